"""A fast read-only traversal that runs every enabled rule in one pass.

`libcst`'s own `visit` rebuilds each node as it goes and costs about as much as the parse
itself; reading the dataclass fields directly costs a tenth of that. The walk also records
each node's parent, which lets rules find the enclosing statement or function of any node
later (for reports made at the end of the module) and lets the applier rebuild only the
path from the root to the nodes it changes.

It also lists the nodes in the order it meets them (source order, parents before children),
which `Context.nodes` and `Context.within` turn into per-type indexes: a rule that needs every
assignment of the file, or every call under one statement, asks the index instead of walking.

The walk is iterative (an explicit stack), so deeply nested generated code cannot exhaust
Python's recursion limit here, and tells nodes from other field values by their exact type
(`isinstance` against LibCST's abstract base classes goes through `ABCMeta.__instancecheck__`,
which is several times slower).
"""

from __future__ import annotations

import dataclasses
import typing
from operator import attrgetter
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import libcst as cst

# Fields that hold only whitespace, comments or punctuation; rules never need to visit them.
_SKIP = {
    "lpar", "rpar", "comma", "semicolon", "leading_lines", "lines_after_decorators",
    "header", "footer", "trailing_whitespace", "newline", "equal", "colon", "dot",
}
_FIELDS: Dict[type, Tuple[str, ...]] = {}
_IS_NODE: Dict[type, bool] = {}
_GETTERS: Dict[type, Optional[Callable[[object], tuple]]] = {}


def child_fields(tp: type) -> Tuple[str, ...]:
    fields = _FIELDS.get(tp)
    if fields is None:
        fields = tuple(
            f.name for f in dataclasses.fields(tp)
            if f.name not in _SKIP and not f.name.startswith("whitespace")
        )
        _FIELDS[tp] = fields
    return fields


def child_nodes(node: cst.CSTNode) -> List[cst.CSTNode]:
    """The node's children that rules may visit, in field order (for rules' own small walks)."""
    tp = type(node)
    getter = _GETTERS.get(tp, _getter)
    if getter is _getter:
        getter = _getter(tp)
    out: List[cst.CSTNode] = []
    if getter is None:
        return out
    is_node = _IS_NODE
    for value in getter(node):
        vt = type(value)
        if vt is tuple or vt is list:
            out.extend(c for c in value if is_node.get(type(c)) or is_node_type(type(c)))
        elif is_node.get(vt) or is_node_type(vt):
            out.append(value)
    return out


def is_node_type(tp: type) -> bool:
    """Whether values of type `tp` are CSTNodes (cached per type)."""
    known = _IS_NODE.get(tp)
    if known is None:
        known = _IS_NODE[tp] = isinstance(tp, type) and issubclass(tp, cst.CSTNode)
    return known


def _getter(tp: type) -> Optional[Callable[[object], tuple]]:
    """A C-level function returning the tuple of a node's child fields that can hold nodes
    (None: no such fields). Fields declared as strings are left out: `Name`, `Integer` and
    `SimpleString`, about a third of all nodes, then have nothing to look at."""
    names = child_fields(tp)
    fields = tuple(f.name for f in dataclasses.fields(tp) if f.name in names and not _is_text(f.type))
    if not fields:
        getter = None
    elif len(fields) == 1:
        one = attrgetter(fields[0])
        getter = lambda node: (one(node),)  # noqa: E731
    else:
        getter = attrgetter(*fields)
    _GETTERS[tp] = getter
    return getter


def _is_text(annotation: object) -> bool:
    """`str`, or a `Literal` of strings (`Arg.star`): a field that never holds a node."""
    return annotation is str or typing.get_origin(annotation) is typing.Literal


Callback = Callable[[cst.CSTNode], None]

_LEAVE = object()  # stack marker: the node below it is finished


def walk(
    module: cst.Module,
    visits: Dict[type, List[Callback]],
    leaves: Dict[type, List[Callback]],
    parents: Dict[cst.CSTNode, cst.CSTNode],
    preorder: Optional[List[cst.CSTNode]] = None,
) -> None:
    """Depth-first walk calling `visits[type]` before and `leaves[type]` after the children
    (children in field order, as LibCST's visitors see them); appends each node to `preorder`."""
    is_node = _IS_NODE
    # type -> (visit callbacks, has leave callbacks, child getter): one lookup per node
    plans: Dict[type, Tuple[Sequence[Callback], bool, Optional[Callable[[object], tuple]]]] = {}
    stack: List[object] = [module]
    push = stack.append
    pop = stack.pop
    seen = (preorder if preorder is not None else []).append
    while stack:
        node = pop()
        if node is _LEAVE:
            node = pop()
            for cb in leaves[type(node)]:
                cb(node)
            continue
        seen(node)
        tp = type(node)
        plan = plans.get(tp)
        if plan is None:
            getter = _GETTERS.get(tp, _getter)
            if getter is _getter:
                getter = _getter(tp)
            plan = plans[tp] = (visits.get(tp, ()), tp in leaves, getter)
        callbacks, leave, getter = plan
        for cb in callbacks:
            cb(node)
        if leave:
            push(node)
            push(_LEAVE)
        if getter is None:
            continue
        # children pushed last-first, so they pop in field order
        for value in reversed(getter(node)):
            vt = type(value)
            if vt is tuple or vt is list:
                for child in reversed(value):
                    ct = type(child)
                    flag = is_node.get(ct)
                    if flag is None:
                        flag = is_node_type(ct)
                    if flag:
                        parents[child] = node
                        push(child)
            else:
                flag = is_node.get(vt)
                if flag is None:
                    flag = is_node_type(vt)
                if flag:
                    parents[value] = node
                    push(value)

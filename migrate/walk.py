"""A fast read-only traversal that runs every enabled rule in one pass.

`libcst`'s own `visit` rebuilds each node as it goes and costs about as much as the parse
itself; reading the dataclass fields directly costs a tenth of that. The walk also records
each node's parent, which lets rules find the enclosing statement or function of any node
later (for reports made at the end of the module) and lets the applier rebuild only the
path from the root to the nodes it changes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Tuple

import libcst as cst

# Fields that hold only whitespace, comments or punctuation; rules never need to visit them.
_SKIP = {
    "lpar", "rpar", "comma", "semicolon", "leading_lines", "lines_after_decorators",
    "header", "footer", "trailing_whitespace", "newline", "equal", "colon", "dot",
}
_FIELDS: Dict[type, Tuple[str, ...]] = {}


def child_fields(tp: type) -> Tuple[str, ...]:
    fields = _FIELDS.get(tp)
    if fields is None:
        fields = tuple(
            f.name for f in dataclasses.fields(tp)
            if f.name not in _SKIP and not f.name.startswith("whitespace")
        )
        _FIELDS[tp] = fields
    return fields


Callback = Callable[[cst.CSTNode], None]


def walk(
    module: cst.Module,
    visits: Dict[type, List[Callback]],
    leaves: Dict[type, List[Callback]],
    parents: Dict[cst.CSTNode, cst.CSTNode],
) -> None:
    """Depth-first walk calling `visits[type]` before and `leaves[type]` after the children."""
    CSTNode = cst.CSTNode

    def go(node: cst.CSTNode) -> None:
        tp = type(node)
        for cb in visits.get(tp, ()):
            cb(node)
        for name in child_fields(tp):
            value = getattr(node, name)
            if isinstance(value, CSTNode):
                parents[value] = node
                go(value)
            elif type(value) is tuple or type(value) is list:
                for child in value:
                    if isinstance(child, CSTNode):
                        parents[child] = node
                        go(child)
        for cb in leaves.get(tp, ()):
            cb(node)

    go(module)

"""`ast.walk`, once per node: the program layer asks for every node of the same trees many
times (each module's imports, its dynamic imports, its `sys.path` edits, its effects, its
calls per function), and `ast.walk` re-creates the walk each time through `iter_child_nodes`
and `iter_fields`, which made walking most of a whole-program build's time. `walk(node)` gives
the same nodes in the same (breadth-first) order, computed once and kept on the node; the trees
are read-only while the program is analysed."""

from __future__ import annotations

import ast
from collections import deque
from typing import Dict, List, Tuple

_FIELDS: Dict[type, Tuple[str, ...]] = {}
_AST = ast.AST


def walk(node: ast.AST) -> List[ast.AST]:
    """`list(ast.walk(node))`, computed once per node."""
    found = node.__dict__.get("_tm_walk")
    if found is not None:
        return found
    out: List[ast.AST] = []
    todo = deque([node])
    pop, push, add = todo.popleft, todo.append, out.append
    fields_of = _FIELDS
    while todo:
        n = pop()
        add(n)
        fields = fields_of.get(type(n))
        if fields is None:
            fields = fields_of[type(n)] = type(n)._fields
        for name in fields:
            value = getattr(n, name, None)
            if isinstance(value, _AST):
                push(value)
            elif type(value) is list:
                for item in value:
                    if isinstance(item, _AST):
                        push(item)
    node.__dict__["_tm_walk"] = out
    return out

"""Line/column of reported nodes, computed only for those nodes.

LibCST's PositionProvider records a range for every node of the module. Findings are few, so
this generates the code once with a codegen state that remembers the token index at which each
wanted node starts, then converts those indices to (line, column) in a single scan.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Optional, Set, Tuple

import libcst as cst
from libcst._nodes.internal import CodegenState


class _MarkingState(CodegenState):
    def __init__(self, wanted: Set[cst.CSTNode], **kwargs) -> None:
        super().__init__(**kwargs)
        self.wanted = wanted
        self.marks: Dict[cst.CSTNode, int] = {}

    def before_codegen(self, node: cst.CSTNode) -> None:
        if node in self.wanted and node not in self.marks:
            self.marks[node] = len(self.tokens)

    @contextmanager
    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        # The syntactic start (after leading comments/whitespace) wins over before_codegen.
        if node in self.wanted:
            self.marks[node] = len(self.tokens)
        yield


def positions(module: cst.Module, nodes: Iterable[cst.CSTNode]) -> Dict[cst.CSTNode, Tuple[int, int]]:
    """Map each node to its 1-based line and 0-based column in `module.code`."""
    wanted = set(nodes)
    if not wanted:
        return {}
    state = _MarkingState(wanted, default_indent=module.default_indent, default_newline=module.default_newline)
    module._codegen(state)
    order = sorted(state.marks.items(), key=lambda kv: kv[1])
    out: Dict[cst.CSTNode, Tuple[int, int]] = {}
    line, col, index = 1, 0, 0
    tokens = state.tokens
    for node, mark in order:
        while index < mark:
            tok = tokens[index]
            newlines = tok.count("\n")
            if newlines:
                line += newlines
                col = len(tok) - tok.rfind("\n") - 1
            else:
                col += len(tok)
            index += 1
        out[node] = (line, col)
    return out


def position_of(module: cst.Module, node: cst.CSTNode) -> Optional[Tuple[int, int]]:
    return positions(module, [node]).get(node)

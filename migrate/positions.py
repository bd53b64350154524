"""Line/column of reported nodes, computed only for those nodes, and fast code generation.

LibCST's PositionProvider records a range for every node of the module. Findings are few, so
this generates the code once with a codegen state that remembers the token index at which each
wanted node starts, then converts those indices to (line, column) by counting newlines in the
joined text between consecutive marks.

The same pass records where each top-level statement starts in the source (a `Layout`), so
after the edits are applied `regenerate` copies the text of every top-level statement the
edits did not touch straight from the original source and generates code only for the
statements that changed: for a typical migration most of the file is copied.

Both use a codegen state whose `record_syntactic_position` returns a shared no-op context
manager instead of building a generator-based one for every node, which makes LibCST's
codegen about a third faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import libcst as cst
from libcst._nodes.internal import CodegenState


class _NullContext:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> bool:
        return False


_NULL = _NullContext()


class _FastState(CodegenState):
    """CodegenState without the per-node generator context manager."""

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        return _NULL


class _MarkingState(_FastState):
    def __init__(self, wanted: Set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.wanted = wanted  # ids of the wanted nodes (id() avoids CSTNode's Python __hash__)
        self.marks: Dict[int, int] = {}

    def before_codegen(self, node: cst.CSTNode) -> None:
        key = id(node)
        if key in self.wanted and key not in self.marks:
            self.marks[key] = len(self.tokens)

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):
        # The syntactic start (after leading comments/whitespace) wins over before_codegen.
        key = id(node)
        if key in self.wanted:
            self.marks[key] = len(self.tokens)
        return _NULL


@dataclass
class Layout:
    """Where the original module's parts lie in its source text (character offsets)."""

    module: cst.Module
    source: str
    header_end: int
    spans: Dict[int, Tuple[int, int]]  # id(top-level statement) -> (start, end)
    footer_start: int


def _module_codegen(module: cst.Module, state: CodegenState, starts: List[int]) -> None:
    """`Module._codegen` with the token index recorded before each top-level statement."""
    state.before_codegen(module)
    for line in module.header:
        line._codegen(state)
    for stmt in module.body:
        starts.append(len(state.tokens))
        stmt._codegen(state)
    starts.append(len(state.tokens))
    for line in module.footer:
        line._codegen(state)
    if module.has_trailing_newline:
        if len(state.tokens) == 0:
            state.add_token(state.default_newline)
    else:
        state.pop_trailing_newline()
    state.after_codegen(module)


def positions_and_layout(
    module: cst.Module, nodes: Iterable[cst.CSTNode], source: Optional[str] = None
) -> Tuple[Dict[cst.CSTNode, Tuple[int, int]], Optional[Layout]]:
    """Map each node to its 1-based line and 0-based column in `module.code`; with `source`
    (the text `module` was parsed from), also the Layout used by `regenerate`."""
    by_id = {id(n): n for n in nodes}
    state = _MarkingState(set(by_id), default_indent=module.default_indent,
                          default_newline=module.default_newline)
    starts: List[int] = []
    _module_codegen(module, state, starts)
    tokens = state.tokens
    out: Dict[cst.CSTNode, Tuple[int, int]] = {}
    line, col, index = 1, 0, 0
    for key, mark in sorted(state.marks.items(), key=lambda kv: kv[1]):
        if mark > index:
            text = "".join(tokens[index:mark])
            newlines = text.count("\n")
            if newlines:
                line += newlines
                col = len(text) - text.rfind("\n") - 1
            else:
                col += len(text)
            index = mark
        out[by_id[key]] = (line, col)
    layout = None
    if source is not None:
        layout = _layout(module, source, tokens, starts)
    return out, layout


def _layout(module: cst.Module, source: str, tokens: List[str], starts: List[int]) -> Optional[Layout]:
    offsets = []
    pos = 0
    prev = 0
    for index in starts:
        pos += sum(map(len, tokens[prev:index]))
        offsets.append(pos)
        prev = index
    total = pos + sum(map(len, tokens[prev:]))
    if total != len(source) or not module.has_trailing_newline:
        return None  # never expected (LibCST round-trips exactly); fall back to full codegen
    spans = {id(stmt): (offsets[i], offsets[i + 1]) for i, stmt in enumerate(module.body)}
    return Layout(module, source, offsets[0], spans, offsets[-1])


def positions(module: cst.Module, nodes: Iterable[cst.CSTNode]) -> Dict[cst.CSTNode, Tuple[int, int]]:
    """Map each node to its 1-based line and 0-based column in `module.code`."""
    nodes = list(nodes)
    if not nodes:
        return {}
    return positions_and_layout(module, nodes)[0]


def position_of(module: cst.Module, node: cst.CSTNode) -> Optional[Tuple[int, int]]:
    return positions(module, [node]).get(node)


def code_for(node: cst.CSTNode, module: cst.Module) -> str:
    """Code of a node as it would appear at the top level of `module` (fast codegen)."""
    state = _FastState(default_indent=module.default_indent, default_newline=module.default_newline)
    node._codegen(state)
    return "".join(state.tokens)


def module_code(module: cst.Module) -> str:
    """`module.code`, faster."""
    state = _FastState(default_indent=module.default_indent, default_newline=module.default_newline)
    module._codegen(state)
    return "".join(state.tokens)


def regenerate(new: cst.Module, layout: Optional[Layout]) -> str:
    """The code of `new`, an edited version of `layout.module`: top-level statements that are
    still the original objects are copied from the original source; the rest is generated."""
    if layout is None:
        return module_code(new)
    old = layout.module
    if (
        new.default_indent != old.default_indent or new.default_newline != old.default_newline
        or not new.has_trailing_newline or not (new.body or new.header or new.footer)
    ):
        return module_code(new)
    source = layout.source
    pieces: List[str] = []
    if _same(new.header, old.header):
        pieces.append(source[: layout.header_end])
    else:
        pieces.extend(code_for(line, new) for line in new.header)
    # `layout.module` keeps the original statements alive, so an id() hit is that very object.
    spans = layout.spans
    for stmt in new.body:
        span = spans.get(id(stmt))
        if span is not None:
            pieces.append(source[span[0]: span[1]])
        else:
            pieces.append(code_for(stmt, new))
    if _same(new.footer, old.footer):
        pieces.append(source[layout.footer_start:])
    else:
        pieces.extend(code_for(line, new) for line in new.footer)
    return "".join(pieces)


def _same(a, b) -> bool:
    return a is b or (len(a) == len(b) and all(x is y for x, y in zip(a, b)))


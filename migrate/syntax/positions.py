"""Line/column of reported nodes, and the code of an edited module, without generating the
code of the whole module.

LibCST's PositionProvider records a range for every node of the module; findings are few. With
a `Layout` (where the original statements lie in the source, from CPython's ast), the position
of a node comes from generating only the statement (or compound statement's header) that
holds it, starting at that statement's known line and stopping once the node is generated.
Without one (no source, or a source the Layout cannot map) the whole module is generated once
with a marking codegen state.

`regenerate` copies the source text of every original statement that the edits left alone
and that is still at the same indentation, at any depth, and generates code only for the rest:
for a typical migration most of the file is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import libcst as cst

from torchmigrate.syntax.codegen import MarkingState, code_for, module_code
from torchmigrate.syntax.layout import UNITS, Layout, Mismatch

__all__ = ["positions_and_layout", "positions", "position_of", "regenerate", "code_for", "module_code"]

Position = Tuple[int, int]


def positions_and_layout(
    module: cst.Module, nodes: Iterable[cst.CSTNode], source: Optional[str] = None,
    parents: Optional[Dict[cst.CSTNode, cst.CSTNode]] = None, lines: Optional[Dict[int, int]] = None,
) -> Tuple[Dict[cst.CSTNode, Position], Optional[Layout]]:
    """Map each node to its 1-based line and 0-based column in `module.code`; with `source`
    (the text `module` was parsed from) and `parents` (every node's parent, as the walk records
    them), also the Layout that lets `regenerate` copy unchanged statements (`lines`: the
    statements' lines where the caller already paired them, see `layout.statement_lines`)."""
    nodes = list(nodes)
    layout = (Layout.build(module, source, parents, lines)
              if source is not None and parents is not None else None)
    if layout is not None:
        try:
            units = _units(layout, nodes)
        except Mismatch:  # a node the walk did not record (the Layout is still sound)
            return _positions_by_module(module, nodes), layout
        try:
            return _positions_by_statement(layout, units), layout
        except Mismatch:
            layout.broken = True
    return _positions_by_module(module, nodes), layout


def positions(module: cst.Module, nodes: Iterable[cst.CSTNode]) -> Dict[cst.CSTNode, Position]:
    """Map each node to its 1-based line and 0-based column in `module.code`."""
    nodes = list(nodes)
    if not nodes:
        return {}
    return _positions_by_module(module, nodes)


def position_of(module: cst.Module, node: cst.CSTNode) -> Optional[Position]:
    return positions(module, [node]).get(node)


def _positions_by_module(module: cst.Module, nodes: List[cst.CSTNode]) -> Dict[cst.CSTNode, Position]:
    """One code generation of the whole module with a marking state."""
    by_id = {id(n): n for n in nodes}
    state = MarkingState(set(by_id), default_indent=module.default_indent,
                         default_newline=module.default_newline)
    module._codegen(state)
    tokens = state.tokens
    out: Dict[cst.CSTNode, Position] = {}
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
    return out


def _units(layout: Layout, nodes: List[cst.CSTNode]) -> Dict[int, Tuple[cst.CSTNode, List[cst.CSTNode]]]:
    """The nodes grouped by the innermost statement or except clause that holds them."""
    groups: Dict[int, Tuple[cst.CSTNode, List[cst.CSTNode]]] = {}
    for node in nodes:
        unit = layout.module if node is layout.module else _unit_of(node, layout.parents)
        groups.setdefault(id(unit), (unit, []))[1].append(node)
    return groups


def _positions_by_statement(layout: Layout, units) -> Dict[cst.CSTNode, Position]:
    """Generate only the statements that hold the nodes, each from its known line."""
    out: Dict[cst.CSTNode, Position] = {}
    for unit, members in units.values():
        if unit is layout.module:
            out[unit] = (1, 0)  # where the whole-module codegen marks it
            continue
        indent = layout.indent_of(unit)
        state = layout.generate(unit, {id(n) for n in members}, indent)
        marks = state.marks
        offsets = _char_offsets(state.tokens, marks.values())
        text = "".join(state.tokens[:max(marks.values())])  # all that the positions depend on
        anchor = offsets[marks[id(unit)]]
        layout.locate(unit, text, anchor, indent)  # `text` starts a line of the source
        line = layout.line_of(unit)
        for node in members:
            mark = marks.get(id(node))
            if mark is None:
                raise Mismatch("node not generated by its statement")
            offset = offsets[mark]
            if offset >= anchor:
                row = line + text.count("\n", anchor, offset)
            else:
                row = line - text.count("\n", offset, anchor)
            out[node] = (row, offset - text.rfind("\n", 0, offset) - 1)
    return out


def _unit_of(node: cst.CSTNode, parents: Dict[cst.CSTNode, cst.CSTNode]) -> cst.CSTNode:
    """The innermost statement or except clause that holds `node`."""
    while type(node) not in UNITS:
        node = parents.get(node)
        if node is None:
            raise Mismatch("not in the module")
    return node


def _char_offsets(tokens: List[str], marks: Iterable[int]) -> Dict[int, int]:
    """Character offset in "".join(tokens) of each token index in `marks`."""
    out: Dict[int, int] = {}
    offset = index = 0
    for mark in sorted(set(marks)):
        offset += sum(map(len, tokens[index:mark]))
        index = mark
        out[mark] = offset
    return out


# --- regenerate --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Verbatim(cst.BaseStatement):
    """An original statement's source text, copied instead of generated."""

    text: str

    def _visit_and_replace_children(self, visitor) -> "_Verbatim":
        return self

    def _codegen_impl(self, state) -> None:
        state.add_token(self.text)


# Fields that hold the clauses and blocks of compound statements (and of the clauses).
_CLAUSE_FIELDS = ("body", "orelse", "handlers", "finalbody", "cases")


def regenerate(new: cst.Module, layout: Optional[Layout]) -> str:
    """The code of `new`, an edited version of `layout.module`: original statements still at
    their original indentation are copied from the source; the rest is generated."""
    old = layout.module if layout is not None else None
    if (
        old is None or layout.broken or new.default_indent != old.default_indent
        or new.default_newline != old.default_newline or not new.has_trailing_newline
    ):
        return module_code(new)
    try:
        body = _Copier(layout).statements(new.body, "")
    except Mismatch:
        layout.broken = True
        return module_code(new)
    return module_code(new.with_changes(body=body))


class _Copier:
    """Rebuilds the edited parts of a module with each copyable statement as a _Verbatim."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def statements(self, body, indent: str):
        """`body` with each run of copyable statements as one _Verbatim (`body` itself if
        nothing could be copied)."""
        layout = self.layout
        out = []
        i = 0
        while i < len(body):
            stmt = body[i]
            place = layout.place(stmt)
            if place is None:  # new, or a clause (except, case): copy what is inside
                out.append(self.clauses(stmt, indent))
                i += 1
                continue
            if layout.indent_of(stmt) != indent:
                out.append(stmt)  # moved: all of it is generated with its new indentation
                i += 1
                continue
            owner, first = place
            run = _common_run(body, i, owner.body, first)
            if first + run == len(owner.body):
                run -= 1  # nothing marks where an original body's last statement ends
            if run:
                out.append(_Verbatim(layout.text(stmt, owner.body[first + run])))
                i += run
            else:
                out.append(self.clauses(stmt, indent))
                i += 1
        return body if len(out) == len(body) and all(a is b for a, b in zip(out, body)) else out

    def clauses(self, node: cst.CSTNode, indent: str) -> cst.CSTNode:
        """`node` (a compound statement or clause) with its blocks' statements copied."""
        changes = {}
        for name in _CLAUSE_FIELDS:
            value = getattr(node, name, None)
            if value is None:
                continue
            if isinstance(value, cst.IndentedBlock):
                body = self.statements(value.body, indent + self.layout.level(value))
                new = value if body is value.body else value.with_changes(body=body)
            elif isinstance(value, (cst.Else, cst.Finally, cst.If)):
                new = self.clauses(value, indent)
            elif name == "handlers":
                new = self.statements(value, indent)  # except clauses: as new statements
            elif name == "cases":
                new = self.statements(value, indent + self.layout.level(node))
            else:
                continue
            if new is not value:
                changes[name] = new
        return node.with_changes(**changes) if changes else node


def _common_run(new: list, i: int, old: list, j: int) -> int:
    """How many statements from new[i] on are old[j], old[j + 1], ... (by identity)."""
    run = 0
    while i + run < len(new) and j + run < len(old) and new[i + run] is old[j + run]:
        run += 1
    return run

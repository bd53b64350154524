"""Where the statements of a parsed module lie in its source text, without generating its code.

LibCST keeps no positions. CPython's own parser (`ast.parse`, under a tenth of a LibCST parse)
gives the line of every statement; walking the two trees' statement lists side by side pairs
each LibCST statement (and except clause) with its ast node, whose line is all that is kept
(a LibCST `SimpleStatementLine` holds one ast statement per `;`-separated part; an `elif` is
an If in both trees' `orelse`). A statement's code starts with its leading blank and comment
lines (and decorators), then the indentation of its blocks, then its first token, which is
where the ast statement starts: so it starts that prefix's length before the indentation on
the ast line. The prefix is assembled from the leading lines, or generated when there are
decorators, and checked against the source there.

Every answer is checked: when the trees do not pair up there is no Layout; when a text does
not match the source where it should, callers mark the Layout `broken` and generate the whole
module instead. Files with lone carriage-return newlines are not mapped at all (ast counts
them as line breaks; the engine's line numbers count only "\\n").
"""

from __future__ import annotations

import ast
import re
from typing import Dict, List, Optional, Tuple

import libcst as cst

from torchmigrate.syntax.codegen import Done, PartialState

# LibCST compound statement -> the ast node types it parses to.
_COMPOUND = {
    cst.If: (ast.If,), cst.For: (ast.For, ast.AsyncFor), cst.While: (ast.While,),
    cst.Try: (ast.Try,), cst.TryStar: (ast.TryStar,), cst.With: (ast.With, ast.AsyncWith),
    cst.FunctionDef: (ast.FunctionDef, ast.AsyncFunctionDef), cst.ClassDef: (ast.ClassDef,),
    cst.Match: (ast.Match,),
}
_AST_COMPOUND = tuple(t for types in _COMPOUND.values() for t in types)
_HANDLERS = (cst.ExceptHandler, cst.ExceptStarHandler)
_INDENTING = (cst.IndentedBlock, cst.Match)  # the nodes whose codegen adds indentation
# Nodes whose position is known from the ast: statements and except clauses (exact types:
# isinstance against LibCST's abstract classes is slow).
UNITS = frozenset((cst.SimpleStatementLine, *_COMPOUND, *_HANDLERS))


class Mismatch(Exception):
    """The LibCST and ast trees, or the generated text and the source, do not agree."""


class Layout:
    """Start offsets of the original module's statements, computed on demand."""

    def __init__(self, module: cst.Module, source: str, lines: Dict[int, int],
                 parents: Dict[cst.CSTNode, cst.CSTNode]) -> None:
        self.module = module
        self.source = source
        self.parents = parents
        self.broken = False  # set by callers when an answer turned out inconsistent
        self.line_starts = [0] + [m.end() for m in re.finditer("\n", source)]
        self._lines = lines  # id(statement or except clause) -> line of its first token
        self._inside: Dict[int, str] = {id(module): ""}  # id(block) -> indentation inside it
        self._starts: Dict[int, int] = {}  # id(statement) -> offset of its code in the source
        self._order: Dict[int, Dict[int, int]] = {}  # id(body owner) -> id(statement) -> index

    @classmethod
    def build(cls, module: cst.Module, source: str, parents: Dict[cst.CSTNode, cst.CSTNode],
              lines: Optional[Dict[int, int]] = None) -> Optional["Layout"]:
        """The Layout of `module`, parsed from `source`; None when it cannot be mapped.
        `lines` is `statement_lines(module, ast.parse(source))` where the caller has it."""
        if "\r" in source and source.count("\r") != source.count("\r\n"):
            return None
        if lines is None:
            try:
                lines = statement_lines(module, ast.parse(source))
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                return None
        return None if lines is None else cls(module, source, lines, parents)

    def line_of(self, unit: cst.CSTNode) -> int:
        """The line of the first token of a statement or except clause."""
        line = self._lines.get(id(unit))
        if line is None:
            raise Mismatch("not a statement of the module")
        return line

    # --- indentation and start offsets -------------------------------------------------------

    def indent_of(self, node: cst.CSTNode) -> str:
        """The indentation LibCST generates before a statement's or clause's lines: one level
        for each IndentedBlock around it, and one for the cases of a `match`."""
        parent = self.parents.get(node)
        while parent is not None and type(parent) not in _INDENTING and parent is not self.module:
            parent = self.parents.get(parent)
        if parent is None:
            raise Mismatch("not in the module")
        return self._indent_inside(parent)

    def _indent_inside(self, owner) -> str:
        known = self._inside.get(id(owner))
        if known is None:
            known = self._inside[id(owner)] = self.indent_of(owner) + self.level(owner)
        return known

    def level(self, owner) -> str:
        """The indentation an IndentedBlock or Match adds."""
        return self.module.default_indent if owner.indent is None else owner.indent

    def generate(self, unit: cst.CSTNode, wanted, indent: str) -> PartialState:
        """Generate `unit`'s code, as in the whole module, up to its first token and `wanted`."""
        state = PartialState(unit, wanted, default_indent=self.module.default_indent,
                             default_newline=self.module.default_newline)
        if indent:
            state.indent_tokens.append(indent)
        parent = self.parents.get(unit)
        try:
            if type(unit) is cst.If and type(parent) is cst.If and parent.orelse is unit:
                unit._codegen(state, is_elif=True)
            else:
                unit._codegen(state)
        except Done:
            pass
        if not state.anchored:
            raise Mismatch("no syntactic start")
        return state

    def locate(self, unit: cst.CSTNode, text: str, anchor: int, indent: str) -> int:
        """Where `text`, the start of `unit`'s code whose first token is at offset `anchor` in
        it, starts in the source; checks that the source there is `text`, after a newline."""
        line = self.line_of(unit)
        if line > len(self.line_starts):
            raise Mismatch("line out of range")
        start = self.line_starts[line - 1] + len(indent) - anchor
        source = self.source
        if start < 0 or not source.startswith(text, start) or (start and source[start - 1] != "\n"):
            raise Mismatch("generated text differs from the source")
        return start

    def start(self, stmt: cst.BaseStatement) -> int:
        """Offset in the source where the original statement's code (leading lines first) begins."""
        known = self._starts.get(id(stmt))
        if known is None:
            indent = self.indent_of(stmt)
            if getattr(stmt, "decorators", None) or getattr(stmt, "lines_after_decorators", None):
                prefix = "".join(self.generate(stmt, set(), indent).tokens)
            else:  # the common case, without the codegen machinery (`locate` checks the text)
                newline = self.module.default_newline
                prefix = "".join([_empty_line(line, indent, newline) for line in stmt.leading_lines]) + indent
            known = self._starts[id(stmt)] = self.locate(stmt, prefix, len(prefix), indent)
        return known

    def place(self, stmt: cst.CSTNode) -> Optional[Tuple[object, int]]:
        """(owner, index) of an original statement of a Module or IndentedBlock body, where
        `owner.body[index] is stmt`; None for any other node (new ones included)."""
        owner = self.parents.get(stmt)
        if type(owner) is not cst.IndentedBlock and owner is not self.module:
            return None
        order = self._order.get(id(owner))
        if order is None:
            order = self._order[id(owner)] = {id(s): i for i, s in enumerate(owner.body)}
        index = order.get(id(stmt))
        return None if index is None or owner.body[index] is not stmt else (owner, index)

    def text(self, first: cst.BaseStatement, stop: cst.BaseStatement) -> str:
        """The source text from original statement `first` up to original statement `stop`."""
        return self.source[self.start(first): self.start(stop)]


def statement_lines(module: cst.Module, tree: ast.Module) -> Optional[Dict[int, int]]:
    """id(statement or except clause of `module`) -> the line of its first token, from CPython's
    tree of the same source; None when the two trees do not pair up. Only these lines are kept,
    so the caller can drop the ast tree at once (it is large for large files)."""
    lines: Dict[int, int] = {}
    try:
        _pair_body(module.body, tree.body, lines)
    except (RecursionError, Mismatch):
        return None
    return lines


def _empty_line(line: cst.EmptyLine, indent: str, newline: str) -> str:
    """The code LibCST generates for an EmptyLine."""
    comment = line.comment
    return "".join((
        indent if line.indent else "", line.whitespace.value, "" if comment is None else comment.value,
        newline if line.newline.value is None else line.newline.value,
    ))


def _pair_body(statements, nodes: List[ast.stmt], lines: Dict[int, int]) -> None:
    """Record the line of each statement of a LibCST body, from the matching ast body."""
    k = 0
    for stmt in statements:
        if k >= len(nodes):
            raise Mismatch("fewer ast statements")
        node = nodes[k]
        lines[id(stmt)] = node.lineno
        if type(stmt) is cst.SimpleStatementLine:
            if isinstance(node, _AST_COMPOUND):
                raise Mismatch("simple statement")
            k += len(stmt.body)
        else:
            _pair_compound(stmt, node, lines)
            k += 1
    if k != len(nodes):
        raise Mismatch("more ast statements")


def _pair_compound(stmt: cst.CSTNode, node: ast.stmt, lines: Dict[int, int]) -> None:
    if type(node) not in _COMPOUND.get(type(stmt), ()):
        raise Mismatch(type(stmt).__name__)
    if type(stmt) is not cst.Match:
        _pair_block(stmt.body, node.body, lines)
    orelse = getattr(stmt, "orelse", None)
    if type(orelse) is cst.If:  # elif: one ast If in `orelse`
        if len(node.orelse) != 1:
            raise Mismatch("elif")
        lines[id(orelse)] = node.orelse[0].lineno
        _pair_compound(orelse, node.orelse[0], lines)
    elif orelse is not None:
        _pair_block(orelse.body, node.orelse, lines)
    if type(stmt) in (cst.Try, cst.TryStar):
        if len(stmt.handlers) != len(node.handlers):
            raise Mismatch("except clauses")
        for handler, ast_handler in zip(stmt.handlers, node.handlers):
            lines[id(handler)] = ast_handler.lineno
            _pair_block(handler.body, ast_handler.body, lines)
        if stmt.finalbody is not None:
            _pair_block(stmt.finalbody.body, node.finalbody, lines)
    elif type(stmt) is cst.Match:
        if len(stmt.cases) != len(node.cases):
            raise Mismatch("match cases")
        for case, ast_case in zip(stmt.cases, node.cases):
            _pair_block(case.body, ast_case.body, lines)


def _pair_block(suite: cst.BaseSuite, nodes: List[ast.stmt], lines: Dict[int, int]) -> None:
    if type(suite) is cst.IndentedBlock:
        _pair_body(suite.body, nodes, lines)
    elif len(nodes) != len(suite.body):  # `if x: a; b` holds no statement lines
        raise Mismatch("one-line suite")

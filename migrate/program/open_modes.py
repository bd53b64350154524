"""Modes of `open(...)` calls that a literal does not show: a variable chosen from literals.

`open_type = "a" if os.path.exists(log) else "w"; self.log_file = open(log, open_type)` writes
a file as surely as `open(log, "w")`: the mode is one of the literals the variable was ever given.
A module's names assigned only string literals (or conditional expressions of them) map to every
character those literals hold; a name also assigned anything else is unknown and left out. Both
trees the tool reads (LibCST for the rules, `ast` for the program's effects) ask the same question,
so both forms are here.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Dict, Iterable, Optional

from torchmigrate.program.search_path import dotted_name

if TYPE_CHECKING:  # the program build reads `ast` only: a warm lint run never imports LibCST
    import libcst as cst

WRITING = frozenset("wax+")


def _literal_chars_ast(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) <= 3:
        return node.value
    if isinstance(node, ast.IfExp):
        body, orelse = _literal_chars_ast(node.body), _literal_chars_ast(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _literal_chars_cst(node: "cst.BaseExpression") -> Optional[str]:
    import libcst as cst

    from torchmigrate.syntax.nodes import string_value

    value = string_value(node)
    if value is not None:
        return value if len(value) <= 3 else None
    if isinstance(node, cst.IfExp):
        body, orelse = _literal_chars_cst(node.body), _literal_chars_cst(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _merge(found: Dict[str, Optional[str]], name: str, chars: Optional[str]) -> None:
    if name in found and found[name] is None:
        return
    found[name] = None if chars is None else (found.get(name) or "") + chars


def mode_names_ast(tree: ast.AST) -> Dict[str, str]:
    """Names (`mode`, `self.open_type`) of `tree` assigned only short string literals, each with
    the characters of all its literals."""
    found: Dict[str, Optional[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                name = dotted_name(target)
                if name is not None:
                    _merge(found, name, _literal_chars_ast(node.value))
    return {k: v for k, v in found.items() if v}


def mode_names_cst(nodes: Iterable["cst.Assign"]) -> Dict[str, str]:
    """The same for the assignments of a LibCST module."""
    from torchmigrate.syntax.imports import dotted  # (LibCST only where the rules run)

    found: Dict[str, Optional[str]] = {}
    for node in nodes:
        for target in node.targets:
            name = dotted(target.target)
            if name is not None:
                _merge(found, name, _literal_chars_cst(node.value))
    return {k: v for k, v in found.items() if v}


def _joined(parts, of) -> Optional[str]:
    """The characters of a mode built by concatenation (`mode + self.file_flags`, `"w" + "b"`):
    the known parts' characters where they include a writing one (whatever the rest adds, the
    file is written), else where every part is known; None otherwise."""
    found = [of(part) for part in parts]
    known = "".join(c for c in found if c is not None)
    return known if None not in found or writes(known) else None


def mode_of_ast(mode: Optional[ast.AST], names: Optional[Dict[str, str]]) -> Optional[str]:
    """The characters `mode` (a literal, a conditional of literals, a name of `names`, or a
    concatenation of those) may hold."""
    if mode is None:
        return None
    if isinstance(mode, ast.BinOp) and isinstance(mode.op, ast.Add):
        return _joined((mode.left, mode.right), lambda part: mode_of_ast(part, names))
    chars = _literal_chars_ast(mode)
    if chars is None and names:
        name = dotted_name(mode)
        chars = names.get(name) if name is not None else None
    return chars


def mode_of_cst(mode: Optional["cst.BaseExpression"], names: Optional[Dict[str, str]]) -> Optional[str]:
    from torchmigrate.syntax.imports import dotted

    import libcst as cst

    if mode is None:
        return None
    if isinstance(mode, cst.BinaryOperation) and isinstance(mode.operator, cst.Add):
        return _joined((mode.left, mode.right), lambda part: mode_of_cst(part, names))
    chars = _literal_chars_cst(mode)
    if chars is None and names:
        name = dotted(mode)
        chars = names.get(name) if name is not None else None
    return chars


def writes(chars: Optional[str]) -> bool:
    return chars is not None and bool(set(chars) & WRITING)


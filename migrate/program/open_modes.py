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


# what a file handle is written with: its own methods, and calls that take it as where to write
_HANDLE_WRITES = frozenset({"write", "writelines"})
_WRITES_INTO = frozenset({"json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump", "csv.writer",
                          "csv.DictWriter", "np.save", "numpy.save", "np.savetxt", "numpy.savetxt", "torch.save"})


def mode_names_ast(tree: ast.AST) -> Dict[str, str]:
    """Names (`mode`, `self.open_type`) of `tree` assigned only short string literals, each with
    the characters of all its literals; and a mode no literal shows (`self.mode`, set from a
    constructor's argument) where a handle opened with it is written in the module (`with
    open(self.filepath, self.mode) as f: f.write(line)`): a writing mode, whatever it holds."""
    found: Dict[str, Optional[str]] = {}
    withs = []  # (one walk of the module: the program build reads every module)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                name = dotted_name(target)
                if name is not None:
                    _merge(found, name, _literal_chars_ast(node.value))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            withs.append(node)
    out = {k: v for k, v in found.items() if v}
    uses: Dict[str, bool] = {}
    for node in withs:
        for item in node.items:
            handle = dotted_name(item.optional_vars) if item.optional_vars is not None else None
            mode = _mode_arg_ast(item.context_expr)
            name = dotted_name(mode) if mode is not None else None
            if handle and name and name not in out:
                uses[name] = uses.get(name, True) and _written_ast(node.body, handle)
    return {**out, **_written_modes(uses)}


def _written_modes(uses: Dict[str, bool]) -> Dict[str, str]:
    """Mode names whose every handle is written (a name also used for a handle that is only
    read, a parameter of the same name in another function, stays unknown: guarding a read
    would starve the other ranks)."""
    return {name: "w" for name, written in uses.items() if written}


def _mode_arg_ast(call: ast.AST) -> Optional[ast.AST]:
    """The mode argument of `open(path, mode)` / `open(path, mode=...)`, else None."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "open"):
        return None
    for k in call.keywords:
        if k.arg == "mode":
            return k.value
    return call.args[1] if len(call.args) >= 2 else None


def _written_ast(body, handle: str) -> bool:
    """`handle.write(...)`, `print(..., file=handle)`, `json.dump(x, handle)` in `body`."""
    for statement in body:
        for node in ast.walk(statement):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _HANDLE_WRITES and dotted_name(func.value) == handle:
                return True
            if any(k.arg == "file" and dotted_name(k.value) == handle for k in node.keywords):
                return True
            if dotted_name(func) in _WRITES_INTO and any(dotted_name(a) == handle for a in node.args):
                return True
    return False


def mode_names_cst(nodes: Iterable["cst.Assign"], withs: Iterable["cst.With"] = ()) -> Dict[str, str]:
    """The same for the assignments (and `with` statements) of a LibCST module."""
    import libcst as cst

    from torchmigrate.syntax.imports import dotted  # (LibCST only where the rules run)

    found: Dict[str, Optional[str]] = {}
    for node in nodes:
        for target in node.targets:
            name = dotted(target.target)
            if name is not None:
                _merge(found, name, _literal_chars_cst(node.value))
    out = {k: v for k, v in found.items() if v}
    uses: Dict[str, bool] = {}
    for node in withs:
        for item in node.items:
            call = item.item
            if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "open"
                    and item.asname is not None):
                continue
            mode = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "mode"), None)
            if mode is None and len(call.args) >= 2 and call.args[1].keyword is None:
                mode = call.args[1].value
            name = dotted(mode) if mode is not None else None
            handle = dotted(item.asname.name)
            if handle and name and name not in out:
                uses[name] = uses.get(name, True) and _written_cst(node.body, handle)
    return {**out, **_written_modes(uses)}


def _written_cst(body: "cst.CSTNode", handle: str) -> bool:
    import libcst as cst

    from torchmigrate.syntax.imports import dotted

    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Call):
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in _HANDLE_WRITES and dotted(func.value) == handle:
                return True
            if any(a.keyword is not None and a.keyword.value == "file" and dotted(a.value) == handle for a in node.args):
                return True
            if dotted(func) in _WRITES_INTO and any(a.keyword is None and dotted(a.value) == handle for a in node.args):
                return True
        stack.extend(node.children)
    return False


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


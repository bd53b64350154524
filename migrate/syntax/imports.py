"""Name resolution from the module's own import statements.

LibCST's QualifiedNameProvider costs several times the parse on real scripts. Training
scripts bind library names almost exclusively through imports, so a table built from the
import statements (at any depth, statements only) resolves `nn.DataParallel`,
`ac(...)` after `from torch.cuda.amp import autocast as ac`, or `DL` for `DataLoader as DL`
to the same qualified names at a fraction of the cost.
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import libcst as cst

# A vendored copy of the runtime is the same API under another module name.
_CANONICAL = {"torchmigrate_runtime": "torchmigrate.runtime"}


def dotted(node: cst.BaseExpression) -> Optional[str]:
    """`a.b.c` for a Name/Attribute chain, None for anything else.

    The most called helper of all (every rule asks it about most names): exact type tests,
    because `isinstance` against LibCST's classes goes through `ABCMeta.__instancecheck__`."""
    tp = type(node)
    if tp is _NAME:
        return node.value  # type: ignore[attr-defined]
    parts = []
    while tp is _ATTRIBUTE:
        parts.append(node.attr.value)  # type: ignore[attr-defined]
        node = node.value  # type: ignore[attr-defined]
        tp = type(node)
    if tp is not _NAME:
        return None
    parts.append(node.value)  # type: ignore[attr-defined]
    parts.reverse()
    return ".".join(parts)


_NAME, _ATTRIBUTE = cst.Name, cst.Attribute
_LINES = (cst.SimpleStatementLine, cst.SimpleStatementSuite)
_IMPORTS = (cst.Import, cst.ImportFrom)


def _module_name(node: Optional[cst.BaseExpression]) -> str:
    return dotted(node) if node is not None else ""


def iter_statements(body) -> Iterator[cst.CSTNode]:
    """Every statement in a block, recursing into compound statements (never into expressions).

    One-line suites (`if x: import y`) are yielded as the SimpleStatementSuite itself.
    """
    for stmt in body:
        yield stmt
        # most statements are lines: skip them before the (slow, abstract) isinstance test
        if type(stmt) is not cst.SimpleStatementLine and isinstance(stmt, cst.BaseCompoundStatement):
            blocks = [getattr(stmt, "body", None), getattr(stmt, "orelse", None), getattr(stmt, "finalbody", None)]
            blocks += list(getattr(stmt, "handlers", ())) + list(getattr(stmt, "cases", ()))
            for block in blocks:
                yield from _suite(block)


def _suite(block) -> Iterator[cst.CSTNode]:
    if block is None:
        return
    if isinstance(block, cst.BaseCompoundStatement):  # an `elif` chain
        yield from iter_statements([block])
    elif isinstance(block, cst.IndentedBlock):
        yield from iter_statements(block.body)
    elif isinstance(block, cst.SimpleStatementSuite):
        yield block
    else:  # Else, Finally, ExceptHandler, MatchCase: a wrapper around a suite
        yield from _suite(block.body)


# After `from project.models import *`, these names almost always come through the star import
# (project modules re-export torch), so they resolve as the usual torch spellings.
_STAR_FALLBACK = {"torch": "torch", "nn": "torch.nn", "F": "torch.nn.functional", "optim": "torch.optim"}


class ImportTable:
    """Maps local names to qualified names (`nn` -> `torch.nn`)."""

    def __init__(self) -> None:
        self.names: Dict[str, str] = {}
        self.import_statements = []
        self.star_modules: List[str] = []

    @classmethod
    def from_module(cls, module: cst.Module) -> "ImportTable":
        table = cls()
        for stmt in iter_statements(module.body):  # exact type tests: this sees every statement
            if type(stmt) in _LINES:
                for small in stmt.body:  # type: ignore[attr-defined]
                    if type(small) in _IMPORTS:
                        table.add(small)
                        table.import_statements.append(stmt)
        return table

    def add(self, node) -> None:
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = _CANONICAL.get(_module_name(alias.name), _module_name(alias.name))
                if alias.asname is not None:
                    self.names[alias.asname.name.value] = full
                else:
                    head = full.split(".")[0]
                    self.names.setdefault(head, head)
        elif isinstance(node, cst.ImportFrom) and not node.relative:
            module = _module_name(node.module)
            if isinstance(node.names, cst.ImportStar):
                self.star_modules.append(module)
                return
            for alias in node.names:
                name = _module_name(alias.name)
                local = alias.asname.name.value if alias.asname is not None else name
                full = f"{module}.{name}" if module else name
                self.names[local] = _CANONICAL.get(full, full)

    def resolve(self, node: cst.BaseExpression) -> Optional[str]:
        """Qualified name of a Name/Attribute chain whose head is imported, else None.

        Called for most names rules see: it finds the head before joining any text, since
        most chains (`self.model.train`, `args.lr`) start with a name that is not imported."""
        parts = []
        tp = type(node)
        while tp is _ATTRIBUTE:
            parts.append(node.attr.value)  # type: ignore[attr-defined]
            node = node.value  # type: ignore[attr-defined]
            tp = type(node)
        if tp is not _NAME:
            return None
        head = node.value  # type: ignore[attr-defined]
        base = self.names.get(head)
        if base is None:
            base = self._from_star(head)
            if base is None:
                return None
        if not parts:
            return base
        parts.append(base)
        parts.reverse()
        return ".".join(parts)

    def _from_star(self, head: str) -> Optional[str]:
        if not self.star_modules:
            return None
        torch_star = next((m for m in self.star_modules if m == "torch" or m.startswith("torch.")), None)
        if torch_star is not None and head not in _STAR_FALLBACK:
            return f"{torch_star}.{head}"  # `from torch.utils.data import *` then `DataLoader`
        return _STAR_FALLBACK.get(head)

    def alias_for(self, qualified: str) -> Optional[str]:
        """The local name bound to exactly `qualified`, if the module imports it."""
        for local, full in self.names.items():
            if full == qualified:
                return local
        return None

    def imports_module(self, prefix: str) -> bool:
        """True if anything imported comes from `prefix` (e.g. `apex`)."""
        return any(full == prefix or full.startswith(prefix + ".") for full in self.names.values())


def is_import_line(stmt: cst.CSTNode) -> bool:
    """A line of import statements only."""
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def leading_import_anchor(module: cst.Module) -> Optional[cst.CSTNode]:
    """The last line of the module's first run of top-level import lines.

    New imports and a top-level `tm.setup()` go right after it: later imports may follow code
    that already uses the runtime (`loader = DataLoader(...)` between two import blocks), so
    "after the last import" can be too late. Without imports: the docstring, or None.
    """
    anchor = None
    for stmt in module.body:
        if is_import_line(stmt):
            anchor = stmt
        elif anchor is not None:
            break
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
    if anchor is None and module.body and _is_docstring(module.body[0]):
        return module.body[0]
    return anchor


def new_import_anchor(module: cst.Module) -> Optional[cst.CSTNode]:
    """Where the engine adds imports: after the first run of import lines (`leading_import_anchor`),
    unless code comes before that run (`device = "cuda"` above `import torch` in a settings
    module): a rewrite of that code (`device = tm.device()`) would run before an import placed
    below it, so the imports go after the docstring, or first. (No `from __future__` import can
    follow such code, so the top is always a valid place.)"""
    for stmt in module.body:
        if is_import_line(stmt) or isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if not _is_docstring(stmt) or stmt is not module.body[0]:
            return module.body[0] if _is_docstring(module.body[0]) else None
    return leading_import_anchor(module)


def last_import_before_defs(module: cst.Module) -> Optional[cst.CSTNode]:
    """The last top-level import line before the module's first def or class (unlike
    `leading_import_anchor`, past code between import blocks), or None."""
    anchor = None
    for stmt in module.body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if is_import_line(stmt):
            anchor = stmt
    return anchor

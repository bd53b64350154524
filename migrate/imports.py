"""Name resolution from the module's own import statements.

LibCST's QualifiedNameProvider costs several times the parse on real scripts. Training
scripts bind library names almost exclusively through imports, so a table built from the
import statements (at any depth, statements only) resolves `nn.DataParallel`,
`ac(...)` after `from torch.cuda.amp import autocast as ac`, or `DL` for `DataLoader as DL`
to the same qualified names at a fraction of the cost.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import libcst as cst

# A vendored copy of the runtime is the same API under another module name.
_CANONICAL = {"torchmigrate_runtime": "torchmigrate.runtime"}


def dotted(node: cst.BaseExpression) -> Optional[str]:
    """`a.b.c` for a Name/Attribute chain, None for anything else."""
    parts = []
    while isinstance(node, cst.Attribute):
        parts.append(node.attr.value)
        node = node.value
    if not isinstance(node, cst.Name):
        return None
    parts.append(node.value)
    return ".".join(reversed(parts))


def _module_name(node: Optional[cst.BaseExpression]) -> str:
    return dotted(node) if node is not None else ""


def iter_statements(body) -> Iterator[cst.CSTNode]:
    """Every statement in a block, recursing into compound statements (never into expressions).

    One-line suites (`if x: import y`) are yielded as the SimpleStatementSuite itself.
    """
    for stmt in body:
        yield stmt
        if isinstance(stmt, cst.BaseCompoundStatement):
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


class ImportTable:
    """Maps local names to qualified names (`nn` -> `torch.nn`)."""

    def __init__(self) -> None:
        self.names: Dict[str, str] = {}
        self.import_statements = []

    @classmethod
    def from_module(cls, module: cst.Module) -> "ImportTable":
        table = cls()
        for stmt in iter_statements(module.body):
            if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                for small in stmt.body:
                    if isinstance(small, (cst.Import, cst.ImportFrom)):
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
                return
            for alias in node.names:
                name = _module_name(alias.name)
                local = alias.asname.name.value if alias.asname is not None else name
                full = f"{module}.{name}" if module else name
                self.names[local] = _CANONICAL.get(full, full)

    def resolve(self, node: cst.BaseExpression) -> Optional[str]:
        """Qualified name of a Name/Attribute chain whose head is imported, else None."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        base = self.names.get(head)
        if base is None:
            return None
        return f"{base}.{rest}" if rest else base

    def alias_for(self, qualified: str) -> Optional[str]:
        """The local name bound to exactly `qualified`, if the module imports it."""
        for local, full in self.names.items():
            if full == qualified:
                return local
        return None

    def imports_module(self, prefix: str) -> bool:
        """True if anything imported comes from `prefix` (e.g. `apex`)."""
        return any(full == prefix or full.startswith(prefix + ".") for full in self.names.values())

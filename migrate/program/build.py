"""From the paths a command was given to the programs they make up (see `graph`, `facts`)."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

from torchmigrate.program import facts, graph
from torchmigrate.program.view import ModuleView


@dataclass
class Program:
    """Every file to process, the entry points among them, and each module's view."""

    files: List[Path]
    entries: List[Path] = field(default_factory=list)
    followed: List[Path] = field(default_factory=list)  # files found through imports only
    views: Dict[str, ModuleView] = field(default_factory=dict)
    # files that import each other, directly or not: each group is written whole or not at all
    groups: List[List[str]] = field(default_factory=list)


def build(found: Sequence[Path], named: Sequence[Path], follow: bool = True,
          exclude: Optional[callable] = None) -> Program:
    """`found`: the files discovered from the command line; `named`: those given by name.

    Entry points are the files given by name and, in folders, files with a `__main__` guard
    or that no other file of the run imports. With `follow`, the project modules the entries
    import (transitively) join the run. `exclude(path)` drops followed files that the
    configuration excludes.
    """
    trees: Dict[Path, ast.Module] = {}
    resolved = {Path(_real(p)): p for p in found}
    named_set = {Path(_real(p)) for p in named}
    program = Program(list(found))
    start = graph.build(resolved, trees)
    imported: Set[Path] = {f for deps in start.imports.values() for f in deps}
    entries = []
    for path in resolved:
        tree = trees.get(path)
        if path in named_set or (tree is not None and (graph.has_main_guard(tree) or path not in imported)):
            entries.append(path)
    program.entries = entries
    if not follow:
        return program
    absolute = any(Path(p).is_absolute() for p in found)
    for path in start.modules:
        if path not in resolved and (exclude is None or not exclude(path)):
            program.followed.append(path)
            program.files.append(path if absolute else Path(graph.relpath(path)))
    views = facts.compute(start, trees, entries)
    program.views = {str(p): v for p, v in views.items()}
    program.groups = _connected(start)
    return program


def _real(path) -> str:
    try:
        return os.path.realpath(path)
    except OSError:
        return os.path.abspath(path)


def _connected(g: graph.Graph) -> List[List[str]]:
    """The modules in groups connected by imports (either direction)."""
    parent = {m: m for m in g.modules}

    def root(m):
        while parent[m] is not m:
            parent[m] = parent[parent[m]]
            m = parent[m]
        return m

    for m, deps in g.imports.items():
        for d in deps:
            if d in parent:
                parent[root(d)] = root(m)
    groups: Dict[Path, List[str]] = {}
    for m in g.modules:
        groups.setdefault(root(m), []).append(str(m))
    return [v for v in groups.values() if len(v) > 1]

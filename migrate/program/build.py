"""From the paths a command was given to the programs they make up (see `graph`, `facts`)."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

from torchmigrate.program import facts, graph
from torchmigrate.program.fs import PLAIN, FileSystem
from torchmigrate.program.program import Program


def build(found: Sequence[Path], named: Sequence[Path], follow: bool = True,
          exclude: Optional[callable] = None, fs: FileSystem = PLAIN) -> Program:
    """`found`: the files discovered from the command line; `named`: those given by name.

    Entry points are the files given by name and, in folders, files with a `__main__` guard
    or that no other file of the run imports. With `follow`, the project modules the entries
    import (transitively) join the run. `exclude(path)` drops followed files that the
    configuration excludes. Every file-system question goes through `fs` (see `fs.Recorder`).
    """
    trees: Dict[Path, ast.Module] = {}
    resolved = {Path(_real(p, fs)): p for p in found}
    named_set = {Path(_real(p, fs)) for p in named}
    program = Program(list(found))
    start = graph.build(resolved, trees, fs)
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
    program.unresolved = [f"{graph.relpath(path)}:{line}: {name}" for path, misses in start.unresolved.items()
                          if exclude is None or not exclude(path) for line, name in misses]
    views = facts.compute(start, trees, entries)
    program.views = {str(p): v for p, v in views.items()}
    program.groups = _connected(start)
    return program


def _real(path, fs: FileSystem) -> str:
    try:
        return fs.realpath(path)
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

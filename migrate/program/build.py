"""From the paths a command was given to the programs they make up (see `graph`, `facts`)."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

from torchmigrate.program import facts, graph
from torchmigrate.program.fs import PLAIN, FileSystem
from torchmigrate.program.program import Program
from torchmigrate.program.view import ModuleView


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
    program.views = {str(p): v for p, v in _views(start, trees, entries).items()}
    program.groups = [[str(m) for m in part.modules] for part in _parts(start) if len(part.modules) > 1]
    return program


def _views(start: graph.Graph, trees: Dict[Path, ast.Module], entries: List[Path]) -> Dict[Path, ModuleView]:
    """The facts of each program in the run, computed apart: scripts given together that share no
    module (`torchmigrate ddp *.py` over a folder of examples) are separate programs, and one's
    BCE loss, own process group or endless generator says nothing about another's training. A
    checkpoint outlives the program that wrote it (train.py saves, evaluate.py loads), so which
    keys hold pickled objects is the one fact all of them share."""
    views: Dict[Path, ModuleView] = {}
    for part in _parts(start):
        members = set(part.modules)
        views.update(facts.compute(part, trees, [e for e in entries if e in members]))
    pickled = frozenset().union(*(v.pickled_keys for v in views.values()))
    return {p: dataclasses.replace(v, pickled_keys=pickled) for p, v in views.items()}


def _real(path, fs: FileSystem) -> str:
    try:
        return fs.realpath(path)
    except OSError:
        return os.path.abspath(path)


def _parts(g: graph.Graph) -> List[graph.Graph]:
    """The run's programs: its modules in groups connected by imports (either direction), each
    as a graph of its own."""
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
    groups: Dict[Path, List[Path]] = {}
    for m in g.modules:
        groups.setdefault(root(m), []).append(m)
    return [graph.Graph(modules=members,
                        imports={m: g.imports[m] for m in members if m in g.imports},
                        statements={m: g.statements[m] for m in members if m in g.statements},
                        unresolved={m: g.unresolved[m] for m in members if m in g.unresolved})
            for members in groups.values()]

"""From the paths a command was given to the programs they make up (see `graph`, `facts`)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set

from torchmigrate.program import facts, graph
from torchmigrate.program.fs import PLAIN, FileSystem, digest
from torchmigrate.program.program import Program
from torchmigrate.program.view import ModuleView


def build(found: Sequence[Path], named: Sequence[Path], follow: bool = True,
          exclude: Optional[callable] = None, fs: FileSystem = PLAIN, parts: Optional["PartViews"] = None,
          scans: Optional[graph.Scans] = None) -> Program:
    """`found`: the files discovered from the command line; `named`: those given by name.

    Entry points are the files given by name and, in folders, files with a `__main__` guard
    or that no other file of the run imports. With `follow`, the project modules the entries
    import (transitively) join the run. `exclude(path)` drops followed files that the
    configuration excludes. Every file-system question goes through `fs` (see `fs.Recorder`).
    `parts` (the lint cache's) keeps the facts of each program of the run by what they were
    computed from, so editing one script of a folder of examples recomputes that program's facts
    only; `scans` keeps what following each module's imports needs of its text
    (`graph.ModuleScan`), so only the edited file is parsed.
    """
    trees: Dict[Path, ast.Module] = {}
    resolved = {Path(_real(p, fs)): p for p in found}
    named_set = {Path(_real(p, fs)) for p in named}
    program = Program(list(found))
    start = graph.build(resolved, trees, fs, scans)
    imported: Set[Path] = {f for deps in start.imports.values() for f in deps}
    entries = []
    for path in resolved:
        parsed = path in start.statements  # (a module that does not parse has no statements)
        if path in named_set or (parsed and (path in start.main_guards or path not in imported)):
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
    program.views = {str(p): v for p, v in _views(start, trees, entries, _part_key(fs) if parts else None,
                                                  parts, lambda m: graph.parse(m, fs)).items()}
    program.groups = [[str(m) for m in part.modules] for part in _parts(start) if len(part.modules) > 1]
    return program


class PartViews(Protocol):
    """Where the facts of one program of a run are kept by their key (`engine.cache`)."""

    def get(self, key: str) -> Optional[Dict[str, ModuleView]]: ...

    def put(self, key: str, views: Dict[str, ModuleView]) -> None: ...


def _part_key(fs: FileSystem) -> Optional[Callable[[graph.Graph, List[Path]], Optional[str]]]:
    """The key of a program's facts: its modules in order with the hash of each one's bytes (as
    the recording file system read them), what each imports, and its entries. None where the
    file system keeps no hashes (no cache), or a module's is missing."""
    reads = getattr(fs, "reads", None)
    if reads is None:
        return None

    def key(part: graph.Graph, entries: List[Path]) -> Optional[str]:
        hashes = [reads.get(str(m)) for m in part.modules]
        if any(h is None for h in hashes):
            return None
        text = json.dumps([[str(m) for m in part.modules], hashes, [str(e) for e in entries],
                           {str(m): [str(d) for d in part.imports.get(m, ())] for m in part.modules},
                           {str(m): part.unresolved.get(m, []) for m in part.modules}])
        return digest(text.encode("utf-8", "surrogateescape"))

    return key


def _views(start: graph.Graph, trees: Dict[Path, ast.Module], entries: List[Path],
           key: Optional[Callable[[graph.Graph, List[Path]], Optional[str]]] = None,
           parts: Optional[PartViews] = None,
           parse: Optional[Callable[[Path], Optional[ast.Module]]] = None) -> Dict[Path, ModuleView]:
    """The facts of each program in the run, computed apart: scripts given together that share no
    module (`torchmigrate ddp *.py` over a folder of examples) are separate programs, and one's
    BCE loss, own process group or endless generator says nothing about another's training. A
    checkpoint outlives the program that wrote it (train.py saves, evaluate.py loads), so which
    keys hold pickled objects is the one fact all of them share."""
    views: Dict[Path, ModuleView] = {}
    for part in _parts(start):
        members = set(part.modules)
        own = [e for e in entries if e in members]
        found = key(part, own) if key is not None and parts is not None else None
        kept = parts.get(found) if found is not None else None
        if kept is not None and set(kept) == {str(m) for m in part.modules}:
            views.update({Path(p): v for p, v in kept.items()})
            continue
        for m in part.modules:  # a module whose scan was kept: its facts need its parse
            if m not in trees and m in part.statements and parse is not None:
                tree = parse(m)
                if tree is not None:
                    trees[m] = tree
                    part.statements[m] = graph.import_statements(tree)
        computed = facts.compute(part, trees, own)
        views.update(computed)
        if found is not None:
            parts.put(found, {str(p): v for p, v in computed.items()})
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

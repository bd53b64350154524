"""Collate functions that re-batch: a loader's batch is a group that the `collate_fn` cuts into
batches of the configured size (FastSpeech2's `Dataset.collate_fn` sorts a group of
`batch_size * group_size` samples by length and returns `group_size` batches of `batch_size`).

Dividing such a loader's batch among the ranks does not divide the batches a step trains on:
the collate still cuts batches of the configured size, so each rank steps on full-size batches
and the global batch grows with the ranks. TM305 keeps the loader's batch there and says why,
instead of claiming the original's global batch is kept.
"""

from __future__ import annotations

import ast
import re
from typing import FrozenSet, Iterable

from torchmigrate.program.astwalk import walk

_BATCH_SIZE = re.compile(r"(?i)^batch_?size$")


def _reads_batch_size(func: ast.AST) -> bool:
    for n in walk(func):
        name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else None
        if name and _BATCH_SIZE.match(name) and isinstance(getattr(n, "ctx", None), ast.Load):
            return True
    return False


def _returns_batches(func: ast.AST) -> bool:
    """A return of a list built of several batches (`[self.reprocess(data, i) for i in idx]`)."""
    return any(isinstance(n, ast.Return) and isinstance(n.value, (ast.ListComp, ast.List)) for n in walk(func))


def rebatching(functions: Iterable[ast.AST]) -> FrozenSet[str]:
    """Names of the functions and methods among `functions` that take a loader's samples and
    return a list of batches cut by a batch size they read: the collates that re-batch."""
    out = set()
    for func in functions:
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and "collate" in func.name.lower() \
                and _reads_batch_size(func) and _returns_batches(func):
            out.add(func.name)
    return frozenset(out)

"""The program's endless generators: functions and methods that yield inside a `while True:` loop
(`def generator(self, bs): while True: random.shuffle(...); for ...: yield batch`). A training loop
that counts steps and draws its batches from one with `next()` shares out the generator, not the
counter (`batches.BatchFacts`). One `ast` check, for the program's view (`facts.compute`) and for
a file processed without its program (`effects.of_module`)."""

from __future__ import annotations

import ast
from typing import FrozenSet

from torchmigrate.program.astwalk import walk

_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


def endless_generator(func: ast.AST) -> bool:
    """`func` yields inside a `while True:` loop of its own."""
    for node in walk(func):
        if isinstance(node, ast.While) and isinstance(node.test, ast.Constant) and node.test.value in (True, 1) \
                and any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in walk(node)):
            return True
    return False


def endless_generators(tree: ast.Module) -> FrozenSet[str]:
    """The names of the module's functions and methods that are endless generators."""
    functions = [d for d in tree.body if isinstance(d, _FUNCS)]
    functions += [f for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body if isinstance(f, _FUNCS)]
    return frozenset(f.name for f in functions if endless_generator(f))

"""Whether a program names a device anywhere: a program that never does runs on the CPU.

A training program that never says `cuda`, `device`, `gpu` or `mps` (no `.cuda()`, no
`.to(device)`, no `torch.device(...)`, no `--gpu` option) builds every tensor and its model on
the CPU. Under torchrun on a GPU host the migration must keep it there: a model moved to
`cuda:LOCAL_RANK` meets batches, masks and targets that the program keeps making on the CPU,
and the first forward fails (a full-batch graph trainer whose `torch.eye` and label tensors
never move). Such a program gets `tm.setup(device="cpu")`: its ranks run on the CPU, over gloo,
as its one process did.

The test is deliberately generous about what counts as naming a device (any identifier or
string that mentions one, docstrings included): a false "names a device" keeps the usual
migration, while a false "names none" would keep a GPU program off its GPUs.
"""

from __future__ import annotations

import ast
import re
from typing import Iterable

_WORDS = re.compile(r"cuda|device|gpu|accelerat|(?<![a-z])mps(?![a-z])|(?<![a-z])xla|(?<![a-z])npu|(?<![a-z])xpu",
                    re.IGNORECASE)


def names_device(trees: Iterable[ast.AST]) -> bool:
    """True when some module of the program mentions a device in code or in a string."""
    return any(_mentions(tree) for tree in trees)


def _mentions(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.keyword):
            text = node.arg or ""
        elif isinstance(node, ast.arg):
            text = node.arg
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.alias):
            text = node.name + " " + (node.asname or "")
        else:
            continue
        if _WORDS.search(text):
            return True
    return False

"""The program's modules whose `forward` returns a loss summed over the batch (a diffusion or VAE
wrapper, `return torch.sum(F.mse_loss(eps, self.model(x_t), reduction="none"))`), wherever they
are defined: a fact of the whole program, because the training step that calls one
(`loss = trainer(x)`) is usually in another module than the class.

`losses.summed_loss` asks it for a loss that is such a module's output, so that the model plan
wraps with `loss_reduction="sum"` there too (DDP's averaging would otherwise give each step
1/world_size of the original's gradient). Only what the code shows for sure counts, as in
`losses`: a `.sum()` or `torch.sum(x)` over the whole tensor, a torch loss with
`reduction="sum"`, sums of those and those scaled by a number, through the forward's own local
names.
"""

from __future__ import annotations

import ast
from typing import Dict, Optional

from torchmigrate.program.astwalk import walk
from torchmigrate.program.search_path import dotted_name

_DEPTH = 3


def summing_forward(klass: ast.ClassDef) -> bool:
    """`klass` defines `forward`, and every value it returns is a loss summed over the batch."""
    forward = next((f for f in klass.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f.name == "forward"), None)
    if forward is None:
        return False
    values = [n.value for n in walk(forward) if isinstance(n, ast.Return)]
    if not values or any(v is None for v in values):
        return False
    assigned: Dict[str, ast.AST] = {}
    for n in walk(forward):  # the last assignment of each local name, in source order
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            assigned[n.targets[0].id] = n.value
    return all(_summed(v, assigned, 0) for v in values)


def _summed(node: Optional[ast.AST], assigned: Dict[str, ast.AST], depth: int) -> bool:
    if node is None or depth > _DEPTH:
        return False
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _summed(node.operand, assigned, depth)
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, (ast.Add, ast.Sub)):
            return _summed(node.left, assigned, depth) and _summed(node.right, assigned, depth)
        if isinstance(node.op, ast.Mult):
            return (_number(node.left) and _summed(node.right, assigned, depth)) or (
                _number(node.right) and _summed(node.left, assigned, depth))
        if isinstance(node.op, ast.Div):
            return _number(node.right) and _summed(node.left, assigned, depth)
        return False
    if isinstance(node, ast.Name):
        return node.id in assigned and _summed(assigned[node.id], assigned, depth + 1)
    if isinstance(node, ast.Call):
        name = dotted_name(node.func) or ""
        if name in ("torch.sum", "th.sum"):
            return len(node.args) == 1 and not node.keywords
        if isinstance(node.func, ast.Attribute) and node.func.attr == "sum":
            return not node.args and not node.keywords
        reduction = next((k.value for k in node.keywords if k.arg == "reduction"), None)
        return isinstance(reduction, ast.Constant) and reduction.value == "sum" and name.rsplit(".", 1)[-1].endswith("loss")
    return False


def _number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)

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
from typing import Dict, FrozenSet, List, Optional, Tuple

from torchmigrate.program.astwalk import walk
from torchmigrate.program.search_path import dotted_name

_DEPTH = 3


WHOLE = -1  # the forward's whole value, not one item of a tuple it returns


def summing_outputs(klass: ast.ClassDef) -> FrozenSet[int]:
    """What `klass`'s `forward` returns summed over the batch: `WHOLE` where every value it
    returns is such a loss; else the positions of the tuple it returns (every `return` a tuple
    of one length) whose item is one (a VRNN's `return kld_loss, nll_loss, (means, stds)`, the
    losses accumulated over time steps, `kld_loss += self._kld_gauss(...)`, its own method
    returning `0.5 * torch.sum(...)`)."""
    methods = {f.name: f for f in klass.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    forward = methods.get("forward")
    if forward is None:
        return frozenset()
    values = [n.value for n in walk(forward) if isinstance(n, ast.Return)]
    if not values or any(v is None for v in values):
        return frozenset()
    summed = _Summed(methods)
    if all(summed.of(v, forward, 0) for v in values):
        return frozenset({WHOLE})
    if not all(isinstance(v, ast.Tuple) for v in values) or len({len(v.elts) for v in values}) != 1:
        return frozenset()
    return frozenset(i for i in range(len(values[0].elts))
                     if all(summed.of(v.elts[i], forward, 0) for v in values))


class _Summed:
    """Whether an expression of a method of the class is surely a loss summed over the batch."""

    def __init__(self, methods: Dict[str, ast.AST]) -> None:
        self.methods = methods
        self._locals: Dict[int, Tuple[Dict[str, ast.AST], Dict[str, List[ast.AST]]]] = {}

    def _names(self, func: ast.AST) -> Tuple[Dict[str, ast.AST], Dict[str, List[ast.AST]]]:
        """The last assignment of each local name, in source order, and what `+=` adds to it."""
        if id(func) not in self._locals:
            assigned: Dict[str, ast.AST] = {}
            added: Dict[str, List[ast.AST]] = {}
            for n in walk(func):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    assigned[n.targets[0].id] = n.value
                elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
                    added.setdefault(n.target.id, []).append(n.value if isinstance(n.op, ast.Add) else None)
            self._locals[id(func)] = (assigned, added)
        return self._locals[id(func)]

    def of(self, node: Optional[ast.AST], func: ast.AST, depth: int) -> bool:
        if node is None or depth > _DEPTH:
            return False
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return self.of(node.operand, func, depth)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, (ast.Add, ast.Sub)):
                return self.of(node.left, func, depth) and self.of(node.right, func, depth)
            if isinstance(node.op, ast.Mult):
                return (_number(node.left) and self.of(node.right, func, depth)) or (
                    _number(node.right) and self.of(node.left, func, depth))
            if isinstance(node.op, ast.Div):
                return _number(node.right) and self.of(node.left, func, depth)
            return False
        if isinstance(node, ast.Name):
            assigned, added = self._names(func)
            if node.id in added:  # `kld = 0`, then `kld += <a sum>` at each time step
                return _number(assigned.get(node.id)) and all(self.of(v, func, depth + 1) for v in added[node.id])
            return node.id in assigned and self.of(assigned[node.id], func, depth + 1)
        if isinstance(node, ast.Call):
            name = dotted_name(node.func) or ""
            if name in ("torch.sum", "th.sum"):
                return len(node.args) == 1 and not node.keywords
            if isinstance(node.func, ast.Attribute) and node.func.attr == "sum":
                return not node.args and not node.keywords
            if name.startswith("self.") and name.count(".") == 1 and name[5:] in self.methods:
                method = self.methods[name[5:]]  # the class's own helper: `self._kld_gauss(...)`
                returns = [n.value for n in walk(method) if isinstance(n, ast.Return)]
                return bool(returns) and all(self.of(r, method, depth + 1) for r in returns)
            reduction = next((k.value for k in node.keywords if k.arg == "reduction"), None)
            return isinstance(reduction, ast.Constant) and reduction.value == "sum" and name.rsplit(".", 1)[-1].endswith("loss")
        return False


def _number(node: Optional[ast.AST]) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)

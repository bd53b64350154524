"""Losses that compare the samples of a batch with each other: a contrastive loss (SimCLR's
NT-Xent, InfoNCE over the batch, CLIP's image-text matrix) or batch-hard triplet mining, where each
sample's negatives are the rest of its batch. A fact of the whole program, from CPython's `ast`:
the loss usually sits in a losses module or a model method, far from the loader.

Under DDP each rank computes such a loss over its own share of the batch only, so a sample sees
(W - 1) / W fewer negatives than in the original, silently: the loss means something else. TM305
keeps each rank's batch at the configured size there and says so (`rules/model/batch.py`).

A function couples its batch too when it orders the per-sample losses of the batch to keep part of
it (Co-teaching's and JoCoR's small-loss selection: `np.argsort(loss.data)` over a loss with
`reduction="none"`): over a rank's share it would keep the smallest of fewer samples.

A function couples its batch when it takes the distances between every two samples of the batch
(`torch.pdist(x)`: a uniformity loss), or when it builds a matrix of every sample against every
other one,
- `z @ z.t()`, `torch.mm(a, b.t())`, `torch.matmul(a, b.T)`, `a @ b.transpose(0, 1)`,
  `torch.einsum("nc,mc->nm", a, b)`, `cosine_similarity(z.unsqueeze(1), z.unsqueeze(0))`,
  `torch.cdist(a, b)`,
and indexes it by sample: `torch.arange(...)` targets (the positive of row i is column i),
`torch.eye(...)` / `fill_diagonal_` / `diag` masks. A Gram matrix of features without them (style
transfer) is not one; attention (`q @ k.transpose(-2, -1)`) is not either.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Optional

from torchmigrate.program.astwalk import walk

_TRANSPOSED = frozenset({"t", "T"})
_INDEXING = frozenset({"arange", "eye", "fill_diagonal_", "diag", "diagonal", "diag_embed"})
_EINSUM_PAIR = re.compile(r"^\s*(\w)(\w)\s*,\s*(\w)(\w)\s*->\s*(\w)(\w)\s*$")


def _transposed(node: ast.AST) -> bool:
    """`x.t()`, `x.T`, `x.transpose(0, 1)`, `x.permute(1, 0)`: a 2-D tensor of values computed
    here with rows and columns swapped (not a weight: `h @ self.embed.weight.T` ties weights)."""
    inner = None
    if isinstance(node, ast.Attribute) and node.attr == "T":
        inner = node.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        name = node.func.attr
        values = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if (name == "t" and not node.args) or (
                name in ("transpose", "permute") and len(node.args) == 2 and sorted(values) == [0, 1]):
            inner = node.func.value
    return inner is not None and not _held(inner)


def _held(node: ast.AST) -> bool:
    """`self.proj.weight`, `model.prototypes`: an attribute of an object (a parameter, a buffer,
    a queue), not a batch's values."""
    return isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Call))


def _last(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _unsqueezed(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _last(node.func) == "unsqueeze"


def _pairwise(node: ast.AST) -> bool:
    """`node` builds a matrix of every sample against every other one."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return _transposed(node.right)
    if not isinstance(node, ast.Call):
        return False
    name = _last(node.func)
    if name in ("mm", "matmul") and len(node.args) == 2:
        return _transposed(node.args[1])
    if name == "cdist":
        return True
    if name == "einsum" and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        m = _EINSUM_PAIR.match(node.args[0].value)
        # "nc,mc->nm": rows of both operands against each other over a shared feature index
        return bool(m) and m.group(2) == m.group(4) and (m.group(5), m.group(6)) == (m.group(1), m.group(3)) \
            and m.group(1) != m.group(3)
    if name in ("cosine_similarity", "CosineSimilarity") or (
            isinstance(node.func, ast.Call) and _last(node.func.func) == "CosineSimilarity"):
        return sum(1 for a in node.args if _unsqueezed(a)) == 2
    return False


def _all_pairs(node: ast.AST) -> bool:
    """`torch.pdist(x)` (`F.pdist`): the distances between every two rows of the batch's values
    (a uniformity loss over the batch, `pdist(x).pow(2).mul(-t).exp().mean().log()`), not of
    weights an object holds."""
    return isinstance(node, ast.Call) and _last(node.func) == "pdist" and bool(node.args) and not _held(node.args[0])


def _over_parameters(nodes) -> bool:
    """The function loops over a model's parameters (`for param in model.parameters(): w =
    param.view(...); torch.mm(w, w.t()) * (1 - torch.eye(n))`, BigGAN's orthogonal
    regularisation): its matrices compare weights, not the samples of a batch."""
    return any(isinstance(n, ast.For) and isinstance(n.iter, ast.Call) and _last(n.iter.func) in (
        "parameters", "named_parameters") for n in nodes)


def _per_sample_losses(nodes) -> bool:
    """A loss computed per sample (`reduction="none"`, the old `reduce=False`)."""
    return any(isinstance(n, ast.keyword) and (
        n.arg == "reduction" and isinstance(n.value, ast.Constant) and n.value.value == "none"
        or n.arg == "reduce" and isinstance(n.value, ast.Constant) and n.value.value is False) for n in nodes)


def _ranks_losses(node: ast.AST) -> bool:
    """`np.argsort(loss.data)`, `loss_1.sort()`, `torch.topk(losses, k)`: the samples of a batch
    ordered by their losses (Co-teaching's and JoCoR's small-loss selection keeps the smallest)."""
    if not (isinstance(node, ast.Call) and _last(node.func) in ("argsort", "sort", "topk")):
        return False
    operands = [*node.args, node.func.value] if isinstance(node.func, ast.Attribute) else list(node.args)
    return any("loss" in ast.unparse(o).lower() for o in operands[:2])


def coupled_losses(trees: Dict[Path, ast.Module]) -> Optional[str]:
    """`file:line name()` of the first function of the program that compares the samples of a
    batch with each other (see the module's docstring), or that keeps part of each batch by
    ranking its samples' losses (a small-loss selection), or None."""
    for path in sorted(trees):
        tree = trees[path]
        scopes = [(n.name + "()", list(walk(n))) for n in walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        scopes.append(("the script's top level", _top_level(tree)))
        for name, nodes in scopes:
            spread = next((n for n in nodes if _all_pairs(n)), None)
            if spread is not None and not _over_parameters(nodes):
                return f"{path.name}:{spread.lineno} {name}"
            pairwise = next((n for n in nodes if _pairwise(n)), None)
            if pairwise is not None and any(isinstance(n, ast.Call) and _last(n.func) in _INDEXING for n in nodes) \
                    and not _over_parameters(nodes):
                return f"{path.name}:{pairwise.lineno} {name}"
            ranked = next((n for n in nodes if _ranks_losses(n)), None)
            if ranked is not None and _per_sample_losses(nodes):
                return f"{path.name}:{ranked.lineno} {name}"
    return None


def _top_level(tree: ast.Module) -> list:
    """The nodes of a module outside its functions and classes (a training script's loop)."""
    out: list = []
    stack = [s for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(c for c in ast.iter_child_nodes(node)
                     if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))
    return out

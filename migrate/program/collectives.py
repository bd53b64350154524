"""Code that must run on every rank: calls that communicate (torch.distributed's and the
runtime's collectives), and expressions that may run one, a forward pass or a function of the
module that might do either. Facts only, no rule code: such code must never go under a rank
guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import libcst as cst

from torchmigrate import analysis
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.syntax import iter_nodes
from torchmigrate.syntax.imports import dotted

if TYPE_CHECKING:
    from torchmigrate.rule import Context


_COLLECTIVE_SUFFIXES = ("all_reduce", "all_gather", "all_gather_object", "reduce", "gather", "gather_object",
                        "broadcast", "broadcast_object_list", "barrier", "reduce_scatter",
                        "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "gather_for_metrics",
                        "scatter", "monitored_barrier", "main_process_first", "reduce_batch_total", "all_ranks",
                        "any_rank")


def is_collective(name: Optional[str]) -> bool:
    """A resolved call name that communicates (torch.distributed or the runtime)."""
    if not name:
        return False
    if name.startswith("torch.distributed.") or name.startswith(RUNTIME + "."):
        return name.rsplit(".", 1)[1] in _COLLECTIVE_SUFFIXES
    return False


def runs_user_code(ctx: Context, node: cst.CSTNode) -> bool:
    """Whether evaluating `node` may run a forward pass, a collective or a function of this file
    (which might do either): such code must run on every rank, never under a rank guard."""
    f = analysis.facts(ctx)
    models = set(analysis.trained_models(ctx))
    for n in iter_nodes(node):
        if not isinstance(n, cst.Call):
            continue
        func = n.func
        if isinstance(func, cst.Name) and func.value in f.functions:
            if not pure_helper(ctx, f.functions[func.value]) and not _rank_free(ctx, n):
                return True
            continue
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in ("self", "cls") \
                and func.attr.value in f.functions:
            if not pure_helper(ctx, f.functions[func.attr.value]) and not _rank_free(ctx, n):
                return True
            continue
        name = ctx.resolve(func)
        if is_collective(name):
            return True
        d = dotted(func)
        if d and analysis.model_root(d) in models and d == analysis.model_root(d):
            return True  # model(x)
    return False


def _rank_free(ctx: Context, call: cst.Call) -> bool:
    """What the program's effects say `call` reaches does nothing that every rank must do alike:
    no collective, training step or forward of handed code, no random draw or lasting state
    (`to_image(t)`, a helper that converts a tensor to an image and calls another such helper).
    Running it on the main process alone changes nothing on the others."""
    from torchmigrate.program.effects import CALLS, COLLECTIVE, PROBE, RANDOM, STATE, TRAIN
    from torchmigrate.program.writes import call_kinds

    kinds = call_kinds(ctx, call)
    return kinds is not None and not kinds & {CALLS, COLLECTIVE, PROBE, RANDOM, STATE, TRAIN}


# Builtins and tensor/array methods that compute on values: no forward pass, no collective.
_PURE_BUILTINS = frozenset({"len", "min", "max", "abs", "sum", "range", "float", "int", "str", "round", "list",
                            "tuple", "dict", "zip", "enumerate", "sorted", "isinstance", "format"})
_PURE_METHODS = frozenset({"clamp", "clamp_", "cpu", "numpy", "detach", "float", "double", "half", "int", "long",
                           "mul", "mul_", "add", "add_", "div", "div_", "sub", "permute", "transpose", "view",
                           "reshape", "squeeze", "unsqueeze", "clone", "to", "item", "tolist", "max", "min", "sum",
                           "mean", "astype", "size", "contiguous", "flatten", "expand", "repeat", "type", "format",
                           "append", "join", "split", "cat", "stack", "zeros", "ones", "zeros_like", "ones_like",
                           "arange", "linspace", "tensor", "from_numpy", "clip", "round", "exp", "log", "sqrt", "pow"})


def pure_helper(ctx: Context, func: cst.FunctionDef) -> bool:
    """A function of this file that only computes on values (`denorm(x)`: `(x + 1) / 2`,
    clamped): builtins and tensor/array methods, no call of a model, of `self.<anything>`, of
    another function of the file, or of a collective. Its calls may go under a rank guard."""
    memo = ctx.facts.setdefault("tm_pure_helpers", {})
    if func in memo:
        return memo[func]
    pure = True
    for call in ctx.within(func, cst.Call):
        target = call.func
        if isinstance(target, cst.Name):
            pure = target.value in _PURE_BUILTINS
        elif isinstance(target, cst.Attribute):
            receiver = target.value
            pure = not (isinstance(receiver, cst.Name) and receiver.value in ("self", "cls")) \
                and target.attr.value in _PURE_METHODS and not is_collective(ctx.resolve(target))
        else:
            pure = False
        if not pure:
            break
    memo[func] = pure
    return pure

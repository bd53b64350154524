"""What the launch rules share: the torch.distributed calls that create, tear down and need a
process group, the `--local_rank` option that torch.distributed.launch passes, and the calls
that seed the global random generators."""

from __future__ import annotations

from typing import List

import libcst as cst

from torchmigrate.syntax.imports import dotted

INIT_PG = "torch.distributed.init_process_group"
DESTROY_PG = "torch.distributed.destroy_process_group"
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
         "torch.multiprocessing.spawn.spawn", "torch.multiprocessing.spawn.start_processes")


# Calls that end the process: resolved names, and builtins called by their bare name.
EXIT_CALLS = ("sys.exit", "os._exit")
EXIT_BUILTINS = ("exit", "quit")


def ends_process(ctx, call: cst.Call) -> bool:
    """`sys.exit(...)`, `os._exit(...)`, `exit()`, `quit()` (the builtins, not a name imported
    over them)."""
    name = ctx.resolve(call.func)
    return name in EXIT_CALLS or (isinstance(call.func, cst.Name) and call.func.value in EXIT_BUILTINS and name is None)


# torch.distributed.launch passes `--local_rank=N` (recent versions `--local-rank=N`).
LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def option_strings(call: cst.Call) -> List[cst.Arg]:
    """The option names of an `add_argument(...)` call: its leading string literals."""
    out = []
    for a in call.args:
        if a.keyword is not None or a.star:
            break
        if not isinstance(a.value, cst.SimpleString):
            break
        out.append(a)
    return out


# Calls that seed the global random generators (torch's, CUDA's, random's, numpy's).
SEEDERS = {
    "torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
    "random.seed", "numpy.random.seed",
}


# Functions that belong to the data pipeline or the model: their randomness is per sample
# (augmentation, dropout, noise), and differing across ranks is what the user wants.
_PER_SAMPLE_METHODS = frozenset({"__getitem__", "__iter__", "__next__", "__call__", "forward", "__len__"})
_PER_SAMPLE_WORDS = ("transform", "augment", "collate", "worker_init", "noise", "crop", "flip", "jitter")
_PER_SAMPLE_BASES = ("Dataset", "Module", "Sampler", "Transform", "nn.", "Layer", "Loss")


def _called_per_sample(klass: cst.ClassDef, name: str) -> bool:
    """A method of `klass` that its own `__call__`, `__getitem__` or `forward` calls
    (`self.get_params(...)`, `RandomOrder.get_params(...)`: a transform's parameters drawn for
    each sample)."""
    owners = {"self", "cls", klass.name.value}
    for method in klass.body.body:
        if not (isinstance(method, cst.FunctionDef) and method.name.value in _PER_SAMPLE_METHODS):
            continue
        stack: List[cst.CSTNode] = [method.body]
        while stack:
            node = stack.pop()
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == name \
                    and isinstance(node.func.value, cst.Name) and node.func.value.value in owners:
                return True
            stack.extend(node.children)
    return False


def per_sample(ctx, func: cst.FunctionDef, depth: int = 0) -> bool:
    """`func` runs per sample or per forward (a dataset's `__getitem__`, a transform, a collate
    function, a model's method, or a function of the module that only these call: MAE's
    `random_indexes(T)` drawing each sample's patch mask in `PatchShuffle.forward`), maybe in a
    data-loader worker: its random draws are augmentation, dropout, masks or noise, meant to
    differ per rank, and no collective can run there."""
    name = func.name.value.lower()
    if func.name.value in _PER_SAMPLE_METHODS or any(w in name for w in _PER_SAMPLE_WORDS):
        return True
    for anc in ctx.ancestors(func):
        if isinstance(anc, cst.ClassDef):
            bases = " ".join(dotted(b.value) or "" for b in anc.bases)
            if any(b in bases for b in _PER_SAMPLE_BASES) or _called_per_sample(anc, func.name.value):
                return True
        if isinstance(anc, cst.FunctionDef) and per_sample(ctx, anc, depth):
            return True
    return ctx.parent(func) is ctx.module and depth < 3 and _only_called_per_sample(ctx, func, depth)


def _only_called_per_sample(ctx, func: cst.FunctionDef, depth: int) -> bool:
    """Every use of the module-level function `func` in its module is a call made in code that
    runs per sample (`per_sample`), and there is at least one."""
    calls = 0
    for name in ctx.named(func.name.value):
        if name is func.name:
            continue
        call = ctx.parent(name)
        caller = ctx.enclosing(name, cst.FunctionDef)
        if not (isinstance(call, cst.Call) and call.func is name) or caller is None \
                or not per_sample(ctx, caller, depth + 1):
            return False
        calls += 1
    return calls > 0

"""TM305's decisions: how big each rank's batch is once the program runs on N ranks.

DDP averages the gradients of the ranks, so a step trains on the batches of every rank together.
Under the batch policy "global" (the default, `Options.batch_policy`) the migrated program keeps
the original's global batch: each training DataLoader that TM201 shards in this run loads
`tm.per_rank_batch(batch_size)` samples (batch_size / world_size; the next size up, with a
warning naming the nearest sizes that divide, when it does not). The steps per epoch, step-based schedules, warm-up and the
learning rate then keep their meaning, gradient accumulation still sums the same number of
samples per optimizer step, and a DataParallel program's batch, which DataParallel split across
its GPUs, is split across the ranks the same way. Under "per-gpu" every rank keeps the whole
batch and TM305 scales the learning rate instead (`model/plan.py` finds the optimizers).

A loader whose batch size cannot be found or divided safely keeps its batch and gets a TODO:
a batch sampler (or a `batch_sampler=` that TM201 shards whole), batch sizes hidden in
`**kwargs` (other than a dict literal bound once in the loader's scope, whose `"batch_size"`
entry is divided) or left at the default of one sample, and a training loop that reads the batch size
as a count (`seen += args.batch_size`), or a program that builds a model or loss of its own
from the batch size (`NTXentLoss(device, config.batch_size)`, `init_hidden(batch_size)`,
`ModuleView.batch_consumers`), which would no longer match the batches. A loop that
reads it only as a tensor's shape (GAN noise `torch.randn(args.batch_size, nz)`, labels
`torch.ones(args.batch_size, 1)`, `out.view(args.batch_size, -1)`) has those shapes divided too.
Evaluation loaders are never touched: their batch size changes nothing about training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import libcst as cst

from torchmigrate.program.loaders import Loader, bind_args, compared_with_rows, key_of, loader_facts
from torchmigrate.program.scopes import assignments, scope_of
from torchmigrate.program.syntax import root_name
from torchmigrate.rule import Context
from torchmigrate.rules.data.plan import data_plan
from torchmigrate.program.syntax import iter_nodes
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code

DIVIDED = "per_rank_batch"


@dataclass(eq=False)
class BatchSite:
    """A training loader this run shards, and what happens to its batch size."""

    loader: Loader
    # the `batch_size` argument (positional or keyword), or its entry in the `**params` dict
    size: Optional[cst.CSTNode]
    kept: str = ""  # why the batch stays per rank (a TODO); "" when it is divided
    # the loop's reads of the batch size as a tensor's shape, divided with it
    # (`torch.randn(args.batch_size, nz)` -> `torch.randn(tm.per_rank_batch(args.batch_size), nz)`)
    shapes: List[cst.CSTNode] = field(default_factory=list)


def divides_batches(ctx: Context) -> bool:
    """This run keeps the original's global batch by dividing the training loaders' batch size:
    `ddp` with the global policy, TM305 and TM201 (which shards the loaders) both enabled, and
    a model wrapped in DDP (else training data stays whole, see `Options.shard_training`)."""
    options = ctx.options
    return (options.mode == "ddp" and options.batch_policy == "global" and options.shard_training
            and {"TM201", "TM305"} <= ctx.enabled)


def loaders_carry_batch(ctx: Context) -> bool:
    """The program's global batch is decided at its DataLoaders (divided there, or a TODO there
    that says why not), so its optimizers need no word about the learning rate."""
    if not divides_batches(ctx):
        return False
    return ctx.program.program_dataloaders or (not ctx.program.followed and bool(loader_facts(ctx).loaders))


def batch_sites(ctx: Context) -> List[BatchSite]:
    """The training loaders of this module that TM201 shards in this run, with their decision
    (computed once per module)."""
    found = ctx.facts.get("model.batch_sites")
    if found is None:
        found = ctx.facts["model.batch_sites"] = _decide(ctx) if divides_batches(ctx) else []
    return found  # type: ignore[return-value]


def splits_batches(ctx: Context, loader: Loader) -> bool:
    """The loader's own `batch_sampler=` is split batch by batch among the ranks
    (`tm.shard_sampler(..., split_batches=True)`): torch's `BatchSampler`, where this run keeps
    the original's global batch, unless the loop reads the configured batch size as a shape or a
    count (a part of a batch would not match it; whole batches are dealt then, and TM305 says so)."""
    if loader.custom_param != "batch_sampler" or loader.custom_arg is None or not divides_batches(ctx) \
            or loader.batch_read:
        return False
    value = loader.custom_arg.value
    key = key_of(value)
    values = [a.value for a in loader_facts(ctx).assigns_at(loader.call, key)] if key is not None else [value]
    # torch's own BatchSampler over a sampler: batches of unrelated samples, any part of one is a
    # batch. A batch sampler of the program's (an N-way K-shot episode, K samples per identity,
    # a bucket of lengths) makes batches with a structure the step relies on: dealt whole.
    # (or a program's own copy of it, by that name: FixMatch vendors torch's sampler module)
    return bool(values) and all(isinstance(v, cst.Call) and (
        ctx.resolve(v.func) in _TORCH_BATCH_SAMPLERS or (dotted(v.func) or "").rsplit(".", 1)[-1] == "BatchSampler")
        for v in values)


_TORCH_BATCH_SAMPLERS = frozenset({"torch.utils.data.BatchSampler", "torch.utils.data.sampler.BatchSampler"})


def _decide(ctx: Context) -> List[BatchSite]:
    facts = loader_facts(ctx)
    if facts.distributed or facts.skip_file:
        return []
    plan = data_plan(ctx)
    sites = []
    for loader in facts.loaders:
        decided = plan.of(loader)
        if loader.kind == "eval" or not _sharded_here(loader, decided) or splits_batches(ctx, loader):
            continue  # (a batch sampler split batch by batch keeps the global batch itself)
        args = bind_args(loader.call) or {}
        size = args.get("batch_size") or _size_in_kwargs(ctx, loader.call)
        if size is not None and DIVIDED in code(size.value):
            continue  # migrated already
        shapes = [u for u in loader.batch_uses if shape_of_batch(ctx, u)]
        divided = bool(shapes) and len(shapes) == len(loader.batch_uses)  # every read a shape
        kept = _sized_elsewhere(ctx, size) or _rebatched(ctx, args) or _kept(loader, size, args, shapes_divided=divided) \
            or _sample_indexed(ctx, facts, loader)
        sites.append(BatchSite(loader, size, kept, [] if kept else shapes))
    return sites


def _size_in_kwargs(ctx: Context, call: cst.Call):
    """The `"batch_size": value` entry (or `batch_size=value` of `dict(...)`) of the dict a
    loader takes as `**params`, where its scope binds that name once, to a literal
    (`training_params = {"batch_size": opt.batch_size, "shuffle": True}`): the batch size is
    divided there (a loader of the other split sharing the dict loads smaller batches, with the
    same results). None where the dict is not such a literal."""
    star = [a.value for a in call.args if a.star == "**" and isinstance(a.value, cst.Name)]
    if len(star) != 1:
        return None
    bound = assignments(ctx).get((scope_of(ctx, call), star[0].value), [])
    if len(bound) != 1 or len(bound[0].targets) != 1:
        return None
    value = bound[0].value
    if isinstance(value, cst.Dict):
        found = [e for e in value.elements if isinstance(e, cst.DictElement) and isinstance(e.key, cst.SimpleString)
                 and e.key.evaluated_value == "batch_size"]
        return found[0] if len(found) == 1 else None
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "dict":
        found = [a for a in value.args if a.keyword is not None and a.keyword.value == "batch_size"]
        return found[0] if len(found) == 1 else None
    return None


# Calls whose positional arguments (or `size=`) give a tensor's shape: the batch size there is
# the number of rows of this rank's batch (`torch.ones(args.batch_size, 1)` labels, GAN noise,
# `out.view(args.batch_size, -1)`, `torch.arange(args.batch_size)` contrastive targets).
_SHAPE_FUNCS = frozenset({"view", "reshape", "expand", "repeat", "randn", "rand", "zeros", "ones", "empty", "full",
                          "new_zeros", "new_ones", "new_empty", "new_full", "randint", "normal", "arange",
                          "randperm", "eye", "FloatTensor", "LongTensor", "Tensor"})


def _sized_elsewhere(ctx: Context, size: Optional[cst.CSTNode]) -> str:
    """The program builds a model or loss of its own from this batch size (`NTXentLoss(device,
    config.batch_size)`, `init_hidden(batch_size)`): it expects the configured batch, which a
    rank's share would not match; or its loss compares the samples of a batch with each other
    (`program.batch_coupling`): over a rank's share each sample would see fewer negatives. Then
    the batch stays (the reason, or "")."""
    value = size.value if size is not None else None
    leaf = value.attr.value if isinstance(value, cst.Attribute) else value.value if isinstance(value, cst.Name) else None
    where = ctx.program.batch_consumers.get(leaf) if leaf else None
    if where:
        return (f"the program also builds something sized by `{leaf}` ({where}), which a rank's share of the batch "
                "would not match")
    for coupled in sorted(ctx.program.batch_coupled):
        return (f"the program compares the samples of a batch with each other ({coupled}: a contrastive loss whose "
                "negatives are the rest of the batch, hard-example mining, a selection of the samples with the "
                "smallest losses), which over a rank's share would see fewer of them")
    return ""


def shape_of_batch(ctx: Context, use: cst.CSTNode) -> bool:
    """`use` (the batch size expression) is a dimension of a tensor made or reshaped here, or is
    compared with the rows of a batch (`assert x.shape[0] == n * batch_size`)."""
    if compared_with_rows(ctx, use):
        return True
    node = use
    parent = ctx.parent(node)
    comprehension = _range_comprehension(ctx, node)
    if comprehension is not None:  # `torch.LongTensor([[sos for _ in range(bs)]])`: bs elements
        node, parent = comprehension, ctx.parent(comprehension)
    # `torch.zeros((bs, 1))`, `torch.randn(bs * 2, nz)`: a dimension made from the batch size
    while isinstance(parent, (cst.Element, cst.Tuple, cst.List)) or (
            isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, (cst.Multiply, cst.FloorDivide))):
        node, parent = parent, ctx.parent(parent)
    if not isinstance(parent, cst.Arg) or parent.star or (parent.keyword is not None and parent.keyword.value != "size"):
        return False
    call = ctx.parent(parent)
    if not isinstance(call, cst.Call):
        return False
    func = call.func
    name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
    if name not in _SHAPE_FUNCS:
        return False
    if name == "randint" and parent.keyword is None:
        positional = [a for a in call.args if a.keyword is None]
        return len(positional) >= 2 and parent is positional[-1]  # randint(low, high, size)
    if name == "normal":
        return parent.keyword is not None  # normal(mean, std, size=...)
    return True


def _range_comprehension(ctx: Context, use: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The list comprehension or generator that `use` sizes as `range(use)`, its only loop
    (`[sos for _ in range(bs)]`), else None."""
    arg = ctx.parent(use)
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "range"
            and len(call.args) == 1):
        return None
    loop = ctx.parent(call)
    comp = ctx.parent(loop) if isinstance(loop, cst.CompFor) and loop.iter is call and loop.inner_for_in is None \
        else None
    return comp if isinstance(comp, (cst.ListComp, cst.GeneratorExp)) else None


def _sharded_here(loader: Loader, decided) -> bool:
    """TM201 gives the loader a distributed sampler in this run (`tm.sampler`, or its own
    sampler wrapped in `tm.shard_sampler`), so each rank loads its share of every epoch."""
    if decided.status == "plain":
        return decided.sampler in ("distributed", "mixed") and not loader.ordered
    return decided.status == "custom" and decided.sampler == "distributed"


def _sample_indexed(ctx: Context, facts, loader: Loader) -> str:
    """A loop over the loader reads one sample of a batch at a fixed position past the first
    (`img = images.cpu().numpy(); img[2]`, a visualisation of the third sample): a rank's share
    of the batch may be shorter than that (8 samples on 8 ranks: one each), so the batch stays."""
    try:
        loops = facts.consumers(loader)[0]
    except Exception:  # noqa: BLE001 - without the loops, nothing is known to index the batch
        return ""
    for loop in loops:
        names = {n.value for n in ctx.within(loop.target, cst.Name)}
        assigns = [a for a in ctx.within(loop.body, cst.Assign, skip_defs=True)]
        for _ in range(3):  # names computed from the batch: `images = sample['images'].to(device)`
            for a in assigns:
                if (root_name(a.value) or "").split(".")[0] in names:
                    names |= {n.value for t in a.targets for n in ctx.within(t.target, cst.Name)}
        views = _holders_of_batches(ctx, loop)
        for sub in ctx.within(loop.body, cst.Subscript, skip_defs=True):
            index = sub.slice[0].slice if len(sub.slice) == 1 else None
            if isinstance(sub.value, cst.Name) and sub.value.value in names and isinstance(index, cst.Index) \
                    and isinstance(index.value, cst.Integer) and int(index.value.value) >= 1 \
                    and sub.value.value not in views:
                return (f"the loop over it reads sample `{code(sub)}` of a batch at a fixed position, which a rank's "
                        "share of the batch may not have")
    return ""


def _holders_of_batches(ctx: Context, loop: cst.CSTNode) -> set:
    """Names whose items are batches themselves: the loop reads the batch size off one of them
    (`N = data[0].shape[0]`, `len(views[0])`, `x[0].size(0)`), so `data[1]` is a second view of
    the batch (two augmentations of a contrastive pair), not its second sample."""
    out = set()
    for sub in ctx.within(loop.body, cst.Subscript, skip_defs=True):
        index = sub.slice[0].slice if len(sub.slice) == 1 else None
        if not (isinstance(sub.value, cst.Name) and isinstance(index, cst.Index) and isinstance(index.value, cst.Integer)):
            continue
        parent = ctx.parent(sub)
        sized = (isinstance(parent, cst.Attribute) and parent.value is sub and (
            (parent.attr.value == "shape" and isinstance(ctx.parent(parent), cst.Subscript))
            or (parent.attr.value == "size" and isinstance(ctx.parent(parent), cst.Call))))
        if not sized and isinstance(parent, cst.Arg):
            call = ctx.parent(parent)
            sized = isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "len"
        if sized:
            out.add(sub.value.value)
    return out


def _rebatched(ctx: Context, args) -> str:
    """The loader's `collate_fn` cuts each loaded group into batches of a configured size
    (`ModuleView.rebatching_collates`): a rank's share of the group would still be cut into
    full-size batches, so dividing the loader's batch would not divide the step's batch."""
    collate = args.get("collate_fn")
    name = code(collate.value).rsplit(".", 1)[-1] if collate is not None else ""
    if collate is not None and _first_item(collate.value):
        return (f"its `collate_fn` ({code(collate.value)}) returns the first item of each loaded batch: each item is "
                "a whole batch (a bucket of samples the dataset groups), which every rank loads whole")
    if name and name in ctx.program.rebatching_collates:
        return (f"its `collate_fn` ({code(collate.value)}) cuts each loaded batch into batches of a configured size, "
                "so a rank's share would still train on full-size batches")
    return ""


def _first_item(node: cst.BaseExpression) -> bool:
    """`lambda b: b[0]` (also through a call in the body: `lambda x: collect(x[0])`)."""
    if not isinstance(node, cst.Lambda) or len(node.params.params) != 1:
        return False
    param = node.params.params[0].name.value
    return any(isinstance(n, cst.Subscript) and isinstance(n.value, cst.Name) and n.value.value == param
               and len(n.slice) == 1 and isinstance(n.slice[0].slice, cst.Index)
               and isinstance(n.slice[0].slice.value, cst.Integer) and n.slice[0].slice.value.value == "0"
               for n in iter_nodes(node.body))


def _kept(loader: Loader, size: Optional[cst.CSTNode], args, shapes_divided: bool = False) -> str:
    """Why the loader's batch size cannot be divided here ("" when it can; `shapes_divided`:
    the loop's reads of it are shapes, divided with it)."""
    if loader.custom_param == "batch_sampler":
        return "its `batch_sampler=` makes the batches, and each rank now takes whole batches of it"
    if size is None and loader.kwargs_arg is not None:
        return f"its batch size may come from `**{code(loader.kwargs_arg)}`"
    if size is None or "batch_sampler" in args:
        return "it loads one sample per batch (no `batch_size`), which cannot be split among the ranks"
    if isinstance(size.value, cst.Integer) and int(size.value.evaluated_value) == 1:
        return "a batch of one sample cannot be split among the ranks"
    if loader.batch_read and not shapes_divided:
        return f"the loop over it reads `{loader.batch_read}` as a shape or a count, which a smaller batch would not match"
    return ""


def policy_applied(ctx: Context) -> bool:
    """TM305 decides the program's batch in this run: it divides the loaders' batch size (see
    `loaders_carry_batch`) or, under "per-gpu", scales the learning rates. Other rules then
    say nothing about the global batch (TM306's DataParallel note)."""
    if ctx.options.mode != "ddp" or "TM305" not in ctx.enabled:
        return False
    return ctx.options.batch_policy == "per-gpu" or loaders_carry_batch(ctx)


def per_rank(tm: str, value: cst.BaseExpression) -> cst.Call:
    """`tm.per_rank_batch(<value>)`: this rank's share of the batch size `value`."""
    return cst.Call(func=cst.parse_expression(f"{tm}.{DIVIDED}"), args=[cst.Arg(value.with_changes(lpar=[], rpar=[]))])


def divide_fix(ctx: Context, site: BatchSite):
    """The edit of the batch size: `tm.per_rank_batch(size)`; for a loader that trains or
    evaluates by a condition (`shuffle=is_train`), `tm.per_rank_batch(size) if is_train else
    size`, so the evaluation batch stays as it was."""
    tm = ctx.tm
    condition = site.loader.condition if site.loader.kind == "mixed" else None

    def fix(value: cst.BaseExpression) -> cst.BaseExpression:
        call = per_rank(tm, value)
        if condition is None:
            return call
        return cst.IfExp(test=cst.parse_expression(condition), body=call, orelse=value.deep_clone())
    return fix

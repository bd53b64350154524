"""The metrics family's decisions: how the loader of a loop is sharded once this run's fixes are
in (`loop_sharding`: sharded, whole, or unknown and left to the runtime), and so whether the
values a loop computes need a reduction at all and which `len(...)` denominators stay exact when
TM701 reduces the sums of the loop.

A loop over a loader that every rank iterates in full (an evaluation loader kept whole) computes
the whole data's numbers on every rank: reducing them again would count each sample once per
rank, so the metrics rules leave it alone.

A loader the data rules give an unpadded `tm.eval_sampler` (TM203) makes `len(loader.dataset)`
exact for summed counts; one with a padded distributed sampler (TM201, or a `DistributedSampler`
already there) gives every rank the same batch count, so a sum over `len(loader)` is averaged
over the ranks instead. The loader facts say which loaders an expression denotes, the data plan
(`rules/data/plan.py`) and the data rules' findings how they end up sharded.
"""

from __future__ import annotations

from typing import Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Edit, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program import splits
from torchmigrate.program.loaders import DIST_SAMPLERS, bind_params, conditional_sampler, loaders, refs_at
from torchmigrate.program.metrics import (ExactDenominators, leaves_early, loader_expr, means_only, reassigned_in,
                                          starts_empty_list)
from torchmigrate.program.losses import summed_loss
from torchmigrate.program.syntax import local_callee
from torchmigrate.rule import Context
from torchmigrate.rules.data.plan import data_plan
from torchmigrate.options import RUNTIME_MODULE as RUNTIME


def _sharding(ctx: Context, loader) -> Optional[str]:
    """How a loader of the loader facts is sharded once this run's fixes are in (the data
    plan): "eval" (unpadded: every sample once), "distributed" (padded, equal batch counts),
    "mixed" (one of those, by its condition), "planned" (sharded by the plan's decision, through
    a rule this run does not apply), "whole" (every rank iterates all of it: an evaluation loader
    kept whole, a loader the plan gives no sampler) or None (unknown: the loader's sampling is
    hidden, or half of it is kept whole)."""
    plan = data_plan(ctx)
    decided = plan.of(loader)
    status, call = decided.status, loader.call
    if status == "plain":
        if not ctx.options.migrating:  # lint: TM201 says a plain training loader must be sharded
            return "whole" if loader.kind == "eval" else "planned"
        if decided.sampler is None:
            return "whole"
        if ("TM203" if loader.kind == "eval" else "TM201") not in ctx.enabled:
            return "planned"  # the plan shards it, by a rule this run does not apply
        if decided.sampler == "mixed":
            return None if plan.eval_whole(loader) else "mixed"
        return decided.sampler  # "eval" or "distributed"
    if status == "distributed" and isinstance(call, cst.Call):
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "sampler" and isinstance(a.value, cst.Call):
                name = ctx.resolve(a.value.func)
                if name == RUNTIME + ".eval_sampler":
                    return "eval"
                if name in (RUNTIME + ".sampler", *DIST_SAMPLERS):
                    return "distributed"
        return "distributed" if decided.sampler == "distributed" else None
    if status == "custom":
        return "distributed" if decided.sampler == "distributed" else "whole"
    if status == "sharded":
        return "distributed"
    if status == "whole":
        return "whole"
    return None


def branch_sharding(ctx: Context, loader, branch: Optional[str]) -> Optional[str]:
    """`_sharding` of a loader as one reference holds it: the branch of a mixed loader that a
    factory call builds (`test_dl = make_loader(test_ds, False)`) is known where its evaluation
    half stays whole."""
    if branch is not None and ((loader.kind == "mixed" and data_plan(ctx).eval_whole(loader)
                                and _sharding(ctx, loader) is None) or conditional_sampler(loader) is not None):
        return "whole" if branch == "eval" else "distributed"
    if branch == "eval" and loader.kind == "train":
        return "whole"  # `dev = tm.unsharded(get_loader, ...)` from the training loaders' factory
    return _sharding(ctx, loader)


def _from_elsewhere(ctx: Context, fn: cst.FunctionDef, param: str) -> Set[Optional[str]]:
    """A parameter of `fn` that this module's calls hand loaders built in another module of the
    program (`train_loader, test_loader = load_data(args)` ... `eval(model, test_loader, args)`),
    in a module that builds none itself: an evaluation loader that reaches another module is
    never proven reduced, so it stays whole unless `--shard-eval` (as `ModuleView.loader_params`
    says for loaders handed across modules). By the names the calls pass, else the parameter's."""
    if not ctx.program.program_dataloaders or loaders(ctx):
        return set()
    names = {param}
    for call in ctx.nodes(cst.Call):
        if isinstance(call.func, cst.Name) and call.func.value == fn.name.value:
            names |= {value.value for bound, value in bind_params(fn, call, False)
                      if bound == param and isinstance(value, cst.Name)}
    verdicts = {splits.verdict(splits.words(n)) for n in names} - {None}
    if verdicts == {"eval"}:
        return {"eval" if ctx.options.shard_eval else "whole"}
    return set()


def loop_sharding(ctx: Context, loop: cst.For) -> str:
    """"sharded", "whole" or "unknown": whether the loader `loop` iterates gives each rank its
    own part of the data once this run's fixes are in. Known for a loader of this module (the
    data plan) and for a parameter that other modules hand loaders whose names say their split
    (`ModuleView.loader_params`: an evaluation loader reaching another module is never proven
    reduced, so it stays whole unless `--shard-eval`; a training loader is sharded while the
    program wraps a model). Where nothing is known of the loader, a loop that runs a backward
    pass iterates training data, sharded. Otherwise "unknown" (some of its loaders sharded and
    some not, as a loader built for both splits whose evaluation half stays whole, or nothing
    known): the runtime decides (`tm.all_reduce(..., over=loader)`)."""
    if not ctx.options.shard_training and analysis.runs_backward(ctx, loop):
        return "whole"  # this run keeps training data whole (no model is wrapped in DDP)
    node = loader_expr(ctx, loop.iter)
    states: Set[Optional[str]] = set()
    try:
        states |= {branch_sharding(ctx, x, r.branch) for r in refs_at(ctx, node) for x in r.loaders}
    except Exception:  # noqa: BLE001 - an optional refinement: without it the runtime decides
        states.add(None)
    fn = ctx.enclosing(loop, cst.FunctionDef)
    if isinstance(node, cst.Name) and fn is not None:
        klass = ctx.enclosing(fn, cst.ClassDef)
        qual = f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value
        for split in ctx.program.loader_params.get(qual, {}).get(node.value, ()):
            if split == "eval":
                states.add("eval" if ctx.options.shard_eval else "whole")
            elif split == "train":
                states.add("distributed" if ctx.options.shard_training else "whole")
            else:
                states.add(None)
    if not states and isinstance(node, cst.Name) and fn is not None:
        states |= _from_elsewhere(ctx, fn, node.value)
    if not states:  # nothing known of the loader: a loop that trains iterates training data
        return "sharded" if analysis.runs_backward(ctx, loop) else "unknown"
    if states == {"whole"}:
        return "whole"
    if None in states or "whole" in states:
        return "unknown"  # (a loader built for both splits whose evaluation half stays whole)
    return "sharded"


def _range_over_len(node: cst.BaseExpression) -> Optional[str]:
    """`X` of `range(0, len(X), bs)` / `range(len(X) // bs)` / `range(len(X))`, as text."""
    if not (isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "range"):
        return None
    for a in node.args:
        value = a.value
        while isinstance(value, cst.BinaryOperation):
            value = value.left
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "len" \
                and len(value.args) == 1:
            return code(value.args[0].value).replace(" ", "")
    return None


def exact_lens(ctx: Context, loop: cst.For) -> ExactDenominators:
    """The `len(...)` denominators that stay exact once the sums of `loop` are reduced."""
    out = ExactDenominators()
    node = loader_expr(ctx, loop.iter)
    try:  # the loader facts say which loaders an expression denotes, the data plan how they are sharded
        loaders = [l for r in refs_at(ctx, node) for l in r.loaders]
    except Exception:  # noqa: BLE001 - an optional refinement; without it denominators are reported
        return out
    if not loaders:
        counted = _range_over_len(loop.iter)
        if counted and ctx.options.shard_training and analysis.trains_itself(ctx, loop):
            # a hand-made training loop over batch starts, `for i in range(0, len(X), bs)`, which
            # TM201 shares out by rank (`tm.shard_range`, padded like a training sampler): `len(X)`
            # is the whole set, as `len(loader.dataset)` of a padded training loader is
            out.dataset.add(counted)
        elif isinstance(node, (cst.Name, cst.Attribute)) and _trains(ctx, loop):
            # a loader handed in (`def _train_epoch(self, data_loader)`) that the loop trains on:
            # reduced `over=` it, exact or within the padding of a training sampler; a sum of
            # batch means over `len(loader)` is averaged over the ranks (a padded sampler gives
            # each as many batches)
            text = code(node).replace(' ', '')
            out.dataset.add(f"{text}.dataset")
            out.batches.add(text)
            out.counters |= _counters(ctx, loop)
        return out
    kinds = {_sharding(ctx, l) for l in loaders}
    text = code(node).replace(" ", "")
    if kinds == {"eval"}:
        out.dataset.add(f"{text}.dataset")
        if len(loaders) == 1 and isinstance(loaders[0].dataset, (cst.Name, cst.Attribute)):
            out.dataset.add(code(loaders[0].dataset))
    elif kinds == {"distributed"}:
        out.batches.add(text)
        out.counters |= _counters(ctx, loop)
        if _trains(ctx, loop):
            # a training loop's loss summed over the samples, logged per sample: the padded
            # sampler repeats at most world_size - 1 samples of the whole set, which moves a
            # logged mean by less than (W - 1) / len(dataset) of the loss; a report would ask
            # for what the reduction already does
            out.dataset.add(f"{text}.dataset")
            if len(loaders) == 1 and isinstance(loaders[0].dataset, (cst.Name, cst.Attribute)):
                out.dataset.add(code(loaders[0].dataset))
    return out


def _counters(ctx: Context, loop: cst.For) -> Set[str]:
    """`i` of `for i, batch in enumerate(loader)` (counting from 0) and the names the body sets
    to it alone (`b_idx = i`): after a pass over a loader that every rank goes through in as many
    batches (a padded distributed sampler), `i + 1` is that count on every rank."""
    it, target = loop.iter, loop.target
    if not (isinstance(it, cst.Call) and dotted(it.func) == "enumerate" and len(it.args) == 1
            and isinstance(target, cst.Tuple) and target.elements and isinstance(target.elements[0].value, cst.Name)):
        return set()
    index = target.elements[0].value.value
    found = {index}
    for assign in ctx.within(loop.body, cst.Assign, skip_defs=True):
        if isinstance(assign.value, cst.Name) and assign.value.value == index and len(assign.targets) == 1 \
                and isinstance(assign.targets[0].target, cst.Name):
            found.add(assign.targets[0].target.value)
    return found


def _trains(ctx: Context, node: cst.CSTNode, depth: int = 0) -> bool:
    """`node` runs a backward, itself or through a function of this module or a method of its
    class that it calls (`iter_loss = self._train_iteration(data)`), two calls deep."""
    if analysis.runs_backward(ctx, node):
        return True
    if depth >= 2:
        return False
    for call in ctx.within(node, cst.Call, skip_defs=True):
        callee = local_callee(ctx, call)
        if callee is not None and callee is not node and _trains(ctx, callee, depth + 1):
            return True
    return False


def gathered_for_mean(ctx: Context, loop: cst.For, name: str) -> bool:
    """`name` is a list of per-batch values filled in `loop` over a loader that is not read whole,
    and read after it only as a mean (`sum(losses) / len(losses)`): TM703 gathers it after the loop."""
    return starts_empty_list(ctx, loop, name) and not reassigned_in(ctx, loop, name) and means_only(ctx, loop, name) \
        and not leaves_early(ctx, loop) and loop_sharding(ctx, loop) != "whole"


def ranks_value(ctx: Context, node: cst.BaseExpression) -> Edit:
    """The edit that makes `node` the ranks' mean, `tm.all_reduce(<node>, op="mean")`, or their
    sum where it is a loss summed over each rank's share of the original batch (`_summed_share`)
    (its outer parentheses dropped; inside an f-string the other quote, which before Python 3.12
    its expressions cannot reuse). A collective: for values every rank computes at that point."""
    quote = '"'
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.FormattedString):
            quote = "'" if '"' in anc.start else '"'
            break
        if isinstance(anc, cst.BaseStatement):
            break
    op = "sum" if _summed_share(ctx, node) else "mean"
    template = cst.parse_expression(f"{ctx.tm}.all_reduce(_, op={quote}{op}{quote})")

    def fix(value: cst.BaseExpression) -> cst.Call:
        return template.with_changes(args=[cst.Arg(value.with_changes(lpar=[], rpar=[]), comma=template.args[0].comma),
                                           template.args[1]])
    return replace(node, fix)


def _summed_share(ctx: Context, node: cst.BaseExpression) -> bool:
    """`node` (`kld_loss`, `loss.item()`, `float(loss)`) is a loss summed over the batch in a
    training loop whose loader the migration shards with the original's global batch kept: each
    rank sums its share of the batch, so the original's value is the ranks' sum."""
    while True:
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) \
                and node.func.attr.value in ("item", "detach", "cpu") and not node.args:
            node = node.func.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "float" \
                and len(node.args) == 1:
            node = node.args[0].value
        elif isinstance(node, cst.Attribute) and node.attr.value == "data":
            node = node.value
        else:
            break
    loop = ctx.enclosing(node, cst.For)
    return ctx.options.batch_policy == "global" and loop is not None and loop_sharding(ctx, loop) == "sharded" \
        and summed_loss(ctx, node)

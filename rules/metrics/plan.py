"""The metrics family's decisions: how the loader of a loop is sharded once this run's fixes are
in, and so which `len(...)` denominators stay exact when TM701 reduces the sums of the loop.

A loader the data rules give an unpadded `tm.eval_sampler` (TM203) makes `len(loader.dataset)`
exact for summed counts; one with a padded distributed sampler (TM201, or a `DistributedSampler`
already there) gives every rank the same batch count, so a sum over `len(loader)` is averaged
over the ranks instead. The loader facts say which loaders an expression denotes, the data plan
(`rules/data/plan.py`) and the data rules' findings how they end up sharded.
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from torchmigrate.syntax.nodes import code
from torchmigrate.program.loaders import DIST_SAMPLERS, refs_at
from torchmigrate.program.metrics import ExactDenominators, loader_expr
from torchmigrate.rule import Context
from torchmigrate.rules.data.plan import data_plan
from torchmigrate.options import RUNTIME_MODULE as RUNTIME


def _sharding(ctx: Context, loader) -> Optional[str]:
    """"eval" (unpadded: every sample once), "distributed" (padded, equal batch counts) or None,
    for a loader of the loader facts, once this run's fixes are in (the data plan)."""
    decided = data_plan(ctx).of(loader)
    status, call = decided.status, loader.call
    if status == "plain":
        fixed = {f.code for f in ctx.findings if f.edits and f.node is call}
        if "TM203" in fixed and decided.sampler == "eval":
            return "eval"
        if "TM201" in fixed and decided.sampler == "distributed":
            return "distributed"
        return None
    if status == "distributed" and isinstance(call, cst.Call):
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "sampler" and isinstance(a.value, cst.Call):
                name = ctx.resolve(a.value.func)
                if name == RUNTIME + ".eval_sampler":
                    return "eval"
                if name in (RUNTIME + ".sampler", *DIST_SAMPLERS):
                    return "distributed"
        return "distributed" if decided.sampler == "distributed" else None
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
        return out
    kinds = {_sharding(ctx, l) for l in loaders}
    text = code(node).replace(" ", "")
    if kinds == {"eval"}:
        out.dataset.add(f"{text}.dataset")
        if len(loaders) == 1 and isinstance(loaders[0].dataset, (cst.Name, cst.Attribute)):
            out.dataset.add(code(loaders[0].dataset))
    elif kinds == {"distributed"}:
        out.batches.add(text)
    return out

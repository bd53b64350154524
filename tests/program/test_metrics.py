"""The metric facts (`program.metrics`) without any rule: which loops iterate a loader, what a name
holds before the loop, what happens to it after, and which calls compute a metric."""

from __future__ import annotations

import textwrap

import libcst as cst

from torchmigrate import analysis
from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.metrics import (events_after, initial_value, leaves_early, loader_expr, loader_loop,
                                          metric_name, reassigned_in, starts_empty_list)
from torchmigrate.rule import Options

EVALUATE = """
    import torch
    from sklearn.metrics import roc_auc_score
    from torch.utils.data import DataLoader
    from tqdm import tqdm

    val = DataLoader(val_ds, batch_size=64)

    def evaluate(model):
        correct, total = 0, 0
        preds = []
        for i, (x, y) in enumerate(tqdm(val)):
            out = model(x)
            correct += (out.argmax(1) == y).sum().item()
            total += y.size(0)
            preds.append(out)
        auc = roc_auc_score(y, torch.cat(preds))
        return correct / total, auc

    def steps(items):
        count = 0
        for item in items:
            count += 1
        return count
"""


def context(source: str):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [])


def loops(ctx):
    return [n for n in ctx.nodes(cst.For)]


def test_loops_over_loaders_and_the_loader_they_iterate():
    ctx = context(EVALUATE)
    over_loader, over_items = loops(ctx)
    aug = next(n for n in ctx.within(over_loader, cst.AugAssign))
    assert loader_loop(ctx, aug) is over_loader
    assert loader_loop(ctx, next(n for n in ctx.within(over_items, cst.AugAssign))) is None
    assert code(loader_expr(ctx, over_loader.iter)) == "val"  # through enumerate(...) and tqdm(...)


def test_what_a_name_holds_before_the_loop():
    ctx = context(EVALUATE)
    loop = loops(ctx)[0]
    found, value = initial_value(ctx, loop, "total")
    assert found and code(value) == "0"
    assert starts_empty_list(ctx, loop, "preds")
    assert not starts_empty_list(ctx, loop, "total")
    assert not reassigned_in(ctx, loop, "total")
    assert reassigned_in(ctx, loop, "out")
    assert not leaves_early(ctx, loop)


def test_reads_after_the_loop_and_metric_calls():
    ctx = context(EVALUATE)
    loop = loops(ctx)[0]
    events = events_after(ctx, loop, {"correct", "total"})
    assert [code(u) for u in events["correct"].uses] == ["correct"]
    assert not events["total"].collective and not events["total"].augs
    names = {metric_name(ctx, c) for c, _ in analysis.facts(ctx).calls}
    assert "roc_auc_score" in names
    assert not {"cat", "sum", "append"} & names

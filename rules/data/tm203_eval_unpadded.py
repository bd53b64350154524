"""TM203: evaluation DataLoaders get an unpadded sampler (every sample exactly once)."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.program.loaders import DIST_SAMPLERS, Loader, bind_args, calls_within, is_literal, key_of
from torchmigrate.rule import Example
from torchmigrate.rules.data.base import DataRule


class EvalUnpadded(DataRule):
    """
    ## What it does
    Gives evaluation loaders (their name, dataset, enclosing function or a `train=False` /
    `split="val"` argument says val/valid/validation/test/eval/dev) an unpadded sampler,
    `sampler=tm.eval_sampler(dataset)`, and drops `shuffle`. In `lint`, in files that already
    use torch.distributed, it reports evaluation loaders sharded with a `DistributedSampler`.

    An evaluation loader whose batch size is a computed group size (`batch_size=num_neg + 1`:
    each batch is one user's positive and negatives, read as `item[0]`) is kept unsharded and
    reported: sharding by sample would split every group across ranks and silently change the
    metric (found on guoyang9/NCF).

    ## Why is this bad?
    Without a sampler every rank evaluates the whole set (N times the work); with a
    `DistributedSampler` the set is padded with repeated samples so that it divides evenly, so
    metrics count some samples twice (5 samples on 2 ranks: rank 1 gets `[1, 3, 0]`).
    `tm.eval_sampler` gives rank r the samples r, r+N, r+2N, ...: each sample exactly once.
    Reduce the per-rank counts afterwards (TM701) or gather predictions (TM702).

    ## Limitations
    Ranks may then run one batch fewer than others, which is safe only when no per-batch
    collective runs during evaluation: evaluate under `torch.no_grad()` (a DDP forward with
    gradients enabled may broadcast buffers) or through `tm.unwrap(model)`. In files that are
    already distributed, evaluation loaders without a sampler are left alone (rank-0-only
    evaluation is a valid design).
    """

    code = "TM203"
    name = "eval-unpadded"
    summary = "Shard evaluation DataLoaders without padding (every sample exactly once)"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader
            val_loader = DataLoader(val_ds, batch_size=128, shuffle=False)
            """,
            after="""
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            val_loader = DataLoader(val_ds, batch_size=128, sampler=tm.eval_sampler(val_ds))
            """,
        ),
        Example(
            before="""
            import torch.utils.data as data
            test_loader = data.DataLoader(datasets.MNIST("data", train=False), batch_size=1000)
            """,
            after="""
            import torch.utils.data as data
            import torchmigrate.runtime as tm
            test_dataset = datasets.MNIST("data", train=False)
            test_loader = data.DataLoader(test_dataset, batch_size=1000, sampler=tm.eval_sampler(test_dataset))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if not self.active():
            return
        facts, plan = self.facts, self.plan
        tm = self.ctx.tm
        for loader in facts.loaders:
            if loader.kind != "eval":
                continue
            status = plan.of(loader).status
            if status == "plain" and loader.ordered:
                if not facts.distributed:  # (said once, when the migration keeps it whole)
                    self.keep_ordered(loader)
            elif status == "plain" and not facts.distributed and loader.grouped:
                self.report(loader.call, f"kept unsharded: its batch size `{loader.grouped}` is a computed group size, as when each "
                                         "batch is one group (a user's candidate items, a query's documents) that "
                                         "sharding by sample would split; every rank evaluates the whole set, so "
                                         "its metrics agree across ranks: shard whole batches by hand for a speed-up")
            elif status == "plain" and not facts.distributed and plan.eval_whole(loader):
                self.keep_whole(loader)
            elif status == "plain" and not facts.distributed:
                what = f"`{loader.target}`" if loader.target else "this evaluation DataLoader"
                if plan.of(loader).eval_with_grad:
                    self.add_sampler(loader, (
                        f"{what} gives every rank the whole evaluation set: shard it. It is iterated with "
                        "gradients enabled, where a DDP forward broadcasts buffers and every rank must run the "
                        f"same number of batches, so it gets the padded `{tm}.sampler(..., shuffle=False)` (a "
                        f"few samples count twice); evaluate under `torch.no_grad()` to use `{tm}.eval_sampler`"))
                else:
                    self.add_sampler(loader, f"{what} gives every rank the whole evaluation set: shard it without "
                                             f"padding (`sampler={tm}.eval_sampler(...)`) so each sample counts once")
                self.sharded_unproven(loader)
            elif status in ("custom", "iterable", "unknown", "unhoistable") and not facts.distributed:
                self.manual(loader)
            elif status == "distributed" and not self.ctx.options.migrating and self._padded(loader):
                self.report(loader.call, "a DistributedSampler pads the evaluation set with repeated samples, so "
                                         "metrics count some samples twice: use "
                                         f"`sampler={tm}.eval_sampler(dataset)` (every sample once) when no "
                                         "per-batch collective runs during evaluation")

    def _padded(self, loader: Loader) -> bool:
        args = bind_args(loader.call) or {}
        sampler = args.get("sampler")
        if sampler is None:
            return False
        node = sampler.value
        values = [node] + [a.value for a in self.facts.assigns_at(loader.call, key_of(node) or "")]
        for value in values:
            for c in calls_within(self.ctx, value):
                if self.ctx.resolve(c.func) in DIST_SAMPLERS:
                    if any(a.keyword and a.keyword.value == "drop_last" and is_literal(a.value, "True") for a in c.args):
                        return False
                    return True
        return False


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
    Shards an evaluation loader (its name, dataset, enclosing function or a `train=False` /
    `split="val"` argument says val/valid/validation/test/eval/dev) with an unpadded sampler,
    `sampler=tm.eval_sampler(dataset)`, dropping `shuffle`, **only where the program model
    proves that every value computed from it is reduced across ranks before it is used**:

    - every use of the loader is a `for` loop of its module (not handed to another module or a
      library, not returned to another module, not iterated by a comprehension, not counted
      with `len()`);
    - each loop runs under `torch.no_grad()` on every rank (no rank guard) and to its end (no
      `break`/`return`), and no loop reads the loader's batch size as a shape;
    - each loop leaves behind only sums that TM701 reduces exactly (`correct += ...`,
      `loss_sum += loss.item() * n` divided by a count or by `len(loader.dataset)`) and lists
      of per-batch values whose only use is their mean, which TM703 gathers. A metric object
      (`matrix.add(...)`, `metric.update(...)`), a list of predictions for sklearn, an attribute
      or a file written in the loop is a value the tool cannot reduce.

    Otherwise the loader is **kept whole**: every rank evaluates the whole set, as the original
    did, so every rank computes the same numbers and the metrics rules reduce nothing over it
    (a reduction would count each sample once per rank). The report's notes say so in one line,
    with the reason. Its cost: each rank does the whole evaluation's work, so evaluation takes as
    long as in one process instead of 1/N of it (training is still sharded). In `ddp`, a whole
    evaluation loader bound to a name is followed by `tm.same_draws(loader)`: once training
    starts each rank draws its own random numbers (`tm.seed_per_rank()`), so a dataset that
    crops, samples points or frames at random, or a shuffled loader, would give each rank other
    numbers from the same set; while it is iterated every rank draws alike instead.

    `--shard-eval` (or `shard-eval = true` in `[tool.torchmigrate]`) shards evaluation loaders
    anyway and leaves a TODO naming the value that is not proven reduced. In `lint`, in files
    that already use torch.distributed, the rule reports evaluation loaders sharded with a
    `DistributedSampler`.

    An evaluation loader the tool cannot shard at all (its own `sampler=`/`batch_sampler=`, such
    as a few-shot episode sampler, an IterableDataset, arguments from `**kwargs`) is kept whole
    the same way in `ddp`,
    with `tm.same_draws`, and a note; in `lint` it is reported.

    An evaluation loader whose batch size is a computed group size (`batch_size=num_neg + 1`:
    each batch is one user's positive and negatives, read as `item[0]`) is kept unsharded even
    with `--shard-eval`: sharding by sample would split every group across ranks.

    ## Why is this bad?
    Without a sampler every rank evaluates the whole set (N times the work); with a
    `DistributedSampler` the set is padded with repeated samples so that it divides evenly, so
    metrics count some samples twice (5 samples on 2 ranks: rank 1 gets `[1, 3, 0]`).
    `tm.eval_sampler` gives rank r the samples r, r+N, r+2N, ...: each sample exactly once. But a
    sharded loader makes every value computed from it one rank's value; each one the tool does
    not reduce is a silent wrong number that then steers training (the best checkpoint, early
    stopping, `scheduler.step(val_loss)`), and code that relies on full batches or on dataset
    order breaks. So sharding is for evaluation the tool can prove right.

    ## Limitations
    The proof sees one module: a loader that reaches another module's `evaluate()` is kept
    whole (the metrics rules there know it from the program's calls, or ask the runtime:
    `over=loader`). Ranks of a sharded loader may run one batch fewer than others, which is
    safe only when no per-batch collective runs during evaluation, hence the `no_grad`
    condition. In files that are already distributed, evaluation loaders without a sampler are
    left alone (rank-0-only evaluation is a valid design).
    """

    code = "TM203"
    name = "eval-unpadded"
    summary = "Shard evaluation DataLoaders without padding where what is computed from them is reduced"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            import torch
            from torch.utils.data import DataLoader
            val_loader = DataLoader(val_ds, batch_size=128, shuffle=False)
            correct = total = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += y.size(0)
            print(correct / total)
            """,
            after="""
            import torch
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            val_loader = DataLoader(val_ds, batch_size=128, sampler=tm.eval_sampler(val_ds))
            correct = total = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += y.size(0)
                correct, total = tm.all_reduce(correct, total)
            print(correct / total)
            """,
            also=("TM701",),
        ),
        Example(
            before="""
            import torch
            from sklearn.metrics import f1_score
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            val_loader = DataLoader(val_ds, batch_size=128, shuffle=False)
            tm.same_draws(val_loader)
            with torch.no_grad():
                preds = [model(x).argmax(1) for x, _ in val_loader]
            print(f1_score(val_ds.targets, torch.cat(preds), average="macro"))
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
            # TODO(torchmigrate): TM203 sharded by --shard-eval (or `shard-eval = true`), but sharding may change what is computed from it, as not every value is proven reduced across ranks: no loop of this module iterates it. Make that value right across ranks by hand (TM701/TM702/TM703 reduce what they can), or evaluate the whole set on every rank (without --shard-eval)
            test_dataset = datasets.MNIST("data", train=False)
            test_loader = data.DataLoader(test_dataset, batch_size=1000, sampler=tm.eval_sampler(test_dataset))
            """,
            flags=("--shard-eval",),
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
            elif status in ("custom", "iterable", "unknown", "unhoistable") and not facts.distributed \
                    and self.ctx.options.migrating:
                # its own (batch) sampler makes the batches (episodes of a few-shot evaluation), its
                # dataset streams them, or its arguments are out of sight: every rank evaluates
                # them all, drawing alike, so the numbers agree
                self.keep_whole(loader, _unshardable(loader, status))
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


def _unshardable(loader: Loader, status: str) -> str:
    """Why the tool cannot shard an evaluation loader (it is kept whole)."""
    if status == "custom":
        return f"its own `{loader.custom_param}=` makes its batches"
    if status == "iterable":
        return "its dataset is an IterableDataset, which takes no sampler"
    if status == "unhoistable":
        return "its dataset expression cannot be moved out of the statement to take a sampler"
    return "its arguments are out of sight (`*args`, `**kwargs` or no dataset)"

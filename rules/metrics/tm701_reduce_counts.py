"""TM701 reduce-counts: counts and sums accumulated over a sharded loader, reduced across ranks.

After the migration every rank iterates its own shard of each loader, so counts and sums
accumulated in a loop are per rank. This rule reduces them once after the loop (one collective
for all of them, on every rank), when every division they take part in stays right (`plan`).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr, stmt
from torchmigrate.program.loaders import is_pure, refs_at
from torchmigrate.program.metrics import (dict_sums, divisions_of, events_after, initial_value, is_number, iterates_loader,
                                          leaves_early, loader_expr, loader_loop, loop_sums, named_like_loader,
                                          zeros_value)
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.program.batches import batch_facts
from torchmigrate.program.losses import summed_loss
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.scopes import names_in
from torchmigrate.program.syntax import ranged_loop
from torchmigrate.rules._active import active
from torchmigrate.rules.metrics.plan import exact_lens, loop_sharding


class ReduceCounts(Rule):
    """
    ## What it does
    For a loop over a data loader that accumulates counts or sums into plain numbers
    (`correct += (pred == y).sum().item()`, `total += y.size(0)`,
    `total_loss += loss.item() * x.size(0)`, `n += len(y)`, `n_batches += 1`) which are used
    after the loop, inserts one reduction right after the loop:

        correct, total = tm.all_reduce(correct, total)

    Only accumulators set to a number before the loop (in the same pass of any enclosing loop)
    qualify, and only when every division they take part in after the loop stays right once
    they are reduced:

    - accumulators of the same loop (`correct / total`, `100.0 * correct / max(total, 1)`);
    - `len(loader.dataset)` / `len(val_ds)` when the loader is sharded without padding by
      `tm.eval_sampler` (TM203): the per-rank sums add up to exactly the whole dataset;
    - `len(loader)` when the loader has a padded distributed sampler (TM201 / an existing
      `DistributedSampler`): every rank runs the same number of batches, so the sum is averaged
      over the ranks instead, `running = tm.all_reduce(running, op="mean")`.

    - `len(loader.dataset)` of a padded training loader, in a loop that trains (a training
      loss summed per sample and logged as a mean): the padding repeats at most
      world_size - 1 samples, a negligible change to a logged mean, so the sums are reduced.

    Any other denominator (`len(loader.dataset)` of a padded loader in a loop that does not
    train, `len(loader)` of an unpadded one, a loop index, a count from elsewhere) is reported
    instead, with the line to add.

    Entries of a dict summed with constant keys (`res["loss"] += loss.item() * n`,
    `res["counter"] += n`), the dict set to a literal before the loop, are reduced the same way
    (`res["loss"], res["counter"] = tm.all_reduce(res["loss"], res["counter"])`) when every later
    read of a summed entry is a division of summed entries, or a sum over samples shown as it is;
    otherwise (the dict returned whole, a sum of per-batch means shown as it is, PSNR derived
    from a summed MSE) the dict is reported.

    Lists of running sums summed by index (`loss_epoch[idx] += loss.item()`, one running loss
    per head or module; `correct[c] += ...; total[c] += ...`, per-class counts), set to a list of
    numbers before the loop (`[0] * n`, `[0.0 for _ in range(n)]`) and also summed from a loop
    over the heads or classes nested in the batch loop, are reduced element by element
    (`correct, total = tm.all_reduce(correct, total)`): summed where every value added is a
    count or a sum over samples, averaged over the ranks (`op="mean"`) where every value is one
    batch's mean in a training loop; any other list is reported with the line to add.

    An average finished inside the loop from its accumulators (`dice_avg = dice_sum / seen`, or
    `loss_sum / (batch_size * (i - 1) + len(x))` at the last batch) and read after it (the epoch's
    metric, returned and compared with the best one) is made the ranks' mean after the loop,
    `dice_avg = tm.all_reduce(dice_avg, op="mean")`: every rank runs as many batches of as many
    samples, so that is the average over the whole data.

    Only loops over a sharded loader need it. A loader every rank iterates in full (an
    evaluation loader TM203 keeps whole, or one the program's other modules hand this function
    under a name that says validation or test) gives sums of the whole set on every rank, and
    reducing them would count each sample once per rank: such loops are left alone. Where only
    the run can tell (a loader handed in from elsewhere, in a loop without a backward pass), the
    reduction takes the loader, `tm.all_reduce(correct, total, over=val_loader)`, and reduces
    only when it turns out sharded.

    ## Why is this bad?
    Under DDP each rank iterates its own shard, so an accuracy computed from rank-local counts
    describes one shard, and rank 0 logs and checkpoints on it (Lightning-AI/pytorch-lightning#1479).
    One reduction after the loop (not one per batch) costs a single collective. It must run on
    every rank: a loop under a rank guard, or in a function called under one, is reported
    instead (a collective on one rank hangs the job).

    `tm.all_reduce` is the identity in a single process, so the script still runs as
    `python train.py`.
    """

    code = "TM701"
    name = "reduce-counts"
    summary = "Reduce metric counts accumulated over a sharded loader across ranks"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            def evaluate(model, val_loader):
                correct, total = 0, 0
                for x, y in val_loader:
                    pred = model(x).argmax(1)
                    correct += (pred == y).sum().item()
                    total += y.size(0)
                return correct / total
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def evaluate(model, val_loader):
                correct, total = 0, 0
                for x, y in val_loader:
                    pred = model(x).argmax(1)
                    correct += (pred == y).sum().item()
                    total += y.size(0)
                correct, total = tm.all_reduce(correct, total, over=val_loader)
                return correct / total
            """,
        ),
        Example(
            before="""
            import torch
            def evaluate(model, val_loader):
                correct = 0
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                return correct / len(val_loader.dataset)
            """,
            after="""
            import torch
            def evaluate(model, val_loader):
                correct = 0
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                # TODO(torchmigrate): TM701 `correct` is a sum over this rank's shard but divided by `len(val_loader.dataset)`, the whole dataset: add `correct = tm.all_reduce(correct, over=val_loader)` after the loop (exact when the loader is sharded with tm.eval_sampler), or count samples in the loop (`n += y.size(0)`), reduce the count too and divide by it
                return correct / len(val_loader.dataset)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.augs: List[cst.AugAssign] = []
        self.dict_augs: List[cst.AugAssign] = []  # `results['mse'] += ...`
        self.averages: List[cst.Assign] = []  # `loss_avg = loss_avg * 0.8 + float(loss) * 0.2`
        self.quotients: List[cst.Assign] = []  # `dice_avg = dice_sum / n_seen`, inside a loop: see `_finished_means`
        # the lists and arrays summed by index that a reduction after a loop now sums (`matrix`)
        self.reduced_lists: Dict[cst.For, Set[str]] = {}

    def _dict_sums(self) -> None:
        """`res["loss"] += loss.item() * n; res["counter"] += n` in a loop over a sharded
        loader: a dict of running sums over this rank's shard (egnn's `res`, SRGAN's
        `valing_results`). Where every later read of a summed entry is a division of summed
        entries (`res["loss"] / res["counter"]`), one reduction of the entries after the loop
        makes them the whole data's; otherwise (the dict returned or saved whole, an entry shown
        as it is, PSNR derived from a summed MSE) which entries are sums is the user's to say,
        and it is reported once per dict and loop (for a training loop, only where the dict is
        read after it)."""
        ctx = self.ctx
        seen: Set[Tuple[cst.CSTNode, str]] = set()
        for aug in self.dict_augs:
            loop = loader_loop(ctx, aug)
            name = aug.target.value.value
            if loop is None or (loop, name) in seen:
                continue
            seen.add((loop, name))
            sharding = loop_sharding(ctx, loop)
            if sharding == "whole":
                continue
            found = dict_sums(ctx, loop, name)
            if found.reduced:
                continue
            trains = analysis.runs_backward(ctx, loop)
            if trains and not found.used_after:
                continue  # a training loop's running sums that nothing reads afterwards
            if trains and found.keys and found.counters == found.keys:
                continue  # `state["itr"] += 1`: a step count, alike on ranks that run as many steps
            over = code(loader_expr(ctx, loop.iter)) if sharding == "unknown" else None
            if over is not None and not is_pure(loader_expr(ctx, loop.iter)):
                over = None
            if found.reducible and not leaves_early(ctx, loop):
                entries = [f'{name}["{k}"]' for k in found.keys]
                line = _reduce_line(ctx.tm, entries, f", over={over}" if over else "")
                if collective_guard(ctx, loop) is not None:
                    self.report(loop, f"`{name}[...]` sums values over this rank's shard only, but this loop runs "
                                      f"under a rank guard, where a reduction would hang the other ranks: evaluate on "
                                      f"every rank and add `{line}` after the loop", statement=ctx.statement_of(loop))
                    continue
                self.report(loop, f"`{name}[...]` sums values over this rank's shard only; reduce the summed entries "
                                  f"across ranks after the loop"
                                  + (f" (`over={over}`: left as they are where the loader is not sharded)" if over else ""),
                            edits=[insert_after(loop, [_reduce_statement(ctx.tm, entries, "", over, _depth(ctx, loop))])],
                            imports=[ctx.runtime_import()])
                continue
            self.report(aug, f"`{name}[...]` sums values over this rank's shard of the loader only: reduce the summed "
                             f"entries across ranks after the loop (`{name}[k] = {ctx.tm}.all_reduce({name}[k])`) "
                             f"and compute what is derived from them (means, PSNR) afterwards",
                        statement=ctx.statement_of(loop))

    def _list_sums(self) -> Set[str]:
        """`loss_epoch[idx] += loss.item()` (one running loss per head or module),
        `correct[c] += ...; total[c] += ...` (per-class counts), `matrix[t, p] += 1` (a confusion
        matrix): a list of running sums, or a zero array or tensor, set to numbers before a loop over a sharded loader, summed by index in it (also from
        a loop over the heads or classes nested in it). The lists of one loop are reduced
        together after it, element by element: summed where every value added is a count or a
        sum over samples, averaged over the ranks (`op="mean"`) where every value is one
        batch's mean loss in a training loop (each rank runs as many batches, so the mean of the
        ranks' totals is the original's); anything else is reported. The names handled, so the
        dict path leaves them alone."""
        ctx = self.ctx
        by_loop: Dict[cst.For, Dict[str, List[cst.AugAssign]]] = {}
        for aug in self.dict_augs:
            name = aug.target.value.value
            loop = _data_loop(ctx, aug)
            if loop is None:
                continue
            found, value = initial_value(ctx, loop, name)
            if found and (_number_list(value) or zeros_value(value)):
                by_loop.setdefault(loop, {}).setdefault(name, []).append(aug)
        handled: Set[str] = set()
        for loop, lists in by_loop.items():
            handled |= set(lists)
            sharding = loop_sharding(ctx, loop)
            if sharding == "whole":
                continue
            events = events_after(ctx, loop, set(lists))
            used = [n for n in lists if events[n].uses or events[n].augs]
            if not used or any(events[n].collective for n in used):
                continue  # read by nothing after the loop, or reduced already (a second run)
            trains = analysis.runs_backward(ctx, loop)
            groups: Dict[Optional[str], List[str]] = {}
            for n in used:
                values = [a.value for a in lists[n]]
                op = None
                if _counted(ctx, loop, n):
                    if all(_PER_SAMPLE_SUM.search(code(v)) or _one_per_item(ctx, loop, a) or _value_per_item(ctx, loop, a)
                           for v, a in zip(values, lists[n])):
                        op = ""
                    elif trains and all(_batch_mean(v) for v in values):
                        op = "mean"
                groups.setdefault(op, []).append(n)
            over = code(loader_expr(ctx, loop.iter)) if sharding == "unknown" else None
            if over is not None and not is_pure(loader_expr(ctx, loop.iter)):
                over = None
            guard = collective_guard(ctx, loop)
            statements = []
            for op, names in groups.items():
                listed = ", ".join(f"`{n}`" for n in names)
                one = len(names) == 1
                line = _reduce_line(ctx.tm, names, (f', op="{op}"' if op else "") + (f", over={over}" if over else ""))
                if op is None or guard is not None or leaves_early(ctx, loop):
                    why = ("this loop runs under a rank guard, where a reduction would hang the other ranks: evaluate "
                           "on every rank and add" if guard is not None else
                           "sum them across ranks where they add up samples, average them where they add up one "
                           "value per batch, by adding")
                    self.report(loop, f"{listed} {'sums' if one else 'sum'} values by index over this rank's shard "
                                      f"only: {why} `{line}` after the loop (`op=\"mean\"` for an average)",
                                statement=ctx.statement_of(loop))
                    continue
                statements.append(_reduce_statement(ctx.tm, names, op, over, _depth(ctx, loop)))
                if not op:
                    self.reduced_lists.setdefault(loop, set()).update(names)
                self.report(loop, f"{listed} {'sums' if one else 'sum'} values by index over this rank's shard only; "
                                  f"reduce {'it' if one else 'them'} across ranks after the loop, element by element"
                                  + (" (the ranks' mean: each entry adds one mean per batch, and every rank runs as "
                                     "many batches)" if op == "mean" else "")
                                  + (f" (`over={over}`: left as {'it is' if one else 'they are'} where the loader is "
                                     "not sharded)" if over else ""),
                            edits=[insert_after(loop, [statements[-1]])], imports=[ctx.runtime_import()])
        return handled

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name) \
                and _running_average(node.value, node.targets[0].target.value):
            self.averages.append(node)
        elif len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name) \
                and isinstance(node.value, cst.BinaryOperation) and isinstance(node.value.operator, cst.Divide):
            self.quotients.append(node)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, cst.AddAssign) and isinstance(node.target, cst.Name) \
                and _incremental_step(node.value, node.target.value):
            self.averages.append(node)  # `avg += (loss.item() - avg) / i`: a running mean, not a sum
        elif isinstance(node.operator, cst.AddAssign) and isinstance(node.target, cst.Name):
            self.augs.append(node)
        elif isinstance(node.operator, cst.AddAssign) and isinstance(node.target, cst.Subscript) \
                and isinstance(node.target.value, cst.Name):
            self.dict_augs.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        lists = self._list_sums()
        self.dict_augs = [a for a in self.dict_augs if a.target.value.value not in lists]
        self._dict_sums()
        for average in self.averages:
            self._moving_average_after(average)
        if not self.augs:
            return
        loops: Dict[cst.CSTNode, List[str]] = {}
        for aug in self.augs:
            loop = loader_loop(ctx, aug)
            if loop is None:
                continue
            names = loops.setdefault(loop, [])
            if aug.target.value not in names:
                names.append(aug.target.value)
        for loop, names in loops.items():
            self._loop(loop, names)
        self._finished_means(loops)

    def _finished_means(self, loops: Dict[cst.CSTNode, List[str]]) -> None:
        """`train_dice_avg = dice_sum / (batch_size * (i - 1) + len(images))` at the last batch
        (or at every one), read after the loop (returned as the epoch's metric, compared with
        the best one to keep a checkpoint or stop early): an average of this rank's shard, made
        the ranks' mean right after the loop (every rank runs as many batches of as many
        samples, so it is the average over the whole data). Only names bound in the loop by
        such quotients alone, each dividing an accumulator of the loop (`dice_sum += ...`, set
        to a number before it)."""
        ctx = self.ctx
        found: Dict[cst.CSTNode, List[str]] = {}
        for assign in self.quotients:
            loop = loader_loop(ctx, assign)
            name = assign.targets[0].target.value
            if loop is None or loop not in loops or name in loops[loop] or name in found.get(loop, []):
                continue
            sums = [n for n in loops[loop] if n in names_in(ctx, assign.value.left)]
            if not any(initial_value(ctx, loop, n)[0] and is_number(initial_value(ctx, loop, n)[1]) for n in sums):
                continue
            bindings = [n for n in ctx.within(loop.body, cst.Assign, cst.AugAssign, skip_defs=True)
                        if any(isinstance(t, cst.Name) and t.value == name for t in (
                            [x.target for x in n.targets] if isinstance(n, cst.Assign) else [n.target]))]
            if not all(b in self.quotients and any(n in names_in(ctx, b.value.left) for n in loops[loop]) for b in bindings):
                continue
            if loop_sharding(ctx, loop) == "whole" or leaves_early(ctx, loop) or collective_guard(ctx, loop) is not None:
                continue
            events = events_after(ctx, loop, {name})[name]
            if events.collective or events.augs or not events.uses:
                continue
            found.setdefault(loop, []).append(name)
        tm = ctx.tm
        for loop, names in found.items():
            listed = ", ".join(f"`{n}`" for n in names)
            self.report(loop, f"{listed} {'is an average' if len(names) == 1 else 'are averages'} of this rank's shard "
                              "only, finished inside the loop and read after it (an epoch's metric, compared or "
                              "returned): made the ranks' mean after the loop",
                        edits=[insert_after(loop, [_reduce_statement(tm, names, "mean", None, _depth(ctx, loop))])],
                        imports=[ctx.runtime_import()])

    def _moving_average_after(self, assign) -> None:
        """`loss_avg = loss_avg * 0.8 + float(loss) * 0.2` (or a running mean, `avg += (loss.item()
        - avg) / i`) over a sharded loader, read after the loop (a results file, a printed epoch
        line): the ranks' mean right after the loop. Both averages are linear in what they
        average, and every rank runs as many batches, so the mean of the ranks' averages is the
        average of the steps' means over the ranks' parts: the original's average over whole
        batches. (Its reads inside the loop stay each rank's own.)"""
        ctx = self.ctx
        name = assign.target.value if isinstance(assign, cst.AugAssign) else assign.targets[0].target.value
        loop = loader_loop(ctx, assign)
        if loop is None or loop_sharding(ctx, loop) == "whole" or leaves_early(ctx, loop):
            return
        found, value = initial_value(ctx, loop, name)
        if not (found and value is not None and is_number(value)):
            return
        bindings = [n for n in ctx.within(loop.body, cst.Assign, cst.AugAssign, skip_defs=True)
                    if any(isinstance(t, cst.Name) and t.value == name
                           for t in ([x.target for x in n.targets] if isinstance(n, cst.Assign) else [n.target]))]
        if bindings != [assign]:
            return
        events = events_after(ctx, loop, {name})[name]
        if events.collective or events.augs or not events.uses or collective_guard(ctx, loop) is not None:
            return
        tm = ctx.tm
        self.report(assign, f"`{name}` is a moving average of this rank's batches only: it is made the ranks' mean "
                            f"after the loop (`{tm}.all_reduce({name}, op=\"mean\")`), the average over whole "
                            "batches that one process computes",
                    edits=[insert_after(loop, [_reduce_statement(tm, [name], "mean", None, _depth(ctx, loop))])],
                    imports=[ctx.runtime_import()])

    def _total_of_batch_means(self, loop: cst.For, name: str) -> bool:
        """`total_loss += loss.item()` over the batches of a loader whose batch this run divides
        (each rank loads batch_size / world_size, so it runs as many batches as the original), the
        total then shown or stored as it is (no division after the loop): summed across ranks it
        would be world_size times the original's total; their mean is the original's."""
        ctx = self.ctx
        if not self._shown_total(loop, name):
            return False
        from torchmigrate.rules.model.batch import batch_sites

        try:
            loaders = {id(l) for r in refs_at(ctx, loader_expr(ctx, loop.iter)) for l in r.loaders}
        except Exception:  # noqa: BLE001 - without the loader facts, the sum stays a sum
            return False
        return any(id(site.loader) in loaders and not site.kept for site in batch_sites(ctx))

    def _steps_alike(self, loop: cst.For, name: str) -> bool:
        """`_l_g += loss_gen.item()` in a loop over a count of steps that every rank runs in full
        (`for i in range(args.n_dis):`, whose batches come from a sharded loader one `next()` at a
        time; no batch loop the data rules share out): each rank adds as many batch means as one
        process, so the ranks' mean of the totals is the original's total (their sum would be
        world_size times it)."""
        if not _counter(loop.iter) or any(b.loop is loop for b in batch_facts(self.ctx).loops):
            return False
        return self._adds_batch_means(loop, name)

    def _adds_batch_means(self, loop: cst.For, name: str) -> bool:
        """Every update of `name` in `loop` adds one batch mean (`+= loss.item()`, the loss not
        surely summed over its batch), and there is one."""
        augs = self._augs(loop, name)
        for a in augs:
            if not (isinstance(a.operator, cst.AddAssign) and _batch_mean(a.value)):
                return False
            inner = a.value.func.value if isinstance(a.value.func, cst.Attribute) else a.value.args[0].value
            if summed_loss(self.ctx, inner):
                return False
        return bool(augs)

    def _handed_total(self, loop: cst.For, name: str) -> Optional[str]:
        """The loader (a parameter) of a training loop whose `name` is a total of batch means
        shown as it is, where the loader comes from elsewhere (`def train_model(model,
        train_dataloader)`): whether each rank ran as many batches as the original (its batch
        divided) or its share of them, only the run can tell (`tm.reduce_batch_total`)."""
        ctx = self.ctx
        node = loader_expr(ctx, loop.iter)
        if not isinstance(node, cst.Name) or not analysis.runs_backward(ctx, loop) or not self._shown_total(loop, name):
            return None
        try:
            if any(r.loaders for r in refs_at(ctx, node)):
                return None  # a loader of this module: `_total_of_batch_means` knows
        except Exception:  # noqa: BLE001 - without the loader facts, the run decides
            pass
        return node.value

    def _augs(self, loop: cst.For, name: str) -> List[cst.AugAssign]:
        """The in-place updates of the plain name `name` in `loop`'s body (not in defs there)."""
        return [a for a in self.ctx.within(loop.body, cst.AugAssign, skip_defs=True)
                if isinstance(a.target, cst.Name) and a.target.value == name]

    def _sums_batch_means(self, loop: cst.For, name: str) -> bool:
        """`name` adds one batch mean per step of a training loop (`train_loss += loss.item()`,
        the loss not surely summed over its batch): `tm.reduce_batch_total` makes the ranks' total
        the original's, averaged where each rank ran as many batches, summed where it ran its share."""
        ctx = self.ctx
        if not analysis.runs_backward(ctx, loop) or not self._adds_batch_means(loop, name):
            return False
        # divided by a count of samples only (`/ num_samples`, `/ len(loader.dataset)`): a mean of
        # batch means over a count of steps (`/ count` with `count += 1`) stays a plain sum
        uses = events_after(ctx, loop, {name})[name].uses
        divisions = [d for u in uses for d in divisions_of(ctx, u)]
        return bool(divisions) and len(divisions) == len(uses) and all(self._samples(loop, d.right) for d in divisions)

    def _samples(self, loop: cst.For, node: cst.BaseExpression) -> bool:
        """`node` counts samples: `len(X.dataset)`, or a name the loop adds batch sizes to."""
        text = code(node).replace(" ", "")
        if text.startswith("len(") and text.endswith(".dataset)"):
            return True
        if not isinstance(node, cst.Name):
            return False
        augs = self._augs(loop, node.value)
        return bool(augs) and all(isinstance(a.operator, cst.AddAssign) and not isinstance(a.value, cst.Integer)
                                  and _PER_SAMPLE_SUM.search(code(a.value)) for a in augs)

    def _counts_samples(self, loop: cst.For, name: str) -> bool:
        """`name` adds a count or sum over each batch's samples in `loop` (`correct += (p ==
        y).sum().item()`) and is divided after it (by the loop's batch count)."""
        augs = self._augs(loop, name)
        events = events_after(self.ctx, loop, {name})[name]
        return any(_PER_SAMPLE_SUM.search(code(a.value)) and not _batch_mean(a.value) for a in augs) \
            and (bool(events.augs) or any(divisions_of(self.ctx, u) for u in events.uses))

    def _shown_total(self, loop: cst.For, name: str) -> bool:
        """`name` only adds one batch mean per step in `loop` (`total_loss += loss.item()`) and
        after it is shown or stored as it is, in no arithmetic and changed no more."""
        ctx = self.ctx
        augs = self._augs(loop, name)
        if not augs or not all(isinstance(a.operator, cst.AddAssign) and _batch_mean(a.value) for a in augs):
            return False
        events = events_after(ctx, loop, {name})[name]
        return not events.augs and not any(self._in_arithmetic(u) for u in events.uses)

    def _in_arithmetic(self, use: cst.CSTNode) -> bool:
        """`use` is an operand of arithmetic, also through a conversion (`float(total) / count`)."""
        for anc in self.ctx.ancestors(use):
            if isinstance(anc, cst.BinaryOperation):
                # `"loss %.3f" % (epoch, total)`: formatting, not arithmetic
                return not (isinstance(anc.operator, cst.Modulo)
                            and isinstance(anc.left, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)))
            if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                return False
            if isinstance(anc, cst.Call) and not (isinstance(anc.func, cst.Name) and anc.func.value in ("float", "int")):
                return False
        return False

    def _loop(self, loop: cst.For, names: List[str]) -> None:
        ctx = self.ctx
        sharding = loop_sharding(ctx, loop)
        if sharding == "whole":
            return  # every rank iterates the whole loader: its sums are the whole data's already
        exact = exact_lens(ctx, loop)
        found = loop_sums(ctx, loop, names, exact, also=self.reduced_lists.get(loop, set()))
        kind, foreign = found.kinds, found.foreign
        for name in [n for n, k in kind.items() if k == "sum" and (self._total_of_batch_means(loop, n)
                                                                    or self._steps_alike(loop, n))]:
            kind[name] = "mean"
        for name in [n for n, k in kind.items() if k == "mean-or-sum"]:
            # `train_loss < min_train_loss` before `train_loss /= len(loader)`: the ranks' mean, so
            # every rank takes the same decision (which best model it saves and returns); the raw
            # sum of batch means is also the original's where each rank runs as many batches as it
            # did (its batch divided), else it is that sum over this rank's share of the batches
            kind[name] = "mean"
        counted = [n for n, k in kind.items() if k == "mean" and self._counts_samples(loop, n)]
        for name in counted:
            # `correct / len(loader)`: samples per batch, whose ranks' mean is the original's only
            # where the batch was not divided; the division is the user's to settle
            del kind[name]
            events = events_after(ctx, loop, {name})[name]
            foreign[name] = next((d for u in events.uses for d in divisions_of(ctx, u)), None) or events.augs[0]
        tm = ctx.tm
        # a loader whose sharding only the run knows: reduce where it turns out sharded
        over = code(loader_expr(ctx, loop.iter)) if sharding == "unknown" else None
        if over is not None and not is_pure(loader_expr(ctx, loop.iter)):
            over = None
        ordered = [n for n in names if n in kind]
        if ordered:
            sums = [n for n in ordered if kind.get(n) != "mean"]
            means = [n for n in ordered if kind.get(n) == "mean"]
            handed = {n: h for n in sums if (h := self._handed_total(loop, n))}
            loader_node = loader_expr(ctx, loop.iter)
            if isinstance(loader_node, (cst.Name, cst.Attribute)) and is_pure(loader_node):
                # `train_loss += loss.item()` then `train_loss / num_samples`: a sum of batch
                # means, which the ranks' sum would count W times where each ran as many batches
                handed.update({n: code(loader_node) for n in sums
                               if n not in handed and self._sums_batch_means(loop, n)})
            sums = [n for n in sums if n not in handed]
            depth = _depth(ctx, loop)
            lines, statements = [], []
            for n, loader in handed.items():
                lines.append(f"{n} = {tm}.reduce_batch_total({n}, over={loader})")
                statements.append(stmt(lines[-1]))
            extra = f", over={over}" if over else ""
            if sums:
                lines.append(_reduce_line(tm, sums, extra))
                statements.append(_reduce_statement(tm, sums, "", over, depth))
            if means:
                lines.append(_reduce_line(tm, means, ', op="mean"' + extra))
                statements.append(_reduce_statement(tm, means, "mean", over, depth))
            guard = collective_guard(ctx, loop)
            listed = ", ".join(f"`{n}`" for n in ordered)
            one = len(ordered) == 1
            shard = "this rank's shard" if not over else f"this rank's shard when `{over}` is sharded"
            if guard is not None:
                self.report(loop, f"{listed} {'counts' if one else 'count'} only {shard}, but this loop "
                                  f"runs under a rank guard, where a reduction would hang the other ranks: evaluate "
                                  f"on every rank and add `{'; '.join(lines)}` after the loop",
                            statement=ctx.statement_of(loop))
            else:
                self.report(loop, f"{listed} {'counts' if one else 'count'} only {shard}; reduce "
                                  f"{'it' if one else 'them'} across ranks after the loop"
                                  + (f" (`over={over}`: left as {'it is' if one else 'they are'} where the loader "
                                     "is not sharded)" if over else ""),
                            edits=[insert_after(loop, statements)],
                            imports=[ctx.runtime_import()])
        # one finding per denominator: `running_loss / len(loader)` (a mean of batch values) and
        # `correct / len(loader.dataset)` (a count of samples) need different reductions
        by_den: Dict[str, List[str]] = {}
        for n in names:
            if n in foreign:
                by_den.setdefault(_denominator(foreign[n]), []).append(n)
        for den, bad_names in by_den.items():
            first = foreign[bad_names[0]]
            if isinstance(first, (cst.BinaryOperation, cst.AugAssign)) and den in bad_names:
                # the count is the denominator of something the loop does not add up in a number
                # (`sum(losses) / n_samples`, a list of tensors, `c /= n` of a cloned tensor)
                left = first.left if isinstance(first, cst.BinaryOperation) else first.target
                self.report(first, f"`{code(first)}` is this rank's value only: `{den}` counts this rank's "
                                   f"shard and `{code(left)}` is not a number the loop adds to; report the "
                                   f"ranks' mean (`{tm}.all_reduce(value, op=\"mean\")`) or sum both parts "
                                   f"across ranks before dividing")
            else:
                self.report(first, _manual_message(tm, bad_names, den, padded=bool(exact.batches), over=over,
                                                   counts=all(n in counted for n in bad_names)))


# a count or a sum over a batch's samples (`(pred == y).sum().item()`, `y.size(0)`, `len(y)`)
_PER_SAMPLE_SUM = re.compile(r"\.sum\(|size\(|len\(|shape\[|numel\(|count")


def _counter(node: cst.BaseExpression) -> bool:
    """`range(n)`, `trange(n)`, `tqdm(range(n))`, `enumerate(range(n))`: a count of steps."""
    while isinstance(node, cst.Call) and code(node.func).rsplit(".", 1)[-1] in ("tqdm", "enumerate") and node.args:
        node = node.args[0].value
    return isinstance(node, cst.Call) and code(node.func).rsplit(".", 1)[-1] in ("range", "trange")


def _running_average(value: cst.BaseExpression, name: str) -> bool:
    """The value of `name = ...` updates an average of per-batch values: an exponential moving
    average (`_moving_average`), or a running mean, `avg + (x - avg) / i` or `(avg * (i - 1) + x) / i`."""
    if _moving_average(value, name):
        return True
    if not isinstance(value, cst.BinaryOperation):
        return False
    if isinstance(value.operator, cst.Add):
        return any(isinstance(kept, cst.Name) and kept.value == name and _incremental_step(step, name)
                   for kept, step in ((value.left, value.right), (value.right, value.left)))
    if isinstance(value.operator, cst.Divide) and isinstance(value.left, cst.BinaryOperation) \
            and isinstance(value.left.operator, cst.Add):
        total = value.left
        return any(isinstance(kept, cst.BinaryOperation) and isinstance(kept.operator, cst.Multiply)
                   and any(isinstance(side, cst.Name) and side.value == name for side in (kept.left, kept.right))
                   and name not in _names(new) and name not in _names(value.right)
                   for kept, new in ((total.left, total.right), (total.right, total.left)))
    return False


def _incremental_step(value: cst.BaseExpression, name: str) -> bool:
    """`(x - name) / i`: the step a running mean takes toward the next value (`name += ...`)."""
    return isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide) \
        and isinstance(value.left, cst.BinaryOperation) and isinstance(value.left.operator, cst.Subtract) \
        and isinstance(value.left.right, cst.Name) and value.left.right.value == name \
        and name not in _names(value.left.left) and name not in _names(value.right)


def _moving_average(value: cst.BaseExpression, name: str) -> bool:
    """`name * a + b * float(loss)`, `a * name + (1 - a) * loss.item()`: `name` once, scaled by
    a number, plus a term of a per-batch value (a call) without it."""
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add)):
        return False
    for kept, new in ((value.left, value.right), (value.right, value.left)):
        if isinstance(kept, cst.BinaryOperation) and isinstance(kept.operator, cst.Multiply) and any(
                isinstance(side, cst.Name) and side.value == name for side in (kept.left, kept.right)) \
                and any(isinstance(side, (cst.Float, cst.Integer, cst.Name)) and not (
                    isinstance(side, cst.Name) and side.value == name) for side in (kept.left, kept.right)):
            return name not in _names(new) and "(" in code(new)
    return False


def _names(node: cst.CSTNode) -> List[str]:
    out: List[str] = []

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            out.append(n.value)
        for child in n.children:
            go(child)

    go(node)
    return out


def _data_loop(ctx: Context, node: cst.CSTNode) -> Optional[cst.For]:
    """The loop over data around `node` in its function: the nearest `for` over a loader, or one
    that runs a training step itself over something other than `range(...)` (a loop over the
    heads, classes or modules nested in the batch loop is not it)."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if not isinstance(anc, cst.For):
            continue
        if iterates_loader(ctx, anc.iter) or (not ranged_loop(anc) and analysis.trains_itself(ctx, anc)):
            return anc
    return None


def _number_list(value: Optional[cst.BaseExpression]) -> bool:
    """`[0, 0.0]`, `[0] * n`, `[0.0 for _ in range(n)]`: a list of numbers to sum into by index;
    also a dict of numbers by key, `{i: 0 for i in range(10)}` (per-timestep loss bins), whose
    keys are alike on every rank."""
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply):
        return _number_list(value.left) or _number_list(value.right)
    if isinstance(value, cst.List):
        return bool(value.elements) and all(is_number(e.value) for e in value.elements)
    if isinstance(value, cst.DictComp):
        return is_number(value.value) and isinstance(value.for_in.iter, cst.Call) \
            and (dotted(value.for_in.iter.func) or "") == "range"
    return isinstance(value, cst.ListComp) and is_number(value.elt)


def _one_per_item(ctx: Context, loop: cst.For, aug: cst.AugAssign) -> bool:
    """`matrix[t, p] += 1` (or `+= 1.0`) in a loop over a batch's items nested in `loop` (a
    confusion matrix): one count per sample."""
    inner = ctx.enclosing(aug, cst.For)
    one = isinstance(aug.value, (cst.Integer, cst.Float)) and float(aug.value.value.replace("_", "")) == 1
    return one and inner is not None and inner is not loop


def _value_per_item(ctx: Context, loop: cst.For, aug: cst.AugAssign) -> bool:
    """`lossbin[int(t * 10)] += l` with `l` a target of a loop over the batch's items nested in
    `loop` (`for t, l in zip(ts.tolist(), losses.tolist()):`): one value per sample, a sum over
    samples like a count."""
    inner = ctx.enclosing(aug, cst.For)
    if inner is None or inner is loop or not isinstance(aug.value, cst.Name):
        return False
    targets = {n.value for n in ctx.within(inner.target, cst.Name)} | (
        {inner.target.value} if isinstance(inner.target, cst.Name) else set())
    return aug.value.value in targets


def _counted(ctx: Context, loop: cst.For, name: str) -> bool:
    """Inside `loop`, `name` is only summed into by index (`name[i] += v`) and read, never
    rebound, appended to or written otherwise."""
    for node in ctx.within(loop.body, cst.AugAssign, cst.Assign, skip_defs=True):
        targets = [node.target] if isinstance(node, cst.AugAssign) else [t.target for t in node.targets]
        for t in targets:
            if isinstance(t, cst.Name) and t.value == name:
                return False
            if isinstance(t, cst.Subscript) and isinstance(t.value, cst.Name) and t.value.value == name \
                    and not (isinstance(node, cst.AugAssign) and isinstance(node.operator, cst.AddAssign)):
                return False
    return not any(isinstance(c.func, cst.Attribute) and isinstance(c.func.value, cst.Name)
                   and c.func.value.value == name for c in ctx.within(loop.body, cst.Call, skip_defs=True))


_BATCH_MEAN = re.compile(r"(?i)(loss|err|nll|acc|ppl|mse|mae|psnr|ssim)")


def _batch_mean(value: cst.BaseExpression) -> bool:
    """`loss.item()`, `float(loss)`, `slot_loss.data.item()`: one batch's mean loss or metric,
    not a count or a sum over its samples (`loss.item() * x.size(0)`)."""
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "item":
        inner = value.func.value
    elif isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and value.func.value == "float" \
            and len(value.args) == 1:
        inner = value.args[0].value
    else:
        return False
    return bool(_BATCH_MEAN.search(code(inner)))


def _depth(ctx: Context, loop: cst.For) -> int:
    """The columns of indentation of a statement beside `loop`."""
    return sum(1 for a in ctx.ancestors(loop) if isinstance(a, cst.IndentedBlock)) * 4


def _reduce_line(tm: str, names: List[str], extra: str) -> str:
    """`a, b = tm.all_reduce(a, b)` as text (for messages)."""
    joined = ", ".join(names)
    return f"{joined} = {tm}.all_reduce({joined}{extra})"


_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
_EQ = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


def _reduce_statement(tm: str, names: List[str], op: str, over: Optional[str], indent: int) -> cst.SimpleStatementLine:
    """`a, b = tm.all_reduce(a, b)` (with `op="mean"`, `over=loader` when given; built directly:
    parsing costs ~10 ms), broken after the parenthesis when the line would pass 100 columns.
    `names` may be entries of a dict (`res["loss"]`)."""
    def node(n: str) -> cst.BaseExpression:
        return cst.Name(n) if n.isidentifier() else expr(n)

    if len(names) == 1:
        target: cst.BaseExpression = node(names[0])
    else:
        target = cst.Tuple([cst.Element(node(n), comma=_COMMA if i < len(names) - 1 else cst.MaybeSentinel.DEFAULT)
                            for i, n in enumerate(names)], lpar=[], rpar=[])
    args = [cst.Arg(node(n)) for n in names]
    if op:
        args.append(cst.Arg(cst.SimpleString(f'"{op}"'), keyword=cst.Name("op"), equal=_EQ))
    if over:
        args.append(cst.Arg(expr(over), keyword=cst.Name("over"), equal=_EQ))
    args = [a.with_changes(comma=_COMMA) for a in args[:-1]] + args[-1:]
    call = cst.Call(cst.Attribute(cst.Name(tm), cst.Name("all_reduce")), args)
    extra = (f', op="{op}"' if op else "") + (f", over={over}" if over else "")
    if indent + len(_reduce_line(tm, names, extra)) > 100:
        call = call.with_changes(whitespace_before_args=cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(), empty_lines=[], indent=True,
            last_line=cst.SimpleWhitespace("    ")))
    return cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(target)], call)])


def _manual_message(tm: str, names: List[str], den: str, padded: bool = False, over: Optional[str] = None,
                    counts: bool = False) -> str:
    """What to do about sums divided by a denominator a reduction would not keep right (with
    `over`: the loader, when only the run knows whether it is sharded; `counts`: the sums count
    samples and `den` is the loader's batch count)."""
    listed = ", ".join(f"`{n}`" for n in names)
    joined = ", ".join(names)
    args = joined + (f", over={over}" if over else "")
    one = len(names) == 1
    compact = den.replace(" ", "")
    if compact.startswith("len(") and compact.endswith(".dataset)") or re.match(r"len\(\w*(ds|dataset|data|set)\)$", compact):
        return (f"{listed} {'is a sum' if one else 'are sums'} over this rank's shard but divided by `{den}`, "
                f"the whole dataset: add `{joined} = {tm}.all_reduce({args})` after the loop "
                + ("(approximate: the training sampler pads the shards with a few repeated samples)" if padded else
                   f"(exact when the loader is sharded with {tm}.eval_sampler)")
                + ", or count samples in the loop (`n += y.size(0)`), reduce the count too and divide by it")
    if counts:
        return (f"{listed} {'counts' if one else 'count'} this rank's samples but {'is' if one else 'are'} divided "
                f"by `{den}`, its batch count, a per-batch figure that depends on the batch each rank loads: "
                f"where the loader's batch is divided across ranks (batch policy global), add `{joined} = "
                f"{tm}.all_reduce({args})` after the loop; where every rank loads the whole batch, `op=\"mean\"`; "
                f"or count the samples too and divide by their reduced count")
    if compact.startswith("len(") and named_like_loader(compact[4:-1]):
        return (f"{listed} {'sums' if one else 'sum'} per-batch values over this rank's batches but "
                f"{'is' if one else 'are'} divided by `{den}`, this rank's batch count: add "
                f"`{joined} = {tm}.all_reduce({args}, op=\"mean\")` after the loop to average over the ranks "
                f"(their batch counts are equal with a DistributedSampler)")
    return (f"{listed} {'is a sum' if one else 'are sums'} over this rank's shard but divided by `{den}`: "
            f"reduce {'it' if one else 'them'} after the loop (`{joined} = {tm}.all_reduce({args})`) "
            f"together with a count accumulated in the loop, and divide by the reduced count")


def _denominator(node: cst.CSTNode) -> str:
    if isinstance(node, cst.BinaryOperation):
        return code(node.right)
    if isinstance(node, cst.AugAssign):
        return code(node.value)
    return code(node)

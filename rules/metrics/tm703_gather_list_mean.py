"""TM703 gather-list-mean: per-batch values and meters averaged over one rank's batches."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.loaders import is_pure
from torchmigrate.program.losses import backward_loss
from torchmigrate.program.loop_ranks import names_in, per_rank_names
from torchmigrate.program.metrics import (binding_of, in_mean, initial_value, is_load, leaves_early, loader_expr,
                                          loader_loop, means_only, reassigned_in, source_index, starts_empty_list)
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.scopes import scope_of
from torchmigrate.program.syntax import binds, local_calls, next_statement, root_name
from torchmigrate.rules._active import active
from torchmigrate.rules.metrics.plan import gathered_for_mean, loop_sharding, ranks_value


# `AverageMeter()`, `RunningAverage()`, `LossTracker()`: objects that keep a running sum and count
_METER = re.compile(r"(?i)(meter|average|avg|tracker|accumulator)$")


def _tolist(node: cst.BaseExpression) -> bool:
    """`x.tolist()`: the values of a tensor or array as a list (what `errs += ...` extends by)."""
    return type(node) is cst.Call and type(node.func) is cst.Attribute and node.func.attr.value == "tolist" \
        and not node.args


class GatherListMean(Rule):
    """
    ## What it does
    For a list filled with one value per batch in a loop over a data loader (`losses = []`,
    `losses.append(loss.item())`), or with each sample's values (`errs.extend(err.tolist())`,
    `errs += err.tolist()`), whose every use after the loop is its mean —
    `sum(losses) / len(losses)`, `np.mean(losses)`, `statistics.mean(losses)`,
    `torch.tensor(losses).mean()` — inserts right after the loop:

        losses = tm.gather_list(losses)

    which concatenates the lists of all ranks (rank order; identity in one process). A list kept
    across epochs (made before the epoch loop, read as a mean after each batch loop) is gathered
    where it is read, `np.mean(tm.gather_list(mean_correct))`, so each rank keeps only its own
    values.

    In `ddp`, a list that records one number per training step (`G_losses.append(errG.item())`,
    `history["loss"].append(float(loss))`: a loss history printed, plotted or saved) in a loop
    over a sharded training loader records the ranks' mean instead,
    `G_losses.append(tm.all_reduce(errG.item(), op="mean"))`: only appends every rank makes in
    every step (in the loop's body, not under an `if`), in a loop no rank leaves early.

    In `ddp`, a print, log or progress-bar call of a training loop over a sharded loader that
    shows the step's loss or batch metric (`print(f"step {i} loss {loss.item():.4f}")`,
    `logger.info("loss %.3f", loss.item())`, `writer.add_scalar("train/loss", loss.item(), step)`,
    `wandb.log({"loss": loss, "acc": acc})` with the step's tensors, `pbar.set_postfix(loss=...)`,
    `pbar.set_description(f"loss {loss_sum / (i + 1)}")` with a running sum of the step's values,
    a project logger's `logger.log_step(step, {"loss": l})`) shows the ranks' mean,
    `tm.all_reduce(loss.item(), op="mean")`: only numbers named like a loss or an averaged metric
    (and running counts of correct answers divided by a count), or whatever their name, numbers
    bound to the step's loss (`l = loss.item()`) and running sums of it (`interval_loss +=
    loss.detach().cpu().numpy()`, also averaged in place before it is shown); a running ratio
    bound in the loop (`accuracy = float(correct) / float(total)`) is reduced where it is
    computed, so every later use sees the ranks' value; only where
    every rank shows them in the same steps (under tests of the loop's index, counters and
    settings, not of its data; after no `continue` a rank may take). The same holds in a function
    that runs the training step itself and that the loop calls once per batch
    (`self._train_one_step(batch)`).

    In `ddp`, the numbers a training step hands a meter, logger or dict
    (`metric_logger.update(loss=loss_value)` after `loss_value = loss.item()`,
    `losses.update(loss.item(), images.size(0))`) become the ranks' mean where they are
    computed, so every rank's object holds the same values whatever its class (and shows them
    mid-epoch); the same conditions as for histories.

    A meter object built before the loop (`meter = AverageMeter()`, any class named like a
    meter, average or tracker) and updated in it (`meter.update(loss.item(), x.size(0))`) gets
    `tm.reduce_meter(meter)` after the loop: its `sum` and `count` are summed across ranks and
    its `avg` recomputed (a meter without those attributes is left as it is, on every rank). A
    dict of meters (`meters = defaultdict(AverageMeter)`, `meters[key].update(v, n)`) gets
    `for _meter in meters.values(): tm.reduce_meter(_meter)`; the runtime reduces only what a
    meter gained since its last reduction, so meters kept across epochs are not counted twice.

    ## Why is this bad?
    Under DDP each rank iterates its own shard, so the mean of its list is the mean of one shard.
    Rank 0 logs it, and where it drives control flow (`scheduler.step(val_loss)` with
    ReduceLROnPlateau, early stopping, the best-checkpoint choice) the ranks decide differently:
    their learning rates, and then their parameters, drift apart with no error. A mean over the
    gathered values is the mean over every batch of every rank, and it is the same on every rank.
    Only means are rewritten (a mean over duplicated values is unchanged, so this is right even
    for a loader that turns out unsharded); a list used any other way is left alone.

    The gather must run on every rank: a loop under a rank guard is reported instead. A loop
    over a loader every rank iterates in full (an evaluation loader TM203 keeps whole) already
    covers every batch and is left alone; where only the run can tell whether the loader is
    sharded (one handed in from another module), the meter's reduction takes it,
    `tm.reduce_meter(meter, over=loader)`, so a whole set's sum and count are not multiplied.
    """

    code = "TM703"
    name = "gather-list-mean"
    summary = "Gather per-batch values from every rank before taking their mean"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            @torch.no_grad()
            def validate(model, val_loader, criterion):
                losses = []
                for x, y in val_loader:
                    losses.append(criterion(model(x), y).item())
                return sum(losses) / len(losses)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            @torch.no_grad()
            def validate(model, val_loader, criterion):
                losses = []
                for x, y in val_loader:
                    losses.append(criterion(model(x), y).item())
                losses = tm.gather_list(losses)
                return sum(losses) / len(losses)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        loops: Dict[cst.CSTNode, List[str]] = {}
        meters: Dict[cst.CSTNode, List[str]] = {}
        meter_dicts: Dict[cst.CSTNode, List[str]] = {}  # `meters[key].update(v, n)`: a dict of meters
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if type(func) is cst.Attribute and func.attr.value in ("append", "extend", "update") \
                    and type(func.value) is cst.Name:
                loop = loader_loop(ctx, call)
                found = (meters if func.attr.value == "update" else loops).setdefault(loop, []) if loop else None
                receivers = [func.value.value]
                if func.attr.value == "update" and loop is not None:
                    # `[m.update(result, n) for m in meters]` over `meters = [block, total]`: each one
                    receivers = _iterated_members(ctx, call, func.value.value, loop) or receivers
                for receiver in receivers:
                    if found is not None and receiver not in found:
                        found.append(receiver)
            elif type(func) is cst.Attribute and func.attr.value == "update" and type(func.value) is cst.Subscript \
                    and type(func.value.value) is cst.Name:
                loop = loader_loop(ctx, call)
                found = meter_dicts.setdefault(loop, []) if loop else None
                if found is not None and func.value.value.value not in found:
                    found.append(func.value.value.value)
        for aug in ctx.nodes(cst.AugAssign):  # `losses += [loss.item()]`, `errs += err.tolist()`: an append, an extend
            if isinstance(aug.operator, cst.AddAssign) and type(aug.target) is cst.Name \
                    and (type(aug.value) is cst.List and len(aug.value.elements) == 1 or _tolist(aug.value)):
                loop = loader_loop(ctx, aug)
                found = loops.setdefault(loop, []) if loop else None
                if found is not None and aug.target.value not in found:
                    found.append(aug.target.value)
        fed = self._step_updates() if ctx.options.mode == "ddp" else set()
        if ctx.options.mode == "ddp":
            self._collectors(fed)
        for loop, names in meters.items():
            names = [n for n in names if n not in fed]
            if names and not leaves_early(ctx, loop) and loop_sharding(ctx, loop) != "whole":
                self._meters(loop, names)
        for loop, names in meter_dicts.items():
            if not leaves_early(ctx, loop) and loop_sharding(ctx, loop) != "whole":
                self._meter_dicts(loop, names)
        gathered: Set[str] = set()
        for loop, names in loops.items():
            lists = [n for n in names if gathered_for_mean(ctx, loop, n) and not self._shown_each_step(loop, n)]
            gathered |= self._gather_at_reads(loop, [n for n in names if n not in lists])
            if not lists:
                continue  # (a loader every rank iterates in full: its means are the whole data's)
            gathered.update(lists)
            listed = ", ".join(f"`{n}`" for n in lists)
            self._after_loop(loop, [f"{n} = {ctx.tm}.gather_list({n})" for n in lists],
                             f"{listed} {'holds' if len(lists) == 1 else 'hold'} this rank's values only, but this "
                             "loop runs under a rank guard, where a gather would hang the other ranks",
                             f"the mean of {listed} covers this rank's batches only; gather every rank's values first")
        gathered |= self._attribute_lists()
        if ctx.options.mode == "ddp":
            self._step_histories(gathered)
            self._step_prints()

    def _attribute_lists(self) -> Set[str]:
        """`self.running_acc = []` before a loop over a sharded loader in a trainer's method,
        `self.running_acc.append(acc)` in it, `np.mean(self.running_acc)` after it (an epoch's
        metric that picks the best checkpoint): the mean is taken over the gathered values where
        it is read, `np.mean(tm.gather_list(self.running_acc))`; the attribute itself keeps this
        rank's values for whatever else reads it. Only reads after the loop in the same method,
        each one a mean, reached by every rank. Returns the attributes gathered."""
        ctx = self.ctx
        seen: Set[Tuple[int, str]] = set()
        done: Set[str] = set()
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if not (type(func) is cst.Attribute and func.attr.value == "append" and type(func.value) is cst.Attribute
                    and dotted(func.value.value) == "self"):
                continue
            name = code(func.value)
            loop = loader_loop(ctx, call)
            if loop is None or (id(loop), name) in seen:
                continue
            seen.add((id(loop), name))
            method = ctx.enclosing(loop, cst.FunctionDef)
            if method is None or not starts_empty_list(ctx, loop, name) or leaves_early(ctx, loop) \
                    or loop_sharding(ctx, loop) == "whole" or collective_guard(ctx, loop) is not None:
                continue
            if any(dotted(t) == name for a in ctx.within(loop.body, cst.Assign, skip_defs=True)
                   for t in (x.target for x in a.targets)):
                continue  # bound again in the loop
            end = ctx.last_position(loop)
            reads = [n for n in ctx.within(method, cst.Attribute) if dotted(n) == name
                     and (ctx.position(n) or 0) > end and ctx.enclosing(n, cst.FunctionDef) is method]
            if not reads or any(not in_mean(ctx, n, name) and not _reduced(ctx, n, "gather_list")
                                or collective_guard(ctx, n) is not None for n in reads):
                continue
            done.add(name)
            reads = [n for n in reads if not _reduced(ctx, n, "gather_list")]  # (none on a second run)
            if not reads:
                continue
            self.report(loop, f"the mean of `{name}` covers this rank's batches only: gather every rank's values "
                              "where it is read", edits=_gathered_where_read(ctx, reads), imports=[ctx.runtime_import()])
        return done

    def _gather_at_reads(self, loop: cst.For, names: List[str]) -> Set[str]:
        """`mean_correct = []` before the epoch loop, `mean_correct.append(acc)` in each batch
        loop, `np.mean(mean_correct)` after it: a list of per-batch values kept across epochs and
        read as a mean. Gathered where it is read, `np.mean(tm.gather_list(mean_correct))`, so
        each rank keeps only its own values (a gather after the loop, assigned back, would hold
        every rank's earlier values once per rank by the next epoch). Returns the lists gathered
        (their values are not also averaged as they are recorded: `_step_histories`)."""
        ctx = self.ctx
        done: Set[str] = set()
        for name in names:
            outer = [a for a in ctx.ancestors(loop) if isinstance(a, (cst.For, cst.While))
                     and ctx.enclosing(a, cst.FunctionDef) is ctx.enclosing(loop, cst.FunctionDef)]
            if not any(starts_empty_list(ctx, a, name) and not reassigned_in(ctx, a, name) for a in outer):
                continue
            if not means_only(ctx, loop, name) or leaves_early(ctx, loop) or loop_sharding(ctx, loop) == "whole" \
                    or collective_guard(ctx, loop) is not None:
                continue
            index = source_index(ctx)
            begin, scope = index.end[loop], scope_of(ctx, loop)
            reads = [n for order, n in index.names(name) if order > begin and scope_of(ctx, n) is scope
                     and is_load(ctx, n) and binding_of(ctx, n) is None and not _reduced(ctx, n, "gather_list")]
            if not reads:
                continue
            done.add(name)
            self.report(loop, f"the mean of `{name}` covers this rank's batches only (a list kept across epochs): "
                              "gather every rank's values where it is read", edits=_gathered_where_read(ctx, reads),
                        imports=[ctx.runtime_import()])
        return done

    def _shown_each_step(self, loop: cst.For, name: str) -> bool:
        """The list `name` of a training loop (`loss_G_train += [loss_G.item()]`) is also read in
        the loop, as a mean shown each step (`print(... mean(loss_G_train))`): a gather after the
        loop would leave those lines rank 0's, so `_step_histories` records each step's value as
        the ranks' mean instead, which every later mean over the list keeps right. Only where
        every record of it is one of those (a step's number, in the loop's body itself)."""
        ctx = self.ctx
        if ctx.options.mode != "ddp" or not analysis.runs_backward(ctx, loop):
            return False
        records = self._records(loop, name)
        if not records or not all(ctx.parent(ctx.statement_of(r)) is loop.body and (_number_of_step(ctx, v) or (
                isinstance(v, cst.Call) and ctx.resolve(v.func) == RUNTIME + ".all_reduce")) for r, v in records):
            return False  # (the ranks' mean already: a second run)
        statements = {id(ctx.statement_of(r)) for r, _ in records}
        return any(n.value == name and is_load(ctx, n) and id(ctx.statement_of(n)) not in statements
                   for n in ctx.within(loop.body, cst.Name, skip_defs=True))

    def _records(self, loop: cst.CSTNode, name: str) -> List[Tuple[cst.CSTNode, cst.BaseExpression]]:
        """`name.append(v)` and `name += [v]` in `loop`: (the call or augmented assignment, v)."""
        ctx = self.ctx
        out: List[Tuple[cst.CSTNode, cst.BaseExpression]] = []
        for c in ctx.within(loop, cst.Call, skip_defs=True):
            if type(c.func) is cst.Attribute and c.func.attr.value == "append" and code(c.func.value) == name \
                    and len(c.args) == 1:
                out.append((c, c.args[0].value))
        for a in ctx.within(loop, cst.AugAssign, skip_defs=True):
            if isinstance(a.operator, cst.AddAssign) and code(a.target) == name and type(a.value) is cst.List \
                    and len(a.value.elements) == 1:
                out.append((a, a.value.elements[0].value))
        return out

    def _step_histories(self, gathered: Set[str]) -> None:
        """`G_losses.append(errG.item())`, `results["loss"].append(loss.item())` once per step
        of a training loop over a sharded loader (the DCGAN tutorial's loss history, plotted or
        saved at the end): each recorded value becomes the ranks' mean as it is appended. Only
        appends every rank makes in every step (in the loop's body, not under an `if`), of a
        number (`.item()`, `float(...)`), in a loop no rank leaves early and no rank guard holds."""
        ctx = self.ctx
        gathered_later = {code(c.args[0].value) for c in analysis.calls_to(ctx, RUNTIME + ".gather_list") if c.args}
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if not (type(func) is cst.Attribute and func.attr.value == "append" and len(call.args) == 1):
                continue
            owner = code(func.value)
            if owner in gathered or call.args[0].keyword is not None or call.args[0].star:
                continue
            value = call.args[0].value
            loop = _training_step_loop(ctx, call)
            if not (_number_of_step(ctx, value) or (
                    loop is not None and isinstance(value, cst.Name) and _METRIC_NAME.search(value.value)
                    and _sums_step_means(ctx, _step_sums(ctx, loop, value.value)))):
                continue  # (`train_loss.append(loss_val)` of `loss_val += loss.item()`: its ranks' mean)
            if loop is None or collective_guard(ctx, loop) is not None or _skipped_before(ctx, loop, call):
                continue
            if isinstance(func.value, cst.Name) and owner in gathered_later:
                continue  # one gathered after the loop (a list whose mean is taken: `gathered`, above)
            statement = ctx.statement_of(call)
            if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
                    and isinstance(statement.body[0], cst.Expr) and statement.body[0].value is call):
                continue
            if any(isinstance(a, (cst.If, cst.Try, cst.For, cst.While)) for a in ctx.ancestors_until(statement, loop)):
                continue
            self.report(call, f"`{owner}` records this rank's value each training step (a history that is "
                              f"printed, plotted or saved): record the ranks' mean",
                        edits=[ranks_value(ctx, value)], imports=[ctx.runtime_import()])
        for aug in ctx.nodes(cst.AugAssign):  # `loss_G_train += [loss_G.item()]`, shown each step
            if not (isinstance(aug.operator, cst.AddAssign) and type(aug.target) is cst.Name
                    and type(aug.value) is cst.List and len(aug.value.elements) == 1):
                continue
            loop = _training_step_loop(ctx, aug)
            owner, value = aug.target.value, aug.value.elements[0].value
            if owner in gathered or loop is None or not _number_of_step(ctx, value) \
                    or not self._shown_each_step(loop, owner) \
                    or collective_guard(ctx, loop) is not None or _skipped_before(ctx, loop, aug):
                continue
            self.report(aug, f"`{owner}` records this rank's value each training step and shows its mean each "
                             f"step: record the ranks' mean", edits=[ranks_value(ctx, value)],
                        imports=[ctx.runtime_import()])

    def _step_updates(self) -> Set[str]:
        """`meter.update(loss.item(), n)`, `metric_logger.update(loss=loss_value)` (with
        `loss_value = loss.item()` earlier in the step) once per step of a training loop over a
        sharded loader: the number becomes the ranks' mean where it is computed, so every rank's
        meter, logger or dict holds the same values and shows them mid-epoch, whatever its class
        (a MetricLogger of SmoothedValues has no `sum`/`count` for `tm.reduce_meter`). Only updates
        every rank makes in every step (in the loop's body, not under an `if`), in a loop no rank
        leaves early and no rank guard holds. Returns the receivers whose every value was reduced."""
        ctx = self.ctx
        done: Set[cst.CSTNode] = set()
        fed: Set[str] = set()
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if not (type(func) is cst.Attribute and func.attr.value == "update" and call.args):
                continue
            loop = _training_step_loop(ctx, call)
            if loop is None or collective_guard(ctx, loop) is not None or _skipped_before(ctx, loop, call):
                continue
            statement = ctx.statement_of(call)
            if not isinstance(statement, cst.SimpleStatementLine) or any(
                    isinstance(a, (cst.If, cst.Try, cst.For, cst.While, cst.With)) for a in ctx.ancestors_until(statement, loop)):
                continue
            values = [self._step_number(loop, statement, a.value) for a in call.args if not a.star]
            values = [v for v in values if v is not None]
            already = [a for a in call.args if isinstance(a.value, cst.Call)
                       and ctx.resolve(a.value.func) == RUNTIME + ".all_reduce"]  # a second run
            if not values and not already:
                continue
            if len(values) + len(already) == len([a for a in call.args if self._is_value(a)]):
                fed.add(code(func.value))
            edits = [ranks_value(ctx, v) for v in values if v not in done and not _reduced(ctx, v)]
            done.update(values)
            if edits:
                self.report(call, f"`{code(func.value)}` averages this rank's value each training step: record the "
                                  f"ranks' mean", edits=edits, imports=[ctx.runtime_import()])
        return fed

    @staticmethod
    def _is_value(arg: cst.Arg) -> bool:
        """An argument of `update` that is a value, not the count (`n=`, a `.size(0)`, `len(x)`)."""
        value = arg.value
        if arg.keyword is not None and arg.keyword.value in ("n", "count", "num", "weight", "batch_size"):
            return False
        if isinstance(value, cst.Call) and (isinstance(value.func, cst.Name) and value.func.value == "len" or (
                isinstance(value.func, cst.Attribute) and value.func.attr.value in ("size", "numel"))):
            return False
        return not isinstance(value, (cst.Integer, cst.Subscript, cst.Attribute))

    def _step_number(self, loop: cst.For, statement: cst.CSTNode, value: cst.BaseExpression):
        """The step number `value` is (`loss.item()`), or the one a name of the step holds
        (`loss_value = loss.item()` directly in the loop's body, before `statement`), or None."""
        ctx = self.ctx
        if _number_of_step(ctx, value):
            return value
        if not isinstance(value, cst.Name) or not isinstance(loop.body, cst.IndentedBlock):
            return None
        body = list(loop.body.body)
        top = statement
        while top is not None and ctx.parent(top) is not loop.body:
            top = ctx.parent(top)
        if top not in body:
            return None
        earlier = body[:body.index(top)]
        for at in range(len(earlier) - 1, -1, -1):
            s = earlier[at]
            if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign):
                a = s.body[0]
                if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) \
                        and a.targets[0].target.value == value.value:
                    if _number_of_step(ctx, a.value) or _library_metric(ctx, a.value):
                        return a.value
                    return a.value if _ratio_of_step_numbers(ctx, a.value, earlier[:at]) else None
                if self._beside_the_loss(loop, a, value.value):
                    return value
            if value.value in binds(ctx, s):
                return None  # bound again, or in a block: not one value of the step
        return None

    def _beside_the_loss(self, loop: cst.For, assign: cst.Assign, name: str) -> bool:
        """`loss, acc, pos_sim, neg_sim = criterion(out, y)`: `name` is unpacked from the call
        that gives the loss this step backpropagates, so it is one of the step's batch metrics
        (fed to a meter beside the loss's)."""
        if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, (cst.Tuple, cst.List)) \
                or not isinstance(assign.value, cst.Call):
            return False
        names = [e.value.value for e in assign.targets[0].target.elements if isinstance(e.value, cst.Name)]
        if name not in names:
            return False
        backwards = [c for c in self.ctx.within(loop.body, cst.Call, skip_defs=True)
                     if isinstance(c.func, cst.Attribute) and c.func.attr.value == "backward"]
        return any(root_name(c.func.value) in names and root_name(c.func.value) != name
                   or any(isinstance(n, cst.Name) and n.value in names and n.value != name
                          for n in self.ctx.within(c.func.value, cst.Name)) for c in backwards)

    def _step_prints(self) -> None:
        """`print(f"step {i} loss {loss.item():.4f}")` every N steps of a training loop over a
        sharded loader: rank 0 would print its own shard's loss; the printed number becomes the
        ranks' mean, `tm.all_reduce(loss.item(), op="mean")`. Only numbers named like a loss or
        a metric averaged over the batch (`loss`, `errD`, `acc`, `psnr`), only prints every rank
        reaches in the same steps (under `if` tests of the loop's index, counters and settings,
        not of its data), in a loop no rank leaves early and no rank guard holds."""
        ctx = self.ctx
        done: Set[int] = set()
        for call, name in analysis.facts(ctx).calls:
            values = [v for v in logged_step_values(ctx, call, name) if id(v) not in done]
            done.update(id(v) for v in values)
            if not values:
                continue
            self.report(call, "this prints this rank's value of the step (its shard's batch): print the ranks' mean",
                        edits=[ranks_value(ctx, v) for v in values], imports=[ctx.runtime_import()])

    def _collectors(self, fed: Set[str]) -> None:
        """`train_label = LabelContainer()` before a loop over a sharded loader,
        `train_label.add(gt, pred)` in it, `train_label.get_acc()` after it: an object of a class
        this rule cannot see into collects this rank's batches, so what it gives after the loop
        is this rank's value. Nothing here can reduce it for any class, so it is named (a TODO and
        a report line) rather than claimed as reduced; only in a training loop over a loader known
        to be sharded.
        Meters (`_meters`), loggers fed the step's reduced numbers (`fed`) and libraries that
        synchronise themselves (torchmetrics, ignite) are not named."""
        ctx = self.ctx
        found: Dict[cst.CSTNode, List[str]] = {}  # loop -> what its collectors give after it
        seen: Set[Tuple[int, str]] = set()
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if not (type(func) is cst.Attribute and type(func.value) is cst.Name and func.attr.value in _COLLECTS):
                continue
            name = func.value.value
            loop = loader_loop(ctx, call)
            if loop is None or (id(loop), name) in seen:
                continue
            seen.add((id(loop), name))
            ok, value = initial_value(ctx, loop, name)
            if not (ok and isinstance(value, cst.Call)):
                continue
            label = (dotted(value.func) or "").rsplit(".", 1)[-1]
            resolved = ctx.resolve(value.func) or ""
            if not label[:1].isupper() or _METER.search(label) or resolved.startswith(_SELF_SYNCING):
                continue
            if all(a.keyword is not None for a in call.args):
                continue  # `metric_logger.update(loss=loss_value)`: named numbers of the step, `_step_updates`
            if name in fed or reassigned_in(ctx, loop, name) or not self._read_after(loop, name) \
                    or leaves_early(ctx, loop) or not analysis.runs_backward(ctx, loop) \
                    or loop_sharding(ctx, loop) in ("whole", "unknown"):
                continue  # (an evaluation loader stays whole, or TM203 names what it collects: --shard-eval)
            index = source_index(ctx)
            begin, scope = index.end[loop], scope_of(ctx, loop)
            reads = [n for order, n in index.names(name) if order > begin and scope_of(ctx, n) is scope and is_load(ctx, n)]
            if any(_reduced(ctx, n) or _reduced(ctx, n, "gather_list") or _reduced(ctx, n, "reduce_meter") for n in reads):
                continue
            read = next((ctx.parent(n) for n in reads if isinstance(ctx.parent(n), cst.Attribute)), None)
            found.setdefault(loop, []).append(f"`{name}` ({label}" + (f", read as `{code(read)}`)" if read is not None
                                                                      else ")"))
        for loop, listed in found.items():
            one = len(listed) == 1
            self.report(loop, f"{', '.join(listed)} {'collects' if one else 'collect'} this rank's batches only, so "
                              f"what {'it gives' if one else 'they give'} after the loop is this rank's value, not the "
                              f"whole data set's: gather what {'it collects' if one else 'they collect'} across ranks "
                              f"(`{ctx.tm}.gather_list`) or reduce the counts (`{ctx.tm}.all_reduce`) before reading "
                              f"{'it' if one else 'them'}", statement=ctx.statement_of(loop))

    def _after_loop(self, loop: cst.For, lines: List[str], guarded: str, message: str) -> None:
        """Insert `lines` (collectives) right after `loop`, or, where a rank guard would keep some
        ranks from them and hang the others, say `guarded` and what to add."""
        ctx = self.ctx
        if collective_guard(ctx, loop) is not None:
            self.report(loop, f"{guarded}: evaluate on every rank and add `{'; '.join(lines)}` after the loop",
                        statement=ctx.statement_of(loop))
            return
        self.report(loop, message, edits=[insert_after(loop, [cst.parse_statement(line + "\n") for line in lines])],
                    imports=[ctx.runtime_import()])

    def _meters(self, loop: cst.For, names: List[str]) -> None:
        ctx = self.ctx
        found = []
        for name in names:
            ok, value = initial_value(ctx, loop, name)
            label = (dotted(value.func) or "").rsplit(".", 1)[-1] if ok and isinstance(value, cst.Call) else ""
            if _METER.search(label) and not reassigned_in(ctx, loop, name) and self._read_after(loop, name) \
                    and not self._fed_reduced(loop, name):
                found.append(name)
        if not found or self._reduced_after(loop, found):
            return
        listed = ", ".join(f"`{n}`" for n in found)
        averages = f"{listed} average{'s' if len(found) == 1 else ''} this rank's batches only"
        over = ""
        if loop_sharding(ctx, loop) == "unknown" and is_pure(loader_expr(ctx, loop.iter)):
            over = f", over={code(loader_expr(ctx, loop.iter))}"  # the run knows whether it is sharded
        self._after_loop(loop, [f"{ctx.tm}.reduce_meter({n}{over})" for n in found],
                         f"{averages}, but this loop runs under a rank guard, where a reduction would hang the "
                         "other ranks",
                         f"{averages}; reduce {'its' if len(found) == 1 else 'their'} sum and count across ranks")

    def _meter_dicts(self, loop: cst.For, names: List[str]) -> None:
        """`loss_meters[key].update(value, n)` in the loop, `loss_meters` a dict of running-average
        objects made before it (`defaultdict(AverageMeter)`, `{k: AverageMeter() for k in keys}`)
        and read after it: each meter is reduced after the loop (`tm.reduce_meter`, which reduces
        only what a meter gained since its last reduction, so a dict kept across epochs is right)."""
        ctx = self.ctx
        found = []
        for name in names:
            made = [a.value for a in analysis.facts(ctx).assigns if scope_of(ctx, a) is scope_of(ctx, loop)
                    and any(isinstance(t.target, cst.Name) and t.target.value == name for t in a.targets)]
            if len(made) == 1 and any(_METER.search(n.value) for n in ctx.within(made[0], cst.Name)) \
                    and not reassigned_in(ctx, loop, name) and self._read_after(loop, name):
                found.append(name)
        after = next_statement(ctx, loop)
        found = [n for n in found if not (isinstance(after, cst.For) and code(after.iter) == f"{n}.values()"
                                          and "reduce_meter(" in code(after.body))]  # (an earlier run's)
        if not found:
            return
        listed = ", ".join(f"`{n}`" for n in found)
        over = ""
        if loop_sharding(ctx, loop) == "unknown" and is_pure(loader_expr(ctx, loop.iter)):
            over = f", over={code(loader_expr(ctx, loop.iter))}"
        lines = [f"for _meter in {n}.values():\n    {ctx.tm}.reduce_meter(_meter{over})" for n in found]
        self._after_loop(loop, lines,
                         f"the meters of {listed} average this rank's batches only, but this loop runs under a rank "
                         "guard, where a reduction would hang the other ranks",
                         f"the meters of {listed} average this rank's batches only; reduce each one's sum and count "
                         "across ranks")

    def _fed_reduced(self, loop: cst.For, name: str) -> bool:
        """Every `name.update(v, ...)` of the loop gets a value already reduced across ranks
        (Swin's `acc1 = reduce_tensor(acc1)` before `acc1_meter.update(acc1.item(), n)`): the
        meter averages the whole batch of every rank already."""
        reduced: Set[str] = set()
        for a in self.ctx.within(loop, cst.Assign, skip_defs=True):
            last = (dotted(a.value.func) or "").rsplit(".", 1)[-1].lower() if isinstance(a.value, cst.Call) else ""
            if "reduce" in last or "gather" in last:
                reduced |= {dotted(t.target) for t in a.targets} - {None}
        updates = [c for c in self.ctx.within(loop, cst.Call, skip_defs=True)
                   if isinstance(c.func, cst.Attribute) and c.func.attr.value == "update" and dotted(c.func.value) == name]
        for call in updates:
            value = call.args[0].value if call.args else None
            while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and not value.args:
                value = value.func.value  # `acc1.item()`, `loss.mean()`
            if value is None or dotted(value) not in reduced:
                return False
        return bool(updates)

    def _read_after(self, loop: cst.For, name: str) -> bool:
        ctx = self.ctx
        index = source_index(ctx)
        begin, scope = index.end[loop], scope_of(ctx, loop)
        return any(order > begin and scope_of(ctx, n) is scope and is_load(ctx, n) for order, n in index.names(name))

    def _reduced_after(self, loop: cst.For, names: List[str]) -> bool:
        """`tm.reduce_meter(meter)` already follows the loop (a second run)."""
        nxt = next_statement(self.ctx, loop)
        return nxt is not None and "reduce_meter(" in code(nxt) and any(n in code(nxt) for n in names)


def _iterated_members(ctx, call: cst.Call, name: str, loop: cst.For) -> List[str]:
    """The names a comprehension or loop inside `loop` binds `name` to, one after the other, when
    it iterates a list of names made before the batch loop (`for m in meters`, `meters = [block,
    total]`; or the literal itself: `for m in (block, total)`)."""
    over = analysis.loop_binding(ctx, call, name)
    if over is None or not any(a is loop for a in ctx.ancestors(over)):
        return []
    if isinstance(over, (cst.List, cst.Tuple)):
        names = [dotted(e.value) for e in over.elements]
        return names if all(n and "." not in n for n in names) else []
    return [m for m in analysis.literal_members(ctx, over, loop) if "." not in m]


# methods that hand an object one batch's values to keep (`container.add(gt, pred)`)
_COLLECTS = frozenset({"add", "update", "append", "extend", "push", "record", "collect", "accumulate", "add_batch",
                       "feed", "put"})
# libraries whose collectors reduce across ranks themselves
_SELF_SYNCING = ("torchmetrics.", "ignite.", "torchmigrate.")
_PRINTS = frozenset({"print", RUNTIME + ".print", "logging.info", "logging.log", "wandb.log", "sys.stdout.write"})
# methods that log a step's number to a dashboard: `writer.add_scalar("loss", loss.item(), step)`
_SCALAR_LOGS = frozenset({"add_scalar", "add_scalars", "log_metrics", "log_metric"})
# methods of a progress bar that show the step's numbers: `pbar.set_postfix(loss=loss.item())`
_BAR_SHOWS = frozenset({"set_postfix", "set_description", "set_postfix_str", "set_description_str"})
_METRIC_NAME = re.compile(r"(?i)(loss|err|nll|kld?\b|bpd|psnr|ssim|ppl|perplex|mse|mae|acc)")
# what a running sum shown as a ratio counts: `correct / seen`, `100 * n_correct / total`
_RUNNING_NAME = re.compile(r"(?i)(loss|err|nll|kld?\b|bpd|psnr|ssim|ppl|perplex|mse|mae|acc|correct|hits|right)")
# where a name may sit in a logging call and still be one shown number: `f"{loss}"`,
# `{"loss": loss}`, `loss=loss`, `"%.3f" % loss`, `loss_sum / (i + 1)`
_SHOWN_IN = (cst.Arg, cst.DictElement, cst.Dict, cst.FormattedStringExpression, cst.FormattedString,
             cst.ConcatenatedString, cst.BinaryOperation, cst.Element, cst.Tuple, cst.UnaryOperation)


def logged_step_values(ctx: Context, call: cst.Call, name: Optional[str]) -> List[cst.CSTNode]:
    """The numbers of a training step that the print, logging or progress-bar `call` shows and
    that `_step_prints` makes the ranks' mean: `loss.item()` in `wandb.log({"loss":
    loss.item()})`, the step's loss or accuracy tensor (`wandb.log({"acc": acc})`), and running
    sums of the step's values shown mid-epoch (`pbar.set_description(f"{loss_sum / (i + 1)}")`):
    collectives inside the call's arguments, so TM601 must not put the call under a rank guard
    (it logs through `tm.main_only`, which evaluates the arguments on every rank)."""
    builtin = name is None and isinstance(call.func, cst.Name) and call.func.value == "print"
    method = call.func.attr.value if isinstance(call.func, cst.Attribute) else ""
    if not (builtin or name in _PRINTS or (name is None and (method in ("info", "log") or method.startswith("log_"))
                                           and "log" in (dotted(call.func.value) or "").lower())
            or method in _SCALAR_LOGS or method in _BAR_SHOWS):
        return []
    found = _step_block(ctx, call)
    if found is None or collective_guard(ctx, call) is not None:
        return []
    block, data = found
    between = ctx.ancestors_until(call, block)
    if any(isinstance(a, (cst.For, cst.While, cst.Try, cst.Lambda, cst.FunctionDef)) for a in between):
        return []
    if any(isinstance(a, cst.If) and names_in(a.test) & data for a in between) or any(
            isinstance(a, cst.IfExp) for a in between):
        return []  # a test of this rank's data: some ranks may not print in this step
    if _skipped_before(ctx, block, call):
        return []
    values: List[cst.CSTNode] = [
        c for c in ctx.within(call, cst.Call) if _number_of_step(ctx, c)
        and _METRIC_NAME.search(code(c.func.value if isinstance(c.func, cst.Attribute) else c.args[0].value))
        and names_in(c) & data and not _reduced(ctx, c)]
    return values + _shown_names(ctx, call, block, data)


def _shown_names(ctx: Context, call: cst.Call, block: cst.CSTNode, data: Set[str]) -> List[cst.Name]:
    """The names of `call`'s arguments that show one number of this rank's step: a loss or
    accuracy of the step (`acc = (out.argmax(1) == y).float().mean()`, `loss_value =
    loss.item()`), or a running sum of the loop shown as a mean (`loss_sum` summing `loss.item()`,
    or the numerator of `correct / seen`, whose count is the same on every rank of a padded
    sampler). Not a count shown as it is, not a name whose kind the file does not show."""
    from torchmigrate.program.types import TENSOR, kind_of

    out = []
    backed = _backward_names(ctx, block)
    for node in ctx.within(call, cst.Name):
        if node is call.func or node.value not in data:
            continue
        if not _RUNNING_NAME.search(node.value):
            # `l = loss.item()` shown as `l`, `running += loss.item()` shown as `running / 4`
            if (_holds_metric_number(ctx, block, node, backed) or _sums_step_means(ctx, _step_sums(
                    ctx, block, node.value))) and not _reduced(ctx, node) and all(
                    _shown_in(a) for a in ctx.ancestors_until(node, call)):
                out.append(node)
            continue
        chain = ctx.ancestors_until(node, call)
        if not all(_shown_in(a) for a in chain) or _reduced(ctx, node):
            continue
        parent = ctx.parent(node)
        if isinstance(parent, cst.Arg) and parent.keyword is node or isinstance(parent, cst.DictElement) \
                and parent.key is node:
            continue
        sums = _step_sums(ctx, block, node.value)
        ratio = _running_ratio(ctx, block, node) if not sums else None
        if ratio is not None:
            out.append(ratio)  # reduced where it is computed: every later use sees the ranks' value
        elif sums:
            if _sums_step_means(ctx, sums) or _numerator(ctx, node, call):
                out.append(node)
        elif _METRIC_NAME.search(node.value) and (_holds_step_number(ctx, block, node) or node.value in backed
                                                  or kind_of(ctx, node) == TENSOR):
            out.append(node)
    return out


def _shown_in(node: cst.CSTNode) -> bool:
    """`node` may hold a shown number and still show that one number: `_SHOWN_IN`, or a call that
    only formats it (`"{:.2f}".format(loss_sum / n)`, `round(loss_sum / n, 4)`; not `float(loss)`,
    itself one number of the step, made the ranks' mean whole)."""
    if isinstance(node, _SHOWN_IN):
        return True
    if not isinstance(node, cst.Call):
        return False
    func = node.func
    return isinstance(func, cst.Attribute) and func.attr.value == "format" and isinstance(
        func.value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)) or isinstance(
        func, cst.Name) and func.value == "round"


def _backward_names(ctx: Context, block: cst.CSTNode) -> Set[str]:
    """The names the step runs a backward pass from (`loss.backward()`, `scaler.scale(loss).backward()`):
    tensors, whatever made them."""
    losses = (backward_loss(c) for c in ctx.within(block, cst.Call, skip_defs=True))
    return {loss.value for loss in losses if isinstance(loss, cst.Name)}


def _skipped_before(ctx: Context, block: cst.CSTNode, node: cst.CSTNode) -> bool:
    """A `continue` of `block` (a loop) before `node`: a rank that skips the rest of its step
    (`if torch.isnan(loss): continue`) would leave the others waiting in the collective."""
    if not isinstance(block, (cst.For, cst.While)):
        return False
    at = ctx.position(node) or 0
    for skip in ctx.within(block.body, cst.Continue, skip_defs=True):
        if (ctx.position(skip) or 0) < at and ctx.enclosing(skip, cst.For, cst.While) is block:
            return True
    return False


def _step_sums(ctx: Context, block: cst.CSTNode, name: str) -> List[cst.AugAssign]:
    """`name += ...` of the step itself (not of a loop inside it, an evaluation run every N
    steps): a running sum over the steps."""
    return [a for a in ctx.within(block, cst.AugAssign, skip_defs=True)
            if isinstance(a.target, cst.Name) and a.target.value == name
            and (ctx.enclosing(a, cst.For, cst.While) or block) is block]


def _sums_step_means(ctx: Context, sums: List[cst.AugAssign]) -> bool:
    """Every one of `sums` adds a loss or batch metric of the step (`loss_val += loss.item()`,
    `interval_loss += loss.detach().cpu().numpy()` of the loss the step backpropagates)."""
    adds = [a for a in sums if not isinstance(a.operator, (cst.DivideAssign, cst.MultiplyAssign))]
    # (`running_loss /= interval` before it is shown: the running sum averaged in place)
    return bool(adds) and all(isinstance(a.operator, cst.AddAssign) and _METRIC_NAME.search(code(a.value))
                              and (_number_of_step(ctx, a.value) or _loss_as_numpy(ctx, a) or _loss_tensor(ctx, a))
                              for a in adds)


def _loss_tensor(ctx: Context, aug: cst.AugAssign) -> bool:
    """`aug` adds a loss tensor of the step (`content_loss_sum += content_loss`, a term of the
    loss it backpropagates, or that loss itself)."""
    from torchmigrate.program.types import TENSOR, kind_of

    value = aug.value
    if not isinstance(value, cst.Name):
        return False
    loop = ctx.enclosing(aug, cst.For, cst.While, cst.FunctionDef)
    return loop is not None and (value.value in _backward_names(ctx, loop) or kind_of(ctx, value) == TENSOR)


def _loss_as_numpy(ctx: Context, aug: cst.AugAssign) -> bool:
    """`aug` adds `loss.detach().cpu().numpy()`, where `loss` is what its loop backpropagates (a
    scalar: `backward()` takes no gradient argument only for one)."""
    value = aug.value
    if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "numpy"
            and not value.args):
        return False
    loop = ctx.enclosing(aug, cst.For, cst.While, cst.FunctionDef)
    return loop is not None and root_name(value) in _backward_names(ctx, loop)


def _numerator(ctx: Context, node: cst.Name, call: cst.Call) -> bool:
    """`node` is on the left of a division inside `call` (`100.0 * correct / seen`)."""
    child: cst.CSTNode = node
    for anc in ctx.ancestors_until(node, call):
        if isinstance(anc, cst.BinaryOperation) and isinstance(anc.operator, cst.Divide):
            return anc.left is child
        child = anc
    return False


def _bindings(ctx: Context, block: cst.CSTNode, name: str) -> List[cst.Assign]:
    """The assignments in `block` (not in functions defined there) that bind the plain `name`."""
    return [a for a in ctx.within(block, cst.Assign, skip_defs=True)
            if any(isinstance(t.target, cst.Name) and t.target.value == name for t in a.targets)]


def _holds_step_number(ctx: Context, block: cst.CSTNode, node: cst.Name) -> bool:
    """`node` is bound in `block` only to a number of the step (`loss_value = loss.item()`)."""
    bound = _bindings(ctx, block, node.value)
    return bool(bound) and all(len(a.targets) == 1 and (_number_of_step(ctx, a.value) or _library_metric(ctx, a.value))
                               for a in bound)


def _running_ratio(ctx: Context, block: cst.CSTNode, node: cst.Name) -> Optional[cst.BaseExpression]:
    """The value of `accuracy = float(correct) / float(total)`, bound once directly in the body of
    the step loop `block` (every rank computes it every step) from two running sums of the loop:
    the rank's running accuracy, whose ranks' mean is the whole batch's (the shares are equal)."""
    if not isinstance(block, cst.For) or not isinstance(block.body, cst.IndentedBlock):
        return None
    bound = _bindings(ctx, block, node.value)
    if len(bound) != 1 or len(bound[0].targets) != 1 or ctx.parent(ctx.parent(bound[0])) is not block.body:
        return None
    value = bound[0].value
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Divide)):
        return None

    def running(side: cst.BaseExpression) -> bool:
        while isinstance(side, cst.Call) and isinstance(side.func, cst.Name) and side.func.value in ("float", "int") \
                and len(side.args) == 1:
            side = side.args[0].value
        return isinstance(side, cst.Name) and bool(_step_sums(ctx, block, side.value))
    return value if running(value.left) and running(value.right) and not _reduced(ctx, value) else None


def _holds_metric_number(ctx: Context, block: cst.CSTNode, node: cst.Name, backed: Set[str]) -> bool:
    """`node`, whatever its name, is bound in `block` only to a number of the step's loss or
    metric (`l = loss.item()`, `v = float(train_acc)`)."""
    bound = _bindings(ctx, block, node.value)
    if not bound or not all(len(a.targets) == 1 and _number_of_step(ctx, a.value) for a in bound):
        return False
    for a in bound:
        inner = a.value.func.value if isinstance(a.value.func, cst.Attribute) else a.value.args[0].value
        if not (_METRIC_NAME.search(code(inner)) or root_name(inner) in backed):
            return False
    return True


def _training_step_loop(ctx: Context, node: cst.CSTNode, trains: bool = False) -> Optional[cst.For]:
    """The loop over a sharded training loader that runs `node` once per step, which no rank
    leaves early (a collective there is reached by every rank in every step), or None
    (`trains`: the caller knows that `node` runs the backward pass)."""
    loop = loader_loop(ctx, node)
    if loop is None or not (trains or analysis.runs_backward(ctx, loop)) or leaves_early(ctx, loop) \
            or loop_sharding(ctx, loop) != "sharded":
        return None
    return loop


def _step_block(ctx: Context, node: cst.CSTNode) -> Optional[Tuple[cst.CSTNode, Set[str]]]:
    """What runs `node` once per training step on every rank, with the names that differ per
    rank there: the loop over a sharded training loader (`_training_step_loop`), or a function
    that runs the step itself (`def _train_one_step(self, batch): ... loss.backward()`) which
    every such loop of this file that calls it calls once per pass, outside any test, and which
    returns nowhere before `node`."""
    loop = _training_step_loop(ctx, node)
    if loop is not None:
        return loop, per_rank_names(ctx, loop)
    fn = ctx.enclosing(node, cst.FunctionDef)
    if fn is None or loader_loop(ctx, node) is not None or not analysis.runs_backward(ctx, fn):
        return None
    at = ctx.position(node) or 0
    if any((ctx.position(r) or 0) < at for r in ctx.within(fn.body, cst.Return, cst.Yield, skip_defs=True)):
        return None
    sites = local_calls(ctx).get(fn.name.value, [])
    for site in sites:
        outer = _training_step_loop(ctx, site, trains=True)
        if outer is None or collective_guard(ctx, site) is not None or not isinstance(ctx.parent(site), cst.Expr):
            return None
        if any(isinstance(a, (cst.If, cst.For, cst.While, cst.Try, cst.Lambda, cst.FunctionDef))
               for a in ctx.ancestors_until(site, outer)):
            return None
    return (fn, per_rank_names(ctx, fn)) if sites else None


def _library_metric(ctx: Context, value: cst.BaseExpression) -> bool:
    """`metrics.accuracy_score(y, pred)`, `f1_score(...)`: a metric a library computes over the
    arguments it is given (this step's batch), one number."""
    return isinstance(value, cst.Call) and (ctx.resolve(value.func) or "").startswith("sklearn.metrics.")


def _ratio_of_step_numbers(ctx: Context, value: cst.BaseExpression, before: List[cst.CSTNode]) -> bool:
    """`correct / labels.size(0)`, `100.0 * correct / n` where `correct = (...).sum().item()`
    just before: a batch metric computed from numbers of the step, one number."""
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Divide, cst.Multiply))):
        return False
    numbers = set()
    for s in before:
        if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 and isinstance(s.body[0], cst.Assign):
            a = s.body[0]
            if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and _number_of_step(ctx, a.value):
                numbers.add(a.targets[0].target.value)
    left = value.left
    while isinstance(left, cst.BinaryOperation) and isinstance(left.operator, (cst.Divide, cst.Multiply)):
        left = left.right if isinstance(left.left, (cst.Integer, cst.Float)) else left.left
    return _number_of_step(ctx, left) or isinstance(left, cst.Name) and left.value in numbers


def _number_of_step(ctx: Context, value: cst.BaseExpression) -> bool:
    """`loss.item()`, `errD.mean().item()`, `float(loss)`: one number of this step."""
    if not isinstance(value, cst.Call):
        return False
    func = value.func
    if isinstance(func, cst.Attribute) and func.attr.value == "item" and not value.args:
        return True
    return isinstance(func, cst.Name) and func.value == "float" and len(value.args) == 1


def _gathered_where_read(ctx: Context, reads: List[cst.CSTNode]) -> List:
    """The edits that read every rank's values of a list at each of `reads`: `tm.gather_list(x)`."""
    gather = cst.parse_expression(f"{ctx.tm}.gather_list")
    return [replace(n, lambda v: cst.Call(func=gather, args=[cst.Arg(v)])) for n in reads]


def _reduced(ctx: Context, value: cst.CSTNode, helper: str = "all_reduce") -> bool:
    """`value` is already an argument of `tm.all_reduce(...)` (or of the runtime's `helper`,
    `tm.gather_list(...)`): a second run."""
    parent = ctx.parent(value)
    call = ctx.parent(parent) if isinstance(parent, cst.Arg) else None
    return isinstance(call, cst.Call) and ctx.resolve(call.func) == f"{RUNTIME}.{helper}"

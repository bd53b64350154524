"""TM108: training steps that one rank skips on its own while the others wait in the all-reduce."""

from __future__ import annotations

import re

from typing import List, Set

import libcst as cst

from torchmigrate.analysis import is_backward
from torchmigrate.finding import Safety, replace
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.rule import Example, Rule
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.loaders import loader_expr, refs_at
from torchmigrate.program.loop_ranks import names_in, per_rank_names
from torchmigrate.program.ranks import rank_polarity
from torchmigrate.program.syntax import ranged_loop
from torchmigrate.rules._active import active
from torchmigrate.rules.launch.base import ends_process
from torchmigrate.rules.metrics.plan import ranks_value

_LOOP_EXITS = (cst.Continue, cst.Break, cst.Return, cst.Raise)


def _leaves(ctx, small: cst.CSTNode) -> bool:
    """`continue`, `break`, `return`, `raise`, or `sys.exit(...)`/`exit()`: the rank leaves the
    step (or the loop, or the run) here."""
    if isinstance(small, _LOOP_EXITS):
        return True
    return isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) and ends_process(ctx, small.value)


# classes that schedule a learning rate (`torch.optim.lr_scheduler.*LR`, a project `WarmupScheduler`)
_SCHEDULER = re.compile(r"(Scheduler|LR|Schedule)$")
# a value that measures training or evaluation, which each rank computes on its own data
_METRIC_VALUE = re.compile(r"(?i)(loss|acc|metric|score|err|psnr|ssim|mse|mae|perplex|ppl|bleu|f1|auc|val)")
# counters every rank steps alike (`scheduler.step(epoch)`)
_COUNTER = re.compile(r"(?i)^(epoch|step|it|iter|iteration|global_step|i|e|n_iter|num_steps)\w*$")


class RankSkips(Rule):
    """
    ## What it does
    - In a training loop, `if <test on this batch or its loss>: continue` before the backward
      pass (or `break`, `return`, `raise`, `sys.exit(1)` anywhere in the loop, after calls that
      print or log why) becomes `if tm.any_rank(<test>): ...`: when any rank skips the step (or
      leaves the loop, or ends the run: DeiT's `if not math.isfinite(loss_value): sys.exit(1)`),
      every rank does. An exit under a branch that this rank's own data chose (`if acc > best:
      ... else: patience += 1; if patience > 2: break`, with `acc` computed here from a shard) is
      reported instead: only the ranks that took the branch would reach a collective there.
    - A `try:` around the forward/backward whose `except` skips the step (`continue`, the
      classic out-of-memory handler) is reported: one rank skipping leaves the others waiting.
    - `scheduler.step(val_loss)` of a `ReduceLROnPlateau` (built in this file, or a receiver
      named like one), or of any scheduler given a loss or a metric (`model_scheduler.step(total_loss)`:
      a project scheduler that adapts to it; not an epoch counter), becomes
      `scheduler.step(tm.all_reduce(val_loss, op="mean"))`: every
      rank's scheduler sees the same metric, so the learning rates stay equal. A metric of the
      whole data is the same on every rank and the mean leaves it as it is; one of a shard, or
      of a model that draws random numbers per rank (dropout, sampling), becomes the ranks'
      mean. A call under a rank guard is reported (the mean is a collective).

    - `if loss > threshold: loss.backward(); optimizer.step()` (a step taken only when this
      rank's own test holds, with no backward on the other branch) becomes
      `if tm.all_ranks(loss > threshold):`: the step is taken when the test holds on every rank.
    - Several backward passes after one forward (`loss1.backward(retain_graph=True)` then
      `loss2.backward()`, or one loss per head in a loop over the heads) are reported: DDP
      averages the gradients of the first pass only; summing the losses into one backward pass
      gives the same gradients.

    ## Why is this bad?
    The backward pass of a DDP model is a collective: every rank's gradients are averaged as
    they are computed. A rank that skips a step on its own (a NaN or zero loss, an empty batch,
    a caught error) never joins that all-reduce, so the other ranks wait for it until the
    process-group timeout, or the ranks silently average gradients of different steps.
    Tests on the loop's index or epoch are the same on every rank and are left alone.
    A plateau scheduler stepped with a per-rank metric lowers the learning rate on some ranks
    and not others: the ranks then take different steps from the same averaged gradients, and
    their parameters drift apart with no error.
    """

    code = "TM108"
    name = "skip-together"
    summary = "Skip a training step on every rank or on none"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            for x, y in loader:
                loss = criterion(model(x), y)
                if torch.isnan(loss):
                    continue
                loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            for x, y in loader:
                loss = criterion(model(x), y)
                if tm.any_rank(torch.isnan(loss)):
                    continue
                loss.backward()
                optimizer.step()
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        for loop in ctx.nodes(cst.For, cst.While):
            backwards = [c for c in ctx.within(loop, cst.Call, skip_defs=True) if is_backward(c)]
            if not backwards:
                continue
            last = max(ctx.position(c) or 0 for c in backwards)
            data = per_rank_names(ctx, loop)
            for test_if in ctx.within(loop, cst.If, skip_defs=True):
                if self._loop_of(test_if) is loop:
                    self._skip_if(test_if, data, before=(ctx.position(test_if) or 0) < last)
                    self._backward_if(test_if, data)
            self._retained_backwards(loop, backwards)
            for attempt in ctx.within(loop, cst.Try, skip_defs=True):
                if self._loop_of(attempt) is loop and any(is_backward(c) for c in ctx.within(attempt.body, cst.Call)):
                    self._skip_except(attempt)
        if ctx.options.mode == "ddp":
            self._plateau_steps()

    def _plateau_steps(self) -> None:
        ctx = self.ctx
        plateaus = {dotted(t.target) for a in ctx.nodes(cst.Assign) if isinstance(a.value, cst.Call)
                    and (ctx.resolve(a.value.func) or dotted(a.value.func) or "").endswith("ReduceLROnPlateau")
                    for t in a.targets}
        schedulers = {dotted(t.target) for a in ctx.nodes(cst.Assign) if isinstance(a.value, cst.Call)
                      and _SCHEDULER.search((ctx.resolve(a.value.func) or dotted(a.value.func) or "").rsplit(".", 1)[-1])
                      for t in a.targets}
        for call in ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "step" and len(call.args) == 1):
                continue
            receiver = dotted(func.value) or ""
            a = call.args[0]
            if receiver not in plateaus and "plateau" not in receiver.lower():
                # another scheduler stepped with a metric (`model_scheduler.step(total_loss)`, a
                # project scheduler that adapts to the loss): the same disagreement
                if not ((receiver in schedulers or "sched" in receiver.lower())
                        and _METRIC_VALUE.search(code(a.value)) and not _COUNTER.search(code(a.value))):
                    continue
            if a.star or (a.keyword is not None and a.keyword.value != "metrics"):
                continue
            value = a.value
            if isinstance(value, (cst.Integer, cst.Float)) or (
                    isinstance(value, cst.Call) and (ctx.resolve(value.func) or "").startswith(RUNTIME)):
                continue
            if collective_guard(ctx, call) is not None:
                self.report(call, f"`{code(call)}` steps the plateau scheduler with this rank's metric under a rank "
                                  f"guard: step it on every rank with `{ctx.tm}.all_reduce({code(value)}, op=\"mean\")`, "
                                  "so the learning rates stay equal")
                continue
            self.report(call, f"`{code(call)}`: each rank's metric can differ (a shard, a model that samples), and a "
                              "plateau scheduler given different metrics sets different learning rates: step it with "
                              "the ranks' mean",
                        edits=[ranks_value(ctx, value)],
                        imports=[ctx.runtime_import()])

    def _loop_of(self, node: cst.CSTNode):
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.For, cst.While, cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return anc
        return None

    def _skip_if(self, test_if: cst.If, data: Set[str], before: bool) -> None:
        """`if <per-rank test>: continue` before the backward, or `break` anywhere in the loop
        (the other ranks' next backward would wait for this rank)."""
        ctx = self.ctx
        smalls: List[cst.CSTNode] = []
        for line in test_if.body.body:  # an indented block's lines, or a one-line suite's statements
            smalls += list(line.body) if isinstance(line, cst.SimpleStatementLine) else [line]
        if test_if.orelse is not None or not smalls or not _leaves(ctx, smalls[-1]):
            return
        if isinstance(smalls[-1], cst.Continue) and not before:
            return  # after this step's backward: the step was taken on every rank
        test = test_if.test
        if rank_polarity(test) is not None or not (names_in(test) & data) or collective_guard(ctx, test_if) is not None:
            return
        if isinstance(test, cst.Call) and (cst.helpers.get_full_name_for_node(test.func) or "").endswith("any_rank"):
            return
        last = smalls[-1]
        outer = self._per_rank_branch(test_if, data)
        if outer is not None:
            # `if acc > best: ... else: patience += 1; if patience > 2: break`: only the ranks that
            # took the other branch would reach a collective here, and the rest would never join it
            self.report(test_if, f"a rank that takes this `{code(last)}` on its own leaves the others waiting in the "
                                 f"gradient all-reduce, and it is reached only where this rank's `{code(outer.test)}` "
                                 "chose the branch, so no collective can decide it here: make the value that test "
                                 f"reads the same on every rank (`{ctx.tm}.all_reduce(value, op=\"mean\")` where it "
                                 "is computed, or evaluate on the whole data)")
            return
        if not all(isinstance(s, cst.Expr) and isinstance(s.value, cst.Call) for s in smalls[:-1]):
            # more than a message before the exit (`nan_steps += 1`): every rank would run it
            self.report(test_if, f"a rank that takes this `{code(last)}` on its own misses a backward pass while the "
                                 "others wait for it in the gradient all-reduce: decide on every rank, "
                                 f"`if {ctx.tm}.any_rank({code(test)}):`, and keep per-rank counts apart")
            return
        what = "continue" if isinstance(last, cst.Continue) else "break" if isinstance(last, cst.Break) else code(last)
        self.report(test_if, f"a rank that takes this `{what}` on its own misses a backward pass while the others "
                             f"wait for it in the gradient all-reduce: take it on every rank when any rank does",
                    edits=[replace(test, lambda t: cst.Call(func=cst.parse_expression(f"{ctx.tm}.any_rank"),
                                                            args=[cst.Arg(t)]))],
                    imports=[ctx.runtime_import()])

    def _per_rank_branch(self, node: cst.CSTNode, data: Set[str]):
        """The nearest `if`/`while` between `node` and its loop whose test reads values computed
        per rank in the loop from data (`_computed_here`) and is not already decided on every
        rank (`tm.any_rank(...)`): a branch some ranks take and others do not. None where every
        rank reaches `node` alike."""
        loop = self._loop_of(node)
        computed = self._computed_here(loop, data)
        for anc in self.ctx.ancestors(node):
            if anc is loop:
                return None
            if isinstance(anc, (cst.If, cst.While)) and anc is not node and names_in(anc.test) & computed \
                    and rank_polarity(anc.test) is None and not (
                        isinstance(anc.test, cst.Call) and (dotted(anc.test.func) or "").endswith(("any_rank", "all_ranks"))):
                return anc
        return None

    def _computed_here(self, loop: cst.CSTNode, data: Set[str]) -> Set[str]:
        """Of the loop's per-rank names, those it computes itself from data each rank reads in
        part: what reads a batch the loop's `for` takes (`loss = criterion(model(x), y)`), `acc =
        sum(... for x, y in dev_loader) / n` over a sharded loader, and what follows from them
        (`best = acc`). A value a call returns (`val_loss = validate(model, loader)`)
        is the metrics family's, reduced or named where it is computed, and a constant or a
        comprehension over data every rank reads whole agrees already."""
        from torchmigrate.rules.metrics.plan import branch_sharding

        ctx = self.ctx
        values: dict = {}
        for node in ctx.within(loop, cst.Assign, cst.AugAssign, skip_defs=True):
            pairs = ([(node.target, node.value)] if isinstance(node, cst.AugAssign) else
                     [(t.target, node.value) for t in node.targets])
            for target, value in pairs:
                if isinstance(target, (cst.Tuple, cst.List)) and isinstance(value, (cst.Tuple, cst.List)) \
                        and len(target.elements) == len(value.elements):
                    pairs += [(a.value, b.value) for a, b in zip(target.elements, value.elements)]
                    continue
                for n in names_in(target):
                    values.setdefault(n, []).append(value)

        batches = set()  # what the loop's `for`s bind from their data (not a range's index)
        for f in [loop, *ctx.within(loop, cst.For, skip_defs=True)] if isinstance(loop, cst.For) else \
                ctx.within(loop, cst.For, skip_defs=True):
            if not ranged_loop(f):
                batches |= names_in(f.target)

        def from_data(value: cst.BaseExpression) -> bool:
            own = set().union(*(names_in(c.target) for c in ctx.within(value, cst.CompFor)))
            if (names_in(value) - own) & batches:
                return True  # `loss = criterion(model(x), y)`: this rank's batch
            for comp in ctx.within(value, cst.CompFor):
                try:
                    whole = all(branch_sharding(ctx, x, r.branch) == "whole"
                                for r in refs_at(ctx, loader_expr(ctx, comp.iter)) for x in r.loaders) \
                        and bool(refs_at(ctx, loader_expr(ctx, comp.iter)))
                except Exception:  # noqa: BLE001 - unknown loaders count as per rank
                    whole = False
                if not whole:
                    return True
            return False

        computed = {n for n in data if any(from_data(v) for v in values.get(n, ()))}
        while True:
            more = {n for n in data - computed if any(names_in(v) & computed for v in values.get(n, ()))}
            if not more:
                return computed
            computed |= more

    def _retained_backwards(self, loop: cst.CSTNode, backwards: List[cst.Call]) -> None:
        """`loss1.backward(retain_graph=True); loss2.backward()` after one forward (a minimax
        loss, one loss per head or module): DDP reduces the gradients in the first backward pass
        after a forward only, so what the later ones add stays on each rank and the parameters
        drift apart with no error. Reported once per loop (the losses are summed into one
        backward by hand: `(loss1 + loss2).backward()` gives the same gradients)."""
        if self.ctx.options.mode != "ddp":
            return
        own = [c for c in backwards if self._loop_of(c) is loop]
        retained = [c for c in own if any(a.keyword is not None and a.keyword.value == "retain_graph"
                                          and code(a.value) == "True" for a in c.args)]
        if not retained:
            return
        first = retained[0]
        repeated = ranged_loop(loop) and not any(  # `for idx in range(n_heads):` with no step inside
            isinstance(c.func, cst.Attribute) and c.func.attr.value == "step"
            for c in self.ctx.within(loop.body, cst.Call, skip_defs=True))
        if not repeated and not [c for c in own if (self.ctx.position(c) or 0) > (self.ctx.position(first) or 0)]:
            return
        self.report(first, "several backward passes after one forward of a model in DDP (`retain_graph=True`, then "
                           "another backward): DDP averages the gradients of the first pass only, so what the later "
                           "passes add stays on each rank and the ranks' parameters drift apart; sum the losses and "
                           "take one backward pass (`(loss1 + loss2).backward()` gives the same gradients)")

    def _backward_if(self, test_if: cst.If, data: Set[str]) -> None:
        """`if loss > threshold: loss.backward(); optimizer.step()` with no backward on the other
        branch: a rank whose own batch fails the test skips the backward that the others wait
        for. The step is taken when every rank's test holds, `if tm.all_ranks(<test>):` (a rank
        skips when any rank would, as for `continue`)."""
        ctx = self.ctx
        test = test_if.test
        if not any(is_backward(c) for c in ctx.within(test_if.body, cst.Call, skip_defs=True)):
            return
        if test_if.orelse is not None and any(is_backward(c) for c in ctx.within(test_if.orelse, cst.Call,
                                                                                   skip_defs=True)):
            return  # a backward on both branches: every rank takes one
        if rank_polarity(test) is not None or not (names_in(test) & data) or collective_guard(ctx, test_if) is not None:
            return
        if isinstance(test, cst.Call) and (cst.helpers.get_full_name_for_node(test.func) or "").endswith(
                ("any_rank", "all_ranks")):
            return
        self.report(test_if, "a rank whose own test fails here skips this backward pass while the others wait for it "
                             "in the gradient all-reduce: take the step only when the test holds on every rank",
                    edits=[replace(test, lambda t: cst.Call(func=cst.parse_expression(f"{ctx.tm}.all_ranks"),
                                                            args=[cst.Arg(t)]))],
                    imports=[ctx.runtime_import()])

    def _skip_except(self, attempt: cst.Try) -> None:
        for handler in attempt.handlers:
            exits = [n for n in self.ctx.within(handler.body, cst.Continue, cst.Break, skip_defs=True)
                     if self._loop_of(n) is self._loop_of(attempt)]
            if exits:
                self.report(handler, "a rank whose step raises here skips it (the usual out-of-memory handler) while the "
                                     "others wait in the gradient all-reduce: let the error end the run, or agree on "
                                     f"skipping with `{self.ctx.tm}.any_rank(failed)` after the `try` on every rank")
                return

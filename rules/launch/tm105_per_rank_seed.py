"""TM105 per-rank-seed: each rank draws its own random numbers once training starts (dropout,
augmentation), while everything drawn before (initial weights, data splits) stays the same."""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_before, remove, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, code, expr, kwarg, with_args
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules.launch.base import SEEDERS
from torchmigrate.rules.launch.streams import Placement, stream_plan


def _dotted_names(node: cst.CSTNode) -> List[str]:
    """`a`, `self.x`: the variables an expression reads (outermost dotted chains)."""
    name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
    if name is not None:
        return [name]
    out: List[str] = []
    for child in node.children:
        out += _dotted_names(child)
    return out


class PerRankSeed(Rule):
    """
    ## What it does
    In a migration (`ddp`), keeps the program's own seeding and inserts `tm.seed_per_rank()`
    right before each training loop (a loop that runs a backward, itself or through a function
    of the module): from there on rank r > 0 draws from streams of its own (random, numpy,
    torch), so dropout masks, augmentations, noise and DataLoader worker seeds differ per rank,
    while the initial weights, random splits and anything else drawn before training stay
    identical on every rank, as in the original. Rank 0 and a one-process run keep their
    streams untouched: `python train.py` draws exactly what the original did. A loop that
    builds an optimizer, a DataLoader or a model wrap (cross-validation folds) is set-up, so
    the call goes before the training loop inside it. Where the training loop draws a
    permutation or a shuffle from the global streams (`torch.randperm`, `random.shuffle`),
    whose result must agree on every rank (batches or a split cut from it), nothing is
    inserted and the report says why (a TODO where the module seeds, else a note).

    In `lint` (files that use torch.distributed or the runtime already), suggests replacing a
    group of global seeding statements (`torch.manual_seed(s)`, `torch.cuda.manual_seed_all(s)`,
    `random.seed(s)`, `np.random.seed(s)`, adjacent in one block, also across imports) with one
    `tm.seed_everything(s, per_rank=True)` call, which seeds `random`, numpy and torch with
    `s + rank`. The groups of one function (or of the module) that use the same seed are one
    finding; the fix is unsafe (it changes the random streams, and splits drawn after it
    differ per rank), so `lint --unsafe-fixes` applies it. Seeds that already depend on the
    rank (`args.seed + rank`) are left alone.

    ## Why is this bad?
    With the same seed (or none: torch's default seed is the same in every process) every rank
    draws the same dropout masks, augmentations and noise, so N ranks see N copies of one
    random stream instead of N independent ones. Seeding each rank differently from the start
    is wrong too: a `random_split` or a generated validation set drawn after it differs per
    rank, so one rank's validation samples are another's training samples.

    ## Example
    ```python
    torch.manual_seed(args.seed)
    model = Net()
    for epoch in range(args.epochs):
        train(model, train_loader)
    ```
    becomes
    ```python
    torch.manual_seed(args.seed)
    model = Net()
    tm.seed_per_rank()
    for epoch in range(args.epochs):
        train(model, train_loader)
    ```

    ## Limitations
    Streams the program keeps in objects of its own (`np.random.default_rng(seed)`, a
    `torch.Generator` passed to a transform) are not touched. A training loop in another module
    than the function that calls it gets the call inside that module, before its own loop.
    """

    code = "TM105"
    name = "per-rank-seed"
    summary = "Give each rank its own random streams once training starts (dropout, augmentation)"
    safety = Safety.UNSAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            torch.manual_seed(args.seed)
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for epoch in range(args.epochs):
                for x, y in loader:
                    optimizer.zero_grad()
                    criterion(model(x), y).backward()
                    optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            torch.manual_seed(args.seed)
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            tm.seed_per_rank()
            for epoch in range(args.epochs):
                for x, y in loader:
                    optimizer.zero_grad()
                    criterion(model(x), y).backward()
                    optimizer.step()
            """,
        ),
        Example(
            before="""
            import random
            import torch
            import torch.distributed as dist
            dist.init_process_group("nccl")
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            """,
            mode="lint",  # reported, with an unsafe fix: `tm.seed_everything(args.seed, per_rank=True)`
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._assign_index: Optional[Dict[str, List[cst.BaseExpression]]] = None
        self._rank_text: Dict[cst.CSTNode, bool] = {}

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not (ctx.options.mode == "ddp" or analysis.is_distributed(ctx)):
            return
        if ctx.options.mode == "ddp":
            # the same decision whether the file sets up torch.distributed itself or not: the
            # migration moves such code onto the runtime, and a second run must change nothing
            self._streams_part_at_training()
            return
        seeds = analysis.calls_to(ctx, *SEEDERS)
        seen: Set[cst.CSTNode] = set()
        # Groups of one scope that seed with the same value are one finding (one TODO): a
        # script often seeds torch/random first and CUDA a few lines later under `if cuda:`.
        clusters: Dict[Tuple[cst.CSTNode, Optional[str]], List[List[cst.SimpleStatementLine]]] = {}
        for call in seeds:
            line = self._line(call)
            if line is None or line in seen:
                continue
            group = self._group(line)
            seen.update(group)
            calls = [small.value for g in group for small in g.body]
            if any(self._rank_dependent(c) for c in calls):
                continue
            clusters.setdefault((ctx.scope_of(line), self._common_seed(calls)), []).append(group)
        for groups in clusters.values():
            self._report_groups(groups)
        for call in analysis.calls_to(ctx, RUNTIME + ".seed_everything"):
            if arg(call, "per_rank", 1) is None and not any(a.star for a in call.args):
                if self._rank_dependent(call):
                    continue
                self.report(call, "tm.seed_everything without per_rank: every rank draws the same random numbers; "
                                  "pass per_rank=True (unsafe: changes the random streams)",
                            edits=[replace(call, lambda c: with_args(c, [*c.args, kwarg("per_rank", expr("True"))]))])

    def _streams_part_at_training(self) -> None:
        """A migration keeps the program's seeding (identical initial weights and splits on
        every rank) and gives each rank its own streams where training starts (see
        `rules/launch/streams.py`); where a draw in the training loop must agree, it says why."""
        ctx = self.ctx
        if not ctx.options.shard_training or analysis.calls_to(ctx, ctx.options.runtime_module + ".seed_per_rank"):
            return
        tm = ctx.tm
        seeds = bool(analysis.calls_to(ctx, *SEEDERS, RUNTIME + ".seed_everything"))
        for item in stream_plan(ctx):
            if isinstance(item, Placement):
                self.report(item.loop, f"ranks draw their own random numbers from here on (`{tm}.seed_per_rank()`: "
                                       "dropout, augmentation, noise, DataLoader workers), while the initial weights "
                                       "and data splits drawn before stay identical on every rank; one process draws "
                                       "exactly what the original did",
                            edits=[insert_before(item.loop, [cst.parse_statement(f"{tm}.seed_per_rank()\n")])],
                            imports=[ctx.runtime_import()], safety=Safety.SAFE)
                continue
            draw = code(item.draw)
            self.report(item.loop, f"every rank draws the same random numbers during training (dropout, augmentation): "
                                   f"`{tm}.seed_per_rank()` cannot go before this loop, because `{draw}` in it must "
                                   "give the same result on every rank (batches or a split cut from it); draw it "
                                   f"with a generator seeded alike on every rank (`{tm}.shared_generator()`), then "
                                   f"call `{tm}.seed_per_rank()` before the loop",
                        statement=item.loop, advice=not seeds)

    def _is_seed_line(self, line: cst.CSTNode) -> bool:
        if not isinstance(line, cst.SimpleStatementLine):
            return False
        for small in line.body:
            if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                    and self.ctx.resolve(small.value.func) in SEEDERS):
                return False
        return True

    def _line(self, call: cst.Call) -> Optional[cst.SimpleStatementLine]:
        parent = self.ctx.parent(call)
        if not isinstance(parent, cst.Expr):
            return None
        line = self.ctx.parent(parent)
        return line if self._is_seed_line(line) else None

    def _group(self, line: cst.SimpleStatementLine) -> List[cst.SimpleStatementLine]:
        """The seeding lines from `line` on in its block, also across import lines between
        them (`torch.manual_seed(s)` / `import random` / `random.seed(s)`)."""
        block = self.ctx.parent(line)
        body = list(getattr(block, "body", ()))
        if line not in body:
            return [line]
        i = body.index(line)
        group = [line]
        for nxt in body[i + 1:]:
            if self._is_seed_line(nxt):
                group.append(nxt)
            elif not (isinstance(nxt, cst.SimpleStatementLine)
                      and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in nxt.body)):
                break
        return group

    def _seed_value(self, call: cst.Call) -> Optional[cst.BaseExpression]:
        a = arg(call, "seed", 0)
        if a is None or len(call.args) != 1:
            return None
        return a.value

    def _rank_dependent(self, call: cst.Call) -> bool:
        """The seed already differs per rank: `seed + rank`, or a variable assigned from the rank
        (`seed = args.seed + utils.get_rank()`, `self.seed_offset = ddp_rank`)."""
        a = arg(call, "seed", 0)
        if a is None:
            return False
        if self._mentions_rank(a.value):
            return True
        index = self._assigned()
        for name in _dotted_names(a.value):
            if any(self._mentions_rank(value) for value in index.get(name, ())):
                return True
        return False

    def _mentions_rank(self, node: cst.CSTNode) -> bool:
        """Whether the source text of `node` contains "rank"; remembered per node, since the same
        assigned values are asked about for every seeding call and generating their code is the cost."""
        found = self._rank_text.get(node)
        if found is None:
            found = self._rank_text[node] = "rank" in code(node).lower()
        return found

    def _assigned(self) -> Dict[str, List[cst.BaseExpression]]:
        """Assigned values by dotted target name, built once."""
        if self._assign_index is None:
            self._assign_index = {}
            for assign in analysis.facts(self.ctx).assigns:
                for t in assign.targets:
                    name = dotted(t.target)
                    if name:
                        self._assign_index.setdefault(name, []).append(assign.value)
        return self._assign_index

    def _common_seed(self, calls: List[cst.Call]) -> Optional[str]:
        """The text of the one seed every call uses, or None (different or unknown seeds)."""
        values = [self._seed_value(c) for c in calls]
        texts = {code(v) for v in values if v is not None}
        if None in values or len(texts) != 1:
            return None
        return texts.pop()

    def _report_groups(self, groups: List[List[cst.SimpleStatementLine]]) -> None:
        """One finding for the seeding groups of one scope that share a seed (or all have mixed
        seeds): the TODO goes on the first group, the fix replaces every group."""
        group = groups[0]
        calls = [small.value for line in group for small in line.body]
        tm = self.ctx.tm
        first = calls[0]
        more = sum(len(g) for g in groups[1:])
        also = f" (also for the {more} later seeding line{'s' if more > 1 else ''} in this scope)" if more else ""
        if self._common_seed(calls) is None:
            self.report(first, f"every rank uses the same seed (identical augmentations/dropout on all ranks): "
                               f"seed with `{tm}.seed_everything(seed, per_rank=True)` (adds the rank){also}",
                        statement=group[0])
            return
        seed = self._seed_value(first)
        seed_text = code(seed)
        edits = []
        for g in groups:
            edits += self._group_edits(g, seed)
        self.report(first, f"every rank uses the same seed (identical augmentations/dropout on all ranks): use "
                           f"`{tm}.seed_everything({seed_text}, per_rank=True)` (unsafe: changes the random streams; "
                           f"keep dataset splits on an explicit generator){also}",
                    edits=edits, imports=[self.ctx.runtime_import()], statement=group[0])

    def _group_edits(self, group: List[cst.SimpleStatementLine], seed: cst.BaseExpression) -> list:
        """The first line becomes `tm.seed_everything(seed, per_rank=True)`, the others go."""
        tm = self.ctx.tm
        # Comments on the lines that go move above the one call that replaces them.
        moved: List[cst.EmptyLine] = []
        for line in group[1:]:
            moved += [ln for ln in line.leading_lines if ln.comment is not None]
            if line.trailing_whitespace.comment is not None:
                moved.append(cst.EmptyLine(comment=line.trailing_whitespace.comment))

        def fix(line: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
            call = expr(f"{tm}.seed_everything(__seed__, per_rank=True)")
            call = call.with_changes(args=[call.args[0].with_changes(value=seed), call.args[1]])
            return line.with_changes(body=[cst.Expr(call)], leading_lines=[*line.leading_lines, *moved])

        return [replace(group[0], fix)] + [remove(line) for line in group[1:]]

"""What the rules of the data family share: the facts and the plan they read, when they report,
and the one edit TM201 and TM203 both make (a loader gets its sampler)."""

from __future__ import annotations

from typing import List

import libcst as cst

from torchmigrate.finding import Edit, insert_after, replace
from torchmigrate.syntax.nodes import code, expr, set_kwarg, stmt
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.loaders import Loader, LoaderFacts, loader_facts
from torchmigrate.rule import Rule
from torchmigrate.rules.data.plan import DataPlan, data_plan
from torchmigrate.rules.data.rewrite import Hoists, dataset_column, layout_of, rewrite_call


class DataRule(Rule):
    """A rule of the data family: reads the module's loader facts and the family's plan."""

    commands = frozenset({"ddp", "lint"})

    @property
    def facts(self) -> LoaderFacts:
        return loader_facts(self.ctx)

    @property
    def plan(self) -> DataPlan:
        return data_plan(self.ctx)

    def active(self) -> bool:
        """DDP-conversion rules report in `lint` only for files that are already distributed."""
        facts = self.facts
        if not facts.loaders or facts.skip_file:
            return False
        return self.ctx.options.mode != "lint" or facts.distributed

    def add_sampler(self, loader: Loader, message: str) -> None:
        """Report a plain loader with the edit that gives it its sampler."""
        ctx, plan = self.ctx, self.plan
        tm = ctx.tm
        decided = plan.of(loader)
        hoist = decided.hoist
        dataset_text = code(loader.dataset) if hoist is None else hoist[1]
        # the loader's own shuffle=True is kept where it evaluates (an evaluation that breaks
        # early, or takes `next(iter(loader))` for sample images, sees new batches)
        keep = loader.shuffle is not None and not (isinstance(loader.shuffle, cst.Name)
                                                   and loader.shuffle.value in ("False", "None"))
        shuffle_left = None
        if loader.kind == "eval" and decided.eval_with_grad:
            sampler_text = f"{tm}.sampler({dataset_text}, shuffle=False)"
        elif loader.kind == "eval":
            sampler_text = (f"{tm}.eval_sampler({dataset_text}, shuffle={code(loader.shuffle)})" if keep
                            else f"{tm}.eval_sampler({dataset_text})")
        else:
            shuffle = (code(loader.shuffle) if loader.shuffle is not None
                       else f'{loader.kwargs_shuffle}.get("shuffle", False)' if loader.kwargs_shuffle else "False")
            if loader.kind == "mixed":
                train_shuffle = "True" if loader.condition_is_shuffle else shuffle
                kept = keep and not loader.condition_is_shuffle
                if plan.eval_whole(loader):
                    evaluation = "None"
                    if kept:  # `shuffle=True` for every split: the evaluation branch still shuffles
                        shuffle_left = expr(f"None if {loader.condition} else {shuffle}")
                else:
                    evaluation = (f"{tm}.eval_sampler({dataset_text}, shuffle={shuffle})" if kept
                                  else f"{tm}.eval_sampler({dataset_text})")
                sampler_text = (f"{tm}.sampler({dataset_text}, shuffle={train_shuffle}) if {loader.condition} "
                                f"else {evaluation}")
            else:
                sampler_text = f"{tm}.sampler({dataset_text}, shuffle={shuffle})"
        sampler = expr(sampler_text)
        edits: List[Edit] = []
        capture = None
        new_dataset = None
        shared = sum(1 for x in self.facts.loaders if x.statement is loader.statement) > 1
        layout = None if shared else layout_of(ctx, loader.call)  # widths are unknown when two change
        if hoist is not None:
            mode, name = hoist
            if mode == "line":
                hoists = plan.hoists.get(loader.statement)
                if hoists is None:
                    hoists = plan.hoists[loader.statement] = Hoists(loader.statement)
                old = dataset_column(ctx, loader.call, layout)
                capture = hoists.add(name, 0 if old is None else len(name) + 3 - old)
                new_dataset = cst.Name(name)
            else:
                new_dataset = cst.NamedExpr(cst.Name(name), loader.dataset)
        kw = loader.kwargs_shuffle
        if layout is not None and hoist is not None and hoist[0] == "line":
            indent, first, widest = layout  # the dataset expression becomes a short name
            widest -= len(code(loader.dataset)) - len(hoist[1])
            layout = (indent, first, widest)

        # the loop reads the batch size as a shape: a rank's share may end in a partial batch
        drop_last = loader.kind == "train" and loader.sized_by is not None
        if drop_last:
            message += (f" (and `drop_last=True`: the loop uses `{loader.sized_by}` as a shape, and a rank's share "
                        "of the dataset can end in a partial batch that the full dataset never had)")

        def fix(call: cst.Call, sampler=sampler, new_dataset=new_dataset, capture=capture, kw=kw, layout=layout,
                walrus=hoist is not None and hoist[0] == "walrus", name=hoist and hoist[1], drop_last=drop_last,
                shuffle_left=shuffle_left):
            if walrus:
                positional = [a for a in call.args if a.keyword is None and not a.star]
                current = positional[0] if positional else next(
                    a for a in call.args if a.keyword is not None and a.keyword.value == "dataset")
                new_dataset = cst.NamedExpr(cst.Name(name), current.value)
            return rewrite_call(call, sampler, dataset=new_dataset, capture=capture, kwargs_shuffle=kw, layout=layout,
                                drop_last=drop_last, shuffle_left=shuffle_left)

        edits.append(replace(loader.call, fix))
        if capture is not None:
            edits.append(plan.hoists[loader.statement].edit)
        self.report(loader.call, message, edits=edits, imports=[ctx.runtime_import()])

    def manual(self, loader: Loader) -> None:
        self.report(loader.call, self.plan.of(loader).reason)


    def keep_whole(self, loader: Loader, because: str = "") -> None:
        """An evaluation loader (or the evaluation half of a mixed one) whose shards the program
        model cannot prove reduced, or that the tool cannot shard (`because`: its own batch
        sampler): every rank evaluates the whole set, and the report's notes say so, with why
        and what it costs."""
        what = f"`{loader.target}`" if loader.target else "this DataLoader"
        half = "'s evaluation branch" if loader.kind == "mixed" else ""
        why = (f"Not sharded because {because}: share its batches out by rank by hand for a speed-up" if because else
               f"Not sharded because {self.plan.of(loader).unproven}; `--shard-eval` shards it anyway")
        self.report(loader.call, f"{what}{half} kept whole: every rank evaluates the whole set, as the original "
                                 "did, so its numbers agree across ranks (the cost: each rank does the whole "
                                 f"evaluation's work). {why}", advice=True)
        if self._same_draws(loader):
            return
        if loader.kind != "mixed" and _shuffles_by_itself(loader.call) and collective_guard(self.ctx, loader.call) is None:
            tm = self.ctx.tm
            self.report(loader.call, f"{what} shuffles with each rank's own random stream, which differs per rank once "
                                     f"training starts (`{tm}.seed_per_rank()`), so the ranks would see its batches in "
                                     "different orders and compute different numbers from the same set: its order "
                                     f"comes from a generator seeded alike on every rank (`{tm}.shared_generator()`)",
                        edits=[replace(loader.call, lambda c: set_kwarg(
                            c, "generator", cst.parse_expression(f"{tm}.shared_generator()")))],
                        imports=[self.ctx.runtime_import()])

    def _same_draws(self, loader: Loader) -> bool:
        """A whole evaluation loader bound to a name: `tm.same_draws(val_loader)` after it, so
        every rank draws the same random numbers while it is iterated (a random crop or subset
        of points in the dataset, its shuffle, its workers' seeds). Once training starts each
        rank draws its own (`tm.seed_per_rank()`), and the ranks would compute different numbers
        from the same set, each choosing its own best model, learning rate or early stop. Only in
        `ddp`; a loader built for both splits is left to its shuffle (its training half must
        draw per rank)."""
        ctx = self.ctx
        if ctx.options.mode != "ddp" or loader.kind != "eval" or not loader.target:
            return False
        line = loader.statement
        if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(
                line.body[0], (cst.Assign, cst.AnnAssign)) and line.body[0].value is loader.call):
            return False
        text = f"{ctx.tm}.same_draws({loader.target})"
        body = ctx.parent(line)
        siblings = list(body.body) if isinstance(body, (cst.IndentedBlock, cst.Module)) else []
        at = next((i for i, s in enumerate(siblings) if s is line), None)
        if at is not None and at + 1 < len(siblings) and code(siblings[at + 1]).strip() == text:
            return True  # (a second run)
        self.report(loader.call, f"`{loader.target}` is read whole by every rank: it draws the same random numbers "
                                 f"on every rank while it is iterated (`{text}`), so the ranks compute the same "
                                 "numbers from it once each draws its own for training",
                    edits=[insert_after(line, [stmt(text)])], imports=[ctx.runtime_import()])
        return True

    def sharded_unproven(self, loader: Loader) -> None:
        """An evaluation loader sharded by `--shard-eval` although the program model cannot prove
        every value computed from it reduced: a TODO names the value."""
        why = self.plan.of(loader).unproven
        if why and self.ctx.options.shard_eval:
            what = "its evaluation branch sharded" if loader.kind == "mixed" else "sharded"
            self.report(loader.call, f"{what} by --shard-eval (or `shard-eval = true`), but sharding may change what "
                                     f"is computed from it, as not every value is proven reduced across ranks: {why}. "
                                     "Make that value right across ranks by hand (TM701/TM702/TM703 reduce what they "
                                     "can), or evaluate the whole set on every rank (without --shard-eval)")

    def keep_ordered(self, loader: Loader) -> None:
        """A loader whose batches the code pairs with its dataset's fields in dataset order is
        left whole, and the report says why (see `Loader.ordered`)."""
        what = f"`{loader.target}`" if loader.target else "this DataLoader"
        self.report(loader.call, f"{what} kept unsharded: the code pairs its batches with `{loader.ordered}` in "
                                 "dataset order (a feature bank and its labels), which a sharded loader would break; "
                                 "every rank runs it over the whole dataset, so the results agree across ranks")


def _shuffles_by_itself(call: cst.Call) -> bool:
    """`DataLoader(ds, shuffle=<not False>)` with no sampler and no generator of its own: its
    order comes from the process's global random stream."""
    given = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    if any(a.star for a in call.args) or {"sampler", "batch_sampler", "generator"} & set(given):
        return False
    shuffle = given.get("shuffle")
    if shuffle is None and len([a for a in call.args if a.keyword is None]) >= 3:
        shuffle = [a for a in call.args if a.keyword is None][2].value  # DataLoader(ds, bs, shuffle)
    return shuffle is not None and not (isinstance(shuffle, cst.Name) and shuffle.value in ("False", "None"))

"""The data family's decisions: for each loader of the module's facts (`program.loaders`), what
this run does with it.

- ``status``: the loader's own status (`Loader.status`), or ``"unhoistable"`` when it has no
  sampler and its dataset expression cannot be moved out of its statement;
- ``hoist``: how TM201/TM203 name the dataset expression before passing it to the sampler:
  ``("line", name)`` (an assignment before the statement) or ``("walrus", name)``;
- ``sampler``: the sampler the loader has once this run's fixes are in: ``"distributed"``
  (padded DistributedSampler semantics: ``tm.sampler``, ``tm.shard_sampler`` or
  ``DistributedSampler``), ``"eval"`` (``tm.eval_sampler``: every sample exactly once across
  ranks), ``"mixed"``, ``"custom"`` or None (every rank iterates the whole dataset). An
  evaluation loader iterated with gradients enabled gets the padded ``tm.sampler(ds,
  shuffle=False)`` (``eval_with_grad``): a DDP forward then broadcasts buffers, so ranks must
  run equal batch counts or they hang;
- ``needs_epoch``: its sampler reshuffles, so epoch loops over it need ``set_epoch`` (TM202);
- ``reason``: what to do by hand when no rule can (the TODO of a manual finding);
- ``unproven``: for an evaluation loader (or the evaluation half of a mixed one), why the
  program model cannot prove that every value computed from it is reduced across ranks before
  it is used ("" when it can). Such a loader is kept whole (``sampler`` None, or None in the
  evaluation branch of a mixed loader): every rank evaluates the whole set, as the original
  did, and its numbers agree across ranks. With `Options.shard_eval` it is sharded anyway and
  the reason becomes a TODO.

An evaluation loader is proven when every use of it in its module is a `for` loop over it
(`LoaderFacts.consumers`: handed to another module, returned to one, counted with `len()`, it
is not), its batch size is not read as a shape (`Loader.sized_by`), and every loop over it runs
under `no_grad` on every rank, runs to its end, and leaves behind only what the metrics rules
reduce (`loop_effects`): sums that TM701 reduces exactly (`loop_sums`, with `len(dataset)`
exact for an unpadded shard) and lists of per-batch values whose only use is their mean, which
TM703 gathers. Anything else a loop keeps (a metric object's state, a list of predictions, an
attribute, a file) is a value the tool cannot reduce, and a sharded loader would make it one
rank's value.

A training loader gets the status ``"whole"`` (no sampler, every rank iterates all of it) when
the program trains but wraps no model in DDP (`Options.shard_training`): shards would train a
different model on each rank.

Training data that no DataLoader carries (`program.batches`) gets a `BatchPlan` each
(`DataPlan.batches`): ``"shard"`` (TM201 shares it out by rank), ``"whole"`` (kept whole: no model
is wrapped), ``"manual"`` (``reason`` says what to do by hand) or ``"skip"`` (sharded elsewhere:
a DataLoader, a token stream, a batch iterator sharded where it is built).

Computed once per module (`data_plan(ctx)`), on the facts alone: which data rules are enabled
does not change it, so TM202 knows what TM201 gives a loader even when TM201 runs elsewhere.
"""

from __future__ import annotations

import ast
import re
from functools import cached_property
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.batches import BatchFacts, BatchLoop, FullBatchLoss, batch_facts
from torchmigrate.program.facts import iterator_builders_of, training_text
from torchmigrate.program.loaders import Loader, LoaderFacts, is_literal, is_pure, loader_expr, loader_facts, refs_at
from torchmigrate.program.loop_effects import loop_effects
from torchmigrate.program.metrics import (ExactDenominators, Sums, dict_sums, loop_sums, means_only, reassigned_in,
                                          starts_empty_list)
from torchmigrate.program.rank_guards import collective_guard

_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)
UNWRAPPED = ("kept whole: no model of the program is wrapped in DDP (see TM301), so shards would train a different "
             "model on each rank; every rank trains the same model on all the data instead. Shard it once the "
             "model is wrapped")


@dataclass(eq=False)
class LoaderPlan:
    """What this run does with one loader (see the module docstring)."""

    status: str
    reason: str = ""
    hoist: Optional[Tuple[str, str]] = None  # ("line"|"walrus", new variable name)
    sampler: Optional[str] = None
    needs_epoch: bool = False
    eval_with_grad: bool = False  # an evaluation loop over it runs with gradients enabled
    unproven: str = ""  # why its evaluation shards cannot be proven reduced ("" when they can)


@dataclass(eq=False)
class BatchPlan:
    """What this run does with a hand-made batch loop or a full-batch loss (see the module
    docstring)."""

    status: str
    reason: str = ""


class DataPlan:
    """The plan of every loader of a module, and the hoisted-dataset statements the rules share."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.facts: LoaderFacts = loader_facts(ctx)
        self.hoists: Dict[cst.CSTNode, object] = {}  # statement -> its `rewrite.Hoists`
        self._used_names: Optional[Set[str]] = None  # see `_taken_names`
        self._plans: Dict[int, LoaderPlan] = {}
        for loader in self.facts.loaders:
            self._plans[loader.index] = self._plan(loader)
        for loader in self.facts.loaders:
            plan = self._plans[loader.index]
            if loader.kind == "eval" and plan.sampler == "eval" and self.facts.iterated_with_grad(loader):
                # Unpadded shards give ranks different batch counts; a DDP forward with gradients
                # enabled broadcasts buffers (a collective), so the rank with more batches would
                # hang. A padded sampler keeps the counts equal.
                plan.eval_with_grad = True
                plan.sampler = "distributed"

    def of(self, loader: Loader) -> LoaderPlan:
        return self._plans[loader.index]

    # --- data no DataLoader carries ----------------------------------------------------------
    @property
    def batches(self) -> BatchFacts:
        return batch_facts(self.ctx)

    def batch(self, found) -> BatchPlan:
        """The plan of a `BatchLoop` or a `FullBatchLoss` of `batches` (one not yet sharded)."""
        ctx = self.ctx
        facts = self.facts
        if not ctx.options.migrating or facts.distributed or facts.skip_file or ctx.program.program_distributed:
            return BatchPlan("skip")
        if isinstance(found, FullBatchLoss):
            if ctx.program.program_loaders or facts.loaders:
                return BatchPlan("skip")  # mini-batches come from a loader: a mask there is per batch
            return BatchPlan("shard") if ctx.options.shard_training else BatchPlan("whole", UNWRAPPED)
        if found.kind == "iterable" and (found.loader or self.builds_training_iterators or (
                (ctx.program.program_loaders or facts.loaders) and not ctx.program.opaque_loaders)):
            return BatchPlan("skip")  # a loader (or a built iterator) is sharded where it is built
        # A training loop over batches this module cannot trace, in a program whose DataLoader
        # subclasses build their loaders where no `sampler=` can be added: `tm.shard_batches`
        # leaves a loader that is sharded already as it is and shards any other at run time.
        if found.kind == "range" and self._streams(found.sliced):
            return BatchPlan("skip")  # a token stream: each rank already has its own part
        if found.carried:
            return BatchPlan("manual", (
                f"this loop carries `{found.carried}` from one batch to the next (a recurrent state over "
                "consecutive chunks), so giving each rank every other batch would break it, and every rank "
                "trains on the same batches: cut the data into one contiguous part per rank before it is "
                f"batched (`{ctx.tm}.shard_stream(data)`)"))
        if found.kind in ("range", "cursor"):
            if found.unknown_order:
                return BatchPlan("manual", (
                    f"the order of {', '.join(f'`{n}`' for n in found.sliced)} comes from {found.unknown_order}, "
                    "which each rank draws for itself, so every rank trains on the same batches: draw it once "
                    f"for all ranks (`{ctx.tm}.broadcast_object(...)`) and take every "
                    f"`{ctx.tm}.world_size()`-th batch (`{ctx.tm}.shard_range(range(...))`)"))
        return BatchPlan("shard") if ctx.options.shard_training else BatchPlan("whole", UNWRAPPED)

    def _streams(self, names: Tuple[str, ...]) -> bool:
        """Some of `names` holds a token stream (`batchify(...)`, `tm.shard_stream(...)`)."""
        for assign in analysis.facts(self.ctx).assigns:
            if not {dotted(t.target) for t in assign.targets} & set(names):
                continue
            for call in self.ctx.within(assign.value, cst.Call):
                last = (dotted(call.func) or "").rsplit(".", 1)[-1].lower()
                if "batchify" in last or last == "shard_stream":
                    return True
        return False

    @cached_property
    def iterator_builders(self) -> Dict[str, Tuple[int, ...]]:
        """The program's hand-made batch iterators and their builders, as this module spells
        them (`ModuleView.iterator_builders`; of this file alone when it has no program)."""
        found = self.ctx.program.iterator_builders
        if found or self.ctx.program.followed:
            return found
        defs = [s for s in self.ctx.module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))]
        text = code(cst.Module(body=defs))
        return iterator_builders_of(ast.parse(text).body) if _MAY_ITERATE.search(text) else {}

    @cached_property
    def builds_training_iterators(self) -> bool:
        """This module builds a hand-made batch iterator over training data, which TM201 shards
        where it is built (`tm.shard_stream` on its data)."""
        builders = self.iterator_builders
        if not builders:
            return False
        for call, _name in analysis.facts(self.ctx).calls:
            positions = builders.get(dotted(call.func) or "")
            if positions is None:
                continue
            args = training_args(call, positions)
            function = self.ctx.enclosing(call, cst.FunctionDef)
            if args and (any(training_text(code(a.value)) for a in args)
                         or (function is not None and training_text(function.name.value))):
                return True
        return False

    def _plan(self, loader: Loader) -> LoaderPlan:
        plan = LoaderPlan(loader.status, _reason(loader, self.ctx.tm))
        if loader.kind != "eval" and loader.status in ("plain", "custom") and not self.ctx.options.shard_training \
                and not self.facts.skip_file:
            plan.status, plan.reason = "whole", UNWRAPPED
            return plan
        if loader.status == "plain":
            plan.hoist = self._hoist_plan(loader.call, loader)
            if plan.hoist is None and not is_pure(loader.dataset):
                plan.status = "unhoistable"
                plan.reason = ("the dataset expression cannot be moved out of this statement: assign it to a "
                               f"variable `ds` and pass `sampler={self.ctx.tm}.sampler(ds, shuffle=...)` (no `shuffle=`)")
        plan.sampler = self._sampler_after(loader, plan)
        plan.needs_epoch = self._needs_epoch(loader, plan)
        return plan

    def _hoist_plan(self, call: cst.Call, loader: Loader) -> Optional[Tuple[str, str]]:
        if loader.dataset is None or is_pure(loader.dataset):
            return None
        ctx = self.ctx
        statement = loader.statement
        mode = "line"
        child: cst.CSTNode = call
        in_comprehension = False
        for anc in ctx.ancestors(call):
            if anc is statement:
                break
            if isinstance(anc, cst.CompFor) and child is anc.iter:
                return None  # walrus is not allowed in a comprehension's iterable
            if isinstance(anc, _COMPREHENSIONS):
                in_comprehension = True
                mode = "walrus"
            elif isinstance(anc, (cst.Lambda, cst.IfExp, cst.BooleanOperation)):
                mode = "walrus"
            child = anc
        if statement is None:
            return None
        block = ctx.parent(statement)
        if mode == "line":
            if isinstance(statement, cst.SimpleStatementLine):
                small = ctx.enclosing(call, cst.BaseSmallStatement)
                if statement.body[0] is not small:
                    mode = "walrus"
            elif isinstance(statement, cst.For) and ctx.enclosing(call, cst.For) is statement and _within(call, statement.iter, ctx):
                pass
            elif isinstance(statement, cst.With) and any(_within(call, item, ctx) for item in statement.items):
                pass
            else:
                mode = "walrus"
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                mode = "walrus"
        if mode == "walrus" and in_comprehension and isinstance(ctx.scope_of(call), cst.ClassDef):
            return None
        return mode, self._new_name(loader)

    def _new_name(self, loader: Loader) -> str:
        """A readable, unused name for a hoisted dataset: `train_loader` -> `train_dataset`,
        `self.extra` -> `extra_dataset`, `return DataLoader(...)` in `get_test_loader` ->
        `test_dataset`; else by kind."""
        def from_loader_name(source: str) -> Optional[str]:
            for word, repl in (("dataloader", "dataset"), ("DataLoader", "Dataset"), ("loader", "dataset"),
                               ("Loader", "Dataset")):
                if word in source:
                    return source.replace(word, repl, 1)
            if source.endswith("_dl") or source == "dl":
                return source[:-2] + "dataset"
            return None

        base = None
        if loader.target and "[" in loader.target:
            keys = loader.bound
            if len(keys) == 1:
                base = re.sub(r"\W+", "_", keys[0].split("[", 1)[1]).strip("_") + "_dataset"
        elif loader.target:
            source = loader.target.split(".")[-1]
            base = from_loader_name(source) or f"{source}_dataset"
        elif isinstance(loader.scope, cst.FunctionDef):
            base = from_loader_name(re.sub(r"^(get|build|make|create|prepare|load|setup|init)_", "",
                                           loader.scope.name.value))
        if not base or not base.isidentifier():
            base = "eval_dataset" if loader.kind == "eval" else "train_dataset" if loader.kind == "train" else "dataset"
        taken = self._taken_names()
        name, n = base, 2
        while name in taken:
            name = f"{base}_{n}"
            n += 1
        taken.add(name)
        return name

    def _taken_names(self) -> Set[str]:
        """The module's identifiers and the names given to hoisted datasets so far (gathered on
        the first hoist: most files need none, and a module has many names)."""
        if self._used_names is None:
            self._used_names = self.facts.scan.identifiers
        return self._used_names

    def _sampler_after(self, loader: Loader, plan: LoaderPlan) -> Optional[str]:
        facts = self.facts
        if plan.status == "distributed":
            return "distributed"
        if plan.status == "custom":  # TM201 wraps a training loader's own sampler in tm.shard_sampler
            sharded = loader.custom_arg is not None and loader.kind != "eval" and not facts.skip_file \
                and not facts.distributed
            return "distributed" if sharded else "custom"
        if plan.status != "plain" or facts.skip_file or loader.ordered:
            return None
        if loader.kind == "eval":
            if facts.distributed or loader.grouped:
                return None
            plan.unproven = self._unproven(loader)
            return None if plan.unproven and not self.ctx.options.shard_eval else "eval"
        if loader.kind == "mixed":
            plan.unproven = self._unproven(loader)
        return "distributed" if loader.kind == "train" else "mixed"

    def eval_whole(self, loader: Loader) -> bool:
        """The loader's evaluation shards are not proven reduced and stay whole (the evaluation
        branch of a mixed loader gets no sampler)."""
        return bool(self.of(loader).unproven) and not self.ctx.options.shard_eval

    def _unproven(self, loader: Loader) -> str:
        """Why sharding this evaluation loader could change what the program computes from it
        ("" when every value computed from it is proven reduced: see the module docstring)."""
        facts = self.facts
        if loader.sized_by:
            return f"a loop over it reads its batch size `{loader.sized_by}` as a shape, which a rank's last batch may not fill"
        loops, escapes = facts.consumers(loader)
        if escapes:
            node, why = escapes[0]
            return why + _where(self.ctx, node)
        if not loops:
            return "no loop of this module iterates it"
        for loop in loops:
            why = self._loop_unproven(loader, loop)
            if why:
                return why
        return ""

    def _loop_unproven(self, loader: Loader, loop: cst.For) -> str:
        ctx = self.ctx
        where = _where(ctx, loop)
        if not self.facts.grad_free(loop, 0) and not self.facts.forwards_grad_free(loop):
            return (f"the loop over it{where} runs with gradients enabled, where a DDP forward needs the same number "
                    "of batches on every rank")
        if collective_guard(ctx, loop) is not None:
            return f"the loop over it{where} runs on some ranks only (a rank guard), where nothing can be reduced"
        effects = loop_effects(ctx, loop)
        if effects.leaves_early is not None:
            return f"the loop over it{where} may stop early (`{code(effects.leaves_early).strip()[:40]}`)"
        loaders = [x for r in refs_at(ctx, loader_expr(ctx, loop.iter)) for x in r.loaders]
        exact = ExactDenominators()
        if loaders == [loader]:  # what TM701 may divide by once the loader has `tm.eval_sampler`
            exact.dataset.add(code(loader_expr(ctx, loop.iter)).replace(" ", "") + ".dataset")
            if isinstance(loader.dataset, (cst.Name, cst.Attribute)):
                exact.dataset.add(code(loader.dataset))
        sums = loop_sums(ctx, loop, list(effects.bound), exact) if "TM701" in ctx.enabled else Sums()
        for name in effects.bound:
            if sums.kinds.get(name) != "sum" and name not in sums.reduced:
                return f"`{name}` carries per-batch values out of the loop over it{where}"
        for name in effects.appended:
            if not ("TM703" in ctx.enabled and starts_empty_list(ctx, loop, name)
                    and not reassigned_in(ctx, loop, name) and means_only(ctx, loop, name)):
                return f"`{name}` collects per-batch values{where} that are used other than in a mean"
        summed: Dict[str, bool] = {}  # dicts of running sums TM701 reduces after the loop
        for node, what in effects.kept:
            owner = node.value.value if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) else None
            if owner is not None and "TM701" in ctx.enabled and isinstance(loop, cst.For):
                if owner not in summed:
                    summed[owner] = dict_sums(ctx, loop, owner).reducible
                if summed[owner]:
                    continue
            return f"{what} in the loop over it{where}"
        return ""

    def _needs_epoch(self, loader: Loader, plan: LoaderPlan) -> bool:
        if self.facts.skip_file or loader.kind == "eval":
            return False
        if plan.status == "distributed":
            return loader.sampler_shuffles
        if plan.status == "custom":
            return plan.sampler == "distributed"  # a tm.shard_sampler: a new draw each epoch
        if plan.status != "plain" or plan.sampler is None:
            return False
        if loader.kind == "mixed" or loader.kwargs_shuffle:
            return True
        return loader.shuffle is not None and not is_literal(loader.shuffle, "False", "None")


def _reason(loader: Loader, tm: str) -> str:
    """What to do by hand with a loader whose sampling the rules cannot change."""
    if loader.status == "custom":
        return (f"this DataLoader has its own `{loader.custom_param}=`, which every rank iterates in full: make it "
                "shard by rank (e.g. a DistributedSampler over its indices, or "
                f"`{tm}.rank()`/`{tm}.world_size()` inside it)")
    if loader.status == "iterable":
        return ("an IterableDataset cannot take a sampler, so every rank streams the same samples: "
                f"shard the stream in `__iter__` (e.g. `itertools.islice(stream, {tm}.rank(), None, "
                f"{tm}.world_size())`, combined with `get_worker_info()` for workers)")
    if loader.unknown == "star-args":
        return (f"DataLoader(*args) hides its arguments: pass `sampler={tm}.sampler(dataset, "
                "shuffle=...)` (without `shuffle=`) so that each rank loads its own shard")
    if loader.unknown == "no-dataset":
        return (f"the dataset is not passed explicitly: pass `sampler={tm}.sampler(dataset, "
                "shuffle=...)` so that each rank loads its own shard")
    if loader.unknown == "kwargs":
        return (f"DataLoader(**{code(loader.kwargs_arg)}) may set `sampler`/`shuffle` in ways the tool "
                f"cannot see: pass `sampler={tm}.sampler(dataset, shuffle=...)` and make sure "
                "the dict sets neither `sampler` nor `shuffle=True`")
    if loader.unknown == "kwargs-shuffle":
        return "DataLoader gets `shuffle` from a dict and elsewhere: set the sampler by hand"
    return ""


_MAY_ITERATE = re.compile(r"__next__|__iter__|\byield\b")


def training_args(call: cst.Call, positions: Tuple[int, ...]) -> List[cst.Arg]:
    """The data arguments of a call of an iterator builder (at `positions`; -1: every positional one)."""
    positional = [a for a in call.args if a.keyword is None and not a.star]
    return positional if -1 in positions else [positional[p] for p in positions if p < len(positional)]


def _where(ctx, node: cst.CSTNode) -> str:
    """` in `evaluate()`` for a node inside a function (or method), else ""."""
    fn = ctx.enclosing(node, cst.FunctionDef)
    return f" in `{fn.name.value}()`" if fn is not None else ""


def _within(node: cst.CSTNode, container: cst.CSTNode, ctx) -> bool:
    return node is container or any(anc is container for anc in ctx.ancestors(node))


def data_plan(ctx) -> DataPlan:
    """The module's data plan, built on first use and kept on the context."""
    found = ctx.facts.get("data.plan")
    if found is None:
        found = ctx.facts["data.plan"] = DataPlan(ctx)
    return found  # type: ignore[return-value]

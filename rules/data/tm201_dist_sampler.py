"""TM201: every training DataLoader gets a distributed sampler (and token streams a shard)."""

from __future__ import annotations

import ast
import re
from typing import Dict

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr
from torchmigrate.program.facts import iterator_builders_of, training_text
from torchmigrate.program.loaders import Loader
from torchmigrate.rule import Example
from torchmigrate.rules.data.base import DataRule
from torchmigrate.rules.data.plan import UNWRAPPED


class DistSampler(DataRule):
    """
    ## What it does
    Gives every training `DataLoader` a distributed sampler, `sampler=tm.sampler(dataset,
    shuffle=<the original shuffle>)`, and drops the `shuffle` argument (a positional `shuffle`
    becomes a keyword first). Loaders built at top level, in `main()`, in helper functions that
    return them and in trainer-class methods are all handled, under any import spelling of
    `DataLoader`. A dataset given as an expression (`DataLoader(MyDataset(root), ...)`) is first
    assigned to a variable (`train_dataset = MyDataset(root)`) so it is built only once.

    ## Why is this bad?
    DDP does not shard inputs: without a distributed sampler every rank iterates the whole
    dataset, so N processes do N times the work per epoch and see identical batches.
    `tm.sampler` is a `DistributedSampler` under torchrun and a `RandomSampler` (or
    `SequentialSampler` when not shuffling) in a plain `python train.py` run.

    Loaders whose name, dataset or enclosing function says val/test/eval/dev are left to TM203.
    A loader built for both (`shuffle=is_train`, a dict comprehension over `["train", "val"]`)
    gets `tm.sampler(...) if <training> else ...`, where the evaluation branch follows TM203's
    decision: `tm.eval_sampler(...)` where what is computed from it is proven reduced, else
    `None` (every rank evaluates the whole set; a note says so).
    Where the loop over a training loader reads the loader's batch size as a shape
    (`out.view(opt.batch_size, 4, 4)`, `torch.ones(opt.batch_size, 1)`), the loader also gets
    `drop_last=True`: the whole dataset may divide into full batches while a rank's share of it
    does not ("shape '[8, 4, 4]' is invalid for input of size 64" on rank 1 at the last batch).
    A loader that no training step iterates and whose batches the code pairs with its dataset's
    fields in dataset order (a kNN monitor's feature bank labelled by
    `memory_loader.dataset.targets`) is kept whole, and the report says so.
    A training loader with its own `sampler=`/`batch_sampler=` (`WeightedRandomSampler`,
    `RandomSampler(replacement=True)`, a bucketing sampler of the project) gets it wrapped in
    `tm.shard_sampler(...)`: the same draw on every rank (same seed, a new one each epoch), each
    rank taking every W-th item, padded to equal step counts; a sampler built with the rank or
    world size already shards and is left alone. An `IterableDataset`, or arguments hidden in
    `*args`/`**kwargs` the tool cannot see, is reported for a manual change instead, and so is a
    training step in a program that builds no DataLoader at all (full-batch tensors, a
    hand-made loop over indices): every rank would train on the same batches. Token streams
    (`batchify(corpus.train, bsz)`) and the program's hand-made batch iterators over training
    data (a class with `__next__` such as `DatasetIterater(train_data, ...)`, a function that
    builds one, a generator slicing its arguments, `minibatch(users, items)` in a training
    function) are sharded instead: each rank reads its own contiguous part of the data,
    `tm.shard_stream(train_data)`, parts of equal length so every rank runs the same number
    of steps; evaluation data stays whole. In a program that trains but wraps no model in DDP
    (TM301 could not: the optimizer is built where the model cannot be wrapped, the training
    step runs a method other than `forward`), training data is kept whole with a TODO: shards
    would train a different model on each rank, worse than the original. Loaders
    that already have a `DistributedSampler` or a `tm` sampler are left alone. In `lint` the rule
    reports only in files that already use torch.distributed: a training loader there without a
    distributed sampler is a bug.

    ## Limitations
    `tm.sampler` pads the last shard with repeated samples so that every rank runs the same
    number of steps; the DataLoader's own `drop_last` keeps its meaning (per-rank batches).
    A `generator=` passed to the DataLoader no longer drives the shuffling.
    """

    code = "TM201"
    name = "dist-sampler"
    summary = "Shard training DataLoaders across ranks with a distributed sampler"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader
            train_loader = DataLoader(train_ds, 64, True, num_workers=4)
            """,
            after="""
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            train_loader = DataLoader(train_ds, 64, sampler=tm.sampler(train_ds, shuffle=True), num_workers=4)
            """,
        ),
        Example(
            before="""
            import torch
            def get_train_loader(root):
                return torch.utils.data.DataLoader(ImageFolder(root), batch_size=32, shuffle=True)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def get_train_loader(root):
                train_dataset = ImageFolder(root)
                return torch.utils.data.DataLoader(train_dataset, batch_size=32,
                                                   sampler=tm.sampler(train_dataset, shuffle=True))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        streams, iterators = self._shard_streams(), self._shard_iterators()
        if not (streams or iterators):
            self._no_loader_anywhere()
        if not self.active():
            return
        facts, plan = self.facts, self.plan
        for loader in facts.loaders:
            if loader.kind == "eval":
                continue
            status = plan.of(loader).status
            if status == "plain" and loader.ordered:
                if not facts.distributed:  # (said once, when the migration keeps it whole)
                    self.keep_ordered(loader)
            elif status == "plain":
                what = f"`{loader.target}`" if loader.target else "this DataLoader"
                self.add_sampler(loader, f"{what} gives every rank the whole dataset: shard it with a distributed "
                                         f"sampler (`sampler={self.ctx.tm}.sampler(...)`)")
                if loader.kind == "mixed" and plan.eval_whole(loader):
                    self.keep_whole(loader)
                elif loader.kind == "mixed":
                    self.sharded_unproven(loader)
            elif status == "custom" and loader.custom_arg is not None and not facts.distributed:
                self._shard_custom(loader)
            elif status == "whole":
                what = f"`{loader.target}`" if loader.target else "this DataLoader"
                self.report(loader.call, f"{what} {plan.of(loader).reason}")
            elif status in ("custom", "iterable", "unknown", "unhoistable") and not facts.distributed:
                self.manual(loader)

    def _shard_streams(self) -> bool:
        """`train_data = batchify(corpus.train, bsz)` (a token stream cut into `bsz` columns, read
        with `get_batch(train_data, i)`), where the training step reads it: each rank batchifies
        its own contiguous part of the stream, `batchify(tm.shard_stream(corpus.train), bsz)`, all
        parts of one length so every rank runs the same number of steps. Evaluation streams are
        left whole. True when a stream was sharded."""
        ctx = self.ctx
        if not ctx.options.migrating or self.facts.distributed or self.facts.skip_file:
            return False
        sharded = False
        for assign in analysis.facts(ctx).assigns:
            value = assign.value
            if not (isinstance(value, cst.Call) and value.args and not value.args[0].star
                    and "batchify" in (dotted(value.func) or "").rsplit(".", 1)[-1].lower()):
                continue
            first = value.args[0].value
            if _is_shard(first):
                sharded = True  # migrated already
                continue
            names = [dotted(t.target) for t in assign.targets]
            if len(names) != 1 or names[0] is None or not self._read_where_trained(names[0]):
                continue
            tm = ctx.tm
            if not ctx.options.shard_training:
                self.report(value, f"`{names[0]}`, a token stream, {UNWRAPPED}")
                continue
            self.report(value, f"`{names[0]}` is a token stream that every rank would read in full: each rank "
                               f"batchifies its own contiguous part (`{tm}.shard_stream`, equal lengths)",
                        edits=[replace(first, lambda f: cst.Call(func=expr(f"{tm}.shard_stream"), args=[cst.Arg(f)]))],
                        imports=[ctx.runtime_import()])
            sharded = True
        return sharded

    def _shard_iterators(self) -> bool:
        """A hand-made batch iterator of the program (a class with `__next__`, a function that
        builds one, a generator that slices its data: `ModuleView.iterator_builders`) built over
        training data (`build_iterator(train_data, config)`, `LMOrderedIterator(self.train, ...)`,
        `minibatch(users, pos, neg)` in `BPR_train`): each rank builds it over its own contiguous
        part of the data (`tm.shard_stream`, equal lengths, so every rank runs the same number of
        steps). Evaluation data stays whole (every rank scores all of it). True when one was."""
        ctx = self.ctx
        if not ctx.options.migrating or self.facts.distributed or self.facts.skip_file:
            return False
        builders = ctx.program.iterator_builders or self._own_builders()
        if not builders:
            return False
        tm = ctx.tm
        sharded = False
        for call, _name in analysis.facts(ctx).calls:
            position = builders.get(dotted(call.func) or "")
            if position is None:
                continue
            positional = [a for a in call.args if a.keyword is None and not a.star]
            args = positional if position < 0 else positional[position:position + 1]
            if not args:
                continue
            if any(_is_shard(a.value) for a in args):
                sharded = True  # migrated already
                continue
            function = ctx.enclosing(call, cst.FunctionDef)
            if not any(training_text(code(a.value)) for a in args) and not (
                    function is not None and training_text(function.name.value)):
                continue
            shown = ", ".join(f"`{code(a.value)}`" for a in args)
            if not ctx.options.shard_training:
                self.report(call, f"{shown} (a hand-made batch iterator's data) {UNWRAPPED}")
                continue
            self.report(call, f"{shown} feed{'s' if len(args) == 1 else ''} a hand-made batch iterator that every "
                              f"rank would read in full: each rank reads its own contiguous part "
                              f"(`{tm}.shard_stream`, equal lengths)",
                        edits=[replace(a.value, lambda v: cst.Call(func=expr(f"{tm}.shard_stream"), args=[cst.Arg(v)]))
                               for a in args],
                        imports=[ctx.runtime_import()])
            sharded = True
        return sharded

    def _own_builders(self) -> Dict[str, int]:
        """The iterator builders of this file, when it is processed without its program."""
        if self.ctx.program.followed:
            return {}
        defs = [s for s in self.ctx.module.body if isinstance(s, (cst.ClassDef, cst.FunctionDef))]
        text = code(cst.Module(body=defs))
        return iterator_builders_of(ast.parse(text).body) if _MAY_ITERATE.search(text) else {}

    def _read_where_trained(self, name: str) -> bool:
        """`name` is read in a function or loop that runs a backward pass."""
        ctx = self.ctx
        head = name.split(".")[-1]
        for use in ctx.named(head):
            for anc in ctx.ancestors(use):
                if isinstance(anc, (cst.FunctionDef, cst.For, cst.While)) and analysis.runs_backward(ctx, anc):
                    return True
                if isinstance(anc, cst.FunctionDef):
                    break
        return False

    def _no_loader_anywhere(self) -> None:
        """A training step in a program that builds no DataLoader: its batches come from
        tensors (full-batch training), a token stream (`batchify`/`get_batch`) or a hand-made
        iterator, which no sampler shards. Said plainly, once, at the first backward."""
        ctx, facts = self.ctx, self.facts
        if not ctx.options.migrating or facts.loaders or facts.distributed or facts.skip_file \
                or ctx.program.program_loaders:
            return
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "backward" and not call.args:
                tm = ctx.tm
                self.report(call, "no DataLoader in this program: every rank trains on the same batches (full-batch "
                                  "tensors, a token stream, a hand-made iterator); give each rank its own part "
                                  f"(e.g. every `{tm}.world_size()`-th batch starting at `{tm}.rank()`), or keep "
                                  "identical data on purpose (full-batch training)",
                            statement=ctx.statement_of(call))
                return

    def _shard_custom(self, loader: Loader) -> None:
        """`sampler=WeightedRandomSampler(...)` -> `sampler=tm.shard_sampler(WeightedRandomSampler(...))`."""
        arg = loader.custom_arg
        name = arg.keyword.value if arg.keyword is not None else "sampler"
        tm = self.ctx.tm
        self.report(arg.value, f"this DataLoader's own `{name}=` is iterated in full by every rank: "
                               f"`{tm}.shard_sampler` shares it out by rank (same seed on every rank)",
                    edits=[replace(arg.value, lambda v: cst.Call(func=expr(f"{tm}.shard_sampler"), args=[cst.Arg(v)]))],
                    imports=[self.ctx.runtime_import()])



_MAY_ITERATE = re.compile(r"__next__|__iter__|\byield\b")


def _is_shard(node: cst.BaseExpression) -> bool:
    """`tm.shard_stream(...)`: sharded by an earlier run."""
    return isinstance(node, cst.Call) and (dotted(node.func) or "").endswith("shard_stream")

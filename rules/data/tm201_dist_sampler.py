"""TM201: every training DataLoader gets a distributed sampler, and training data no DataLoader
carries (token streams, hand-made batches, full-batch indices) its share by rank."""

from __future__ import annotations

import re
from typing import List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr, kwarg, with_args
from torchmigrate.program.batches import BatchLoop, FullBatchLoss
from torchmigrate.program.facts import CONFIG_RECEIVERS, training_text
from torchmigrate.program.effects import NUMPY, TRAIN
from torchmigrate.program.syntax import local_callee
from torchmigrate.program.loaders import Loader, asks_for_evaluation, bind_args, is_literal, is_pure
from torchmigrate.program.writes import call_kinds
from torchmigrate.rule import Example
from torchmigrate.rules.data.base import DataRule
from torchmigrate.rules.data.plan import UNWRAPPED, BatchPlan, training_args
from torchmigrate.rules.model.batch import DIVIDED, divides_batches, splits_batches


def _whole_batches(tm: str, what: str) -> str:
    """What `tm.shard_batches` does to the global batch, said where the batches are made."""
    return (f"each rank takes whole batches of `{what}`, so a step trains on `{tm}.world_size()` of the "
            "original's batches (a global batch world_size times larger, world_size times fewer steps per epoch) "
            f"with the learning rate unchanged: divide its batch size where it is set "
            f"(`{tm}.per_rank_batch(batch_size)`; then its `len()` counts the batches of every rank) or scale the "
            f"learning rate (`lr * {tm}.world_size()`)")


class DistSampler(DataRule):
    """
    ## What it does
    Gives every training `DataLoader` a distributed sampler, `sampler=tm.sampler(dataset,
    shuffle=<the original shuffle>)`, and drops the `shuffle` argument (a positional `shuffle`
    becomes a keyword first). Loaders built at top level, in `main()`, in helper functions that
    return them and in trainer-class methods are all handled, under any import spelling of
    `DataLoader`. A dataset given as an expression (`DataLoader(MyDataset(root), ...)`) is first
    assigned to a variable (`train_dataset = MyDataset(root)`) so it is built only once.
    A factory that builds the training loader and is also called for evaluation data
    (`dev_loader = get_loader(dev_file, bs)`, by the name it is bound to or the files it is
    given, in any module) is called there as `tm.unsharded(get_loader, ...)`, followed by
    `tm.same_draws(dev_loader)`: every rank evaluates the whole set, so the numbers that choose
    the best model or stop training agree across ranks.

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
    `*args`/`**kwargs` the tool cannot see, is reported for a manual change instead.

    Training data that no DataLoader carries is sharded too, always with equal step counts:
    - token streams (`batchify(corpus.train, bsz)`) and the program's hand-made batch iterators
      over training data (a class with `__next__` such as `DatasetIterater(train_data, ...)`, a
      function that builds one, a generator indexing its arguments, `minibatch(users, items)` in
      a training function): each rank reads its own contiguous part of every data argument,
      `tm.shard_stream(train_data)`, parts of equal length;
    - a hand-made loop over batch starts whose body is a training step
      (`for i in range(0, len(X), bs): xb = X[perm[i:i + bs]]`, also under `enumerate`/`tqdm`):
      `tm.shard_range(range(...))`, rank r taking batches r, r+W, ...; the permutation the loop
      slices (`perm = torch.randperm(n)`, `np.random.shuffle(idx)`) is drawn by rank 0 and shared
      (`tm.broadcast_object`), so the ranks' batches are disjoint;
    - in a program with no DataLoader, a training loop over any other iterable of batches (a
      generator, a `BatchIterator`, a bucket iterator, a list of batches): `tm.shard_batches(...)`,
      each rank keeping every W-th batch of a sequence drawn alike on every rank. Its batches
      stay whole, so a step trains on W of the original's: under the global batch policy a TODO
      says so where the loop reads them (divide the batch size where it is set, or scale the
      learning rate);
    - full-batch training (`loss = F.nll_loss(out[idx_train], labels[idx_train])`, a node or edge
      mask of a graph): each rank scores its part of the training indices (`tm.shard_indices`)
      and `tm.shard_mean` weights the parts, so the averaged gradient and the loss are exactly
      those of one process.
    A loop that carries a state from one batch to the next (`output, hidden = model(x, hidden)`),
    an order drawn by a call the tool cannot share (`X, y = shuffle(X, y)`), a summed or weighted
    full-batch loss, or a training step over data the tool cannot see stays whole with a TODO
    that says so: every rank would train on the same batches. Evaluation data stays whole.
    In a program that trains but wraps no model in DDP
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
    summary = "Shard training data across ranks: DataLoaders, token streams, hand-made batches, full-batch indices"
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

    def _whole_for_evaluation(self) -> None:
        """`dev_loader = get_loader(dev_file, bs)`, a call for evaluation data of the factory that
        also builds the training loader, whose sampler this run shards (`LoaderFacts.whole_sites`):
        `tm.unsharded(get_loader, dev_file, bs)`, so every rank evaluates the whole set and the
        numbers computed from it agree across ranks (they choose the best model, the early stop);
        `tm.same_draws(dev_loader)` after it where it is bound to a name."""
        ctx, plan = self.ctx, self.plan
        sites = list(self.facts.whole_sites)
        factories = ctx.program.loader_factories
        if factories and ctx.options.shard_training:
            # another module's factory (`dev_dataloader = get_loader(args.dev_file, bs)`)
            for assign in analysis.facts(ctx).assigns:
                call = assign.value
                if isinstance(call, cst.Call) and dotted(call.func) in factories and len(assign.targets) == 1 \
                        and asks_for_evaluation(call, assign.targets[0].target):
                    sites.append((call, []))
        for call, found in sites:
            if not all(plan.of(x).status == "plain" for x in found) or any(a.star for a in call.args):
                continue
            line = ctx.statement_of(call)
            assign = line.body[0] if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 else None
            target = code(assign.targets[0].target) if isinstance(assign, cst.Assign) and assign.value is call \
                and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name) else None
            edits = [replace(call, lambda c: c.with_changes(
                func=cst.parse_expression(f"{ctx.tm}.unsharded"), args=[cst.Arg(c.func), *c.args]))]
            if target is not None:
                edits.append(insert_after(line, [cst.parse_statement(f"{ctx.tm}.same_draws({target})")]))
            what = f"`{target}`" if target else "this loader"
            self.report(call, f"{what} is evaluation data built by `{code(call.func)}`, which also builds the training "
                              f"loader that is sharded now: every rank takes the whole set "
                              f"(`{ctx.tm}.unsharded({code(call.func)}, ...)`), drawn alike, so the numbers computed "
                              "from it agree across ranks", edits=edits, imports=[ctx.runtime_import()])

    def leave_Module(self, node: cst.Module) -> None:
        streams, iterators = self._shard_streams(), self._shard_iterators()
        covered = self._shard_batch_data()
        if not (streams or iterators):
            self._no_loader_anywhere(covered)
        if self.ctx.options.mode == "ddp" and not self.facts.skip_file and not self.facts.distributed:
            self._whole_for_evaluation()
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
                elif loader.kind == "train":
                    self._read_elsewhere(loader)
            elif status == "custom" and loader.custom_arg is not None and not facts.distributed:
                self._shard_custom(loader)
            elif status == "whole":
                what = f"`{loader.target}`" if loader.target else "this DataLoader"
                self.report(loader.call, f"{what} {plan.of(loader).reason}")
            elif status in ("custom", "iterable", "unknown", "unhoistable") and not facts.distributed:
                self.manual(loader)

    def _read_elsewhere(self, loader: Loader) -> None:
        """A training loader, now sharded, also handed to a function of another module that does
        not train and computes in numpy from what it reads (`fid = calculate_fid(train_loader,
        model)`: feature statistics over "the dataset"): there each rank reads only its own part
        of the data, so the result covers 1/world of it and differs per rank (a metric that picks
        the best checkpoint). Named at the call. (A function of this file is the metric rules':
        they reduce what it sums or collects over the loader, or name it there.)"""
        ctx = self.ctx
        texts = {(ref.scope, ref.text) for ref in loader.refs}
        if not texts:
            return
        for call, _name in analysis.facts(ctx).calls:  # (a library call reaches no program code: no kinds)
            handed = [a for a in call.args if not a.star and (ctx.scope_of(call), dotted(a.value)) in texts]
            kinds = call_kinds(ctx, call) if handed and local_callee(ctx, call) is None else None
            if kinds is None or TRAIN in kinds or NUMPY not in kinds:
                continue
            shown = code(call.func)
            self.report(call, f"`{code(handed[0].value)}`, a training loader now sharded, is also read by {shown}(), "
                              f"which does not train: there each rank sees only its own part of the data, so what "
                              f"it computes covers 1/world of it and differs per rank. Give {shown}() a loader over "
                              f"the whole dataset (every rank computing the same), or reduce its result across ranks")

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
            if any(_is_shard(a.value) for a in value.args):
                sharded = True  # migrated already
                continue
            first = self._stream_argument(value)
            if first is None:
                continue
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

    def _stream_argument(self, call: cst.Call) -> Optional[cst.BaseExpression]:
        """The token stream among the arguments of `batchify(...)`: where this file defines it,
        the parameter it reads as a tensor (`data.size(0)`, `data.narrow(...)`, `data.view(...)`,
        `len(data)`, `data[...]`: `def batchify(args, data, bsz)`); else the argument named for
        training data (`corpus.train`), else the first that is neither a number nor the
        program's configuration (`args`, `config`)."""
        positional = [a for a in call.args if a.keyword is None and not a.star]
        fn = analysis.facts(self.ctx).functions.get(dotted(call.func) or "")
        if fn is not None:
            names = [p.name.value for p in fn.params.params]
            for i, name in enumerate(names):
                if i < len(positional) and _read_as_tensor(self.ctx, fn, name):
                    return positional[i].value
        for a in positional:
            if training_text(code(a.value)):
                return a.value
        for a in positional:
            root = (dotted(a.value) or "").split(".")[0]
            if root and root.lower() not in CONFIG_RECEIVERS and root != "device":
                return a.value
        return None

    def _shard_iterators(self) -> bool:
        """A hand-made batch iterator of the program (a class with `__next__`, a function that
        builds one, a generator that slices its data: `ModuleView.iterator_builders`) built over
        training data (`build_iterator(train_data, config)`, `LMOrderedIterator(self.train, ...)`,
        `minibatch(users, pos, neg)` in `BPR_train`): each rank builds it over its own part of the
        data (`tm.shard_stream`, equal lengths, so every rank runs the same number of steps: a
        list of samples dealt out at random, so a list saved in class order is not cut into one
        class per rank, and a tensor or array cut contiguously, as a token stream must be). Evaluation data stays whole (every rank scores all of it). True when one was."""
        ctx = self.ctx
        if not ctx.options.migrating or self.facts.distributed or self.facts.skip_file:
            return False
        builders = self.plan.iterator_builders
        if not builders:
            return False
        tm = ctx.tm
        sharded = False
        for call, _name in analysis.facts(ctx).calls:
            positions = builders.get(dotted(call.func) or "")
            if positions is None:
                continue
            args = training_args(call, positions)
            if not args:
                continue
            if any(_is_shard(a.value) for a in args):
                sharded = True  # migrated already
                continue
            function = ctx.enclosing(call, cst.FunctionDef)
            if not any(training_text(code(a.value)) for a in args) and not (
                    function is not None and training_text(function.name.value)):
                continue
            if all(file_name(ctx, a.value) for a in args):
                continue  # the iterator reads a file it is named (`DataLoader(data_dir + "/train.json", ...)`)
            shown = ", ".join(f"`{code(a.value)}`" for a in args)
            if not ctx.options.shard_training:
                self.report(call, f"{shown} (a hand-made batch iterator's data) {UNWRAPPED}")
                continue
            self.report(call, f"{shown} feed{'s' if len(args) == 1 else ''} a hand-made batch iterator that every "
                              f"rank would read in full: each rank reads its own part "
                              f"(`{tm}.shard_stream`, equal lengths: a list of samples dealt out at random once "
                              f"per run, the iterator reshuffling within it; a tensor or array a contiguous part)",
                        edits=[replace(a.value, lambda v: cst.Call(func=expr(f"{tm}.shard_stream"), args=[cst.Arg(v)]))
                               for a in args],
                        imports=[ctx.runtime_import()])
            sharded = True
        return sharded

    def _shard_batch_data(self) -> Set[cst.CSTNode]:
        """Training data that no DataLoader carries, shared out by rank where the plan says so
        (`DataPlan.batch`): a hand-made loop over batch starts (`for i in range(0, len(X), bs)`)
        takes every W-th batch (`tm.shard_range`), and the permutation its batches come from is
        drawn once for all ranks (`tm.broadcast_object`); a loop over an iterable of batches (a
        generator, a `BatchIterator`, a bucket iterator) keeps every W-th batch
        (`tm.shard_batches`); a full-batch loss over training indices (`out[idx_train]`) takes
        this rank's part of them (`tm.shard_indices`), weighted so that the averaged gradient
        and the loss are one process's (`tm.shard_mean`). Returns the loops and functions whose
        training steps now read this rank's part (or say why not), for `_no_loader_anywhere`."""
        ctx, plan = self.ctx, self.plan
        covered: Set[cst.CSTNode] = set()
        batches = plan.batches
        for found in batches.loops:
            decided = BatchPlan("done") if found.sharded else plan.batch(found)
            if decided.status != "skip":
                covered.add(found.loop)
            if decided.status == "shard":
                self._shard_loop(found)
            elif decided.status == "manual":
                self.report(found.loop.iter, decided.reason)
            elif decided.status == "whole":
                self.report(found.loop.iter, f"`{code(found.wrapped)}` (hand-made batches) {decided.reason}")
        for loss in batches.losses:
            decided = BatchPlan("done") if loss.sharded else plan.batch(loss)
            if decided.status != "skip":
                covered.add(ctx.enclosing(loss.call, cst.FunctionDef) or ctx.module)
            if decided.status == "shard":
                self._shard_loss(loss)
            elif decided.status == "whole":
                self.report(loss.call, f"`{loss.index}`, full-batch training data, {decided.reason}")
        return covered

    def _shard_loop(self, found: BatchLoop) -> None:
        ctx = self.ctx
        tm = ctx.tm
        helper = "shard_range" if found.kind == "range" else "shard_batches"
        divided = divided_range(ctx, found) if found.kind == "range" else None
        wrapped = found.wrapped

        def shard(w):
            if divided is not None:  # the step of `range(0, n, bs)`: each rank's share of a batch
                args = list(w.args)
                args[2] = args[2].with_changes(value=_per_rank(tm, args[2].value))
                w = w.with_changes(args=args)
            return cst.Call(func=expr(f"{tm}.{helper}"), args=[cst.Arg(w)])

        edits = [replace(wrapped, shard)]
        if found.kind == "cursor":
            edits = [replace(sub, lambda n: cst.Call(func=expr(f"{tm}.rank_part"), args=[cst.Arg(n)]))
                     for sub in found.slices]
            data = ", ".join(f"`{n}`" for n in found.sliced)
            message = (f"this loop reads every batch of {data} at a cursor it moves itself, which every rank "
                       f"would read alike: each rank takes its part of every batch (`{tm}.rank_part`), so a step "
                       "still trains on the original's batch (the same samples, split among the ranks)")
        elif found.kind == "drawn":
            self.report(found.loop.iter, (
                f"this loop counts steps and draws its batches with `next()` from `{code(wrapped)}`, which every "
                f"rank would read alike: each rank draws every `{tm}.world_size()`-th batch of it, in the same "
                f"order on every rank (`iter({tm}.shard_batches(...))`), and keeps its number of steps, so a step "
                f"trains on `{tm}.world_size()` of the original's batches (a larger global batch): divide the "
                f"batch size by `{tm}.world_size()` where it is set, or scale the learning rate"),
                edits=[replace(wrapped, lambda w: cst.Call(func=cst.Name("iter"), args=[cst.Arg(
                    cst.Call(func=expr(f"{tm}.shard_batches"), args=[cst.Arg(w)]))]))],
                imports=[ctx.runtime_import()])
            return
        elif found.kind == "range":
            data = ", ".join(f"`{n}`" for n in found.sliced)
            message = (f"this loop gives every rank every batch of {data}: each rank takes every "
                       f"`{tm}.world_size()`-th batch (`{tm}.shard_range`, the same number of steps on every rank)")
            if divided is not None:
                edits += [replace(node, lambda n: _per_rank(tm, n)) for node in divided]
                message += (f"; each batch is `{tm}.per_rank_batch(...)` of the original's, so a step still trains on "
                            "the original's global batch (the same samples, split among the ranks)")
            elif divides_batches(ctx):
                self.report(found.loop.iter, f"each rank takes whole batches of this loop, so a step trains on "
                                             f"`{tm}.world_size()` of the original's batches (a larger global batch, "
                                             "fewer steps per epoch): its batch size is read elsewhere in the loop "
                                             "too, so it is not divided here; divide it by "
                                             f"`{tm}.world_size()` where it is set, or scale the learning rate")
        else:
            message = (f"every rank would train on every batch of `{code(found.wrapped)}`: each rank keeps every "
                       f"`{tm}.world_size()`-th batch, drawn in the same order on every rank (`{tm}.shard_batches`, "
                       "the same number of steps on every rank)")
            if divides_batches(ctx):
                self.report(found.loop.iter, _whole_batches(tm, code(found.wrapped)))
        orders = [o for o in found.orders if not o.shared]
        methods = [o for o in orders if o.kind == "method"]
        orders = [o for o in orders if o.kind != "method"]
        for order in methods:
            edits.append(replace(order.node, lambda c: cst.Call(func=expr(f"{tm}.agreed"), args=[
                cst.Arg(c.func), *[a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in c.args]])))
        if methods:
            message += (f"; {', '.join(sorted({f'`{code(o.node.func)}()`' for o in methods}))} reorders it alike "
                        f"on every rank (`{tm}.agreed`), so the ranks' batches are disjoint")
        for order in orders:
            if order.kind == "draw":
                edits.append(replace(order.node, lambda c: cst.Call(func=expr(f"{tm}.broadcast_object"),
                                                                    args=[cst.Arg(c)])))
            else:
                edits.append(insert_after(order.node, [cst.parse_statement(
                    f"{order.name}[:] = {tm}.broadcast_object({order.name})")]))
        if orders:
            message += (f"; the order {', '.join(sorted({f'`{o.name}`' for o in orders}))} is drawn by rank 0 and "
                        f"shared (`{tm}.broadcast_object`), so the ranks' batches are disjoint")
        self.report(found.loop.iter, message, edits=edits, imports=[ctx.runtime_import()])

    def _shard_loss(self, loss: FullBatchLoss) -> None:
        ctx = self.ctx
        tm = ctx.tm
        index = loss.index
        edits = [replace(i, lambda v: cst.Call(func=expr(f"{tm}.shard_indices"), args=[cst.Arg(v)]))
                 for i in loss.indices]
        edits.append(replace(loss.call, lambda c: cst.Call(func=expr(f"{tm}.shard_mean"),
                                                           args=[cst.Arg(c), cst.Arg(expr(index))])))
        self.report(loss.call, f"full-batch training: every rank would score all of `{index}`; each rank takes its "
                               f"part (`{tm}.shard_indices`), and `{tm}.shard_mean` weights the parts so that the "
                               "averaged gradient and the loss are those of one process",
                    edits=edits, imports=[ctx.runtime_import()])

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

    def _no_loader_anywhere(self, covered: Set[cst.CSTNode]) -> None:
        """A training step in a program that builds no DataLoader: its batches come from
        tensors (full-batch training), a token stream (`batchify`/`get_batch`) or a hand-made
        iterator, which no sampler shards. Said plainly, once, at the first backward that no
        sharded loop or loss (`covered`, see `_shard_batch_data`) runs."""
        ctx, facts = self.ctx, self.facts
        if not ctx.options.migrating or facts.loaders or facts.distributed or facts.skip_file \
                or ctx.program.program_loaders:
            return
        steps = {name for node in covered if isinstance(node, cst.For)
                 for name in self._functions_called(node.body)}
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            function = ctx.enclosing(call, cst.FunctionDef)
            if (function or ctx.module) in covered or (function is not None and function.name.value in steps) \
                    or any(anc in covered for anc in ctx.ancestors(call)):
                continue
            if isinstance(func, cst.Attribute) and func.attr.value == "backward" and not call.args:
                tm = ctx.tm
                self.report(call, "no DataLoader in this program: every rank trains on the same batches (full-batch "
                                  "tensors, a token stream, a hand-made iterator); give each rank its own part, "
                                  f"the same number of steps on every rank (`{tm}.shard_range(...)` over batch "
                                  f"starts or `{tm}.shard_batches(...)` over an iterable of batches pad the last "
                                  "round; a rank with one step more waits forever in the backward), or keep "
                                  "identical data on purpose (full-batch training)",
                            statement=ctx.statement_of(call))
                return

    def _functions_called(self, block: cst.CSTNode) -> Set[str]:
        return {(dotted(c.func) or "").rsplit(".", 1)[-1] for c in self.ctx.within(block, cst.Call, skip_defs=True)}

    def _shard_custom(self, loader: Loader) -> None:
        """`sampler=WeightedRandomSampler(...)` -> `sampler=tm.shard_sampler(WeightedRandomSampler(...))`.

        A sampler the program sets only sometimes (`sampler=train_sampler, shuffle=(train_sampler
        is None)`, pytorch/examples' idiom): `tm.shard_sampler(train_sampler, dataset=ds,
        shuffle=(train_sampler is None))` and `shuffle=False` (a loader given a sampler refuses
        `shuffle=True`), so the ranks share out whichever order the program picked."""
        arg = loader.custom_arg
        name = arg.keyword.value if arg.keyword is not None else "sampler"
        tm = self.ctx.tm
        block = _batch_block(loader) if name == "sampler" else []
        shuffle = next((a for a in loader.call.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
        optional = name == "sampler" and shuffle is not None and not (
            isinstance(shuffle.value, cst.Name) and shuffle.value.value == "False")
        if optional:
            if not isinstance(loader.dataset, (cst.Name, cst.Attribute)):
                self.report(arg.value, f"this DataLoader's own `sampler=` may be None (`shuffle={code(shuffle.value)}`): "
                                       f"use `sampler={tm}.shard_sampler({code(arg.value)}, dataset=<the dataset>, "
                                       f"shuffle={code(shuffle.value)})` and `shuffle=False`")
                return
            dataset, order = loader.dataset, shuffle.value.with_changes(lpar=[], rpar=[])
            self.report(arg.value, f"this DataLoader's own `sampler=` (or, where it is None, its shuffled order) is "
                                   f"iterated in full by every rank: `{tm}.shard_sampler` shares it out by rank",
                        edits=[replace(arg.value, lambda v: with_args(cst.Call(func=expr(f"{tm}.shard_sampler")), [
                            cst.Arg(v), kwarg("dataset", dataset), kwarg("shuffle", order), *block])),
                               replace(shuffle.value, lambda v: cst.Name("False"))],
                        imports=[self.ctx.runtime_import()])
            return
        if splits_batches(self.ctx, loader):
            self.report(arg.value, f"this DataLoader's own `batch_sampler=` is iterated in full by every rank: "
                                   f"`{tm}.shard_sampler(..., split_batches=True)` gives each rank its part of every "
                                   "batch (the same draw on every rank), so the loader keeps its number of batches "
                                   "and a step still trains on the original's batch",
                        edits=[replace(arg.value, lambda v: with_args(cst.Call(func=expr(f"{tm}.shard_sampler")),
                                                                       [cst.Arg(v), kwarg("split_batches",
                                                                                          cst.Name("True"))]))],
                        imports=[self.ctx.runtime_import()])
            return
        self.report(arg.value, f"this DataLoader's own `{name}=` is iterated in full by every rank: "
                               f"`{tm}.shard_sampler` shares it out by rank (same seed on every rank)",
                    edits=[replace(arg.value, lambda v: with_args(cst.Call(func=expr(f"{tm}.shard_sampler")),
                                                                   [cst.Arg(v), *block]))],
                    imports=[self.ctx.runtime_import()])


def _batch_block(loader: Loader) -> List[cst.Arg]:
    """`batch_size=<the loader's batch size>` for `tm.shard_sampler`, which then deals the
    sampler's sequence in blocks of a batch: a sampler that yields K samples of one identity in
    a row (a PK sampler for a triplet loss) keeps them on one rank. Only a literal or a plain
    name or attribute (read twice), as the original wrote it."""
    bound = bind_args(loader.call)
    size = bound.get("batch_size") if bound else None
    if size is None or not (isinstance(size.value, cst.Integer) or (
            isinstance(size.value, (cst.Name, cst.Attribute)) and is_pure(size.value)
            and not is_literal(size.value, "None"))):
        return []
    return [kwarg("batch_size", size.value.deep_clone())]


_FILE_SUFFIX = re.compile(r"\.(json|jsonl|txt|csv|tsv|pkl|pickle|npy|npz|h5|hdf5|pt|pth|tar|zip|gz|conll|xml|yaml|yml)$",
                          re.IGNORECASE)
_FILE_WORDS = re.compile(r"(?i)(file|path|dir|fname|filename)$")


def file_name(ctx, node: cst.BaseExpression) -> bool:
    """`node` names a file or folder rather than holding data: a string with a path or a file
    suffix (`data_dir + "/train.json"`, an f-string), `os.path.join(...)`, `Path(...)`, or a
    name that says so (`opt.train_file`, `data_path`)."""
    for s in ctx.within(node, cst.SimpleString):
        value = s.evaluated_value
        if isinstance(value, str) and ("/" in value or _FILE_SUFFIX.search(value)):
            return True
    for s in ctx.within(node, cst.FormattedStringText):
        if "/" in s.value or _FILE_SUFFIX.search(s.value):
            return True
    if isinstance(node, cst.Call) and (ctx.resolve(node.func) or "") in (
            "os.path.join", "pathlib.Path", "pathlib.PurePath"):
        return True
    leaf = node.attr.value if isinstance(node, cst.Attribute) else node.value if isinstance(node, cst.Name) else ""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
            and isinstance(node.slice[0].slice.value, cst.SimpleString):
        leaf = str(node.slice[0].slice.value.evaluated_value)
    return bool(leaf) and bool(_FILE_WORDS.search(leaf))


def _read_as_tensor(ctx, fn: cst.FunctionDef, name: str) -> bool:
    """`fn` reads its parameter `name` as a tensor or sequence: `name.size(0)`, `.narrow(...)`,
    `.view(...)`, `.shape`, `len(name)`, `name[...]`."""
    for node in ctx.within(fn.body, cst.Attribute, cst.Subscript, cst.Call):
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == name \
                and node.attr.value in ("size", "narrow", "view", "shape", "reshape", "numel"):
            return True
        if isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) and node.value.value == name:
            return True
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "len" \
                and node.args and isinstance(node.args[0].value, cst.Name) and node.args[0].value.value == name:
            return True
    return False


def _is_shard(node: cst.BaseExpression) -> bool:
    """`tm.shard_stream(...)`: sharded by an earlier run."""
    return isinstance(node, cst.Call) and (dotted(node.func) or "").endswith("shard_stream")


def _per_rank(tm: str, value: cst.BaseExpression) -> cst.Call:
    return cst.Call(func=expr(f"{tm}.{DIVIDED}"), args=[cst.Arg(value.with_changes(lpar=[], rpar=[]))])


def divided_range(ctx, found: BatchLoop) -> Optional[List[cst.CSTNode]]:
    """Under the global batch policy, where the batch of a loop over batch starts
    (`for i in range(0, n, bs)`) can be divided among the ranks: the occurrences of `bs` in the
    slice bounds `X[i:i + bs]` (also `min(i + bs, n)`), which become `tm.per_rank_batch(bs)` with
    the range's step. Rank r then takes per-rank batches r, r+W, ..., whose union at each step is
    the original's batch. None when it cannot: no step, `bs` read elsewhere in the loop (a
    shape, a count), or the global policy is not in force."""
    if not divides_batches(ctx):
        return None
    call = found.wrapped
    if not isinstance(call, cst.Call) or len(call.args) != 3 or any(a.keyword or a.star for a in call.args):
        return None
    step = call.args[2].value
    if DIVIDED in code(step) or isinstance(step, cst.Integer) and step.evaluated_value == "1":
        return None
    text = code(step)
    target = found.loop.target
    var = target.value if isinstance(target, cst.Name) else None
    if var is None or not isinstance(step, (cst.Name, cst.Attribute, cst.Integer)):
        return None
    bounds, elsewhere = [], 0
    for node in ctx.within(found.loop.body, type(step)):
        if code(node) != text:
            continue
        parent = ctx.parent(node)
        if isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Add) \
                and {code(parent.left), code(parent.right)} == {var, text} and _in_upper_bound(ctx, parent, var):
            bounds.append(node)
        else:
            elsewhere += 1
    return bounds if bounds and not elsewhere else None


def _in_upper_bound(ctx, node: cst.CSTNode, var: str) -> bool:
    """`node` is (inside) the upper bound of a slice whose lower bound is `var`: `X[i:i + bs]`,
    `X[i:min(i + bs, n)]`."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.Slice):
            return anc.upper is child and anc.lower is not None and code(anc.lower) == var
        if isinstance(anc, (cst.BaseStatement, cst.SubscriptElement)):
            return False
        child = anc
    return False

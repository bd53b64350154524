"""Where the ranks' random streams part (TM105): once training starts, never before.

Everything drawn before training must agree on every rank: the initial weights (DDP broadcasts
rank 0's anyway, but a model that is never wrapped does not get them), a random split of the
data, a generated validation set. Everything drawn during training should differ: dropout
masks, augmentations, noise, the seeds of DataLoader workers. So the program keeps its own
seeding, and `tm.seed_per_rank()` goes right before each training loop of the module (a `for`
or `while` that runs a backward, directly or through a function or method of this module it
calls, or that iterates a training DataLoader):

- before the outermost such loop whose body builds nothing the ranks must share (an
  optimizer, a DataLoader, a `tm.wrap_model`, a seeding call, a `random_split`): a loop over
  cross-validation folds that builds a model in each fold keeps its draws agreed, and the
  call goes before the epoch loop inside it;
- nowhere when the outermost training loop draws a permutation or a shuffle (`torch.randperm`,
  `np.random.permutation`, `random.shuffle`, `random.sample`) outside a `tm.broadcast_object`:
  hand-made batches cut from it, or a split taken from it, must agree on every rank. TM105 then
  says why (`Blocked`). The order of a hand-made batch loop that TM201 shards is drawn by rank 0
  and shared, so it does not block; nor do the draws TM107 makes agree (`agreed_draws`).

`agreed_draws`: a permutation or shuffle that training code draws again and again (in a loop, or
in a function of a module other than the entry, which an epoch loop may call: a trainer's
`random.shuffle(self.graphs)`, a helper's `torch.randperm(len(pos) + len(neg))`) becomes
`tm.agreed(random.shuffle, self.graphs)`: drawn under streams seeded alike on every rank, new at
each call, the program's own streams untouched. Once the ranks' streams part, the batches cut
from a per-rank permutation would overlap (rank 0's and rank 1's shares of two different orders);
drawn alike, the shares are disjoint. Not per-sample code (a dataset, a transform, a model: there
draws should differ, and a data-loader worker cannot join a collective), not under a rank guard,
not a permutation made on a device (`device=`; the shared streams are the CPU's), not the order
of a hand-made batch loop (the data family shares it, or leaves it where it does not shard), not
in a generator of batches or a class that makes them (`tm.shard_batches` runs them under streams
seeded alike, `tm.agreed(loader.shuffle)` calls their reshuffling).

Full-batch training whose training indices TM201 shares out (`tm.shard_mean`) gets nothing: every
rank runs the one forward pass whose loss the ranks split, so its dropout must draw alike, as in
one process. Samplers need nothing: `tm.sampler` (DistributedSampler) shuffles with its own seed
and epoch, and `tm.shard_sampler` draws under a seed of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.loaders import _iteration_site, loader_facts
from torchmigrate.rule import Context
from torchmigrate.rules.data.plan import data_plan
from torchmigrate.program.batches import batch_facts
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.syntax import local_callee
from torchmigrate.syntax.nodes import arg
from torchmigrate.rules.launch.base import SEEDERS, per_sample

# Draws whose result must be the same on every rank where they cut or split the data.
AGREED = frozenset({"torch.randperm", "numpy.random.permutation", "random.shuffle", "numpy.random.shuffle",
                    "random.sample"})
# Built once for all ranks before training: a training loop that builds one is a setup loop
# (with the runtime's `wrap_model` and `seed_everything`).
_SETUP = frozenset({"torch.utils.data.random_split"}) | frozenset(SEEDERS)
_LOOPS = (cst.For, cst.While)


@dataclass(frozen=True)
class Placement:
    loop: cst.CSTNode  # the statement `tm.seed_per_rank()` goes before


@dataclass(frozen=True)
class Blocked:
    loop: cst.CSTNode  # the outermost training loop
    draw: cst.Call  # the draw in it that must agree on every rank


def agreed_draws(ctx: Context) -> List[cst.Call]:
    """The draws of this module that TM107 makes agree on every rank (`tm.agreed(draw, ...)`)."""
    found = ctx.facts.get("launch.agreed_draws")
    if found is None:
        found = ctx.facts["launch.agreed_draws"] = _agreed_draws(ctx)
    return found  # type: ignore[return-value]


def _agreed_draws(ctx: Context) -> List[cst.Call]:
    if "TM107" not in ctx.enabled:
        return []
    shared = _Streams.shared_by(ctx)
    orders = batch_facts(ctx).order_draws
    out = []
    for call, name in analysis.facts(ctx).calls:
        if name not in AGREED or _explicit_generator(call) or arg(call, "device") is not None \
                or any(a.star for a in call.args):
            continue
        func = ctx.enclosing(call, cst.FunctionDef)
        in_loop = any(isinstance(a, _LOOPS) for a in _ancestors_in_function(ctx, call))
        if not in_loop and (func is None or ctx.program.is_entry):
            continue  # drawn once: at import, alike on every rank; in a function of the entry, TM107 shares it
        if func is not None and (per_sample(ctx, func) or _generates(ctx, func)):
            continue
        if name == "random.sample" and _batch_sized(ctx, call) or batch_permutation(ctx, call):
            continue
        if collective_guard(ctx, call) is not None:
            continue
        if id(call) in orders or call in shared or ctx.statement_of(call) in shared or in_broadcast(ctx, call) \
                or _broadcast_next(ctx, call):
            continue
        out.append(call)
    return out


def _batch_sized(ctx: Context, call: cst.Call) -> bool:
    """`random.sample(users, self.batch_size)`: a minibatch drawn from the population at each
    step, not an order of it. Drawn per rank (each rank's own streams, `tm.seed_per_rank`), the
    ranks train on independent batches, as data parallelism wants; agreed, every rank would
    train on the same one."""
    k = arg(call, "k", 1)
    if k is None:
        return False
    names = [n.value.lower() for n in ctx.within(k.value, cst.Name)]
    return any("batch" in n or n in ("bs", "n_batch") for n in names)


def batch_permutation(ctx: Context, call: cst.Call) -> bool:
    """`torch.randperm(x.size(0))`, `np.random.permutation(batch_size)`, `perm = torch.randperm(b)`
    after `b = x.shape[0]`: an order of the samples of one batch (a mixup or CutMix partner, a
    shuffled pairing), drawn for each step. Each rank draws its own, as augmentation wants; it
    orders no data that sharding cuts, and shares no configuration."""
    if (ctx.resolve(call.func) or "") not in ("torch.randperm", "numpy.random.permutation") or not call.args:
        return False
    size = call.args[0].value
    if isinstance(size, cst.Name):
        func = ctx.enclosing(call, cst.FunctionDef)
        for a in ctx.within(func, cst.Assign) if func is not None else ():
            if any(isinstance(t.target, cst.Name) and t.target.value == size.value for t in a.targets):
                size = a.value
                break
        else:
            if isinstance(size, cst.Name):
                word = size.value.lower()
                return "batch" in word or word in ("bs", "b", "n_batch", "nb")
    return _sizes_a_batch(size)


def _sizes_a_batch(node: cst.CSTNode) -> bool:
    """`x.size(0)`, `x.shape[0]`, or a name that says batch (`batch_size`, `bs`); not `len(rows)`,
    which also sizes whole datasets (real and fake rows permuted for a discriminator's epoch)."""
    for n in [node, *[c for c in _walk(node)]]:
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "size" \
                and n.args and isinstance(n.args[0].value, cst.Integer) and n.args[0].value.value == "0":
            return True
        if isinstance(n, cst.Subscript) and isinstance(n.value, cst.Attribute) and n.value.attr.value == "shape":
            return True
        if isinstance(n, (cst.Name, cst.Attribute)):
            word = (n.value if isinstance(n, cst.Name) else n.attr.value).lower()
            if "batch" in word or word in ("bs", "n_batch"):
                return True
    return False


def _walk(node: cst.CSTNode):
    for child in node.children:
        yield child
        yield from _walk(child)


def _generates(ctx: Context, func: cst.FunctionDef) -> bool:
    """`func` is a generator (`def batches(...): ... yield`), or a method of a class that makes
    batches (one of its methods generates, or it iterates): the batch iterators TM201 reads
    through `tm.shard_batches`, which runs them under streams seeded alike on every rank, and
    whose reshuffling methods it calls through `tm.agreed`."""
    if any(True for _ in ctx.within(func, cst.Yield, skip_defs=True)):
        return True
    klass = ctx.enclosing(func, cst.ClassDef)
    if klass is None:
        return False
    methods = [s for s in klass.body.body if isinstance(s, cst.FunctionDef)]
    return any(m.name.value in ("__iter__", "__next__") or any(True for _ in ctx.within(m, cst.Yield, skip_defs=True))
               for m in methods)


def _ancestors_in_function(ctx: Context, node: cst.CSTNode) -> List[cst.CSTNode]:
    out = []
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            break
        out.append(anc)
    return out


def _broadcast_next(ctx: Context, call: cst.Call) -> bool:
    """The statement after the draw's shares its result (`order[:] = tm.broadcast_object(order)`,
    as TM107 and TM201 write it): rank 0's draw is every rank's already."""
    statement = ctx.statement_of(call)
    body = list(getattr(ctx.parent(statement), "body", ()))
    if statement not in body or body.index(statement) + 1 >= len(body):
        return False
    after = body[body.index(statement) + 1]
    return any((ctx.resolve(c.func) or "").endswith(".broadcast_object") for c in ctx.within(after, cst.Call))


def in_broadcast(ctx: Context, call: cst.Call) -> bool:
    """`call` is inside a `tm.broadcast_object(...)` of its statement: rank 0's result already."""
    for anc in ctx.ancestors(call):
        if isinstance(anc, cst.Call) and (ctx.resolve(anc.func) or "").endswith(".broadcast_object"):
            return True
        if isinstance(anc, cst.BaseStatement):
            return False
    return False


def stream_plan(ctx: Context) -> List[object]:
    """The placements (and the loops where none can go) of this module, in source order."""
    found = ctx.facts.get("launch.streams")
    if found is None:
        found = ctx.facts["launch.streams"] = _Streams(ctx).plan()
    return found  # type: ignore[return-value]


class _Streams:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.callee = partial(local_callee, ctx)  # the function of this file a call runs, if any
        self.setup_statements = self._setup_statements()
        self._runs: Dict[cst.CSTNode, bool] = {}
        # loops over a training DataLoader: training loops even where the step they run lives in
        # another module (`for batch in train_loader: trainer.step(batch)`)
        self.over_training_data = {_iteration_site(node, ctx) for node, _ref in
                                   loader_facts(ctx).uses(lambda loader: loader.kind == "train")} - {None}
        self.shared_by_data = self.shared_by(ctx)
        self.made_agreed = set(agreed_draws(ctx))
        self.full_batch = self._full_batch_losses()

    def plan(self) -> List[object]:
        out: List[object] = []
        for loop in self._outermost_training_loops():
            if self._holds_full_batch_loss(loop):
                continue  # every rank runs the one forward whose loss they share: its draws must agree
            draw = self._agreed_draw(loop)
            if draw is not None:
                out.append(Blocked(loop, draw))
                continue
            place = self._placement(loop)
            if place is not None:
                out.append(Placement(place))
        return out

    # --- facts ----------------------------------------------------------------------------
    def _setup_statements(self) -> Set[cst.CSTNode]:
        ctx = self.ctx
        nodes: List[cst.CSTNode] = [o.call for o in analysis.optimizers(ctx)]
        nodes += [loader.call for loader in loader_facts(ctx).loaders]
        runtime = ctx.options.runtime_module
        nodes += analysis.calls_to(ctx, *_SETUP, runtime + ".wrap_model", runtime + ".seed_everything")
        return {ctx.statement_of(n) for n in nodes if ctx.statement_of(n) is not None}

    def _runs_backward(self, node: cst.CSTNode, depth: int = 0) -> bool:
        """`node` runs a backward, itself or through a function of this module it calls, or a
        method of its own class (two levels: `for epoch: train_epoch()` -> `for batch: step()`)."""
        known = self._runs.get(node)
        if known is not None:
            return known
        ctx = self.ctx
        runs = node in self.over_training_data or analysis.runs_backward(ctx, node)
        if not runs and depth < 2:
            for call in ctx.within(node, cst.Call, skip_defs=True):
                callee = self.callee(call)
                if callee is not None and callee is not node and self._runs_backward(callee, depth + 1):
                    runs = True
                    break
        self._runs[node] = runs
        return runs

    def _outermost_training_loops(self) -> List[cst.CSTNode]:
        """The outermost loops of their function that hold a training loop (an epoch loop around
        the batch loop), leaving out those a call makes part of another: the batch loop of
        `train_one_epoch` that an epoch loop of this module calls belongs to that loop."""
        ctx = self.ctx
        loops = []
        for loop in ctx.within(ctx.module, *_LOOPS):
            if self._runs_backward(loop):
                top = loop
                for anc in ctx.ancestors(loop):
                    if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                        break
                    if isinstance(anc, _LOOPS):
                        top = anc
                if top not in loops:
                    loops.append(top)
        reached: Set[cst.CSTNode] = set()
        todo = [f for loop in loops for f in map(self.callee, ctx.within(loop, cst.Call, skip_defs=True)) if f]
        while todo:
            function = todo.pop()
            if function not in reached:
                reached.add(function)
                todo += [f for f in map(self.callee, ctx.within(function, cst.Call, skip_defs=True)) if f]
        return [n for n in loops if not any(a in reached for a in ctx.ancestors(n))]

    def _placement(self, loop: cst.CSTNode) -> Optional[cst.CSTNode]:
        """`loop` itself when it builds nothing shared, else the first training loop inside it
        that does not (None: none)."""
        ctx = self.ctx
        if not any(s in self.setup_statements for s in ctx.within(loop, cst.SimpleStatementLine, skip_defs=True)):
            return loop
        for inner in ctx.within(loop, *_LOOPS, skip_defs=True):
            if inner is not loop and self._holds_training(inner):
                place = self._placement(inner)
                if place is not None:
                    return place
        return None

    def _holds_training(self, loop: cst.CSTNode) -> bool:
        return any(self._runs_backward(inner) for inner in self.ctx.within(loop, *_LOOPS, skip_defs=True))

    def _agreed_draw(self, loop: cst.CSTNode) -> Optional[cst.Call]:
        """A permutation or shuffle drawn in the loop (or in a function of this module it calls)
        from the global streams, that is not shared from rank 0."""
        ctx = self.ctx
        bodies = [loop] + [f for f in map(self.callee, ctx.within(loop, cst.Call, skip_defs=True)) if f is not None]
        for body in bodies:
            for call in ctx.within(body, cst.Call, skip_defs=True):
                name = ctx.resolve(call.func)
                if name in AGREED and not _explicit_generator(call) and not self._shared(call) \
                        and not batch_permutation(ctx, call) and not (name == "random.sample" and _batch_sized(ctx, call)):
                    return call  # (not an order of one batch's samples, which each rank draws for itself)
        return None

    @staticmethod
    def shared_by(ctx: Context) -> Set[cst.CSTNode]:
        """The draws and shuffles that set the order of a hand-made batch loop which TM201 shards
        in this run: rank 0 draws them and every rank uses its result (`tm.broadcast_object`)."""
        if "TM201" not in ctx.enabled:
            return set()
        plan = data_plan(ctx)
        return {o.node for found in plan.batches.loops if not found.sharded and plan.batch(found).status == "shard"
                for o in found.orders if not o.shared}

    def _full_batch_losses(self) -> List[cst.Call]:
        """Full-batch losses whose training indices the ranks share out (`tm.shard_mean`, now or
        by TM201 in this run): each rank runs the whole forward and scores its part of it, so the
        forward's dropout must draw alike on every rank, as in one process."""
        ctx = self.ctx
        losses = [c for c in analysis.calls_to(ctx, ctx.options.runtime_module + ".shard_mean")]
        if "TM201" in ctx.enabled:
            plan = data_plan(ctx)
            losses += [loss.call for loss in plan.batches.losses if plan.batch(loss).status == "shard"]
        return losses

    def _holds_full_batch_loss(self, loop: cst.CSTNode) -> bool:
        ctx = self.ctx
        if not self.full_batch:
            return False
        direct = ctx.within(loop, cst.Call, skip_defs=True)
        inside = set(direct)
        for callee in filter(None, map(self.callee, direct)):
            inside.update(ctx.within(callee, cst.Call, skip_defs=True))
        return any(loss in inside for loss in self.full_batch)

    def _shared(self, call: cst.Call) -> bool:
        if call in self.made_agreed or call in self.shared_by_data \
                or self.ctx.statement_of(call) in self.shared_by_data:
            return True
        return in_broadcast(self.ctx, call)


def _explicit_generator(call: cst.Call) -> bool:
    return any(a.keyword is not None and a.keyword.value in ("generator", "random_state") for a in call.args)

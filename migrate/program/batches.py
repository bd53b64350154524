"""Training data that no DataLoader carries, in one module: hand-made batch loops, loops over
iterables of batches, and full-batch losses over a set of training indices.

Built once per module on first use (`batch_facts(ctx)`, kept in ``ctx.facts["batches"]``),
whatever rules run; the data family's plan decides what to do with each (`rules/data/plan.py`).

- A training step is a loop body (or a function called once per iteration) that runs a
  backward pass and an optimizer step itself, outside any inner loop: one iteration, one step.
- `BatchLoop` (``loops``): a ``for`` loop whose body is a training step, over
  - ``"range"``: ``range(...)`` (also under ``enumerate``/``tqdm``) whose variable bounds a slice
    of the data (``X[i:i + bs]``, ``perm[i * bs:(i + 1) * bs]``): ``sliced`` names what it
    slices; ``orders`` the random draws that set the order of that data in the loop's scope
    (``perm = torch.randperm(n)``, ``np.random.shuffle(idx)``), which every rank must make
    alike once the loop is sharded; ``unknown_order`` a draw that reorders it in a way the tool
    cannot make agree (``X, y = shuffle(X, y)``); ``carried`` a value the loop carries from one
    batch to the next (``output, hidden = model(x, hidden)``: a recurrent state over consecutive
    chunks, which a share of the batches would break);
  - ``"iterable"``: anything else that is not a range, a counter or a literal (a generator of
    the program, a ``BatchIterator``, a list of batches, a bucket iterator): ``wrapped`` is the
    expression that yields the batches (under ``enumerate``/``tqdm``), ``loader`` whether it is
    one of this module's DataLoaders (sharded where it is built), ``carried`` as above;
  - ``sharded``: the loop already goes through ``tm.shard_range``/``tm.shard_batches``.
- `FullBatchLoss` (``losses``): ``F.nll_loss(out[idx_train], labels[idx_train])`` (a mean loss of
  torch, or a criterion built from one with no arguments) in a function or loop that runs a
  backward pass, whose two inputs are indexed by the same set of training indices or mask that
  is fixed for the step (not a batch variable, not bound in a loop): every rank computes the
  whole graph and can score its own part of the indices.
- ``order_draws``: every draw and shuffle that the order of a batch loop depends on, of a
  training loop or of a generator that yields batches (TM107 leaves these to the data family:
  broadcast alone, they would make every rank train on the same batches; `tm.shard_batches`
  draws a generator's order alike on every rank by itself).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.facts import training_text
from torchmigrate.program import splits
from torchmigrate.program.loaders import loader_facts

# Draws of a whole new order, which `tm.broadcast_object(...)` makes rank 0's on every rank.
PERMUTATIONS = frozenset({"torch.randperm", "numpy.random.permutation", "random.sample", "numpy.random.choice"})
# ... the same as methods of a generator object (`rng.permutation(n)`, `g.choice(n, n, replace=False)`).
PERMUTATION_METHODS = frozenset({"permutation", "randperm", "sample", "choice"})
# Shuffles in place (`np.random.shuffle(idx)`), after which `idx[:] = tm.broadcast_object(idx)`.
SHUFFLES = frozenset({"random.shuffle", "numpy.random.shuffle"})
SHUFFLE_METHODS = frozenset({"shuffle"})
# Random draws that reorder or resample data (`shuffle(X, y)` of sklearn), among any of these modules.
_RANDOM = ("random.", "numpy.random.", "torch.rand", "sklearn.utils.")
_REORDERS = re.compile(r"shuffle|perm|sample|choice")
_EVAL_WORDS = frozenset({"val", "valid", "validation", "test", "testing", "eval", "evaluation", "dev", "holdout"})
# Wrappers whose first argument is the sequence a loop iterates.
_PASS_THROUGH = frozenset({"enumerate", "tqdm", "tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "iter"})
# Iterables that are counters, not data.
# ... and tqdm's ranges (`trange(start, n_iters)`), which count steps like `range` but are no
# sequence that `tm.shard_range` could share out
_COUNTERS = frozenset({"range", "itertools.count", "itertools.repeat", "count", "repeat",
                       "trange", "tnrange", "tqdm.trange", "tqdm.auto.trange", "tqdm.notebook.trange",
                       "tqdm.tnrange", "tqdm.notebook.tnrange", "tqdm.std.trange"})
# Losses that average over their samples by default (torch.nn.functional and the nn classes).
MEAN_LOSSES = frozenset({"nll_loss", "cross_entropy", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                         "binary_cross_entropy", "binary_cross_entropy_with_logits", "soft_margin_loss",
                         "multilabel_soft_margin_loss"})
MEAN_LOSS_CLASSES = frozenset({"NLLLoss", "CrossEntropyLoss", "MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss",
                               "BCELoss", "BCEWithLogitsLoss", "SoftMarginLoss", "MultiLabelSoftMarginLoss"})
SHARD_HELPERS = ("shard_range", "shard_batches", "shard_indices", "shard_mean")


_CONTAINERS = (cst.Dict, cst.List, cst.Set, cst.DictComp, cst.ListComp, cst.SetComp)
_CONTAINER_CALLS = frozenset({"dict", "list", "set", "collections.defaultdict", "defaultdict", "OrderedDict",
                              "collections.OrderedDict"})


@dataclass(eq=False)
class Order:
    """A draw that sets a batch loop's order: ``call`` to wrap (``"draw"``), the in-place
    shuffle statement after which the shuffled ``name`` is shared (``"shuffle"``), or a method
    call that reorders the iterated object itself before the loop (``"method"``:
    `train_loader.shuffle()` of a hand-made iterator), to make with generators alike on every rank."""

    kind: str
    node: cst.CSTNode
    name: str
    shared: bool = False  # already `tm.broadcast_object(...)` (or followed by it)


@dataclass(eq=False)
class BatchLoop:
    loop: cst.For
    kind: str  # "range", "iterable", "drawn" or "cursor"
    wrapped: cst.BaseExpression
    sliced: Tuple[str, ...] = ()
    slices: Tuple[cst.Subscript, ...] = ()  # "cursor": the batches read at the cursor, `X[c:c + bs]`
    orders: List[Order] = field(default_factory=list)
    unknown_order: Optional[str] = None
    carried: Optional[str] = None
    loader: bool = False
    sharded: bool = False


@dataclass(eq=False)
class FullBatchLoss:
    call: cst.Call
    index: str  # the source text of the index expression (`idx_train`, `data.train_mask`)
    indices: List[cst.BaseExpression] = field(default_factory=list)  # its occurrences in `call`
    sharded: bool = False


class BatchFacts:
    """See the module docstring."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.facts = analysis.facts(ctx)
        self.loops: List[BatchLoop] = []
        self.losses: List[FullBatchLoss] = []
        self._steps: Dict[int, bool] = {}  # id(FunctionDef) -> one training step per call
        generated: List[BatchLoop] = []  # batch loops of generators: their orders only
        trains = any(analysis.is_backward(c) for c, _ in self.facts.calls)
        yields = bool(ctx.nodes(cst.Yield))
        for loop in ctx.nodes(cst.For) if trains or yields else ():
            if trains and self._is_step(loop.body):
                found = self._batch_loop(loop) or self._drawn(loop)
                if found is not None:
                    self.loops.append(found)
            elif yields and ctx.within(loop.body, cst.Yield, skip_defs=True):
                found = self._batch_loop(loop, generator=True)
                if found is not None:
                    generated.append(found)
        if trains:
            self._full_batch_losses()
        self.order_draws: Set[int] = {id(o.node) for b in self.loops + generated for o in b.orders}

    def release(self) -> None:
        self.loops.clear()
        self.losses.clear()

    # --- training steps -------------------------------------------------------------------
    def _direct_calls(self, block: cst.CSTNode) -> List[cst.Call]:
        """Calls in `block` that run once per pass of it: not in an inner loop, def or lambda."""
        ctx = self.ctx
        inner = [n for n in ctx.within(block, cst.For, cst.While, skip_defs=True) if n is not block]
        calls = ctx.within(block, cst.Call, skip_defs=True)
        if not inner:
            return calls
        spans = [(ctx.position(n), ctx.last_position(n)) for n in inner]
        return [c for c in calls if not any(a <= (ctx.position(c) or -1) <= b for a, b in spans)]

    def _is_step(self, block: cst.CSTNode, depth: int = 0) -> bool:
        """`block` runs one backward pass and optimizer step per pass (itself, or through a
        function of this module that does, called once)."""
        calls = self._direct_calls(block)
        backward = any(analysis.is_backward(c) for c in calls)
        step = any(type(c.func) is cst.Attribute and c.func.attr.value == "step" for c in calls)
        if backward and step:
            return True
        if depth > 1:
            return False
        for c in calls:
            name = (dotted(c.func) or "").rsplit(".", 1)[-1]
            fn = self.facts.functions.get(name)
            if fn is not None and not self._container_method(c) and self._function_is_step(fn, depth):
                return True
        return False

    def _container_method(self, call: cst.Call) -> bool:
        """`stats.update(...)`, `history.append(...)` on a dict, list or set the function built
        (a literal, a comprehension, `dict()`): the container's own method, not the module's
        function of that name (a model's `update(batch)` training step)."""
        func = call.func
        if type(func) is not cst.Attribute or type(func.value) is not cst.Name:
            return False
        ctx = self.ctx
        scope = ctx.enclosing(call, cst.FunctionDef) or ctx.module
        name = func.value.value
        for assign in ctx.within(scope, cst.Assign, skip_defs=True):
            value = assign.value
            if not any(type(t.target) is cst.Name and t.target.value == name for t in assign.targets):
                continue
            if isinstance(value, _CONTAINERS) or (isinstance(value, cst.Call) and dotted(value.func) in _CONTAINER_CALLS):
                return True
        return False

    def _function_is_step(self, fn: cst.FunctionDef, depth: int) -> bool:
        key = id(fn)
        if key not in self._steps:
            self._steps[key] = False  # recursion guard
            self._steps[key] = self._is_step(fn.body, depth + 1)
        return self._steps[key]

    # --- batch loops ----------------------------------------------------------------------
    def _batch_loop(self, loop: cst.For, generator: bool = False) -> Optional[BatchLoop]:
        """The loop as a `BatchLoop`, or None when it does not iterate batches. A `generator`'s
        loop (`for i in range(0, n, bs): yield X[perm[i:i + bs]]`) is read for its orders only:
        what consumes it is the training loop."""
        ctx = self.ctx
        wrapped, position = _unwrap(loop.iter)
        if wrapped is None:
            return None
        if isinstance(wrapped, cst.Call) and _helper(wrapped):
            return BatchLoop(loop, "range" if _helper(wrapped) == "shard_range" else "iterable", wrapped,
                             sharded=True)
        variable = _loop_variable(loop.target, position)
        if isinstance(wrapped, cst.Call) and (dotted(wrapped.func) or "") == "range":
            if variable is None:
                return None
            sliced = self._sliced_by(loop, variable)
            if not sliced:  # a counter of steps (`for step in range(n_steps)`), not batches
                return None if generator else self._cursor_loop(loop)
            found = BatchLoop(loop, "range", wrapped, sliced=tuple(sliced))
            found.carried = self._carried(loop)
            for name in sliced:
                self._orders(loop, name, found)
            return found
        if generator:
            return None
        if not self._iterates_data(loop, wrapped):
            return self._cursor_loop(loop) if _is_counter(ctx, wrapped) else None
        refs = loader_facts(ctx).refs_at(wrapped) if loader_facts(ctx).scan is not None else []
        found = BatchLoop(loop, "iterable", wrapped, loader=bool(refs), carried=self._carried(loop))
        found.orders.extend(self._reorders(loop, wrapped))
        return found

    def _cursor_loop(self, loop: cst.For) -> Optional[BatchLoop]:
        """A loop that counts steps and reads each batch at a cursor it moves itself (`batch =
        rays[i_batch:i_batch + N_rand]`, `i_batch += N_rand`, the cursor set before the loop):
        kind ``"cursor"``, ``slices`` the batches read at it. Sharded, each rank takes its part of
        every batch (`tm.rank_part`), so a step still trains on the original's batch."""
        ctx = self.ctx
        steps: Dict[str, str] = {}
        for move in ctx.within(loop.body, cst.AugAssign, cst.Assign, skip_defs=True):
            if isinstance(move, cst.AugAssign):
                if isinstance(move.operator, cst.AddAssign) and isinstance(move.target, cst.Name):
                    steps[move.target.value] = code(move.value)
                continue
            # `c = c + bs`, also `c = c + bs if c + 2 * bs <= n else 0` (back to the start)
            value = move.value.body if isinstance(move.value, cst.IfExp) else move.value
            if len(move.targets) == 1 and isinstance(move.targets[0].target, cst.Name) \
                    and isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add):
                cursor = move.targets[0].target.value
                for one, other in ((value.left, value.right), (value.right, value.left)):
                    if isinstance(one, cst.Name) and one.value == cursor:
                        steps[cursor] = code(other)
        if not steps:
            return None
        slices: List[cst.Subscript] = []
        sliced: List[str] = []
        sharded = False
        for sub in ctx.within(loop.body, cst.Subscript, skip_defs=True):
            cursor = _cursor_slice(sub, steps)
            if cursor is None or not self._starts_before(loop, cursor):
                continue
            if _SEQUENCE_WORDS.search(steps[cursor]) or _SEQUENCE_WORDS.search(code(sub.value)):
                return None  # `data[p:p + seq_length]`: one sequence of a stream, which no rank may split
            holder = ctx.parent(ctx.parent(sub))
            if isinstance(holder, cst.Call) and (dotted(holder.func) or "").endswith(".rank_part"):
                sharded = True
            slices.append(sub)
            sliced.append(code(sub.value))
        if not slices:
            return None
        found = BatchLoop(loop, "cursor", loop.iter, sliced=tuple(dict.fromkeys(sliced)), slices=tuple(slices),
                          carried=self._carried(loop), sharded=sharded)
        for name in found.sliced:
            self._orders(loop, name, found)
        return found

    def _reorders(self, loop: cst.For, wrapped: cst.BaseExpression) -> List[Order]:
        """`train_loader.shuffle()` (a method named like a reordering, called on the object whose
        batches the loop reads, `train_loader.get_iterator()` or `train_loader` itself, in the
        loop's function but not in the loop): each rank would draw its own order."""
        ctx = self.ctx
        base = wrapped.func.value if isinstance(wrapped, cst.Call) and isinstance(wrapped.func, cst.Attribute) \
            else wrapped
        text = code(base)
        scope = ctx.scope_of(loop)
        out = []
        for call, _name in self.facts.calls:
            func = call.func
            if isinstance(func, cst.Attribute) and _REORDERS.search(func.attr.value.lower()) \
                    and code(func.value) == text and ctx.scope_of(call) is scope \
                    and not any(anc is loop for anc in ctx.ancestors(call)):
                out.append(Order("method", call, text))
        return out

    def _drawn(self, loop: cst.For) -> Optional[BatchLoop]:
        """A training loop that counts steps and draws each batch with `next(batches)` from an
        endless generator of the program made before the loop (`batches = data.generator(bs)`,
        `ModuleView.endless_generators`): kind ``"drawn"``, ``wrapped`` the call that makes it.
        Sharding the counter would not share out the data; the generator is what to share."""
        ctx = self.ctx
        endless = ctx.program.endless_generators
        if not endless:
            return None
        for call in self._direct_calls(loop.body):
            if not (type(call.func) is cst.Name and call.func.value == "next" and len(call.args) == 1):
                continue
            name = dotted(call.args[0].value)
            if name is None:
                continue
            scope = ctx.scope_of(loop)
            for assign in self.facts.assigns:
                value = assign.value
                if ctx.scope_of(assign) is not scope or name not in {dotted(t.target) for t in assign.targets} \
                        or any(anc is loop for anc in ctx.ancestors(assign)) or type(value) is not cst.Call:
                    continue
                inner = value.args[0].value if dotted(value.func) == "iter" and value.args else None
                if isinstance(inner, cst.Call) and _helper(inner):
                    return BatchLoop(loop, "drawn", value, sharded=True)  # migrated already
                callee = (dotted(value.func) or "").rsplit(".", 1)[-1]
                if callee in endless and not self._over_loader(value):
                    return BatchLoop(loop, "drawn", value, carried=self._carried(loop))
        return None

    def _over_loader(self, call: cst.Call) -> bool:
        """`infiniteloop(dataloader)`: an endless generator over a DataLoader, which is sharded
        where it is built."""
        facts = loader_facts(self.ctx)
        for a in call.args:
            if (facts.scan is not None and facts.refs_at(a.value)) or splits.named_like_loader(code(a.value)):
                return True
        return False

    def _sliced_by(self, loop: cst.For, variable: str) -> List[str]:
        """What the loop body slices with its variable in a bound (`X[i:i + bs]`), by name, and
        the sequences read by index in such a bound (`starts` of `X[starts[k]:starts[k] + n]`)."""
        out: List[str] = []
        for sub in self.ctx.within(loop.body, cst.Subscript, skip_defs=True):
            for element in sub.slice:
                s = element.slice
                bounds = [b for b in (s.lower, s.upper) if b is not None] if isinstance(s, cst.Slice) else []
                if not any(variable in _names(b) for b in bounds):
                    continue
                names = [dotted(sub.value)] + [dotted(i.value) for b in bounds for i in self.ctx.within(b, cst.Subscript)]
                out += [n for n in names if n is not None and n not in out]
        return out

    def _carried(self, loop: cst.For) -> Optional[str]:
        """A name the loop body feeds back into itself through a call before assigning it in the
        iteration (`output, hidden = model(data, hidden)`, `h = h.detach()`): state over
        consecutive batches. Accumulators (`total += loss.item()`) are not calls of themselves."""
        ctx = self.ctx
        assigned: Set[str] = _target_names(loop.target)
        for node in ctx.within(loop.body, cst.Assign, cst.AugAssign, cst.AnnAssign, skip_defs=True):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            names = {n for t in targets for n in _target_names(t)}
            value = node.value
            if value is not None and isinstance(node, cst.Assign):
                for name in names - assigned:
                    if any(name in _names(c) for c in ctx.within(value, cst.Call)) and self._starts_before(loop, name):
                        return name
            assigned |= names
        return self._detached_in_place(loop)

    def _detached_in_place(self, loop: cst.For) -> Optional[str]:
        """A state the model updates in place, which the loop only cuts from the previous
        batch's graph: `hidden.detach_()`, or `for h in H: h.detach_()` over a list the
        forward writes into (`H[0] = self.cell(x, H[0])`), made before the loop."""
        ctx = self.ctx
        for call in ctx.within(loop.body, cst.Call, skip_defs=True):
            func = call.func
            if type(func) is not cst.Attribute or func.attr.value != "detach_":
                continue
            name = dotted(func.value)
            if name is None:
                continue
            inner = next((f for f in ctx.ancestors(call) if isinstance(f, cst.For) and f is not loop
                          and any(a is loop for a in ctx.ancestors(f)) and name in _target_names(f.target)), None)
            if inner is not None:
                name = dotted(inner.iter)
                if name is None:
                    continue
            if self._starts_before(loop, name.split("[")[0]):
                return name
        return None

    def _starts_before(self, loop: cst.For, name: str) -> bool:
        """`name` gets a value before the loop in its scope (`hidden = model.init_hidden(bsz)`):
        a state the loop carries from batch to batch starts somewhere. (A name first bound in a
        branch of the body, `loss = loss.mean()` after `loss = criterion(...)` in another, is no
        such state.)"""
        ctx = self.ctx
        scope, start = ctx.scope_of(loop), ctx.position(loop) or 0
        for assign in self.facts.assigns:
            if ctx.scope_of(assign) is scope and (ctx.position(assign) or 0) < start \
                    and name in {n for t in assign.targets for n in _target_names(t.target)}:
                return True
        return name.startswith("self.")

    def _orders(self, loop: cst.For, name: str, found: BatchLoop) -> None:
        """The draws in the loop's scope, before it, that reorder `name` (see `BatchLoop`)."""
        ctx = self.ctx
        scope, start = ctx.scope_of(loop), ctx.position(loop) or 0
        for assign in self.facts.assigns:
            if ctx.scope_of(assign) is not scope or (ctx.position(assign) or 0) > start:
                continue
            if name not in {n for t in assign.targets for n in _target_names(t.target)}:
                continue
            for call in ctx.within(assign.value, cst.Call):
                qualified = ctx.resolve(call.func) or ""
                method = call.func.attr.value if type(call.func) is cst.Attribute else ""
                if qualified in PERMUTATIONS or (method in PERMUTATION_METHODS and not qualified.startswith(_RANDOM)):
                    found.orders.append(Order("draw", call, name, shared=self._broadcast(call)))
                elif _REORDERS.search(qualified.rsplit(".", 1)[-1]) and qualified.startswith(_RANDOM):
                    found.unknown_order = f"`{code(assign.value)}`"
        for call, qualified in self.facts.calls:
            qualified = qualified or ""
            method = call.func.attr.value if type(call.func) is cst.Attribute else ""
            if not (qualified in SHUFFLES or (method in SHUFFLE_METHODS and not qualified.startswith(_RANDOM))):
                continue
            if not call.args or dotted(call.args[0].value) != name or ctx.scope_of(call) is not scope \
                    or (ctx.position(call) or 0) > start:
                continue
            statement = ctx.statement_of(call)
            if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1 \
                    and isinstance(statement.body[0], cst.Expr) and statement.body[0].value is call:
                found.orders.append(Order("shuffle", statement, name, shared=self._shared_after(statement)))
            else:
                found.unknown_order = f"`{code(call)}`"

    def _broadcast(self, call: cst.Call) -> bool:
        parent = self.ctx.parent(self.ctx.parent(call))
        return isinstance(parent, cst.Call) and (dotted(parent.func) or "").endswith("broadcast_object")

    def _shared_after(self, statement: cst.CSTNode) -> bool:
        block = self.ctx.parent(statement)
        body = list(getattr(block, "body", ()))
        at = body.index(statement) if statement in body else -1
        return 0 <= at < len(body) - 1 and "broadcast_object" in cst.Module(body=[body[at + 1]]).code

    def _iterates_data(self, loop: cst.For, wrapped: cst.BaseExpression) -> bool:
        """`wrapped` yields data: not a counter, a literal or a name bound to one in the loop's
        scope; the loop reads what it yields; not evaluation data by its name."""
        ctx = self.ctx
        if isinstance(wrapped, (cst.List, cst.Tuple, cst.Set, cst.Dict, cst.SimpleString, cst.Integer)):
            return False
        if isinstance(wrapped, cst.Call) and (ctx.resolve(wrapped.func) or dotted(wrapped.func) or "") in _COUNTERS:
            return False
        if _EVAL_WORDS & set(_words(code(wrapped))):
            return False
        name = dotted(wrapped)
        if name is not None:
            scope = ctx.scope_of(loop)
            for assign in self.facts.assigns:
                if ctx.scope_of(assign) is scope and name in {dotted(t.target) for t in assign.targets}:
                    value = assign.value
                    if isinstance(value, (cst.List, cst.Tuple, cst.Set, cst.Dict)):
                        return False
                    # `prog_bar = tqdm(range(1, n_batches + 1))`: a counter of steps, whose
                    # batches come from elsewhere (`next(generator)`), unless the loop slices
                    # data with it (`X[i * bs:(i + 1) * bs]`)
                    counted, _ = _unwrap(value)
                    if isinstance(counted, cst.Call) and (ctx.resolve(counted.func) or dotted(counted.func) or "") \
                            in _COUNTERS:
                        variable = _loop_variable(loop.target, _unwrap(loop.iter)[1])
                        return variable is not None and bool(self._sliced_by(loop, variable))
        targets = _target_names(loop.target)
        return bool(targets) and any(n.value in targets for n in ctx.within(loop.body, cst.Name, skip_defs=True))

    # --- full-batch losses ----------------------------------------------------------------
    def _full_batch_losses(self) -> None:
        ctx = self.ctx
        criteria = self._mean_criteria()
        batch_loops = {id(b.loop) for b in self.loops}
        for call, qualified in self.facts.calls:
            func = dotted(call.func) or ""
            is_mean = ((qualified or "").startswith("torch.nn.functional.")
                       and qualified.rsplit(".", 1)[-1] in MEAN_LOSSES) or func in criteria
            if not is_mean or len(call.args) != 2 or any(a.keyword is not None or a.star for a in call.args):
                continue
            indices = [_single_index(a.value) for a in call.args]
            if indices[0] is None or indices[1] is None or code(indices[0]) != code(indices[1]):
                continue
            index = code(indices[0])
            if not training_text(index) or not self._fixed_for_the_step(call, indices[0], batch_loops):
                continue
            parent = ctx.parent(ctx.parent(call))
            sharded = isinstance(parent, cst.Call) and _helper(parent) == "shard_mean"
            self.losses.append(FullBatchLoss(call, index, indices, sharded=sharded))
        for loss in self.losses:  # `out[tm.shard_indices(idx_train)]`: migrated already
            loss.sharded = loss.sharded or any(isinstance(i, cst.Call) and _helper(i) for i in loss.indices)

    def _mean_criteria(self) -> Set[str]:
        """Names bound to a mean loss object built with no arguments (`criterion = nn.NLLLoss()`)."""
        out = set()
        for assign in self.facts.assigns:
            value = assign.value
            if isinstance(value, cst.Call) and not value.args and \
                    (self.ctx.resolve(value.func) or "").rsplit(".", 1)[-1] in MEAN_LOSS_CLASSES:
                out |= {n for t in assign.targets if (n := dotted(t.target))}
        return out

    def _fixed_for_the_step(self, call: cst.Call, index: cst.BaseExpression, batch_loops: Set[int]) -> bool:
        """The index set is the same on every step: the loss runs where a backward pass does,
        not in a batch loop or a loop over anything but a range (epochs), and its root name is
        not bound by an enclosing loop."""
        ctx = self.ctx
        if isinstance(index, cst.Call) and _helper(index):
            index = index.args[0].value
        root = index
        while isinstance(root, (cst.Attribute, cst.Subscript)):
            root = root.value
        if not isinstance(root, cst.Name):
            return False
        function = ctx.enclosing(call, cst.FunctionDef)
        if not analysis.runs_backward(ctx, function or ctx.module):
            return False
        for anc in ctx.ancestors(call):
            if anc is function:
                break
            if isinstance(anc, cst.For):
                wrapped, _ = _unwrap(anc.iter)
                if id(anc) in batch_loops or not (isinstance(wrapped, cst.Call) and dotted(wrapped.func) == "range"):
                    return False
                if root.value in _target_names(anc.target):
                    return False
                if any(root.value in {n for t in a.targets for n in _target_names(t.target)}
                       for a in ctx.within(anc.body, cst.Assign, skip_defs=True)):
                    return False
            if isinstance(anc, cst.While):
                return False
        return True


# --- small helpers ---------------------------------------------------------------------------

def _helper(call: cst.Call) -> Optional[str]:
    """`tm.shard_range(...)` and the like: which of the runtime's shard helpers `call` is."""
    name = (dotted(call.func) or "").rsplit(".", 1)[-1]
    return name if name in SHARD_HELPERS else None


# a window of a token stream or a time series, not a batch of samples: its size, or the data
# it is read from, says so
_SEQUENCE_WORDS = re.compile(r"seq|bptt|block|context|window|chunk|len|time|token|text|corpus|char|word|ids\b",
                             re.IGNORECASE)


def _is_counter(ctx, node: cst.BaseExpression) -> bool:
    """`trange(start, n_iters)`, `itertools.count()`: an iterable of step numbers."""
    return isinstance(node, cst.Call) and (ctx.resolve(node.func) or dotted(node.func) or "") in _COUNTERS


def _cursor_slice(sub: cst.Subscript, steps: Dict[str, str]) -> Optional[str]:
    """The cursor of `X[c:c + n]` where the loop moves `c` by that same `n` (`c += n`)."""
    if len(sub.slice) != 1 or not isinstance(sub.slice[0].slice, cst.Slice):
        return None
    part = sub.slice[0].slice
    lower, upper = part.lower, part.upper
    if part.step is not None or not isinstance(lower, cst.Name) or lower.value not in steps \
            or not isinstance(upper, cst.BinaryOperation) or not isinstance(upper.operator, cst.Add):
        return None
    cursor = lower.value
    if isinstance(upper.left, cst.Name) and upper.left.value == cursor:
        size = upper.right
    elif isinstance(upper.right, cst.Name) and upper.right.value == cursor:
        size = upper.left
    else:
        return None
    return cursor if code(size) == steps[cursor] else None


def _unwrap(node: cst.BaseExpression) -> Tuple[Optional[cst.BaseExpression], int]:
    """The sequence a `for` iterates under `enumerate(...)`/`tqdm(...)`, and where its item sits in
    the loop target (1 under `enumerate`, else 0)."""
    position = 0
    while isinstance(node, cst.Call) and (dotted(node.func) or "") in _PASS_THROUGH:
        positional = [a for a in node.args if a.keyword is None and not a.star]
        if not positional:
            return None, 0
        if dotted(node.func) == "enumerate":
            position = 1
        node = positional[0].value
    return node, position


def _loop_variable(target: cst.BaseExpression, position: int) -> Optional[str]:
    if isinstance(target, cst.Name):
        return target.value if position == 0 else None
    if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2:
        item = target.elements[position].value
        return item.value if isinstance(item, cst.Name) else None
    return None


def _target_names(target: cst.CSTNode) -> Set[str]:
    """Dotted names a target binds (`a`, `self.h`, both of `out, hidden`)."""
    if isinstance(target, (cst.Tuple, cst.List)):
        return {n for e in target.elements for n in _target_names(e.value)}
    if isinstance(target, cst.StarredElement):
        return _target_names(target.value)
    name = dotted(target)
    return {name} if name else set()


def _names(node: cst.CSTNode) -> Set[str]:
    """Every plain and dotted name read in `node`."""
    out: Set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, (cst.Name, cst.Attribute)):
            name = dotted(n)
            if name:
                out.add(name)
        stack.extend(n.children)
    return out


def _words(text: str) -> List[str]:
    """Lower-case words of identifiers: `devLoader_2` -> ['dev', 'loader']."""
    return [w for w in re.split(r"[^a-z]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text).lower()) if w]


def _single_index(node: cst.BaseExpression) -> Optional[cst.BaseExpression]:
    """`idx` of `out[idx]` (one index, no slice)."""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        return node.slice[0].slice.value
    return None


def batch_facts(ctx) -> BatchFacts:
    """The module's batch facts, built on first use and kept on the context."""
    found = ctx.facts.get("batches")
    if found is None:
        found = ctx.facts["batches"] = BatchFacts(ctx)
    return found  # type: ignore[return-value]

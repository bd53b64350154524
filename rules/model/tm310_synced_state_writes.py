"""TM310: a state tensor written at the batch's indices stays the same on every rank."""

from __future__ import annotations

from typing import Dict, List, Optional

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, replace
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.types import is_batch_source
from torchmigrate.rule import Example, Rule
from torchmigrate.rules._active import active
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr

# torch's factories of a tensor of a given size (a state: one row per sample, per class)
_FACTORIES = frozenset({"torch.zeros", "torch.ones", "torch.empty", "torch.full", "torch.rand", "torch.randn"})


class SyncedStateWrites(Rule):
    """
    ## What it does
    In `ddp`, a tensor kept across steps and written at the indices of a batch, `state[index] =
    rows` (a per-sample target of a noisy-label loss, a memory bank of features, class centers),
    gets every rank's write on every rank: `state[tm.all_rows(index)] = tm.all_rows(rows)`. The
    state is a tensor the program makes once with a size it computes (`self.target =
    torch.zeros(num_examp, num_classes)` in a loss's `__init__`, `bank = torch.randn(n, dim)`
    before the loop over batches), and the index a name (a batch's sample indices, its labels),
    not a loop's counter (`for i in range(k): buf[i] = ...`). A local the function makes and fills
    in one call (a forward's scratch buffer) is no state. Not under a rank guard.
    A queue kept across steps that takes in rows of each step's batch (MoCo's negative keys:
    `queue = torch.cat([queue, k])[len(k):]`, or `self.queue[:, ptr:ptr + n] = keys.T` with a
    moving pointer) takes in every rank's rows: `tm.gather_rows(k)` (the reference MoCo's
    `concat_all_gather`), at the write or at the top of the method that receives the keys; a
    `torch.cat` not cut to a fixed size (features collected for an evaluation) is left alone.

    ## Why is this bad?
    Once the training data is sharded, each rank sees only its part of every epoch, so it would
    update only the rows of its own samples: each rank's copy of the state drifts apart, and
    once the shards are reshuffled a sample's row on its new rank is stale (or still zero), which
    changes what the method computes, silently. `tm.all_rows` gathers the indices and the rows of
    every rank, in the same order on every rank, so every copy receives every update and stays
    identical, as the one process's state would (rows written by two ranks in one step take the
    later rank's). A collective: every rank runs it once per step, as the training step itself.
    In one process `tm.all_rows(x)` is `x`.
    """

    code = "TM310"
    name = "synced-state-writes"
    summary = "Write a state tensor's rows on every rank when it is written at a batch's indices"
    safety = Safety.SAFE
    commands = frozenset({"ddp"})
    examples = (
        Example(
            before="""
            import torch
            class ELRLoss(torch.nn.Module):
                def __init__(self, num_examp, num_classes, beta=0.7):
                    super().__init__()
                    self.target = torch.zeros(num_examp, num_classes)
                    self.beta = beta
                def forward(self, index, output, label):
                    p = output.softmax(1).detach()
                    self.target[index] = self.beta * self.target[index] + (1 - self.beta) * p
                    return torch.nn.functional.cross_entropy(output, label)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            class ELRLoss(torch.nn.Module):
                def __init__(self, num_examp, num_classes, beta=0.7):
                    super().__init__()
                    self.target = torch.zeros(num_examp, num_classes)
                    self.beta = beta
                def forward(self, index, output, label):
                    p = output.softmax(1).detach()
                    self.target[tm.all_rows(index)] = tm.all_rows(self.beta * self.target[index] + (1 - self.beta) * p)
                    return torch.nn.functional.cross_entropy(output, label)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx) or not ctx.options.migrating or analysis.is_distributed(ctx):
            return
        self._queues()
        states = self._states()
        if not states:
            return
        for assign in ctx.nodes(cst.Assign):
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Subscript):
                continue
            target = assign.targets[0].target
            state = dotted(target.value)
            index = _index(target)
            owner = self._owner(assign, state, states) if state is not None and index is not None else None
            if owner is None or _loop_counter(ctx, assign, index) or not self._outlives_step(assign, state, owner):
                continue
            if collective_guard(ctx, assign) is not None or ctx.enclosing(assign, cst.FunctionDef) is None:
                continue
            tm = ctx.tm
            self.report(assign, f"`{state}` is a state kept across steps and written at the batch's indices "
                                f"(`{code(index)}`): each rank would update only the rows of its own samples, and the "
                                f"ranks' copies would drift apart; every rank's rows are written on every rank "
                                f"(`{tm}.all_rows`)",
                        edits=[replace(assign, lambda a: _gathered(a, tm))], imports=[ctx.runtime_import()])

    # --- queues: a fixed number of the latest rows, taken in at every step ---------------
    def _queues(self) -> None:
        """A queue kept across steps that takes in rows computed from each step's batch (MoCo's
        negative keys): `queue = torch.cat([queue, k])[len(k):]`, or `self.queue[:, ptr:ptr +
        batch_size] = keys.T` with a moving pointer. Each rank would take in only its own shard's
        rows, so the ranks' queues differ and each holds fewer distinct batches: the rows are
        gathered from every rank first (`tm.gather_rows`), as the reference MoCo's
        `concat_all_gather` does, so each step takes in the global batch as in one process."""
        ctx, tm = self.ctx, self.ctx.tm
        for assign in ctx.nodes(cst.Assign):
            if len(assign.targets) != 1 or collective_guard(ctx, assign) is not None:
                continue
            target = assign.targets[0].target
            new = _cat_enqueued(ctx, assign)
            if new is not None and self._in_step(assign, dotted(target) or ""):
                # every read of the rows in the statement (`[len(k):]` too), or the queue would grow
                rows = code(new)
                same = [n for n in ctx.within(assign.value, type(new)) if code(n) == rows and not (
                    isinstance(ctx.parent(n), cst.Attribute) and ctx.parent(n).attr is n)]
                self.report(assign, _QUEUE.format(name=code(target), tm=tm),
                            edits=[replace(n, lambda n: cst.Call(func=expr(f"{tm}.gather_rows"), args=[cst.Arg(n)]))
                                   for n in same],
                            imports=[ctx.runtime_import()])
                continue
            keys = _pointer_enqueued(target, assign.value)
            if keys is None or not self._in_step(assign, dotted(target.value) or ""):
                continue
            func = ctx.enclosing(assign, cst.FunctionDef)
            params = {p.name.value for p in func.params.params} if func is not None else set()
            if keys not in params or not isinstance(func.body, cst.IndentedBlock):
                self.report(assign, _QUEUE.format(name=code(target.value), tm=tm)
                            + f": gather them with `{keys} = {tm}.gather_rows({keys})` before the queue's pointer "
                              "is moved by their number")
                continue
            first = func.body.body[0]
            docstring = isinstance(first, cst.SimpleStatementLine) and isinstance(first.body[0], cst.Expr) \
                and isinstance(first.body[0].value, cst.SimpleString)
            if any(f"{tm}.gather_rows({keys})" in code(st) for st in func.body.body[:2]):
                continue
            line = cst.parse_statement(f"{keys} = {tm}.gather_rows({keys})  # every rank's rows\n")
            edit = insert_after(first, [line]) if docstring else insert_before(first, [line])
            self.report(assign, _QUEUE.format(name=code(target.value), tm=tm), edits=[edit],
                        imports=[ctx.runtime_import()])

    def _in_step(self, assign: cst.Assign, name: str) -> bool:
        """The write runs at each training step: a method of a class writing its own attribute
        (a model's `_dequeue_and_enqueue`), or inside a loop over batches or one that steps."""
        if name.startswith("self.") and self.ctx.enclosing(assign, cst.ClassDef) is not None:
            return True
        for loop in self.ctx.ancestors(assign):
            if isinstance(loop, cst.For) and is_batch_source(self.ctx, loop.iter) or isinstance(
                    loop, (cst.For, cst.While)) and _steps(self.ctx, loop):
                return True
        return False

    def _states(self) -> Dict[str, List[cst.CSTNode]]:
        """Names (`x`, `self.x`) bound to a torch factory whose first size is not a literal,
        with the classes (for `self.`) or scopes they belong to."""
        ctx = self.ctx
        out: Dict[str, List[cst.CSTNode]] = {}
        for assign in ctx.nodes(cst.Assign):
            if len(assign.targets) != 1:
                continue
            name = dotted(assign.targets[0].target)
            call = _factory_call(ctx, assign.value)
            if name is None or call is None or not call.args or call.args[0].keyword is not None:
                continue
            size = call.args[0].value
            first = size.elements[0].value if isinstance(size, (cst.Tuple, cst.List)) and size.elements else size
            if isinstance(first, cst.Integer):
                continue  # a fixed-size buffer, not one row per sample or class
            owner = ctx.enclosing(assign, cst.ClassDef) if name.startswith("self.") else ctx.scope_of(assign)
            if owner is not None:
                out.setdefault(name, []).append(owner)
        return out

    def _owner(self, assign: cst.Assign, name: str, states: Dict[str, List[cst.CSTNode]]) -> Optional[cst.CSTNode]:
        """The class or scope whose state `name` the write at `assign` writes, if any."""
        ctx = self.ctx
        for owner in states.get(name, ()):
            if name.startswith("self."):
                if ctx.enclosing(assign, cst.ClassDef) is owner:
                    return owner
            elif ctx.scope_of(assign) is owner or (isinstance(owner, cst.Module) and name not in _local_names(ctx, assign)):
                return owner
        return None


    def _outlives_step(self, assign: cst.Assign, name: str, owner: cst.CSTNode) -> bool:
        """The state lives longer than one step: an attribute or a module's global does; a local
        of a function only where that function runs the steps itself, the write inside a loop
        over batches or one that steps (`bank = torch.zeros(n, d)` before `for x, y, idx in
        loader:`), not a scratch buffer a forward makes and fills on every call (`folded =
        torch.zeros(k, b, d)` filled row by row)."""
        if name.startswith("self.") or isinstance(owner, cst.Module):
            return True
        for loop in self.ctx.ancestors_until(assign, owner):
            if isinstance(loop, cst.For) and is_batch_source(self.ctx, loop.iter) or isinstance(
                    loop, (cst.For, cst.While)) and _steps(self.ctx, loop):
                return True
        return False


_QUEUE = ("`{name}` is a queue kept across steps that takes in rows of each step's batch: each rank would take in "
          "only its own shard's rows and the ranks' queues would differ; every rank's rows are taken in on every "
          "rank (`{tm}.gather_rows`), as one process took in the whole batch")


def _cat_enqueued(ctx, assign: cst.Assign) -> Optional[cst.BaseExpression]:
    """In `queue = torch.cat([queue, k], dim=0)[len(k):]` (either order, any slice that keeps a
    fixed number of rows): `k`, the rows taken in. A `torch.cat` that is not sliced grows a
    collection (features gathered for an evaluation), which is no queue."""
    value = assign.value
    target = dotted(assign.targets[0].target)
    if target is None or not isinstance(value, cst.Subscript) or len(value.slice) != 1 \
            or not isinstance(value.slice[0].slice, cst.Slice) or not isinstance(value.value, cst.Call):
        return None
    call = value.value
    if (ctx.resolve(call.func) or "") not in ("torch.cat", "torch.concat", "torch.concatenate") or not call.args \
            or not isinstance(call.args[0].value, (cst.List, cst.Tuple)):
        return None
    parts = [e.value for e in call.args[0].value.elements]
    if len(parts) != 2 or any(isinstance(e, cst.StarredElement) for e in call.args[0].value.elements):
        return None
    names = [dotted(p) for p in parts]
    if names.count(target) != 1:
        return None
    new = parts[1 - names.index(target)]
    if isinstance(new, cst.Call) and (dotted(new.func) or "").endswith("gather_rows"):
        return None
    return new if dotted(_rows_base(new)) is not None else None


def _pointer_enqueued(target: cst.BaseExpression, value: cst.BaseExpression) -> Optional[str]:
    """In `self.queue[:, ptr:ptr + batch_size] = keys.T`: `keys` (the name whose rows go in at a
    moving pointer: a slice from a name to that name plus something)."""
    if not isinstance(target, cst.Subscript) or dotted(target.value) is None:
        return None
    moving = False
    for element in target.slice:
        sl = element.slice
        if isinstance(sl, cst.Slice) and isinstance(sl.lower, (cst.Name, cst.Attribute)) \
                and isinstance(sl.upper, cst.BinaryOperation) and isinstance(sl.upper.operator, cst.Add) \
                and dotted(sl.upper.left) == dotted(sl.lower):
            moving = True
    base = _rows_base(value)
    return base.value if moving and isinstance(base, cst.Name) else None


def _rows_base(node: cst.BaseExpression) -> cst.BaseExpression:
    """`keys` of `keys.T`, `keys.t()`, `k.detach()`, `feats.clone()`."""
    while True:
        if isinstance(node, cst.Attribute) and node.attr.value in ("T", "data", "mT"):
            node = node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and not node.args \
                and node.func.attr.value in ("t", "detach", "clone", "float", "half", "contiguous"):
            node = node.func.value
        else:
            return node


def _steps(ctx, loop: cst.CSTNode) -> bool:
    """The loop's body runs a training step: a `.backward()` or an `optimizer.step()`."""
    for call in ctx.within(loop, cst.Call, skip_defs=True):
        func = call.func
        if isinstance(func, cst.Attribute) and (func.attr.value == "backward" or func.attr.value == "step"
                                                and "optim" in (dotted(func.value) or "").lower()):
            return True
    return False


def _loop_counter(ctx, assign: cst.Assign, index: cst.BaseExpression) -> bool:
    """`state[i] = ...` with `i` a loop's counter (`for i in range(k)`, `for i, _ in
    enumerate(...)`): a position the code walks, the same on every rank, not the batch's
    sample indices; gathering an int is meaningless."""
    if not isinstance(index, cst.Name):
        return False
    for loop in ctx.ancestors(assign):
        if not isinstance(loop, cst.For) or not isinstance(loop.iter, cst.Call):
            continue
        func = dotted(loop.iter.func)
        target = loop.target
        if func == "range" and isinstance(target, cst.Name) and target.value == index.value:
            return True
        if func == "enumerate" and isinstance(target, (cst.Tuple, cst.List)) and target.elements \
                and isinstance(target.elements[0].value, cst.Name) and target.elements[0].value.value == index.value:
            return True
    return False


def _factory_call(ctx, value: cst.BaseExpression) -> Optional[cst.Call]:
    """`torch.zeros(n, c)`, also moved: `torch.zeros(n, c).cuda()`, `.to(device)`."""
    while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) \
            and value.func.attr.value in ("cuda", "to", "float", "long", "double", "half"):
        value = value.func.value
    if isinstance(value, cst.Call) and (ctx.resolve(value.func) or "") in _FACTORIES:
        return value
    return None


def _index(target: cst.Subscript) -> Optional[cst.BaseExpression]:
    """The index of `state[index]` when it is one name (`index`, `batch.idx`), not a slice."""
    if len(target.slice) != 1 or not isinstance(target.slice[0].slice, cst.Index):
        return None
    value = target.slice[0].slice.value
    return value if isinstance(value, (cst.Name, cst.Attribute)) and dotted(value) not in ("None", "Ellipsis") else None


def _local_names(ctx, node: cst.CSTNode) -> set:
    function = ctx.enclosing(node, cst.FunctionDef)
    if function is None:
        return set()
    names = {p.name.value for p in (*function.params.params, *function.params.kwonly_params)}
    for assign in ctx.within(function, cst.Assign, skip_defs=True):
        for t in assign.targets:
            if isinstance(t.target, cst.Name):
                names.add(t.target.value)
    return names


def _gathered(assign: cst.Assign, tm: str) -> cst.Assign:
    target = assign.targets[0].target
    element = target.slice[0]
    index = element.slice.value
    new_index = cst.Call(func=expr(f"{tm}.all_rows"), args=[cst.Arg(index)])
    new_target = target.with_changes(slice=[element.with_changes(slice=element.slice.with_changes(value=new_index))])
    return assign.with_changes(targets=[assign.targets[0].with_changes(target=new_target)],
                               value=cst.Call(func=expr(f"{tm}.all_rows"), args=[cst.Arg(assign.value)]))

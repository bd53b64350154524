"""TM310: a state tensor written at the batch's indices stays the same on every rank."""

from __future__ import annotations

from typing import Dict, Optional

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.program.rank_guards import collective_guard
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
    torch.zeros(num_examp, num_classes)` in a loss's `__init__`, `bank = torch.randn(n, dim)`),
    and the index a name (a batch's sample indices, its labels). Not under a rank guard.

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
        states = self._states()
        if not states:
            return
        for assign in ctx.nodes(cst.Assign):
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Subscript):
                continue
            target = assign.targets[0].target
            state = dotted(target.value)
            index = _index(target)
            if state is None or index is None or not self._same_state(assign, state, states):
                continue
            if collective_guard(ctx, assign) is not None or ctx.enclosing(assign, cst.FunctionDef) is None:
                continue
            tm = ctx.tm
            self.report(assign, f"`{state}` is a state kept across steps and written at the batch's indices "
                                f"(`{code(index)}`): each rank would update only the rows of its own samples, and the "
                                f"ranks' copies would drift apart; every rank's rows are written on every rank "
                                f"(`{tm}.all_rows`)",
                        edits=[replace(assign, lambda a: _gathered(a, tm))], imports=[ctx.runtime_import()])

    def _states(self) -> Dict[str, cst.CSTNode]:
        """Names (`x`, `self.x`) bound to a torch factory whose first size is not a literal,
        with the class (for `self.`) or scope they belong to."""
        ctx = self.ctx
        out: Dict[str, cst.CSTNode] = {}
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
                out[name] = owner
        return out

    def _same_state(self, assign: cst.Assign, name: str, states: Dict[str, cst.CSTNode]) -> bool:
        ctx = self.ctx
        owner = states.get(name)
        if owner is None:
            return False
        if name.startswith("self."):
            return ctx.enclosing(assign, cst.ClassDef) is owner
        return ctx.scope_of(assign) is owner or (isinstance(owner, cst.Module) and name not in _local_names(ctx, assign))


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

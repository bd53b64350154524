"""Which names a training loop gives a different value on each rank.

Every rank runs the same loop over its own shard, so what the loop computes from its batches
(the batch itself, the loss, anything assigned from them) differs per rank, while the loop's
index, counters stepped by a constant and values it broadcasts or all-reduces agree. A rule
that puts a collective, or a decision every rank must take alike, under an `if` asks here
whether the test agrees: TM108 (a `continue`/`break` one rank takes alone) and TM703 (a logged
loss reduced where it is printed).
"""

from __future__ import annotations

from typing import List, Set

import libcst as cst

from torchmigrate.rule import Context

# Collectives after which every rank holds the same value in their first argument.
_AGREEING = {"broadcast_object_list", "broadcast", "all_reduce"}


def names_in(node: cst.CSTNode) -> Set[str]:
    """The names an expression or target reads or binds (`self.x`: the object's name)."""
    out: Set[str] = set()
    stack: List[cst.CSTNode] = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Name):
            out.add(n.value)
        elif isinstance(n, cst.Attribute):
            stack.append(n.value)
        else:
            stack.extend(n.children)
    return out


def per_rank_names(ctx: Context, loop: cst.CSTNode) -> Set[str]:
    """Names that differ per rank in the loop: what it assigns, and what a `for` binds from
    its batches (not the index of an `enumerate`), less what it keeps agreed (`agreed_names`)."""
    names: Set[str] = set()
    for assign in ctx.within(loop, cst.Assign, skip_defs=True):
        for t in assign.targets:
            names |= names_in(t.target)
    for assign in ctx.within(loop, cst.AugAssign, skip_defs=True):
        names |= names_in(assign.target)
    names.discard("self")  # `self.step = ...` does not make every `self.x` per rank
    names -= agreed_names(ctx, loop)
    if isinstance(loop, cst.For):
        target = loop.target
        if isinstance(loop.iter, cst.Call) and isinstance(loop.iter.func, cst.Name) \
                and loop.iter.func.value == "enumerate" and isinstance(target, cst.Tuple) and target.elements:
            target = cst.Tuple(elements=target.elements[1:])
        names |= names_in(target)
    return names


def agreed_names(ctx: Context, loop: cst.CSTNode) -> Set[str]:
    """Names the loop gives the same value on every rank: counters it only steps by a
    constant (nanoGPT's `iter_num += 1`, tested by `if iter_num > max_iters: break`), what
    it broadcasts or all-reduces (yolov5's `dist.broadcast_object_list(broadcast_list, 0)`),
    and names it reads back from those alone (`stop = broadcast_list[0]`)."""
    stepped: Set[str] = set()
    for aug in ctx.within(loop, cst.AugAssign, skip_defs=True):
        if isinstance(aug.target, cst.Name) and isinstance(aug.value, (cst.Integer, cst.Float)):
            stepped.add(aug.target.value)
    assigns = ctx.within(loop, cst.Assign, skip_defs=True)
    steps = [a for a in assigns if _steps_by_constant(a)]  # `iter_num = iter_num + 1`
    stepped |= {a.targets[0].target.value for a in steps}
    agreed = stepped - {n for a in assigns if a not in steps for t in a.targets for n in names_in(t.target)}
    for call in ctx.within(loop, cst.Call, skip_defs=True):
        name = cst.helpers.get_full_name_for_node(call.func) or ""
        if name.rsplit(".", 1)[-1] in _AGREEING and call.args and isinstance(call.args[0].value, cst.Name):
            agreed.add(call.args[0].value.value)
    for a in assigns:
        if names_in(a.value) and names_in(a.value) <= agreed:
            agreed |= {n for t in a.targets for n in names_in(t.target)}
    return agreed


def _steps_by_constant(assign: cst.Assign) -> bool:
    """`n = n + 1` (or `n = 1 + n`): a counter stepped by a constant, as `n += 1` is."""
    if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
        return False
    name, value = assign.targets[0].target.value, assign.value
    if not (isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Add)):
        return False
    sides = (value.left, value.right)
    return any(isinstance(a, cst.Name) and a.value == name for a in sides) and any(
        isinstance(b, (cst.Integer, cst.Float)) for b in sides)

"""Which code runs on some ranks only: the innermost rank guard around a node (`if rank == 0:`,
`x if tm.is_main() else y`, `is_main and log(...)`, an earlier `if rank != 0: return`), also
around the calls of the function holding it. Facts only, no rule code: a collective inserted
under such a guard would hang the other ranks, and output already under one needs no guard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import libcst as cst

from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.syntax import body_of, index_in, local_calls

if TYPE_CHECKING:
    from torchmigrate.rule import Context


def _early_exit(stmt: cst.CSTNode) -> bool:
    """`if <rank test>: return` (or continue/break) before the node: the rest runs on some ranks
    only. (`raise` is not counted: it stops the whole job, so it is a check, not a guard.)"""
    if not isinstance(stmt, cst.If) or stmt.orelse is not None:
        return False
    body = stmt.body
    stmts = body.body if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else ()
    if not stmts:
        return False
    last = stmts[-1]
    smalls = last.body if isinstance(last, cst.SimpleStatementLine) else [last]
    return any(isinstance(s, (cst.Return, cst.Continue, cst.Break)) for s in smalls)


def _rank_exits(ctx: Context, block: cst.CSTNode) -> List[tuple]:
    """(index, statement) of the `if <rank test>: return` statements of a block (cached)."""
    cache: Dict[cst.CSTNode, List[tuple]] = ctx.facts.setdefault("tm_rank_exits", {})  # type: ignore[assignment]
    hit = cache.get(block)
    if hit is None:
        hit = cache[block] = [(i, s) for i, s in enumerate(body_of(block) or ())
                              if _early_exit(s) and rank_dependent(ctx, s.test)]
    return hit


def rank_guard_of(ctx: Context, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The innermost `if`/conditional/early exit that makes `node` run on some ranks only, if any
    (within the enclosing function)."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.If) and child is not anc.test and rank_dependent(ctx, anc.test):
            return anc
        if isinstance(anc, cst.IfExp) and child is not anc.test and rank_dependent(ctx, anc.test):
            return anc
        if isinstance(anc, cst.BooleanOperation) and child is anc.right and rank_dependent(ctx, anc.left):
            return anc
        body = body_of(anc)
        if body is not None and isinstance(child, cst.BaseStatement):
            exits = _rank_exits(ctx, anc)
            if exits:
                position = index_in(body, child)
                for i, sibling in exits:
                    if i < position:
                        return sibling
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        child = anc
    return None


def under_rank_guard(ctx: Context, node: cst.CSTNode) -> bool:
    return rank_guard_of(ctx, node) is not None


def collective_guard(ctx: Context, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """A rank guard around `node`, or around a call (in this file) of the function holding it:
    where a collective inserted at `node` would run on some ranks only and hang the others."""
    guard = rank_guard_of(ctx, node)
    if guard is not None:
        return guard
    fn = ctx.enclosing(node, cst.FunctionDef)
    if fn is None:
        return None
    for call in local_calls(ctx).get(fn.name.value, ()):
        guard = rank_guard_of(ctx, call)
        if guard is not None:
            return guard
    return None


def caller_guards(ctx: Context, node: cst.CSTNode, depth: int = 0) -> Optional[List[cst.CSTNode]]:
    """The rank guards under which `node` runs: its own, or, when it has none, those around
    every call (a few levels up) of the function holding it: the helper `save_checkpoint(state)`
    that `main` only calls under `if rank == 0:`, or the `__init__` of a class only built under
    one. Calls from other modules count through the program's facts (an empty list: guarded
    there only). None when some path reaches `node` unguarded, or nothing calls the function."""
    guard = rank_guard_of(ctx, node)
    if guard is not None:
        return [guard]
    fn = ctx.enclosing(node, cst.FunctionDef)
    if fn is None or depth >= 3:
        return None
    klass = ctx.enclosing(fn, cst.ClassDef)
    qual = f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value
    elsewhere = qual in ctx.program.called_elsewhere
    if elsewhere and qual not in ctx.program.guarded_elsewhere:
        return None
    name = klass.name.value if fn.name.value == "__init__" and klass is not None else fn.name.value
    calls = [c for c in local_calls(ctx).get(name, ()) if ctx.enclosing(c, cst.FunctionDef) is not fn]
    if not calls and not elsewhere:  # (a recursive call adds no path from outside)
        return None
    out: List[cst.CSTNode] = []
    for call in calls:
        found = caller_guards(ctx, call, depth + 1)
        if found is None:
            return None
        out.extend(found)
    return out

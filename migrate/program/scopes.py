"""Per-module indexes of scopes and names, computed once per file and kept in the context's
facts: the scope (function, class, lambda or module) holding a node, the assignments of each
scope by name, the plain names under a node. Facts only, no rule code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List

import libcst as cst

from torchmigrate import analysis

if TYPE_CHECKING:
    from torchmigrate.rule import Context


def scope_of(ctx: Context, node: cst.CSTNode) -> cst.CSTNode:
    """`ctx.scope_of`, cached: the function, class, lambda or module whose body holds `node`
    (`syntax.scope_of`, which the training facts ask, skips classes)."""
    cache: Dict[cst.CSTNode, cst.CSTNode] = ctx.facts.setdefault("tm_scope", {})  # type: ignore[assignment]
    hit = cache.get(node)
    if hit is None:
        hit = cache[node] = ctx.scope_of(node)
    return hit


def assignments(ctx: Context) -> Dict[tuple, List[cst.Assign]]:
    """`(scope, name)` -> the Assign statements binding the plain name `name` in `scope`, and
    `(scope, None)` -> every Assign of the scope; computed once per file."""
    index = ctx.facts.get("tm_assignments")
    if index is None:
        index = {}
        for assign in analysis.facts(ctx).assigns:
            scope = scope_of(ctx, assign)
            index.setdefault((scope, None), []).append(assign)
            for t in assign.targets:
                if isinstance(t.target, cst.Name):
                    index.setdefault((scope, t.target.value), []).append(assign)
        ctx.facts["tm_assignments"] = index
    return index  # type: ignore[return-value]


def names_in(ctx: Context, node: cst.CSTNode) -> frozenset:
    """Plain names read or written anywhere under `node` (cached per node; the names come from
    the context's node index rather than a walk of the subtree)."""
    cache: Dict[cst.CSTNode, frozenset] = ctx.facts.setdefault("tm_names_in", {})  # type: ignore[assignment]
    hit = cache.get(node)
    if hit is None:
        hit = cache[node] = frozenset(n.value for n in ctx.within(node, cst.Name))  # type: ignore[attr-defined]
    return hit

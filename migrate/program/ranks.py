"""Which expressions depend on the process's rank: names that hold a rank (`local_rank`,
`get_rank`), rank tests and which ranks they hold on (`rank == 0` on the main process only,
`rank != 0` on the others), and names a module assigns a rank test to (`save_logs =
dist.get_rank() == 0`). Facts only, no rule code: the rank guards (`rank_guards`) and the rules
that put code on the main process, or check that collectives run on every rank, build on them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Dict, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.syntax import iter_nodes, last_name
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import string_value

if TYPE_CHECKING:
    from torchmigrate.rule import Context


_MAIN_WORDS = ("is_main", "is_master", "master_process", "main_process", "is_primary", "global_zero",
               "process_zero", "process_index", "master_ordinal", "ismaster", "ismain", "is_rank_zero",
               "rank_zero", "rank0")


# What may precede `rank` in a name that holds this process's rank (`local_rank`, `get_rank`,
# `global_rank`); a config flag such as BLIP's `negative_all_rank` (the same on every rank) is
# not one.
_RANK_OWNERS = {"local", "global", "world", "node", "get", "my", "cur", "current", "this", "own", "proc",
                "process", "dist", "gpu", "device", "machine", "is", "host", "worker", "trainer", "data", "dp",
                "tp", "pp", "group", "in", "task", "slurm", "ompi", "pmi", "mpi", "hvd", "env"}


def rank_word(word: str) -> bool:
    """`rank`, `local_rank`, `rank_id`, `get_global_rank`: a name with the word `rank` that
    holds (or gets) a process's rank, not a setting about ranks (`negative_all_rank`)."""
    parts = word.lower().split("_")
    i = parts.index("rank") if "rank" in parts else -1
    return i == 0 or (i > 0 and parts[i - 1] in _RANK_OWNERS)


def _rankish_word(word: str) -> bool:
    w = word.lower()
    if rank_word(w) or w in ("localrank", "globalrank", "master"):
        return True
    return any(s in w for s in _MAIN_WORDS)


def rank_dependent(ctx: Context, test: cst.CSTNode) -> bool:
    """Whether an expression depends on the process's rank (`rank == 0`, `tm.is_main()`,
    `args.local_rank in [-1, 0]`, `dist.get_rank() == 0`, `accelerator.is_main_process`,
    `master_process`, `os.environ["LOCAL_RANK"]`, ...)."""
    cache: Dict[cst.CSTNode, bool] = ctx.facts.setdefault("tm_rank_dependent", {})  # type: ignore[assignment]
    hit = cache.get(test)
    if hit is not None:
        return hit
    result = _mentions_rank(test)
    if not result:
        flags = _rank_flags(ctx)
        result = bool(flags) and any(type(n) in (cst.Name, cst.Attribute) and dotted(n) in flags
                                     for n in iter_nodes(test))
    cache[test] = result
    return result


def _mentions_rank(node: cst.CSTNode) -> bool:
    for n in iter_nodes(node):
        if isinstance(n, cst.Name) and _rankish_word(n.value):
            return True
        if isinstance(n, cst.SimpleString) and "rank" in n.value.lower():
            return True
    return False


def _rank_flags(ctx: Context) -> frozenset:
    """Names the file assigns a rank test to (`save_logs = dist.get_rank() == 0`, open_clip's
    `args.save_logs = args.logs and is_master(args)`): `if save_logs:` is a rank guard too.
    Only rank tests (`rank_polarity`), not any value computed from the rank (`device =
    torch.device(f"cuda:{local_rank}")`) nor nanoGPT's `ddp = int(os.environ.get("RANK", -1)) != -1`,
    which holds on every rank."""
    if not ctx.walked:  # the file's assignments are known once the walk is over
        return frozenset()
    found = ctx.facts.get("tm_rank_flags")
    if found is None:
        names = set()
        for a in analysis.facts(ctx).assigns:
            if rank_polarity(a.value) is not None:
                names.update(n for n in (dotted(t.target) for t in a.targets) if n)
        found = ctx.facts["tm_rank_flags"] = frozenset(names)
    return found  # type: ignore[return-value]


_MAIN_WORD = re.compile(
    r"^(is_)?(local_|global_|world_)?(main|master|chief|leader|rank_?0|rank_?zero|global_zero|process_zero)"
    r"(_process|_proc|_rank|_node|_worker)?$", re.IGNORECASE)
_RANK_CALLS = {"get_rank", "get_local_rank", "get_global_rank", "rank", "local_rank", "get_node_rank"}


def _is_rankish(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Call):
        name = last_name(node.func)
        if name == "int" and node.args:
            return _is_rankish(node.args[0].value)
        return name in _RANK_CALLS
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Modulo):
        return _is_rankish(node.left)
    if isinstance(node, cst.Subscript):  # os.environ["RANK"]
        if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
            value = string_value(node.slice[0].slice.value)
            return value in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")
        return False
    name = last_name(node)
    return bool(name and rank_word(name) and not name.lower().startswith(("lora", "low")))


def _is_main_predicate(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.Call):
        node = node.func
    name = last_name(node)
    return bool(name and _MAIN_WORD.match(name) and name.lower() not in ("main", "master"))


def _ints(node: cst.BaseExpression) -> Optional[Set[int]]:
    if isinstance(node, cst.Integer):
        return {int(node.value)}
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and isinstance(node.expression, cst.Integer):
        return {-int(node.expression.value)}
    if isinstance(node, (cst.List, cst.Tuple, cst.Set)):
        out: Set[int] = set()
        for el in node.elements:
            sub = _ints(el.value)
            if sub is None:
                return None
            out |= sub
        return out
    return None


def opposite_polarity(p: Optional[str]) -> Optional[str]:
    """The polarity of `not test` (or of the `else` branch) for a test of polarity `p`."""
    return {"main": "other", "other": "main"}.get(p, p)


def rank_polarity(test: cst.BaseExpression) -> Optional[str]:
    """'main' when the test holds on rank 0 only, 'other' when it excludes rank 0, 'any' when
    it depends on the rank some other way, None when it does not look rank-dependent."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = test.expression
        if _is_rankish(inner):
            return "main"  # `not rank`
        return opposite_polarity(rank_polarity(inner))
    if isinstance(test, cst.BooleanOperation):
        left, right = rank_polarity(test.left), rank_polarity(test.right)
        if left and right and left != right:
            return "any"
        return left or right
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        comp = test.comparisons[0]
        left, right = test.left, comp.comparator
        if _is_rankish(right) and not _is_rankish(left):
            left, right = right, left
        if not _is_rankish(left):
            return None
        values = _ints(right)
        if values is None:
            return "any"
        op = comp.operator
        # -1 is the "not distributed" sentinel of torch.distributed.launch scripts: a test
        # against it alone holds on every rank of a distributed run.
        if isinstance(op, cst.GreaterThan) and max(values) < 0 or \
                isinstance(op, cst.GreaterThanEqual) and max(values) <= 0:
            return None
        if not values - {-1} and isinstance(op, (cst.Equal, cst.NotEqual, cst.In, cst.NotIn, cst.Is, cst.IsNot)):
            return None
        has_zero = 0 in values
        if isinstance(op, (cst.Equal, cst.In, cst.Is)):
            return "main" if has_zero else "other"
        if isinstance(op, (cst.NotEqual, cst.NotIn, cst.IsNot)):
            return "other" if has_zero else "any"
        if isinstance(op, (cst.GreaterThan, cst.GreaterThanEqual)):
            return "other" if min(values) >= 0 else "any"
        if isinstance(op, (cst.LessThan, cst.LessThanEqual)):
            return "main" if max(values) <= 1 else "any"
        return "any"
    if isinstance(test, cst.Call) and _is_main_predicate(test):
        return "main"
    if isinstance(test, (cst.Name, cst.Attribute)):
        if _is_main_predicate(test):
            return "main"
        if _is_rankish(test):
            return "other"  # `if rank:`
    return None

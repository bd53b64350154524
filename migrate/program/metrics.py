"""Metric facts of one module: the loops over data loaders, the numbers, lists and meters they
fill, and what the module does with them after the loop.

No rule code and no option reads these: the metrics family (`rules/metrics/`) decides from them
where a reduction or a gather goes (TM701, TM702, TM703).

- which loops iterate a data loader (`loader_loop`, `iterates_loader`, `loader_names`,
  `named_like_loader`) and which loader expression a loop iterates (`loader_expr`);
- what a name holds before a loop (`initial_value`, `starts_empty_list`, `is_number`), whether the
  loop rebinds it (`reassigned_in`) or may be left early (`leaves_early`);
- what happens to names after a loop (`events_after`: their reads, augmented assignments, and
  whether a collective runs before they are rebound; `binding_of`, `is_load`, `is_store`),
  over a source-order index of names, calls and collectives (`source_index`);
- which calls compute a metric that needs every sample (`metric_name`);
- the sums a loop adds to and whether one reduction after it keeps their divisions right
  (`loop_sums`, given the `ExactDenominators` of how its loader is sharded), and whether a list's
  only use after the loop is its mean (`means_only`): what TM701 and TM703 rewrite, and what the
  data plan counts as reduced when it decides whether an evaluation loader may be sharded.

Name resolution uses the import table (`ctx.resolve`), never across modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.collectives import is_collective
from torchmigrate.program.loop_ranks import names_in, per_rank_names
from torchmigrate.program.loaders import DATALOADERS, TQDM_CALLS, loader_expr, refs_at  # noqa: F401 (loader_expr: re-exported)
from torchmigrate.program.scopes import scope_of
from torchmigrate.program.splits import named_like_loader  # noqa: F401 (re-exported)
from torchmigrate.program.syntax import body_of, exclusive, index_in
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, string_value

if TYPE_CHECKING:
    from torchmigrate.rule import Context

_WRAPPERS = {"enumerate", "iter", "zip"}


def loader_names(ctx: Context) -> Set[str]:
    """Dotted names assigned from `DataLoader(...)` (or a progress bar over a loader)."""
    def compute() -> Set[str]:
        names: Set[str] = set()
        for assign in analysis.facts(ctx).assigns:
            value = assign.value
            if not isinstance(value, cst.Call):
                continue
            resolved = ctx.resolve(value.func)
            if resolved in DATALOADERS or dotted(value.func) in ctx.program.loader_classes or (resolved in TQDM_CALLS and value.args and iterates_loader(ctx, value.args[0].value, names)):
                for t in assign.targets:
                    d = dotted(t.target)
                    if d:
                        names.add(d)
        return names

    key = "tm_loader_names"
    if key not in ctx.facts:
        ctx.facts[key] = compute()
    return ctx.facts[key]  # type: ignore[return-value]


def iterates_loader(ctx: Context, node: cst.BaseExpression, known: Optional[Set[str]] = None) -> bool:
    """`loader`, `self.val_loader`, `loaders["val"]`, `enumerate(loader)`, `tqdm(loader)`, `pbar`
    (bound to `tqdm(loader)`), a name bound to `DataLoader(...)`, a parameter or alias that the
    loader facts follow to a DataLoader of this module."""
    if isinstance(node, cst.Call):
        func = node.func
        resolved = ctx.resolve(func)
        if isinstance(func, cst.Name) and func.value in _WRAPPERS:
            args = [a.value for a in node.args if a.keyword is None and not a.star]
            if func.value != "zip":
                args = args[:1]
            return any(iterates_loader(ctx, a, known) for a in args)
        if resolved in TQDM_CALLS and node.args and node.args[0].keyword is None:
            return iterates_loader(ctx, node.args[0].value, known)
        return False
    expression = node
    if isinstance(node, cst.Subscript):
        node = node.value
    name = dotted(node)
    if name is None:
        return False
    if named_like_loader(name):
        return True
    names = known if known is not None else loader_names(ctx)
    # a name the loader facts follow to a DataLoader of this module (`def evaluate(model, data)`)
    return name in names or (known is None and bool(refs_at(ctx, expression)))


def loader_loop(ctx: Context, node: cst.CSTNode, hand_made: bool = True) -> Optional[cst.For]:
    """The nearest enclosing `for` over a data loader, within the same function: a loop over a
    loader, or (`hand_made`) the loop that runs a training step itself (`for n, x, y in batches:
    ... loss.backward()`: a hand-made iterator, batch starts, a generator; the data rules share
    out what it iterates by rank), not an epoch loop around it."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(anc, cst.For) and (iterates_loader(ctx, anc.iter) or (hand_made and analysis.trains_itself(ctx, anc))):
            return anc
    return None


def is_number(node: cst.BaseExpression) -> bool:
    """A numeric literal (`0`, `0.0`, `-1`)."""
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    return isinstance(node, cst.UnaryOperation) and isinstance(node.expression, (cst.Integer, cst.Float))


def zeros_value(node: cst.BaseExpression) -> bool:
    """A zero tensor or array to add to (`torch.zeros(rep_dim, device=dev)`, `np.zeros(k)`,
    `torch.zeros_like(x)`): a sum `tm.all_reduce` reduces like a number."""
    return isinstance(node, cst.Call) and (dotted(node.func) or "").rsplit(".", 1)[-1] in ("zeros", "zeros_like") \
        and (dotted(node.func) or "").split(".", 1)[0] in ("torch", "np", "numpy")


def _divides_other(ctx: Context, use: cst.CSTNode, group: Set[str]) -> bool:
    """`use` divides a value outside `group` in place (`c /= n_samples`)."""
    for anc in ctx.ancestors(use):
        if isinstance(anc, cst.AugAssign):
            return isinstance(anc.operator, (cst.DivideAssign, cst.FloorDivideAssign)) \
                and not (isinstance(anc.target, cst.Name) and anc.target.value in group)
        if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            return False
    return False


def _empty_list(node: cst.BaseExpression) -> bool:
    if isinstance(node, cst.List):
        return not node.elements
    return isinstance(node, cst.Call) and dotted(node.func) == "list" and not node.args


def _assigned(statement: cst.CSTNode, name: str) -> Tuple[bool, Optional[cst.BaseExpression]]:
    """Whether a simple statement line assigns `name`, and the value (None if unknown)."""
    if not isinstance(statement, cst.SimpleStatementLine):
        return False, None
    found: Tuple[bool, Optional[cst.BaseExpression]] = (False, None)
    for small in statement.body:
        if isinstance(small, cst.Assign):
            for t in small.targets:
                target = t.target
                if isinstance(target, cst.Name) and target.value == name or (
                        isinstance(target, cst.Attribute) and "." in name and dotted(target) == name):
                    found = (True, small.value)  # `losses = []`, `self.running_acc = []`
                elif isinstance(target, (cst.Tuple, cst.List)):
                    for i, el in enumerate(target.elements):
                        if isinstance(el.value, cst.Name) and el.value.value == name:
                            value = small.value
                            if isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(target.elements):
                                found = (True, value.elements[i].value)
                            else:
                                found = (True, None)
        elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
            found = (True, small.value)
        elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name) and small.target.value == name:
            found = (True, None)
    return found


def initial_value(ctx: Context, loop: cst.CSTNode, name: str) -> Tuple[bool, Optional[cst.BaseExpression]]:
    """The value `name` gets before `loop`, in the same function and the same iteration of any
    enclosing loop (a counter set up before an outer `for epoch` loop is not reset per pass)."""
    node = loop
    while True:
        parent = ctx.parent(node)
        if parent is None:
            return False, None
        body = body_of(parent)
        if body is not None and isinstance(parent, (cst.IndentedBlock, cst.Module)):
            for s in reversed(body[:index_in(body, node)]):
                found, value = _assigned(s, name)
                if found:
                    return True, value
        if isinstance(parent, (cst.For, cst.While, cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.Module)):
            return False, None
        node = parent


def starts_empty_list(ctx: Context, loop: cst.CSTNode, name: str) -> bool:
    """`name = []` before `loop` in the same pass of any enclosing loop; or emptied at the end of
    each pass of the enclosing loop instead, having started empty before it (`train_losses = []`
    above `for epoch`, then `train_losses = []` after the mean at the end of each epoch)."""
    found, value = initial_value(ctx, loop, name)
    if found:
        return value is not None and _empty_list(value)
    outer = next((a for a in ctx.ancestors(loop) if isinstance(a, (cst.For, cst.While, cst.FunctionDef, cst.Module))),
                 None)
    if not isinstance(outer, (cst.For, cst.While)) or not isinstance(outer.body, cst.IndentedBlock):
        return False
    body = list(outer.body.body)
    inner = next((s for s in body if s is loop or any(a is s for a in ctx.ancestors(loop))), None)
    if inner is None:
        return False
    emptied = False
    for s in body[body.index(inner) + 1:]:
        found, value = _assigned(s, name)
        if found:
            emptied = value is not None and _empty_list(value)
    before, start = initial_value(ctx, outer, name)
    return emptied and before and start is not None and _empty_list(start)


_SPANNED = (cst.For, cst.While, cst.Assign, cst.AnnAssign, cst.AugAssign)


class SourceIndex:
    """Source-order positions of names and calls, where each loop and assignment starts and
    ends, and the calls that communicate; built from the context's node index on first use
    (only for files with candidate loops). Names and calls are looked up when asked for, as
    the rules ask about a few names and most files have no collective calls."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._names: Dict[str, List[Tuple[int, cst.Name]]] = {}
        self.start = _Spans(ctx.position)
        self.end = _Spans(ctx.last_position)
        self.collectives = [(ctx.position(c), c) for c, name in analysis.facts(ctx).calls if is_collective(name)]
        # calls of this file's helpers that communicate (`reduce_tensor(t)` wrapping dist.all_reduce)
        helpers = set()
        for _, c in self.collectives:
            fn = ctx.enclosing(c, cst.FunctionDef)
            if fn is not None:
                helpers.add(fn.name.value)
        if helpers:
            for o, c in self.calls:
                func = c.func
                name = func.value if isinstance(func, cst.Name) else (
                    func.attr.value if isinstance(func, cst.Attribute) and dotted(func.value) in ("self", "cls") else None)
                if name in helpers:
                    self.collectives.append((o, c))
            self.collectives.sort(key=lambda item: item[0])

    def names(self, value: str) -> List[Tuple[int, cst.Name]]:
        """`(position, node)` of every Name spelling `value`, in source order."""
        found = self._names.get(value)
        if found is None:
            position = self.ctx.position
            found = self._names[value] = [(position(n), n) for n in self.ctx.named(value)]  # type: ignore[misc]
        return found

    @cached_property
    def resolved(self) -> Dict[int, Optional[str]]:
        """`id(call)` -> the call's qualified name (ids: no Python-level `__hash__`)."""
        return {id(call): name for call, name in analysis.facts(self.ctx).calls}

    @cached_property
    def calls(self) -> List[Tuple[int, cst.Call]]:
        """`(position, node)` of every call, in source order."""
        return self.ctx.positioned(cst.Call)  # type: ignore[return-value]

    @cached_property
    def _call_order(self) -> Dict[cst.Call, int]:
        return {c: o for o, c in self.calls}

    def order_of(self, call: cst.Call) -> int:
        """The source-order position of `call` (0 for a call not in the file's index)."""
        return self._call_order.get(call, 0)


class _Spans:
    """`start[node]` / `end[node]` for loops and assignments (`get` defaults for others)."""

    def __init__(self, where) -> None:
        self.where = where

    def __getitem__(self, node: cst.CSTNode) -> int:
        if type(node) not in _SPANNED:  # exact types: isinstance against LibCST's ABCs is slow
            raise KeyError(node)
        return self.where(node)

    def get(self, node: cst.CSTNode, default: int) -> int:
        return self.where(node) if type(node) in _SPANNED else default


def source_index(ctx: Context) -> SourceIndex:
    index = ctx.facts.get("tm_source_index")
    if index is None:
        index = ctx.facts["tm_source_index"] = SourceIndex(ctx)
    return index  # type: ignore[return-value]


def binding_of(ctx: Context, name: cst.Name) -> Optional[cst.CSTNode]:
    """The statement that (re)binds `name` when it is an assignment or loop target
    (Assign, AnnAssign, For, With); AugAssign for `name += ...`; None for a read."""
    node: cst.CSTNode = name
    parent = ctx.parent(node)
    while isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
        node, parent = parent, ctx.parent(parent)
    if isinstance(parent, cst.AssignTarget):
        return ctx.parent(parent)
    if isinstance(parent, (cst.AnnAssign, cst.AugAssign)) and parent.target is node:
        return parent
    if isinstance(parent, cst.For) and parent.target is node:
        return parent
    if isinstance(parent, cst.AsName):
        return ctx.enclosing(parent, cst.With)
    return None


@dataclass
class Events:
    uses: List[cst.Name] = field(default_factory=list)
    augs: List[cst.AugAssign] = field(default_factory=list)  # `x /= n`, `x += y` after the loop
    collective: bool = False


def events_after(ctx: Context, loop: cst.CSTNode, names: Set[str]) -> Dict[str, Events]:
    """Reads of `names` after `loop` in the same function, each up to (and including) the
    name's next rebinding statement, and whether a collective runs in that stretch."""
    index = source_index(ctx)
    start = index.end[loop]
    scope = scope_of(ctx, loop)
    collectives = [o for o, c in index.collectives if o > start and scope_of(ctx, c) is scope]
    out = {}
    for name in names:
        ev = out[name] = Events()
        stop = None
        for order, node in index.names(name):
            if order <= start or (stop is not None and order > stop):
                continue
            if scope_of(ctx, node) is not scope or not is_load(ctx, node) or exclusive(ctx, loop, node):
                continue
            binding = binding_of(ctx, node)
            if binding is None:
                ev.uses.append(node)
            elif isinstance(binding, cst.AugAssign):
                ev.augs.append(binding)
            elif stop is None:
                stop = index.end.get(binding, order)
        ev.collective = any(o <= stop for o in collectives) if stop is not None else bool(collectives)
    return out


def is_store(ctx: Context, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    return not isinstance(parent, (cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index))


def is_load(ctx: Context, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    if isinstance(parent, cst.Attribute) and parent.attr is name:
        return False
    if isinstance(parent, cst.Arg) and parent.keyword is name:
        return False
    return True


def reassigned_in(ctx: Context, loop: cst.CSTNode, name: str) -> bool:
    """`name` is bound by something other than `name += ...` inside the loop."""
    index = source_index(ctx)
    begin, end = index.start[loop], index.end[loop]
    for order, node in index.names(name):
        if begin < order <= end and is_load(ctx, node):
            binding = binding_of(ctx, node)
            if binding is not None and not isinstance(binding, cst.AugAssign):
                return True
    return False


def leaves_early(ctx: Context, loop: cst.For) -> bool:
    """A `return`, `yield` or `break` in the loop: ranks may leave it at different points and
    never all reach a collective after it. Not one under a test of the loop's index, counters
    and settings alone (`if batch_id > args.max_iter: break`): every rank leaves at the same step."""
    exits = ctx.within(loop.body, cst.Return, cst.Yield, cst.Break, skip_defs=True)
    if not exits:
        return False
    data = None
    for node in exits:
        if isinstance(node, cst.Yield):
            return True
        tests = [a for a in ctx.ancestors_until(node, loop) if isinstance(a, (cst.If, cst.While, cst.Try, cst.For))]
        if not tests or not all(isinstance(a, cst.If) for a in tests):
            return True
        if data is None:
            data = per_rank_names(ctx, loop)
        if any(names_in(a.test) & data for a in tests) or any(
                isinstance(c, cst.Call) for a in tests for c in ctx.within(a.test, cst.Call)):
            return True  # (a call may read this rank's data or state)
    return False


_METRIC_TOKENS = {"auc", "roc", "auroc", "auprc", "f1", "fbeta", "mcc", "map", "iou", "miou", "wer", "cer", "r2",
                  "ap", "dice", "bleu", "rouge", "kappa", "ndcg", "mrr", "acc"}
_METRIC_WORDS = ("precision", "recall", "confusion", "matthews", "accuracy", "score", "metric", "pearson",
                 "spearman", "corrcoef", "evaluat")
_METRIC_MODULES = ("sklearn.metrics", "torchmetrics.functional", "scipy.stats", "pycocotools", "evaluate.")
_NOT_METRICS = {"print", "len", "sum", "max", "min", "str", "float", "int", "list", "sorted", "map", "zip",
                "enumerate", "range", "round", "abs"}


def metric_name(ctx: Context, call: cst.Call) -> Optional[str]:
    name = ctx.resolve(call.func) or dotted(call.func)
    if not name:
        return None
    last = name.rsplit(".", 1)[-1]
    if last in _NOT_METRICS:
        return None
    lower = last.lower()
    tokens = set(lower.split("_"))
    if name.startswith(_METRIC_MODULES) or tokens & _METRIC_TOKENS or any(w in lower for w in _METRIC_WORDS) \
            or any(t.startswith("accu") and not t.startswith("accum") for t in tokens):
        return last  # (`calculate_accuray`: an accuracy, misspelt; not `accumulate`)
    return None


# --- the sums of a loop, and whether a reduction keeps their divisions right -------------------

@dataclass
class ExactDenominators:
    """`len(...)` denominators that stay exact once a loop's sums are reduced across ranks, given
    how its loader is sharded (the metrics plan knows that: `rules/metrics/plan.exact_lens`)."""

    dataset: Set[str] = field(default_factory=set)  # len(X) = whole dataset, loader unpadded (tm.eval_sampler)
    batches: Set[str] = field(default_factory=set)  # len(X) = per-rank batch count, equal on every rank
    # names holding the loop's `enumerate` index (`i`, or `b_idx = i` in the body): `i + 1` after
    # the loop is this rank's batch count, equal on every rank
    counters: Set[str] = field(default_factory=set)


_SAFE_FUNCS = {"max", "min", "float", "int", "abs", "round"}
_SAFE_METHODS = {"item", "float", "double", "cpu", "long"}
_DIVISIONS = (cst.Divide, cst.FloorDivide)
_DIVISION_ASSIGNS = (cst.DivideAssign, cst.FloorDivideAssign, cst.MultiplyAssign)


def _closed(node: cst.CSTNode, group: Set[str], lens: Set[str] = frozenset()) -> bool:
    """Only accumulators of `group`, numbers, max/min/float/int/abs/round, and `len(X)` for X in `lens`."""
    if isinstance(node, cst.Name):
        return node.value in group
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.BinaryOperation):
        return _closed(node.left, group, lens) and _closed(node.right, group, lens)
    if isinstance(node, cst.UnaryOperation):
        return _closed(node.expression, group, lens)
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Name) and func.value in _SAFE_FUNCS:
            return all(_closed(a.value, group, lens) for a in node.args)
        if isinstance(func, cst.Name) and func.value == "len" and len(node.args) == 1 and lens:
            return code(node.args[0].value).replace(" ", "") in lens
        if isinstance(func, cst.Attribute) and func.attr.value in _SAFE_METHODS and not node.args:
            return _closed(func.value, group, lens)
        return False
    return False


def _classify(left: cst.CSTNode, right: cst.CSTNode, whole: cst.CSTNode, group: Set[str],
              exact: ExactDenominators) -> Optional[str]:
    """How a division involving accumulators stays right after reducing: "sum" (reduce with a
    sum), "mean" (`x / len(loader)`: average over ranks), or None (foreign denominator)."""
    if _closed(whole, group) or (exact.dataset and _closed(whole, group, exact.dataset)):
        return "sum"
    if exact.batches and _closed(left, group) and isinstance(right, cst.Call) and _closed(right, set(), exact.batches):
        return "mean"
    if exact.counters and _closed(left, group) and _batch_count(right, exact.counters):
        return "mean"
    return None


def _batch_count(node: cst.CSTNode, counters: Set[str]) -> bool:
    """`i + 1` (also `1 + i`, `float(i + 1)`) of a loop's `enumerate` index `i`: after the loop,
    the number of batches the rank went through."""
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in ("float", "int") \
            and len(node.args) == 1:
        return _batch_count(node.args[0].value, counters)
    if not (isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add)):
        return False
    sides = (node.left, node.right)
    return any(isinstance(a, cst.Name) and a.value in counters and isinstance(b, cst.Integer) and b.value == "1"
               for a, b in (sides, sides[::-1]))


def divisions_of(ctx: Context, use: cst.Name) -> List[cst.BinaryOperation]:
    out = []
    for anc in ctx.ancestors(use):
        if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            break
        if isinstance(anc, cst.BinaryOperation) and isinstance(anc.operator, _DIVISIONS):
            out.append(anc)
    return out


@dataclass
class Sums:
    """The numbers a loop adds to (`correct += ...`, `total += y.size(0)`) and what a reduction
    after the loop would make of them (`loop_sums`)."""

    # reducible: name -> "sum" (`tm.all_reduce(x)`) or "mean" (`op="mean"`, a sum over len(loader));
    # "mean-or-sum": also read as it is before `x /= len(loader)` (compared, printed): the ranks'
    # mean where each rank runs the original's number of batches (its batch divided), for the rule
    # to settle
    kinds: Dict[str, str] = field(default_factory=dict)
    # a division after the loop that a reduction would make wrong: name -> that division (or `x /= d`)
    foreign: Dict[str, cst.CSTNode] = field(default_factory=dict)
    reduced: Set[str] = field(default_factory=set)  # a collective already runs after the loop


def loop_sums(ctx: Context, loop: cst.For, names: List[str], exact: ExactDenominators,
              also: Set[str] = frozenset()) -> Sums:
    """Which of `names` (added to with `+=` in `loop`) are sums that one reduction right after
    the loop makes right: set to a number before the loop (in the same pass of any enclosing
    loop), never rebound in it, used after it, not added to after it, and every division they
    take part in after the loop stays right once they are reduced (`ExactDenominators`). A
    loop that may be left early (`return`, `yield`) has none: some ranks would never reach a
    reduction after it. `also`: what a reduction after the loop sums besides (an array summed by
    index, `matrix / total`), which a division may combine with these."""
    out = Sums()
    if ctx.within(loop.body, cst.Return, cst.Yield, skip_defs=True):
        return out
    candidates = []
    for name in names:
        found, value = initial_value(ctx, loop, name)
        if found and value is not None and (is_number(value) or zeros_value(value)) and not reassigned_in(ctx, loop, name):
            candidates.append(name)
    if not candidates:
        return out
    events = events_after(ctx, loop, set(candidates))
    group = set()
    for name in candidates:
        ev = events[name]
        if ev.collective and (ev.uses or ev.augs):
            out.reduced.add(name)
            continue
        if ev.collective or not ev.uses and not ev.augs:
            continue  # not used after the loop
        if any(isinstance(a.operator, (cst.AddAssign, cst.SubtractAssign)) for a in ev.augs):
            continue  # accumulated further after the loop: unclear where to reduce
        group.add(name)
    changed = True
    while changed and group:
        changed = False
        kinds: Dict[str, str] = {}
        for name in sorted(group):
            ev = events[name]
            found: Set[Optional[str]] = set()
            bad = None
            for a in ev.augs:
                if isinstance(a.operator, _DIVISION_ASSIGNS):
                    k = _classify(a.target, a.value, a.value, group | also, exact) \
                        if not isinstance(a.operator, cst.MultiplyAssign) else ("sum" if _closed(a.value, group) else None)
                    found.add(k)
                    if k is None and bad is None:
                        bad = a
            # `train_loss /= len(loader)` rebinds the sum to its mean: what reads it afterwards
            # (a print, a checkpoint dict) reads the mean
            averaged_at = min((ctx.position(a) or 0 for a in ev.augs if isinstance(a.operator, _DIVISION_ASSIGNS)
                               and not isinstance(a.operator, cst.MultiplyAssign)), default=None)
            for use in ev.uses:
                if _divides_other(ctx, use, group) and bad is None:
                    # `c /= n_samples`: `c` is not reduced here, so neither is its count
                    bad = ctx.enclosing(use, cst.AugAssign)
                divisions = divisions_of(ctx, use)
                if not divisions and averaged_at is not None and (ctx.position(use) or 0) > averaged_at:
                    continue
                if not divisions:
                    found.add("plain")
                for d in divisions:
                    k = _classify(d.left, d.right, d, group | also, exact)
                    found.add(k)
                    if k is None and bad is None:
                        bad = d
            if bad is None and found == {"mean", "plain"}:
                kinds[name] = "mean-or-sum"  # a sum of batch means read as it is, then over len(loader)
                continue
            if bad is None and "mean" in found and found != {"mean"}:
                bad = next((d for use in ev.uses for d in divisions_of(ctx, use)), None) or ev.uses[0]
            if bad is not None:
                out.foreign[name] = bad
                group.discard(name)
                changed = True
            else:
                kinds[name] = "mean" if found == {"mean"} else "sum"
        out.kinds = kinds
    return out


# --- lists of per-batch values whose only use is their mean ----------------------------------

# Calls that turn a list into its mean: the result is the same whichever rank's values it holds,
# so gathering every rank's values into it is right whether or not the loader was sharded.
MEAN_CALLS = frozenset({"mean", "fmean", "average", "nanmean"})
_TO_ARRAY = frozenset({"tensor", "as_tensor", "stack", "array", "asarray", "Tensor", "FloatTensor"})


def means_only(ctx: Context, loop: cst.For, name: str) -> bool:
    """Every use of the list `name` after `loop` (in its scope, before a rebinding) is inside a
    mean: `sum(x) / len(x)`, `np.mean(x)`, `statistics.mean(x)`, `torch.tensor(x).mean()`, a mean
    over its items (`np.mean([d["acc"] for d in x])`)."""
    index = source_index(ctx)
    begin = index.end[loop]
    scope = scope_of(ctx, loop)
    uses = 0
    for order, n in index.names(name):
        if order <= begin or scope_of(ctx, n) is not scope or not is_load(ctx, n):
            continue
        if binding_of(ctx, n) is not None:
            continue  # `losses = np.mean(losses)`: the target; its value's uses are checked
        if _deleted(ctx, n):
            break  # `del losses`: no use, and none after it
        if not in_mean(ctx, n, name):
            return False
        uses += 1
        statement = ctx.statement_of(n)
        if any(binding_of(ctx, t) is not None for t in ctx.within(statement, cst.Name) if t.value == name):
            break  # rebound here: later uses are of the mean, not the list
    return uses > 0


def _deleted(ctx: Context, node: cst.Name) -> bool:
    """`node` is a target of `del` (`del losses`, `del a, losses`)."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.Del):
            return True
        if not isinstance(anc, (cst.Tuple, cst.List, cst.Element)):
            return False
    return False


def in_mean(ctx: Context, use: cst.BaseExpression, name: str) -> bool:
    """`use` (the list `name`, a name or `self.x`) is read as a mean: `np.mean(x)`,
    `sum(x) / len(x)`, `torch.tensor(x).mean()`, a mean over its items."""
    parent = ctx.parent(use)
    if isinstance(parent, cst.CompFor) and parent.iter is use:
        # `np.mean([x["acc"] for x in summ])`: a mean over the (gathered) list's items
        comp = ctx.parent(parent)
        if isinstance(comp, (cst.ListComp, cst.GeneratorExp)) and isinstance(ctx.parent(comp), cst.Arg):
            return _in_mean_call(ctx, ctx.parent(comp), name)
        return False
    if isinstance(parent, cst.Subscript) and _is_first_item(parent) and isinstance(ctx.parent(parent), cst.CompFor) \
            and ctx.parent(parent).iter is parent:
        return True  # `for metric in summ[0]`: the keys of one item, the same on every rank
    if not isinstance(parent, cst.Arg):
        return False
    return _in_mean_call(ctx, parent, name)


def _in_mean_call(ctx: Context, parent: cst.Arg, name: str) -> bool:
    """`parent` is the first and only argument of a mean (or a side of sum/len)."""
    call = ctx.parent(parent)
    if not isinstance(call, cst.Call) or call.args[0] is not parent:
        return False
    label = (dotted(call.func) or "").rsplit(".", 1)[-1]
    if label in MEAN_CALLS and len(call.args) == 1:
        return True
    if label in _TO_ARRAY:  # torch.tensor(losses).mean()
        attr = ctx.parent(call)
        return (isinstance(attr, cst.Attribute) and attr.attr.value in MEAN_CALLS
                and isinstance(ctx.parent(attr), cst.Call))
    if label in ("sum", "len") and len(call.args) == 1:
        return _sum_over_len(ctx, call, name)
    return False


def _is_first_item(node: cst.Subscript) -> bool:
    """`x[0]`."""
    if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
        return False
    value = node.slice[0].slice.value
    return isinstance(value, cst.Integer) and value.value == "0"


def _sum_over_len(ctx: Context, call: cst.Call, name: str) -> bool:
    """`call` (`sum(x)` or `len(x)`) is a side of `sum(x) / len(x)` (also `max(len(x), 1)`)."""
    node: cst.CSTNode = call
    parent = ctx.parent(node)
    if isinstance(parent, cst.Arg):  # max(len(x), 1)
        outer = ctx.parent(parent)
        if isinstance(outer, cst.Call) and dotted(outer.func) == "max":
            node, parent = outer, ctx.parent(outer)
    if not (isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Divide)):
        return False
    left, right = code(parent.left).replace(" ", ""), code(parent.right).replace(" ", "")
    return left == f"sum({name})" and right in (f"len({name})", f"max(len({name}),1)", f"max(1,len({name}))")


# --- dicts of running sums (`res["loss"] += loss.item() * n; res["counter"] += n`) ------------

@dataclass
class DictSums:
    """The entries of the dict `name` that a loop adds to with constant keys (`keys`, in source
    order), and whether one reduction right after the loop makes every later use right
    (`reducible`: each entry is read after the loop only in divisions of entries of the sum,
    `res["loss"] / res["counter"]`); `why` says what stands in the way otherwise."""

    name: str
    keys: List[str] = field(default_factory=list)
    reducible: bool = False
    used_after: bool = False
    reduced: bool = False  # a collective already follows the loop (a second run)
    why: str = ""
    # entries only ever incremented by a whole number (`state["itr"] += 1`): a count of steps,
    # the same on every rank where every rank runs as many (a training loop)
    counters: List[str] = field(default_factory=list)


def dict_sums(ctx: Context, loop: cst.For, name: str) -> DictSums:
    """What `loop` sums into the dict `name`: entries with constant string keys, the dict set to
    a dict literal before the loop (the summed entries to numbers) and not rebound in it, no
    other write to it in the loop, no `return`/`yield` in the loop, and no collective after it
    (a second run)."""
    out = DictSums(name)
    writes = []
    for node in ctx.within(loop.body, cst.AugAssign, cst.Assign, skip_defs=True):
        targets = [node.target] if isinstance(node, cst.AugAssign) else [t.target for t in node.targets]
        for t in targets:
            if isinstance(t, cst.Name) and t.value == name:
                out.why = "rebound in the loop"
                return out
            if isinstance(t, cst.Subscript) and isinstance(t.value, cst.Name) and t.value.value == name:
                writes.append((node, t))
    per_sample: Dict[str, bool] = {}
    counting: Dict[str, bool] = {}
    for node, target in writes:
        key = _constant_key(target)
        if not isinstance(node, cst.AugAssign) or not isinstance(node.operator, cst.AddAssign) or key is None:
            out.why = "written in other ways in the loop"
            return out
        if key not in out.keys:
            out.keys.append(key)
        per_sample[key] = per_sample.get(key, True) and bool(_PER_SAMPLE.search(code(node.value)))
        counting[key] = counting.get(key, True) and isinstance(node.value, cst.Integer)
    out.counters = [k for k in out.keys if counting[k]]
    events = events_after(ctx, loop, {name})[name]
    out.used_after = bool(events.uses or events.augs)
    found, value = initial_value(ctx, loop, name)
    if not found or not isinstance(value, cst.Dict):
        out.why = "not set to a dict literal before the loop"
        return out
    initial = {}
    for element in value.elements:
        if isinstance(element, cst.DictElement):
            key = string_value(element.key) if element.key is not None else None
            if key is not None:
                initial[key] = element.value
    if any(k not in initial or not is_number(initial[k]) for k in out.keys):
        out.why = "its summed entries do not start as numbers before the loop"
        return out
    if events.collective and events.uses:
        out.reduced = out.reducible = out.used_after  # a collective follows the loop (a second run)
        return out
    if ctx.within(loop.body, cst.Return, cst.Yield, skip_defs=True) or events.augs:
        out.why = "left early or changed after the loop"
        return out
    for use in events.uses:
        sub = ctx.parent(use)
        key = _constant_key(sub) if isinstance(sub, cst.Subscript) and sub.value is use else None
        if key is None:
            out.why = f"`{name}` is used whole after the loop"
            return out
        if key not in out.keys:
            continue  # an entry the loop does not sum (`res["epoch"]`)
        divisions = divisions_of(ctx, sub)
        if not divisions and per_sample[key]:
            continue  # a sum over samples shown as it is: the ranks' sum is the whole data's
        if not divisions or not all(_slots_closed(d, name, out.keys) for d in divisions):
            out.why = f"`{name}[{key!r}]` is read after the loop outside a division of the summed entries"
            return out
    out.reducible = out.used_after
    return out


# what a sum over a batch's samples adds (`loss.item() * x.size(0)`, `len(y)`, `(pred == y).sum()`),
# as opposed to one value per batch (`loss.item()`, `1`), whose sum over ranks is not the original's
_PER_SAMPLE = re.compile(r"size|len\(|shape|numel|\.sum\(|count")


def _constant_key(sub: cst.Subscript) -> Optional[str]:
    """`"loss"` for `d["loss"]`."""
    if len(sub.slice) != 1 or not isinstance(sub.slice[0].slice, cst.Index):
        return None
    return string_value(sub.slice[0].slice.value)


def _slots_closed(node: cst.CSTNode, name: str, keys: List[str]) -> bool:
    """Only entries `name[k]` for k in `keys`, numbers and max/min/float/int/abs/round of them."""
    if isinstance(node, cst.Subscript):
        return isinstance(node.value, cst.Name) and node.value.value == name and _constant_key(node) in keys
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    if isinstance(node, cst.BinaryOperation):
        return _slots_closed(node.left, name, keys) and _slots_closed(node.right, name, keys)
    if isinstance(node, cst.UnaryOperation):
        return _slots_closed(node.expression, name, keys)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value in _SAFE_FUNCS:
        return all(_slots_closed(a.value, name, keys) for a in node.args)
    return False

"""TM701 reduce-counts, TM702 gather-for-metrics: metrics over the whole dataset, not one shard.

After the migration every rank iterates its own shard of each loader, so counts and sums
accumulated in a loop are per rank. TM701 reduces them once after the loop (one collective for
all of them, on every rank); TM702 reports predictions collected into lists for metrics that
need every sample (AUC, F1, mAP), suggesting `tm.gather_for_metrics`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after
from torchmigrate.imports import dotted
from torchmigrate.nodes import code
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.collectives import is_collective
from torchmigrate.program.loaders import DATALOADERS, DIST_SAMPLERS, TQDM_CALLS, refs_at
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.scopes import names_in, scope_of
from torchmigrate.program.syntax import body_of, index_in, iter_nodes
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules._active import active
from torchmigrate.rules.data.plan import data_plan

_WRAPPERS = {"enumerate", "iter", "zip"}
_SAFE_FUNCS = {"max", "min", "float", "int", "abs", "round"}
_SAFE_METHODS = {"item", "float", "double", "cpu", "long"}


def _loader_name(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return "loader" in last or last in ("dl", "dls") or last.endswith("_dl") or last.startswith("dl_")


def loader_names(ctx: Context) -> Set[str]:
    """Dotted names assigned from `DataLoader(...)` (or a progress bar over a loader)."""
    def compute() -> Set[str]:
        names: Set[str] = set()
        for assign in analysis.facts(ctx).assigns:
            value = assign.value
            if not isinstance(value, cst.Call):
                continue
            resolved = ctx.resolve(value.func)
            if resolved in DATALOADERS or dotted(value.func) in ctx.program.loader_classes or (resolved in TQDM_CALLS and value.args and _iterates_loader(ctx, value.args[0].value, names)):
                for t in assign.targets:
                    d = dotted(t.target)
                    if d:
                        names.add(d)
        return names

    key = "tm_loader_names"
    if key not in ctx.facts:
        ctx.facts[key] = compute()
    return ctx.facts[key]  # type: ignore[return-value]


def _iterates_loader(ctx: Context, node: cst.BaseExpression, known: Optional[Set[str]] = None) -> bool:
    """`loader`, `self.val_loader`, `loaders["val"]`, `enumerate(loader)`, `tqdm(loader)`, `pbar`
    (bound to `tqdm(loader)`), a name bound to `DataLoader(...)`."""
    if isinstance(node, cst.Call):
        func = node.func
        resolved = ctx.resolve(func)
        if isinstance(func, cst.Name) and func.value in _WRAPPERS:
            args = [a.value for a in node.args if a.keyword is None and not a.star]
            if func.value != "zip":
                args = args[:1]
            return any(_iterates_loader(ctx, a, known) for a in args)
        if resolved in TQDM_CALLS and node.args and node.args[0].keyword is None:
            return _iterates_loader(ctx, node.args[0].value, known)
        return False
    if isinstance(node, cst.Subscript):
        node = node.value
    name = dotted(node)
    if name is None:
        return False
    if _loader_name(name):
        return True
    names = known if known is not None else loader_names(ctx)
    return name in names


def _numeric(node: cst.BaseExpression) -> bool:
    if isinstance(node, (cst.Integer, cst.Float)):
        return True
    return isinstance(node, cst.UnaryOperation) and isinstance(node.expression, (cst.Integer, cst.Float))


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
                if isinstance(target, cst.Name) and target.value == name:
                    found = (True, small.value)
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


_SPANNED = (cst.For, cst.Assign, cst.AnnAssign, cst.AugAssign)


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


def _binding(ctx: Context, name: cst.Name) -> Optional[cst.CSTNode]:
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
class _Events:
    uses: List[cst.Name] = field(default_factory=list)
    augs: List[cst.AugAssign] = field(default_factory=list)  # `x /= n`, `x += y` after the loop
    collective: bool = False


def events_after(ctx: Context, loop: cst.CSTNode, names: Set[str]) -> Dict[str, _Events]:
    """Reads of `names` after `loop` in the same function, each up to (and including) the
    name's next rebinding statement, and whether a collective runs in that stretch."""
    index = source_index(ctx)
    start = index.end[loop]
    scope = scope_of(ctx, loop)
    collectives = [o for o, c in index.collectives if o > start and scope_of(ctx, c) is scope]
    out = {}
    for name in names:
        ev = out[name] = _Events()
        stop = None
        for order, node in index.names(name):
            if order <= start or (stop is not None and order > stop):
                continue
            if scope_of(ctx, node) is not scope or not _is_load(ctx, node):
                continue
            binding = _binding(ctx, node)
            if binding is None:
                ev.uses.append(node)
            elif isinstance(binding, cst.AugAssign):
                ev.augs.append(binding)
            elif stop is None:
                stop = index.end.get(binding, order)
        ev.collective = any(o <= stop for o in collectives) if stop is not None else bool(collectives)
    return out


def _is_store(ctx: Context, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    return not isinstance(parent, (cst.Attribute, cst.Subscript, cst.SubscriptElement, cst.Index))


def _is_load(ctx: Context, name: cst.Name) -> bool:
    parent = ctx.parent(name)
    if isinstance(parent, cst.Attribute) and parent.attr is name:
        return False
    if isinstance(parent, cst.Arg) and parent.keyword is name:
        return False
    return True


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


_DIVISIONS = (cst.Divide, cst.FloorDivide)
_DIVISION_ASSIGNS = (cst.DivideAssign, cst.FloorDivideAssign, cst.MultiplyAssign)


@dataclass
class _Exact:
    """`len(...)` denominators that stay exact after a reduction, from the loop's loaders."""

    dataset: Set[str] = field(default_factory=set)  # len(X) = whole dataset, loader unpadded (tm.eval_sampler)
    batches: Set[str] = field(default_factory=set)  # len(X) = per-rank batch count, equal on every rank


def _classify(left: cst.CSTNode, right: cst.CSTNode, whole: cst.CSTNode, group: Set[str], exact: _Exact) -> Optional[str]:
    """How a division involving accumulators stays right after reducing: "sum" (reduce with a
    sum), "mean" (`x / len(loader)`: average over ranks), or None (foreign denominator)."""
    if _closed(whole, group) or (exact.dataset and _closed(whole, group, exact.dataset)):
        return "sum"
    if exact.batches and _closed(left, group) and isinstance(right, cst.Call) and _closed(right, set(), exact.batches):
        return "mean"
    return None


def _divisions_of(ctx: Context, use: cst.Name) -> List[cst.BinaryOperation]:
    out = []
    for anc in ctx.ancestors(use):
        if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            break
        if isinstance(anc, cst.BinaryOperation) and isinstance(anc.operator, _DIVISIONS):
            out.append(anc)
    return out


def _loader_expr(ctx: Context, node: cst.BaseExpression) -> cst.BaseExpression:
    """`enumerate(tqdm(loader))` -> `loader`."""
    while isinstance(node, cst.Call) and node.args and node.args[0].keyword is None:
        func = node.func
        if (isinstance(func, cst.Name) and func.value in ("enumerate", "iter")) or ctx.resolve(func) in TQDM_CALLS:
            node = node.args[0].value
        else:
            break
    return node


def _sharding(ctx: Context, loader) -> Optional[str]:
    """"eval" (unpadded: every sample once), "distributed" (padded, equal batch counts) or None,
    for a loader of the loader facts, once this run's fixes are in (the data plan)."""
    decided = data_plan(ctx).of(loader)
    status, call = decided.status, loader.call
    if status == "plain":
        fixed = {f.code for f in ctx.findings if f.edits and f.node is call}
        if "TM203" in fixed and decided.sampler == "eval":
            return "eval"
        if "TM201" in fixed and decided.sampler == "distributed":
            return "distributed"
        return None
    if status == "distributed" and isinstance(call, cst.Call):
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "sampler" and isinstance(a.value, cst.Call):
                name = ctx.resolve(a.value.func)
                if name == RUNTIME + ".eval_sampler":
                    return "eval"
                if name in (RUNTIME + ".sampler", *DIST_SAMPLERS):
                    return "distributed"
        return "distributed" if decided.sampler == "distributed" else None
    return None


def exact_lens(ctx: Context, loop: cst.For) -> _Exact:
    out = _Exact()
    node = _loader_expr(ctx, loop.iter)
    try:  # the loader facts say which loaders an expression denotes, the data plan how they are sharded
        loaders = [l for r in refs_at(ctx, node) for l in r.loaders]
    except Exception:  # noqa: BLE001 - an optional refinement; without it denominators are reported
        return out
    if not loaders:
        return out
    kinds = {_sharding(ctx, l) for l in loaders}
    text = code(node).replace(" ", "")
    if kinds == {"eval"}:
        out.dataset.add(f"{text}.dataset")
        if len(loaders) == 1 and isinstance(loaders[0].dataset, (cst.Name, cst.Attribute)):
            out.dataset.add(code(loaders[0].dataset))
    elif kinds == {"distributed"}:
        out.batches.add(text)
    return out


class ReduceCounts(Rule):
    """
    ## What it does
    For a loop over a data loader that accumulates counts or sums into plain numbers
    (`correct += (pred == y).sum().item()`, `total += y.size(0)`,
    `total_loss += loss.item() * x.size(0)`, `n += len(y)`, `n_batches += 1`) which are used
    after the loop, inserts one reduction right after the loop:

        correct, total = tm.all_reduce(correct, total)

    Only accumulators set to a number before the loop (in the same pass of any enclosing loop)
    qualify, and only when every division they take part in after the loop stays right once
    they are reduced:

    - accumulators of the same loop (`correct / total`, `100.0 * correct / max(total, 1)`);
    - `len(loader.dataset)` / `len(val_ds)` when the loader is sharded without padding by
      `tm.eval_sampler` (TM203): the per-rank sums add up to exactly the whole dataset;
    - `len(loader)` when the loader has a padded distributed sampler (TM201 / an existing
      `DistributedSampler`): every rank runs the same number of batches, so the sum is averaged
      over the ranks instead, `running = tm.all_reduce(running, op="mean")`.

    Any other denominator (`len(loader.dataset)` of a padded training loader, `len(loader)` of an
    unpadded one, a loop index, a count from elsewhere) is reported instead, with the line to add.

    ## Why is this bad?
    Under DDP each rank iterates its own shard, so an accuracy computed from rank-local counts
    describes one shard, and rank 0 logs and checkpoints on it (Lightning-AI/pytorch-lightning#1479).
    One reduction after the loop (not one per batch) costs a single collective. It must run on
    every rank: a loop under a rank guard, or in a function called under one, is reported
    instead (a collective on one rank hangs the job).

    `tm.all_reduce` is the identity in a single process, so the script still runs as
    `python train.py`.
    """

    code = "TM701"
    name = "reduce-counts"
    summary = "Reduce metric counts accumulated over a sharded loader across ranks"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            def evaluate(model, val_loader):
                correct, total = 0, 0
                for x, y in val_loader:
                    pred = model(x).argmax(1)
                    correct += (pred == y).sum().item()
                    total += y.size(0)
                return correct / total
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def evaluate(model, val_loader):
                correct, total = 0, 0
                for x, y in val_loader:
                    pred = model(x).argmax(1)
                    correct += (pred == y).sum().item()
                    total += y.size(0)
                correct, total = tm.all_reduce(correct, total)
                return correct / total
            """,
        ),
        Example(
            before="""
            import torch
            def evaluate(model, val_loader):
                correct = 0
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                return correct / len(val_loader.dataset)
            """,
            after="""
            import torch
            def evaluate(model, val_loader):
                correct = 0
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                # TODO(torchmigrate): TM701 `correct` is a sum over this rank's shard but divided by `len(val_loader.dataset)`, the whole dataset: add `correct = tm.all_reduce(correct)` after the loop (exact when the loader is sharded with tm.eval_sampler), or count samples in the loop (`n += y.size(0)`), reduce the count too and divide by it
                return correct / len(val_loader.dataset)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.augs: List[cst.AugAssign] = []
        self.dict_augs: List[cst.AugAssign] = []  # `results['mse'] += ...`

    def _dict_sums(self) -> None:
        """`results['mse'] += batch_mse * n` in an evaluation loop over a loader (no backward in
        it): a dict of running sums over this rank's shard (SRGAN's `valing_results`). Which keys
        are sums and which are derived from them (PSNR from the summed MSE) is the user's to say,
        so it is reported once per dict and loop."""
        ctx = self.ctx
        seen: Set[Tuple[cst.CSTNode, str]] = set()
        for aug in self.dict_augs:
            loop = loader_loop(ctx, aug)
            name = aug.target.value.value
            if loop is None or (loop, name) in seen or analysis.runs_backward(ctx, loop):
                continue
            seen.add((loop, name))
            self.report(aug, f"`{name}[...]` sums values over this rank's shard of the loader only: reduce the summed "
                             f"entries across ranks after the loop (`{name}[k] = {ctx.tm}.all_reduce({name}[k])`) "
                             f"and compute what is derived from them (means, PSNR) afterwards",
                        statement=ctx.statement_of(loop))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, cst.AddAssign) and isinstance(node.target, cst.Name):
            self.augs.append(node)
        elif isinstance(node.operator, cst.AddAssign) and isinstance(node.target, cst.Subscript) \
                and isinstance(node.target.value, cst.Name):
            self.dict_augs.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        self._dict_sums()
        if not self.augs:
            return
        loops: Dict[cst.CSTNode, List[str]] = {}
        for aug in self.augs:
            loop = loader_loop(ctx, aug)
            if loop is None:
                continue
            names = loops.setdefault(loop, [])
            if aug.target.value not in names:
                names.append(aug.target.value)
        for loop, names in loops.items():
            self._loop(loop, names)

    def _loop(self, loop: cst.For, names: List[str]) -> None:
        ctx = self.ctx
        if ctx.within(loop.body, cst.Return, cst.Yield, skip_defs=True):
            return  # some ranks may leave the loop early and never reach a reduction after it
        candidates = []
        for name in names:
            found, value = initial_value(ctx, loop, name)
            if found and value is not None and _numeric(value) and not _reassigned_in(ctx, loop, name):
                candidates.append(name)
        if not candidates:
            return
        events = events_after(ctx, loop, set(candidates))
        group = set()
        for name in candidates:
            ev = events[name]
            if ev.collective or not ev.uses and not ev.augs:
                continue  # already reduced, or not used after the loop
            if any(isinstance(a.operator, (cst.AddAssign, cst.SubtractAssign)) for a in ev.augs):
                continue  # accumulated further after the loop: unclear where to reduce
            group.add(name)
        if not group:
            return
        exact = exact_lens(ctx, loop)
        foreign: Dict[str, cst.CSTNode] = {}
        kind: Dict[str, str] = {}
        changed = True
        while changed:
            changed = False
            kind = {}
            for name in sorted(group):
                ev = events[name]
                kinds: Set[Optional[str]] = set()
                bad = None
                for a in ev.augs:
                    if isinstance(a.operator, _DIVISION_ASSIGNS):
                        k = _classify(a.target, a.value, a.value, group, exact) if not isinstance(a.operator, cst.MultiplyAssign) \
                            else ("sum" if _closed(a.value, group) else None)
                        kinds.add(k)
                        if k is None and bad is None:
                            bad = a
                for use in ev.uses:
                    divisions = _divisions_of(ctx, use)
                    if not divisions:
                        kinds.add("plain")
                    for d in divisions:
                        k = _classify(d.left, d.right, d, group, exact)
                        kinds.add(k)
                        if k is None and bad is None:
                            bad = d
                if bad is None and "mean" in kinds and kinds != {"mean"}:
                    bad = next((d for use in ev.uses for d in _divisions_of(ctx, use)), None) or ev.uses[0]
                if bad is not None:
                    foreign[name] = bad
                    group.discard(name)
                    changed = True
                else:
                    kind[name] = "mean" if kinds == {"mean"} else "sum"
        tm = ctx.tm
        ordered = [n for n in names if n in group]
        if ordered:
            sums = [n for n in ordered if kind.get(n) != "mean"]
            means = [n for n in ordered if kind.get(n) == "mean"]
            depth = sum(1 for a in ctx.ancestors(loop) if isinstance(a, cst.IndentedBlock)) * 4
            lines, statements = [], []
            if sums:
                lines.append(_reduce_line(tm, sums, "", depth))
                statements.append(_reduce_statement(tm, sums, False, depth))
            if means:
                lines.append(_reduce_line(tm, means, ', op="mean"', depth))
                statements.append(_reduce_statement(tm, means, True, depth))
            guard = collective_guard(ctx, loop)
            listed = ", ".join(f"`{n}`" for n in ordered)
            one = len(ordered) == 1
            if guard is not None:
                self.report(loop, f"{listed} {'counts' if one else 'count'} only this rank's shard, but this loop "
                                  f"runs under a rank guard, where a reduction would hang the other ranks: evaluate "
                                  f"on every rank and add `{'; '.join(lines)}` after the loop",
                            statement=ctx.statement_of(loop))
            else:
                self.report(loop, f"{listed} {'counts' if one else 'count'} only this rank's shard; reduce "
                                  f"{'it' if one else 'them'} across ranks after the loop",
                            edits=[insert_after(loop, statements)],
                            imports=[ctx.runtime_import()])
        bad_names = [n for n in names if n in foreign]
        if bad_names:
            first = foreign[bad_names[0]]
            self.report(first, _manual_message(tm, bad_names, _denominator(first), padded=bool(exact.batches)))


def _reduce_line(tm: str, names: List[str], extra: str, indent: int) -> str:
    """`a, b = tm.all_reduce(a, b)` as text (for messages)."""
    joined = ", ".join(names)
    return f"{joined} = {tm}.all_reduce({joined}{extra})"


_COMMA = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def _reduce_statement(tm: str, names: List[str], mean: bool, indent: int) -> cst.SimpleStatementLine:
    """`a, b = tm.all_reduce(a, b)` (built directly: parsing costs ~10 ms), broken after the
    parenthesis when the line would pass 100 columns."""
    if len(names) == 1:
        target: cst.BaseExpression = cst.Name(names[0])
    else:
        target = cst.Tuple([cst.Element(cst.Name(n), comma=_COMMA if i < len(names) - 1 else cst.MaybeSentinel.DEFAULT)
                            for i, n in enumerate(names)], lpar=[], rpar=[])
    args = [cst.Arg(cst.Name(n), comma=_COMMA if i < len(names) - 1 or mean else cst.MaybeSentinel.DEFAULT)
            for i, n in enumerate(names)]
    if mean:
        args.append(cst.Arg(cst.SimpleString('"mean"'), keyword=cst.Name("op"),
                            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                                  whitespace_after=cst.SimpleWhitespace(""))))
    call = cst.Call(cst.Attribute(cst.Name(tm), cst.Name("all_reduce")), args)
    if indent + len(_reduce_line(tm, names, ', op="mean"' if mean else "", 0)) > 100:
        call = call.with_changes(whitespace_before_args=cst.ParenthesizedWhitespace(
            first_line=cst.TrailingWhitespace(), empty_lines=[], indent=True,
            last_line=cst.SimpleWhitespace("    ")))
    return cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(target)], call)])


def _manual_message(tm: str, names: List[str], den: str, padded: bool = False) -> str:
    listed = ", ".join(f"`{n}`" for n in names)
    joined = ", ".join(names)
    one = len(names) == 1
    compact = den.replace(" ", "")
    if compact.startswith("len(") and compact.endswith(".dataset)") or re.match(r"len\(\w*(ds|dataset|data|set)\)$", compact):
        return (f"{listed} {'is a sum' if one else 'are sums'} over this rank's shard but divided by `{den}`, "
                f"the whole dataset: add `{joined} = {tm}.all_reduce({joined})` after the loop "
                + ("(approximate: the training sampler pads the shards with a few repeated samples)" if padded else
                   f"(exact when the loader is sharded with {tm}.eval_sampler)")
                + ", or count samples in the loop (`n += y.size(0)`), reduce the count too and divide by it")
    if compact.startswith("len(") and _loader_name(compact[4:-1]):
        mean = ", ".join(names)
        return (f"{listed} {'sums' if one else 'sum'} per-batch values over this rank's batches but "
                f"{'is' if one else 'are'} divided by `{den}`, this rank's batch count: add "
                f"`{mean} = {tm}.all_reduce({mean}, op=\"mean\")` after the loop to average over the ranks "
                f"(their batch counts are equal with a DistributedSampler)")
    return (f"{listed} {'is a sum' if one else 'are sums'} over this rank's shard but divided by `{den}`: "
            f"reduce {'it' if one else 'them'} after the loop (`{joined} = {tm}.all_reduce({joined})`) "
            f"together with a count accumulated in the loop, and divide by the reduced count")


def loader_loop(ctx: Context, node: cst.CSTNode) -> Optional[cst.For]:
    """The nearest enclosing `for` over a data loader, within the same function."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        if isinstance(anc, cst.For) and _iterates_loader(ctx, anc.iter):
            return anc
    return None


def _reassigned_in(ctx: Context, loop: cst.CSTNode, name: str) -> bool:
    """`name` is bound by something other than `name += ...` inside the loop."""
    index = source_index(ctx)
    begin, end = index.start[loop], index.end[loop]
    for order, node in index.names(name):
        if begin < order <= end and _is_load(ctx, node):
            binding = _binding(ctx, node)
            if binding is not None and not isinstance(binding, cst.AugAssign):
                return True
    return False


def _denominator(node: cst.CSTNode) -> str:
    if isinstance(node, cst.BinaryOperation):
        return code(node.right)
    if isinstance(node, cst.AugAssign):
        return code(node.value)
    return code(node)


# --- TM702 ---------------------------------------------------------------------------------

_METRIC_TOKENS = {"auc", "roc", "auroc", "auprc", "f1", "fbeta", "mcc", "map", "iou", "miou", "wer", "cer", "r2",
                  "ap", "dice", "bleu", "rouge", "kappa", "ndcg", "mrr", "acc"}
_METRIC_WORDS = ("precision", "recall", "confusion", "matthews", "accuracy", "score", "metric", "pearson",
                 "spearman", "corrcoef", "evaluat")
_METRIC_MODULES = ("sklearn.metrics", "torchmetrics.functional", "scipy.stats", "pycocotools", "evaluate.")
_NOT_METRICS = {"print", "len", "sum", "max", "min", "str", "float", "int", "list", "sorted", "map", "zip",
                "enumerate", "range", "round", "abs"}
_GATHERS = ("gather_for_metrics", "all_gather", "all_gather_object", "gather", "gather_object")


def _is_metric_call(ctx: Context, call: cst.Call) -> Optional[str]:
    name = ctx.resolve(call.func) or dotted(call.func)
    if not name:
        return None
    last = name.rsplit(".", 1)[-1]
    if last in _NOT_METRICS:
        return None
    lower = last.lower()
    if name.startswith(_METRIC_MODULES) or set(lower.split("_")) & _METRIC_TOKENS or any(w in lower for w in _METRIC_WORDS):
        return last
    return None


class GatherForMetrics(Rule):
    """
    ## What it does
    Reports predictions and targets collected into lists over a data loader
    (`preds.append(...)`, `torch.cat(all_preds)`) that feed a metric needing every sample: sklearn
    metrics (`roc_auc_score`, `f1_score`, `average_precision_score`, ...), torchmetrics
    functionals, or a helper of this file named like a metric (`roc_auc`, `compute_map`). The
    suggested fix gathers them from every rank first:

        preds = tm.gather_for_metrics(torch.cat(all_preds), len(val_ds))

    ## Why is this bad?
    Under DDP each rank predicts only its shard, so a ranking or F1 metric computed from the
    lists is a metric of one shard. Sums can be reduced (TM701) but AUC, F1 or mAP cannot: they
    need all predictions. `tm.gather_for_metrics` all-gathers them in dataset order (for
    `tm.eval_sampler` loaders) and drops sampler padding given the dataset length, like
    Accelerate's `gather_for_metrics`. It must run on every rank.

    ## Limitations
    Report only: where the gathered tensors go (a metric on every rank, or on rank 0) is a choice
    for the script's author.
    """

    code = "TM702"
    name = "gather-for-metrics"
    summary = "Gather per-rank predictions before dataset-level metrics (AUC, F1, mAP)"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from sklearn.metrics import roc_auc_score
            preds, labels = [], []
            for x, y in val_loader:
                preds.append(model(x).sigmoid())
                labels.append(y)
            auc = roc_auc_score(torch.cat(labels), torch.cat(preds))
            """,
            after="""
            import torch
            from sklearn.metrics import roc_auc_score
            preds, labels = [], []
            for x, y in val_loader:
                preds.append(model(x).sigmoid())
                labels.append(y)
            # TODO(torchmigrate): TM702 `labels`, `preds` hold this rank's predictions only, and `roc_auc_score` needs all of them: gather each list on every rank first, e.g. `labels = tm.gather_for_metrics(torch.cat(labels), len(val_loader.dataset))` (it takes tensors and returns them in dataset order)
            auc = roc_auc_score(torch.cat(labels), torch.cat(preds))
            """,
        ),
    )

    def _appends(self) -> List[Tuple[cst.CSTNode, str]]:
        """`name.append(...)` / `name.extend(...)` calls and `name += ...` statements, with the
        list's name, in source order. Picked at the end from the file's recorded calls and the
        node index rather than by a callback for each of the file's calls (exact type tests:
        none of these classes has subclasses); the few found are then merged by position."""
        ctx = self.ctx
        appends: List[Tuple[cst.CSTNode, str]] = []
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if type(func) is cst.Attribute and func.attr.value in ("append", "extend") and type(func.value) is cst.Name:
                appends.append((call, func.value.value))
        augs = [(node, node.target.value) for node in ctx.nodes(cst.AugAssign)
                if type(node.operator) is cst.AddAssign and type(node.target) is cst.Name]
        if appends and augs:
            return sorted(appends + augs, key=lambda found: ctx.position(found[0]))
        return appends or augs

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        appends = self._appends()
        if not appends:
            return
        loops: Dict[cst.CSTNode, List[str]] = {}
        for n, name in appends:
            loop = loader_loop(ctx, n)
            if loop is not None and name not in loops.setdefault(loop, []):
                loops[loop].append(name)
        reported: Set[cst.CSTNode] = set()
        for loop, names in loops.items():
            lists = [n for n in names if _list_init(ctx, loop, n)]
            if lists:
                self._check(loop, lists, reported)

    def _check(self, loop: cst.For, lists: List[str], reported: Set[cst.CSTNode]) -> None:
        ctx = self.ctx
        index = source_index(ctx)
        begin = index.end[loop]
        scope = scope_of(ctx, loop)
        for order, call in index.calls:
            if order > begin:
                name = index.resolved.get(id(call)) or dotted(call.func) or ""
                if name.rsplit(".", 1)[-1] in _GATHERS and scope_of(ctx, call) is scope:
                    return  # already gathered
        origin: Dict[str, str] = {n: n for n in lists}
        since: Dict[str, int] = {n: begin for n in lists}
        work = list(lists)
        metric_calls: List[Tuple[cst.Call, str, Set[str]]] = []
        seen_calls: Set[cst.Call] = set()
        while work:
            name = work.pop(0)
            for order, node in index.names(name):
                if order <= since[name] or scope_of(ctx, node) is not scope or _binding(ctx, node) is not None:
                    continue
                for anc in ctx.ancestors(node):
                    if isinstance(anc, cst.Call) and anc not in seen_calls:
                        metric = _is_metric_call(ctx, anc)
                        if metric:
                            seen_calls.add(anc)
                            used = names_in(ctx, anc) & set(origin)
                            metric_calls.append((anc, metric, used))
                    elif isinstance(anc, cst.Assign):
                        for t in anc.targets:
                            for el in iter_nodes(t.target):
                                if isinstance(el, cst.Name) and _is_store(ctx, el) and el.value not in origin:
                                    origin[el.value] = origin[name]
                                    since[el.value] = index.end[anc]
                                    work.append(el.value)
                        break
                    if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                        break
        metric_calls.sort(key=lambda item: index_order(index, item[0]))
        if not metric_calls:
            return
        size = _dataset_len(ctx, loop)
        tm = ctx.tm
        call = metric_calls[0][0]
        if ctx.statement_of(call) in reported:
            return
        reported.add(ctx.statement_of(call))
        metrics = []
        sources: Set[str] = set()
        for _, metric, used in metric_calls:
            if metric not in metrics:
                metrics.append(metric)
            sources |= {origin[u] for u in used}
        ordered = sorted(sources)
        listed = ", ".join(f"`{s}`" for s in ordered)
        first = ordered[0]
        one = len(ordered) == 1
        self.report(call, f"{listed} hold{'s' if one else ''} this rank's predictions only, and "
                          f"{', '.join(f'`{m}`' for m in metrics)} need{'s' if len(metrics) == 1 else ''} all of "
                          f"them: gather {'it' if one else 'each list'} on every rank first, e.g. "
                          f"`{first} = {tm}.gather_for_metrics(torch.cat({first}), {size})` "
                          f"(it takes tensors and returns them in dataset order)")


def index_order(index: SourceIndex, call: cst.Call) -> int:
    cache = index.__dict__.setdefault("call_order", None)
    if cache is None:
        cache = index.__dict__["call_order"] = {c: o for o, c in index.calls}
    return cache.get(call, 0)


def _list_init(ctx: Context, loop: cst.CSTNode, name: str) -> bool:
    found, value = initial_value(ctx, loop, name)
    return found and value is not None and _empty_list(value)


def _dataset_len(ctx: Context, loop: cst.For) -> str:
    """`len(val_ds)` when the loop's loader is built from a known dataset, else `len(loader.dataset)`."""
    it = loop.iter
    while isinstance(it, cst.Call) and it.args:
        it = it.args[0].value
    name = dotted(it)
    if name is None:
        return "len(dataset)"
    for assign in analysis.facts(ctx).assigns:
        if not isinstance(assign.value, cst.Call) or ctx.resolve(assign.value.func) not in DATALOADERS:
            continue
        if any(dotted(t.target) == name for t in assign.targets):
            first = assign.value.args[0] if assign.value.args else None
            if first is not None and (first.keyword is None or first.keyword.value == "dataset"):
                return f"len({code(first.value)})"
    return f"len({name}.dataset)"


# Calls that turn a list into its mean: the result is the same whichever rank's values it holds,
# so gathering every rank's values into it is right whether or not the loader was sharded.
_MEAN_CALLS = frozenset({"mean", "fmean", "average", "nanmean"})
_TO_ARRAY = frozenset({"tensor", "as_tensor", "stack", "array", "asarray", "Tensor", "FloatTensor"})
# `AverageMeter()`, `RunningAverage()`, `LossTracker()`: objects that keep a running sum and count
_METER = re.compile(r"(?i)(meter|average|avg|tracker|accumulator)$")


class GatherListMean(Rule):
    """
    ## What it does
    For a list filled with one value per batch in a loop over a data loader (`losses = []`,
    `losses.append(loss.item())`) whose every use after the loop is its mean —
    `sum(losses) / len(losses)`, `np.mean(losses)`, `statistics.mean(losses)`,
    `torch.tensor(losses).mean()` — inserts right after the loop:

        losses = tm.gather_list(losses)

    which concatenates the lists of all ranks (rank order; identity in one process).

    A meter object built before the loop (`meter = AverageMeter()`, any class named like a
    meter, average or tracker) and updated in it (`meter.update(loss.item(), x.size(0))`) gets
    `tm.reduce_meter(meter)` after the loop: its `sum` and `count` are summed across ranks and
    its `avg` recomputed (a meter without those attributes is left as it is, on every rank).

    ## Why is this bad?
    Under DDP each rank iterates its own shard, so the mean of its list is the mean of one shard.
    Rank 0 logs it, and where it drives control flow (`scheduler.step(val_loss)` with
    ReduceLROnPlateau, early stopping, the best-checkpoint choice) the ranks decide differently:
    their learning rates, and then their parameters, drift apart with no error. A mean over the
    gathered values is the mean over every batch of every rank, and it is the same on every rank.
    Only means are rewritten (a mean over duplicated values is unchanged, so this is right even
    for a loader that turns out unsharded); a list used any other way is left alone.

    The gather must run on every rank: a loop under a rank guard is reported instead.
    """

    code = "TM703"
    name = "gather-list-mean"
    summary = "Gather per-batch values from every rank before taking their mean"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            @torch.no_grad()
            def validate(model, val_loader, criterion):
                losses = []
                for x, y in val_loader:
                    losses.append(criterion(model(x), y).item())
                return sum(losses) / len(losses)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            @torch.no_grad()
            def validate(model, val_loader, criterion):
                losses = []
                for x, y in val_loader:
                    losses.append(criterion(model(x), y).item())
                losses = tm.gather_list(losses)
                return sum(losses) / len(losses)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        loops: Dict[cst.CSTNode, List[str]] = {}
        meters: Dict[cst.CSTNode, List[str]] = {}
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if type(func) is cst.Attribute and func.attr.value in ("append", "update") and type(func.value) is cst.Name:
                loop = loader_loop(ctx, call)
                found = (loops if func.attr.value == "append" else meters).setdefault(loop, []) if loop else None
                if found is not None and func.value.value not in found:
                    found.append(func.value.value)
        for loop, names in meters.items():
            if not _leaves_early(ctx, loop):
                self._meters(loop, names)
        for loop, names in loops.items():
            lists = [n for n in names if _list_init(ctx, loop, n) and not _reassigned_in(ctx, loop, n)
                     and self._means_only(loop, n)]
            if not lists or _leaves_early(ctx, loop):
                continue
            listed = ", ".join(f"`{n}`" for n in lists)
            self._after_loop(loop, [f"{n} = {ctx.tm}.gather_list({n})" for n in lists],
                             f"{listed} {'holds' if len(lists) == 1 else 'hold'} this rank's values only, but this "
                             "loop runs under a rank guard, where a gather would hang the other ranks",
                             f"the mean of {listed} covers this rank's batches only; gather every rank's values first")

    def _after_loop(self, loop: cst.For, lines: List[str], guarded: str, message: str) -> None:
        """Insert `lines` (collectives) right after `loop`, or, where a rank guard would keep some
        ranks from them and hang the others, say `guarded` and what to add."""
        ctx = self.ctx
        if collective_guard(ctx, loop) is not None:
            self.report(loop, f"{guarded}: evaluate on every rank and add `{'; '.join(lines)}` after the loop",
                        statement=ctx.statement_of(loop))
            return
        self.report(loop, message, edits=[insert_after(loop, [cst.parse_statement(line + "\n") for line in lines])],
                    imports=[ctx.runtime_import()])

    def _meters(self, loop: cst.For, names: List[str]) -> None:
        ctx = self.ctx
        found = []
        for name in names:
            ok, value = initial_value(ctx, loop, name)
            label = (dotted(value.func) or "").rsplit(".", 1)[-1] if ok and isinstance(value, cst.Call) else ""
            if _METER.search(label) and not _reassigned_in(ctx, loop, name) and self._read_after(loop, name) \
                    and not self._fed_reduced(loop, name):
                found.append(name)
        if not found or self._reduced_after(loop, found):
            return
        listed = ", ".join(f"`{n}`" for n in found)
        averages = f"{listed} average{'s' if len(found) == 1 else ''} this rank's batches only"
        self._after_loop(loop, [f"{ctx.tm}.reduce_meter({n})" for n in found],
                         f"{averages}, but this loop runs under a rank guard, where a reduction would hang the "
                         "other ranks",
                         f"{averages}; reduce {'its' if len(found) == 1 else 'their'} sum and count across ranks")

    def _fed_reduced(self, loop: cst.For, name: str) -> bool:
        """Every `name.update(v, ...)` of the loop gets a value already reduced across ranks
        (Swin's `acc1 = reduce_tensor(acc1)` before `acc1_meter.update(acc1.item(), n)`): the
        meter averages the whole batch of every rank already."""
        reduced: Set[str] = set()
        for a in self.ctx.within(loop, cst.Assign, skip_defs=True):
            last = (dotted(a.value.func) or "").rsplit(".", 1)[-1].lower() if isinstance(a.value, cst.Call) else ""
            if "reduce" in last or "gather" in last:
                reduced |= {dotted(t.target) for t in a.targets} - {None}
        updates = [c for c in self.ctx.within(loop, cst.Call, skip_defs=True)
                   if isinstance(c.func, cst.Attribute) and c.func.attr.value == "update" and dotted(c.func.value) == name]
        for call in updates:
            value = call.args[0].value if call.args else None
            while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and not value.args:
                value = value.func.value  # `acc1.item()`, `loss.mean()`
            if value is None or dotted(value) not in reduced:
                return False
        return bool(updates)

    def _read_after(self, loop: cst.For, name: str) -> bool:
        ctx = self.ctx
        index = source_index(ctx)
        begin, scope = index.end[loop], scope_of(ctx, loop)
        return any(order > begin and scope_of(ctx, n) is scope and _is_load(ctx, n) for order, n in index.names(name))

    def _reduced_after(self, loop: cst.For, names: List[str]) -> bool:
        """`tm.reduce_meter(meter)` already follows the loop (a second run)."""
        nxt = _next_sibling(self.ctx, loop)
        return nxt is not None and "reduce_meter(" in code(nxt) and any(n in code(nxt) for n in names)

    def _means_only(self, loop: cst.For, name: str) -> bool:
        """Every use of `name` after `loop` (in its scope, before a rebinding) is inside a mean."""
        ctx = self.ctx
        index = source_index(ctx)
        begin = index.end[loop]
        scope = scope_of(ctx, loop)
        uses = 0
        for order, n in index.names(name):
            if order <= begin or scope_of(ctx, n) is not scope or not _is_load(ctx, n):
                continue
            if _binding(ctx, n) is not None:
                continue  # `losses = np.mean(losses)`: the target; its value's uses are checked
            if not self._in_mean(n, name):
                return False
            uses += 1
            statement = ctx.statement_of(n)
            if any(_binding(ctx, t) is not None for t in ctx.within(statement, cst.Name) if t.value == name):
                break  # rebound here: later uses are of the mean, not the list
        return uses > 0

    def _in_mean(self, use: cst.Name, name: str) -> bool:
        ctx = self.ctx
        parent = ctx.parent(use)
        if isinstance(parent, cst.CompFor) and parent.iter is use:
            # `np.mean([x["acc"] for x in summ])`: a mean over the (gathered) list's items
            comp = ctx.parent(parent)
            if isinstance(comp, (cst.ListComp, cst.GeneratorExp)) and isinstance(ctx.parent(comp), cst.Arg):
                return self._in_mean_call(ctx.parent(comp), name)
            return False
        if isinstance(parent, cst.Subscript) and _is_first_item(parent) and isinstance(ctx.parent(parent), cst.CompFor) \
                and ctx.parent(parent).iter is parent:
            return True  # `for metric in summ[0]`: the keys of one item, the same on every rank
        if not isinstance(parent, cst.Arg):
            return False
        return self._in_mean_call(parent, name)

    def _in_mean_call(self, parent: cst.Arg, name: str) -> bool:
        """`parent` is the first and only argument of a mean (or a side of sum/len)."""
        ctx = self.ctx
        call = ctx.parent(parent)
        if not isinstance(call, cst.Call) or call.args[0] is not parent:
            return False
        label = (dotted(call.func) or "").rsplit(".", 1)[-1]
        if label in _MEAN_CALLS and len(call.args) == 1:
            return True
        if label in _TO_ARRAY:  # torch.tensor(losses).mean()
            attr = ctx.parent(call)
            return (isinstance(attr, cst.Attribute) and attr.attr.value in _MEAN_CALLS
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


def _leaves_early(ctx: Context, loop: cst.For) -> bool:
    """A `return`, `yield` or `break` in the loop: ranks may leave it at different points and
    never all reach a collective after it."""
    return bool(ctx.within(loop.body, cst.Return, cst.Yield, cst.Break, skip_defs=True))


def _next_sibling(ctx: Context, statement: cst.CSTNode) -> Optional[cst.CSTNode]:
    body = body_of(ctx.parent(statement))
    if body is None:
        return None
    i = index_in(body, statement)
    return body[i + 1] if i is not None and i + 1 < len(body) else None


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

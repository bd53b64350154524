"""TM702 gather-for-metrics: predictions collected per rank that feed a metric needing every sample."""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.loaders import DATALOADERS
from torchmigrate.program.metrics import (binding_of, is_store, loader_expr, loader_loop, metric_name, source_index,
                                          starts_empty_list)
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.program.scopes import names_in, scope_of
from torchmigrate.program.syntax import iter_nodes
from torchmigrate.rules._active import active
from torchmigrate.rules.metrics.plan import gathered_for_mean, loop_sharding


_GATHERS = ("gather_for_metrics", "gather_list", "all_gather", "all_gather_object", "gather", "gather_object")


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

    A loop over a loader every rank iterates in full (an evaluation loader TM203 keeps whole)
    already holds every prediction on every rank: nothing is reported. Where only the run can
    tell (a loader handed in from another module), the suggested gather takes the loader,
    `over=loader`, and leaves the predictions as they are where it is not sharded.

    In a migration (`ddp`), where the lists and what is computed from them go nowhere but into
    such metrics (whose data arguments all come from the lists), `print` and `len`, they are
    gathered right after the loop, every list the metrics read, in rank order, so each
    prediction stays beside its target:

        preds = tm.gather_list(preds)
        labels = tm.gather_list(labels)

    (`over=loader` where only the run can tell whether the loader is sharded). The metric is then
    the whole set's, the same on every rank, as in one process (a training loader's sampler
    may repeat a few samples to even out the ranks' shares).

    ## Limitations
    Lists that also go elsewhere (written to a file in their own order, paired with the
    dataset's labels, returned) are only reported: where the gathered tensors go, and in which
    order, is a choice for the script's author.
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
            import torchmigrate.runtime as tm
            preds, labels = [], []
            for x, y in val_loader:
                preds.append(model(x).sigmoid())
                labels.append(y)
            preds = tm.gather_list(preds, over=val_loader)
            labels = tm.gather_list(labels, over=val_loader)
            auc = roc_auc_score(torch.cat(labels), torch.cat(preds))
            """,
        ),
        Example(
            before="""
            import torch
            from sklearn.metrics import roc_auc_score
            preds, labels = [], []
            for x, y in val_loader:
                preds.append(model(x).sigmoid())
                labels.append(y)
            auc = roc_auc_score(torch.cat(labels), torch.cat(preds))
            torch.save(torch.cat(preds), "preds.pt")
            """,
            after="""
            import torch
            from sklearn.metrics import roc_auc_score
            preds, labels = [], []
            for x, y in val_loader:
                preds.append(model(x).sigmoid())
                labels.append(y)
            # TODO(torchmigrate): TM702 `labels`, `preds` hold this rank's predictions only when `val_loader` is sharded, and `roc_auc_score` needs all of them: gather each list on every rank first, e.g. `labels = tm.gather_for_metrics(torch.cat(labels), len(val_loader.dataset), over=val_loader)` (it takes tensors and returns them in dataset order; unchanged where the loader is not sharded)
            auc = roc_auc_score(torch.cat(labels), torch.cat(preds))
            torch.save(torch.cat(preds), "preds.pt")
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
            lists = [n for n in names if starts_empty_list(ctx, loop, n)]
            if lists:
                self._check(loop, lists, reported)

    def _only_metrics(self, loop: cst.For, index, scope, origin: Dict[str, str], since: Dict[str, int],
                      metric_calls: List[Tuple[cst.Call, str, Set[str]]]) -> bool:
        """Whether gathering every list the loop collected keeps the program's meaning: the lists,
        and what is computed from them after the loop, go into the metrics (whose data arguments
        all come from the lists, so each prediction stays beside its target), into values computed
        from them (a loss averaged over the masks), `print`/`len`, tests and the function's
        return, and never meet a count this rank kept for itself (`sum(losses) / n` with `n += len(y)`:
        TM701's), nor a call that could write them out or pair them with the dataset's own order."""
        ctx = self.ctx
        metric_nodes = {c for c, _, _ in metric_calls}
        for metric in metric_nodes:
            for a in metric.args:
                if a.keyword is None and any(n not in origin and ctx.resolve(cst.Name(n)) is None
                                             for n in self._data_names(a.value)):
                    return False
        counters = {a.target.value for a in ctx.within(loop, cst.AugAssign)
                    if isinstance(a.target, cst.Name) and a.target.value not in origin}
        for name in origin:
            for order, node in index.names(name):
                if order <= since[name] or scope_of(ctx, node) is not scope or binding_of(ctx, node) is not None:
                    continue
                for anc in ctx.ancestors(node):
                    if isinstance(anc, cst.BinaryOperation) and names_in(ctx, anc) & counters:
                        return False
                    if isinstance(anc, cst.Assign):
                        if not all(isinstance(t.target, (cst.Name, cst.Tuple, cst.List)) for t in anc.targets):
                            return False  # kept in an object or a container: it may go anywhere
                        break
                    if anc in metric_nodes or isinstance(anc, (cst.Return, cst.Comparison, cst.If)):
                        break
                    if isinstance(anc, cst.Call) and not self._pure(anc):
                        return False
                    if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                        break
        return True

    def _data_names(self, node: cst.CSTNode) -> Set[str]:
        """The variables `node` reads values from: not attribute names (`torch.cat`'s `cat`), not
        the functions it calls by name (`list(preds)`'s `list`)."""
        ctx = self.ctx
        out = set()
        for name in ctx.within(node, cst.Name):
            parent = ctx.parent(name)
            if (isinstance(parent, cst.Attribute) and parent.attr is name) or (
                    isinstance(parent, cst.Call) and parent.func is name):
                continue
            out.add(name.value)
        return out

    def _pure(self, call: cst.Call) -> bool:
        """A call that computes from its arguments without sending them anywhere: a metric, `print`,
        `len`, the builtins and numpy/torch array functions (`np.concatenate`, `torch.cat`,
        `np.sum`, `round`), methods of the values (`.tolist()`, `.numpy()`)."""
        if metric_name(self.ctx, call):
            return True
        if isinstance(call.func, cst.Attribute) and not (self.ctx.resolve(call.func) or ""):
            return call.func.attr.value not in _SENDS
        name = self.ctx.resolve(call.func) or dotted(call.func) or ""
        return name in _PURE_BUILTINS or name.split(".")[0] in ("numpy", "torch") and not name.startswith(_WRITERS)

    def _check(self, loop: cst.For, lists: List[str], reported: Set[cst.CSTNode]) -> None:
        ctx = self.ctx
        sharding = loop_sharding(ctx, loop)
        if sharding == "whole":
            return  # every rank predicts the whole set: the metric is the whole set's already
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
                if order <= since[name] or scope_of(ctx, node) is not scope or binding_of(ctx, node) is not None:
                    continue
                for anc in ctx.ancestors(node):
                    if isinstance(anc, cst.Call) and anc not in seen_calls:
                        metric = metric_name(ctx, anc)
                        if metric:
                            seen_calls.add(anc)
                            used = names_in(ctx, anc) & set(origin)
                            metric_calls.append((anc, metric, used))
                    elif isinstance(anc, cst.Assign):
                        for t in anc.targets:
                            for el in iter_nodes(t.target):
                                if isinstance(el, cst.Name) and is_store(ctx, el) and el.value not in origin:
                                    origin[el.value] = origin[name]
                                    since[el.value] = index.end[anc]
                                    work.append(el.value)
                        break
                    if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                        break
        metric_calls.sort(key=lambda item: index.order_of(item[0]))
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
        loader = code(loader_expr(ctx, loop.iter))
        when = f" when `{loader}` is sharded" if sharding == "unknown" else ""
        over = f", over={loader}" if sharding == "unknown" else ""
        if ctx.options.mode == "ddp" and collective_guard(ctx, loop) is None \
                and self._only_metrics(loop, index, scope, origin, since, metric_calls):
            lines = [cst.parse_statement(f"{s} = {tm}.gather_list({s}{over})") for s in lists
                     if not ("TM703" in ctx.enabled and gathered_for_mean(ctx, loop, s))]  # (TM703's)
            self.report(call, f"{listed} hold{'s' if one else ''} this rank's predictions only{when}, and "
                              f"{', '.join(f'`{m}`' for m in metrics)} need{'s' if len(metrics) == 1 else ''} all of "
                              f"them: {'it is' if one else 'they are'} gathered from every rank after the loop "
                              "(the metric is the whole set's, the same on every rank)",
                        edits=[insert_after(loop, lines)], imports=[ctx.runtime_import()], safety=Safety.SAFE)
            return
        self.report(call, f"{listed} hold{'s' if one else ''} this rank's predictions only{when}, and "
                          f"{', '.join(f'`{m}`' for m in metrics)} need{'s' if len(metrics) == 1 else ''} all of "
                          f"them: gather {'it' if one else 'each list'} on every rank first, e.g. "
                          f"`{first} = {tm}.gather_for_metrics(torch.cat({first}), {size}{over})` "
                          f"(it takes tensors and returns them in dataset order"
                          + ("; unchanged where the loader is not sharded)" if over else ")"))


_PURE_BUILTINS = frozenset({"print", "len", "sum", "min", "max", "round", "float", "int", "list", "tuple", "sorted",
                            "abs", "str", "zip", "enumerate", "map"})
# methods that hand a value to something else (a file, a writer, a queue)
_SENDS = frozenset({"write", "writerow", "writerows", "dump", "save", "savetxt", "to_csv", "put", "send", "add_scalar",
                    "add_histogram", "log", "info", "append", "extend"})
_WRITERS = ("numpy.save", "numpy.savez", "numpy.savetxt", "torch.save")


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

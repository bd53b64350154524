"""TM104 symmetric-collectives: collectives and DDP forwards that run on some ranks only (under a
rank guard or in an `except` block) and hang the others."""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.ranks import opposite_polarity, rank_polarity
from torchmigrate.program.syntax import last_name
from torchmigrate.rule import Context, Example, Rule

COLLECTIVES = {
    f"torch.distributed.{n}" for n in (
        "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "_all_gather_base",
        "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
        "reduce", "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list",
        "all_to_all", "all_to_all_single", "new_group")
} | {f"{RUNTIME}.{n}" for n in ("all_reduce", "barrier", "gather_for_metrics", "wrap_model", "setup",
                                "main_process_first", "reduce_batch_total", "any_rank", "all_ranks")} | {
    "torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
}
# Helpers from other modules (detectron2's comm, DETR's utils, ...) that communicate.
_COLLECTIVE_HELPERS = {"synchronize", "barrier", "all_reduce", "all_gather", "reduce_dict", "reduce_tensor",
                       "all_reduce_mean", "reduce_mean", "reduce_loss_dict", "wait_for_everyone",
                       "gather_for_metrics", "broadcast_object", "all_gather_object", "reduce_value"}
_DDP_CONSTRUCTORS = ("torch.nn.parallel.DistributedDataParallel",
                     "torch.nn.parallel.distributed.DistributedDataParallel", RUNTIME + ".wrap_model")


class SymmetricCollectives(Rule):
    """
    ## What it does
    Reports collectives (`dist.all_reduce`, `barrier`, `all_gather`, `broadcast`, `reduce`,
    `tm.all_reduce`, `tm.barrier`, `tm.gather_for_metrics`, DDP construction, and helpers such
    as `comm.synchronize()`) and forward passes through a DDP-wrapped model that run only on
    some ranks: inside `if rank == 0:`, `if args.local_rank in [-1, 0]:`,
    `if dist.get_rank() == 0:`, `if tm.is_main():`, `if is_main_process():` (and their `else`
    branches), or inside `except` blocks. Calls to functions of the same file that run a
    collective or a DDP forward are reported too (one level deep).

    The common "rank 0 first" pattern, a `barrier()` under `if rank != 0:` matched by one
    under `if rank == 0:` (or in both branches of one `if`), is recognised and not reported.

    ## Why is this bad?
    A collective completes only when every rank calls it. When rank 0 alone calls
    `all_reduce` or `barrier` (or runs a DDP forward, which may broadcast buffers), the job
    hangs until the process-group timeout (10 minutes with NCCL by default) and then dies.
    The same happens when an exception is caught on one rank only. Evaluate on rank 0 with
    `tm.unwrap(model)`, or run the collective on every rank.

    ## Example
    ```python
    if rank == 0:
        dist.all_reduce(t)      # ranks 1..N-1 never join: hang
    ```

    ## Limitations
    Whether a branch really differs between ranks depends on program semantics, so this rule
    only reports (it has no fix), and it looks through one level of same-file calls.
    """

    code = "TM104"
    name = "symmetric-collectives"
    summary = "Collectives and DDP forwards must run on every rank, not under rank guards or in except blocks"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch.distributed as dist
            if dist.get_rank() == 0:
                dist.all_reduce(t)
            """,
            after="""
            import torch.distributed as dist
            if dist.get_rank() == 0:
                # TODO(torchmigrate): TM104 `dist.all_reduce` is a collective under a rank guard (`if dist.get_rank() == 0`): the other ranks never join it and the job hangs; call it on every rank
                dist.all_reduce(t)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.regions: Dict[cst.CSTNode, Tuple[str, str]] = {}  # block -> (polarity, description)

    def visit_If(self, node: cst.If) -> None:
        polarity = rank_polarity(node.test)
        if polarity is None:
            return
        text = f"if {code(node.test)}"
        if len(text) > 60:
            text = text[:57] + "..."
        self.regions[node.body] = (polarity, f"`{text}`")
        if node.orelse is not None:
            target = node.orelse.body if isinstance(node.orelse, cst.Else) else node.orelse
            self.regions[target] = (opposite_polarity(polarity), f"the else branch of `{text}`")

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        self.regions[node.body] = ("except", "an `except` block")

    def _region(self, node: cst.CSTNode, stop: Optional[cst.CSTNode] = None):
        """The innermost guarded region holding node (not crossing a def), and its scope."""
        found = None
        for anc in self.ctx.ancestors(node):
            if anc is stop:
                break
            if found is None and anc in self.regions:
                found = self.regions[anc]
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return found, anc
        return found, self.ctx.module

    def _collective_name(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        if name in COLLECTIVES:
            return name
        last = last_name(call.func)
        if last in _COLLECTIVE_HELPERS:
            if name is not None and not name.startswith("torch.") and not name.startswith(RUNTIME):
                return name  # imported helper (comm.synchronize, utils.reduce_dict)
            if isinstance(call.func, cst.Attribute) and last in ("wait_for_everyone", "gather_for_metrics"):
                return dotted(call.func) or last
        return None

    def leave_Module(self, node: cst.Module) -> None:
        if not self.regions:
            return
        ctx = self.ctx
        calls = analysis.facts(ctx).calls
        ddp = self._ddp_models()
        # Direct offenders, by enclosing function (for the one-level look through calls).
        by_function: Dict[cst.CSTNode, List[Tuple[str, str, Optional[str]]]] = {}
        candidates = []  # (call, what, region, scope, key)
        functions = analysis.facts(ctx).functions
        methods: Dict[Tuple[cst.CSTNode, str], cst.FunctionDef] = {}
        for cls in analysis.facts(ctx).classes.values():
            if isinstance(cls.body, cst.IndentedBlock):
                for s in cls.body.body:
                    if isinstance(s, cst.FunctionDef):
                        methods[(cls, s.name.value)] = s
        for call, name in calls:
            what = None
            coll = self._collective_name(call, name)
            if coll is not None:
                what = ("collective", dotted(call.func) or coll.rsplit(".", 1)[-1], coll.rsplit(".", 1)[-1])
            else:
                func = dotted(call.func)
                if func in ddp:
                    what = ("forward", func, None)
            if what is None:
                continue
            fn = ctx.enclosing(call, cst.FunctionDef)
            if fn is not None:
                by_function.setdefault(fn, []).append(what)
            region, scope = self._region(call)
            if region is not None:
                candidates.append((call, what, region, scope))
        # Calls to same-file functions that communicate, made under a guard.
        param_forwards = self._param_forwards(ddp, calls)
        for call, name in calls:
            if name is not None:
                continue
            target = None
            if isinstance(call.func, cst.Name):
                target = functions.get(call.func.value)
            elif isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name) \
                    and call.func.value.value == "self":
                cls = ctx.enclosing(call, cst.ClassDef)
                if cls is not None:
                    target = methods.get((cls, call.func.attr.value))
            if target is None:
                continue
            region, scope = self._region(call)
            if region is None:
                continue
            inner = by_function.get(target, [])
            fname = dotted(call.func)
            if inner:
                kind, name, _ = inner[0]
                candidates.append((call, ("calls" if kind == "collective" else "calls-forward", fname, name),
                                   region, scope))
                continue
            forwarded = self._passes_model(call, target, ddp, param_forwards)
            if forwarded:
                candidates.append((call, ("calls-forward", fname, forwarded), region, scope))
        self._report(candidates)

    def _report(self, candidates) -> None:
        # "rank 0 first": the same collective under opposite guards of one scope is symmetric.
        polarities: Dict[Tuple[cst.CSTNode, str], Set[str]] = {}
        for call, what, region, scope in candidates:
            if what[0] == "collective":
                polarities.setdefault((scope, what[2]), set()).add(region[0])
        seen = set()
        for call, what, region, scope in candidates:
            if call in seen:
                continue
            seen.add(call)
            if what[0] == "collective" and {"main", "other"} <= polarities.get((scope, what[2]), set()):
                continue
            where = region[1]
            if region[0] == "except":
                consequence = "if only some ranks raise, the others wait for it forever; call it on every rank or re-raise"
            else:
                consequence = "the other ranks never join it and the job hangs; call it on every rank"
            if what[0] == "collective":
                msg = f"`{what[1]}` is a collective under a rank guard ({where}): {consequence}"
                if region[0] == "except":
                    msg = f"`{what[1]}` is a collective inside {where}: {consequence}"
            elif what[0] == "forward":
                msg = (f"forward through the DDP model `{what[1]}` only on some ranks ({where}) can hang (DDP syncs "
                       f"buffers/gradients); use `tm.unwrap({what[1]})` for rank-0-only evaluation, or run it on every rank")
            elif what[0] == "calls":
                msg = f"`{what[1]}()` runs the collective `{what[2]}` but is called under a rank guard ({where}): {consequence}"
            else:
                msg = (f"`{what[1]}()` runs a forward through the DDP model `{what[2]}` but is called under a rank guard "
                       f"({where}): it can hang; evaluate through `tm.unwrap({what[2]})` for rank-0-only work, or call it on every rank")
            self.report(call, msg)

    def _ddp_models(self) -> Set[str]:
        ctx = self.ctx
        names: Set[str] = set()
        for call in analysis.calls_to(ctx, *_DDP_CONSTRUCTORS):
            parent = ctx.parent(call)
            if isinstance(parent, cst.Assign):
                for t in parent.targets:
                    name = dotted(t.target)
                    if name:
                        names.add(name)
        if ctx.options.mode == "ddp":
            names.update(analysis.trained_models(ctx))
        return names

    def _param_forwards(self, ddp: Set[str], calls) -> Dict[cst.CSTNode, Set[str]]:
        """For each function, the parameter names it calls like a model (`model(x)`)."""
        if not ddp:
            return {}
        out: Dict[cst.CSTNode, Set[str]] = {}
        for call, name in calls:
            if name is None and isinstance(call.func, cst.Name):
                fn = self.ctx.enclosing(call, cst.FunctionDef)
                if fn is not None:
                    params = {p.name.value for p in fn.params.params} | {p.name.value for p in fn.params.kwonly_params}
                    if call.func.value in params:
                        out.setdefault(fn, set()).add(call.func.value)
        return out

    def _passes_model(self, call: cst.Call, target: cst.FunctionDef, ddp: Set[str],
                      param_forwards: Dict[cst.CSTNode, Set[str]]) -> Optional[str]:
        called = param_forwards.get(target)
        if not called:
            return None
        params = [p.name.value for p in target.params.params]
        if params and params[0] in ("self", "cls") and isinstance(call.func, cst.Attribute):
            params = params[1:]
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for i, a in enumerate(call.args):
            name = dotted(a.value)
            if name not in ddp:
                continue
            if a.keyword is not None:
                param = a.keyword.value
            elif a.star:
                continue
            else:
                index = positional.index(a)
                param = params[index] if index < len(params) else None
            if param in called:
                return name
        return None

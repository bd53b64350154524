"""TM407 (apex.amp -> torch autocast + GradScaler) and TM408 (apex.parallel & co. -> torch).

NVIDIA removed `apex.amp`, `apex.parallel.DistributedDataParallel` and friends (apex commit
cb65b8ed, May 2025), so a script importing them no longer runs: the migration must leave no
apex import behind. Each apex name is dropped from its import only when every use of it was
converted; `try: from apex import amp / except ImportError: ...` blocks collapse to the branch
that still makes sense. Import statements (and those try blocks) are edited by exactly one
rule: TM407 when it runs, else TM408.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, insert_before, remove, replace
from torchmigrate.imports import dotted
from torchmigrate.nodes import code, expr, stmt, with_args
from torchmigrate.rule import Context, Example
from torchmigrate.program.precision import APEX_AMP, apex_level
from torchmigrate.program.syntax import is_attr_name, statements, subnodes
from torchmigrate.rules.amp.base import AmpRule, emit_scaler
from torchmigrate.rules.amp.edits import removal
from torchmigrate.rules.amp.plan import enabled_codes, plan

_AMP_CONVERTED = ("initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
                  "register_half_function", "register_float_function", "register_promote_function")
_INITIALIZE_PARAMS = ("models", "optimizers", "enabled", "opt_level")
_APEX_DDP = ("apex.parallel.DistributedDataParallel", "apex.parallel.distributed.DistributedDataParallel")
_APEX_SYNCBN_CONVERT = ("apex.parallel.convert_syncbn_model",)
_APEX_SYNCBN = ("apex.parallel.SyncBatchNorm", "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm")
# apex class -> (torch replacement, keyword arguments torch does not take)
_APEX_CLASSES: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    "apex.optimizers.FusedAdam": ("torch.optim.AdamW", ("bias_correction", "adam_w_mode", "set_grad_none",
                                                         "capturable", "master_weights")),
    "apex.optimizers.FusedSGD": ("torch.optim.SGD", ("wd_after_momentum", "materialize_master_grads",
                                                      "set_grad_none")),
    "apex.optimizers.FusedAdagrad": ("torch.optim.Adagrad", ("set_grad_none", "adagrad_w_mode")),
    "apex.normalization.FusedLayerNorm": ("torch.nn.LayerNorm", ("memory_efficient",)),
    "apex.normalization.MixedFusedLayerNorm": ("torch.nn.LayerNorm", ("memory_efficient",)),
    "apex.normalization.FusedRMSNorm": ("torch.nn.RMSNorm", ("memory_efficient",)),
    "apex.parallel.SyncBatchNorm": ("torch.nn.SyncBatchNorm", ("channel_last", "fuse_relu")),
}
_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


def _apex(name: Optional[str]) -> bool:
    return bool(name) and (name == "apex" or name.startswith("apex."))


def _local(alias: cst.ImportAlias) -> str:
    return alias.asname.name.value if alias.asname is not None else dotted(alias.name).split(".")[0]


class _ApexState:
    """What TM407 and TM408 convert, decided once for both (before either reports), so the
    rule that owns the imports knows which apex names go."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.converted: Set[cst.Call] = set()  # apex calls some enabled rule rewrites
        self.removed: Set[cst.CSTNode] = set()  # statements/blocks removed (their apex uses go too)
        self.findings: Dict[str, List[tuple]] = {"TM407": [], "TM408": []}  # (node, message, kwargs)


class _Collector:
    """Stands in for a rule while deciding: records findings instead of reporting them."""

    def __init__(self, ctx: Context, code_: str, state: _ApexState) -> None:
        self.ctx, self.code, self.state = ctx, code_, state

    def report(self, node, message, **kwargs) -> None:
        self.state.findings[self.code].append((node, message, kwargs))


def _state(ctx: Context) -> _ApexState:
    state = ctx.facts.get("apex_state")
    if state is None:
        state = _ApexState(ctx)
        ctx.facts["apex_state"] = state
        enabled = enabled_codes(ctx)
        if "TM407" in enabled:
            _decide_amp(_Collector(ctx, "TM407", state))
        if "TM408" in enabled:
            _decide_parallel(_Collector(ctx, "TM408", state))
    return state  # type: ignore[return-value]


class _ApexRule(AmpRule):
    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.locals = {local for local, full in ctx.imports.names.items() if _apex(full)}
        self.refs: List[cst.Name] = []
        self.import_nodes: List[cst.CSTNode] = []
        self.tries: List[cst.Try] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self.locals and not is_attr_name(self.ctx, node):
            self.refs.append(node)

    def visit_Import(self, node: cst.Import) -> None:
        if any(_apex(dotted(a.name)) for a in node.names):
            self.import_nodes.append(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not node.relative and node.module is not None and _apex(dotted(node.module)):
            self.import_nodes.append(node)

    def visit_Try(self, node: cst.Try) -> None:
        self.tries.append(node)

    def owns_imports(self) -> bool:
        return self.code == "TM407" or "TM407" not in enabled_codes(self.ctx)

    def cleanup_imports(self) -> None:
        """Drop every apex name whose uses were all converted; collapse try/except ImportError."""
        ctx = self.ctx
        state = _state(ctx)
        unconverted: Dict[str, List[cst.Name]] = {}
        for ref in self.refs:
            if ctx.enclosing(ref, cst.Import, cst.ImportFrom):
                continue
            if self._converted(ref, state):
                continue
            unconverted.setdefault(ref.value, []).append(ref)
        # `try: from apex import amp / except ImportError: amp = None`: the fallback binding
        # stays, so the remaining uses (`if amp is not None:`) still work once the import goes.
        fallback_bound: Set[str] = set()
        for t in self.tries:
            if t.handlers and all(_catches_import_error(h) for h in t.handlers):
                imported = {_local(a) for n in self.import_nodes if not isinstance(n.names, cst.ImportStar)
                            and t.body in set(ctx.ancestors(n)) for a in n.names}
                for h in t.handlers:
                    fallback_bound |= {n for n in imported if _binds_any(h.body, {n})}
        for name in list(unconverted):
            if name in fallback_bound:
                del unconverted[name]
        dropped: Dict[cst.CSTNode, List[str]] = {}
        for node in self.import_nodes:
            names = [] if isinstance(node.names, cst.ImportStar) else list(node.names)
            drop = []
            for alias in names:
                full = dotted(alias.name) if isinstance(node, cst.Import) else f"{dotted(node.module)}.{dotted(alias.name)}"
                if _apex(full) and _local(alias) not in unconverted:
                    drop.append(_local(alias))
            if drop:
                dropped[node] = drop
        for node, drop in dropped.items():
            edit = (removal(ctx, node) if len(drop) == len(node.names) else
                    replace(node, lambda n, d=tuple(drop): _drop(n, d)))
            self.report(node, f"remove the apex import (`{', '.join(drop)}`): apex.amp/apex.parallel were removed "
                              "upstream and its uses now call torch", edits=[edit])
        level_ok = apex_level(ctx)[0] in ("O0", "O1") or not _amp_calls(ctx)
        for name, refs in unconverted.items():
            if self.code == "TM407" and level_ok:
                self.report(refs[0], f"`{name}` (apex) is still used here and has no automatic torch "
                                     "equivalent: replace it by hand so no apex import remains")
        for t in self.tries:
            self._collapse_try(t, dropped)

    def _converted(self, ref: cst.Name, state: _ApexState) -> bool:
        ctx = self.ctx
        node: cst.CSTNode = ref
        parent = ctx.parent(node)
        while isinstance(parent, cst.Attribute) and parent.value is node:
            node, parent = parent, ctx.parent(parent)
        if isinstance(parent, cst.Call) and parent.func is node and parent in state.converted:
            return True
        return any(a in state.removed for a in ctx.ancestors(ref))

    def _collapse_try(self, t: cst.Try, dropped: Dict[cst.CSTNode, List[str]]) -> None:
        body = list(statements(t.body))
        apex_lines = [s for s in body if isinstance(s, cst.SimpleStatementLine)
                      and any(small in dropped for small in s.body)]
        if not apex_lines:
            return
        # every apex name imported in the try body must be going
        for s in apex_lines:
            for small in s.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)) and small not in dropped:
                    return
                if small in dropped and not isinstance(small.names, cst.ImportStar) and len(dropped[small]) != len(small.names):
                    return
        if not all(_catches_import_error(h) for h in t.handlers) or not t.handlers:
            return
        names = {n for s in apex_lines for small in s.body if small in dropped for n in dropped[small]}
        fallback = next((h for h in t.handlers if _binds_any(h.body, names)), None)
        index = t.handlers.index(fallback) if fallback is not None else None
        why = ("apex is gone: keep the code path written for when it is missing" if fallback is not None
               else "apex is gone: drop the guard around its import")

        def fix(node: cst.Try):
            if index is not None:
                keep = list(statements(node.handlers[index].body))
            else:
                keep = list(statements(node.body))
                if node.orelse is not None:
                    keep += list(statements(node.orelse.body))
            if node.finalbody is not None:
                keep += list(statements(node.finalbody.body))
            keep = [s for s in keep if not _is_pass(s)]
            if not keep:
                return cst.RemovalSentinel.REMOVE
            lead = list(node.leading_lines) + list(getattr(keep[0], "leading_lines", ()))
            keep[0] = keep[0].with_changes(leading_lines=lead)
            return cst.FlattenSentinel(keep)

        self.report(t, f"`try: import apex ... except ImportError`: {why}", edits=[replace(t, fix)])


def _catches_import_error(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elements if isinstance(handler.type, cst.Tuple) else [cst.Element(handler.type)]
    return any(dotted(e.value) in _IMPORT_ERRORS for e in types)


def _binds_any(block, names: Set[str]) -> bool:
    for n in subnodes(block):
        if isinstance(n, cst.AssignTarget) and dotted(n.target) in names:
            return True
        if isinstance(n, cst.ImportAlias) and _local(n) in names:
            return True
    return False


def _is_pass(s: cst.CSTNode) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, cst.Pass) for x in s.body)


def _drop(node, drop: Sequence[str]):
    keep = [a for a in node.names if _local(a) not in drop]
    if not keep:
        return cst.RemovalSentinel.REMOVE
    keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=keep)


def _kw_names(call: cst.Call, params: Sequence[str]) -> List[str]:
    positional = [a for a in call.args if a.keyword is None]
    return [p for p, _ in zip(params, positional)] + [a.keyword.value for a in call.args if a.keyword]


class _Rename(cst.CSTTransformer):
    def __init__(self, name: str, value: cst.BaseExpression) -> None:
        self.name, self.value = name, value

    def leave_Name(self, original, updated):
        return self.value if updated.value == self.name else updated


class ApexAmp(_ApexRule):
    """
    ## What it does
    Migrates NVIDIA apex mixed precision (opt_level O1) to torch's:
    `model, optimizer = amp.initialize(model, optimizer, opt_level="O1")` is removed and a
    `scaler = tm.GradScaler()` is created beside the optimizer;
    `with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()` becomes
    `scaler.scale(loss).backward()`; `amp.master_params(optimizer)` in clipping becomes the
    model's parameters after `scaler.unscale_(optimizer)`; `amp.state_dict()` /
    `amp.load_state_dict(...)` become the scaler's. The optimizer steps go through the scaler
    (TM402) and the forward gets autocast (TM401), which is what O1 did by patching torch
    functions. No apex import remains.

    ## Why is this bad?
    apex said "apex.amp is deprecated and will be removed by the end of February 2023. Use
    PyTorch AMP", and then removed it: scripts importing it fail with
    `ModuleNotFoundError: No module named 'apex'`.

    ## Limitations
    O2/O3 (fp16 model weights with fp32 master copies) have no direct torch equivalent and are
    reported for a manual change. apex-only options (`loss_scale`, `keep_batchnorm_fp32`,
    `delay_unscale`, ...) are dropped and listed in the report. With `--amp off` the scaler is
    created disabled and no autocast is added.
    """

    code = "TM407"
    name = "apex-amp"
    summary = "Replace apex.amp (O1) with torch autocast + GradScaler"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from apex import amp
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = tm.GradScaler()
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        state = _state(ctx)
        p = plan(ctx)
        if p.scaler is not None and p.scaler_owner == self.code and any(
                c in state.converted for c, _ in _amp_calls(ctx)):
            emit_scaler(self, p)
        for node_, message, kwargs in state.findings[self.code]:
            self.report(node_, message, **kwargs)
        if self.owns_imports():
            self.cleanup_imports()


def _amp_calls(ctx: Context) -> List[Tuple[cst.Call, str]]:
    facts = analysis.facts(ctx)
    return [(c, n) for c, n in facts.calls if n and (n == APEX_AMP or n.startswith(APEX_AMP + "."))]


def _decide_amp(self: _Collector) -> None:
    ctx = self.ctx
    calls = _amp_calls(ctx)
    if not calls:
        return
    p = plan(ctx)
    level, init = apex_level(ctx)
    if level not in ("O0", "O1"):
        self.report(init or calls[0][0], f"apex opt_level {level} keeps fp16 model weights with fp32 master "
                                         "copies, which torch AMP does not do: remove `amp.initialize`, keep the "
                                         "model in fp32 and use `tm.autocast()` + `tm.GradScaler()`")
        return
    if p.scaler is None:
        self.report(calls[0][0], "apex.amp cannot be migrated automatically here (see the other findings): use "
                                 "`tm.autocast()` for the forward and `scaler = tm.GradScaler()` with "
                                 "`scaler.scale(loss).backward()`, `scaler.step(opt)`, `scaler.update()`")
        return
    state = self.state
    scaler = p.scaler.text
    for call, name in calls:
        attr = name.rsplit(".", 1)[1]
        if attr == "initialize":
            _initialize(self, call, state)
        elif attr == "scale_loss":
            _scale_loss(self, call, scaler, state)
        elif attr == "master_params":
            _master_params(self, call, scaler, state, p)
        elif attr in ("state_dict", "load_state_dict"):
            state.converted.add(call)
            self.report(call, f"apex `amp.{attr}` -> `{scaler}.{attr}`",
                        edits=[replace(call, lambda c, a=attr: c.with_changes(func=expr(f"{scaler}.{a}")))])
        elif attr.startswith("register_") or attr in ("half_function", "float_function", "promote_function"):
            line = ctx.statement_of(call)
            if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(
                    line.body[0], cst.Expr) and line.body[0].value is call:
                state.converted.add(call)
                self.report(call, f"`amp.{attr}` has no torch equivalent (autocast keeps its own op lists): "
                                  "removed", edits=[remove(line)])


def _initialize(self, call: cst.Call, state: _ApexState) -> None:
    ctx = self.ctx
    names = _kw_names(call, _INITIALIZE_PARAMS)
    dropped = [n for n in names if n not in ("models", "optimizers")]
    note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
    positional = [a.value for a in call.args if a.keyword is None][:2]
    keyword = {a.keyword.value: a.value for a in call.args if a.keyword}
    values = positional + [keyword[k] for k in ("models", "optimizers")[len(positional):] if k in keyword]
    parent = ctx.parent(call)
    line = ctx.statement_of(call)
    message = f"remove `amp.initialize`: torch autocast + GradScaler need no model/optimizer patching{note}"
    state.converted.add(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(line, cst.SimpleStatementLine) \
            and len(line.body) == 1:
        target = parent.targets[0].target
        targets = [code(e.value) for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [code(target)]
        if targets == [code(v) for v in values]:
            self.report(call, message, edits=[remove(line)])
            return
    if isinstance(parent, cst.Expr) and isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        self.report(call, message, edits=[remove(line)])
        return
    if not values:
        return
    new = values[0] if len(values) == 1 else cst.Tuple([cst.Element(v) for v in values], lpar=[], rpar=[])
    self.report(call, message, edits=[replace(call, lambda _c: new)])


def _scale_loss(self, call: cst.Call, scaler: str, state: _ApexState) -> None:
    ctx = self.ctx
    item = ctx.parent(call)
    w = ctx.parent(item) if isinstance(item, cst.WithItem) else None
    if not isinstance(w, cst.With) or len(w.items) != 1 or not call.args:
        self.report(call, f"apex `amp.scale_loss` used outside a single `with`: use `{scaler}.scale(loss)`")
        return
    loss = call.args[0].value
    asname = item.asname
    extra = [a.keyword.value for a in call.args[2:] if a.keyword] + [
        "loss_id" for a in call.args[2:] if a.keyword is None]
    note = f" (dropped apex options: {', '.join(extra)})" if extra else ""
    state.converted.add(call)
    state.removed.add(item)
    scaled = expr(f"{scaler}.scale({code(loss)})")

    def fix(node: cst.With):
        body = list(statements(node.body)) if isinstance(node.body, cst.IndentedBlock) else [
            cst.SimpleStatementLine(list(node.body.body))]
        if asname is not None and isinstance(asname.name, cst.Name):
            renamer = _Rename(asname.name.value, scaled)
            body = [s.visit(renamer) for s in body]
        lead = list(node.leading_lines) + list(getattr(body[0], "leading_lines", ()))
        body[0] = body[0].with_changes(leading_lines=lead)
        return cst.FlattenSentinel(body)

    self.report(w, f"apex `amp.scale_loss` -> `{scaler}.scale({code(loss)}).backward()`{note}",
                edits=[replace(w, fix)])


def _master_params(self, call: cst.Call, scaler: str, state: _ApexState, p) -> None:
    ctx = self.ctx
    if not call.args:
        return
    opt = call.args[0].value
    models = ()
    for o in analysis.optimizers(ctx):
        if o.target == dotted(opt):
            models = o.models
            break
    if len(models) == 1:
        params = f"{models[0]}.parameters()"
    else:
        params = f'[p for group in {code(opt)}.param_groups for p in group["params"]]'
    state.converted.add(call)
    edits = [replace(call, lambda _c: expr(params))]
    line = ctx.statement_of(call)
    unscale = p.apex_unscales.get(line)
    if unscale:
        edits.append(insert_before(line, [stmt(f"{scaler}.unscale_({n})") for n in unscale]))
        message = f"apex `amp.master_params({code(opt)})` -> `{params}` after `{scaler}.unscale_(...)`"
    else:
        message = f"apex `amp.master_params({code(opt)})` -> `{params}`"
    self.report(call, message, edits=edits)


class ApexParallel(_ApexRule):
    """
    ## What it does
    Replaces the rest of apex with torch: `apex.parallel.DistributedDataParallel(model, ...)`
    becomes `tm.wrap_model(model)` (DDP on the process's device, plain model in one process),
    `convert_syncbn_model(model)` becomes `torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`,
    `apex.parallel.SyncBatchNorm` becomes `torch.nn.SyncBatchNorm`, `FusedAdam`/`FusedSGD`/
    `FusedAdagrad` become `torch.optim.AdamW`/`SGD`/`Adagrad` (`FusedAdam(adam_w_mode=False)`
    becomes `Adam`), `FusedLayerNorm`/`FusedRMSNorm` become `torch.nn.LayerNorm`/`RMSNorm`.
    apex-only arguments (`delay_allreduce`, `message_size`, `bias_correction`, ...) are dropped
    and listed in the finding. No apex import remains.

    ## Why is this bad?
    apex deprecated its DistributedDataParallel and SyncBatchNorm for the torch equivalents and
    then removed them (NVIDIA/apex#1896); importing them fails on current apex and apex is an
    extra CUDA build most machines do not have.

    ## Limitations
    Other apex modules (`FusedLAMB`, `apex.contrib`, `apex.fp16_utils`, `LARC`) are reported
    for a manual change.
    """

    code = "TM408"
    name = "apex-ddp"
    summary = "Replace apex DDP / SyncBN / fused modules with torch"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model
            model = convert_syncbn_model(model)
            model = DDP(model, delay_allreduce=True)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            model = tm.wrap_model(model)
            """,
            mode="ddp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        state = _state(self.ctx)
        for node_, message, kwargs in state.findings[self.code]:
            self.report(node_, message, **kwargs)
        if self.owns_imports():
            self.cleanup_imports()


def _decide_parallel(self: _Collector) -> None:
    ctx = self.ctx
    state = self.state
    facts = analysis.facts(ctx)
    for call, name in facts.calls:
        if not _apex(name) or name == APEX_AMP or name.startswith(APEX_AMP + "."):
            continue
        if name in _APEX_DDP:
            _ddp(self, call, state)
        elif name in _APEX_SYNCBN_CONVERT:
            state.converted.add(call)
            kept = [a for a in call.args if a.keyword is None][:1] + [
                a for a in call.args if a.keyword and a.keyword.value in ("process_group",)]
            dropped = [a.keyword.value for a in call.args if a.keyword and a.keyword.value != "process_group"]
            note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
            self.report(call, f"apex `convert_syncbn_model` -> `torch.nn.SyncBatchNorm.convert_sync_batchnorm`{note}",
                        edits=[replace(call, lambda c, k=kept: with_args(
                            c.with_changes(func=expr("torch.nn.SyncBatchNorm.convert_sync_batchnorm")), k))],
                        imports=[Import("torch")])
        elif name in _APEX_CLASSES or name in _APEX_SYNCBN:
            target, drop = _APEX_CLASSES.get(name) or _APEX_CLASSES["apex.parallel.SyncBatchNorm"]
            if name == "apex.optimizers.FusedAdam":
                mode = next((a.value for a in call.args if a.keyword and a.keyword.value == "adam_w_mode"), None)
                if mode is not None and code(mode) in ("False", "0"):
                    target = "torch.optim.Adam"
                elif mode is not None and code(mode) not in ("True", "1"):
                    self.report(call, "`FusedAdam(adam_w_mode=...)` with a computed mode: use torch.optim.AdamW "
                                      "(decoupled weight decay) or torch.optim.Adam by hand")
                    continue
            dropped = [a.keyword.value for a in call.args if a.keyword and a.keyword.value in drop]
            if any(a.keyword is None for a in call.args[1:]) and "optimizers" in name:
                self.report(call, f"`{name.rsplit('.', 1)[1]}` with positional options: replace it by "
                                  f"`{target}` by hand")
                continue
            state.converted.add(call)
            note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
            self.report(call, f"apex `{name.rsplit('.', 1)[1]}` -> `{target}`{note}",
                        edits=[replace(call, lambda c, t=target, d=drop: with_args(
                            c.with_changes(func=expr(t)),
                            [a for a in c.args if not (a.keyword and a.keyword.value in d)]))],
                        imports=[Import("torch")])
        else:
            self.report(call, f"`{name}` has no automatic torch replacement: replace it by hand so no apex "
                              "import remains")

def _ddp(self, call: cst.Call, state: _ApexState) -> None:
    ctx = self.ctx
    module = next((a for a in call.args if a.keyword is None), None) or next(
        (a for a in call.args if a.keyword and a.keyword.value == "module"), None)
    if module is None:
        return
    dropped = [a.keyword.value for a in call.args if a.keyword and a is not module]
    note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
    state.converted.add(call)
    self.report(call, f"apex DistributedDataParallel -> `{ctx.tm}.wrap_model`{note}",
                edits=[replace(call, lambda c, m=module.value: cst.Call(
                    func=expr(f"{ctx.tm}.wrap_model"), args=[cst.Arg(m)]))],
                imports=[ctx.runtime_import()])

"""TM407: NVIDIA apex mixed precision (`apex.amp`, opt_level O1) -> torch autocast + GradScaler.
What TM407 and TM408 share (the conversions decided once for both, the apex imports) is in
`apex`."""

from __future__ import annotations

from typing import List, Sequence

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_before, remove, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr, stmt
from torchmigrate.rule import Example
from torchmigrate.program.precision import apex_amp_calls, apex_level
from torchmigrate.program.syntax import statements
from torchmigrate.rules.amp.apex import ApexRule, ApexState, Collector, apex_state
from torchmigrate.rules.amp.base import emit_scaler
from torchmigrate.rules.amp.plan import plan

_INITIALIZE_PARAMS = ("models", "optimizers", "enabled", "opt_level")


def _kw_names(call: cst.Call, params: Sequence[str]) -> List[str]:
    positional = [a for a in call.args if a.keyword is None]
    return [p for p, _ in zip(params, positional)] + [a.keyword.value for a in call.args if a.keyword]


class _Rename(cst.CSTTransformer):
    def __init__(self, name: str, value: cst.BaseExpression) -> None:
        self.name, self.value = name, value

    def leave_Name(self, original, updated):
        return self.value if updated.value == self.name else updated


class ApexAmp(ApexRule):
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

    @staticmethod
    def decide(collector: Collector) -> None:
        _decide_amp(collector)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        state = apex_state(ctx)
        p = plan(ctx)
        if p.scaler is not None and p.scaler_owner == self.code and any(
                c in state.converted for c, _ in apex_amp_calls(ctx)):
            emit_scaler(self, p)
        self.report_decided()


def _decide_amp(self: Collector) -> None:
    ctx = self.ctx
    calls = apex_amp_calls(ctx)
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


def _initialize(self, call: cst.Call, state: ApexState) -> None:
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


def _scale_loss(self, call: cst.Call, scaler: str, state: ApexState) -> None:
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


def _master_params(self, call: cst.Call, scaler: str, state: ApexState, p) -> None:
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

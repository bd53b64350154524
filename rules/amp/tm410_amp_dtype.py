"""TM410: existing autocast and GradScaler calls use the runtime's AMP policy."""

from __future__ import annotations

from typing import Iterable, List, Sequence, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr, kwarg, with_args
from torchmigrate.program.precision import AUTOCAST, SCALER, TM_AUTOCAST, TM_SCALER
from torchmigrate.rule import Context, Example
from torchmigrate.rules.amp.base import AmpRule, convertible_call, in_taken_call, name_refs
from torchmigrate.rules.amp.edits import DTYPE_TEXT, removal
from torchmigrate.rules.amp.plan import Plan, plan


class AmpDtype(AmpRule):
    """
    ## What it does
    Applies the runtime's mixed-precision policy: in `ddp`/`amp` migrations every existing
    `autocast(...)` and `GradScaler(...)` (from `torch.cuda.amp`, `torch.cpu.amp`, `torch.amp`,
    `torch.autocast`) becomes `tm.autocast(...)` / `tm.GradScaler(...)`, keeping `enabled=` and
    `dtype=` (positional arguments become keywords; the device argument goes: the runtime uses
    the process's device). `--amp bf16|fp16` adds `dtype="bf16"|"fp16"` where no dtype is given.
    In `lint`, reports fp16 autocast in a training script without a GradScaler.

    ## Why is this bad?
    `autocast("cuda")` does nothing on a CPU-only run and warns; a hard-coded fp16 policy is
    slower and less stable than bf16 on GPUs that support it, and fp16 without loss scaling
    lets small gradients underflow. `tm.autocast()` picks bf16 where supported, else fp16 (with
    `tm.GradScaler()` enabled only then), and no autocast on the CPU (bf16 there only when
    `TORCHMIGRATE_AMP=bf16` asks for it), so the script runs everywhere at full speed.

    ## Limitations
    Calls with `cache_enabled=` or `*args` are left to TM406 (modernised to `torch.amp`).
    """

    code = "TM410"
    name = "amp-dtype"
    summary = "Use the runtime's AMP dtype policy for autocast and GradScaler"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            from torch.cuda.amp import autocast, GradScaler
            scaler = GradScaler(enabled=use_amp)
            with autocast(enabled=use_amp):
                loss = criterion(model(x), y)
            """,
            after="""
            from torch.cuda.amp import autocast, GradScaler
            import torchmigrate.runtime as tm
            scaler = tm.GradScaler(enabled=use_amp)
            with tm.autocast(enabled=use_amp):
                loss = criterion(model(x), y)
            """,
            mode="amp",
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.names = _modern_import_names(ctx)
        self.imports: List[cst.ImportFrom] = []

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if self.names and not node.relative and node.module is not None and dotted(node.module) in _MODERN_MODULES:
            self.imports.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip:
            return
        if not ctx.options.migrating:
            self.lint_fp16(p)
            return
        if ctx.options.amp == "off":
            return
        facts = analysis.facts(ctx)
        taken: Set[cst.Call] = set()
        for call, name in facts.calls:
            if name in AUTOCAST or name in SCALER:
                if not convertible_call(call, name):
                    self.report(call, f"`{code(call.func)}(...)` with `cache_enabled=`/`*args` cannot use the "
                                      "runtime's policy: it stays CUDA-only (use `tm.autocast(...)` if possible)")
                    continue
                taken.add(call)
                helper = "autocast" if name in AUTOCAST else "GradScaler"
                self.report(call, f"use the runtime's AMP policy: `{ctx.tm}.{helper}(...)` (bf16 where supported, "
                                  "else fp16 with loss scaling; CPU runs too)",
                            edits=[replace(call, lambda c, n=name: _to_runtime(ctx, c, n))],
                            imports=[ctx.runtime_import()])
            elif name in (TM_AUTOCAST, TM_SCALER) and ctx.options.amp in DTYPE_TEXT:
                if not any(a.keyword and a.keyword.value == "dtype" for a in call.args) and not (
                        name == TM_AUTOCAST and any(a.keyword is None for a in call.args)):
                    self.report(call, f"force the AMP dtype: `dtype={DTYPE_TEXT[ctx.options.amp]}`",
                                edits=[replace(call, lambda c: _add_kw(c, "dtype", expr(DTYPE_TEXT[ctx.options.amp])))])
        refs = name_refs(ctx, self.names) if self.imports else []
        for imp in self.imports:
            drop = unused_aliases(ctx, imp, refs, taken)
            if drop:
                edit = (removal(ctx, imp) if len(drop) == len(imp.names) else
                        replace(imp, lambda n, d=drop: _drop_aliases(n, d)))
                self.report(imp, "drop imports the runtime's AMP helpers replace", edits=[edit])

    def lint_fp16(self, p: Plan) -> None:
        if p.existing_scalers or not p.sites:
            return
        facts = analysis.facts(self.ctx)
        for call, name in facts.calls:
            if name not in AUTOCAST:
                continue
            dtype = next((a.value for a in call.args if a.keyword and a.keyword.value == "dtype"), None)
            dname = self.ctx.resolve(dtype) if dtype is not None else None
            cuda_default = name.startswith("torch.cuda.") and dtype is None
            if dname in ("torch.float16", "torch.half") or cuda_default:
                self.report(call, "fp16 autocast without a GradScaler: small gradients underflow; use "
                                  "`tm.autocast()` + `tm.GradScaler()` (bf16 where supported)")
                return


_MODERN_MODULES = ("torch.amp", "torch", "torch.amp.autocast_mode", "torch.amp.grad_scaler")


def _modern_import_names(ctx: Context) -> Set[str]:
    out = set()
    for local, full in ctx.imports.names.items():
        if full in AUTOCAST or full in SCALER:
            if not full.startswith(("torch.cuda.", "torch.cpu.")):
                out.add(local)
    return out


def _add_kw(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    return with_args(call, [*call.args, kwarg(name, value)])


def _to_runtime(ctx: Context, call: cst.Call, qualified: str) -> cst.Call:
    legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
    if qualified in AUTOCAST:
        params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
        helper = "autocast"
    else:
        params = (("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled") if legacy else
                  ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"))
        helper = "GradScaler"
    positional = [a for a in call.args if a.keyword is None]
    args = [kwarg(p, a.value) for p, a in zip(params, positional)]
    args += [a for a in call.args if a.keyword is not None]
    args = [a for a in args if a.keyword.value not in ("device_type", "device")]
    if ctx.options.amp in DTYPE_TEXT and not any(a.keyword.value == "dtype" for a in args):
        args.append(kwarg("dtype", expr(DTYPE_TEXT[ctx.options.amp])))
    new = call.with_changes(func=expr(f"{ctx.tm}.{helper}"), args=[])
    return with_args(new, [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == len(args) - 1 else a
                           for i, a in enumerate(args)]) if args else new


def unused_aliases(ctx: Context, imp: cst.ImportFrom, refs: Iterable[cst.Name], taken: Set[cst.Call]) -> List[str]:
    """Local names bound by `imp` (autocast/GradScaler aliases) whose every use is a taken call."""
    if isinstance(imp.names, cst.ImportStar):
        return []
    module = dotted(imp.module) if imp.module is not None else ""
    out = []
    for alias in imp.names:
        full = f"{module}.{dotted(alias.name)}"
        if full not in AUTOCAST and full not in SCALER and full not in ("torch.cuda.amp", "torch.cpu.amp", "torch.amp"):
            continue
        local = alias.asname.name.value if alias.asname is not None else dotted(alias.name)
        uses = [r for r in refs if r.value == local and not ctx.enclosing(r, cst.Import, cst.ImportFrom)]
        if all(in_taken_call(ctx, r, taken) for r in uses):
            out.append(local)
    return out


def _drop_aliases(node: cst.ImportFrom, drop: Sequence[str]):
    keep = [a for a in node.names
            if (a.asname.name.value if a.asname is not None else dotted(a.name)) not in drop]
    if not keep:
        return cst.RemovalSentinel.REMOVE
    keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=keep)

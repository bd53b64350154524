"""TM406: `torch.cuda.amp` / `torch.cpu.amp` → `torch.amp`."""

from __future__ import annotations

from typing import Optional, Tuple

import libcst as cst

from torchmigrate.finding import Safety, replace
from torchmigrate.imports import dotted
from torchmigrate.nodes import expr, kwarg, with_args
from torchmigrate.rule import Example, Rule

_OLD_MODULES = {"torch.cuda.amp": "cuda", "torch.cpu.amp": "cpu"}
# Positional parameters of the deprecated callables, in order; the torch.amp versions take the
# device first and, for autocast, `dtype` before `enabled`, so positionals become keywords.
_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
_DECORATORS = ("custom_fwd", "custom_bwd")


def _deprecated(qualified: Optional[str]) -> Optional[Tuple[str, str]]:
    """(device, attribute) for `torch.cuda.amp.X` / `torch.cpu.amp.X`, including submodules."""
    if not qualified:
        return None
    for module, device in _OLD_MODULES.items():
        if qualified.startswith(module + "."):
            attr = qualified.rsplit(".", 1)[1]
            return device, attr
    return None


def _modern_func(func: cst.BaseExpression) -> cst.BaseExpression:
    """`torch.cuda.amp.autocast` → `torch.amp.autocast`; aliases and bare names stay as they are."""
    name = dotted(func)
    if name is None:
        return func
    for old in (".cuda.amp.", ".cpu.amp."):
        if old in "." + name + ".":
            new = ("." + name).replace(old, ".amp.", 1).lstrip(".")
            return expr(new)
    return func


class TorchCudaAmp(Rule):
    """
    ## What it does
    Rewrites the deprecated `torch.cuda.amp` and `torch.cpu.amp` APIs (`autocast`,
    `GradScaler`, `custom_fwd`, `custom_bwd`) to `torch.amp`, passing the device explicitly.

    ## Why is this bad?
    PyTorch deprecated the device-specific namespaces: every call emits a `FutureWarning`
    ("`torch.cuda.amp.autocast(args...)` is deprecated. Please use
    `torch.amp.autocast('cuda', args...)` instead."), and they will be removed. The new
    `torch.amp.autocast` takes `dtype` before `enabled`, so positional arguments are turned
    into keywords; `enabled=`, `dtype=` and `cache_enabled=` are kept.

    Handles every import spelling: `from torch.cuda.amp import autocast as ac`,
    `import torch.cuda.amp as amp`, `from torch.cuda import amp` and fully qualified use.
    Bare references that are not called (e.g. passing `torch.cuda.amp.autocast` around) are
    reported for a manual change.
    """

    code = "TM406"
    name = "torch-cuda-amp"
    summary = "Replace deprecated torch.cuda.amp / torch.cpu.amp with torch.amp"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.cuda.amp import autocast, GradScaler
            scaler = GradScaler(enabled=use_amp)
            with autocast(use_amp):
                loss = model(x)
            """,
            after="""
            from torch.amp import autocast, GradScaler
            scaler = GradScaler("cuda", enabled=use_amp)
            with autocast("cuda", enabled=use_amp):
                loss = model(x)
            """,
        ),
        Example(
            before="""
            import torch
            @torch.cuda.amp.custom_fwd
            def forward(ctx, x):
                return x
            """,
            after="""
            import torch
            @torch.amp.custom_fwd(device_type="cuda")
            def forward(ctx, x):
                return x
            """,
        ),
    )

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.handled = set()  # func nodes already rewritten as part of a call/decorator
        self.bare = []  # references that are neither called nor decorators

    # --- imports --------------------------------------------------------------------
    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        module = dotted(node.module)
        if module in _OLD_MODULES:
            self.report(node, f"`from {module} import ...` is deprecated; import from torch.amp",
                        edits=[replace(node, lambda n: n.with_changes(module=expr("torch.amp")))])
        elif module in ("torch.cuda", "torch.cpu"):
            amp = [a for a in node.names if dotted(a.name) == "amp"]
            if not amp:
                return
            line = self.ctx.parent(node)
            rest = [a for a in node.names if dotted(a.name) != "amp"]
            if rest and isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
                # Keep the other names where they are and add the new import on its own line.
                edit = replace(line, lambda ln: cst.FlattenSentinel(
                    [ln, cst.SimpleStatementLine([_amp_import(node)])]))
                edits = [replace(node, lambda n: _without_amp(n)), edit]
            else:
                edits = [replace(node, lambda n: _amp_import(n) if not rest else
                                 cst.FlattenSentinel([_without_amp(n), _amp_import(n)]))]
            self.report(node, f"`from {module} import amp` is deprecated; use `from torch import amp`",
                        edits=edits)

    def visit_Import(self, node: cst.Import) -> None:
        if any(dotted(a.name) in _OLD_MODULES for a in node.names):
            def fix(n: cst.Import) -> cst.Import:
                names = [a.with_changes(name=expr("torch.amp")) if dotted(a.name) in _OLD_MODULES else a
                         for a in n.names]
                return n.with_changes(names=names)
            self.report(node, "`import torch.cuda.amp` is deprecated; import torch.amp", edits=[replace(node, fix)])

    # --- uses -----------------------------------------------------------------------
    def visit_Decorator(self, node: cst.Decorator) -> None:
        target = node.decorator
        func = target.func if isinstance(target, cst.Call) else target
        found = _deprecated(self.ctx.resolve(func))
        if not found or found[1] not in _DECORATORS:
            return
        device, attr = found
        self.handled.add(func)

        def fix(dec: cst.Decorator) -> cst.Decorator:
            inner = dec.decorator
            device_kw = kwarg("device_type", expr(f'"{device}"'))
            if isinstance(inner, cst.Call):
                call = inner.with_changes(func=_modern_func(inner.func))
                return dec.with_changes(decorator=with_args(call, [device_kw, *call.args]))
            return dec.with_changes(decorator=cst.Call(func=_modern_func(inner), args=[device_kw]))

        self.report(node, f"`{attr}` from torch.{device}.amp is deprecated; use torch.amp.{attr}(device_type=\"{device}\")",
                    edits=[replace(node, fix)])

    def visit_Call(self, node: cst.Call) -> None:
        found = _deprecated(self.ctx.resolve(node.func))
        if not found or node.func in self.handled:
            return
        device, attr = found
        if attr in _DECORATORS and isinstance(self.ctx.parent(node), cst.Decorator):
            return
        self.handled.add(node.func)
        if attr not in ("autocast", "GradScaler"):
            self.report(node, f"torch.{device}.amp.{attr} is deprecated; use torch.amp.{attr}")
            return

        def fix(call: cst.Call) -> cst.Call:
            args = list(call.args)
            if attr == "autocast":
                positional = [a for a in args if a.keyword is None and not a.star]
                rest = [a for a in args if a not in positional]
                args = [kwarg(p, a.value) for p, a in zip(_AUTOCAST_PARAMS, positional)] + rest
            device_arg = cst.Arg(value=expr(f'"{device}"'))
            return with_args(call.with_changes(func=_modern_func(call.func)), [device_arg, *args])

        self.report(node, f"torch.{device}.amp.{attr}(...) is deprecated; use torch.amp.{attr}(\"{device}\", ...)",
                    edits=[replace(node, fix)])

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self._bare(node)

    def visit_Name(self, node: cst.Name) -> None:
        self._bare(node)

    def leave_Module(self, node: cst.Module) -> None:
        for ref in self.bare:
            if ref not in self.handled:
                found = _deprecated(self.ctx.resolve(ref))
                self.report(ref, f"reference to deprecated torch.{found[0]}.amp.{found[1]}: "
                                 f"use torch.amp.{found[1]} with the device argument")

    def _bare(self, node) -> None:
        parent = self.ctx.parent(node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return  # only the outermost part of a dotted name
        if isinstance(parent, (cst.ImportAlias, cst.ImportFrom, cst.Import)) or self.ctx.enclosing(node, cst.ImportFrom, cst.Import):
            return
        if isinstance(node, cst.Name) and isinstance(parent, cst.Attribute) and parent.attr is node:
            return
        found = _deprecated(self.ctx.resolve(node))
        if found and found[1] in ("autocast", "GradScaler", *_DECORATORS):
            self.bare.append(node)


def _amp_import(node: cst.ImportFrom) -> cst.ImportFrom:
    """`from torch import amp` keeping the alias the user chose."""
    amp = [a for a in node.names if dotted(a.name) == "amp"][0]
    return cst.ImportFrom(module=expr("torch"), names=[amp.with_changes(comma=cst.MaybeSentinel.DEFAULT)])


def _without_amp(node: cst.ImportFrom) -> cst.ImportFrom:
    rest = [a for a in node.names if dotted(a.name) != "amp"]
    rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=rest)

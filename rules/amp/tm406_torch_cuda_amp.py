"""TM406: `torch.cuda.amp` / `torch.cpu.amp` → `torch.amp`."""

from __future__ import annotations

from typing import List, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import expr, kwarg, with_args
from torchmigrate.rule import Example
from torchmigrate.rules.amp.base import AmpRule, in_taken_call, name_refs, policy_active, policy_takes
from torchmigrate.rules.amp.edits import removal

_OLD_MODULES = {"torch.cuda.amp": "cuda", "torch.cpu.amp": "cpu"}
_OLD_PREFIXES = tuple(module + "." for module in _OLD_MODULES)
# Positional parameters of the deprecated callables, in order; the torch.amp versions take the
# device first and, for autocast, `dtype` before `enabled`, so positionals become keywords.
_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
_DECORATORS = ("custom_fwd", "custom_bwd")


def _deprecated(qualified: Optional[str]) -> Optional[Tuple[str, str]]:
    """(device, attribute) for `torch.cuda.amp.X` / `torch.cpu.amp.X`, including submodules."""
    if not qualified or not qualified.startswith(_OLD_PREFIXES):  # most names: one test
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


class TorchCudaAmp(AmpRule):
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

    In `ddp`/`amp` migrations (unless `--amp off`) the `autocast(...)`/`GradScaler(...)` calls
    themselves belong to TM410, which turns them into the runtime's `tm.autocast(...)` /
    `tm.GradScaler(...)`; this rule then only rewrites the imports (dropping names no longer
    used), `custom_fwd`/`custom_bwd`, and calls TM410 cannot express (`cache_enabled=`).
    `lint` always reports (and `--fix` modernises) every deprecated use.
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
        self.calls = analysis.facts(ctx).calls  # (call, resolved name), as the walk meets them
        self.handled = set()  # func nodes already rewritten as part of a call/decorator
        self.taken = set()  # calls TM410 rewrites to the runtime (see rules/amp/base.py)
        self.deferred = []  # (import node, report function) decided in leave_Module
        self.locals = {local for local, full in ctx.imports.names.items()
                       if _deprecated(full) or full in _OLD_MODULES}
        # local names that can start a dotted path into torch.cuda.amp / torch.cpu.amp
        self.heads = {local for local, full in ctx.imports.names.items()
                      if full in ("torch", "torch.cuda", "torch.cpu") or _deprecated(full) or full in _OLD_MODULES}

    # --- imports --------------------------------------------------------------------
    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        module = dotted(node.module)
        if module in _OLD_MODULES and policy_active(self.ctx):
            self.deferred.append(node)
        elif module in _OLD_MODULES:
            self.report(node, f"`from {module} import ...` is deprecated; import from torch.amp",
                        edits=[replace(node, lambda n: n.with_changes(module=expr("torch.amp")))])
        elif module in ("torch.cuda", "torch.cpu"):
            amp = [a for a in node.names if dotted(a.name) == "amp"]
            if not amp:
                return
            if policy_active(self.ctx):
                self.deferred.append(node)
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
            if policy_active(self.ctx):
                self.deferred.append(node)
                return

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
        # The Facts collector visits each node before every rule, so its last entry is `node`,
        # already resolved (checked: a rule run on its own resolves the call itself).
        last, qualified = self.calls[-1] if self.calls else (None, None)
        if last is not node:
            qualified = self.ctx.resolve(node.func)
        found = _deprecated(qualified)
        if not found or node.func in self.handled:
            return
        device, attr = found
        if attr in _DECORATORS and isinstance(self.ctx.parent(node), cst.Decorator):
            return
        self.handled.add(node.func)
        if self._fallback(node, attr):
            return
        if policy_takes(self.ctx, node, qualified):
            self.taken.add(node)
            return
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

    def _fallback(self, node: cst.Call, attr: str) -> bool:
        """`try: torch.amp.GradScaler(...)` / `except (AttributeError, TypeError):
        torch.cuda.amp.GradScaler()` (open_clip): the old spelling is the deliberate fallback
        for a torch that lacks the new one, not a use to migrate."""
        handler = self.ctx.enclosing(node, cst.ExceptHandler)
        attempt = self.ctx.parent(handler) if handler is not None else None
        if not isinstance(attempt, cst.Try):
            return False
        return any((self.ctx.resolve(c.func) or "") == f"torch.amp.{attr}"
                   for c in self.ctx.within(attempt.body, cst.Call))

    def leave_Module(self, node: cst.Module) -> None:
        if self.deferred:
            refs = name_refs(self.ctx, self.locals)  # Name nodes that may refer to deprecated imports
            for imp in self.deferred:
                self._deferred_import(imp, refs)
        for ref in self._bare_references():
            if ref not in self.handled and not self._follows_the_import(ref):
                found = _deprecated(self.ctx.resolve(ref))
                self.report(ref, f"reference to deprecated torch.{found[0]}.amp.{found[1]}: "
                                 f"use torch.amp.{found[1]} with the device argument")

    def _follows_the_import(self, ref: cst.BaseExpression) -> bool:
        """A name that needs nothing once its import is migrated: an annotation (`scaler:
        amp.GradScaler`, never called), or `amp.GradScaler` through `from torch.cuda import amp`,
        which becomes `from torch import amp` (whose GradScaler defaults to CUDA)."""
        ctx = self.ctx
        if any(isinstance(a, cst.Annotation) for a in ctx.ancestors(ref)):
            return True
        found = _deprecated(ctx.resolve(ref))
        return bool(found) and found[1] == "GradScaler" \
            and ctx.imports.names.get((dotted(ref) or "").split(".")[0]) in _OLD_MODULES

    def _bare_references(self) -> List[cst.BaseExpression]:
        """Whole dotted names (`torch.cuda.amp.autocast`, `ac`) naming a deprecated autocast,
        GradScaler or decorator outside the imports, in source order; `handled` ones included.

        Every such name starts with one of `heads`, so it is found from the index's Names with
        those values (the chain of attributes each one heads) rather than by testing each
        Name and Attribute of the file as the walk meets it."""
        ctx = self.ctx
        parent_of = ctx.parents.get
        found = []
        for value in self.heads:
            for head in ctx.named(value):
                node, parent = head, parent_of(head)
                while type(parent) is cst.Attribute and parent.value is node:
                    node, parent = parent, parent_of(parent)  # only the outermost part counts
                if node is head and type(parent) is cst.Attribute:
                    continue  # the attribute name in `x.torch`
                qualified = _deprecated(ctx.resolve(node))
                if not qualified or qualified[1] not in ("autocast", "GradScaler", *_DECORATORS):
                    continue
                if isinstance(parent, (cst.ImportAlias, cst.ImportFrom, cst.Import)) or ctx.enclosing(node, cst.ImportFrom, cst.Import):
                    continue
                found.append(node)
        found.sort(key=ctx.position)
        return found

    def _deferred_import(self, node, refs: List[cst.Name]) -> None:
        """A deprecated import in a migration where TM410 rewrites the calls: drop the names only
        those calls used, modernise the rest."""
        drop = set(_unused_locals(self.ctx, node, refs, self.taken))
        if isinstance(node, cst.Import):
            def fix_import(n: cst.Import):
                names = [a for a in n.names if _local(a) not in drop]
                names = [a.with_changes(name=expr("torch.amp")) if dotted(a.name) in _OLD_MODULES else a
                         for a in names]
                if not names:
                    return cst.RemovalSentinel.REMOVE
                names[-1] = names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                return n.with_changes(names=names)
            gone = all(_local(a) in drop for a in node.names)
            self.report(node, "`import torch.cuda.amp` is deprecated; the runtime's AMP helpers replace it",
                        edits=[removal(self.ctx, node) if gone else replace(node, fix_import)])
            return
        module = dotted(node.module)
        if module in _OLD_MODULES:
            def fix_from(n: cst.ImportFrom):
                names = [a for a in n.names if _local(a) not in drop]
                if not names:
                    return cst.RemovalSentinel.REMOVE
                names[-1] = names[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                return n.with_changes(module=expr("torch.amp"), names=names)
            gone = all(_local(a) in drop for a in node.names)
            self.report(node, f"`from {module} import ...` is deprecated; the runtime's AMP helpers replace it",
                        edits=[removal(self.ctx, node) if gone else replace(node, fix_from)])
            return
        # `from torch.cuda import amp[, other]`
        amp_alias = [a for a in node.names if dotted(a.name) == "amp"][0]
        rest = [a for a in node.names if dotted(a.name) != "amp"]
        gone = _local(amp_alias) in drop

        def fix_module(n: cst.ImportFrom):
            if gone:
                return _without_amp(n) if rest else cst.RemovalSentinel.REMOVE
            return _amp_import(n) if not rest else cst.FlattenSentinel([_without_amp(n), _amp_import(n)])
        self.report(node, f"`from {module} import amp` is deprecated; use `from torch import amp`",
                    edits=[removal(self.ctx, node) if gone and not rest else replace(node, fix_module)])


def _local(alias: cst.ImportAlias) -> str:
    return alias.asname.name.value if alias.asname is not None else dotted(alias.name)


def _unused_locals(ctx, node, refs, taken):
    """Names bound by a deprecated import whose every use is a call TM410 rewrites."""
    if isinstance(node.names, cst.ImportStar):
        return []
    out = []
    for alias in node.names:
        local = _local(alias)
        if isinstance(node, cst.Import) and alias.asname is None:
            continue  # `import torch.cuda.amp` binds `torch`
        uses = [r for r in refs if r.value == local and not ctx.enclosing(r, cst.Import, cst.ImportFrom)]
        if all(in_taken_call(ctx, r, taken) for r in uses):
            out.append(local)
    return out


def _amp_import(node: cst.ImportFrom) -> cst.ImportFrom:
    """`from torch import amp` keeping the alias the user chose."""
    amp = [a for a in node.names if dotted(a.name) == "amp"][0]
    return cst.ImportFrom(module=expr("torch"), names=[amp.with_changes(comma=cst.MaybeSentinel.DEFAULT)])


def _without_amp(node: cst.ImportFrom) -> cst.ImportFrom:
    rest = [a for a in node.names if dotted(a.name) != "amp"]
    rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=rest)

"""Mixed precision already in a module: the autocast and GradScaler names, the settings of each
autocast, apex's opt_level, and the `forward` of a model handed to `nn.DataParallel`.

Facts only, whatever rules run: the AMP plan (`rules/amp/plan.py`) and the AMP rules decide what
to change from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.syntax import method_name, statements
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code

if TYPE_CHECKING:
    from torchmigrate.rule import Context

AUTOCAST = frozenset({
    "torch.cuda.amp.autocast", "torch.cpu.amp.autocast", "torch.amp.autocast", "torch.autocast",
    "torch.amp.autocast_mode.autocast", "torch.cuda.amp.autocast_mode.autocast",
    "torch.cpu.amp.autocast_mode.autocast",
})
SCALER = frozenset({
    "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler", "torch.amp.GradScaler", "torch.GradScaler",
    "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
})
TM_AUTOCAST = "torchmigrate.runtime.autocast"
TM_SCALER = "torchmigrate.runtime.GradScaler"
TM_NO_SYNC = "torchmigrate.runtime.no_sync"
BCE_CLASSES = frozenset({"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"})
BCE_FUNCS = frozenset({"torch.nn.functional.binary_cross_entropy"})
DATA_PARALLEL = frozenset({"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                           "torch.nn.parallel.data_parallel.DataParallel"})
APEX_AMP = "apex.amp"
# Frameworks that manage precision themselves (a file importing one has its own AMP setup).
FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed",
              "fairscale", "colossalai", "ignite")


def apex_amp_calls(ctx: Context) -> List[Tuple[cst.Call, str]]:
    """The module's calls into `apex.amp` (`amp.initialize`, `amp.scale_loss`, ...), with their
    resolved names."""
    facts = analysis.facts(ctx)
    return [(c, n) for c, n in facts.calls if n and (n == APEX_AMP or n.startswith(APEX_AMP + "."))]


def apex_o1(ctx: Context) -> bool:
    """apex is used with opt_level O1 (or O0): convertible. O2/O3 (fp16 master weights) are not."""
    return apex_level(ctx)[0] in ("O0", "O1")


def apex_level(ctx: Context) -> Tuple[str, Optional[cst.Call]]:
    cached = ctx.facts.get("amp_apex_level")
    if cached is None:
        level, node = "O1", None
        facts = analysis.facts(ctx)
        for call, name in facts.calls:
            if name == f"{APEX_AMP}.initialize":
                node = call
                arg = next((a for a in call.args if a.keyword and a.keyword.value == "opt_level"), None)
                if arg is None:
                    positional = [a for a in call.args if a.keyword is None]
                    arg = positional[2] if len(positional) > 2 else None
                if arg is not None and isinstance(arg.value, cst.SimpleString):
                    level = arg.value.evaluated_value
                elif arg is not None:
                    # `opt_level=args.opt_level`: look at the argparse default
                    for other, oname in facts.calls:
                        if method_name(other) == "add_argument" and any(
                                isinstance(a.value, cst.SimpleString) and "opt" in a.value.evaluated_value.lower()
                                and "level" in a.value.evaluated_value.lower() for a in other.args if a.keyword is None):
                            default = next((a for a in other.args if a.keyword and a.keyword.value == "default"), None)
                            if default is not None and isinstance(default.value, cst.SimpleString):
                                level = default.value.evaluated_value
                if level not in ("O0", "O1"):
                    break
        cached = (level, node)
        ctx.facts["amp_apex_level"] = cached
    return cached  # type: ignore[return-value]


_FP16 = frozenset({"torch.float16", "torch.half"})
_CONSTANT_DTYPES = frozenset({"torch.float16", "torch.half", "torch.bfloat16"})


def autocast_settings(ctx: Context, call: cst.Call, qualified: str) -> Tuple[Optional[cst.BaseExpression], bool]:
    """(the dtype argument, whether `cache_enabled` or `*args` is given) of an autocast call."""
    if qualified == TM_AUTOCAST:
        dtype = next((a.value for a in call.args if a.keyword and a.keyword.value == "dtype"), None)
        if dtype is None:
            positional = [a for a in call.args if a.keyword is None]
            dtype = positional[0].value if positional else None
        return dtype, any(a.star for a in call.args)
    legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
    params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
    positional = [a for a in call.args if a.keyword is None and not a.star]
    named = {p: a.value for p, a in zip(params, positional)}
    named.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    return named.get("dtype"), "cache_enabled" in named or any(a.star for a in call.args)


def autocast_calls(ctx: Context) -> List[Tuple[cst.Call, str]]:
    return [(c, n) for c, n in analysis.facts(ctx).calls if n in AUTOCAST or n == TM_AUTOCAST]


def replica_settings_lost(ctx: Context) -> bool:
    """Some autocast of the file differs from what DataParallel's replica threads use (CUDA's
    default dtype, fp16, with the cast cache on): `tm.autocast()` (bf16 where supported), an
    explicit dtype other than fp16, or `cache_enabled=`."""
    for call, name in autocast_calls(ctx):
        if name.startswith("torch.cpu."):
            continue
        dtype, cache = autocast_settings(ctx, call, name)
        if cache:
            return True
        if name == TM_AUTOCAST:
            if dtype is None or not (isinstance(dtype, cst.SimpleString) and dtype.evaluated_value == "fp16") \
                    and ctx.resolve(dtype) not in _FP16:
                return True
        elif dtype is not None and ctx.resolve(dtype) not in _FP16:
            return True
    return False


def caller_dtype(ctx: Context) -> Optional[cst.BaseExpression]:
    """The dtype every autocast of the file names, when it is one constant (`torch.bfloat16`,
    `"bf16"`): the forward's autocast uses it too."""
    seen: List[str] = []
    node = None
    for call, name in autocast_calls(ctx):
        dtype, _ = autocast_settings(ctx, call, name)
        if dtype is None:
            return None
        constant = isinstance(dtype, cst.SimpleString) or ctx.resolve(dtype) in _CONSTANT_DTYPES
        if not constant:
            return None
        text = code(dtype)
        if seen and text != seen[0]:
            return None
        seen.append(text)
        node = dtype
    return node


def _is_docstring(s: cst.CSTNode) -> bool:
    return (isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Expr)
            and isinstance(s.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def wrappable_forward(ctx: Context, call: cst.Call) -> Tuple[Optional[cst.FunctionDef], list]:
    """For `nn.DataParallel(model)`: the `forward` of the model's class in this file and the
    statements to run under autocast there (none when it already runs under autocast);
    (None, []) when there is no class or no `forward` with a block to wrap."""
    klass = model_class(ctx, call.args[0].value)
    if klass is None:
        return None, []
    forward = next((s for s in statements(klass.body) if isinstance(s, cst.FunctionDef)
                    and s.name.value == "forward"), None)
    if forward is None or not isinstance(forward.body, cst.IndentedBlock):
        return None, []
    body = list(forward.body.body)
    if _is_docstring(body[0]):
        body = body[1:]
    if not body or _forward_covered(ctx, forward, body):
        return forward, []
    return forward, body


def _forward_covered(ctx: Context, forward: cst.FunctionDef, body) -> bool:
    for dec in forward.decorators:
        d = dec.decorator
        if ctx.resolve(d.func if isinstance(d, cst.Call) else d) in (AUTOCAST | {TM_AUTOCAST}):
            return True
    if len(body) == 1 and isinstance(body[0], cst.With):
        for item in body[0].items:
            i = item.item
            if isinstance(i, cst.Call) and ctx.resolve(i.func) in (AUTOCAST | {TM_AUTOCAST}):
                return True
    return False


def model_class(ctx: Context, value: cst.BaseExpression) -> Optional[cst.ClassDef]:
    classes = analysis.facts(ctx).classes
    seen = 0
    while seen < 8:
        seen += 1
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            value = value.func.value  # `Net().to(device)`, `Net().cuda()`
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
            return classes.get(value.func.value)
        name = dotted(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
        if name is None:
            return None
        found = None
        for assign in analysis.facts(ctx).assigns:
            if any(dotted(t.target) == name for t in assign.targets):
                v = assign.value
                inner = v
                while isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute):
                    inner = inner.func.value
                if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Name) and inner.func.value in classes:
                    found = v
                    break
        if found is None:
            return None
        value = found
    return None

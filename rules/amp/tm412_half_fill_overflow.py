"""TM412: fill constants beyond half precision's range (`masked_fill(mask, -1e9)`) under autocast."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.program.loaders import is_pure
from torchmigrate.program.precision import AUTOCAST, TM_AUTOCAST
from torchmigrate.program.syntax import unparen
from torchmigrate.rule import Example, Rule
from torchmigrate.syntax.imports import dotted

# largest finite float16
HALF_MAX = 65504.0
# method -> (position of the value among its arguments, keyword of the value)
_METHODS: Dict[str, Tuple[int, str]] = {"masked_fill": (1, "value"), "masked_fill_": (1, "value"),
                                        "fill_": (0, "value"), "new_full": (1, "fill_value")}
# function -> (position of the tensor, position of the value, keyword of the value)
_FUNCTIONS: Dict[str, Tuple[int, int, str]] = {"torch.masked_fill": (0, 2, "value"),
                                               "torch.full_like": (0, 1, "fill_value")}
_FULL_DTYPES = frozenset({"torch.float32", "torch.float", "torch.float64", "torch.double", "numpy.float32",
                          "numpy.float64", "numpy.double"})


class HalfFillOverflow(Rule):
    """
    ## What it does
    In a program that gets (or has) mixed precision, a fill constant larger than float16 can
    hold (its largest finite value is 65504) written into a tensor that autocast may compute in
    float16 — `scores.masked_fill(mask == 0, -1e9)`, `x.masked_fill_(pad, -1e10)`,
    `t.fill_(1e9)`, `torch.full_like(x, -1e9)`, also through a module constant (`NEG_INF =
    -1e9`) or `torch.finfo(torch.float32).min` — becomes
    `scores.masked_fill(mask == 0, tm.fill_value(-1e9, scores))`. `tm.fill_value` clamps the
    constant to the finite range of the filled tensor's dtype (of the autocast dtype where the
    tensor is an expression), and returns it unchanged in float32.

    ## Why is this bad?
    Under fp16 autocast (GPUs without bf16: V100, T4, and `TORCHMIGRATE_AMP=fp16`) the attention
    scores come out of the matmul in float16, and `masked_fill` raises "value cannot be
    converted to type c10::Half without overflow" at the first training step: the migrated
    program no longer runs where the original did. `-65504` masks a softmax exactly as `-1e9`
    does (both exponentiate to 0). `float("-inf")` is representable and left alone.
    """

    code = "TM412"
    name = "half-fill-overflow"
    summary = "Fit fill constants beyond float16's range (masked_fill(mask, -1e9)) to the filled tensor"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            def attention(q, k, v, mask):
                scores = q @ k.transpose(-2, -1)
                scores = scores.masked_fill(mask == 0, -1e9)
                return scores.softmax(-1) @ v
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def attention(q, k, v, mask):
                scores = q @ k.transpose(-2, -1)
                scores = scores.masked_fill(mask == 0, tm.fill_value(-1e9, scores))
                return scores.softmax(-1) @ v
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.migrating:
            if ctx.program.amp_hazards or ctx.options.amp == "off":
                return  # no autocast in this program (TM409 says why), or none asked for
        elif not analysis.calls_to(ctx, *AUTOCAST, TM_AUTOCAST):
            return  # lint: only files that run autocast
        constants = _module_constants(node)
        for call, name in analysis.facts(ctx).calls:
            found = _value_and_tensor(call, name)
            if found is None:
                continue
            value, tensor = found
            number = _number(value, constants)
            if number is None or abs(number) <= HALF_MAX or abs(number) == float("inf"):
                continue
            like = tensor if tensor is not None and is_pure(tensor) else None
            text = f"{ctx.tm}.fill_value"

            def fitted(v: cst.BaseExpression, like=like) -> cst.Call:
                args = [cst.Arg(v)] + ([cst.Arg(like.deep_clone())] if like is not None else [])
                return cst.Call(func=cst.parse_expression(text), args=args)

            self.report(value, f"the fill value {number:g} does not fit float16 (largest 65504), which autocast "
                               "computes this tensor in on GPUs without bf16: `masked_fill` raises there; "
                               f"`{text}` fits it to the tensor's dtype",
                        edits=[replace(value, fitted)], imports=[ctx.runtime_import()])


def _value_and_tensor(call: cst.Call, name: Optional[str]):
    """(the fill value argument, the tensor filled or None) of a fill call, or None."""
    if name in _FUNCTIONS:
        at_tensor, at_value, keyword = _FUNCTIONS[name]
        if any(a.keyword is not None and a.keyword.value == "dtype" for a in call.args):
            return None  # its dtype is the program's choice
        value = _argument(call, at_value, keyword)
        tensor = _argument(call, at_tensor, "input")
        return (value, tensor) if value is not None else None
    func = call.func
    if not isinstance(func, cst.Attribute) or func.attr.value not in _METHODS or name is not None and \
            name.startswith(("numpy.", "torch.")):
        return None
    if any(a.keyword is not None and a.keyword.value == "dtype" for a in call.args):
        return None
    at_value, keyword = _METHODS[func.attr.value]
    value = _argument(call, at_value, keyword)
    return (value, func.value) if value is not None else None


def _argument(call: cst.Call, position: int, keyword: str) -> Optional[cst.BaseExpression]:
    if any(a.star for a in call.args):
        return None
    for a in call.args:
        if a.keyword is not None and a.keyword.value == keyword:
            return a.value
    positional = [a for a in call.args if a.keyword is None]
    return positional[position].value if position < len(positional) else None


def _module_constants(module: cst.Module) -> Dict[str, cst.BaseExpression]:
    """Names bound once at module level, to what (`NEG_INF = -1e9`)."""
    seen: Dict[str, int] = {}
    values: Dict[str, cst.BaseExpression] = {}
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name):
                target = small.targets[0].target.value
                seen[target] = seen.get(target, 0) + 1
                values[target] = small.value
    return {k: v for k, v in values.items() if seen[k] == 1}


def _number(node: cst.BaseExpression, constants: Dict[str, cst.BaseExpression], depth: int = 0) -> Optional[float]:
    """The constant `node` stands for: a literal (signed), `float("-1e9")`, a module constant,
    `torch.finfo(torch.float32).min`; None for anything else."""
    node = unparen(node)
    if depth > 3:
        return None
    if isinstance(node, (cst.Integer, cst.Float)):
        return float(node.evaluated_value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
        inner = _number(node.expression, constants, depth + 1)
        return None if inner is None else (-inner if isinstance(node.operator, cst.Minus) else inner)
    if isinstance(node, cst.Name) and node.value in constants:
        return _number(constants[node.value], constants, depth + 1)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "float" \
            and len(node.args) == 1 and isinstance(node.args[0].value, cst.SimpleString):
        try:
            return float(node.args[0].value.evaluated_value)
        except ValueError:
            return None
    if isinstance(node, cst.Attribute) and node.attr.value in ("min", "max") and isinstance(node.value, cst.Call):
        finfo = node.value
        if (dotted(finfo.func) or "").endswith("finfo") and len(finfo.args) == 1:
            dtype = (dotted(finfo.args[0].value) or "").replace("np.", "numpy.")
            if dtype in _FULL_DTYPES:
                big = 3.4028234663852886e38 if dtype.endswith(("float32", "float")) else 1.7976931348623157e308
                return -big if node.attr.value == "min" else big
    return None

"""The code the AMP rules write: dotted names, calls and `with` blocks built directly (parsing a
snippet costs about a millisecond), and the runtime's helpers with the run's `--amp` dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Sequence

import libcst as cst

from torchmigrate.finding import remove
from torchmigrate.syntax.nodes import expr, kwarg, with_args

if TYPE_CHECKING:
    from torchmigrate.rule import Context

# `--amp bf16|fp16`: the dtype argument of the runtime's helpers
DTYPE_TEXT = {"bf16": '"bf16"', "fp16": '"fp16"'}


def removal(ctx: Context, small: cst.CSTNode):
    """An edit removing a small statement: the whole line when it is the only one there, so
    insertions anchored on that line (the runtime import goes after the last import) survive."""
    line = ctx.parent(small)
    if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        return remove(line)
    return remove(small)


def dotted_node(text: str) -> cst.BaseExpression:
    """`a.b.c` built directly (parsing a snippet costs about a millisecond)."""
    parts = text.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def expr_of(text: str) -> cst.BaseExpression:
    if all(part.isidentifier() for part in text.split(".")):
        return dotted_node(text)
    return expr(text)


def call_node(func: str, *args: cst.BaseExpression, **kwargs: cst.BaseExpression) -> cst.Call:
    items = [cst.Arg(a) for a in args] + [kwarg(k, v) for k, v in kwargs.items()]
    return with_args(cst.Call(func=dotted_node(func)), items)


def call_stmt(call: cst.BaseExpression, target: Optional[str] = None) -> cst.SimpleStatementLine:
    if target is None:
        return cst.SimpleStatementLine([cst.Expr(call)])
    return cst.SimpleStatementLine([cst.Assign(targets=[cst.AssignTarget(dotted_node(target))], value=call)])


def runtime_kwargs(ctx: Context, scaler: bool = False) -> Dict[str, cst.BaseExpression]:
    if scaler and ctx.options.amp == "off":
        return {"enabled": cst.Name("False")}
    text = DTYPE_TEXT.get(ctx.options.amp)
    return {"dtype": cst.SimpleString(text)} if text else {}


def with_node(call: cst.Call, body: Sequence[cst.BaseStatement]) -> cst.With:
    return cst.With(items=[cst.WithItem(call)], body=cst.IndentedBlock(body=list(body)))


def runtime_call(ctx: Context, helper: str, args: str = "") -> str:
    return f"{ctx.tm}.{helper}({args})"


def dtype_arg(ctx: Context) -> str:
    text = DTYPE_TEXT.get(ctx.options.amp)
    return f"dtype={text}" if text else ""

"""What the logging rules share: adding a keyword argument (`mode=` to `wandb.init`, `disable=`
to a progress bar) that keeps a call's one-argument-per-line layout, and the expressions that
need parentheses to become part of a larger one."""

from __future__ import annotations

import libcst as cst

from torchmigrate.syntax.nodes import kwarg, set_kwarg

# Expressions that need parentheses as the operand of `or` or the branch of `x if c else y`.
NEEDS_PARENS = (cst.IfExp, cst.Lambda, cst.NamedExpr, cst.Yield)


def add_kwarg(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """`set_kwarg` that keeps one-argument-per-line calls with a trailing comma in that layout."""
    args = list(call.args)
    if any(a.keyword is not None and a.keyword.value == name for a in args) or not args or args[-1].star:
        return set_kwarg(call, name, value)
    last = args[-1]
    comma = last.comma
    before = args[-2].comma.whitespace_after if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
        else call.whitespace_before_args
    if not isinstance(before, cst.ParenthesizedWhitespace):
        before = cst.SimpleWhitespace(" ")
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=before))
        args.append(kwarg(name, value).with_changes(comma=comma))
        return call.with_changes(args=args)
    if not isinstance(comma, cst.Comma) and isinstance(last.whitespace_after_arg, cst.ParenthesizedWhitespace):
        # closing parenthesis on its own line, no trailing comma
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=before),
                                     whitespace_after_arg=cst.SimpleWhitespace(""))
        args.append(kwarg(name, value).with_changes(whitespace_after_arg=last.whitespace_after_arg))
        return call.with_changes(args=args)
    return set_kwarg(call, name, value)

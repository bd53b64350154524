"""Small helpers for building and inspecting LibCST nodes in rules.

`libcst.matchers` costs ~0.4 s to import, more than the whole budget for a one-file lint, so
rules use these plain functions instead.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Optional, Sequence

import libcst as cst

from torchmigrate.syntax.positions import code_for
from torchmigrate.syntax.walk import child_nodes

_EMPTY = cst.Module(body=[])


def code(node: cst.CSTNode) -> str:
    """Source text of a node (without surrounding whitespace of its parent)."""
    return code_for(node, _EMPTY)  # the text of `_EMPTY.code_for_node(node)`, ~1/3 faster


@lru_cache(maxsize=4096)
def expr(text: str) -> cst.BaseExpression:
    """The expression `text`, parsed once per text: LibCST nodes are immutable, so one node can
    serve every file and every place it is inserted (rules build the same `tm.device()`,
    `tm.setup()`, `tm.is_main()` thousands of times in a large run)."""
    return cst.parse_expression(text)


@lru_cache(maxsize=4096)
def stmt(text: str) -> cst.BaseStatement:
    """The statement `text`, parsed once per text (see `expr`)."""
    return cst.parse_statement(text if text.endswith("\n") else text + "\n")


def arg(call: cst.Call, keyword: Optional[str] = None, position: Optional[int] = None) -> Optional[cst.Arg]:
    """The argument passed as `keyword=` or at `position` (counting plain positionals only)."""
    if keyword is not None:
        for a in call.args:
            if a.keyword is not None and a.keyword.value == keyword:
                return a
    if position is not None:
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if position < len(positional):
            # a *args before this position makes the position unknowable
            index = call.args.index(positional[position])
            if not any(a.star for a in call.args[:index]):
                return positional[position]
    return None


def has_star_args(call: cst.Call) -> bool:
    return any(a.star for a in call.args)


def kwarg(name: str, value: cst.BaseExpression) -> cst.Arg:
    return cst.Arg(value=value, keyword=cst.Name(name),
                   equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                         whitespace_after=cst.SimpleWhitespace("")))


def _comma() -> cst.Comma:
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def with_args(call: cst.Call, args: Sequence[cst.Arg]) -> cst.Call:
    """Replace a call's arguments, keeping commas consistent (no trailing comma added)."""
    out = []
    for i, a in enumerate(args):
        last = i == len(args) - 1
        if last:
            keep = call.args and a is call.args[-1]
            out.append(a if keep else a.with_changes(comma=cst.MaybeSentinel.DEFAULT))
        elif a.comma is cst.MaybeSentinel.DEFAULT:
            out.append(a.with_changes(comma=_comma()))
        else:
            out.append(a)
    return call.with_changes(args=out)


def set_kwarg(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """Set `name=value`, replacing an existing keyword of that name or appending one."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == name:
            args[i] = a.with_changes(value=value)
            return call.with_changes(args=args)
    new = kwarg(name, value)
    # keep **kwargs last
    index = len(args)
    while index > 0 and args[index - 1].star == "**":
        index -= 1
    args.insert(index, new)
    return with_args(call, args)


def remove_kwarg(call: cst.Call, name: str) -> cst.Call:
    args = [a for a in call.args if not (a.keyword is not None and a.keyword.value == name)]
    return with_args(call, args)


def is_string(node: cst.CSTNode, *values: str) -> bool:
    """True for a plain string literal (any value if none given)."""
    if isinstance(node, cst.SimpleString):
        return not values or node.evaluated_value in values
    return False


def string_value(node: cst.CSTNode) -> Optional[str]:
    """The value of a plain string literal, or None (another node, a bytes literal)."""
    if isinstance(node, cst.SimpleString):
        try:
            value = node.evaluated_value
        except Exception:  # pragma: no cover - malformed literal
            return None
        return value if isinstance(value, str) else None
    return None


def method_call(node: cst.CSTNode, *names: str) -> bool:
    """`<anything>.name(...)` for one of `names`."""
    return (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute)
            and node.func.attr.value in names)


def with_block(items: str, body: Sequence[cst.BaseStatement]) -> cst.With:
    """`with <items>:` around statements (indentation is relative, so any depth works)."""
    header = cst.parse_statement(f"with {items}:\n    pass\n")
    assert isinstance(header, cst.With)
    return header.with_changes(body=cst.IndentedBlock(body=list(body)))


class _Shift(cst.CSTTransformer):
    def __init__(self, delta: int, start: int) -> None:
        super().__init__()
        self.delta = delta
        self.start = start

    def leave_ParenthesizedWhitespace(self, original, updated):
        width = len(updated.last_line.value)
        if width < self.start or (self.start and not updated.indent):
            return updated
        return updated.with_changes(last_line=cst.SimpleWhitespace(" " * max(0, width + self.delta)))


def shift_continuations(node: cst.CSTNode, delta: int, start: int = 0) -> cst.CSTNode:
    """Move the continuation lines of a multi-line expression `delta` columns (it moved); with
    `start`, only the lines indented at least that far past the block's indentation."""
    if not delta or "\n" not in code(node):
        return node
    return node.visit(_Shift(delta, start))


def keep_alignment(call: cst.Call, new_func: str, column: Optional[int]) -> Optional[Callable[[cst.CSTNode], cst.CSTNode]]:
    """For a call at `column` past its block's indentation whose function is renamed to
    `new_func` (`print` -> `tm.print`): a replacement for the call that moves the continuation
    lines aligned under its arguments as far as the first line moves. Lines indented less than
    the arguments' start (the hanging indent of an inner `.format(` call, say) are relative to
    the block, not to the name, and stay. None when nothing needs to move: one line, an
    unknown column, the arguments on lines of their own (a hanging indent), or a
    triple-quoted string whose text cannot move."""
    if column is None or isinstance(call.whitespace_before_args, cst.ParenthesizedWhitespace):
        return None
    delta = len(new_func) - len(code(call.func))
    if not delta or "\n" not in code(call) or _has_multiline_string(call):
        return None
    start = column + len(code(call.func)) + len(code(call.whitespace_after_func)) + 1
    return lambda updated: shift_continuations(updated, delta, start) if isinstance(updated, cst.Call) else updated


def _has_multiline_string(node: cst.CSTNode) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, (cst.SimpleString, cst.FormattedString)) and "\n" in code(n):
            return True
        stack.extend(child_nodes(n))
    return False

"""Rewriting a DataLoader call: give it `sampler=` (dropping `shuffle`), hoist its dataset
expression into a variable, and keep the call's line layout (wrap at 99 columns, or at the
longest line the call already had, aligned with its own continuation lines)."""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate.syntax.codegen import FastState
from torchmigrate.finding import replace
from torchmigrate.syntax.nodes import code, expr, kwarg, shift_continuations
from torchmigrate.program.loaders import PARAMS

_EMPTY = cst.Module(body=[])  # code generation settings of `code()`
_EQ = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


class Hoists:
    """`ds = <expr>` statements put before one statement; the dataset expressions are taken from
    the rewritten call (so fixes of other rules inside them survive)."""

    def __init__(self, statement: cst.CSTNode) -> None:
        self.items: List[List] = []  # [name, rewritten expression or None, column shift]
        # the edit holds the items, not this object (which holds the edit): no reference cycle
        self.edit = replace(statement, partial(_hoist, self.items))

    def add(self, name: str, shift: int = 0) -> List:
        item = [name, None, shift]
        self.items.append(item)
        return item


def _hoist(items: List[List], updated):
    """`updated` (the rewritten statement) preceded by the `name = expression` assignments."""
    if not isinstance(updated, cst.BaseStatement):
        return updated
    new = [cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(name))], shift_continuations(value, shift))])
           for name, value, shift in items if value is not None]
    if not new:
        return updated
    new[0] = new[0].with_changes(leading_lines=updated.leading_lines)
    return cst.FlattenSentinel([*new, updated.with_changes(leading_lines=())])


def dataset_column(ctx, call: cst.Call, layout) -> Optional[int]:
    """Column (relative to the statement) where the call's dataset argument starts."""
    if layout is None or not call.args:
        return None
    first = call.args[0]
    if first.keyword is not None and first.keyword.value != "dataset" or first.star:
        return None
    ws = call.whitespace_before_args
    if isinstance(ws, cst.ParenthesizedWhitespace):
        column = len(ws.last_line.value)
    else:
        column = layout[1] - layout[0] + len(ws.value)
    if first.keyword is not None:
        column += len(code(first.keyword)) + len(code(first.equal)) if first.equal is not cst.MaybeSentinel.DEFAULT \
            else len(first.keyword.value) + 1
    return column


def _keywordize(args: List[cst.Arg], start: int = 2) -> List[cst.Arg]:
    """Positional arguments from `start` on become keywords (so removing one cannot shift others)."""
    out = []
    position = 0
    for a in args:
        if a.keyword is None and not a.star:
            if position >= start:
                a = a.with_changes(keyword=cst.Name(PARAMS[position]), equal=_EQ)
            position += 1
        out.append(a)
    return out


def _delete(args: List[cst.Arg], index: int) -> None:
    if index == len(args) - 1 and index > 0:
        args[index - 1] = args[index - 1].with_changes(comma=args[index].comma)
    del args[index]


def _insert_after(args: List[cst.Arg], index: int, new: cst.Arg) -> None:
    prev = args[index]
    if index < len(args) - 1:
        args.insert(index + 1, new.with_changes(comma=prev.comma))
        return
    if prev.comma is cst.MaybeSentinel.DEFAULT:
        args[index] = prev.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(new)
        return
    # a trailing comma: the new argument takes the separator the previous ones use
    separator = args[index - 1].comma if index > 0 else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    args[index] = prev.with_changes(comma=separator)
    args.append(new.with_changes(comma=prev.comma))


def _index(args: Sequence[cst.Arg], keyword: str) -> Optional[int]:
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == keyword:
            return i
    return None


LINE_LIMIT = 99


def layout_of(ctx, call: cst.Call) -> Optional[Tuple[int, int, int]]:
    """(indentation of the statement, column where the call's arguments start, longest line of
    the call today) when the call starts on its statement's first line; None when unknown. The
    arguments start just after the `(`, or, when they begin on a line of their own (a hanging
    indent, `DataLoader(\n    ds, ...`), at that line's indentation."""
    statement = ctx.statement_of(call)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    indent = 0
    for anc in ctx.ancestors(statement):
        if isinstance(anc, cst.IndentedBlock):
            indent += len(anc.indent if anc.indent is not None else ctx.module.default_indent)
    line, call_code, func_width = _line_and_call(statement.body[0], call)
    at = line.find(call_code)
    if at < 0 or "\n" in line[:at] or line.count(call_code) != 1:
        return None
    first = indent + at + func_width + 1
    hanging = call.whitespace_before_args
    if isinstance(hanging, cst.ParenthesizedWhitespace):
        first = (indent if hanging.indent else 0) + len(hanging.last_line.value)
    lines = call_code.split("\n")
    widest = max([indent + at + len(lines[0])] + [indent + len(x) for x in lines[1:]])
    return indent, first, widest


class _SpanState(FastState):
    """Code generation that notes the token span of each wanted node (its first occurrence)."""

    def __init__(self, wanted: Set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.wanted = wanted  # ids of the wanted nodes
        self.spans: Dict[int, List[int]] = {}  # id -> [first token, token after the last]

    def before_codegen(self, node: cst.CSTNode) -> None:
        key = id(node)
        if key in self.wanted and key not in self.spans:
            self.spans[key] = [len(self.tokens), -1]

    def after_codegen(self, node: cst.CSTNode) -> None:
        span = self.spans.get(id(node))
        if span is not None and span[1] < 0:
            span[1] = len(self.tokens)


def _line_and_call(small: cst.CSTNode, call: cst.Call) -> Tuple[str, str, int]:
    """`code(small)`, `code(call)` and `len(code(call.func))` from one code generation of
    `small` when it holds the call (a call generates the same code inside its statement as on
    its own); layout_of runs for every loader that gets a sampler."""
    state = _SpanState({id(call), id(call.func)}, default_indent=_EMPTY.default_indent,
                       default_newline=_EMPTY.default_newline)
    small._codegen(state)
    tokens = state.tokens
    line = "".join(tokens)
    span = state.spans.get(id(call))
    if span is None:  # the call is in another small statement of the line
        return line, code(call), len(code(call.func))
    func = state.spans[id(call.func)]
    return line, "".join(tokens[span[0]:span[1]]), len("".join(tokens[func[0]:func[1]]))


def _single_line(comma) -> bool:
    return isinstance(comma, cst.Comma) and not isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)


def _wrap(args: List[cst.Arg], new: cst.Arg, layout: Tuple[int, int, int]) -> List[cst.Arg]:
    """Break the line before `new` (and after it) when the line holding it gets too long,
    aligning with the call's own continuation lines or its opening parenthesis."""
    indent, first, widest = layout
    limit = max(LINE_LIMIT, widest)
    cont = None
    for a in args:
        if isinstance(a.comma, cst.Comma) and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace):
            ws = a.comma.whitespace_after
            cont = ws
            break
    if cont is None:
        relative = first - indent
        cont = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(" " * relative))
    cont_col = indent + len(cont.last_line.value) if cont.indent else len(cont.last_line.value)
    index = args.index(new)
    texts = [_arg_text(a) for a in args[:index + 2]]
    if any("\n" in text for text in texts):
        return args  # a multi-line argument: the columns cannot be counted
    # the column where each argument starts, breaking before the new argument and before the
    # one after it when their line would get too long
    col = first
    for i, text in enumerate(texts):
        if i == index and i > 0 and col + len(text) + 1 > limit and _single_line(args[i - 1].comma):
            args[i - 1] = args[i - 1].with_changes(comma=args[i - 1].comma.with_changes(whitespace_after=cont))
            col = cont_col
        elif i == index + 1 and _single_line(args[i - 1].comma) and col + _rest_of_line(args, i) > limit:
            args[i - 1] = args[i - 1].with_changes(comma=args[i - 1].comma.with_changes(whitespace_after=cont))
        col += len(text)
        comma = args[i].comma
        if isinstance(comma, cst.Comma):
            col = cont_col if not _single_line(comma) else col + 1 + len(comma.whitespace_after.value)
    return args


def _arg_text(arg: cst.Arg) -> str:
    """An argument's code without its comma and the whitespace after it (which holds the line
    break when the call's `)` stands on a line of its own)."""
    return code(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")))


def _rest_of_line(args: List[cst.Arg], i: int) -> int:
    """Columns from the start of `args[i]` to the end of its line: the arguments after it up to
    the next line break, with their separators, and the comma or `)` that ends the line."""
    width = 0
    for a in args[i:]:
        text = _arg_text(a)
        if "\n" in text:
            return width + text.index("\n")
        width += len(text)
        if not _single_line(a.comma):
            break
        width += 1 + len(a.comma.whitespace_after.value)
    return width + 1


def rewrite_call(call: cst.Call, sampler: Optional[cst.BaseExpression], *, dataset: Optional[cst.BaseExpression] = None,
                 capture: Optional[List] = None, kwargs_shuffle: Optional[str] = None,
                 layout: Optional[Tuple[int, int, int]] = None, drop_last: bool = False,
                 shuffle_left: Optional[cst.BaseExpression] = None) -> cst.Call:
    """Give a DataLoader call `sampler=` (or, with sampler None, only drop `shuffle`), and with
    `drop_last`, `drop_last=True` after it; with `shuffle_left`, `shuffle=<it>` after the sampler
    (`None if split == "train" else True`: the splits the sampler leaves to the loader shuffle)."""
    args = _keywordize(list(call.args))
    if dataset is not None:
        for i, a in enumerate(args):
            if (a.keyword is None and not a.star) or (a.keyword is not None and a.keyword.value == "dataset"):
                if capture is not None:
                    capture[1] = a.value
                value = dataset
                if a.keyword is not None and isinstance(value, cst.NamedExpr):
                    value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                args[i] = a.with_changes(value=value)
                break
    shuffle = _index(args, "shuffle")
    current = _index(args, "sampler")
    new_arg = None
    if sampler is None:
        if shuffle is not None:
            _delete(args, shuffle)
    elif current is not None:
        args[current] = new_arg = args[current].with_changes(value=sampler)
        if shuffle is not None:
            _delete(args, shuffle)
    elif shuffle is not None:
        args[shuffle] = new_arg = args[shuffle].with_changes(keyword=cst.Name("sampler"), value=sampler)
    else:
        after = _index(args, "batch_size")
        if after is None:
            positional = [i for i, a in enumerate(args) if a.keyword is None and not a.star]
            after = positional[-1] if positional else 0
        _insert_after(args, after, kwarg("sampler", sampler))
        new_arg = args[after + 1]
    placed = _index(args, "sampler")
    if shuffle_left is not None and placed is not None and _index(args, "shuffle") is None:
        _insert_after(args, placed, kwarg("shuffle", shuffle_left))
        new_arg = args[placed]  # (its comma may have changed)
        placed += 1
    if drop_last and placed is not None and _index(args, "drop_last") is None:
        _insert_after(args, placed, kwarg("drop_last", expr("True")))
        new_arg = args[placed]  # (its comma may have changed)
    if kwargs_shuffle:
        for i, a in enumerate(args):
            if a.star == "**" and isinstance(a.value, cst.Name) and a.value.value == kwargs_shuffle:
                args[i] = a.with_changes(value=expr(f'{{**{kwargs_shuffle}, "shuffle": False}}'))
    if args and call.args and args[-1] is not call.args[-1] and args[-1].comma is not cst.MaybeSentinel.DEFAULT:
        last_original = call.args[-1].comma
        if last_original is cst.MaybeSentinel.DEFAULT:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    if layout is not None and new_arg is not None:
        args = _wrap(args, new_arg, layout)
    return call.with_changes(args=args)


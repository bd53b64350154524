"""TM602 tqdm-main: progress bars drawn by the main process only."""

from __future__ import annotations

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, expr, set_kwarg
from torchmigrate.program.loaders import TQDM_CALLS
from torchmigrate.program.rank_guards import under_rank_guard
from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.syntax import iter_nodes
from torchmigrate.rule import Example, Rule
from torchmigrate.rules._active import active
from torchmigrate.rules.logging.base import NEEDS_PARENS, add_kwarg


def _disable_fix(tm: str):
    def fix(call: cst.Call) -> cst.Call:
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "disable":
                value = a.value
                if isinstance(value, NEEDS_PARENS) and not value.lpar:
                    value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                if any(isinstance(n, cst.Name) and n.value == "None" for n in iter_nodes(value)):
                    # `disable=None` means "off when not a terminal": keep that value on rank 0
                    new = cst.IfExp(test=expr(f"{tm}.is_main()"), body=value, orelse=cst.Name("True"))
                    return set_kwarg(call, "disable", new)
                new = cst.BooleanOperation(left=value, operator=cst.Or(), right=expr(f"not {tm}.is_main()"))
                return set_kwarg(call, "disable", new)
        return add_kwarg(call, "disable", expr(f"not {tm}.is_main()"))
    return fix


# what a bar has counted: attributes a disabled bar leaves at their start
_COUNTS = frozenset({"n", "last_print_n", "format_dict"})


def _stream_fix(tm: str):
    """`file=tm.bar_stream(<file>)`: drawn on the main process, counting everywhere."""
    def fix(call: cst.Call) -> cst.Call:
        given = arg(call, "file")
        stream = expr(f"{tm}.bar_stream()")
        if given is not None:
            return set_kwarg(call, "file", stream.with_changes(args=[cst.Arg(given.value)]))
        return add_kwarg(call, "file", stream)
    return fix


class TqdmMain(Rule):
    """
    ## What it does
    Adds `disable=not tm.is_main()` to `tqdm(...)` / `trange(...)` progress bars (any import
    spelling: `tqdm.tqdm`, `tqdm.auto`, `tqdm.notebook`, aliases). An existing `disable=expr`
    becomes `disable=expr or not tm.is_main()` (`disable=expr if tm.is_main() else True` when
    `expr` may be `None`, tqdm's "off when not a terminal"); a `disable=` that already depends
    on the rank is kept, and so are bars under a rank guard. A bar whose count the program
    reads (`val_loss / pbar.n`) gets `file=tm.bar_stream()` instead: a disabled bar stops
    counting, this one counts on every rank and draws on the main process only.

    ## Why is this bad?
    Every rank draws its own bar on the same terminal: with 8 processes the output is 8
    interleaved, constantly redrawn bars (tqdm/tqdm#1294). The bar object still exists on the
    other ranks (disabled bars accept `set_postfix`, `update`, `write`, ...), so nothing else
    changes. In `lint` mode (distributed files) bars shown on every rank are reported.
    """

    code = "TM602"
    name = "tqdm-main"
    summary = "Show tqdm progress bars on the main process only"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from tqdm import tqdm
            for x, y in tqdm(train_loader, desc="train"):
                pass
            """,
            after="""
            import torch
            from tqdm import tqdm
            import torchmigrate.runtime as tm
            for x, y in tqdm(train_loader, desc="train", disable=not tm.is_main()):
                pass
            """,
        ),
        Example(
            before="""
            import torch
            from tqdm.auto import trange
            for step in trange(n, disable=args.quiet):
                pass
            """,
            after="""
            import torch
            from tqdm.auto import trange
            import torchmigrate.runtime as tm
            for step in trange(n, disable=args.quiet or not tm.is_main()):
                pass
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        for call, name in analysis.facts(ctx).calls:
            if name not in TQDM_CALLS:
                continue
            if any(a.star == "**" for a in call.args):
                continue  # disable= may come from **kwargs
            if name.endswith(".tqdm") and len([a for a in call.args if a.keyword is None]) > 10:
                continue  # disable passed positionally
            disable = next((a for a in call.args if a.keyword is not None and a.keyword.value == "disable"), None)
            if disable is not None and rank_dependent(ctx, disable.value):
                continue
            stream = arg(call, "file")
            if stream is not None and isinstance(stream.value, cst.Call) \
                    and (dotted(stream.value.func) or "").endswith(".bar_stream"):
                continue
            if under_rank_guard(ctx, call):
                continue
            if self._counted(call):
                self.report(call, "progress bar drawn by every rank, and the program reads its count (a disabled bar "
                                  "stops counting): draw it on the main process only, counting on every rank",
                            edits=[replace(call, _stream_fix(ctx.tm))], imports=[ctx.runtime_import()])
                continue
            self.report(call, "progress bar drawn by every rank; show it on the main process only",
                        edits=[replace(call, _disable_fix(ctx.tm))], imports=[ctx.runtime_import()])

    def _counted(self, call: cst.Call) -> bool:
        """The bar is kept in a name (`pbar = tqdm(...)`, `with tqdm(...) as pbar:`) whose count
        the function reads (`pbar.n`, `pbar.format_dict`): a disabled bar never counts."""
        ctx = self.ctx
        parent = ctx.parent(call)
        target = None
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            target = parent.targets[0].target
        elif isinstance(parent, cst.WithItem) and parent.asname is not None:
            target = parent.asname.name
        name = dotted(target) if target is not None else None
        if name is None:
            return False
        scope = ctx.enclosing(call, cst.FunctionDef) or ctx.module
        return any(isinstance(a, cst.Attribute) and a.attr.value in _COUNTS and dotted(a.value) == name
                   for a in ctx.within(scope, cst.Attribute))

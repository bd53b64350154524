"""TM102 local-rank-arg: a `--local_rank` option that also takes `--local-rank` and defaults to
the LOCAL_RANK environment variable (torchrun passes no argument)."""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, replace
from torchmigrate.syntax.nodes import arg, code, expr, kwarg, string_value, with_args
from torchmigrate.rule import Example, Rule
from torchmigrate.rules.launch.base import LOCAL_RANK_FLAGS, option_strings


def _mentions_local_rank(node: cst.CSTNode) -> bool:
    """The expression reads the LOCAL_RANK environment variable (a "LOCAL_RANK" literal)."""
    text = code(node)
    return '"LOCAL_RANK"' in text or "'LOCAL_RANK'" in text


class LocalRankArg(Rule):
    """
    ## What it does
    Rewrites a `--local_rank` argparse option written for `python -m torch.distributed.launch`
    so it accepts both spellings (`--local-rank`, `--local_rank`) and defaults to the
    `LOCAL_RANK` environment variable, keeping the old default as the fallback:
    `parser.add_argument("--local-rank", "--local_rank", type=int,
    default=int(os.environ.get("LOCAL_RANK", -1)))`. The destination stays `local_rank`
    (argparse derives it from the first long option), so `args.local_rank` keeps working.
    A missing default becomes `int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ
    else None`; `required=True` is dropped (torchrun never passes the flag).

    ## Why is this bad?
    torchrun passes no `--local_rank` argument at all: it only sets `LOCAL_RANK`, so
    `args.local_rank` silently keeps its default (every process thinks it is local rank 0 and
    uses GPU 0). Recent `torch.distributed.launch` passes `--local-rank=N`, which an option
    spelled only `--local_rank` rejects ("unrecognized arguments: --local-rank=0").

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=-1)
    ```
    becomes
    ```python
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    ```
    """

    code = "TM102"
    name = "local-rank-arg"
    summary = "Accept --local-rank and --local_rank and default to the LOCAL_RANK environment variable"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import argparse
            import os
            import torch
            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)
            """,
            after="""
            import argparse
            import os
            import torch
            parser = argparse.ArgumentParser()
            parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        for call, _name in analysis.facts(self.ctx).calls:
            if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "add_argument"):
                continue
            options = option_strings(call)
            values = [string_value(a.value) for a in options]
            if not any(v in LOCAL_RANK_FLAGS for v in values):
                continue
            action = arg(call, "action")
            if action is not None and string_value(action.value) not in (None, "store"):
                continue
            self._check(call, values)

    def _check(self, call: cst.Call, values: List[Optional[str]]) -> None:
        default = arg(call, "default")
        env_default = default is not None and _mentions_local_rank(default.value)
        both = all(flag in values for flag in LOCAL_RANK_FLAGS)
        required = arg(call, "required")
        if both and env_default and required is None:
            return
        os_name = self.ctx.imports.alias_for("os") or "os"
        imports = [] if os_name != "os" else [Import("os")]

        def fix(c: cst.Call) -> cst.Call:
            args = list(c.args)
            options = option_strings(c)
            vals = [string_value(a.value) for a in options]
            if "--local-rank" not in vals or "--local_rank" not in vals:
                i = next(i for i, v in enumerate(vals) if v in LOCAL_RANK_FLAGS)
                have = options[i]
                quote = have.value.quote
                prefix = have.value.prefix
                missing = "--local_rank" if vals[i] == "--local-rank" else "--local-rank"
                comma = have.comma if isinstance(have.comma, cst.Comma) else cst.Comma(
                    whitespace_after=cst.SimpleWhitespace(" "))
                new = cst.Arg(value=cst.SimpleString(f"{prefix}{quote}{missing}{quote}"), comma=comma)
                pos = args.index(have)
                if missing == "--local-rank":
                    args.insert(pos, new)
                else:
                    if have.comma is cst.MaybeSentinel.DEFAULT:
                        args[pos] = have.with_changes(comma=comma)
                    args.insert(pos + 1, new if pos + 1 < len(args) else new.with_changes(comma=cst.MaybeSentinel.DEFAULT))
            args = [a for a in args if not (a.keyword is not None and a.keyword.value == "required")]
            d = next((a for a in args if a.keyword is not None and a.keyword.value == "default"), None)
            if d is None or not _mentions_local_rank(d.value):
                if d is None or (isinstance(d.value, cst.Name) and d.value.value == "None"):
                    value = expr(f'int({os_name}.environ["LOCAL_RANK"]) if "LOCAL_RANK" in {os_name}.environ else None')
                else:
                    value = expr(f'int({os_name}.environ.get("LOCAL_RANK", {code(d.value)}))')
                if d is None:
                    kinds = [a.keyword.value if a.keyword is not None else None for a in args]
                    if "type" in kinds:
                        index = kinds.index("type") + 1
                    else:
                        index = len(option_strings(c))
                    args.insert(index, kwarg("default", value))
                else:
                    args[args.index(d)] = d.with_changes(value=value)
            return with_args(c, args)

        what = []
        if not both:
            what.append("accept both --local-rank and --local_rank")
        if not env_default:
            what.append("default to the LOCAL_RANK environment variable (torchrun passes no argument)")
        if required is not None:
            what.append("drop required=")
        self.report(call, "--local_rank argument from torch.distributed.launch: " + "; ".join(what),
                    edits=[replace(call, fix)], imports=imports)

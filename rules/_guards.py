"""The edit that puts statements on the main process only, which the logging, checkpoint and
file-writing rules share (and TM101 asks which lines it can wrap): `if tm.is_main():` around
runs of adjacent statements, each a statement line of its own in a block.

Not a rule module (the leading underscore): the rule catalogue does not scan it.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import libcst as cst

from torchmigrate.finding import wrap
from torchmigrate.syntax.nodes import stmt
from torchmigrate.program.syntax import body_of, index_in
from torchmigrate.rule import Context


def _if_main(tm: str, body: Sequence[cst.BaseStatement]) -> cst.If:
    """`if tm.is_main():` around statements (indentation is relative, so any depth works)."""
    header = stmt(f"if {tm}.is_main():\n    pass\n")  # parsed once per spelling of the runtime
    return header.with_changes(body=cst.IndentedBlock(body=list(body)))


def guardable_line(ctx: Context, node: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The statement line holding `node` when it is the line's only statement and the line sits
    in an indented block or the module (so it can be wrapped in `if tm.is_main():`)."""
    line = ctx.statement_of(node)
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    if not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
        return None
    return line


def sibling_runs(ctx: Context, lines: Iterable[cst.CSTNode]) -> List[List[cst.CSTNode]]:
    """Group statements into runs of adjacent siblings (same block, consecutive), in order."""
    by_parent: Dict[cst.CSTNode, List[int]] = {}
    seen = set()
    for line in lines:
        if line in seen:
            continue
        seen.add(line)
        parent = ctx.parent(line)
        body = body_of(parent)
        if body is None:
            continue
        by_parent.setdefault(parent, []).append(index_in(body, line))
    runs: List[List[cst.CSTNode]] = []
    for parent, indices in by_parent.items():
        body = body_of(parent)
        indices.sort()
        run: List[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                runs.append([body[j] for j in run])
                run = []
            run.append(i)
        if run:
            runs.append([body[j] for j in run])
    return runs


def guard_edit(ctx: Context, run: Sequence[cst.CSTNode]):
    """The edit that wraps a run of adjacent statements (`sibling_runs`) in `if tm.is_main():`."""
    tm = ctx.tm
    return wrap(run[0], run[-1], lambda stmts: _if_main(tm, stmts))

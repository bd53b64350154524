"""The edit that puts statements on the main process only, which the logging, checkpoint and
file-writing rules share (and TM101 asks which lines it can wrap): `if tm.is_main():` around
runs of adjacent statements, each a statement line of its own in a block; and the names such a
guard would leave unbound on the other ranks (`orphaned`), which rules check before guarding.

Not a rule module (the leading underscore): the rule catalogue does not scan it.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence

import libcst as cst

from torchmigrate.finding import wrap
from torchmigrate.syntax.nodes import expr, stmt
from torchmigrate.program.syntax import binds, body_of, index_in
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


def orphaned(ctx: Context, run: Sequence[cst.CSTNode]) -> List[str]:
    """Names the statements of `run` bind (`x = ...`, `with ... as f`, a loop variable) that code
    after them in the same function reads: under `if tm.is_main():` they would be unbound on the
    other ranks (NameError there), so such a run must not be guarded as it is."""
    scope = ctx.enclosing(run[0], cst.FunctionDef) or ctx.module
    end = ctx.last_position(run[-1])
    found = []
    for name in sorted({n for s in run for n in binds(ctx, s) if "." not in n}):
        later = sorted(((p, use) for use in ctx.named(name) if (p := ctx.position(use)) is not None and p > end
                        and (ctx.enclosing(use, cst.FunctionDef) or ctx.module) is scope and not _other_name(ctx, use)),
                       key=lambda found: found[0])
        # the next mention decides: a read needs the value, a new binding (`with open(p) as f`) replaces it
        if later and not _binding(ctx, later[0][1]):
            found.append(name)
    return found


def _other_name(ctx: Context, name: cst.Name) -> bool:
    """`x.name` or `f(name=...)`: an attribute's or keyword's name, not the variable."""
    parent = ctx.parent(name)
    return isinstance(parent, cst.Attribute) and parent.attr is name or isinstance(parent, cst.Arg) and parent.keyword is name


def _binding(ctx: Context, name: cst.Name) -> bool:
    """`name` is bound here: an assignment target, an `as` name, a loop variable."""
    parent = ctx.parent(name)
    return isinstance(parent, (cst.AssignTarget, cst.AsName)) or (
        isinstance(parent, (cst.For, cst.CompFor, cst.AnnAssign)) and getattr(parent, "target", None) is name)


def main_only_call(tm: str):
    """`factory(args)` -> `tm.main_only(factory, args)`: the object on the main process, a null
    object that absorbs every use on the others (a writer, a file opened for writing)."""
    def fix(call: cst.Call) -> cst.Call:
        if not call.args:
            return call.with_changes(func=expr(f"{tm}.main_only"), args=[cst.Arg(value=call.func)])
        # `SummaryWriter(\n    log_dir=...)` -> `tm.main_only(SummaryWriter,\n    log_dir=...)`
        ws = call.whitespace_before_args
        after = ws if isinstance(ws, cst.ParenthesizedWhitespace) else cst.SimpleWhitespace(" ")
        first = cst.Arg(value=call.func, comma=cst.Comma(whitespace_after=after))
        return call.with_changes(func=expr(f"{tm}.main_only"), whitespace_before_args=cst.SimpleWhitespace(""),
                                 args=[first, *call.args])
    return fix


def claim_tests(ctx: Context, calls: Iterable[cst.Call]) -> bool:
    """Claim file-system tests (`os.path.exists(p)`) that a rule makes rank 0's answer with
    `tm.broadcast_object(...)`: True when no other rule of this run claimed any of them. Two
    rules (a question asked on the main process, a flag file only it writes) may both need the
    same test shared, and it must be shared once."""
    calls = list(calls)
    claimed = ctx.facts.setdefault("guards.shared_tests", set())
    if any(call in claimed for call in calls):
        return False
    claimed.update(calls)
    return True

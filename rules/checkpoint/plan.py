"""The checkpoint family's decisions: which statements this run puts under
`with tm.main_process_first():`, so that the main process downloads or builds a file before the
other ranks read it (TM505).

Computed once per module (`plan(ctx)`), from the write and download facts (`program.writes`),
and only when TM505 runs: TM501 and TM504 ask it too (`Plan.orders`), because a file saved or
written inside such a block is complete before any rank reads it, so TM501 must not ask for a
barrier there and TM504 must not guard the write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted
from torchmigrate.program import effects
from torchmigrate.program.writes import (call_kinds, early_return_check, existence_if, fetches, in_body, in_loop,
                                         inside_def, scope_qual, under_main_process_first, writes_file)
from torchmigrate.rule import Context
from torchmigrate.program.collectives import is_collective
from torchmigrate.program.rank_guards import rank_guard_of
from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.syntax import body_of, index_in, iter_nodes, local_calls
from torchmigrate.rules._active import active


# effects of a helper that must run on every rank: such a helper is not a cache builder
_EVERY_RANK = frozenset({effects.COLLECTIVE, effects.TRAIN, effects.CALLS})


@dataclass
class Span:
    """Sibling statements `first`..`last` to run under one `with tm.main_process_first():`."""

    first: cst.BaseStatement
    last: cst.BaseStatement
    report: cst.CSTNode  # where the finding points
    cache: bool  # a cache built on first use (else a download)


@dataclass
class Plan:
    spans: List[Span] = field(default_factory=list)
    manual: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)  # (node, why no fix)
    wrapped: Set[cst.CSTNode] = field(default_factory=set)  # every statement of every span
    # this module's first-run builders (`ModuleView.first_run_builders`), when TM505 runs: every
    # call of them goes under `main_process_first` with its existence test, wherever it is
    builders: frozenset = frozenset()

    def orders(self, ctx: Context, node: cst.CSTNode) -> bool:
        """Whether `node` runs in a block that makes the other ranks wait for the main process:
        one already in the code, or one this run adds (when TM505 runs), here or around every
        call of the first-run builder that holds it."""
        return under_main_process_first(ctx, node) or node in self.wrapped \
            or any(a in self.wrapped for a in ctx.ancestors(node)) \
            or bool(self.builders) and scope_qual(ctx, node) in self.builders


def plan(ctx: Context) -> Plan:
    found = ctx.facts.get("tm505_plan")
    if found is None:
        found = ctx.facts["tm505_plan"] = _Planner(ctx).plan() if ctx.facts.get("tm505_on") and active(ctx) else Plan()
    return found  # type: ignore[return-value]


class _Planner:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def plan(self) -> Plan:
        ctx = self.ctx
        spans: Dict[cst.CSTNode, Span] = {}
        result = Plan(builders=ctx.program.first_run_builders)
        for call, name in analysis.facts(ctx).calls:
            kind = ("download" if fetches(ctx, call, name) else None) or self._cache_write(call, name)
            if kind is None or inside_def(ctx, call, ctx.statement_of(call)):
                continue
            span = self._span(call, kind)
            if span is not None and span.first not in spans:
                spans[span.first] = span
            elif span is None and kind == "download" and self._no_fix(call) is None:
                result.manual.append((call, f"every rank downloads this at once, in the header of a compound "
                                            f"statement, which cannot go under a block whole: download it in a "
                                            f"statement of its own before, under `with {ctx.tm}.main_process_first():`"))
        chosen = [s for s in spans.values() if not any(a in spans for a in ctx.ancestors(s.first))]
        chosen.sort(key=lambda s: ctx.position(s.first) or 0)
        for span in chosen:
            if result.spans and _covers(ctx, result.spans[-1], span.first):
                continue  # e.g. a download between an early-return test and the cache's write
            why = self._no_fix(span.first, span)
            if why == "":
                continue  # already ordered
            if why is not None:
                result.manual.append((span.report, why))
                continue
            if result.spans and _follows(ctx, result.spans[-1].last, span.first):
                result.spans[-1].last = span.last  # adjacent statements share one block
            else:
                result.spans.append(span)
        for span in result.spans:
            body = body_of(ctx.parent(span.first)) or ()
            result.wrapped.update(body[index_in(body, span.first):index_in(body, span.last) + 1])
        return result

    def _cache_write(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """A file write under (or after the early return of) an `if` that tests whether a file
        exists: a cache built once. Not a checkpoint: a state dict in the call, or a test in a
        loop (saved again and again)."""
        if not (writes_file(call, name, analysis.open_modes(self.ctx)) or self._helper_writes(call)) or any(
                isinstance(n, cst.Name) and n.value == "state_dict" for n in iter_nodes(call)):
            return None
        check = existence_if(self.ctx, call) or early_return_check(self.ctx, call)
        return None if check is None or in_loop(self.ctx, check) else "cache"

    def _helper_writes(self, call: cst.Call) -> bool:
        """`call` reaches the program's own code (in any module) that writes files and does
        nothing that must run on every rank (no collective, training step or code handed in):
        `if not os.path.isdir(out): preprocess(raw, out)` builds an output folder on first run."""
        kinds = call_kinds(self.ctx, call)
        return bool(kinds) and effects.WRITE in kinds and not kinds & _EVERY_RANK

    # --- where the block goes -------------------------------------------------------------

    def _span(self, call: cst.Call, kind: str) -> Optional[Span]:
        """The statements to order: the existence test around the call with what it guards (and,
        after an early return, the statements up to the call's), else the statement line holding
        the call. None where the call sits in a compound statement's header (the block would take
        the loop or branch with it)."""
        ctx = self.ctx
        check = existence_if(ctx, call)
        if check is not None:
            return Span(check, check, check, True) if in_body(ctx, check) else None
        early = early_return_check(ctx, call) if kind == "cache" else None
        if early is not None:
            line = ctx.statement_of(call)
            while not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
                line = ctx.statement_of(ctx.parent(line))
            return Span(early, line, early, True) if in_body(ctx, early) else None
        line = ctx.statement_of(call)
        if kind == "download" and isinstance(line, cst.SimpleStatementLine) and in_body(ctx, line):
            return Span(line, line, call, False)
        return None

    def _no_fix(self, first: cst.CSTNode, span: Optional[Span] = None) -> Optional[str]:
        """"" where the code already orders the ranks, why not where a barrier would hang, None
        where the block can go in (around `span`, which starts at `first`)."""
        ctx = self.ctx
        if under_main_process_first(ctx, first) or rank_guard_of(ctx, first) is not None or self._hand_ordered(first) \
                or self._guarded_calls(first) == "" or span is not None and self._trains(span):
            return ""
        if span is not None and self._communicates(span):
            return (f"every rank runs this download or cache build at once, but these statements also communicate "
                    f"with the other ranks: do the download or build in statements of their own under "
                    f"`with {ctx.tm}.main_process_first():`")
        return self._guarded_calls(first)

    def _guarded_calls(self, node: cst.CSTNode) -> Optional[str]:
        """Of the function holding `node`, how this file calls it under rank guards: "" when
        always (only those ranks download: ordered by the user), why not when only sometimes
        (a barrier would wait there for ranks that never come), None when never."""
        ctx = self.ctx
        fn = ctx.enclosing(node, cst.FunctionDef)
        calls = local_calls(ctx).get(fn.name.value, []) if fn is not None else []
        guarded = [c for c in calls if rank_guard_of(ctx, c) is not None]
        if not guarded:
            return None
        if len(guarded) == len(calls):
            return ""
        return (f"every rank runs this download or cache build at once, but this function is also called under a "
                f"rank guard, where `{ctx.tm}.main_process_first()` would wait for ranks that never come: call it "
                f"on every rank, with the download under `with {ctx.tm}.main_process_first():`")

    def _hand_ordered(self, node: cst.CSTNode) -> bool:
        """After `if rank not in (-1, 0): dist.barrier()` (Transformers' old examples): the
        other ranks already wait for the main one."""
        ctx = self.ctx
        statement = ctx.statement_of(node)
        while statement is not None and not in_body(ctx, statement):
            statement = ctx.statement_of(ctx.parent(statement))
        body = body_of(ctx.parent(statement)) or ()
        return any(
            isinstance(s, cst.If) and rank_dependent(ctx, s.test)
            and any(isinstance(n, cst.Call) and (dotted(n.func) or "").endswith("barrier") for n in iter_nodes(s.body))
            for s in body[:max(index_in(body, statement), 0)])

    def _trains(self, span: Span) -> bool:
        """The statements run a backward pass, here or in a function of this file they call:
        `if not os.path.isfile(best): <train>; torch.save(best_state, best)` is a training run
        skipped when its result exists, not a cache. Under `main_process_first` rank 0 would
        train alone while the others wait, and its first DDP step would wait for them: a hang
        (found on LeeJunHyun/Image_Segmentation)."""
        return any(analysis.is_backward(call) or local is not None and analysis.runs_backward(self.ctx, local)
                   or effects.TRAIN in (call_kinds(self.ctx, call) or ())
                   for call, local in self._span_calls(span))

    def _communicates(self, span: Span) -> bool:
        """A collective in the statements, or in a function of this file they call."""
        ctx = self.ctx
        return any(is_collective(ctx.resolve(call.func)) or local is not None and any(
            isinstance(m, cst.Call) and is_collective(ctx.resolve(m.func)) for m in iter_nodes(local.body))
            or effects.COLLECTIVE in (call_kinds(ctx, call) or ())
            for call, local in self._span_calls(span))

    def _span_calls(self, span: Span):
        """(call, the function of this file it calls or None) for every call in the span."""
        functions = analysis.facts(self.ctx).functions
        body = body_of(self.ctx.parent(span.first)) or ()
        for statement in body[index_in(body, span.first):index_in(body, span.last) + 1]:
            for n in iter_nodes(statement):
                if isinstance(n, cst.Call):
                    yield n, functions.get(n.func.value) if isinstance(n.func, cst.Name) else None


def _covers(ctx: Context, span: Span, statement: cst.CSTNode) -> bool:
    """`statement` is one of the span's statements."""
    parent = ctx.parent(span.first)
    body = body_of(parent) or ()
    return ctx.parent(statement) is parent and \
        index_in(body, span.first) <= index_in(body, statement) <= index_in(body, span.last)


def _follows(ctx: Context, a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """`b` is the statement right after `a` in the same block."""
    parent = ctx.parent(a)
    body = body_of(parent) or ()
    return ctx.parent(b) is parent and index_in(body, b) == index_in(body, a) + 1

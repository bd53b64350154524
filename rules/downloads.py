"""TM505: datasets downloaded, and caches built, by every rank at once.

The decisions live in `plan(ctx)`, computed once per file, because TM501 asks them too: a file
saved inside a block that `main_process_first` orders is complete before any rank reads it, so
TM501 must not ask for a barrier there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, wrap
from torchmigrate.imports import dotted
from torchmigrate.program.collectives import is_collective
from torchmigrate.program.rank_guards import rank_guard_of
from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.syntax import body_of, index_in, iter_nodes, local_calls
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules._active import active

# Calls that fetch files from the network (resolved names).
_DOWNLOADS = frozenset({
    "urllib.request.urlretrieve", "torch.hub.download_url_to_file",
    "torchvision.datasets.utils.download_url", "torchvision.datasets.utils.download_and_extract_archive",
    "torchvision.datasets.utils.download_file_from_google_drive",
    "huggingface_hub.snapshot_download", "huggingface_hub.hf_hub_download", "datasets.load_dataset",
    "gdown.download", "wget.download", "nltk.download",
})
# Dataset classes that download when given `download=` (anything but a literal False).
_DATASET_PACKAGES = ("torchvision.datasets.", "torchaudio.datasets.")
# torchtext's datasets fetch their files whenever they are built.
_ALWAYS_FETCH = ("torchtext.datasets.",)
_HF_LOAD = "datasets.load_dataset"
# Methods of a Hugging Face dataset that write cache files next to it.
_HF_CACHING = frozenset({"map", "filter"})
_EXISTS = frozenset({"os.path.exists", "os.path.isfile", "os.path.isdir"})
_EXISTS_METHODS = frozenset({"exists", "is_file", "is_dir"})
_FIRST = frozenset({"main_process_first", "local_main_process_first"})
_DEFS = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


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

    def orders(self, ctx: Context, node: cst.CSTNode) -> bool:
        """Whether `node` runs in a block that makes the other ranks wait for the main process:
        one already in the code, or one this run adds (when TM505 runs)."""
        return _under_first(ctx, node) or node in self.wrapped or any(a in self.wrapped for a in ctx.ancestors(node))


def plan(ctx: Context) -> Plan:
    found = ctx.facts.get("tm505_plan")
    if found is None:
        found = ctx.facts["tm505_plan"] = _Planner(ctx).plan() if ctx.facts.get("tm505_on") and active(ctx) else Plan()
    return found  # type: ignore[return-value]


class MainProcessFirst(Rule):
    """
    ## What it does
    Puts what every rank would fetch or build into the same files at the same time under
    `with tm.main_process_first():`, so the main process does it first and the other ranks
    then find it complete:
    - dataset downloads: `torchvision.datasets.X(..., download=True)` (and torchaudio's),
      torchtext datasets, `datasets.load_dataset(...)` and the `.map`/`.filter` calls on what it
      returned (they write cache files), `urlretrieve`, `snapshot_download`, `hf_hub_download`,
      torchvision's `download_url`, `gdown.download`, `nltk.download`;
    - caches built on first use: an `if` that tests whether a file exists
      (`os.path.exists`, `Path(...).exists()`, ...) and downloads or writes it (a preprocessed
      dataset, a vocabulary saved with `torch.save`, `pickle.dump`, `.save(...)`), with the
      statements after it when the `if` returns the cached copy early: the test and the write
      together, so the others test again after the main process wrote the file, and load it.

    Adjacent statements share one block. Already ordered code is left alone: under
    `main_process_first` (the runtime's, Accelerate's or Transformers'), under a rank guard, or
    after the hand-written `if rank != 0: barrier()` idiom. A write under an existence test in a
    loop, or of a state dict, is a checkpoint (TM501's), not a cache, and so is a block that trains
    (a backward pass, here or in a function it calls) when its saved result is missing: rank 0
    would train alone while the others wait, and hang at its first DDP step. A statement that also runs a
    collective, or a function called under a rank guard in this file, is reported instead (a
    barrier there would hang).

    ## Why is this bad?
    Under torchrun every rank runs the same code: eight processes download the same archive
    into the same folder and extract it over each other, or find a cache missing, build it
    and write it at once; a rank that reads while another writes gets a truncated file
    (`EOFError`, `BadZipFile`, a corrupt pickle) in some runs only. `tm.main_process_first()` is
    Accelerate's `main_process_first()` and Transformers' `training_args.main_process_first()`:
    rank 0 runs the block while the others wait at a barrier, then they run it. One process
    or no process group: the block just runs.
    """

    code = "TM505"
    name = "main-process-first"
    summary = "Download datasets and build caches on the main process first, then on the other ranks"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torchvision
            train_set = torchvision.datasets.CIFAR10("data", train=True, download=True)
            test_set = torchvision.datasets.CIFAR10("data", train=False, download=True)
            """,
            after="""
            import torchvision
            import torchmigrate.runtime as tm
            with tm.main_process_first():
                train_set = torchvision.datasets.CIFAR10("data", train=True, download=True)
                test_set = torchvision.datasets.CIFAR10("data", train=False, download=True)
            """,
        ),
        Example(
            before="""
            import os
            import torch
            def vocabulary(texts, path):
                if not os.path.exists(path):
                    torch.save(sorted({w for t in texts for w in t.split()}), path)
                return torch.load(path)
            """,
            after="""
            import os
            import torch
            import torchmigrate.runtime as tm
            def vocabulary(texts, path):
                with tm.main_process_first():
                    if not os.path.exists(path):
                        torch.save(sorted({w for t in texts for w in t.split()}), path)
                return torch.load(path)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        ctx.facts["tm505_on"] = True  # TM501 asks the plan only when this rule runs

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        found = plan(ctx)
        for target, why in found.manual:
            self.report(target, why)
        tm = ctx.tm
        for span in found.spans:
            if span.cache:
                message = (f"every rank finds this file missing at once, builds it and writes it (a rank can read "
                           f"another's half-written file); build it on the main process first with "
                           f"`{tm}.main_process_first()`, the other ranks then find it and load it")
            else:
                message = (f"every rank downloads this at once into the same place (a rank can read another's "
                           f"half-written file); download on the main process first with `{tm}.main_process_first()`")
            self.report(span.report, message, imports=[ctx.runtime_import()],
                        edits=[wrap(span.first, span.last, _main_first(tm))])


class _Planner:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._hf: Dict[cst.CSTNode, Set[str]] = {}

    def plan(self) -> Plan:
        ctx = self.ctx
        spans: Dict[cst.CSTNode, Span] = {}
        result = Plan()
        for call, name in analysis.facts(ctx).calls:
            kind = self._fetch(call, name) or self._cache_write(call, name)
            if kind is None or _inside_def(ctx, call, ctx.statement_of(call)):
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

    # --- what fetches or builds -----------------------------------------------------------

    def _fetch(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        if name is not None and (name in _DOWNLOADS or name.startswith(_ALWAYS_FETCH)
                                 or name.startswith(_DATASET_PACKAGES) and _downloads(call)):
            return "download"
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in _HF_CACHING \
                and _root_name(func.value) in self._hf_datasets(call):
            return "download"
        return None

    def _cache_write(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """A file write under (or after the early return of) an `if` that tests whether a file
        exists: a cache built once. Not a checkpoint: a state dict in the call, or a test in a
        loop (saved again and again)."""
        func = call.func
        writes = name in analysis.FILE_WRITERS or name == "torch.save" or (
            (dotted(func) or "") == "open" and analysis.opens_for_writing(call)) or (
            isinstance(func, cst.Attribute) and bool(call.args)
            and (func.attr.value in analysis.FILE_WRITER_METHODS or func.attr.value in ("save", "save_to_disk")))
        if not writes or any(isinstance(n, cst.Name) and n.value == "state_dict" for n in iter_nodes(call)):
            return None
        check = self._existence_if(call) or self._early_return_check(call)
        return None if check is None or _in_loop(self.ctx, check) else "cache"

    def _hf_datasets(self, at: cst.CSTNode) -> Set[str]:
        """Names the function holding `at` binds to what `load_dataset` returned (or its `.map`)."""
        ctx = self.ctx
        scope = ctx.scope_of(at)
        found = self._hf.get(scope)
        if found is None:
            found = self._hf[scope] = set()
            for assign in analysis.facts(ctx).assigns:
                value = assign.value
                if ctx.scope_of(assign) is not scope or not isinstance(value, cst.Call):
                    continue
                if ctx.resolve(value.func) == _HF_LOAD or (
                        isinstance(value.func, cst.Attribute) and value.func.attr.value in _HF_CACHING
                        and _root_name(value.func.value) in found):
                    found |= {t.target.value for t in assign.targets if isinstance(t.target, cst.Name)}
        return found

    # --- where the block goes -------------------------------------------------------------

    def _existence_if(self, node: cst.CSTNode) -> Optional[cst.If]:
        """The innermost `if` around `node` (in its function) that asks whether a file exists;
        of an `elif`, the whole chain."""
        ctx = self.ctx
        for anc in ctx.ancestors(node):
            if isinstance(anc, _DEFS):
                return None
            if isinstance(anc, cst.If) and _asks_exists(ctx, anc.test):
                while isinstance(ctx.parent(anc), cst.If):
                    anc = ctx.parent(anc)
                return anc
        return None

    def _early_return_check(self, node: cst.CSTNode) -> Optional[cst.If]:
        """`if os.path.exists(p): return load(p)` before the statement holding `node`, in its block."""
        ctx = self.ctx
        line = ctx.statement_of(node)
        while line is not None and not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
            line = ctx.statement_of(ctx.parent(line))
        if line is None:
            return None
        body = body_of(ctx.parent(line)) or ()
        for sibling in reversed(body[:max(index_in(body, line), 0)]):
            if isinstance(sibling, cst.If) and _asks_exists(ctx, sibling.test) and sibling.orelse is None \
                    and isinstance(sibling.body, cst.IndentedBlock) and sibling.body.body \
                    and any(isinstance(n, cst.Return) for n in iter_nodes(sibling.body.body[-1])):
                return sibling
        return None

    def _span(self, call: cst.Call, kind: str) -> Optional[Span]:
        """The statements to order: the existence test around the call with what it guards (and,
        after an early return, the statements up to the call's), else the statement line holding
        the call. None where the call sits in a compound statement's header (the block would take
        the loop or branch with it)."""
        ctx = self.ctx
        check = self._existence_if(call)
        if check is not None:
            return Span(check, check, check, True) if _in_body(ctx, check) else None
        early = self._early_return_check(call) if kind == "cache" else None
        if early is not None:
            line = ctx.statement_of(call)
            while not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
                line = ctx.statement_of(ctx.parent(line))
            return Span(early, line, early, True) if _in_body(ctx, early) else None
        line = ctx.statement_of(call)
        if kind == "download" and isinstance(line, cst.SimpleStatementLine) and _in_body(ctx, line):
            return Span(line, line, call, False)
        return None

    def _no_fix(self, first: cst.CSTNode, span: Optional[Span] = None) -> Optional[str]:
        """"" where the code already orders the ranks, why not where a barrier would hang, None
        where the block can go in (around `span`, which starts at `first`)."""
        ctx = self.ctx
        if _under_first(ctx, first) or rank_guard_of(ctx, first) is not None or self._hand_ordered(first) \
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
        while statement is not None and not _in_body(ctx, statement):
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
                   for call, local in self._span_calls(span))

    def _communicates(self, span: Span) -> bool:
        """A collective in the statements, or in a function of this file they call."""
        ctx = self.ctx
        return any(is_collective(ctx.resolve(call.func)) or local is not None and any(
            isinstance(m, cst.Call) and is_collective(ctx.resolve(m.func)) for m in iter_nodes(local.body))
            for call, local in self._span_calls(span))

    def _span_calls(self, span: Span):
        """(call, the function of this file it calls or None) for every call in the span."""
        functions = analysis.facts(self.ctx).functions
        body = body_of(self.ctx.parent(span.first)) or ()
        for statement in body[index_in(body, span.first):index_in(body, span.last) + 1]:
            for n in iter_nodes(statement):
                if isinstance(n, cst.Call):
                    yield n, functions.get(n.func.value) if isinstance(n.func, cst.Name) else None


def _under_first(ctx: Context, node: cst.CSTNode) -> bool:
    """Inside `with <anything>.main_process_first(...)` already."""
    return any(isinstance(anc, cst.With) and any(
        isinstance(item.item, cst.Call) and (dotted(item.item.func) or "").rsplit(".", 1)[-1] in _FIRST
        for item in anc.items) for anc in ctx.ancestors(node))


def _inside_def(ctx: Context, node: cst.CSTNode, statement: Optional[cst.CSTNode]) -> bool:
    """`node` runs later than its statement: in a lambda (or a def) within it."""
    for anc in ctx.ancestors(node):
        if anc is statement:
            return False
        if isinstance(anc, _DEFS):
            return True
    return False


def _in_body(ctx: Context, statement: cst.CSTNode) -> bool:
    return isinstance(ctx.parent(statement), (cst.IndentedBlock, cst.Module))


def _in_loop(ctx: Context, node: cst.CSTNode) -> bool:
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.For, cst.While)):
            return True
        if isinstance(anc, _DEFS):
            return False
    return False


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


def _downloads(call: cst.Call) -> bool:
    """`download=` given and not a literal False."""
    return any(a.keyword is not None and a.keyword.value == "download"
               and not (isinstance(a.value, cst.Name) and a.value.value == "False") for a in call.args)


def _asks_exists(ctx: Context, test: cst.BaseExpression) -> bool:
    """The test calls `os.path.exists`/`isfile`/`isdir` or a path's `.exists()`/`.is_file()`/`.is_dir()`."""
    for n in iter_nodes(test):
        if isinstance(n, cst.Call) and (ctx.resolve(n.func) in _EXISTS or (
                isinstance(n.func, cst.Attribute) and n.func.attr.value in _EXISTS_METHODS and not n.args)):
            return True
    return False


def _root_name(node: cst.BaseExpression) -> Optional[str]:
    """`ds` of `ds`, `ds["train"]`, `ds.train`."""
    while isinstance(node, (cst.Subscript, cst.Attribute)):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


_HEADER: Dict[str, cst.With] = {}


def _main_first(tm: str):
    """Builds `with tm.main_process_first():` around the wrapped statements."""
    header = _HEADER.get(tm)
    if header is None:
        header = _HEADER[tm] = cst.parse_statement(f"with {tm}.main_process_first():\n    pass\n")  # type: ignore

    def build(statements):
        return header.with_changes(body=cst.IndentedBlock(body=list(statements)))

    return build

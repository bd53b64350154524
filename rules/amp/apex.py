"""What the apex rules share, TM407 (apex.amp -> torch autocast + GradScaler) and TM408
(apex.parallel & co. -> torch): what both convert, decided once, and the apex imports.

NVIDIA removed `apex.amp`, `apex.parallel.DistributedDataParallel` and friends (apex commit
cb65b8ed, May 2025), so a script importing them no longer runs: the migration must leave no
apex import behind. Each apex name is dropped from its import only when every use of it was
converted; `try: from apex import amp / except ImportError: ...` blocks collapse to the branch
that still makes sense. Import statements (and those try blocks) are edited by exactly one
rule: TM407 when it runs, else TM408.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set

import libcst as cst

from torchmigrate.finding import replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.rule import Context
from torchmigrate.program.precision import apex_amp_calls, apex_level
from torchmigrate.program.syntax import is_attr_name, statements, subnodes
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.edits import removal
from torchmigrate.rules.amp.plan import enabled_codes

_IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")


def is_apex(name: Optional[str]) -> bool:
    return bool(name) and (name == "apex" or name.startswith("apex."))


def _local(alias: cst.ImportAlias) -> str:
    return alias.asname.name.value if alias.asname is not None else dotted(alias.name).split(".")[0]


class ApexState:
    """What TM407 and TM408 convert, decided once for both (before either reports), so the
    rule that owns the imports knows which apex names go."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.converted: Set[cst.Call] = set()  # apex calls some enabled rule rewrites
        self.removed: Set[cst.CSTNode] = set()  # statements/blocks removed (their apex uses go too)
        self.findings: Dict[str, List[tuple]] = {"TM407": [], "TM408": []}  # (node, message, kwargs)


class Collector:
    """Stands in for a rule while deciding: records findings instead of reporting them."""

    def __init__(self, ctx: Context, code_: str, state: ApexState) -> None:
        self.ctx, self.code, self.state = ctx, code_, state

    def report(self, node, message, **kwargs) -> None:
        self.state.findings[self.code].append((node, message, kwargs))


def apex_state(ctx: Context) -> ApexState:
    """What the enabled apex rules convert in this module, decided by each (TM407, then TM408)
    the first time either asks."""
    state = ctx.facts.get("apex_state")
    if state is None:
        state = ApexState(ctx)
        ctx.facts["apex_state"] = state
        enabled = enabled_codes(ctx)
        for rule in sorted(ApexRule.__subclasses__(), key=lambda r: r.code):
            if rule.code in enabled:
                rule.decide(Collector(ctx, rule.code, state))
    return state  # type: ignore[return-value]


class ApexRule(AmpRule):
    """Base of TM407 and TM408: each decides its conversions into the shared `ApexState`
    (`decide`), reports them in `leave_Module`, and the rule that owns the imports drops the
    apex names no longer used."""

    @staticmethod
    def decide(collector: Collector) -> None:
        """Record this rule's conversions and findings in `collector` (see `apex_state`)."""
        raise NotImplementedError

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.locals = {local for local, full in ctx.imports.names.items() if is_apex(full)}
        self.refs: List[cst.Name] = []
        self.import_nodes: List[cst.CSTNode] = []
        self.tries: List[cst.Try] = []

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self.locals and not is_attr_name(self.ctx, node):
            self.refs.append(node)

    def visit_Import(self, node: cst.Import) -> None:
        if any(is_apex(dotted(a.name)) for a in node.names):
            self.import_nodes.append(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not node.relative and node.module is not None and is_apex(dotted(node.module)):
            self.import_nodes.append(node)

    def visit_Try(self, node: cst.Try) -> None:
        self.tries.append(node)

    def owns_imports(self) -> bool:
        return self.code == "TM407" or "TM407" not in enabled_codes(self.ctx)

    def report_decided(self) -> None:
        """Report what `decide` recorded for this rule, then the import cleanup if it is ours."""
        for node, message, kwargs in apex_state(self.ctx).findings[self.code]:
            self.report(node, message, **kwargs)
        if self.owns_imports():
            self.cleanup_imports()

    def cleanup_imports(self) -> None:
        """Drop every apex name whose uses were all converted; collapse try/except ImportError."""
        ctx = self.ctx
        state = apex_state(ctx)
        unconverted: Dict[str, List[cst.Name]] = {}
        for ref in self.refs:
            if ctx.enclosing(ref, cst.Import, cst.ImportFrom):
                continue
            if self._converted(ref, state):
                continue
            unconverted.setdefault(ref.value, []).append(ref)
        # `try: from apex import amp / except ImportError: amp = None`: the fallback binding
        # stays, so the remaining uses (`if amp is not None:`) still work once the import goes.
        fallback_bound: Set[str] = set()
        for t in self.tries:
            if t.handlers and all(_catches_import_error(h) for h in t.handlers):
                imported = {_local(a) for n in self.import_nodes if not isinstance(n.names, cst.ImportStar)
                            and t.body in set(ctx.ancestors(n)) for a in n.names}
                for h in t.handlers:
                    fallback_bound |= {n for n in imported if _binds_any(h.body, {n})}
        for name in list(unconverted):
            if name in fallback_bound:
                del unconverted[name]
        dropped: Dict[cst.CSTNode, List[str]] = {}
        for node in self.import_nodes:
            names = [] if isinstance(node.names, cst.ImportStar) else list(node.names)
            drop = []
            for alias in names:
                full = dotted(alias.name) if isinstance(node, cst.Import) else f"{dotted(node.module)}.{dotted(alias.name)}"
                if is_apex(full) and _local(alias) not in unconverted:
                    drop.append(_local(alias))
            if drop:
                dropped[node] = drop
        for node, drop in dropped.items():
            edit = (removal(ctx, node) if len(drop) == len(node.names) else
                    replace(node, lambda n, d=tuple(drop): _drop(n, d)))
            self.report(node, f"remove the apex import (`{', '.join(drop)}`): apex.amp/apex.parallel were removed "
                              "upstream and its uses now call torch", edits=[edit])
        level_ok = apex_level(ctx)[0] in ("O0", "O1") or not apex_amp_calls(ctx)
        for name, refs in unconverted.items():
            if self.code == "TM407" and level_ok:
                self.report(refs[0], f"`{name}` (apex) is still used here and has no automatic torch "
                                     "equivalent: replace it by hand so no apex import remains")
        for t in self.tries:
            self._collapse_try(t, dropped)

    def _converted(self, ref: cst.Name, state: ApexState) -> bool:
        ctx = self.ctx
        node: cst.CSTNode = ref
        parent = ctx.parent(node)
        while isinstance(parent, cst.Attribute) and parent.value is node:
            node, parent = parent, ctx.parent(parent)
        if isinstance(parent, cst.Call) and parent.func is node and parent in state.converted:
            return True
        return any(a in state.removed for a in ctx.ancestors(ref))

    def _collapse_try(self, t: cst.Try, dropped: Dict[cst.CSTNode, List[str]]) -> None:
        body = list(statements(t.body))
        apex_lines = [s for s in body if isinstance(s, cst.SimpleStatementLine)
                      and any(small in dropped for small in s.body)]
        if not apex_lines:
            return
        # every apex name imported in the try body must be going
        for s in apex_lines:
            for small in s.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)) and small not in dropped:
                    return
                if small in dropped and not isinstance(small.names, cst.ImportStar) and len(dropped[small]) != len(small.names):
                    return
        if not all(_catches_import_error(h) for h in t.handlers) or not t.handlers:
            return
        names = {n for s in apex_lines for small in s.body if small in dropped for n in dropped[small]}
        fallback = next((h for h in t.handlers if _binds_any(h.body, names)), None)
        index = t.handlers.index(fallback) if fallback is not None else None
        why = ("apex is gone: keep the code path written for when it is missing" if fallback is not None
               else "apex is gone: drop the guard around its import")

        def fix(node: cst.Try):
            if index is not None:
                keep = list(statements(node.handlers[index].body))
            else:
                keep = list(statements(node.body))
                if node.orelse is not None:
                    keep += list(statements(node.orelse.body))
            if node.finalbody is not None:
                keep += list(statements(node.finalbody.body))
            keep = [s for s in keep if not _is_pass(s)]
            if not keep:
                return cst.RemovalSentinel.REMOVE
            lead = list(node.leading_lines) + list(getattr(keep[0], "leading_lines", ()))
            keep[0] = keep[0].with_changes(leading_lines=lead)
            return cst.FlattenSentinel(keep)

        self.report(t, f"`try: import apex ... except ImportError`: {why}", edits=[replace(t, fix)])


def _catches_import_error(handler: cst.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    types = handler.type.elements if isinstance(handler.type, cst.Tuple) else [cst.Element(handler.type)]
    return any(dotted(e.value) in _IMPORT_ERRORS for e in types)


def _binds_any(block, names: Set[str]) -> bool:
    for n in subnodes(block):
        if isinstance(n, cst.AssignTarget) and dotted(n.target) in names:
            return True
        if isinstance(n, cst.ImportAlias) and _local(n) in names:
            return True
    return False


def _is_pass(s: cst.CSTNode) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, cst.Pass) for x in s.body)


def _drop(node, drop: Sequence[str]):
    keep = [a for a in node.names if _local(a) not in drop]
    if not keep:
        return cst.RemovalSentinel.REMOVE
    keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=keep)

"""Facts about a training script that several rules need, collected in the shared walk.

The `Facts` collector is registered ahead of every rule, so by the time any rule's
`leave_Module` runs it has seen the whole module. Derived facts (which expressions are trained
models, where process-group setup goes, whether the file is already distributed) are computed
on first use and cached on the context, so a rule family pays only for what it asks.

Names are resolved with the module's import table (see `imports.py`), never with LibCST's
metadata providers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import libcst as cst

from torchmigrate.imports import dotted
from torchmigrate.rule import Context, Rule

# Optimizer constructors: anything under these modules except schedulers and helpers.
_OPTIMIZER_MODULES = ("torch.optim.", "apex.optimizers.", "bitsandbytes.optim.", "timm.optim.")
_NOT_OPTIMIZERS = (".lr_scheduler.", ".swa_utils.", ".Optimizer")
_OPTIMIZER_NAMES = {"AdamW", "Adam", "SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
                    "LBFGS", "Lion", "Adafactor", "FusedAdam", "FusedLAMB", "LAMB", "Lamb"}
DISTRIBUTED_MARKERS = (
    "torch.distributed.init_process_group",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.utils.data.DistributedSampler",
    "torch.utils.data.distributed.DistributedSampler",
    "torchmigrate.runtime.setup",
    "torchmigrate.runtime.wrap_model",
)


@dataclass
class Optimizer:
    call: cst.Call
    statement: Optional[cst.CSTNode]
    target: Optional[str]  # `optimizer`, `self.opt_g`
    models: Tuple[str, ...]  # dotted names whose parameters it trains


@dataclass
class Entry:
    """Where a migration puts `tm.setup()` and `tm.cleanup()`."""

    kind: str  # "main-guard" or "top-level"
    setup_before: Optional[cst.CSTNode]  # insert setup before this statement...
    setup_after: Optional[cst.CSTNode]  # ...or after this one
    cleanup_after: Optional[cst.CSTNode]  # insert cleanup after this statement


class Facts(Rule):
    """Collector (not a rule): records calls, assignments, functions and the `__main__` guard."""

    code = ""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.calls: List[Tuple[cst.Call, Optional[str]]] = []
        self.assigns: List[cst.Assign] = []
        self.functions: Dict[str, cst.FunctionDef] = {}
        self.classes: Dict[str, cst.ClassDef] = {}
        self.main_guard: Optional[cst.If] = None
        ctx.facts["facts"] = self

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append((node, self.ctx.resolve(node.func)))

    def visit_Assign(self, node: cst.Assign) -> None:
        self.assigns.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.setdefault(node.name.value, node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.setdefault(node.name.value, node)

    def visit_If(self, node: cst.If) -> None:
        if self.main_guard is None and _is_main_guard(node.test) and self.ctx.parent(node) is self.ctx.module:
            self.main_guard = node


def facts(ctx: Context) -> Facts:
    return ctx.facts["facts"]  # type: ignore[return-value]


def _is_main_guard(test: cst.BaseExpression) -> bool:
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return False
    left, right = test.left, test.comparisons[0].comparator
    names = {dotted(left), dotted(right)}
    strings = [n.evaluated_value for n in (left, right) if isinstance(n, cst.SimpleString)]
    return "__name__" in names and strings == ["__main__"]


def _cached(ctx: Context, key: str, compute):
    if key not in ctx.facts:
        ctx.facts[key] = compute()
    return ctx.facts[key]


# --- calls --------------------------------------------------------------------------------

def calls_to(ctx: Context, *qualified: str) -> List[cst.Call]:
    """Calls whose function resolves to one of the qualified names (or a name under a
    qualified prefix ending in '.')."""
    out = []
    for call, name in facts(ctx).calls:
        if name and any(name == q or (q.endswith(".") and name.startswith(q)) for q in qualified):
            out.append(call)
    return out


def is_distributed(ctx: Context) -> bool:
    """The file already sets up or uses torch.distributed / DDP / the runtime."""
    return _cached(ctx, "is_distributed", lambda: bool(calls_to(ctx, *DISTRIBUTED_MARKERS)))


# --- optimizers and trained models ---------------------------------------------------------

def _is_optimizer(name: Optional[str], call: cst.Call) -> bool:
    if name:
        if any(name.startswith(m) for m in _OPTIMIZER_MODULES):
            return not any(x in name + "." for x in _NOT_OPTIMIZERS) and name.rsplit(".", 1)[1][:1].isupper()
        return name.rsplit(".", 1)[-1] in _OPTIMIZER_NAMES and name.startswith(("transformers.", "torch_optimizer."))
    return False


def model_root(expression: str) -> str:
    """`self.model.head` -> `self.model`; `model.backbone` -> `model`."""
    parts = expression.split(".")
    if parts[0] in ("self", "cls") and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def parameter_owners(node: cst.CSTNode) -> List[str]:
    """Dotted roots X of every `X.parameters()` / `X.named_parameters()` inside `node`."""
    found: List[str] = []

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in (
                "parameters", "named_parameters"):
            owner = dotted(n.func.value)
            if owner:
                root = model_root(owner)
                if root not in found:
                    found.append(root)
        for child in n.children:
            go(child)

    go(node)
    return found


def optimizers(ctx: Context) -> List[Optimizer]:
    def compute() -> List[Optimizer]:
        out = []
        for call, name in facts(ctx).calls:
            if not _is_optimizer(name, call):
                continue
            params = call.args[0] if call.args and call.args[0].keyword is None else None
            if params is None:
                params = next((a for a in call.args if a.keyword and a.keyword.value == "params"), None)
            models = tuple(parameter_owners(params.value)) if params is not None else ()
            stmt = ctx.statement_of(call)
            target = None
            parent = ctx.parent(call)
            if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
                target = dotted(parent.targets[0].target)
            out.append(Optimizer(call, stmt, target, models))
        return out

    return _cached(ctx, "optimizers", compute)


def trained_models(ctx: Context) -> List[str]:
    """Dotted names of models whose parameters an optimizer trains, in order of appearance."""
    def compute() -> List[str]:
        seen: List[str] = []
        for opt in optimizers(ctx):
            for m in opt.models:
                if m not in seen:
                    seen.append(m)
        return seen

    return _cached(ctx, "trained_models", compute)


# --- entry point ---------------------------------------------------------------------------

def _is_import_line(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr)
            and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def entry(ctx: Context) -> Optional[Entry]:
    """Where setup/cleanup go: first/last statement of the `__main__` block, or for a top-level
    script after the last top-level import and at the end of the module."""
    def compute() -> Optional[Entry]:
        guard = facts(ctx).main_guard
        if guard is not None and isinstance(guard.body, cst.IndentedBlock):
            body = guard.body.body
            return Entry("main-guard", setup_before=body[0], setup_after=None, cleanup_after=body[-1])
        body = ctx.module.body
        if not body:
            return None
        last_import = None
        for stmt in body:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                break
            if _is_import_line(stmt):
                last_import = stmt
        if last_import is None:
            first = body[0]
            if _is_docstring(first) and len(body) > 1:
                return Entry("top-level", None, first, body[-1])
            return Entry("top-level", first, None, body[-1])
        return Entry("top-level", None, last_import, body[-1])

    return _cached(ctx, "entry", compute)

"""Mixed precision: TM401-TM405, TM409, TM410, TM604, and the AMP analysis the AMP family shares.

One analysis (`plan(ctx)`, computed once per file in the first `leave_Module` that asks, cached on
the context) decides everything that must agree across rules: where the training steps are
(a `backward` and an optimizer `step` in one function), whether the file can get AMP at all (no
closure steps, no `model.half()`, no apex O2/O3, ...), which single GradScaler the steps share and
where it is created, which statement runs autocast covers, where `unscale_` goes. Each rule then
reports its own part of the plan, so every rule also works alone (`--select`, `explain` examples)
and exactly one rule edits any given node.

Ownership of call nodes between TM406 (`torch.cuda.amp` -> `torch.amp`) and TM410 (the runtime's
AMP policy): in `ddp`/`amp` migrations with `--amp` other than `off` TM410 turns every existing
`autocast(...)`/`GradScaler(...)` (any flavour) into `tm.autocast(...)`/`tm.GradScaler(...)` and
TM406 leaves those calls alone (`policy_takes`); TM406 modernises in `lint` mode, with
`--amp off`, and for calls TM410 cannot express (`cache_enabled=`, `*args`).
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, remove, replace, wrap
from torchmigrate.imports import dotted
from torchmigrate.nodes import code, expr, kwarg, with_args
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.walk import child_fields

# --- qualified names --------------------------------------------------------------------------

AUTOCAST = frozenset({
    "torch.cuda.amp.autocast", "torch.cpu.amp.autocast", "torch.amp.autocast", "torch.autocast",
    "torch.amp.autocast_mode.autocast", "torch.cuda.amp.autocast_mode.autocast",
    "torch.cpu.amp.autocast_mode.autocast",
})
SCALER = frozenset({
    "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler", "torch.amp.GradScaler", "torch.GradScaler",
    "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.grad_scaler.GradScaler",
})
TM_AUTOCAST = "torchmigrate.runtime.autocast"
TM_SCALER = "torchmigrate.runtime.GradScaler"
TM_NO_SYNC = "torchmigrate.runtime.no_sync"
CLIP = frozenset({
    "torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad_norm",
    "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_",
    "torch.nn.utils.clip_grad.clip_grad_norm", "torch.nn.utils.get_total_norm",
})
BCE_CLASSES = frozenset({"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss"})
BCE_FUNCS = frozenset({"torch.nn.functional.binary_cross_entropy"})
DATA_PARALLEL = frozenset({"torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                           "torch.nn.parallel.data_parallel.DataParallel"})
APEX_AMP = "apex.amp"
# Files that hand precision to a framework are left alone.
FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed",
              "fairscale", "colossalai", "ignite")

BCE_BLOCKED = "uses BCELoss (TM409)"
_DTYPE_TEXT = {"bf16": '"bf16"', "fp16": '"fp16"'}
# Method/function calls that only move or reshape data: a statement made only of these is data
# preparation, not part of the forward pass.
_DATA_METHODS = frozenset({
    "to", "cuda", "cpu", "float", "double", "long", "int", "bool", "half", "view", "reshape",
    "squeeze", "unsqueeze", "permute", "transpose", "contiguous", "detach", "clone", "size",
    "numel", "dim", "items", "values", "keys", "get", "pop", "pin_memory", "type", "flatten",
})
_DATA_FUNCS = frozenset({"next", "iter", "len", "range", "int", "float", "enumerate", "zip", "list",
                         "tuple", "dict", "isinstance", "print", "str", "min", "max", "getattr"})
_BUILTINS = frozenset(dir(builtins))
# Methods that turn a low-precision tensor into something safe for numpy.
_SAFE_CONVERSIONS = frozenset({"argmax", "argmin", "float", "double", "long", "int", "bool", "item",
                               "tolist", "topk", "eq", "ne", "gt", "lt", "ge", "le", "round"})


# --- small helpers ----------------------------------------------------------------------------

def enabled_codes(ctx: Context) -> Set[str]:
    return ctx.facts.setdefault("amp_enabled_rules", set())  # type: ignore[return-value]


# Builtins that read a tensor's value without computing with it in its dtype.
_SHAPE_READS = frozenset({"shape", "device", "dtype", "size", "dim", "ndim", "numel", "requires_grad"})
_ORDER_READS = frozenset({"argmax", "argmin", "argsort"})  # same answer in bf16 up to ties
_TENSOR_BUILTINS = frozenset({"len", "print", "isinstance", "float", "int", "range", "enumerate", "zip", "list",
                              "tuple", "min", "max", "sum", "str", "round", "abs"})


class AmpRule(Rule):
    """Base for the AMP family: registers itself so the plan knows which rules run together."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        enabled_codes(ctx).add(self.code)


def subnodes(node: cst.CSTNode, skip_defs: bool = False) -> Iterator[cst.CSTNode]:
    """Every node under `node` (itself included), reading dataclass fields directly (fast).
    To find nodes of given types, `Context.within` is cheaper: it reads the file's node index."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if skip_defs and n is not node and isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        for name in child_fields(type(n)):
            value = getattr(n, name)
            if isinstance(value, cst.CSTNode):
                stack.append(value)
            elif isinstance(value, (tuple, list)):
                stack.extend(reversed([v for v in value if isinstance(v, cst.CSTNode)]))


def calls_in(ctx: Context, node: cst.CSTNode) -> List[cst.Call]:
    """Calls under `node`, not those inside a function, class or lambda defined there."""
    return _memo(ctx, "amp_calls_in", node, _calls_in)


def _calls_in(ctx: Context, node: cst.CSTNode) -> List[cst.Call]:
    return ctx.within(node, cst.Call, skip_defs=True)  # type: ignore[return-value]


def method_name(call: cst.Call) -> Optional[str]:
    return call.func.attr.value if isinstance(call.func, cst.Attribute) else None


def calls_by_method(ctx: Context) -> Dict[str, List[Tuple[cst.Call, Optional[str]]]]:
    """`{"backward": [(call, resolved name), ...], ...}` for method-style calls, built once."""
    index = ctx.facts.get("amp_by_method")
    if index is None:
        index = {}
        for call, name in analysis.facts(ctx).calls:
            func = call.func
            if type(func) is cst.Attribute:
                index.setdefault(func.attr.value, []).append((call, name))
        ctx.facts["amp_by_method"] = index
    return index  # type: ignore[return-value]


def calls_spelled(ctx: Context, spellings: Iterable[str]) -> List[cst.Call]:
    """Calls whose function is written as one of the dotted `spellings` (`model`, `self.net`),
    i.e. whose `dotted(call.func)` is one of them, in source order.

    Found from the index's Names that head each spelling, following the attributes up to the
    call, instead of spelling the function of every call in the file (tens of thousands)."""
    parent_of = ctx.parents.get
    found = []
    for text in set(spellings):
        head, *attrs = text.split(".")
        for node in ctx.named(head):
            for attr in attrs:
                parent = parent_of(node)
                if type(parent) is not cst.Attribute or parent.value is not node or parent.attr.value != attr:
                    break
                node = parent
            else:
                call = parent_of(node)
                if type(call) is cst.Call and call.func is node:
                    found.append(call)
    found.sort(key=ctx.position)
    return found


def receiver(call: cst.Call) -> Optional[cst.BaseExpression]:
    return call.func.value if isinstance(call.func, cst.Attribute) else None


def unparen(node: cst.BaseExpression) -> cst.BaseExpression:
    return node.with_changes(lpar=[], rpar=[]) if getattr(node, "lpar", None) else node


def target_names(target: cst.CSTNode) -> List[str]:
    if isinstance(target, (cst.Name, cst.Attribute)):
        d = dotted(target)
        return [d] if d else []
    if isinstance(target, cst.Subscript):
        return target_names(target.value)
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in target_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return []


def _memo(ctx: Context, kind: str, node: cst.CSTNode, compute: Callable[[Context, cst.CSTNode], object]):
    """Per-file cache for the subtree helpers below (nodes are immutable). It lives in the
    context's facts, so it goes away with the file; keyed by the node itself, so a node a rule
    built stays alive while cached and its answer cannot pass to a later node at its address."""
    cache = ctx.facts.get(kind)
    if cache is None:
        cache = ctx.facts[kind] = {}
    found = cache.get(node)  # type: ignore[attr-defined]
    if found is None:
        found = cache[node] = compute(ctx, node)  # type: ignore[index]
    return found


# Nodes that bind names through a target: `binds` looks for them, `_targets_of` reads them.
_TARGET_NODES = (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.AsName, cst.NamedExpr)


def binds(ctx: Context, statement: cst.CSTNode) -> Set[str]:
    """Dotted names a statement assigns (recursing into compound statements, not into defs)."""
    return _memo(ctx, "amp_binds", statement, _binds)


def _binds(ctx: Context, statement: cst.CSTNode) -> Set[str]:
    out: Set[str] = set()
    for n in ctx.within(statement, *_TARGET_NODES, skip_defs=True):
        out.update(_targets_of(n))
    return out


def _targets_of(n: cst.CSTNode) -> List[str]:
    """Dotted names an assignment, loop, `as` or walrus node binds (none for other nodes)."""
    if isinstance(n, cst.Assign):
        return [name for t in n.targets for name in target_names(t.target)]
    if isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.NamedExpr)):
        return target_names(n.target)
    if isinstance(n, cst.AsName):
        return target_names(n.name)
    return []


def _binds_all(ctx: Context) -> Set[str]:
    """Names bound anywhere in the file, inside functions too, with their parameters."""
    out = {n.name.value for n in ctx.nodes(cst.Param, cst.FunctionDef, cst.ClassDef)}  # type: ignore[attr-defined]
    for n in ctx.nodes(*_TARGET_NODES):
        out.update(_targets_of(n))
    return out


def reads(ctx: Context, node: cst.CSTNode) -> Set[str]:
    """Dotted names (and their prefixes) read anywhere under `node`, not inside defs there."""
    return _memo(ctx, "amp_reads", node, _reads)


def _reads(ctx: Context, node: cst.CSTNode) -> Set[str]:
    out: Set[str] = set()
    for n in ctx.within(node, cst.Name, cst.Attribute, skip_defs=True):
        d = dotted(n)
        if d:
            parts = d.split(".")
            for i in range(1, len(parts) + 1):
                out.add(".".join(parts[:i]))
    return out


def root_name(node: cst.BaseExpression) -> Optional[str]:
    """`loss` for `loss`, `loss.mean()`, `losses["total"]`, `self.loss`; None for other shapes."""
    while True:
        if isinstance(node, (cst.Name, cst.Attribute)):
            return dotted(node)
        if isinstance(node, cst.Subscript):
            node = node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            node = node.func.value
        else:
            return None


def statements(body) -> Sequence[cst.CSTNode]:
    if isinstance(body, (cst.IndentedBlock, cst.Module)):
        return body.body
    return ()


def block_of(ctx: Context, statement: cst.CSTNode) -> Tuple[Optional[cst.CSTNode], Sequence[cst.CSTNode]]:
    parent = ctx.parent(statement)
    if isinstance(parent, (cst.IndentedBlock, cst.Module)):
        return parent, parent.body
    return None, ()


def line_of(ctx: Context, node: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The statement line holding `node`, or None when it sits in a one-line suite or a header."""
    small = ctx.enclosing(node, cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.BaseCompoundStatement)
    return small if isinstance(small, cst.SimpleStatementLine) else None


def owner_statement(ctx: Context, block: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The compound statement whose suite `block` is (climbing through Else/ExceptHandler/...)."""
    node = ctx.parent(block)
    while node is not None and not isinstance(node, (cst.BaseCompoundStatement, cst.Module)):
        node = ctx.parent(node)
    return node if isinstance(node, cst.BaseCompoundStatement) else None


def in_orelse(ctx: Context, statement: cst.CSTNode, owner: cst.CSTNode) -> bool:
    node = statement
    while node is not None and node is not owner:
        parent = ctx.parent(node)
        if parent is owner:
            return node is not getattr(owner, "body", None)
        node = parent
    return False


def scope_of(ctx: Context, node: cst.CSTNode) -> cst.CSTNode:
    cache = ctx.facts.setdefault("amp_scopes", {})
    found = cache.get(node)
    if found is None:
        n = ctx.parents.get(node)
        while n is not None and type(n) not in (cst.FunctionDef, cst.Lambda):
            n = ctx.parents.get(n)
        found = n if n is not None else ctx.module
        cache[node] = found
    return found


def class_of(ctx: Context, func: cst.CSTNode) -> Optional[cst.ClassDef]:
    if isinstance(func, cst.FunctionDef):
        block = ctx.parent(func)
        klass = ctx.parent(block) if block is not None else None
        return klass if isinstance(klass, cst.ClassDef) else None
    return None


def is_visible(ctx: Context, creation: cst.CSTNode, use: cst.CSTNode) -> bool:
    """A plain name assigned in scope `creation` can be read from scope `use`."""
    if creation is ctx.module or creation is use:
        return True
    node = use
    while node is not None and node is not ctx.module:
        node = ctx.enclosing(node, cst.FunctionDef, cst.Lambda)
        if node is creation:
            return True
    return False


def _looks_like_optimizer(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    if any(x in last for x in ("sched", "scaler", "warmup", "lr_")):
        return False
    return last.startswith("opt") or "optim" in last


def removal(ctx: Context, small: cst.CSTNode):
    """An edit removing a small statement: the whole line when it is the only one there, so
    insertions anchored on that line (the runtime import goes after the last import) survive."""
    line = ctx.parent(small)
    if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        return remove(line)
    return remove(small)


def dotted_node(text: str) -> cst.BaseExpression:
    """`a.b.c` built directly (parsing a snippet costs about a millisecond)."""
    parts = text.split(".")
    node: cst.BaseExpression = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


def expr_of(text: str) -> cst.BaseExpression:
    if all(part.isidentifier() for part in text.split(".")):
        return dotted_node(text)
    return expr(text)


def call_node(func: str, *args: cst.BaseExpression, **kwargs: cst.BaseExpression) -> cst.Call:
    items = [cst.Arg(a) for a in args] + [kwarg(k, v) for k, v in kwargs.items()]
    return with_args(cst.Call(func=dotted_node(func)), items)


def call_stmt(call: cst.BaseExpression, target: Optional[str] = None) -> cst.SimpleStatementLine:
    if target is None:
        return cst.SimpleStatementLine([cst.Expr(call)])
    return cst.SimpleStatementLine([cst.Assign(targets=[cst.AssignTarget(dotted_node(target))], value=call)])


def literal(text: str) -> cst.BaseExpression:
    if text.startswith('"'):
        return cst.SimpleString(text)
    return cst.Name(text)


def runtime_kwargs(ctx: Context, scaler: bool = False) -> Dict[str, cst.BaseExpression]:
    if scaler and ctx.options.amp == "off":
        return {"enabled": cst.Name("False")}
    text = _DTYPE_TEXT.get(ctx.options.amp)
    return {"dtype": cst.SimpleString(text)} if text else {}


def with_node(call: cst.Call, body: Sequence[cst.BaseStatement]) -> cst.With:
    return cst.With(items=[cst.WithItem(call)], body=cst.IndentedBlock(body=list(body)))


def runtime_call(ctx: Context, helper: str, args: str = "") -> str:
    return f"{ctx.tm}.{helper}({args})"


def dtype_arg(ctx: Context) -> str:
    text = _DTYPE_TEXT.get(ctx.options.amp)
    return f"dtype={text}" if text else ""


# --- the plan ---------------------------------------------------------------------------------

@dataclass
class Site:
    """One training backward: `loss.backward()`, an already scaled one, or apex's scale_loss block."""

    call: Optional[cst.Call]  # the .backward() call (None for an apex block without one)
    statement: cst.CSTNode  # the statement holding it (the `with amp.scale_loss` block for apex)
    scope: cst.CSTNode
    loss: Optional[cst.BaseExpression]
    kind: str  # "plain", "scaled", "apex"
    paired: bool = False  # the else-branch of an optional-AMP `if`: left alone


@dataclass
class Step:
    call: cst.Call
    scope: cst.CSTNode
    optimizer: Optional[cst.BaseExpression]  # the optimizer expression
    kind: str  # "plain", "scaled", "closure"


@dataclass
class Region:
    first: cst.CSTNode
    last: cst.CSTNode
    kind: str  # "train" or "eval"
    models: List[str] = field(default_factory=list)
    float_after: List[str] = field(default_factory=list)  # forward outputs read after the block


@dataclass
class ScalerInfo:
    text: str  # expression to use: `scaler`, `self.scaler`
    new: bool
    after: Optional[cst.CSTNode] = None  # insert the creation after this statement
    create: str = ""  # the creation statement
    scope: Optional[cst.CSTNode] = None  # function/module whose name it is (None: a `self.` attribute)
    klass: Optional[cst.ClassDef] = None  # for `self.scaler`
    unconditional: bool = True  # always bound (not `GradScaler() if amp else None`, not in an `if`)
    before: Optional[cst.CSTNode] = None  # ...or before this one (a use would come first otherwise)
    dtype: Optional[cst.BaseExpression] = None  # the constant dtype of the file's own autocasts


def scaler_visible(ctx: Context, info: ScalerInfo, node: cst.CSTNode) -> bool:
    """`info.text` can be used at `node`: the scaler is always bound there (a parameter of the
    same name, `train(..., scaler)`, counts)."""
    if not info.unconditional:
        return False
    use = scope_of(ctx, node)
    if info.text.startswith("self."):
        return info.klass is not None and class_of(ctx, use) is info.klass
    if isinstance(use, cst.FunctionDef):
        p = use.params
        if any(x.name.value == info.text for x in (*p.posonly_params, *p.params, *p.kwonly_params)):
            return True
    return info.scope is not None and is_visible(ctx, info.scope, use)


@dataclass
class Plan:
    skip: bool = False  # a framework manages precision, or nothing to do
    adding: bool = False  # this run adds AMP where it is missing
    sites: List[Site] = field(default_factory=list)
    steps: List[Step] = field(default_factory=list)
    blockers: List[Tuple[str, cst.CSTNode, str]] = field(default_factory=list)
    scaler: Optional[ScalerInfo] = None
    scaler_owner: Optional[str] = None  # "TM402" or "TM407": creates the scaler, converts steps
    regions: List[Region] = field(default_factory=list)
    region_manual: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    bce: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)  # TM409 findings
    scale_calls: List[cst.Call] = field(default_factory=list)  # backward calls to scale
    step_calls: List[Step] = field(default_factory=list)  # steps to route through the scaler
    updates: List[Tuple[cst.CSTNode, cst.CSTNode]] = field(default_factory=list)  # (after, anchor)
    unscales: List[Tuple[cst.CSTNode, List[str]]] = field(default_factory=list)  # (before stmt, optimizers)
    apex_unscales: Dict[cst.CSTNode, List[str]] = field(default_factory=dict)
    backward_moves: List[cst.With] = field(default_factory=list)
    backward_inside: List[cst.CSTNode] = field(default_factory=list)
    existing_scalers: List[Tuple[str, cst.Call]] = field(default_factory=list)
    autocast_withs: List[cst.With] = field(default_factory=list)


def plan(ctx: Context) -> Plan:
    cached = ctx.facts.get("amp_plan")
    if cached is None:
        planner = _Planner(ctx)
        cached = planner.build()
        ctx.facts["amp_plan"] = cached
        ctx.facts["amp_planner"] = planner
    return cached  # type: ignore[return-value]


def policy_active(ctx: Context) -> bool:
    """TM410 rewrites existing autocast/GradScaler calls to the runtime's in this run."""
    return ctx.options.migrating and ctx.options.amp != "off" and "TM410" in enabled_codes(ctx)


def convertible_call(call: cst.Call, qualified: str) -> bool:
    """TM410 can express this autocast/GradScaler call with the runtime's helpers."""
    if any(a.star for a in call.args):
        return False
    if qualified in AUTOCAST:
        legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
        params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
        positional = [a for a in call.args if a.keyword is None]
        if len(positional) > len(params):
            return False
        names = [p for p, _ in zip(params, positional)] + [a.keyword.value for a in call.args if a.keyword]
        return "cache_enabled" not in names
    return qualified in SCALER


def policy_takes(ctx: Context, call: cst.Call, qualified: Optional[str]) -> bool:
    return bool(qualified) and (qualified in AUTOCAST or qualified in SCALER) and policy_active(ctx) \
        and convertible_call(call, qualified)


class _Planner:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.facts = analysis.facts(ctx)
        self.p = Plan()
        self.order_cache: Dict[cst.CSTNode, Dict[cst.CSTNode, int]] = {}
        self.contains: Set[cst.CSTNode] = set()  # statements (and ancestors) holding a backward/step
        self.region_sites: Set[int] = set()  # id() of sites whose loss gets a new autocast region
        self.resolved = {call: name for call, name in self.facts.calls}

    # -- entry ------------------------------------------------------------------------------
    def build(self) -> Plan:
        ctx, p = self.ctx, self.p
        if any(ctx.imports.imports_module(f) for f in FRAMEWORKS):
            p.skip = True
            return p
        self.collect()
        enabled = enabled_codes(ctx)
        apex_sites = [s for s in p.sites if s.kind == "apex"]
        from_apex = bool(apex_sites) and apex_o1(ctx)
        amp_on = ctx.options.amp != "off"
        p.adding = amp_on and (ctx.options.migrating or (from_apex and "TM407" in enabled))
        self.training_scopes()
        self.find_blockers()
        if p.adding and not p.blockers:
            self.train_regions()  # first: a new scaler goes only where a step runs under autocast
        self.choose_scaler(from_apex)
        if p.blockers:  # no place for the scaler: no autocast either
            p.regions, p.region_manual, self.region_sites = [], [], set()
        self.bce_checks()
        if p.adding and not p.blockers:
            self.eval_regions()
        self.existing_autocast_checks()
        if p.scaler is not None:
            self.unscale_points()
        for region in p.regions:
            region.float_after = self.float_after(region)
        return p

    # -- collection -------------------------------------------------------------------------
    def collect(self) -> None:
        ctx, p = self.ctx, self.p
        scaler_names: Set[str] = set()
        holders: Set[str] = set()  # variables holding an autocast context (or factory)
        factories: Set[str] = set()  # same-file functions returning one
        for call, name in self.facts.calls:
            if name in SCALER or name == TM_SCALER:
                target = analysis._assign_target(ctx, call)
                if target:
                    p.existing_scalers.append((target, call))
                    scaler_names.add(target)
            elif name in AUTOCAST or name == TM_AUTOCAST:
                parent = ctx.parent(call)
                if isinstance(parent, cst.WithItem):
                    with_node = ctx.parent(parent)
                    if isinstance(with_node, cst.With):
                        p.autocast_withs.append(with_node)
                else:
                    self.autocast_holder(call, holders, factories)
            elif name == "functools.partial" and call.args and (
                    self.ctx.resolve(call.args[0].value) in AUTOCAST | {TM_AUTOCAST}):
                self.autocast_holder(call, holders, factories)  # `amp = partial(torch.autocast, "cuda")`
        if holders or factories:
            self.autocast_context_withs(holders, factories)
        self.scaler_names = scaler_names
        self.autocast_set = set(p.autocast_withs)
        apex_withs: Dict[cst.With, cst.Call] = {}
        for call, name in self.facts.calls:
            if name == f"{APEX_AMP}.scale_loss":
                item = ctx.parent(call)
                w = ctx.parent(item) if isinstance(item, cst.WithItem) else None
                if isinstance(w, cst.With):
                    apex_withs[w] = call
        by_method = calls_by_method(ctx)
        for call, name in by_method.get("backward", ()):
            self.add_backward(call, apex_withs)
        for call, name in by_method.get("step", ()):
            self.add_step(call)
        for w, call in apex_withs.items():
            loss = call.args[0].value if call.args else None
            p.sites.append(Site(None, w, scope_of(ctx, w), loss, "apex"))
        for site in p.sites:
            self.mark(site.statement)
        for step in p.steps:
            self.mark(ctx.statement_of(step.call))

    def autocast_holder(self, call: cst.Call, holders: Set[str], factories: Set[str]) -> None:
        """Record where an autocast context made outside a `with` goes: a variable (`ctx =
        nullcontext() if cpu else torch.autocast(...)`, nanoGPT) or a function's return value."""
        ctx = self.ctx
        node: cst.CSTNode = call
        while True:
            parent = ctx.parent(node)
            if isinstance(parent, (cst.IfExp, cst.BooleanOperation)) and getattr(parent, "test", None) is not node:
                node = parent
                continue
            if isinstance(parent, cst.Assign) and parent.value is node:
                holders.update(d for t in parent.targets for d in [dotted(t.target)] if d)
            elif isinstance(parent, (cst.AnnAssign, cst.AugAssign)) and parent.value is node:
                d = dotted(parent.target)
                if d:
                    holders.add(d)
            elif isinstance(parent, cst.Return):
                func = ctx.enclosing(parent, cst.FunctionDef, cst.Lambda)
                if isinstance(func, cst.FunctionDef):
                    factories.add(func.name.value)
            return

    def autocast_context_withs(self, holders: Set[str], factories: Set[str]) -> None:
        """`with ctx:`, `with ctx():`, `with self.amp_ctx:`, `with get_autocast():` where the
        name holds an autocast context: the block runs under autocast."""
        p = self.p
        for call, _ in self.facts.calls:  # `with holder(...)` / `with factory(...)`
            func = call.func
            d = dotted(func)
            name = func.attr.value if isinstance(func, cst.Attribute) else d
            if not (d in holders or name in factories):
                continue
            item = self.ctx.parent(call)
            w = self.ctx.parent(item) if isinstance(item, cst.WithItem) else None
            if isinstance(w, cst.With) and w not in p.autocast_withs:
                p.autocast_withs.append(w)
        for w in self.with_statements():  # `with holder:`
            if w in p.autocast_withs:
                continue
            if any(isinstance(i.item, (cst.Name, cst.Attribute)) and dotted(i.item) in holders for i in w.items):
                p.autocast_withs.append(w)

    def with_statements(self) -> List[cst.With]:
        return self.ctx.nodes(cst.With)  # type: ignore[return-value]

    def mark(self, node: Optional[cst.CSTNode]) -> None:
        while node is not None and node not in self.contains:
            self.contains.add(node)
            node = self.ctx.parent(node)

    def add_backward(self, call: cst.Call, apex_withs) -> None:
        ctx = self.ctx
        recv = receiver(call)
        if recv is None or any(a.keyword is None for a in call.args):
            return  # `accelerator.backward(loss)`, `engine.backward(loss)`: not a tensor backward
        if self.resolved.get(call) is not None:
            return  # `torch.autograd.backward`-like module functions
        statement = ctx.statement_of(call)
        if statement is None:
            return
        with_node = ctx.enclosing(call, cst.With)
        if with_node in apex_withs and isinstance(recv, cst.Name):
            item = apex_withs[with_node]
            asname = next((i.asname for i in with_node.items if i.item is item and i.asname), None)
            if asname is not None and dotted(asname.name) == recv.value:
                return  # `scaled_loss.backward()` inside apex's block: part of the apex site
        kind = "plain"
        if isinstance(recv, cst.Call) and method_name(recv) == "scale":
            kind = "scaled"
            loss = recv.args[0].value if recv.args else None
        else:
            loss = recv
        self.p.sites.append(Site(call, statement, scope_of(ctx, call), loss, kind))

    def add_step(self, call: cst.Call) -> None:
        ctx = self.ctx
        recv = receiver(call)
        name = dotted(recv) if recv is not None else None
        if name is None:
            return
        if name in self.scaler_names or name.rsplit(".", 1)[-1] in ("scaler", "grad_scaler", "amp_scaler"):
            opt = call.args[0].value if call.args else None
            self.p.steps.append(Step(call, scope_of(ctx, call), opt, "scaled"))
            return
        targets = {o.target for o in analysis.optimizers(ctx) if o.target}
        if name not in targets and not _looks_like_optimizer(name):
            return
        kind = "closure" if call.args else "plain"
        self.p.steps.append(Step(call, scope_of(ctx, call), recv, kind))

    # -- which functions train ---------------------------------------------------------------
    def training_scopes(self) -> None:
        p = self.p
        steps_by_scope: Dict[cst.CSTNode, List[Step]] = {}
        for s in p.steps:
            steps_by_scope.setdefault(s.scope, []).append(s)
        kept = []
        for site in p.sites:
            if site.scope in steps_by_scope or site.kind == "apex":
                kept.append(site)
        p.sites = kept  # a backward without a step in its function is not a training step
        sites_by_scope = {s.scope for s in p.sites}
        for site in p.sites:
            if site.kind == "plain":
                site.paired = self.is_paired(site)
        self.steps_by_scope = steps_by_scope
        self.sites_by_scope = sites_by_scope

    def is_paired(self, site: Site) -> bool:
        """`if use_amp: scaler.scale(loss).backward() else: loss.backward()`: the plain branch
        is the non-AMP path of an optional-AMP script and stays as it is."""
        ctx = self.ctx
        node = site.statement
        while True:
            if_node = ctx.enclosing(node, cst.If, cst.FunctionDef)
            if not isinstance(if_node, cst.If):
                return False
            others = [s for s in self.p.sites if s.kind == "scaled" and s is not site
                      and if_node in set(ctx.ancestors(s.statement))]
            if others:
                return True
            node = if_node

    def find_blockers(self) -> None:
        ctx, p = self.ctx, self.p
        for step in p.steps:
            if step.kind == "closure":
                p.blockers.append(("TM402", step.call,
                                   "optimizer closures are not supported with GradScaler: compute the "
                                   "loss outside the closure to use mixed precision, or keep fp32"))
            elif step.scope not in self.sites_by_scope and step.kind == "plain" and p.sites:
                p.blockers.append(("TM402", step.call,
                                   f"`{code(step.call)}` runs in a function without the `backward()` it "
                                   "applies: scale that loss with the GradScaler (`scaler.scale(loss)."
                                   "backward()`) and step through it (`scaler.step(opt); scaler.update()`)"))
        if any(s.kind == "apex" for s in p.sites) and not apex_o1(ctx):
            level, init = apex_level(ctx)
            p.blockers.append(("TM407", init or p.sites[0].statement, f"apex opt_level {level}"))
        models = set(analysis.trained_models(ctx))
        for call, name in calls_by_method(ctx).get("half", ()):
            recv = receiver(call)
            target = analysis._assign_target(ctx, call)
            owner = root_name(recv) if recv is not None else None
            if (owner and analysis.model_root(owner) in models) or (target and target in models):
                p.blockers.append(("TM402", call,
                                   "`.half()` trains in pure fp16 (no fp32 master weights): remove it and "
                                   "let autocast + GradScaler handle precision"))

    # -- scaler ---------------------------------------------------------------------------
    def choose_scaler(self, from_apex: bool) -> None:
        ctx, p = self.ctx, self.p
        enabled = enabled_codes(ctx)
        needs = [s for s in p.sites if s.kind in ("plain", "apex") and not s.paired]
        plain_steps = [s for s in p.steps if s.kind == "plain" and s.scope in self.sites_by_scope]
        if not needs and not (p.existing_scalers and plain_steps):
            if p.existing_scalers:
                p.scaler = self.existing_scaler()  # for unscale_ (TM403) and checkpoints (TM503)
            return
        if p.blockers and (not any(s.kind == "apex" for s in needs) or any(b[0] == "TM407" for b in p.blockers)):
            return
        if "TM402" in enabled:
            owner = "TM402"
        elif from_apex and "TM407" in enabled:
            owner = "TM407"
        else:
            owner = None
        # Loss scaling belongs to autocast: the scaler serves the functions where a training
        # forward runs under autocast (existing, or added by this run) or a loss is already
        # scaled, not steps autocast was withheld from (TM409's BCELoss, numpy outputs, inline
        # forwards). In a function with both, every loss is scaled (harmless in fp32).
        served = {s.scope for s in p.sites if not s.paired and (
            s.kind in ("scaled", "apex") or self.under_autocast(s))}
        existing = self.existing_scaler()
        if existing is not None:
            p.scaler = existing
            self.scaler_scopes &= served
        elif p.existing_scalers or owner is None or not (p.adding or from_apex):
            return  # several scalers already: the file manages its own
        else:
            if not served & {s.scope for s in needs}:
                return
            needs = [s for s in needs if s.scope in served]
            p.scaler = self.new_scaler(served)
            if p.scaler is None:
                return
            if not p.regions and not runtime_kwargs(ctx, scaler=True):
                # `autocast(dtype=torch.float16)` of the user's: a scaler enabled for that dtype
                p.scaler.dtype = _caller_dtype(ctx)
                if p.scaler.dtype is not None:
                    p.scaler.create = p.scaler.create.replace(
                        "GradScaler()", f"GradScaler(dtype={code(p.scaler.dtype)})")
        p.scaler_owner = owner
        scaler_scopes = self.scaler_visible_from
        for site in needs:
            if site.kind == "plain" and site.call is not None:
                if scaler_scopes(site.scope):
                    p.scale_calls.append(site.call)
        scaled = [s for s in p.sites if s.kind == "scaled"]
        for step in plain_steps:
            if any(self.exclusive(step.call, s.statement) for s in scaled):
                continue  # the non-AMP branch of an optional-AMP `if`
            if scaler_scopes(step.scope):
                p.step_calls.append(step)
        self.plan_updates()

    def scaler_visible_from(self, scope: cst.CSTNode) -> bool:
        info = self.p.scaler
        if info is None:
            return False
        return scope in self.scaler_scopes

    def existing_scaler(self) -> Optional[ScalerInfo]:
        ctx, p = self.ctx, self.p
        if len({t for t, _ in p.existing_scalers}) != 1:
            return None
        target, call = p.existing_scalers[0]
        assign = ctx.parent(call)
        creation_scope = scope_of(ctx, call)
        klass = class_of(ctx, creation_scope) if target.startswith("self.") else None
        # `scaler = GradScaler() if use_amp else None` / created only in one branch: the plain
        # path may run without it, so nothing is added that uses it.
        unconditional = (isinstance(assign, cst.Assign) and assign.value is call
                         and self.hoist(ctx.statement_of(call)) is ctx.statement_of(call))
        info = ScalerInfo(target, new=False, scope=creation_scope, klass=klass, unconditional=unconditional)
        scopes = {s.scope for s in p.sites} | {s.scope for s in p.steps}
        self.scaler_scopes = {s for s in scopes if scaler_visible(ctx, info, s)}
        return info

    def hoist(self, statement: cst.CSTNode) -> cst.CSTNode:
        """Climb out of if/else/try/with blocks (not loops or functions) of the same scope."""
        ctx = self.ctx
        node = statement
        while True:
            block = ctx.parent(node)
            if block is None or isinstance(block, cst.Module):
                return node
            owner = owner_statement(ctx, block)
            if owner is self.facts.main_guard and block is owner.body:
                return node  # the `__main__` block always runs (as module scope)
            if isinstance(owner, (cst.If, cst.Try, cst.With)) or type(owner).__name__ == "TryStar":
                # an `elif` is an If inside the outer If's orelse
                while isinstance(ctx.parent(owner), cst.If) or isinstance(ctx.parent(owner), cst.Else):
                    outer = owner_statement(ctx, ctx.parent(owner)) if isinstance(ctx.parent(owner), cst.Else) else ctx.parent(owner)
                    if not isinstance(outer, cst.If):
                        break
                    owner = outer
                node = owner
                continue
            return node

    def under_autocast(self, site: Site) -> bool:
        """The forward and loss of this backward run under autocast after the migration (or
        the model's own `forward` enters autocast, as recommended for DataParallel)."""
        if self.covered(site.statement) or self.forward_autocast():
            return True
        last, why = self.loss_definition(site)
        if why or last is None:
            return False
        return self.covered(last) or last in self.autocast_set or id(site) in self.region_sites

    def forward_autocast(self) -> bool:
        """A `forward` method of this file runs under autocast (a `with` or a decorator), or TM405
        puts one under autocast in this run: the scaler then comes in this run, not the next."""
        cached = getattr(self, "_forward_autocast", None)
        if cached is None:
            nodes: List[cst.CSTNode] = list(self.p.autocast_withs)
            nodes += [c for c, n in self.facts.calls if (n in AUTOCAST or n == TM_AUTOCAST)
                      and isinstance(self.ctx.parent(c), cst.Decorator)]
            cached = any(getattr(self.ctx.enclosing(n, cst.FunctionDef), "name", None) is not None
                         and self.ctx.enclosing(n, cst.FunctionDef).name.value == "forward" for n in nodes)
            self._forward_autocast = cached or self.dp_forward_wrapped()
        return self._forward_autocast

    def dp_forward_wrapped(self) -> bool:
        """TM405 wraps a DataParallel model's `forward` in autocast in this run."""
        ctx = self.ctx
        if ctx.options.mode != "amp" or "TM405" not in enabled_codes(ctx) or ctx.options.amp in ("off", "fp16") \
                or self.p.blockers:
            return False
        return any(wrappable_forward(ctx, call)[1] for call, name in self.facts.calls if name in DATA_PARALLEL and call.args)

    def new_scaler(self, amp_scopes: Set[cst.CSTNode]) -> Optional[ScalerInfo]:
        ctx, p = self.ctx, self.p
        args = dtype_arg(ctx)
        if ctx.options.amp == "off":
            args = "enabled=False"
        creation = runtime_call(ctx, "GradScaler", args)
        use_scopes = {s.scope for s in p.sites if not s.paired} | {s.scope for s in p.steps if s.scope in self.sites_by_scope}
        use_scopes &= amp_scopes
        receivers = {dotted(s.optimizer) for s in p.steps if s.kind == "plain" and s.optimizer is not None
                     and s.scope in use_scopes}
        receivers.discard(None)
        taken = self.bound_names()
        # trainer classes: `self.optimizer` -> `self.scaler` next to it
        if receivers and all(r.startswith("self.") for r in receivers):
            classes = {class_of(self.ctx, s) for s in use_scopes}
            if len(classes) != 1 or None in classes:
                return self.scaler_blocker("the training steps use `self.<optimizer>` from several classes")
            klass = classes.pop()
            anchor = self.creation_anchor(receivers, klass=klass)
            if anchor is None:
                return self.scaler_blocker("cannot find where `self.<optimizer>` is created")
            name = "self.scaler" if "self.scaler" not in taken else "self.grad_scaler"
            self.scaler_scopes = {s for s in use_scopes}
            return ScalerInfo(name, True, anchor, f"{name} = {creation}", klass=klass)
        name = next(n for n in ("scaler", "grad_scaler", "amp_scaler", "tm_scaler") if n not in taken)
        anchor = self.creation_anchor(receivers)
        if anchor is not None:
            creation_scope = scope_of(ctx, anchor)
            if all(is_visible(ctx, creation_scope, s) for s in use_scopes):
                self.scaler_scopes = set(use_scopes)
                after, before = self.before_uses(anchor, creation_scope, use_scopes)
                return ScalerInfo(name, True, after, f"{name} = {creation}", scope=creation_scope, before=before)
        if any(class_of(ctx, s) is not None and any(
                st.optimizer is not None and (dotted(st.optimizer) or "").startswith("self.")
                for st in p.steps if st.scope is s) for s in use_scopes):
            return self.scaler_blocker("the training steps mix `self.<optimizer>` and plain names")
        # The optimizer is created in another function (`main()` builds it, `train(...)` steps
        # it): one module-level scaler that every function sees.
        anchor = _module_anchor(ctx)
        self.scaler_scopes = set(use_scopes)
        return ScalerInfo(name, True, anchor, f"{name} = {creation}", scope=ctx.module)

    def before_uses(self, anchor: cst.CSTNode, scope: cst.CSTNode,
                    use_scopes: Set[cst.CSTNode]) -> Tuple[Optional[cst.CSTNode], Optional[cst.CSTNode]]:
        """(after, before): create the scaler after `anchor` unless code that uses it runs
        there first (a hoisted `if` that also holds the training loop, a call of the training
        function above it); then before the first statement of that block that uses it."""
        ctx, p = self.ctx, self.p
        points: List[cst.CSTNode] = [s.statement for s in p.sites if s.scope is scope and not s.paired]
        points += [s.call for s in p.steps if s.scope is scope and s.kind == "plain"]
        # calls of the functions that use it, followed through their callers in this file
        frontier = {s for s in use_scopes if s is not scope and isinstance(s, cst.FunctionDef)}
        seen = set(frontier)
        depth = 0
        while frontier and depth < 4:
            depth += 1
            names = {f.name.value for f in frontier}
            frontier = set()
            for call, _ in self.facts.calls:
                func = call.func
                called = func.value if isinstance(func, cst.Name) else (
                    func.attr.value if isinstance(func, cst.Attribute) else None)
                if called not in names:
                    continue
                where = scope_of(ctx, call)
                if where is scope:
                    points.append(call)
                elif isinstance(where, cst.FunctionDef) and where not in seen:
                    seen.add(where)
                    frontier.add(where)
        def first_use(at: cst.CSTNode) -> Tuple[Optional[int], bool]:
            """(index of the first statement of `at`'s block at or before `at` that uses the
            scaler, whether some use lies outside that block)"""
            block, body = block_of(ctx, at)
            body = list(body)
            index = body.index(at)
            earliest, outside = None, False
            for point in points:
                node = point
                while node is not None and ctx.parent(node) is not block:
                    node = ctx.parent(node)
                if node is None:
                    outside = True
                    continue
                i = body.index(node)
                if i <= index and (earliest is None or i < earliest):
                    earliest = i
            return earliest, outside

        if block_of(ctx, anchor)[0] is None:
            return anchor, None
        earliest, _ = first_use(anchor)
        if earliest is None:
            return anchor, None
        # `if cfg.train: optimizer = ...; train(...)`: right after the optimizer when every use
        # follows it in its own block, else before the first statement that uses the scaler
        origin = self.anchor_origin
        if origin is not None and origin is not anchor and block_of(ctx, origin)[0] is not None:
            inner, outside = first_use(origin)
            if inner is None and not outside:
                return origin, None
        return None, list(block_of(ctx, anchor)[1])[earliest]

    def scaler_blocker(self, why: str) -> None:
        step = next((s for s in self.p.steps if s.kind == "plain"), None)
        node = step.call if step is not None else self.p.sites[0].statement
        self.p.blockers.append(("TM402", node, f"cannot place one GradScaler for all steps ({why}): "
                                               "create `scaler = tm.GradScaler()` beside the optimizer and "
                                               "use `scaler.scale(loss).backward()`, `scaler.step(opt)`, "
                                               "`scaler.update()`"))
        return None

    def creation_anchor(self, receivers: Set[str], klass: Optional[cst.ClassDef] = None) -> Optional[cst.CSTNode]:
        """The statement after which the scaler is created: the (hoisted) creation of the first
        optimizer the steps use, moved past directly following optimizer creations."""
        ctx = self.ctx
        self.anchor_origin: Optional[cst.CSTNode] = None
        candidates: List[cst.CSTNode] = []
        opts = analysis.optimizers(ctx)
        for o in opts:
            if o.target in receivers and o.statement is not None:
                candidates.append(o.statement)
        if not candidates:
            for assign in self.facts.assigns:
                if any(dotted(t.target) in receivers for t in assign.targets):
                    candidates.append(ctx.statement_of(assign))
        if not candidates and klass is None:
            # `for opt in optimizers: opt.step()`: beside wherever the optimizers are built
            candidates = [o.statement for o in opts if o.statement is not None and o.via is None]
        if klass is not None:
            candidates = [c for c in candidates if ctx.enclosing(c, cst.ClassDef) is klass]
        candidates = [c for c in candidates if isinstance(c, (cst.SimpleStatementLine, cst.BaseCompoundStatement))]
        if not candidates:
            return None
        self.anchor_origin = candidates[0]
        first = self.hoist(candidates[0])
        block, body = block_of(ctx, first)
        if block is None:
            return None
        hoisted = {self.hoist(c) for c in candidates} | {self.hoist(o.statement) for o in opts if o.statement is not None}
        index = list(body).index(first)
        while index + 1 < len(body) and body[index + 1] in hoisted:
            index += 1
        return body[index]

    def bound_names(self) -> Set[str]:
        out: Set[str] = set()
        for assign in self.facts.assigns:
            for t in assign.targets:
                if type(t.target) is cst.Name:
                    out.add(t.target.value)
                else:
                    out.update(target_names(t.target))
        for func in self.facts.functions.values():
            p = func.params
            for param in (*p.posonly_params, *p.params, *p.kwonly_params):
                out.add(param.name.value)
        out.update(self.ctx.imports.names)
        for name, _ in self.p.existing_scalers:
            out.discard(name)
        return out

    def plan_updates(self) -> None:
        """`scaler.update()` once after the last step of each block (a repeated optimizer starts
        a new group); after the whole loop for `for opt in optimizers: opt.step()`.

        Steps nested in a later statement of the block (`if i % 4 == 0: r1.backward();
        d_optim.step()`) count too: an optimizer of the group stepped again there needs an
        update first ("step() has already been called since the last update()"); steps there
        that apply the same backward's gradients (`dec.step(); if enc: enc.step()`) come before
        the group's update, which then follows that statement instead of theirs."""
        ctx, p = self.ctx, self.p
        by_block: Dict[cst.CSTNode, List[Tuple[cst.CSTNode, Step]]] = {}
        block_of_step: Dict[int, cst.CSTNode] = {}
        for step in p.step_calls:
            line = line_of(ctx, step.call)
            if line is None:
                small = ctx.enclosing(step.call, cst.BaseSmallStatement)
                if isinstance(small, cst.Expr) and small.value is step.call:
                    p.updates.append((small, small))
                continue
            anchor = line
            block, body = block_of(ctx, line)
            owner = owner_statement(ctx, block) if isinstance(block, cst.IndentedBlock) else None
            if (isinstance(owner, cst.For) and isinstance(owner.target, cst.Name)
                    and step.optimizer is not None and dotted(step.optimizer) == owner.target.value):
                anchor = owner
                block, body = block_of(ctx, owner)
            if block is None:
                continue
            by_block.setdefault(block, []).append((anchor, step))
            block_of_step[id(step)] = block

        def key_of(step: Step) -> str:
            return code(step.optimizer) if step.optimizer is not None else ""

        def nested_steps(statement: cst.CSTNode, scope: cst.CSTNode) -> List[Step]:
            return [s for s in p.step_calls if s.scope is scope and id(s) in block_of_step
                    and statement in set(ctx.ancestors(s.call))]

        def has_backward(statement: cst.CSTNode) -> bool:
            return any(s.statement is statement or statement in set(ctx.ancestors(s.statement))
                       for s in p.sites)

        def through_loop(step: Step, statement: cst.CSTNode) -> bool:
            for anc in ctx.ancestors(step.call):
                if isinstance(anc, (cst.For, cst.While)):
                    return True
                if anc is statement:
                    return False
            return False

        planned: List[Tuple[cst.CSTNode, cst.CSTNode, bool]] = []  # (anchor, block, trailing)
        replaced: Set[cst.CSTNode] = set()  # blocks whose trailing update an outer one replaces
        for block, items in by_block.items():
            body = list(statements(block))
            items.sort(key=lambda it: body.index(it[0]) if it[0] in body else 0)
            seen: Set[str] = set()
            group: List[Tuple[cst.CSTNode, Step]] = []
            last: Optional[cst.CSTNode] = None
            for n, (anchor, step) in enumerate(items):
                key = key_of(step)
                if key in seen and group:
                    planned.append((last, block, False))
                    seen, group = set(), []
                seen.add(key)
                group.append((anchor, step))
                last = anchor
                # later statements of the block, up to the next step of its own
                if anchor not in body:
                    continue
                stop = len(body)
                if n + 1 < len(items) and items[n + 1][0] in body:
                    stop = body.index(items[n + 1][0])
                backward = False
                for statement in body[body.index(anchor) + 1:stop]:
                    if not group:
                        break
                    nested = nested_steps(statement, step.scope)
                    if not nested:
                        backward = backward or has_backward(statement)
                        continue
                    keys = {key_of(s) for s in nested}
                    if keys & seen:  # the same optimizer again: update before it
                        planned.append((last, block, False))
                        seen, group = set(), []
                        break
                    if backward or has_backward(statement) or any(through_loop(s, statement) for s in nested):
                        break
                    # the same gradients: one update after the whole statement
                    seen |= keys
                    group.extend((statement, s) for s in nested)
                    last = statement
                    replaced.update(block_of_step[id(s)] for s in nested)
            if group:
                planned.append((last, block, True))
        for anchor, block, trailing in planned:
            if trailing and block in replaced:
                continue
            if trailing and self.has_update_after(anchor):
                continue
            p.updates.append((anchor, anchor))

    def has_update_after(self, anchor: cst.CSTNode) -> bool:
        block, body = block_of(self.ctx, anchor)
        if block is None:
            return False
        index = list(body).index(anchor)
        for s in body[index + 1:index + 4]:
            for c in calls_in(self.ctx, s):
                if method_name(c) == "update" and root_name(receiver(c)) == (self.p.scaler.text if self.p.scaler else None):
                    return True
            if s in self.contains:
                break
        return False

    # -- autocast regions -------------------------------------------------------------------
    def covered(self, node: cst.CSTNode) -> bool:
        """`node` runs under autocast: inside an autocast `with` or an autocast-decorated def."""
        ctx = self.ctx
        for anc in ctx.ancestors(node):
            if anc in self.autocast_set:
                return True
            if isinstance(anc, cst.FunctionDef):
                for dec in anc.decorators:
                    d = dec.decorator
                    name = self.ctx.resolve(d.func if isinstance(d, cst.Call) else d)
                    if name in AUTOCAST or name == TM_AUTOCAST:
                        return True
        return False

    def loss_definition(self, site: Site) -> Tuple[Optional[cst.CSTNode], Optional[str]]:
        """The last statement before the backward that assigns the loss, in the innermost block
        where one exists; or a reason why there is none."""
        ctx = self.ctx
        loss = site.loss
        if loss is None:
            return None, None
        names = set()
        inline_call = False
        for n in subnodes(loss):
            if isinstance(n, cst.Call):
                if not (isinstance(n.func, cst.Attribute) and root_name(n.func.value)):
                    inline_call = True
            if isinstance(n, (cst.Name, cst.Attribute)):
                d = dotted(n)
                if d:
                    names.add(d)
        root = root_name(loss)
        if root and self.resolved.get(loss) is not None:
            root = None  # `F.cross_entropy(model(x), y)`: a library function, not a loss's method
        if root:
            names.add(root)
        if inline_call and not root:
            return None, (f"the forward runs inside `{code(site.call or site.statement)[:60]}`: assign the "
                          "loss to a variable under `with tm.autocast():` and call backward on it")
        node = site.statement
        while True:
            block, body = block_of(ctx, node)
            if block is None:
                return None, None
            index = list(body).index(node)
            for s in reversed(body[:index]):
                if binds(ctx, s) & names:
                    return s, None
            owner = owner_statement(ctx, block)
            if owner is None or isinstance(owner, (cst.FunctionDef, cst.ClassDef)):
                return None, None
            node = owner

    def barrier(self, statement: cst.CSTNode) -> bool:
        return statement in self.contains or statement in self.autocast_set or isinstance(
            statement, (cst.FunctionDef, cst.ClassDef))

    def data_only(self, statement: cst.CSTNode) -> bool:
        if isinstance(statement, cst.If):
            # `if use_cuda: x, y = x.cuda(), y.cuda()`
            return all(self.data_only(s) for block in _suites(statement) for s in statements(block)) and \
                not calls_in(self.ctx, statement.test)
        if not isinstance(statement, cst.SimpleStatementLine):
            return False
        calls = calls_in(self.ctx, statement)
        for call in calls:
            meth = method_name(call)
            if meth in _DATA_METHODS:
                continue
            if isinstance(call.func, cst.Name) and call.func.value in _DATA_FUNCS:
                continue
            return False
        if calls:
            return True
        # no call at all: plain unpacking (`x, y = batch`, `x = batch["x"]`) is data; arithmetic
        # on forward results (`loss = ce + 0.1 * aux`) is not
        for small in statement.body:
            value = getattr(small, "value", None)
            if isinstance(small, cst.AugAssign) or value is None:
                return False
            if not all(isinstance(n, (cst.Name, cst.Attribute, cst.Subscript, cst.Tuple, cst.List, cst.Element,
                                      cst.SubscriptElement, cst.Index, cst.SimpleString, cst.Integer, cst.Dot))
                       for n in subnodes(value)):
                return False
        return True

    def region_start(self, last: cst.CSTNode, stop: Optional[cst.CSTNode] = None) -> cst.CSTNode:
        ctx = self.ctx
        block, body = block_of(ctx, last)
        body = list(body)
        index = body.index(last)
        deps = reads(ctx, last)
        start = last
        chain = [last]
        for s in reversed(body[:index]):
            if self.barrier(s) or s is stop:
                break
            if binds(ctx, s) & deps:
                if self.data_only(s):
                    continue
                start = s
                chain.append(s)
                deps |= reads(ctx, s)
        # The forward starts at the first model call the loss depends on: input preparation
        # before it (augmentation, `Variable(...)`, resizing) and whatever sits between
        # (`zero_grad()`, LR warm-up, plotting) stays outside.
        forward = [s for s in chain if self.calls_model(s)]
        if forward:
            return forward[-1]
        return start

    def calls_model(self, statement: cst.CSTNode) -> bool:
        """`statement` calls a model: a trained model, or a callable object held in a variable or
        attribute (`teacher(x)`, `self.backbone(x)`, `vae.encode(x)`). Library functions and
        classes (`F.interpolate`, `Variable`, also through star imports), builtins, data movement
        (`.to()`, `.float()`), aliases of library callables (`Tensor = torch.cuda.FloatTensor`)
        and helper functions not handed a trained model are not."""
        models = self.model_roots()
        bound = self.file_bindings()
        functions, classes = self.facts.functions, self.facts.classes
        for call in calls_in(self.ctx, statement):
            if self.resolved.get(call) is not None:
                continue
            func = call.func
            if isinstance(func, cst.Name):
                name = func.value
                if name in models:
                    return True
                if name in classes or name in _DATA_FUNCS or name in _BUILTINS:
                    continue
                if name in functions or name not in bound:  # a helper (here or star-imported)
                    if any(analysis.model_root(r) in models for r in reads(self.ctx, call)):
                        return True
                    continue
                if self.alias_only(name):
                    continue
                return True
            if isinstance(func, cst.Attribute):
                if func.attr.value in _DATA_METHODS:
                    continue
                owner = root_name(func.value)
                if owner is None:
                    continue  # a method of a call's result: the inner call decides
                if analysis.model_root(owner) in models:
                    return True
                root = owner.split(".")[0]
                if root in _BUILTINS or root not in bound or self.alias_only(root):
                    continue  # `random.choice` from a star import, `Tensor.new(...)`
                return True
        return False

    def file_bindings(self) -> Set[str]:
        """First parts of every name the file binds (assignments, loop and `with` targets,
        parameters, imports)."""
        cached = getattr(self, "_bindings", None)
        if cached is None:
            cached = {n.split(".")[0] for n in _binds_all(self.ctx)}
            cached.update(self.ctx.imports.names)
            self._bindings = cached
        return cached

    def model_roots(self) -> Set[str]:
        cached = getattr(self, "_model_roots", None)
        if cached is None:
            cached = self._model_roots = set(analysis.trained_models(self.ctx))
        return cached

    def alias_only(self, name: str) -> bool:
        """Every assignment of `name` is a plain expression without a call (`Tensor =
        torch.cuda.FloatTensor if cuda else torch.FloatTensor`): an alias, not a model."""
        found = False
        for assign in self.facts.assigns:
            if any(dotted(t.target) == name for t in assign.targets):
                found = True
                if calls_in(self.ctx, assign.value):
                    return False
        return found

    def train_regions(self) -> None:
        ctx, p = self.ctx, self.p
        raw: Dict[cst.CSTNode, List[Tuple[int, int, Site]]] = {}
        for site in p.sites:
            if site.paired or site.kind == "scaled" and self.covered_site(site):
                continue
            if self.covered(site.statement) and site.kind != "apex":
                continue
            last, why = self.loss_definition(site)
            if why:
                p.region_manual.append((site.statement, why))
                continue
            if last is None or self.covered(last) or last in self.autocast_set:
                continue
            first = self.region_start(last)
            block, body = block_of(ctx, first)
            body = list(body)
            raw.setdefault(block, []).append((body.index(first), body.index(last), site))
        for block, spans in raw.items():
            body = list(statements(block))
            spans.sort(key=lambda s: (s[0], s[1]))
            merged: List[List] = []
            for a, b, site in spans:
                if merged and a <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], b)
                    merged[-1][2].append(site)
                else:
                    merged.append([a, b, [site]])
            for a, b, sites in merged:
                region = Region(body[a], body[b], "train")
                why = self.region_problem(region)
                if why:
                    p.region_manual.append((body[a], why))
                    continue
                p.regions.append(region)
                self.region_sites.update(id(site) for site in sites)

    def covered_site(self, site: Site) -> bool:
        last, _ = self.loss_definition(site)
        return last is None or self.covered(last) or last in self.autocast_set

    def region_statements(self, region: Region) -> List[cst.CSTNode]:
        block, body = block_of(self.ctx, region.first)
        body = list(body)
        return body[body.index(region.first): body.index(region.last) + 1]

    def region_problem(self, region: Region) -> Optional[str]:
        stmts = self.region_statements(region)
        bce = self.bce_names()
        local_funcs = self.bce_functions()
        for s in stmts:
            for call in calls_in(self.ctx, s):
                name = self.ctx.resolve(call.func)
                d = dotted(call.func)
                if name in BCE_FUNCS or name in BCE_CLASSES or (d and d in bce) or (
                        isinstance(call.func, cst.Name) and call.func.value in local_funcs):
                    return BCE_BLOCKED
        escaped = self.numpy_escape(region, stmts)
        if escaped:
            return (f"`{escaped}` leaves autocast as a bf16/fp16 tensor and is converted to numpy later "
                    "(bf16 has no numpy dtype): add `.float()` before `.numpy()`, then put the forward "
                    "under `with tm.autocast():`")
        return None

    def numpy_escape(self, region: Region, stmts: List[cst.CSTNode]) -> Optional[str]:
        ctx = self.ctx
        bound: Set[str] = set()
        for s in stmts:
            bound |= binds(ctx, s)
        losses = {root_name(s.loss) for s in self.p.sites if s.loss is not None}
        bound -= losses
        if not bound:
            return None
        scope = scope_of(ctx, region.first)
        if not hasattr(self, "_appends"):
            by_method = calls_by_method(ctx)
            self._appends = [c for c, _ in (*by_method.get("append", ()), *by_method.get("extend", ()))]
            self._to_numpy = list(by_method.get("numpy", ())) + [(c, n) for c, n in self.facts.calls if (
                n and n.split(".")[0] in ("numpy", "sklearn", "scipy"))]
        # one level of taint through lists: `preds.append(outputs)`
        for call in self._appends:
            if scope_of(ctx, call) is scope and reads(ctx, call) & bound:
                r = root_name(receiver(call))
                if r:
                    bound.add(r)
        for call, name in self._to_numpy:
            if scope_of(ctx, call) is not scope:
                continue
            if method_name(call) == "numpy":
                chain = receiver(call)
                hit = self.chain_hits(chain, bound)
                if hit:
                    return hit
            elif name and name.split(".")[0] in ("numpy", "sklearn", "scipy"):
                for a in call.args:
                    if isinstance(a.value, (cst.Name, cst.Attribute)) and dotted(a.value) in bound:
                        return dotted(a.value)
        return None

    def chain_hits(self, node: Optional[cst.BaseExpression], bound: Set[str]) -> Optional[str]:
        while node is not None:
            if isinstance(node, (cst.Name, cst.Attribute)) and dotted(node) in bound:
                return dotted(node)
            if isinstance(node, cst.Attribute):
                node = node.value
            elif isinstance(node, cst.Subscript):
                node = node.value
            elif isinstance(node, cst.Call):
                meth = method_name(node)
                if meth in _SAFE_CONVERSIONS:
                    return None
                if meth is not None:
                    node = node.func.value
                    continue
                for a in node.args:
                    hit = self.chain_hits(a.value, bound)
                    if hit:
                        return hit
                return None
            else:
                return None
        return None

    def eval_regions(self) -> None:
        ctx, p = self.ctx, self.p
        if p.region_manual:
            return  # the training forward could not get autocast: leave evaluation alike
        if not p.regions and not any(s.kind in ("scaled", "apex") for s in p.sites) and not p.scale_calls:
            return
        models = set(analysis.trained_models(ctx))
        if not models:
            return
        by_loop: Dict[cst.CSTNode, List[cst.CSTNode]] = {}
        for call in calls_spelled(ctx, models):
            loop = ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef, cst.ClassDef)
            if not isinstance(loop, (cst.For, cst.While)) or loop in self.contains:
                continue
            if self.covered(call) or not analysis.under_no_grad(ctx, loop) or self.non_amp_branch(call, loop):
                continue
            by_loop.setdefault(loop, []).append(call)
        for loop, calls in by_loop.items():
            body = list(statements(loop.body))
            idx = []
            for c in calls:
                node = c
                while node is not None and ctx.parent(node) is not loop.body:
                    node = ctx.parent(node)
                if node is not None and node in body:
                    idx.append(body.index(node))
            if not idx:
                continue
            region = Region(body[min(idx)], body[max(idx)], "eval")
            if any(self.barrier(s) for s in self.region_statements(region)):
                continue
            if self.outputs_leave_torch(region, calls):
                continue  # evaluation stays in float32 rather than break the user's metric code
            why = self.region_problem(region)
            if why is None:
                p.regions.append(region)

    def outputs_leave_torch(self, region: Region, calls: List[cst.Call]) -> bool:
        """An output of the evaluation forward reaches a function that is not torch's (the
        project's SSIM helper, a numpy or skimage metric) between the forwards of `region`: in
        bf16 it would fail ("Input type (float) and weight type (BFloat16)", bf16 has no numpy
        dtype) or lose precision, so the evaluation forward keeps float32. Uses after the
        region read the outputs back in float32 (`float_after`)."""
        ctx = self.ctx
        outputs: Set[str] = set()
        for call in calls:
            assign = ctx.enclosing(call, cst.Assign)
            if assign is not None:
                for t in assign.targets:
                    outputs |= {n.value for n in ctx.within(t.target, cst.Name)} if not isinstance(
                        t.target, cst.Name) else {t.target.value}
        if not outputs:
            return False
        uses = (c for s in self.region_statements(region) for c in ctx.within(s, cst.Call, skip_defs=True))
        for use in uses:
            func = use.func
            if isinstance(func, cst.Attribute) and not isinstance(func.value, (cst.Name, cst.Attribute)):
                continue  # a method of a computed value: `(sr - hr).mean()`
            name = ctx.resolve(func) or dotted(func) or ""
            if not name or name.startswith(("torch.", "builtins.")) or name in _TENSOR_BUILTINS \
                    or isinstance(func, cst.Attribute) and dotted(func.value) in outputs:
                continue
            if any(n.value in outputs for a in use.args for n in ctx.within(a, cst.Name)) or any(
                    isinstance(a.value, cst.Name) and a.value.value in outputs for a in use.args):
                return True
        return False

    def float_after(self, region: Region) -> List[str]:
        """Forward outputs bound in `region` and read by the statements after it: the metrics
        computed there (a test loss, softmax probabilities, a running error) would otherwise be
        computed in bf16/fp16 (a test loss read 2.2700 instead of 2.3037), so the block is followed
        by `out = tm.to_float32(out)`. The training loss is not among them (its backward keeps
        the autocast behaviour), nor an output only used for shapes or an argmax."""
        ctx = self.ctx
        losses = {root_name(s.loss) for s in self.p.sites if s.loss is not None}
        outputs: List[str] = []
        for s in self.region_statements(region):
            line = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
            if not isinstance(line, cst.Assign) or not self.calls_model(s) or isinstance(
                    line.value, cst.Call) and method_name(line.value) in _SAFE_CONVERSIONS | _ORDER_READS:
                continue  # `pred = model(x).argmax(1)`: not a floating output
            for t in line.targets:
                names = [t.target] if isinstance(t.target, cst.Name) else (
                    [e.value for e in t.target.elements] if isinstance(t.target, (cst.Tuple, cst.List)) else [])
                outputs += [n.value for n in names if isinstance(n, cst.Name) and n.value not in losses
                            and n.value not in outputs]
        if not outputs:
            return []
        _, body = block_of(ctx, region.last)
        body = list(body)
        autocast = {s for r in self.p.regions if r is not region for s in self.region_statements(r)}
        later = [s for s in body[body.index(region.last) + 1:] if s not in autocast and not self.covered(s)]
        return [name for name in outputs if any(self.precise_use(name, s) for s in later)]

    def precise_use(self, name: str, statement: cst.CSTNode) -> bool:
        """`statement` reads `name` for more than its shape, device or an argmax: a use where
        bf16 would change the number."""
        for ref in self.ctx.within(statement, cst.Name):
            if ref.value != name or _is_attr_name(self.ctx, ref):
                continue
            parent = self.ctx.parent(ref)
            if isinstance(parent, cst.Attribute) and parent.value is ref:
                if parent.attr.value in _SHAPE_READS:
                    continue
                call = self.ctx.parent(parent)
                if isinstance(call, cst.Call) and call.func is parent and parent.attr.value in _ORDER_READS:
                    continue
            if isinstance(parent, cst.Arg):
                call = self.ctx.parent(parent)
                if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "len":
                    continue
            if isinstance(parent, cst.AssignTarget) or isinstance(parent, (cst.Tuple, cst.List)) and isinstance(
                    self.ctx.parent(parent), cst.AssignTarget):
                continue
            return True
        return False

    def non_amp_branch(self, call: cst.Call, stop: cst.CSTNode) -> bool:
        """`call` sits in one branch of an `if` (inside `stop`) whose other branch runs its forward
        under autocast (`if use_amp: with autocast(): out = model(x) else: out = model(x)`): the
        deliberate non-AMP path of an optional-AMP script, left alone."""
        ctx = self.ctx
        child: cst.CSTNode = call
        for anc in ctx.ancestors(call):
            if anc is stop:
                return False
            if isinstance(anc, cst.If):
                others = [b for b in (anc.body, anc.orelse) if b is not None and b is not child]
                if child is not anc.body and child is not anc.orelse:
                    others = []  # `child` is the test
                for other in others:
                    if any(w in self.autocast_set for w in ctx.within(other, cst.With, skip_defs=True)):
                        return True
            child = anc
        return False

    # -- BCE (TM409) ------------------------------------------------------------------------
    def bce_names(self) -> Set[str]:
        cached = getattr(self, "_bce_names", None)
        if cached is None:
            cached = set()
            for call, name in self.facts.calls:
                if name in BCE_CLASSES:
                    target = analysis._assign_target(self.ctx, call)
                    if target:
                        cached.add(target)
            self._bce_names = cached
        return cached

    def bce_functions(self) -> Set[str]:
        """Same-file functions that compute a BCE loss (one level)."""
        cached = getattr(self, "_bce_funcs", None)
        if cached is None:
            cached = set()
            # BCE calls by resolved name, and calls of the variables holding a BCE loss module
            # (a call in both lists only adds its function's name twice).
            calls = analysis.calls_to(self.ctx, *BCE_FUNCS, *BCE_CLASSES) + calls_spelled(self.ctx, self.bce_names())
            for call in calls:
                func = self.ctx.enclosing(call, cst.FunctionDef)
                if func is not None and class_of(self.ctx, func) is None:
                    cached.add(func.name.value)
            self._bce_funcs = cached
        return cached

    def bce_checks(self) -> None:
        p = self.p
        will_autocast = p.adding and not p.blockers and bool(p.sites)
        for call, name in self.facts.calls:
            if name in BCE_CLASSES or name in BCE_FUNCS:
                if will_autocast or self.covered(call) or self.used_under_autocast(call):
                    what = "nn.BCELoss" if name in BCE_CLASSES else "F.binary_cross_entropy"
                    better = "nn.BCEWithLogitsLoss" if name in BCE_CLASSES else "F.binary_cross_entropy_with_logits"
                    p.bce.append((call, f"`{what}` raises under CUDA autocast (unsafe in fp16): drop the final "
                                        f"sigmoid and use `{better}` on the logits, then put the forward and "
                                        "loss under `with tm.autocast():` and scale the loss with `tm.GradScaler()`"))

    def used_under_autocast(self, call: cst.Call) -> bool:
        target = analysis._assign_target(self.ctx, call)
        if not target:
            return False
        return any(self.covered(other) for other in calls_spelled(self.ctx, (target,)))

    # -- existing autocast ------------------------------------------------------------------
    def existing_autocast_checks(self) -> None:
        ctx, p = self.ctx, self.p
        for site in p.sites:
            if site.kind == "apex" or site.call is None:
                continue
            w = None
            for anc in ctx.ancestors(site.call):
                if anc in self.autocast_set:
                    w = anc
                if isinstance(anc, cst.FunctionDef):
                    break
            if w is None:
                continue
            if (isinstance(w, cst.With) and len(w.items) == 1 and w.items[0].asname is None
                    and ctx.parent(site.statement) is w.body and w not in p.backward_moves
                    and list(statements(w.body)).index(site.statement) > 0):
                p.backward_moves.append(w)
            elif w not in p.backward_moves:
                p.backward_inside.append(site.statement)

    # -- unscale_ before clipping / gradient reads (TM403) ----------------------------------------
    def order(self, scope: cst.CSTNode) -> Dict[cst.CSTNode, int]:
        cached = self.order_cache.get(scope)
        if cached is None:
            cached = {}
            body = scope.body if isinstance(scope, cst.Module) else statements(getattr(scope, "body", None))
            stack = list(reversed(body))  # statements in source order, nested blocks included
            while stack:
                s = stack.pop()
                cached[s] = len(cached)
                if isinstance(s, cst.BaseCompoundStatement) and not isinstance(s, (cst.FunctionDef, cst.ClassDef)):
                    stack.extend(reversed([t for block in _suites(s) for t in statements(block)]))
            self.order_cache[scope] = cached
        return cached

    def position(self, node: cst.CSTNode, scope: cst.CSTNode) -> int:
        order = self.order(scope)
        n = node
        while n is not None and n not in order:
            n = self.ctx.parent(n)
        return order.get(n, -1)

    def unscale_points(self) -> None:
        ctx, p = self.ctx, self.p
        text = p.scaler.text
        consumers: List[Tuple[cst.CSTNode, cst.CSTNode, bool]] = []  # (statement, scope, apex)
        helper_clips = self.clip_helpers()
        seen_stmt: Set[cst.CSTNode] = set()
        for call, name in self.facts.calls:
            is_clip = name in CLIP or (isinstance(call.func, cst.Name) and call.func.value in helper_clips)
            if not is_clip:
                continue
            scope = scope_of(ctx, call)
            if scope not in self.sites_by_scope:
                continue
            s = line_of(ctx, call) or ctx.statement_of(call)
            if s is None or s in seen_stmt:
                continue
            seen_stmt.add(s)
            apex = any(self.resolved.get(c) == f"{APEX_AMP}.master_params" for c in calls_in(ctx, call))
            consumers.append((s, scope, apex))
        for node in self.grad_reads():
            scope = scope_of(ctx, node)
            if scope not in self.sites_by_scope:
                continue
            s = line_of(ctx, node) or ctx.statement_of(node)
            if s is None or s in seen_stmt:
                continue
            seen_stmt.add(s)
            consumers.append((s, scope, False))
        # (scope, window, optimizer) -> statements given an unscale_ there: a consumer in the
        # other branch of an `if` (never run in the same pass) still needs its own
        done: Dict[Tuple[cst.CSTNode, int, str], List[cst.CSTNode]] = {}
        consumers.sort(key=lambda c: self.position(c[0], c[1]))
        for s, scope, apex in consumers:
            if not p.scaler.new and not scaler_visible(ctx, p.scaler, s):
                continue
            pos = self.position(s, scope)
            before = [(self.position(x.statement, scope), x) for x in p.sites if x.scope is scope
                      and self.position(x.statement, scope) < pos and not self.exclusive(s, x.statement)]
            if not before:
                continue
            window, last_site = max(before, key=lambda b: b[0])
            if last_site.paired:
                continue  # the non-AMP branch of an optional-AMP script
            later_sites = [self.position(x.statement, scope) for x in p.sites if x.scope is scope
                           and self.position(x.statement, scope) > pos and not self.exclusive(s, x.statement)]
            horizon = min(later_sites) if later_sites else 1 << 30
            steps = [st for st in p.steps if st.scope is scope and st.kind in ("plain", "scaled")
                     and pos < self.position(st.call, scope) < horizon]
            names: List[str] = []
            for st in sorted(steps, key=lambda st: self.position(st.call, scope)):
                opt = code(st.optimizer) if st.optimizer is not None else None
                if opt and opt not in names:
                    names.append(opt)
            if not names:
                continue
            if self.has_unscale(scope, window, pos, text, s):
                continue
            names = [n for n in names if not any(
                not self.exclusive(s, other) for other in done.get((scope, window, n), ()))]
            if not names:
                continue
            for n in names:
                done.setdefault((scope, window, n), []).append(s)
            if not isinstance(s, cst.SimpleStatementLine) and not isinstance(ctx.parent(s), (cst.IndentedBlock, cst.Module)):
                continue
            if apex:
                p.apex_unscales[s] = names
            else:
                p.unscales.append((s, names))

    def exclusive(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """`a` and `b` sit in different branches of one `if` (never both run in one pass)."""
        ctx = self.ctx
        via: Dict[cst.CSTNode, cst.CSTNode] = {}
        child = a
        for anc in ctx.ancestors(a):
            via[anc] = child
            child = anc
        child = b
        for anc in ctx.ancestors(b):
            if anc in via:
                return isinstance(anc, cst.If) and via[anc] is not child and (
                    via[anc] is anc.body or child is anc.body)
            child = anc
        return False

    def has_unscale(self, scope: cst.CSTNode, start: int, end: int, text: str,
                    consumer: Optional[cst.CSTNode] = None) -> bool:
        for call, _ in calls_by_method(self.ctx).get("unscale_", ()):
            if scope_of(self.ctx, call) is scope:
                if start < self.position(call, scope) < end and not (
                        consumer is not None and self.exclusive(consumer, call)):
                    return True
        return False

    def clip_helpers(self) -> Set[str]:
        out = set()
        for call, name in self.facts.calls:
            if name in CLIP:
                func = self.ctx.enclosing(call, cst.FunctionDef)
                if func is not None and func not in self.sites_by_scope and class_of(self.ctx, func) is None:
                    out.add(func.name.value)
        return out

    def grad_reads(self) -> List[cst.CSTNode]:
        """`p.grad` read between backward and step (gradient-norm logging, manual clipping)."""
        out = []
        for scope in self.sites_by_scope:
            order = self.order(scope)
            sites = [self.position(x.statement, scope) for x in self.p.sites if x.scope is scope]
            steps = [self.position(x.call, scope) for x in self.p.steps if x.scope is scope]
            if not sites or not steps:
                continue
            lo, hi = min(sites), max(steps)
            for s, pos in order.items():
                if not (lo < pos < hi) or not isinstance(s, cst.SimpleStatementLine):
                    continue
                for n in self.ctx.within(s, cst.Attribute, skip_defs=True):
                    if n.attr.value == "grad":  # type: ignore[attr-defined]
                        parent = self.ctx.parent(n)
                        if isinstance(parent, cst.AssignTarget):
                            continue
                        if isinstance(parent, cst.Comparison) and any(
                                isinstance(c.operator, (cst.Is, cst.IsNot)) for c in parent.comparisons):
                            continue
                        out.append(n)
                        break
        return out


def _suites(statement: cst.BaseCompoundStatement) -> List[cst.CSTNode]:
    out = []
    body = getattr(statement, "body", None)
    if body is not None:
        out.append(body)
    orelse = getattr(statement, "orelse", None)
    while orelse is not None:
        if isinstance(orelse, cst.If):
            out.append(orelse.body)
            orelse = orelse.orelse
        else:
            out.append(orelse.body)
            orelse = None
    for h in getattr(statement, "handlers", ()):
        out.append(h.body)
    fin = getattr(statement, "finalbody", None)
    if fin is not None:
        out.append(fin.body)
    return out


def _is_import(s: cst.CSTNode) -> bool:
    return isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body)


def _module_anchor(ctx: Context) -> Optional[cst.CSTNode]:
    """After the last top-level import before the first def/class (where the runtime import goes)."""
    anchor = None
    for s in ctx.module.body:
        if isinstance(s, (cst.FunctionDef, cst.ClassDef)):
            break
        if isinstance(s, cst.SimpleStatementLine) and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in s.body):
            anchor = s
    return anchor


def apex_o1(ctx: Context) -> bool:
    """apex is used with opt_level O1 (or O0): convertible. O2/O3 (fp16 master weights) are not."""
    return apex_level(ctx)[0] in ("O0", "O1")


def apex_level(ctx: Context) -> Tuple[str, Optional[cst.Call]]:
    cached = ctx.facts.get("amp_apex_level")
    if cached is None:
        level, node = "O1", None
        facts = analysis.facts(ctx)
        for call, name in facts.calls:
            if name == f"{APEX_AMP}.initialize":
                node = call
                arg = next((a for a in call.args if a.keyword and a.keyword.value == "opt_level"), None)
                if arg is None:
                    positional = [a for a in call.args if a.keyword is None]
                    arg = positional[2] if len(positional) > 2 else None
                if arg is not None and isinstance(arg.value, cst.SimpleString):
                    level = arg.value.evaluated_value
                elif arg is not None:
                    # `opt_level=args.opt_level`: look at the argparse default
                    for other, oname in facts.calls:
                        if method_name(other) == "add_argument" and any(
                                isinstance(a.value, cst.SimpleString) and "opt" in a.value.evaluated_value.lower()
                                and "level" in a.value.evaluated_value.lower() for a in other.args if a.keyword is None):
                            default = next((a for a in other.args if a.keyword and a.keyword.value == "default"), None)
                            if default is not None and isinstance(default.value, cst.SimpleString):
                                level = default.value.evaluated_value
                if level not in ("O0", "O1"):
                    break
        cached = (level, node)
        ctx.facts["amp_apex_level"] = cached
    return cached  # type: ignore[return-value]


# --- rules ------------------------------------------------------------------------------------

class AutocastForward(AmpRule):
    """
    ## What it does
    Runs the forward pass and the loss computation of each training step under
    `with tm.autocast():` (the runtime's autocast: bf16 where supported, else fp16; bf16 on
    CPU), leaving `backward()` outside. Evaluation loops (under `torch.no_grad()` /
    `inference_mode()`) get autocast too, without a scaler. A `backward()` written inside an
    existing autocast block is moved out of it.

    The wrapped run starts at the first statement the loss depends on that calls a model (a
    trained model, or a module held in a variable: `teacher(x)`, `vae.encode(x)`), so input
    preparation before it (`x.to(device)`, `Variable(...)`, resizing) and unrelated statements
    (`zero_grad()`, LR warm-up, plotting) stay outside; without such a call, at the first
    dependency that does more than move data. It ends at the last assignment of the loss before
    `backward()`; a loss computed by a helper call is wrapped as that call. A forward already
    under autocast is left alone, also through a variable or helper that holds the context
    (`ctx = nullcontext() if cpu else torch.autocast(...)` then `with ctx:`, nanoGPT).

    Forward outputs bound in the block and read after it for more than a shape or an argmax
    (the accuracy, a test loss, softmax probabilities) are read back in float32 right after the
    block (`out = tm.to_float32(out)`, any nesting of tuples, lists and dicts): a metric computed
    on bf16 outputs is off in the third digit (a test loss of 2.2891 instead of 2.2852).

    ## Why is this bad?
    Without autocast the model runs in fp32 and gets none of the speed or memory benefits of
    tensor cores. Running `backward()` under autocast is "not recommended": backward ops run in
    the dtype autocast chose for the corresponding forward ops anyway (PyTorch AMP examples).

    ## Limitations
    Reported for a manual change instead: a forward written inside the `backward()` expression
    (`criterion(model(x), y).backward()`), outputs of the forward that are later converted to
    numpy (bf16 has no numpy dtype), `nn.BCELoss` (see TM409), optimizer closures, `model.half()`.
    With `--amp off` nothing is added.
    """

    code = "TM401"
    name = "autocast-forward"
    summary = "Run forward and loss (not backward) under autocast"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                out = model(x)
                loss = criterion(out, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                with tm.autocast():
                    out = model(x)
                    loss = criterion(out, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip:
            return
        for region in p.regions:
            what = "the forward and the loss" if region.kind == "train" else "the evaluation forward"
            self.report(region.first, f"run {what} under `with {ctx.tm}.autocast():`",
                        edits=[wrap(region.first, region.last, partial(_autocast_block, ctx, region))],
                        imports=[ctx.runtime_import()])
        for first, why in p.region_manual:
            if why == BCE_BLOCKED:
                continue  # TM409 reports it
            self.report(first, why)
        for w in p.backward_moves:
            self.report(w, "`backward()` runs inside autocast: move it (and what follows) out of the block",
                        edits=[replace(w, _move_backward_out)])
        for s in p.backward_inside:
            self.report(s, "`backward()` runs inside autocast: end the autocast block before the backward")


def _autocast_block(ctx: Context, region: Region, body: Sequence[cst.BaseStatement]):
    """`with tm.autocast():` around `body`, then the outputs the code after it reads back in
    float32 (`out = tm.to_float32(out)`), so metrics are not computed in bf16/fp16."""
    block = with_node(call_node(f"{ctx.tm}.autocast", **runtime_kwargs(ctx)), body)
    if not region.float_after:
        return block
    return cst.FlattenSentinel([block, *(call_stmt(expr_of(f"{ctx.tm}.to_float32({name})"), name)
                                         for name in region.float_after)])


def _move_backward_out(w: cst.With):
    body = list(w.body.body)
    split = next((i for i, s in enumerate(body) if ".backward(" in code(s)), None)
    if not split:
        return w
    inner = w.with_changes(body=w.body.with_changes(body=body[:split]))
    return cst.FlattenSentinel([inner, *body[split:]])


class GradScalerRule(AmpRule):
    """
    ## What it does
    Scales every training loss with one shared `GradScaler` and steps the optimizers through
    it: `loss.backward()` becomes `scaler.scale(loss).backward()`, `optimizer.step()` becomes
    `scaler.step(optimizer)` followed by `scaler.update()`. `scaler = tm.GradScaler()` is created
    once, beside the optimizer (`self.scaler` in trainer classes; inside the `__main__` block
    when the optimizer is built there; at module level when the optimizer is built in another
    function than the one that steps it), and always before the first statement that runs a
    step using it. It is created only for training steps whose forward runs under autocast
    (existing, or added by TM401): when autocast is withheld (TM409's `BCELoss`, numpy outputs,
    a forward inside the `backward()` expression) the step is left as it is. A new scaler
    follows the dtype of the file's own autocast when that is one constant
    (`tm.GradScaler(dtype=torch.float16)`).

    Several losses or optimizers share the one scaler: each loss is scaled, each optimizer
    stepped through it, and `update()` runs once after the last step of the iteration. With
    gradient accumulation every backward is scaled and `step`/`update` stay inside the
    boundary `if`.

    ## Why is this bad?
    With fp16 autocast small gradients underflow to zero; loss scaling keeps them
    representable and skips steps whose gradients overflowed. The runtime's scaler is enabled
    only where it is needed (fp16 on CUDA) and is a pass-through otherwise, so the same script
    is right for bf16, fp16 and CPU runs.

    ## Limitations
    Manual: optimizer closures (`step(closure)`: "Closure use is not currently supported if
    GradScaler is enabled"), `model.half()`, steps in a function that does not call the
    backward they apply. The non-AMP branch of an optional-AMP script
    (`if use_amp: scaler.scale(loss).backward() else: loss.backward()`) is left alone.
    """

    code = "TM402"
    name = "grad-scaler"
    summary = "Scale losses and step optimizers through one GradScaler"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            scaler = tm.GradScaler()
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip:
            return
        for code_, node_, message in p.blockers:
            if code_ == self.code:
                self.report(node_, message)
        if p.scaler_owner == self.code:
            emit_scaler(self, p)


def emit_scaler(rule: Rule, p: Plan) -> None:
    """Scaler creation, scaled backwards, steps through the scaler and updates (TM402, or TM407
    when it runs without TM402)."""
    ctx = rule.ctx
    s = p.scaler
    imports = [ctx.runtime_import()]
    def creation() -> cst.SimpleStatementLine:
        kwargs = runtime_kwargs(ctx, scaler=True)
        if s.dtype is not None and not kwargs:
            kwargs = {"dtype": s.dtype}
        return call_stmt(call_node(f"{ctx.tm}.GradScaler", **kwargs), target=s.text)

    if s.new and s.after is not None:
        line = creation()
        if isinstance(ctx.parent(s.after), cst.Module) and _is_import(s.after):
            line = line.with_changes(leading_lines=[cst.EmptyLine()])
        rule.report(s.after, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[insert_after(s.after, [line])], imports=imports)
    elif s.new and s.before is not None:
        rule.report(s.before, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[insert_before(s.before, [creation()])], imports=imports)
    elif s.new:
        rule.report(ctx.module, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[replace(ctx.module, lambda m: m.with_changes(body=[creation(), *m.body]))],
                    imports=imports)
    for call in p.scale_calls:
        def fix(c: cst.Call, text=s.text) -> cst.Call:
            loss = unparen(c.func.value)
            scaled = cst.Call(func=dotted_node(f"{text}.scale"), args=[cst.Arg(loss)])
            return c.with_changes(func=c.func.with_changes(value=scaled))
        rule.report(call, f"scale the loss: `{s.text}.scale({code(receiver(call))}).backward()`",
                    edits=[replace(call, fix)])
    for step in p.step_calls:
        opt = code(step.optimizer)
        rule.report(step.call, f"step through the scaler: `{s.text}.step({opt})`",
                    edits=[replace(step.call, lambda c, o=step.optimizer, t=s.text: cst.Call(
                        func=dotted_node(f"{t}.step"), args=[cst.Arg(o)]))])
    for anchor, _ in p.updates:
        update = f"{s.text}.update()"
        if isinstance(anchor, cst.Expr):
            edit = replace(anchor, lambda e: cst.FlattenSentinel([e, cst.Expr(call_node(f"{s.text}.update"))]))
        else:
            edit = insert_after(anchor, [call_stmt(call_node(f"{s.text}.update"))])
        rule.report(anchor, f"update the loss scale once per iteration: `{update}`", edits=[edit])


class UnscaleBeforeClip(AmpRule):
    """
    ## What it does
    Inserts `scaler.unscale_(optimizer)` before gradient clipping
    (`clip_grad_norm_`, `clip_grad_value_`) and before code that reads `.grad` between
    `backward()` and the step (gradient-norm logging), once per optimizer and step.

    ## Why is this bad?
    After `scaler.scale(loss).backward()` the gradients are multiplied by the loss scale
    (65536 at the start), so a clipping threshold or a logged norm is meaningless unless the
    gradients are unscaled first. `unscale_` may be called only once per optimizer per step
    ("unscale_() has already been called on this optimizer since the last update()").
    """

    code = "TM403"
    name = "unscale-before-clip"
    summary = "Unscale gradients before clipping or reading them"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            """,
            after="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            """,
            mode="lint",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip or p.scaler is None:
            return
        if p.scaler.new and p.scaler_owner is None:
            return
        for before, names in p.unscales:
            lines = [call_stmt(call_node(f"{p.scaler.text}.unscale_", expr_of(n))) for n in names]
            self.report(before, f"unscale the gradients first: `{p.scaler.text}.unscale_({', '.join(names)})`",
                        edits=[insert_before(before, lines)])


class AccumNoSync(AmpRule):
    """
    ## What it does
    For gradient accumulation under DDP (`backward()` every batch, `step()` inside
    `if (i + 1) % k == 0:`), wraps the forward and backward of each batch in
    `with tm.no_sync(model, sync=<the step condition>):` so only the boundary batch
    all-reduces. The forward is inside the context, as DDP requires.

    ## Why is this bad?
    Without `no_sync` DDP all-reduces the gradients after every backward, k-1 times for
    nothing. The sync condition is the step condition, so gradients are reduced exactly before
    each step and never left rank-local. A step condition without an end-of-epoch clause
    (`or i + 1 == len(loader)`) carries the last partial window into the next epoch (or drops
    it at `zero_grad`): reported, not changed.

    ## Limitations
    Accumulation shapes other than "backward, then `if <cond>:` holding the step" are reported
    for a manual change. Only in `ddp` migrations (and `lint` of distributed code); it applies
    with `--amp off` too, since it is about DDP communication, not precision.
    """

    code = "TM404"
    name = "accum-no-sync"
    summary = "Skip DDP gradient sync on non-boundary accumulation steps"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(loader):
                loss = criterion(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0 or i + 1 == len(loader):
                    optimizer.step()
                    optimizer.zero_grad()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(loader):
                with tm.no_sync(model, sync=(i + 1) % accum == 0 or i + 1 == len(loader)):
                    loss = criterion(model(x), y) / accum
                    loss.backward()
                if (i + 1) % accum == 0 or i + 1 == len(loader):
                    optimizer.step()
                    optimizer.zero_grad()
            """,
            mode="ddp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.mode == "lint" and not analysis.is_distributed(ctx):
            return
        if ctx.options.mode == "amp":
            return
        p = plan(ctx)
        if p.skip:
            return
        for item in accumulation(ctx, p):
            kind = item[0]
            if kind == "fix":
                _, first, last, model, cond, site = item
                items = f"{ctx.tm}.no_sync({model}, sync={code(cond)})"
                self.report(first, f"skip the gradient all-reduce on non-boundary accumulation steps: "
                                   f"`with {items}:`",
                            edits=[wrap(first, last, lambda body, m=model, c=cond: with_node(
                                call_node(f"{ctx.tm}.no_sync", dotted_node(m), sync=unparen_safe(c)), body))],
                            imports=[ctx.runtime_import()])
            else:
                _, node_, message = item
                self.report(node_, message)


def accumulation(ctx: Context, p: Plan) -> List[tuple]:
    """(kind, ...) items for TM404: ("fix", first, last, model, condition, site) or
    ("manual", node, message)."""
    cached = ctx.facts.get("amp_accumulation")
    if cached is not None:
        return cached  # type: ignore[return-value]
    out: List[tuple] = []
    planner: _Planner = ctx.facts["amp_planner"]  # type: ignore[assignment]
    models = analysis.trained_models(ctx)
    done: Set[cst.CSTNode] = set()
    for site in p.sites:
        if site.paired or site.statement in done:
            continue
        steps = [st for st in p.steps if st.scope is site.scope and st.kind in ("plain", "scaled")]
        if not steps:
            continue
        block, body = block_of(ctx, site.statement)
        if block is None:
            continue
        body = list(body)
        index = body.index(site.statement)
        loop = owner_statement(ctx, block)
        if not isinstance(loop, (cst.For, cst.While)):
            continue
        later = body[index + 1:]
        # a step right after the backward, also on the same line (`loss.backward(); opt.step()`)
        direct = [s for s in body[index:] if any(ctx.statement_of(st.call) is s or line_of(ctx, st.call) is s
                                                 for st in steps)]
        if direct:
            continue
        holder = None
        for s in later:
            if isinstance(s, cst.If) and any(s.body in set(ctx.ancestors(st.call)) for st in steps):
                holder = s
                break
        if holder is None:
            nested = [st for st in steps if loop in set(ctx.ancestors(st.call))]
            if nested:
                out.append(("manual", site.statement,
                            "gradient accumulation with a step condition torchmigrate does not recognise: under "
                            "DDP wrap the forward and backward of non-boundary batches in "
                            "`with tm.no_sync(model, sync=<step condition>):`"))
                done.add(site.statement)
            continue
        if any(_is_no_sync(ctx, a) for a in ctx.ancestors(site.statement)):
            continue
        last_def, _ = planner.loss_definition(site)
        if last_def is None or ctx.parent(last_def) is not block:
            first = site.statement
        else:
            first = planner.region_start(last_def)
        cond = holder.test
        between = body[body.index(first): body.index(holder)]
        if any(binds(ctx, s) & reads(ctx, cond) for s in between):
            out.append(("manual", holder, "the accumulation step condition uses values computed after the "
                                          "forward: wrap non-boundary batches in `tm.no_sync(model, sync=...)` by hand"))
            continue
        if not models:
            try:
                models = list(analysis.wrapped_models(ctx))
            except Exception:  # the model rules are not there
                models = []
        region_models = []
        for s in body[body.index(first): index + 1]:
            for c in calls_in(ctx, s):
                d = dotted(c.func)
                if d and d in models and d not in region_models:
                    region_models.append(d)
        if len(region_models) == 1:
            model = region_models[0]
        elif not region_models and len(models) == 1:
            model = models[0]
        else:
            out.append(("manual", site.statement, "gradient accumulation over several models: wrap the "
                                                  "non-boundary forward/backward in `tm.no_sync(...)` for each DDP model"))
            continue
        done.add(site.statement)
        out.append(("fix", first, site.statement, model, cond, site))
        if _drops_partial_window(cond):
            out.append(("manual", holder,
                        f"the last partial accumulation window of an epoch never steps (`{code(cond)}`): its "
                        "gradients carry into the next epoch or are dropped by zero_grad; add `or <last batch>` "
                        "to the condition if that is not intended"))
    ctx.facts["amp_accumulation"] = out
    return out


def unparen_safe(node: cst.BaseExpression) -> cst.BaseExpression:
    """A condition as a keyword value: its own outer parentheses are not needed."""
    return node.with_changes(lpar=[], rpar=[]) if getattr(node, "lpar", None) else node


def _is_no_sync(ctx: Context, node: cst.CSTNode) -> bool:
    if not isinstance(node, cst.With):
        return False
    for item in node.items:
        i = item.item
        if isinstance(i, cst.Call) and (method_name(i) == "no_sync" or ctx.resolve(i.func) == TM_NO_SYNC):
            return True
    return False


def _drops_partial_window(cond: cst.BaseExpression) -> bool:
    """`(i + 1) % k == 0` alone, without a last-batch clause."""
    if isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1:
        left = unparen(cond.left)
        return isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Modulo)
    return False


class DataParallelAutocast(AmpRule):
    """
    ## What it does
    For code that keeps `nn.DataParallel` (`torchmigrate amp`), runs the model's `forward`
    under `with tm.autocast():` inside the model class, when the class is defined in the file
    (with the caller's dtype when every autocast of the file names the same constant one). In
    `lint`, reports DataParallel models in files whose autocast is not CUDA's default fp16
    (`dtype=torch.bfloat16`, a dtype from a variable, `cache_enabled=`, `tm.autocast()`).

    ## Why is this bad?
    DataParallel runs each replica's forward in its own thread, and autocast state is
    thread-local. Since PyTorch 1.10 `parallel_apply` re-enters autocast in every replica
    thread, but only with the caller's *enabled* flag (`torch.autocast(device_type,
    enabled=...)`): the dtype and the weight-cast cache setting fall back to the thread's
    defaults. A bf16 autocast around `dp_model(x)` (what `tm.autocast()` picks on GPUs that
    support it) runs the replicas in fp16, CUDA's default autocast dtype: fp16 activations where
    bf16 was chosen, and an fp16 backward without loss scaling (small gradients underflow),
    since the scaler is disabled for bf16. Autocast entered inside `forward` runs in the replica's thread and keeps the dtype.

    ## Limitations
    A model class from another module (torchvision, timm) is reported for a manual change.
    Nothing is done when the dtype is forced to fp16 (`--amp fp16`), which the replicas
    already use.
    """

    code = "TM405"
    name = "dp-autocast"
    summary = "Put autocast inside forward for nn.DataParallel models"
    safety = Safety.SAFE
    commands = frozenset({"amp", "lint"})
    examples = (
        Example(
            before="""
            import torch.nn as nn
            class Net(nn.Module):
                def forward(self, x):
                    return self.fc(x)

            model = nn.DataParallel(Net().cuda())
            """,
            after="""
            import torch.nn as nn
            import torchmigrate.runtime as tm
            class Net(nn.Module):
                def forward(self, x):
                    with tm.autocast():
                        return self.fc(x)

            model = nn.DataParallel(Net().cuda())
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip or ctx.options.amp in ("off", "fp16") or p.blockers:
            return
        if ctx.options.mode == "ddp":
            return
        facts = analysis.facts(ctx)
        dp_calls = [call for call, name in facts.calls if name in DATA_PARALLEL and call.args]
        if not dp_calls:
            return
        if ctx.options.mode == "lint" and not _replica_settings_lost(ctx):
            return
        kwargs = runtime_kwargs(ctx)
        if not kwargs and not p.regions:  # (new autocast regions use the runtime's policy)
            dtype = _caller_dtype(ctx)
            if dtype is not None:
                kwargs = {"dtype": dtype}
        shown = ", ".join(f"{k}={code(v)}" for k, v in kwargs.items())
        done: Set[str] = set()
        for call in dp_calls:
            klass = _model_class(ctx, call.args[0].value)
            if klass is None:
                self.report(call, "DataParallel replicas run autocast with CUDA's default dtype (fp16), not the "
                                  "caller's (bf16 with `tm.autocast()` where supported): put "
                                  f"`with tm.autocast({shown}):` inside the model's `forward`, or use DDP "
                                  "(`torchmigrate ddp`)")
                continue
            if klass.name.value in done:
                continue
            done.add(klass.name.value)
            forward, body = wrappable_forward(ctx, call)
            if forward is None:
                self.report(call, f"put `with tm.autocast({shown}):` inside `{klass.name.value}.forward`: "
                                  "DataParallel replicas run autocast with CUDA's default dtype (fp16), not the caller's")
                continue
            if not body:
                continue
            self.report(forward, f"run `{klass.name.value}.forward` under autocast: DataParallel replicas get "
                                 "only the caller's autocast on/off state, not its dtype (bf16 would run as fp16)",
                        edits=[wrap(body[0], body[-1], lambda b, kw=kwargs: with_node(
                            call_node(f"{ctx.tm}.autocast", **kw), b))],
                        imports=[ctx.runtime_import()])


_FP16 = frozenset({"torch.float16", "torch.half"})
_CONSTANT_DTYPES = frozenset({"torch.float16", "torch.half", "torch.bfloat16"})


def _autocast_settings(ctx: Context, call: cst.Call, qualified: str) -> Tuple[Optional[cst.BaseExpression], bool]:
    """(the dtype argument, whether `cache_enabled` or `*args` is given) of an autocast call."""
    if qualified == TM_AUTOCAST:
        dtype = next((a.value for a in call.args if a.keyword and a.keyword.value == "dtype"), None)
        if dtype is None:
            positional = [a for a in call.args if a.keyword is None]
            dtype = positional[0].value if positional else None
        return dtype, any(a.star for a in call.args)
    legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
    params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
    positional = [a for a in call.args if a.keyword is None and not a.star]
    named = {p: a.value for p, a in zip(params, positional)}
    named.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    return named.get("dtype"), "cache_enabled" in named or any(a.star for a in call.args)


def _autocast_calls(ctx: Context) -> List[Tuple[cst.Call, str]]:
    return [(c, n) for c, n in analysis.facts(ctx).calls if n in AUTOCAST or n == TM_AUTOCAST]


def _replica_settings_lost(ctx: Context) -> bool:
    """Some autocast of the file differs from what DataParallel's replica threads use (CUDA's
    default dtype, fp16, with the cast cache on): `tm.autocast()` (bf16 where supported), an
    explicit dtype other than fp16, or `cache_enabled=`."""
    for call, name in _autocast_calls(ctx):
        if name.startswith("torch.cpu."):
            continue
        dtype, cache = _autocast_settings(ctx, call, name)
        if cache:
            return True
        if name == TM_AUTOCAST:
            if dtype is None or not (isinstance(dtype, cst.SimpleString) and dtype.evaluated_value == "fp16") \
                    and ctx.resolve(dtype) not in _FP16:
                return True
        elif dtype is not None and ctx.resolve(dtype) not in _FP16:
            return True
    return False


def _caller_dtype(ctx: Context) -> Optional[cst.BaseExpression]:
    """The dtype every autocast of the file names, when it is one constant (`torch.bfloat16`,
    `"bf16"`): the forward's autocast uses it too."""
    seen: List[str] = []
    node = None
    for call, name in _autocast_calls(ctx):
        dtype, _ = _autocast_settings(ctx, call, name)
        if dtype is None:
            return None
        constant = isinstance(dtype, cst.SimpleString) or ctx.resolve(dtype) in _CONSTANT_DTYPES
        if not constant:
            return None
        text = code(dtype)
        if seen and text != seen[0]:
            return None
        seen.append(text)
        node = dtype
    return node


def _is_docstring(s: cst.CSTNode) -> bool:
    return (isinstance(s, cst.SimpleStatementLine) and isinstance(s.body[0], cst.Expr)
            and isinstance(s.body[0].value, (cst.SimpleString, cst.ConcatenatedString)))


def wrappable_forward(ctx: Context, call: cst.Call) -> Tuple[Optional[cst.FunctionDef], list]:
    """For `nn.DataParallel(model)`: the `forward` of the model's class in this file and the
    statements TM405 puts under autocast (none when it already runs under autocast);
    (None, []) when there is no class or no `forward` with a block to wrap."""
    klass = _model_class(ctx, call.args[0].value)
    if klass is None:
        return None, []
    forward = next((s for s in statements(klass.body) if isinstance(s, cst.FunctionDef)
                    and s.name.value == "forward"), None)
    if forward is None or not isinstance(forward.body, cst.IndentedBlock):
        return None, []
    body = list(forward.body.body)
    if _is_docstring(body[0]):
        body = body[1:]
    if not body or _forward_covered(ctx, forward, body):
        return forward, []
    return forward, body


def _forward_covered(ctx: Context, forward: cst.FunctionDef, body) -> bool:
    for dec in forward.decorators:
        d = dec.decorator
        if ctx.resolve(d.func if isinstance(d, cst.Call) else d) in (AUTOCAST | {TM_AUTOCAST}):
            return True
    if len(body) == 1 and isinstance(body[0], cst.With):
        for item in body[0].items:
            i = item.item
            if isinstance(i, cst.Call) and ctx.resolve(i.func) in (AUTOCAST | {TM_AUTOCAST}):
                return True
    return False


def _model_class(ctx: Context, value: cst.BaseExpression) -> Optional[cst.ClassDef]:
    classes = analysis.facts(ctx).classes
    seen = 0
    while seen < 8:
        seen += 1
        while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute):
            value = value.func.value  # `Net().to(device)`, `Net().cuda()`
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):
            return classes.get(value.func.value)
        name = dotted(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
        if name is None:
            return None
        found = None
        for assign in analysis.facts(ctx).assigns:
            if any(dotted(t.target) == name for t in assign.targets):
                v = assign.value
                inner = v
                while isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute):
                    inner = inner.func.value
                if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Name) and inner.func.value in classes:
                    found = v
                    break
        if found is None:
            return None
        value = found
    return None


class AmpUnsafeOp(AmpRule):
    """
    ## What it does
    Reports `nn.BCELoss` / `F.binary_cross_entropy` used under autocast, or in a script that is
    being given autocast, and suggests the `WithLogits` form. The training step that uses it
    does not get autocast until it is changed.

    ## Why is this bad?
    On CUDA, `binary_cross_entropy` is on autocast's list of unsafe ops and raises
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast":
    after a sigmoid in fp16 the log underflows. `BCEWithLogitsLoss` fuses the sigmoid and is
    numerically safe (the model must then return logits, without the final sigmoid).
    """

    code = "TM409"
    name = "amp-unsafe-op"
    summary = "BCELoss under autocast raises; use BCEWithLogitsLoss"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            import torch.nn as nn
            criterion = nn.BCELoss()
            with torch.autocast("cuda"):
                loss = criterion(torch.sigmoid(model(x)), y)
            """,
            mode="lint",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip or (self.ctx.options.migrating and self.ctx.options.amp == "off"):
            return
        for node_, message in p.bce:
            self.report(node_, message)


class AmpDtype(AmpRule):
    """
    ## What it does
    Applies the runtime's mixed-precision policy: in `ddp`/`amp` migrations every existing
    `autocast(...)` and `GradScaler(...)` (from `torch.cuda.amp`, `torch.cpu.amp`, `torch.amp`,
    `torch.autocast`) becomes `tm.autocast(...)` / `tm.GradScaler(...)`, keeping `enabled=` and
    `dtype=` (positional arguments become keywords; the device argument goes: the runtime uses
    the process's device). `--amp bf16|fp16` adds `dtype="bf16"|"fp16"` where no dtype is given.
    In `lint`, reports fp16 autocast in a training script without a GradScaler.

    ## Why is this bad?
    `autocast("cuda")` does nothing on a CPU-only run and warns; a hard-coded fp16 policy is
    slower and less stable than bf16 on GPUs that support it, and fp16 without loss scaling
    lets small gradients underflow. `tm.autocast()` picks bf16 where supported, else fp16 (with
    `tm.GradScaler()` enabled only then), and no autocast on the CPU (bf16 there only when
    `TORCHMIGRATE_AMP=bf16` asks for it), so the script runs everywhere at full speed.

    ## Limitations
    Calls with `cache_enabled=` or `*args` are left to TM406 (modernised to `torch.amp`).
    """

    code = "TM410"
    name = "amp-dtype"
    summary = "Use the runtime's AMP dtype policy for autocast and GradScaler"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            from torch.cuda.amp import autocast, GradScaler
            scaler = GradScaler(enabled=use_amp)
            with autocast(enabled=use_amp):
                loss = criterion(model(x), y)
            """,
            after="""
            from torch.cuda.amp import autocast, GradScaler
            import torchmigrate.runtime as tm
            scaler = tm.GradScaler(enabled=use_amp)
            with tm.autocast(enabled=use_amp):
                loss = criterion(model(x), y)
            """,
            mode="amp",
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.names = _modern_import_names(ctx)
        self.imports: List[cst.ImportFrom] = []

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if self.names and not node.relative and node.module is not None and dotted(node.module) in _MODERN_MODULES:
            self.imports.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip:
            return
        if not ctx.options.migrating:
            self.lint_fp16(p)
            return
        if ctx.options.amp == "off":
            return
        facts = analysis.facts(ctx)
        taken: Set[cst.Call] = set()
        for call, name in facts.calls:
            if name in AUTOCAST or name in SCALER:
                if not convertible_call(call, name):
                    self.report(call, f"`{code(call.func)}(...)` with `cache_enabled=`/`*args` cannot use the "
                                      "runtime's policy: it stays CUDA-only (use `tm.autocast(...)` if possible)")
                    continue
                taken.add(call)
                helper = "autocast" if name in AUTOCAST else "GradScaler"
                self.report(call, f"use the runtime's AMP policy: `{ctx.tm}.{helper}(...)` (bf16 where supported, "
                                  "else fp16 with loss scaling; CPU runs too)",
                            edits=[replace(call, lambda c, n=name: _to_runtime(ctx, c, n))],
                            imports=[ctx.runtime_import()])
            elif name in (TM_AUTOCAST, TM_SCALER) and ctx.options.amp in _DTYPE_TEXT:
                if not any(a.keyword and a.keyword.value == "dtype" for a in call.args) and not (
                        name == TM_AUTOCAST and any(a.keyword is None for a in call.args)):
                    self.report(call, f"force the AMP dtype: `dtype={_DTYPE_TEXT[ctx.options.amp]}`",
                                edits=[replace(call, lambda c: _add_kw(c, "dtype", expr(_DTYPE_TEXT[ctx.options.amp])))])
        refs = name_refs(ctx, self.names) if self.imports else []
        for imp in self.imports:
            drop = unused_aliases(ctx, imp, refs, taken)
            if drop:
                edit = (removal(ctx, imp) if len(drop) == len(imp.names) else
                        replace(imp, lambda n, d=drop: _drop_aliases(n, d)))
                self.report(imp, "drop imports the runtime's AMP helpers replace", edits=[edit])

    def lint_fp16(self, p: Plan) -> None:
        if p.existing_scalers or not p.sites:
            return
        facts = analysis.facts(self.ctx)
        for call, name in facts.calls:
            if name not in AUTOCAST:
                continue
            dtype = next((a.value for a in call.args if a.keyword and a.keyword.value == "dtype"), None)
            dname = self.ctx.resolve(dtype) if dtype is not None else None
            cuda_default = name.startswith("torch.cuda.") and dtype is None
            if dname in ("torch.float16", "torch.half") or cuda_default:
                self.report(call, "fp16 autocast without a GradScaler: small gradients underflow; use "
                                  "`tm.autocast()` + `tm.GradScaler()` (bf16 where supported)")
                return


_MODERN_MODULES = ("torch.amp", "torch", "torch.amp.autocast_mode", "torch.amp.grad_scaler")


def _modern_import_names(ctx: Context) -> Set[str]:
    out = set()
    for local, full in ctx.imports.names.items():
        if full in AUTOCAST or full in SCALER:
            if not full.startswith(("torch.cuda.", "torch.cpu.")):
                out.add(local)
    return out


def _add_kw(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    return with_args(call, [*call.args, kwarg(name, value)])


def _to_runtime(ctx: Context, call: cst.Call, qualified: str) -> cst.Call:
    legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
    if qualified in AUTOCAST:
        params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
        helper = "autocast"
    else:
        params = (("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled") if legacy else
                  ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled"))
        helper = "GradScaler"
    positional = [a for a in call.args if a.keyword is None]
    args = [kwarg(p, a.value) for p, a in zip(params, positional)]
    args += [a for a in call.args if a.keyword is not None]
    args = [a for a in args if a.keyword.value not in ("device_type", "device")]
    if ctx.options.amp in _DTYPE_TEXT and not any(a.keyword.value == "dtype" for a in args):
        args.append(kwarg("dtype", expr(_DTYPE_TEXT[ctx.options.amp])))
    new = call.with_changes(func=expr(f"{ctx.tm}.{helper}"), args=[])
    return with_args(new, [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == len(args) - 1 else a
                           for i, a in enumerate(args)]) if args else new


def unused_aliases(ctx: Context, imp: cst.ImportFrom, refs: Iterable[cst.Name], taken: Set[cst.Call]) -> List[str]:
    """Local names bound by `imp` (autocast/GradScaler aliases) whose every use is a taken call."""
    if isinstance(imp.names, cst.ImportStar):
        return []
    module = dotted(imp.module) if imp.module is not None else ""
    out = []
    for alias in imp.names:
        full = f"{module}.{dotted(alias.name)}"
        if full not in AUTOCAST and full not in SCALER and full not in ("torch.cuda.amp", "torch.cpu.amp", "torch.amp"):
            continue
        local = alias.asname.name.value if alias.asname is not None else dotted(alias.name)
        uses = [r for r in refs if r.value == local and not ctx.enclosing(r, cst.Import, cst.ImportFrom)]
        if all(_in_taken_call(ctx, r, taken) for r in uses):
            out.append(local)
    return out


def name_refs(ctx: Context, values: Iterable[str]) -> List[cst.Name]:
    """Every `Name` spelling one of `values` that is not an attribute name, in source order.

    Asked of the node index once the walk is done, instead of a `visit_Name` that would test
    each of the file's (many) names against a set of a few imported locals."""
    values = list(values)
    refs = [n for value in values for n in ctx.named(value) if not _is_attr_name(ctx, n)]
    if len(values) > 1:
        refs.sort(key=ctx.position)
    return refs


def _is_attr_name(ctx: Context, node: cst.Name) -> bool:
    """`autocast` in `torch.autocast`, `amp` in `apex.amp`: an attribute, not a use of a local name."""
    parent = ctx.parent(node)
    return isinstance(parent, cst.Attribute) and parent.attr is node


def _in_taken_call(ctx: Context, name: cst.Name, taken: Set[cst.Call]) -> bool:
    node: cst.CSTNode = name
    parent = ctx.parent(node)
    while isinstance(parent, cst.Attribute) and parent.value is node:
        node, parent = parent, ctx.parent(parent)
    return isinstance(parent, cst.Call) and parent.func is node and parent in taken


def _drop_aliases(node: cst.ImportFrom, drop: Sequence[str]):
    keep = [a for a in node.names
            if (a.asname.name.value if a.asname is not None else dotted(a.name)) not in drop]
    if not keep:
        return cst.RemovalSentinel.REMOVE
    keep[-1] = keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return node.with_changes(names=keep)


class ItemSync(AmpRule):
    """
    ## What it does
    Reports `loss.item()` (or `float(loss)`) called on every iteration of a training loop.

    ## Why is this bad?
    `.item()` copies the value to the host and waits for the GPU to finish all queued work: one
    synchronisation per step that stalls the CUDA stream and costs throughput, especially with
    AMP where the step itself is fast. Accumulate `loss.detach()` in a tensor and call
    `.item()` only when logging (every N steps or once per epoch). Under DDP the value is also
    rank-local unless reduced.
    """

    code = "TM604"
    name = "item-sync"
    summary = "loss.item() every step forces a host-device sync"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                running += loss.item()
            """,
            after="""
            import torch
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                # TODO(torchmigrate): TM604 `loss.item()` every step synchronises with the GPU: accumulate `loss.detach()` and call `.item()` only when logging
                running += loss.item()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.mode == "lint" and not analysis.is_distributed(ctx):
            return
        p = plan(ctx)
        if p.skip:
            return
        loops_done: Set[cst.CSTNode] = set()
        losses: Dict[cst.CSTNode, Set[str]] = {}
        for site in p.sites:
            loop = ctx.enclosing(site.statement, cst.For, cst.While, cst.FunctionDef)
            if isinstance(loop, (cst.For, cst.While)) and site.loss is not None:
                r = root_name(site.loss)
                if r:
                    losses.setdefault(loop, set()).add(r)
        if not losses:
            return
        for call, name in calls_by_method(ctx).get("item", ()):
            if call.args:
                continue
            owner = root_name(receiver(call))
            if owner is None:
                continue
            loop = ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef)
            if loop not in losses or loop in loops_done or owner not in losses[loop]:
                continue
            if any(isinstance(a, (cst.If, cst.IfExp)) for a in _between(ctx, call, loop)):
                continue  # only at log steps
            loops_done.add(loop)
            self.report(call, f"`{code(call)}` every step synchronises with the GPU: accumulate "
                              f"`{owner}.detach()` and call `.item()` only when logging")


def _between(ctx: Context, node: cst.CSTNode, stop: cst.CSTNode) -> Iterator[cst.CSTNode]:
    for anc in ctx.ancestors(node):
        if anc is stop:
            return
        yield anc

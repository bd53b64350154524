"""The model family's decisions: wrapping trained models in DDP, and what the wrap changes.

One shared plan (`plan(ctx)`, computed once per file after the walk and cached on the context)
decides for the whole file which models an optimizer trains, which of them are already wrapped
(DDP, `tm.wrap_model`, apex DDP, `nn.DataParallel`, FSDP/Accelerate/DeepSpeed...), where each new
`tm.wrap_model` goes, what happens to `nn.DataParallel`, and which attribute accesses must go
through `tm.unwrap`. Each rule reports its own part of the plan, so whatever subset of the rules
is enabled, every trained model ends up wrapped exactly once:

- TM301 inserts `model = tm.wrap_model(model)` before the statement that builds the model's
  optimizer (or before the call of a same-file helper that builds it from the model);
- TM306 removes `nn.DataParallel` when TM301 wraps the same name in the same scope, else turns
  it into `tm.wrap_model(...)` in place;
- TM304 (`--sync-bn`) and the unused-parameter analysis of TM303 only add keyword arguments to
  that one wrap statement.

Advice (TM304 without `--sync-bn`, TM305, TM303's needless-flag remark) goes, in `ddp`, only
to the wraps the migration itself creates, so a script that is already distributed changes only
where it is broken; `lint` gives it for user-written DDP, and a file torchmigrate migrated
lints clean.

The plan publishes the wrapped names as `ctx.facts["wrapped_models"]` (also
`wrapped_models(ctx)`, which computes the plan on demand for rules that run earlier) and
the Attribute nodes TM302 rewrites as `ctx.facts["unwrapped_attrs"]`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.facts import CONFIG_RECEIVERS
from torchmigrate.analysis import (Optimizer, _call_arg_for, calls_to, facts, is_distributed, is_variable, model_root,
                                   optimizers)
from torchmigrate.finding import insert_before, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg as call_arg
from torchmigrate.syntax.nodes import code, expr, set_kwarg, stmt
from torchmigrate.program.checkpoints import LOADS
from torchmigrate.program.losses import backward_loss, summed_loss
from torchmigrate.program.loaders import loops_of
from torchmigrate.program.metrics import binding_of, is_load, loader_loop, source_index
from torchmigrate.program.models import assign_targets, functional_model, mentions, model_facts, strip_moves
from torchmigrate.program.training import training_facts
from torchmigrate.program.syntax import target_names
from torchmigrate.rule import Context
from torchmigrate.rules.launch import creates_own_group, legacy_launch

CODES = ("TM301", "TM302", "TM303", "TM304", "TM305", "TM306")

_TM_UNWRAP = "torchmigrate.runtime.unwrap"
# loads that bring back a whole pickled model (a resume)
_RELOADS = frozenset({*LOADS, "torchmigrate.runtime.load"})
_SAVES = {"torch.save", "torchmigrate.runtime.save"}
_DP_FUNCTIONAL = {"torch.nn.parallel.data_parallel", "torch.nn.parallel.data_parallel.data_parallel"}
_SYNC_BN = ("torch.nn.SyncBatchNorm.convert_sync_batchnorm", "apex.parallel.convert_syncbn_model")

# nn.Module / DDP API that works the same on the DDP wrapper: never rewritten by TM302. (Not
# here: the structure a wrapper changes: `named_parameters()` and `named_modules()` gain a
# `module.` prefix, so an optimizer group chosen by name comes out empty; `children()` is the
# wrapped module alone, `list(model.children())[-1]` the whole model; `add_module` adds to the
# wrapper. Those go through `tm.unwrap`.)
_MODULE_API = {
    "forward", "parameters", "buffers", "train", "eval", "to", "to_empty", "cuda", "cpu",
    "xpu", "ipu", "mtia", "zero_grad", "requires_grad_", "apply", "half", "float", "double",
    "bfloat16", "type", "share_memory", "extra_repr", "training", "compile",
    "dump_patches", "call_super_init",
    # DistributedDataParallel's own API
    "no_sync", "join", "join_hook", "join_device", "join_process_group", "register_comm_hook",
    "device_ids", "output_device", "process_group", "broadcast_buffers", "find_unused_parameters",
    "gradient_as_bucket_view", "static_graph", "reducer", "require_backward_grad_sync",
    "require_forward_param_sync", "will_sync_module_buffers", "gather", "scatter", "to_kwargs",
    "bucket_bytes_cap", "module",
}
STATE_METHODS = ("state_dict", "load_state_dict")
_CONFIGISH = {*CONFIG_RECEIVERS, "FLAGS", "self.args", "self.cfg", "self.config", "self.opt", "self.hparams",
              "self.params", "self.options"}
_FREEZE = re.compile(r"requires_grad\s*=\s*False|requires_grad_\(\s*(requires_grad\s*=\s*)?False\s*\)")
_UNFREEZE = re.compile(r"requires_grad\s*=\s*True|requires_grad_\(\s*(requires_grad\s*=\s*)?(True)?\s*\)")
_WORLD = re.compile(r"world|n_?gpus?\b|num_gpus|ngpus|nprocs|n_procs|num_processes|num_replicas|"
                    r"num_nodes|nnodes|get_world_size|device_count", re.IGNORECASE)
_EMA = re.compile(r"EMA|Ema|AveragedModel|MovingAverage")


# --- small helpers -------------------------------------------------------------------------

_NOT_HOLDERS = re.compile(rf"{_EMA.pattern}|Averag|DataParallel|Writer|Summary|Profiler|Scheduler|Optim|Scaler")


# classes an `isinstance` asks about to learn whether a model is wrapped, not what it is
_WRAPPER_CLASSES = frozenset({"Module", "DataParallel", "DistributedDataParallel", "DDP", "object"})
_CONTAINERS = (cst.Dict, cst.List, cst.Tuple, cst.DictComp, cst.ListComp)


def _constructs(call: cst.Call) -> bool:
    """`GaussianDiffusion(model, ...)`, `losses.Trainer(model)`: a class built over what it is
    handed (named in CamelCase), not a wrapper the migration handles itself (DataParallel), a copy
    for averaging (EMA, AveragedModel) or a writer, profiler, scheduler, optimizer or scaler."""
    name = (dotted(call.func) or "").rsplit(".", 1)[-1]
    return bool(name) and name[0].isupper() and not name.isupper() and not _NOT_HOLDERS.search(name)


def _holds(value: cst.BaseExpression, m: str) -> bool:
    """`value` keeps a reference to the model `m` itself: an object built over it
    (`GaussianDiffusion(model)`, `Trainer(model=model)`: `_constructs`), or a dict, list or tuple
    that holds it (`kwargs = {"model": model, "data": data}`, later `run(**kwargs)`;
    `dict(model=model)`; `nets = [model, critic]`)."""
    if isinstance(value, cst.Call):
        name = dotted(value.func)
        if not (_constructs(value) or name == "dict"):
            return False
        return any(a.star == "" and dotted(a.value) == m for a in value.args)
    if isinstance(value, cst.Dict):
        return any(isinstance(e, cst.DictElement) and dotted(e.value) == m for e in value.elements)
    if isinstance(value, (cst.List, cst.Tuple)):
        return any(isinstance(e, cst.Element) and dotted(e.value) == m for e in value.elements)
    return False


def _binds_on_every_path(node: cst.If, name: str) -> bool:
    """Every branch of the `if` (an `else` included) assigns `name` in its own block, or holds
    an `if` that does, or leaves (`raise`, `assert False`, `sys.exit(...)`: an unknown choice
    that ends the run)."""
    def block_binds(block: cst.BaseSuite) -> bool:
        for statement in getattr(block, "body", ()):
            if isinstance(statement, cst.SimpleStatementLine):
                for small in statement.body:
                    if isinstance(small, cst.Assign) and any(dotted(t.target) == name for t in small.targets):
                        return True
                    if _ends_run(small):
                        return True
            elif isinstance(statement, cst.If) and _binds_on_every_path(statement, name):
                return True
        return False

    branch: Optional[cst.BaseStatement] = node
    while isinstance(branch, cst.If):
        if not block_binds(branch.body):
            return False
        branch = branch.orelse
    return isinstance(branch, cst.Else) and block_binds(branch.body)


def _ends_run(small: cst.BaseSmallStatement) -> bool:
    """`raise ...`, `assert False` / `assert(False)`, `sys.exit(...)`, `exit(...)`, `quit()`."""
    if isinstance(small, cst.Raise):
        return True
    if isinstance(small, cst.Assert):
        test = small.test
        return isinstance(test, cst.Name) and test.value == "False" or (
            isinstance(test, cst.Integer) and test.value == "0")
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        return (dotted(small.value.func) or "") in ("sys.exit", "exit", "quit", "os._exit")
    return False


def _project_bases(klass: cst.ClassDef) -> List[str]:
    """The class's bases other than `nn.Module` and `object`, as written: where its attributes
    may also be assigned."""
    return [code(b.value) for b in klass.bases if (dotted(b.value) or "").rsplit(".", 1)[-1] not in ("Module", "object")]


def _handed_unnamed(callers: List[Optimizer]) -> bool:
    """One of these calls of a helper that builds an optimizer hands it a model no name holds
    (`fit(Net(), loader)`): the wrap cannot go at that call."""
    return any(not c.models or not all(is_variable(x) for x in c.models) for c in callers)


def _no_model(value: Optional[cst.BaseExpression]) -> bool:
    """`value` is surely not a module: `None` or another literal."""
    return isinstance(value, (cst.Name,)) and value.value in ("None", "False", "True") or isinstance(
        value, (cst.BaseNumber, cst.BaseString, cst.Dict, cst.List, cst.Tuple))


@dataclass
class Wrap:
    """A binding that holds a wrapped model after the migration."""

    name: str
    kind: str  # new | ddp | apex | tm | dp | helper-<kind>
    scope: cst.CSTNode  # function or module (the method, for `self.x`)
    klass: Optional[cst.ClassDef]
    boundary: cst.CSTNode  # statement: accesses from / past it see the wrapped model
    inclusive: bool  # True: the boundary statement itself is after the wrap
    statement: Optional[cst.CSTNode] = None  # the existing wrap statement (never rewritten)
    call: Optional[cst.Call] = None  # the existing wrap call
    arg: Optional[str] = None  # dotted name of the module it wraps

    @property
    def full(self) -> bool:
        """`.module`, `state_dict()` and custom attributes all go through `tm.unwrap` (the binding
        is a `tm.wrap_model` result: DDP under torchrun, the bare module in one process)."""
        return self.kind.rsplit("-", 1)[-1] in ("new", "tm", "apex", "dp")


# `_made_where`'s answer for a model copied for each task or pass (`fast = copy.deepcopy(model)`)
_PER_TASK_COPY = "a copy made for each task or pass"


def _loop_param(target: cst.BaseAssignTargetExpression, named: bool) -> Optional[str]:
    """The name a loop over `parameters()` (`p`) or `named_parameters()` (`name, p`) binds
    each parameter to."""
    if named:
        if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2:
            target = target.elements[1].value
        else:
            return None
    return target.value if isinstance(target, cst.Name) else None


def _steps_by_grad(ctx: Context, loop: cst.For, p: str) -> bool:
    """The loop's body changes the parameter `p` in place from its gradient: `p.data.add_(p.grad,
    alpha=-lr)`, `p.data -= lr * p.grad.data`, `p.sub_(lr * p.grad)`, `p.data = p.data - lr * p.grad`."""
    def is_p(node: cst.CSTNode) -> bool:
        return isinstance(node, cst.Name) and node.value == p or (
            isinstance(node, cst.Attribute) and node.attr.value == "data" and isinstance(node.value, cst.Name)
            and node.value.value == p)

    reads_grad = any(a.attr.value == "grad" and isinstance(a.value, cst.Name) and a.value.value == p
                     for a in ctx.within(loop.body, cst.Attribute))
    if not reads_grad:
        return False
    for node in ctx.within(loop.body, cst.Call, cst.AugAssign, cst.Assign):
        if isinstance(node, cst.Call):
            f = node.func
            if isinstance(f, cst.Attribute) and f.attr.value.endswith("_") and not f.attr.value.startswith("_") \
                    and f.attr.value not in ("zero_", "requires_grad_") and is_p(f.value):
                return True
        elif isinstance(node, cst.AugAssign):
            if is_p(node.target):
                return True
        elif any(is_p(t.target) and isinstance(t.target, cst.Attribute) for t in node.targets):
            return True
    return False


@dataclass
class NewWrap:
    name: str
    opt: Optimizer
    scope: cst.CSTNode
    klass: Optional[cst.ClassDef]
    anchor: cst.CSTNode
    after: bool = False
    def_stmt: Optional[cst.CSTNode] = None
    bn: bool = False
    sync_bn: bool = False
    find_unused: str = ""  # why find_unused_parameters=True is needed
    dp: Optional["DPSite"] = None
    # the same model (re)bound in another branch of an `if`/`try`: this wrap covers that branch
    extra_of: Optional["NewWrap"] = None
    bound: Optional[cst.CSTNode] = None  # the binding in that branch (when no optimizer is built there)
    reloaded: bool = False  # ... a whole model loaded from a checkpoint after the wrap (a resume)


@dataclass
class DPSite:
    wrap: Wrap
    outer: cst.BaseExpression  # the DataParallel call with any `.cuda()`/`.to()` chain
    action: str = "keep"  # keep | remove | replace-if | move | inplace
    target: Optional[cst.CSTNode] = None  # statement removed / replaced
    note_stmt: Optional[cst.CSTNode] = None
    conditional: bool = False
    small: Optional[cst.CSTNode] = None  # the small statement holding the DataParallel call
    wrap_after: bool = False  # collapse: append `name = tm.wrap_model(name)` after the else body
    # inplace in one branch of an `if` whose every branch binds the name: `name =
    # tm.wrap_model(name)` goes after that `if` too, so the single-device branch is wrapped
    ensure_after: Optional[cst.CSTNode] = None
    reason: str = ""  # why a "manual" site is left to the user
    loading_copy: bool = False  # a "part" in a model's own method: a copy built to load a checkpoint
    bn: bool = False
    sync_bn: bool = False
    find_unused: str = ""


@dataclass
class AttrRewrite:
    node: cst.Attribute
    name: str
    attr: str
    owner: str  # rule code that reports it
    dp: bool = False
    use: str = ""  # for the model itself (`attr` ""): "save" or "graph" (else a copy)
    manual: bool = False  # reported only (lint: a checkpoint of the script's own DDP)
    synced: bool = False  # a method computing the training loss: `tm.synced(model).loss(...)`


# --- the plan ------------------------------------------------------------------------------

def plan(ctx: Context) -> "Plan":
    found = ctx.facts.get("model_plan")
    if found is None:
        found = Plan(ctx)
        ctx.facts["model_plan"] = found
    return found  # type: ignore[return-value]


def wrapped_models(ctx: Context) -> List[str]:
    """Dotted names of the models that are DDP-wrapped after this run (newly wrapped by TM301,
    already wrapped by DDP / `tm.wrap_model`, or converted from `nn.DataParallel`), for the rules
    of other families that run before the model rules (also `ctx.facts["wrapped_models"]`). A
    decision, not a fact: it depends on the options and on which model rules are enabled."""
    return plan(ctx).wrapped_names


class Plan:
    """What this run does with the models of one module (see the module docstring), decided from
    its model facts (`self.models`, `program.models`), the options and the rules enabled."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.f = facts(ctx)
        enabled = ctx.facts.get("model_rules", set())
        mode = ctx.options.mode
        distributed = is_distributed(ctx)
        self.active = {c: c in enabled and (mode == "ddp" or (mode == "lint" and (distributed or c == "TM306")))
                       for c in CODES}
        self.tm = ctx.tm
        self._memo: Dict[tuple, object] = {}
        self._delegated: Optional[Set[cst.CSTNode]] = None
        self._final: Optional[List[Wrap]] = None
        self.wraps: List[Wrap] = []
        self.hand_trained = False  # a loop steps some model's parameters from their gradients (`_trained_by_hand`)
        # functions and methods of the file that return a wrapped model (name -> kind of wrap)
        self.returning_wrap: Dict[str, str] = {}
        self.covered: Set[Tuple[str, cst.CSTNode]] = set()  # wrapped by anything
        self.covered_not_dp: Set[Tuple[str, cst.CSTNode]] = set()  # ... by anything but DataParallel
        self.new: List[NewWrap] = []
        self.manual301: List[Tuple[cst.CSTNode, str, Optional[cst.CSTNode]]] = []
        self.dp_sites: List[DPSite] = []
        self.dp_functional: List[cst.Call] = []
        self.rewrites: List[AttrRewrite] = []
        self.notes: Dict[str, List[Tuple[cst.CSTNode, str, Optional[cst.CSTNode]]]] = {c: [] for c in CODES}
        # TM305: optimizers of the models wrapped (`ddp`: by this run) whose learning rate does
        # not scale with the world size, with their `lr` argument (None: the default)
        self.lr_sites: List[Tuple[Optimizer, Optional[cst.Arg]]] = []
        # notes that are advice (correct either way: BatchNorm statistics per rank, a needless
        # find_unused_parameters), listed in the report's notes rather than as TODOs
        self.advice: Set[cst.CSTNode] = set()
        self.sync_bn_fixes: List[Tuple[cst.CSTNode, str, list]] = []
        self.sync_bn_applies = (ctx.options.mode == "ddp" and ctx.options.sync_bn) or (
            ctx.options.mode == "lint" and ctx.options.unsafe_fixes)
        self.has_sync_bn = bool(calls_to(ctx, *_SYNC_BN))

        self.error: Optional[str] = None
        try:
            self.models = model_facts(ctx)
            self._existing()
            self._from_other_modules()
            if self.active["TM301"] and not self.models.framework:
                self._plan_new()
            self._plan_dp()
            self._unused_and_bn()
            self._attributes()
            self._partial_methods()
            self._lr_notes()
            names: List[str] = []
            for w in self.final_wraps():
                if w.name not in names and not w.kind.startswith("instance"):
                    names.append(w.name)
        except Exception as exc:  # never lose the rest of the migration to a model-rule bug
            if os.environ.get("TORCHMIGRATE_DEBUG"):
                raise
            self._reset(f"{type(exc).__name__}: {exc}")
            names = []
        self.wrapped_names = names
        ctx.facts["wrapped_models"] = names
        ctx.facts["unwrapped_attrs"] = {r.node for r in self.rewrites}

    def _reset(self, error: str) -> None:
        """Give up on the whole plan: change nothing, report one manual finding (TM301)."""
        self.error = error
        self.wraps, self.new, self.dp_sites, self.dp_functional, self.rewrites = [], [], [], [], []
        self.sync_bn_fixes, self.manual301 = [], []
        self.notes = {c: [] for c in CODES}
        self.lr_sites, self.advice = [], set()
        self._final = []
        self.manual301.append((self.ctx.module.body[0] if self.ctx.module.body else self.ctx.module,
                               f"could not analyse the models of this file ({error}): wrap each trained model "
                               f"with `{self.tm}.wrap_model(model)` before creating its optimizer", None))

    # --- names -------------------------------------------------------------------------
    def key(self, name: str, node: cst.CSTNode):
        if name.startswith(("self.", "cls.")):
            return name, self.models.class_of(node)
        return name, self.models.scope(node)

    # --- existing wraps ----------------------------------------------------------------
    def _kind(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """The wrapper kind of `call` (`ModelFacts.wrapper_kind`), as this run sees it: a legacy
        script's DDP becomes `tm.wrap_model` (TM301), a runtime wrap."""
        kind = self.models.wrapper_kind(call, name)
        return "tm" if kind == "ddp" and legacy_launch(self.ctx) else kind

    def _existing(self) -> None:
        returning = self.returning_wrap
        for call, name in self.f.calls:
            kind = self._kind(call, name)
            if name in _DP_FUNCTIONAL:
                self.dp_functional.append(call)
            if kind is None:
                continue
            outer, parent = self.models.wrapper_site(call)
            statement = self.ctx.statement_of(call)
            if kind == "other":
                for a in call.args:
                    n = dotted(strip_moves(a.value))
                    if n:
                        self.covered.add(self.key(n, call))
                        self.covered_not_dp.add(self.key(n, call))
                if isinstance(parent, cst.Assign):
                    for t in parent.targets:
                        for n, _ in assign_targets(t.target, None):
                            self.covered.add(self.key(n, call))
                            self.covered_not_dp.add(self.key(n, call))
                continue
            a = self.models.wrapped_arg(call)
            arg = dotted(strip_moves(a.value)) if a is not None else None
            target = None
            if isinstance(parent, cst.Assign) and parent.value is outer and len(parent.targets) == 1:
                target = dotted(parent.targets[0].target)
            elif isinstance(parent, cst.AnnAssign) and parent.value is outer:
                target = dotted(parent.target)
            w = Wrap(target or arg or "", kind, self.models.scope(call), self.models.class_of(call), statement, False,
                     statement=statement, call=call, arg=arg)
            self.wraps.append(w)
            if kind == "dp":
                self.dp_sites.append(DPSite(w, outer))
            for n in (target, arg):
                if n:
                    self.covered.add(self.key(n, call))
                    if kind != "dp":
                        self.covered_not_dp.add(self.key(n, call))
            func = self.ctx.enclosing(call, cst.FunctionDef)
            if func is not None and (isinstance(parent, cst.Return) or (target and self.models.returns(func, target))):
                returning[func.name.value] = kind
        if not returning:
            return
        for a in self.f.assigns:
            value = strip_moves(a.value)
            if not isinstance(value, cst.Call):
                continue
            f = value.func
            fname = f.value if isinstance(f, cst.Name) else (
                f.attr.value if isinstance(f, cst.Attribute) and dotted(f.value) in ("self", "cls") else None)
            if fname not in returning:
                continue
            for t in a.targets:
                for n, _ in assign_targets(t.target, None):
                    statement = self.ctx.statement_of(a)
                    self.wraps.append(Wrap(n, "helper-" + returning[fname], self.models.scope(a),
                                           self.models.class_of(a), statement, False, statement=statement))
                    self.covered.add(self.key(n, a))
                    if returning[fname] != "dp":
                        self.covered_not_dp.add(self.key(n, a))

    def _from_other_modules(self) -> None:
        """Parameters (and `self.` attributes stored from them in `__init__`) that receive, from
        another module of the program, a model the program wraps: `def evaluate(model, loader)`
        in engine.py called as `evaluate(model, val_loader)` from train.py. They hold the
        wrapped model from the top of the function, so custom attributes, `.module` and
        `state_dict()` go through `tm.unwrap` (a no-op on a model that turns out unwrapped)."""
        program = self.ctx.program
        if not (program.wrapped_params or program.wrapped_attrs):
            return
        for top in self.ctx.module.body:
            defs = [(top, None)] if isinstance(top, cst.FunctionDef) else []
            if isinstance(top, cst.ClassDef) and isinstance(top.body, cst.IndentedBlock):
                defs = [(d, top) for d in top.body.body if isinstance(d, cst.FunctionDef)]
            for func, klass in defs:
                qual = f"{klass.name.value}.{func.name.value}" if klass is not None else func.name.value
                names = sorted(program.wrapped_params.get(qual, ()))
                if klass is not None and func.name.value == "__init__":
                    for attr in sorted(program.wrapped_attrs.get(klass.name.value, ())):
                        store = self.models.self_store(func, attr)
                        if store is not None:
                            self.wraps.append(Wrap(f"self.{attr}", "program-tm", func, klass, store, False,
                                                   statement=store))
                            self.covered.add((f"self.{attr}", klass))
                            self.covered_not_dp.add((f"self.{attr}", klass))
                body = func.body.body if isinstance(func.body, cst.IndentedBlock) else [func.body]
                if not names or not body:
                    continue
                for name in names:
                    self.wraps.append(Wrap(name, "program-tm", func, klass, body[0], True))
                    self.covered.add((name, func))
                    self.covered_not_dp.add((name, func))

    def _removable_dp(self, key) -> bool:
        """DataParallel wraps TM306 may drop in favour of TM301's wrap: `m = DataParallel(m)`."""
        if not self.active["TM306"] or key in self.covered_not_dp:
            return False
        for site in self.dp_sites:
            w = site.wrap
            if self.key(w.name, w.call) == key and w.name == w.arg and self._is_dp_assign(site):
                return True
        return False

    def _dp_to_defer(self, m: str, scope: cst.CSTNode, stmt0: cst.CSTNode) -> Optional[DPSite]:
        """`net = DataParallel(base)`, then `base.load_state_dict(...)` / `base.apply(init)` /
        `base.fc.weight = ...` before `net`'s optimizer: DDP broadcasts rank 0's parameters when it
        is built, so the wrap must follow those. The DataParallel site whose wrap TM301 moves to
        the optimizer instead (TM306 then leaves `net = base`)."""
        if not self.active["TM306"] or (m, scope) in self.covered_not_dp or "." in m:
            return None
        found = None
        for site in self.dp_sites:
            w = site.wrap
            if w.name != m or self.models.scope(w.call) is not scope or not w.arg or "." in w.arg or w.arg == m:
                continue
            if found is not None or not self._is_dp_assign(site) or w.statement is None:
                return None
            found = site
        if found is None:
            return None
        start, end = self.models.last_idx(found.wrap.statement), self.models.idx(stmt0)
        return found if start < end and self.models.modified_in_place({m, found.wrap.arg}, scope, start, end) else None

    def _is_dp_assign(self, site: DPSite) -> bool:
        """`name = DataParallel(...)` alone on its line (or one-line suite)."""
        parent = self.ctx.parent(site.outer)
        if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1 and parent.value is site.outer):
            return False
        container = self.ctx.parent(parent)
        return isinstance(container, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) and len(container.body) == 1

    # --- new wraps (TM301) -------------------------------------------------------------
    def _plan_new(self) -> None:
        opts = optimizers(self.ctx)
        best: Dict[tuple, NewWrap] = {}
        cands: Dict[tuple, List[NewWrap]] = {}  # every placement, for `_other_branches`
        own = self._own_optimizers(opts)
        for o in opts:
            if id(o) in own:
                self.manual301.append((o.call, own[id(o)], o.statement))
                continue
            if o.via is not None and (id(o.via) in own or self._super_site(o)) and not o.models:
                continue
            if self.delegated(o) and not self._wrapped_inside(o):
                continue
            unwrapped = self._unwrapped_owners(o) if not o.models else []
            if unwrapped:
                # `SGD(tm.unwrap(model).fc.parameters())` (TM302's rewrite): `model` is wrapped
                for m in unwrapped:
                    placed = self._placement(o, m)
                    if isinstance(placed, NewWrap):
                        k = (m, placed.klass if m.startswith(("self.", "cls.")) else placed.scope)
                        cands.setdefault(k, []).append(placed)
                        if k not in best:
                            best[k] = placed
                continue
            if not o.models:
                params = o.call.args[0].value if o.call.args else None
                if self._wraps_itself():
                    continue  # its models are wrapped; which one this optimizer trains does not matter
                if self._factory_parameter(o, params):
                    continue  # `def get_optimizer(name, parameters, lr)`: its callers say whose parameters
                if o.via is not None and self._trains_own_param(o.via):
                    continue  # `Trainer().train(loader, Net())`: the method that trains its model wraps it
                if o.via is not None or (params is not None and "param" in code(params).lower()):
                    self.manual301.append((o.call, "cannot tell which model this optimizer trains: wrap that model "
                                           f"with `model = {self.tm}.wrap_model(model)` before creating the optimizer",
                                           o.statement))
                continue
            for m in o.models:
                placed = self._placement(o, m)
                if placed is None:
                    continue
                if isinstance(placed, str):
                    self.manual301.append((o.call, placed, o.statement))
                    continue
                k = (m, placed.klass if m.startswith(("self.", "cls.")) else placed.scope)
                cands.setdefault(k, []).append(placed)
                old = best.get(k)
                if old is None or self._prefer(placed, old):
                    best[k] = placed
        if not opts and self.ctx.options.mode == "ddp" and not self.wraps:
            self._trained_by_hand(best)
        self._for_subclasses(best)
        self.new = self._in_place_order(best.values())
        self._leave_own_group_alone()
        self._other_branches(cands)
        self._rebuilt_later(cands)
        self._reloaded()
        self._merge_adjacent()
        # A module of a program whose model is trained (and wrapped) elsewhere: its backward
        # runs through the wrapper the caller passes in.
        elsewhere = self.ctx.program.followed and self.ctx.program.program_trains
        if not opts and self.ctx.options.mode == "ddp" and not self.wraps and not elsewhere and not self.new \
                and not self.hand_trained:
            self._no_optimizer()

    def _trained_by_hand(self, best: Dict[tuple, NewWrap]) -> None:
        """`for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)` after a backward: a model
        trained without an optimizer (hand-written SGD, an RNN language model's classic loop). DDP
        averages gradients in `backward()` whatever steps them, so the model is wrapped right
        after the one assignment that creates it, before the first forward. A function's loop over
        a model of the module (`model = Net()` at the top, read in `train()`) wraps it at module
        level; over a model it is handed (`def train_epoch(model, loader, lr)`), where this file's
        callers make the model they pass (another module's callers: `ModuleView.optimizer_builders`).
        A model made in several places, or by nobody this file sees, gets a TODO."""
        ctx = self.ctx
        for call, _ in self.f.calls:
            func = call.func
            loop = ctx.parent(call)
            if not (isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters")
                    and isinstance(loop, cst.For) and loop.iter is call):
                continue
            m = dotted(func.value)
            param = _loop_param(loop.target, func.attr.value == "named_parameters")
            if not m or not is_variable(m) or m in ("self", "cls") or param is None \
                    or not _steps_by_grad(ctx, loop, param) or not analysis.runs_backward(ctx, self.models.scope(call)):
                continue
            self.hand_trained = True
            sites = self._made_where(m, call, 0)
            if sites == _PER_TASK_COPY:
                self.manual301.append((call, f"`{m}` is a copy made for each task or pass and stepped by hand here: each "
                                       "rank adapts its own copy to its own data, as meta-learning does, but the update "
                                       "these copies make to the model they were copied from must be averaged across "
                                       f"ranks (`{self.tm}.all_reduce(..., op=\"mean\")` of the update, or of the "
                                       "outer gradients), or the ranks' models part", ctx.statement_of(call)))
                continue
            if isinstance(sites, str):
                self.manual301.append((call, f"`{m}` is trained by hand (its parameters stepped from their gradients, "
                                       f"no optimizer) but {sites}: wrap it with `{m} = {self.tm}.wrap_model({m})` "
                                       "where it is made, so that DDP averages its gradients", ctx.statement_of(call)))
                continue
            for name, klass, made, value in sites:
                scope = self.models.scope(made)
                key = (name, klass if klass is not None else scope)
                if key not in best and key not in self.covered:
                    opt = Optimizer(value, made, None, (name,))  # the model's creation stands for the optimizer
                    best[key] = NewWrap(name, opt, scope, klass, made, after=True, def_stmt=made)

    def _made_where(self, m: str, node: cst.CSTNode, depth: int):
        """Where the model `m`, as `node`'s scope reads it, is made: (name, class, statement, value)
        of each assignment to wrap after, following this file's callers of a function that is handed
        the model (up to three calls deep); [] where another module's callers do it; else why not."""
        ctx = self.ctx
        scope = self.models.scope(node)
        klass = self.models.class_of(node) if m.startswith(("self.", "cls.")) else None
        if m.startswith(("self.", "cls.")) and klass is None:
            return "is not made in a class of this file"
        root = m.split(".")[0]
        before = self.models.idx(ctx.statement_of(node))
        if isinstance(scope, cst.FunctionDef) and klass is None and root in self.models.params(scope) \
                and not self.models.assigned_in(scope, m):
            return self._handed(scope, root, m, depth)
        if klass is None and isinstance(scope, cst.FunctionDef) and not self.models.assigned_in(scope, m):
            scope, before = ctx.module, None  # a model of the module's, which the function reads
        defs = [(d, v) for d, v in self.models.definitions(m, scope, klass, before=before) if not _no_model(v)]
        if not defs or defs[-1][1] is None:
            return "is not made in this scope"
        if klass is not None and len({self.models.scope(d) for d, _ in defs}) > 1:
            return "is made in several methods"
        made = self._after_all(defs, self.models.scope(defs[0][0]))
        if made is None:
            return "is made in several places"
        if any(self.ctx.resolve(c.func) in ("copy.deepcopy", "copy.copy")
               for c in self.ctx.within(defs[-1][1], cst.Call)) or loops_of(made, self.ctx, self.models.scope(made)):
            # a copy made for each task or pass (MAML/Reptile's `fast = deepcopy(model)`, stepped by
            # hand on one task's data): averaging its gradients across ranks would mix the tasks
            return _PER_TASK_COPY
        return [(m, klass, made, defs[-1][1])]

    def _after_all(self, defs, scope: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement after which every assignment in `defs` has run: in the innermost block
        that holds them all, the one that holds the last (`model = Net()` then `if cuda: model =
        model.cuda()`: the `if`)."""
        chains = [self._blocks(self.ctx.statement_of(d), scope) for d, _ in defs]
        for block, _ in chains[0]:
            if all(any(b is block for b, _ in chain) for chain in chains):
                return next(child for b, child in chains[-1] if b is block)
        return None

    def _handed(self, func: cst.FunctionDef, param: str, m: str, depth: int):
        """`_made_where` for `m` (`param` or an attribute of it) handed to `func` by its callers."""
        ctx = self.ctx
        names = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
        klass = self.models.class_of(func)
        method = klass is not None and ctx.parent(ctx.parent(func)) is klass
        position = names.index(param) - (1 if method else 0) if param in names else None
        sites, callers = [], 0
        for call, _ in self.f.calls:
            f = call.func
            if method:
                if not (isinstance(f, cst.Attribute) and f.attr.value == func.name.value
                        and isinstance(f.value, cst.Name) and f.value.value == "self"
                        and self.models.class_of(call) is klass):
                    continue
            elif not (isinstance(f, cst.Name) and f.value == func.name.value):
                continue
            callers += 1
            value = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == param), None)
            positional = [a for a in call.args if a.keyword is None]
            if value is None and position is not None and position < len(positional) \
                    and not any(a.star for a in positional[:position + 1]):
                value = positional[position].value
            handed = dotted(value) if value is not None else None
            if handed is None or not is_variable(handed) or depth >= 3:
                return f"is handed to {func.name.value}() in a way this file cannot follow"
            found = self._made_where(handed + m[len(param):], call, depth + 1)
            if isinstance(found, str):
                return found
            sites.extend(found)
        if callers:
            return sites
        qual = func.name.value if ctx.parent(ctx.parent(func)) is ctx.module else None
        if qual is not None and qual in ctx.program.builders_for_others:
            return []  # another module calls it with the model, and wraps it there
        return f"is a parameter of {func.name.value}(), which nobody in this file calls"

    def _for_subclasses(self, best: Dict[tuple, NewWrap]) -> None:
        """Attributes this module's classes assign and a subclass trains (`ModuleView.base_wraps`:
        `BaseTrainer.__init__` builds `self.model`, `class Classifier(BaseTrainer)` builds its
        optimizer): wrapped right after the assignment in `__init__`, so the subclass's optimizer
        and forward see the wrapper. An assignment only inside a branch, or outside `__init__`,
        gets a TODO there instead (the other paths would keep the bare model)."""
        wanted = self.ctx.program.base_wraps
        for klass in self.ctx.module.body if wanted else ():
            if not isinstance(klass, cst.ClassDef) or klass.name.value not in wanted:
                continue
            init = next((f for f in klass.body.body if isinstance(f, cst.FunctionDef) and f.name.value == "__init__"),
                        None) if isinstance(klass.body, cst.IndentedBlock) else None
            for attr in sorted(wanted[klass.name.value]):
                m = f"self.{attr}"
                if (m, klass) in best or (m, klass) in self.covered:
                    continue
                store = self.models.self_store(init, attr) if init is not None else None
                defs = self.models.definitions(m, klass, klass)
                if store is None or store not in getattr(init.body, "body", ()) or len(defs) != 1:
                    node = defs[0][0] if defs else klass.name
                    self.manual301.append((node, f"`{m}` is trained by a subclass's optimizer: wrap it with `{m} = "
                                                 f"{self.tm}.wrap_model({m})` where it is built", None))
                    continue
                value = defs[0][1] if defs[0][1] is not None else defs[0][0]
                opt = Optimizer(value, store, None, (m,))  # the model's creation stands for the optimizer
                best[(m, klass)] = NewWrap(m, opt, init, klass, store, after=True, def_stmt=store)

    def _other_branches(self, cands: Dict[tuple, List[NewWrap]]) -> None:
        """`if ckpt is None: model = Net(); opt = Adam(model.parameters())` / `else: model =
        ckpt["model"]`: the wrap before the optimizer covers one branch only, so the model
        (re)bound in the other branches of the `if` (or `try`) is wrapped there too: before that
        branch's own optimizer for it, else at the end of the branch."""
        extra: List[NewWrap] = []
        for nw in list(self.new):
            if nw.after or nw.extra_of is not None:
                continue
            k = (nw.name, nw.klass if nw.name.startswith(("self.", "cls.")) else nw.scope)
            seen: Set[int] = set()
            for d, value in self.models.definitions(nw.name, nw.scope, nw.klass):
                if self.models.scope(d) is not nw.scope or _no_model(value):
                    continue  # `else: generator = None`: nothing to wrap on that path
                ds = self.ctx.statement_of(d)
                sibling = self._sibling_branch(nw.anchor, ds, nw.scope)
                if sibling is None or id(sibling[0]) in seen:
                    continue
                branch, split = sibling
                seen.add(id(branch))
                if not self._read_after(nw.name, split, nw.scope):
                    continue  # `else: model = ckpt["model"]; evaluate(model)`: the path ends unwrapped, as it should
                inside = [c for c in cands.get(k, ()) if c is not nw and not c.after and c.extra_of is None
                          and any(a is branch for a in self.ctx.ancestors(c.anchor))]
                if inside:
                    c = min(inside, key=lambda c: self.models.idx(c.anchor))
                    c.extra_of = nw
                    extra.append(c)
                    continue
                block = self._bound_block(ds, branch, nw.name)
                body = getattr(block, "body", None)
                last = body[-1] if isinstance(block, cst.IndentedBlock) and body else None
                # (not in an `except` block: a collective there hangs when only some ranks raise, TM104)
                if last is None or self._exits(last) or isinstance(self.ctx.parent(branch), cst.ExceptHandler):
                    self.manual301.append((d, f"`{nw.name}` is also bound here, in another branch than the one that "
                                           f"builds its optimizer: wrap it with `{nw.name} = {self.tm}.wrap_model("
                                           f"{nw.name})` on this path too (on every rank)", ds))
                    continue
                extra.append(NewWrap(nw.name, nw.opt, nw.scope, nw.klass, last, after=True, def_stmt=ds,
                                     extra_of=nw, bound=d))
        if extra:
            self.new = self._in_place_order([*self.new, *extra])

    def _rebuilt_later(self, cands: Dict[tuple, List[NewWrap]]) -> None:
        """`if arch == "small": model = Linear(...); fit(model)` then `if arch == "big": model =
        Sequential(...); fit(model)`: the name is bound to another model after the chosen wrap and
        trained again, at another optimizer site; that site gets its own wrap (wrapping the same
        module twice gives its wrapper back, so where both run nothing changes)."""
        extra: List[NewWrap] = []
        for nw in list(self.new):
            if nw.after or nw.extra_of is not None:
                continue
            k = (nw.name, nw.klass if nw.name.startswith(("self.", "cls.")) else nw.scope)
            start = self.models.idx(nw.anchor)
            defs = [self.models.idx(self.ctx.statement_of(d)) for d, value in
                    self.models.definitions(nw.name, nw.scope, nw.klass)
                    if self.models.scope(d) is nw.scope and not _no_model(value)
                    and not (value is not None and dotted(strip_moves(value)) == nw.name)]  # `model = model.train()`: the same module
            for c in cands.get(k, ()):
                if c is nw or c.after or c.extra_of is not None or c in extra:
                    continue
                end = self.models.idx(c.anchor)
                if end > start and any(start < i < end for i in defs) \
                        and not any(e.anchor is c.anchor for e in [*self.new, *extra]):
                    c.extra_of = nw
                    extra.append(c)
        if extra:
            self.new = self._in_place_order([*self.new, *extra])

    def _reloaded(self) -> None:
        """`model, optim, step = torch.load(ckpt)` after the wrap (a resume that pickled the whole
        model): the name is bound again to the plain module, which trains outside DDP from then on
        (no gradient averaged, the ranks drift apart). It is wrapped again right after the load;
        the optimizer loaded beside it holds the same module's parameters, which the wrapper keeps."""
        extra: List[NewWrap] = []
        for nw in list(self.new):
            if nw.after or nw.extra_of is not None or nw.name.startswith(("self.", "cls.")):
                continue
            start, block = self.models.idx(nw.anchor), self.ctx.parent(nw.anchor)
            for d, _value in self.models.definitions(nw.name, nw.scope, nw.klass):
                ds = self.ctx.statement_of(d)
                if self.models.scope(d) is not nw.scope or self.models.idx(ds) <= start \
                        or not isinstance(ds, cst.SimpleStatementLine) or len(ds.body) != 1:
                    continue
                if not any(a is block for a in self.ctx.ancestors(ds)):
                    continue  # another path than the wrap's (a branch that builds its own optimizer)
                loads = [c for c in self.ctx.within(ds, cst.Call)
                         if self.ctx.resolve(c.func) in _RELOADS]
                if loads and self._wrapped_next(nw.name, ds):
                    continue  # `model = torch.load(p); model = DataParallel(model)`: TM306 makes that the wrap
                if loads and not any(w.anchor is ds for w in extra):
                    extra.append(NewWrap(nw.name, nw.opt, nw.scope, nw.klass, ds, after=True, def_stmt=ds,
                                         extra_of=nw, bound=d, reloaded=True))
        if extra:
            self.new = self._in_place_order([*self.new, *extra])

    def _wrapped_next(self, name: str, statement: cst.CSTNode) -> bool:
        """The statement after `statement` wraps `name` in DataParallel (also under an `if`)."""
        following = self._next_statement(statement)
        return following is not None and any(
            site.wrap.name == name and any(a is following for a in self.ctx.ancestors(site.outer))
            for site in self.dp_sites)

    def _in_place_order(self, wraps) -> List[NewWrap]:
        """New wraps in the order of the statements they go before (or after)."""
        return sorted(wraps, key=lambda w: (self.models.idx(w.anchor), w.after))

    @staticmethod
    def _exits(statement: cst.CSTNode) -> bool:
        return isinstance(statement, cst.SimpleStatementLine) and isinstance(
            statement.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))

    def _read_after(self, name: str, split: cst.CSTNode, scope: cst.CSTNode) -> bool:
        """`name` may be read once the `if`/`try` statement `split` is over: it is read after it
        in `scope`, or `split` sits in a loop (the next round reads it), or it is an attribute
        (`self.model`, which other methods read)."""
        if "." in name:
            return True
        if any(isinstance(a, (cst.For, cst.While)) for a in self.ctx.ancestors_until(split, scope)):
            return True
        end = self.ctx.last_position(split)
        return any(order > end and self.ctx.scope_of(n) is scope and is_load(self.ctx, n)
                   and binding_of(self.ctx, n) is None for order, n in source_index(self.ctx).names(name))

    def _bound_block(self, statement: cst.CSTNode, branch: cst.CSTNode, name: str) -> cst.CSTNode:
        """The block whose end a wrap for the binding `statement` goes to: the outermost block
        from `statement`'s own up to `branch` at whose end `name` is bound on every path (not
        after an inner `if` that binds it in one branch only: UnboundLocalError on the other)."""
        block = self.ctx.parent(statement)
        while block is not branch:
            compound = self._whole_if(self.ctx.parent(block))
            if not (isinstance(compound, cst.If) and _binds_on_every_path(compound, name)):
                break
            outer = self.ctx.parent(compound)
            if not isinstance(outer, cst.IndentedBlock):
                break
            block = outer
        return block

    def _sibling_branch(self, a: cst.CSTNode, b: cst.CSTNode,
                        scope: cst.CSTNode) -> Optional[Tuple[cst.CSTNode, cst.CSTNode]]:
        """When statements `a` and `b` sit in mutually exclusive branches of one `if`/`elif`/`else`
        (or `try` body / `except` handlers): the outermost block of `b`'s branch, and that
        `if`/`try` statement."""
        up: Dict[int, cst.CSTNode] = {}  # id(ancestor of a) -> its child on a's path
        node: Optional[cst.CSTNode] = a
        while node is not None and node is not scope:
            parent = self.ctx.parent(node)
            if parent is not None:
                up[id(parent)] = node
            node = parent
        path = [b]
        node = b
        while node is not None and node is not scope and id(node) not in up and node is not a:
            node = self.ctx.parent(node)
            path.append(node)
        if node is None or node is scope or node is a or len(path) < 2:
            return None
        lca, child_b, child_a = node, path[-2], up[id(node)]
        if isinstance(lca, cst.If):
            if lca.test is child_a or lca.test is child_b:
                return None
        elif isinstance(lca, cst.Try):
            kinds = {type(child_a), type(child_b)}
            if cst.ExceptHandler not in kinds or cst.Finally in kinds:
                return None
        else:
            return None
        blocks = [n for n in path[:-1] if isinstance(n, (cst.IndentedBlock, cst.SimpleStatementSuite))]
        if not blocks:
            return None
        return blocks[-1], self._whole_if(lca)

    def _whole_if(self, node: cst.CSTNode) -> cst.CSTNode:
        """The `if` statement an `elif` (or `else`) belongs to; any other node itself."""
        while isinstance(self.ctx.parent(node), cst.If) and self.ctx.parent(node).orelse is node:
            node = self.ctx.parent(node)
        return node

    def _leave_own_group_alone(self) -> None:
        """A script that creates its own process group (`init_process_group`, often behind a
        flag) but wraps no model in DDP synchronises gradients its own way (NVIDIA/tacotron2's
        `apply_gradient_allreduce`) or not at all: a `tm.wrap_model` there would average the
        gradients twice, or find no process group when the flag is off. Reported instead."""
        if not self.new or any(w.kind not in ("new", "dp", "tm") for w in self.wraps):
            return  # the script's own DDP wraps (not `tm.wrap_model`, which a first run may have added)
        if not creates_own_group(self.ctx):
            return
        keep = []
        for w in self.new:
            if w.dp is not None:
                keep.append(w)
                continue
            self.manual301.append((w.opt.call, f"this script creates its own process group but wraps no model in DDP "
                                   f"(it may average gradients itself): if `{w.name}` needs DDP, wrap it with "
                                   f"`{w.name} = {self.tm}.wrap_model({w.name})` where the script's distributed "
                                   f"setup has run", w.opt.statement))
        self.new = keep

    def _own_optimizers(self, opts: List[Optimizer]) -> Dict[int, str]:
        """Optimizers a module builds from its own `self.parameters()` (`self.opt = Adam(self.parameters())`
        in a layer's `__init__`) that no call site of the file turns into a wrappable model."""
        out: Dict[int, str] = {}
        for o in opts:
            if o.via is not None or not any(m in ("self", "cls") for m in o.models):
                continue
            klass = self.models.class_of(o.call)
            if klass is None:
                continue
            if any(s.via is o and s.models and not self._super_site(s) for s in opts):
                continue
            if klass.name.value in self.ctx.program.wrapped_where_made:
                continue  # wrapped where the program makes it (`model = SessionGraph(...)`)
            tm = self.tm
            out[id(o)] = (f"class {klass.name.value} builds its own optimizer from `self.parameters()`, so its model "
                      f"cannot be wrapped in DDP before the optimizer: wrap the module with "
                      f"`{tm}.wrap_model(...)` and build the optimizer outside it, or wrap manually")
        return out

    @staticmethod
    def _super_site(o: Optimizer) -> bool:
        """`super().__init__(...)`: not a call of the helper that builds the optimizer."""
        f = o.call.func
        return (isinstance(f, cst.Attribute) and isinstance(f.value, cst.Call)
                and isinstance(f.value.func, cst.Name) and f.value.func.value == "super")

    def _unwrapped_owners(self, o: Optimizer) -> List[str]:
        """`m` for optimizer parameters `tm.unwrap(m).<...>.parameters()`."""
        if not o.call.args:
            return []
        text = self.models.text(o.call.args[0].value)
        if "unwrap" not in text:
            return []
        out = []
        for match in re.finditer(r"([\w.]+)\.unwrap\(\s*([A-Za-z_][\w.]*)\s*\)", text):
            if self.ctx.resolve(expr(match.group(1) + ".unwrap")) == _TM_UNWRAP and match.group(2) not in out:
                out.append(match.group(2))
        return out

    def _no_optimizer(self) -> None:
        """A training script that updates its parameters by hand (`p.data.add_(...)`): nothing to wrap.
        Not a module whose training step steps an optimizer it was handed (`def train_one_epoch(model,
        optimizer, ...)`: `optimizer.step()`, `scaler.step(optimizer)`): the optimizer, and the model's
        wrap, are made by its caller."""
        for call, _ in self.f.calls:
            f = call.func
            if not (isinstance(f, cst.Attribute) and f.attr.value == "step"):
                continue
            scope = self.models.scope(call)
            params = self.models.params(scope) if isinstance(scope, cst.FunctionDef) else ()
            stepped = [dotted(f.value) or "", *(dotted(a.value) or "" for a in call.args)]
            if any("optim" in n.lower() and n.split(".")[0] in params for n in stepped):
                return
        for call, _ in self.f.calls:
            f = call.func
            if not (isinstance(f, cst.Attribute) and f.attr.value == "backward"):
                continue
            scope = self.models.scope(call)
            statement = self.ctx.statement_of(call)
            node = statement
            while node is not None and node is not scope:
                if isinstance(node, (cst.For, cst.While)):
                    statement = node
                node = self.ctx.parent(node)
            tm = self.tm
            self.manual301.append((call, "no optimizer found (parameters updated by hand?), so no model was wrapped "
                                   "in DDP and every rank trains its own copy: wrap the trained model with "
                                   f"`model = {tm}.wrap_model(model)` after creating it (DDP averages the gradients "
                                   "in backward(), so manual updates keep working)", statement))
            return

    def delegated(self, o: Optimizer) -> bool:
        """An optimizer built in a helper from its parameters, wrapped at the helper's call sites."""
        if self._delegated is None:
            self._delegated = set()
            for c in optimizers(self.ctx):
                if c.via is not None:
                    func = self.ctx.enclosing(c.via.call, cst.FunctionDef)
                    if func is not None:
                        self._delegated.add(func)
        if o.via is not None:
            return False
        func = self.ctx.enclosing(o.call, cst.FunctionDef)
        if func not in self._delegated:
            return False
        params = self.models.params(func)
        args = o.call.args
        first = args[0].value if args and args[0].keyword is None else None
        return bool(set(o.models) & (params | {"self", "cls"})) or (
            not o.builder and isinstance(first, cst.Name) and first.value in params)

    def _prefer(self, new: NewWrap, old: NewWrap) -> bool:
        if new.klass is not None:
            new_init = self.ctx.enclosing(new.anchor, cst.FunctionDef)
            old_init = self.ctx.enclosing(old.anchor, cst.FunctionDef)
            a = new_init is not None and new_init.name.value == "__init__"
            b = old_init is not None and old_init.name.value == "__init__"
            if a != b:
                return a
        return self.models.idx(new.anchor) < self.models.idx(old.anchor)

    def _placement(self, o: Optimizer, m: str):
        ctx, tm = self.ctx, self.tm
        if m in ("self", "cls"):
            return None
        if not is_variable(m):  # never suggest `True = tm.wrap_model(True)`
            if o.via is not None and self._trains_own_param(o.via):
                return None  # `Trainer().train(loader, Net())`: the method that trains it wraps it
            return (f"cannot tell which model this optimizer trains: wrap that model with "
                    f"`model = {tm}.wrap_model(model)` before creating the optimizer")
        if m in _CONFIGISH:
            if self._holds_a_wrap(o):
                return None  # `config["net"] = Trainer(fwd, loss)` around the wrapped `fwd`
            return (f"the optimizer trains parameters reached through `{m}`: wrap that model with "
                    f"`{tm}.wrap_model(...)` before creating the optimizer")
        if functional_model(ctx, m):
            if "TM309" in ctx.facts.get("model_rules", set()) and ctx.options.mode == "ddp":
                return None  # TM309 shares its parameters and averages its gradients instead
            return (f"`{m}` is differentiated with torch.autograd.grad over its parameters (a functional, "
                    f"meta-learning model), which DistributedDataParallel does not support, so it is not wrapped: "
                    f"call `{tm}.share_params({m})` once after building it and `{tm}.sync_grads({m})` after each "
                    f"backward, before the optimizer's step (every rank then takes the same step)")
        stmt0 = o.statement
        scope = self.models.scope(o.call)
        # `optimizer = model.configure_optimizers(...)`: wrap after the call, which needs the bare model
        after = isinstance(o.call.func, cst.Attribute) and model_root(dotted(o.call.func.value) or "") == m
        if m.startswith(("self.", "cls.")):
            klass = self.models.class_of(o.call)
            if klass is None:
                return None
            if (m, klass) in self.covered and not self._removable_dp((m, klass)):
                return None
            if o.made:  # `self.model = SessionGraph(...)`, which builds its own optimizer
                return NewWrap(m, o, scope, klass, stmt0, after=True, def_stmt=stmt0)
            defs = self.models.definitions(m, scope, klass)
            if not defs:
                inherited = _project_bases(klass)
                if inherited and any(isinstance(f, cst.FunctionDef) and f.name.value in self.returning_wrap
                                     for f in klass.body.body):
                    # `Exp_Basic.__init__`: `self.model = self._build_model()`, which this class
                    # overrides to return the model wrapped (template method): it is wrapped there
                    return None
                if m[len("self."):] in self.ctx.program.wrapped_attrs.get(klass.name.value, ()):
                    return None  # a base class of the program wraps it where it builds it
                if inherited:
                    return (f"`{m}` is assigned outside class {klass.name.value} (in {', '.join(inherited)}?): wrap "
                            f"the model with `{tm}.wrap_model(...)` where it is built, before its optimizer")
                return (f"`{m}` is not assigned in class {klass.name.value}: wrap it with "
                        f"`{m} = {tm}.wrap_model({m})` where it is created, before its optimizer")
            local = [d for d, _ in defs if self.models.scope(d) is scope
                     and self.models.idx(ctx.statement_of(d)) < self.models.idx(stmt0)]
            on_line = None if local else self._created_on_line(m, scope, klass, o)
            def_stmt = ctx.statement_of(local[-1]) if local else (stmt0 if on_line is not None else None)
            model_def = def_stmt or ctx.statement_of(defs[-1][0])
        else:
            if isinstance(ctx.scope_of(o.call), (cst.Lambda, cst.ClassDef)):
                return None
            if self._module_of_wrap(m, scope):
                return None
            deferred = None
            if (m, scope) in self.covered and not self._removable_dp((m, scope)):
                deferred = self._dp_to_defer(m, scope, stmt0)
                if deferred is None:
                    return None
            if self._wrapped_by_callee(m, scope):
                return None
            if o.made:  # `model = SessionGraph(...)`, which builds its own optimizer: wrapped right after
                return NewWrap(m, o, scope, None, stmt0, after=True, def_stmt=stmt0)
            defs = self.models.definitions(m, scope, None, before=self.models.idx(stmt0))
            on_line = None if defs else self._created_on_line(m, scope, None, o)
            if not defs and on_line is None:
                if any(self.models.is_wrap_value(v) for _, v in self.models.assignments(m) if v is not None
                       and self.models.scope(_) is scope):
                    return None
                fname = scope.name.value if isinstance(scope, cst.FunctionDef) else None
                trains_here = fname and m in self.models.params(scope) and self._trains_param(scope, m)
                callers = [c for c in optimizers(ctx) if c.via is o]
                if fname and m in self.models.params(scope) and callers and not (
                        trains_here and _handed_unnamed(callers)):
                    return None  # this file calls fname() with the model: the wrap goes at that call
                if fname and m in self.models.params(scope) and self._builder_for_others(scope):
                    return None  # another module calls fname() with the model and wraps it there
                if fname and m in self.models.params(scope) and not trains_here:
                    return (f"`{m}` is a parameter of {fname}(), which builds its optimizer: wrap the model with "
                            f"`{tm}.wrap_model(...)` where {fname}() is called")
                if trains_here:
                    pass  # `def fit(self, data, net)` that trains it: wrapped before its optimizer, here
                elif fname and self.models.definitions(m, ctx.module, None):
                    return (f"`{m}` is a module-level model whose optimizer is built in {fname}(): wrap it with "
                            f"`{m} = {tm}.wrap_model({m})` at module level before {fname}() runs")
                elif self._wraps_itself():
                    return None
                else:
                    return (f"cannot find where `{m}` is created: wrap it with `{m} = {tm}.wrap_model({m})` "
                            "before creating its optimizer")
            klass = None
            def_stmt = ctx.statement_of(defs[-1][0]) if defs else stmt0
            model_def = def_stmt
        anchor = on_line or self._anchor(stmt0, def_stmt, scope)
        # apex: `model, optimizer = amp.initialize(model, optimizer)` must see the bare model
        # (TM407 removes it for O1; an O2/O3 one stays for the user)
        for call in calls_to(ctx, "apex.amp.initialize"):
            line = ctx.statement_of(call)
            if (self.models.scope(call) is scope and self.models.idx(line) > self.models.idx(anchor)
                    and isinstance(line, cst.SimpleStatementLine)
                    and any(mentions(self.models.text(a.value), m) for a in call.args)
                    and ctx.parent(line) is ctx.parent(anchor)):
                anchor, after = line, True
                break
        if not after:
            anchor = self._before_holders(m, anchor, def_stmt)
        placed = NewWrap(m, o, scope, klass, anchor, after=after, def_stmt=model_def)
        if not m.startswith(("self.", "cls.")) and deferred is not None:
            placed.dp = deferred
        return placed

    def _holds_a_wrap(self, o: Optimizer) -> bool:
        """`Adam(config["net"].parameters())` where the function set `config["net"] =
        Trainer(fwd, calc_loss)` and `fwd` is a model wrapped in this function (a DataParallel
        that TM306 turns into `tm.wrap_model`): the holder's forward runs through the wrapper, so
        its gradients are averaged; nothing more to wrap."""
        ctx = self.ctx
        scope = self.models.scope(o.call)
        wrapped = {w.name for w in self.wraps if w.scope is scope}
        if not wrapped:
            return False
        reached = {code(c.func.value) for c in ctx.within(o.call, cst.Call)
                   if isinstance(c.func, cst.Attribute) and c.func.attr.value == "parameters"}
        for assign in ctx.within(scope, cst.Assign, skip_defs=True):
            if len(assign.targets) != 1 or code(assign.targets[0].target) not in reached \
                    or not isinstance(assign.value, cst.Call):
                continue
            if any(dotted(a.value) in wrapped for a in assign.value.args):
                return True
        return False

    def _wrapped_inside(self, inner: Optimizer) -> bool:
        """A helper that trains the model it is handed, called here with a model no name holds
        (`Trainer().train(loader, Net())`): the wrap goes inside it, where the model has a name."""
        callers = [c for c in optimizers(self.ctx) if c.via is inner]
        return bool(callers) and self._trains_own_param(inner) and _handed_unnamed(callers)

    def _trains_own_param(self, inner: Optimizer) -> bool:
        """The function that builds the optimizer `inner` (reached through a call of it) trains
        the model it is handed itself: it is wrapped there (see `_trains_param`)."""
        func = self.ctx.enclosing(inner.call, cst.FunctionDef)
        return func is not None and any(m in self.models.params(func) and self._trains_param(func, m)
                                        for m in inner.models)

    def _trains_param(self, scope: cst.CSTNode, m: str) -> bool:
        """The function `scope` trains its parameter `m` itself: it runs a backward and calls
        `m(...)` in a loop. Wrapping `m` there, before the optimizer, puts that forward in DDP
        whoever calls the function (a caller that wrapped it already gets its wrapper back:
        `tm.wrap_model` returns the live wrapper of a module it wrapped before)."""
        if not analysis.runs_backward(self.ctx, scope):
            return False
        return any(isinstance(c.func, cst.Name) and c.func.value == m
                   and self.ctx.enclosing(c, cst.For, cst.While, cst.FunctionDef) is not scope
                   for c in self.ctx.within(scope, cst.Call, skip_defs=True))

    def _created_on_line(self, m: str, scope: cst.CSTNode, klass: Optional[cst.ClassDef],
                         o: Optimizer) -> Optional[cst.BaseSmallStatement]:
        """`model = Net(); opt = SGD(model.parameters())`: the model is created on its optimizer's
        own line, by a small statement before the optimizer's. Returns the optimizer's small
        statement: the wrap goes right before it, on that line (no line in between to take it)."""
        line = o.statement
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) < 2:
            return None
        holders = {id(o.call), *(id(a) for a in self.ctx.ancestors(o.call))}
        position = next((i for i, small in enumerate(line.body) if id(small) in holders), None)
        if not position:
            return None
        earlier = {id(small) for small in line.body[:position]}
        for d, _ in self.models.definitions(m, scope, klass):
            if earlier & {id(d), *(id(a) for a in self.ctx.ancestors(d))}:
                return line.body[position]
        return None

    def _before_holders(self, m: str, anchor: cst.CSTNode, def_stmt: Optional[cst.CSTNode]) -> cst.CSTNode:
        """The first statement between the model's creation and `anchor` (in `anchor`'s block)
        that hands the model to another object (`diffusion = GaussianDiffusion(model)`,
        `self.trainer = Trainer(self.model, cfg)`), else `anchor`: that object keeps a reference to
        what it was given and runs its forward through it, so a wrap after it would leave the
        training forward outside DDP (no gradient averaged)."""
        ctx = self.ctx
        block = ctx.parent(anchor)
        body = list(getattr(block, "body", ()))
        if anchor not in body:
            return anchor
        start = body.index(def_stmt) + 1 if def_stmt in body else 0
        for statement in body[start:body.index(anchor)]:
            if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
                continue
            small = statement.body[0]
            if not isinstance(small, cst.Assign) or any(dotted(t.target) == m for t in small.targets):
                continue
            if _holds(small.value, m):
                return statement
        return anchor

    def sums_losses(self) -> bool:
        """Every backward pass of this file takes a loss summed over its batch (`program.losses`)
        in a loop over a training loader the migration shards, with the original's global batch
        kept (each rank loads its share): the wraps then sum the ranks' gradients
        (`loss_reduction="sum"`), as one process summed over the whole batch."""
        key = ("sums-losses",)
        if key not in self._memo:
            from torchmigrate.rules.metrics.plan import loop_sharding  # (the metrics plan imports this family)

            ctx = self.ctx
            ok = ctx.options.mode == "ddp" and ctx.options.batch_policy == "global"
            found = False
            for call in ctx.nodes(cst.Call) if ok else ():
                loss = backward_loss(call)
                if loss is None:
                    continue
                loop = loader_loop(ctx, call, hand_made=False)
                if loop is None or loop_sharding(ctx, loop) != "sharded" or not summed_loss(ctx, loss):
                    ok = False
                    break
                found = True
            self._memo[key] = ok and found
        return self._memo[key]  # type: ignore[return-value]

    def _wraps_itself(self) -> bool:
        """`lint` of a file that wraps its models in DDP itself: an optimizer whose model the
        analysis cannot name (param groups from a helper, a loop over `model.modules()`) most
        likely trains one of them, so "cannot tell which model" is noise there."""
        return self.ctx.options.mode == "lint" and any(
            w.kind.rsplit("-", 1)[-1] in ("ddp", "apex", "tm") for w in self.wraps)

    def _module_of_wrap(self, m: str, scope: cst.CSTNode) -> bool:
        """`model_without_ddp = model.module` after `model = DDP(model)`: `m` is the module
        inside a model this scope wraps, so its optimizer already trains through that wrap
        (DeiT/DETR/MAE build it from `model_without_ddp`); wrapping `m` again is wrong."""
        for a, value in self.models.assignments(m):
            if value is None or self.models.scope(a) is not scope:
                continue
            name = dotted(strip_moves(value))
            if name and name.endswith(".module") and self.key(name[:-len(".module")], a) in self.covered:
                return True
        return False

    def _callee_wraps(self) -> Dict[str, List[Tuple[cst.FunctionDef, str, bool]]]:
        """Functions of the file that wrap one of their parameters in DDP themselves
        (`def train(args, model): ... model = DDP(model, ...)`): by name, (function, parameter,
        is a method)."""
        key = ("callee-wraps",)
        if key not in self._memo:
            found: Dict[str, List[Tuple[cst.FunctionDef, str, bool]]] = {}
            for w in self.wraps:
                func = w.scope
                if w.kind.rsplit("-", 1)[-1] == "dp" or not isinstance(func, cst.FunctionDef) or w.statement is None:
                    continue
                params = self.models.params(func)
                method = isinstance(self.ctx.parent(self.ctx.parent(func)), cst.ClassDef)
                before = self.models.idx(w.statement)
                for n in dict.fromkeys((w.arg, w.name)):
                    # the parameter itself is wrapped, not a model the function builds under its name
                    if n and n in params and not self.models.definitions(n, func, None, before=before):
                        entry = (func, n, method)
                        if entry not in found.setdefault(func.name.value, []):
                            found[func.name.value].append(entry)
            self._memo[key] = found
        return self._memo[key]  # type: ignore[return-value]

    def _factory_parameter(self, o: Optimizer, params: Optional[cst.BaseExpression]) -> bool:
        """The optimizer is built over a parameter of a module-level function (`def
        get_optimizer(name, parameters, lr): return SGD(parameters, lr=lr)`): a factory whose
        callers hand it a model's parameters, and whose call (`self.optimizer =
        get_optimizer("sgd", self.params, lr)`) is where the model is known and wrapped. Also a
        method of a class of the module (a project optimizer wrapper: `class Optimizer: def
        __init__(self, parameters, lr): self.opt = Adam(parameters, lr=lr)`)."""
        ctx = self.ctx
        scope = ctx.scope_of(o.call)
        if not (isinstance(params, cst.Name) and isinstance(scope, cst.FunctionDef)):
            return False
        block = ctx.parent(scope)
        owner = ctx.parent(block) if isinstance(block, cst.IndentedBlock) else block
        at_top = block is ctx.module or (isinstance(owner, cst.ClassDef) and ctx.parent(owner) is ctx.module)
        return at_top and params.value in self.models.params(scope)

    def _builder_for_others(self, scope: cst.CSTNode) -> bool:
        """`scope` builds an optimizer over a model parameter and another module calls it
        (`ModuleView.builders_for_others`: a module-level function, or a class by its
        `__init__`): that module wraps the model it passes, so nothing is left to say here."""
        ctx = self.ctx
        if not isinstance(scope, cst.FunctionDef):
            return False
        block = ctx.parent(scope)
        owner = ctx.parent(block) if isinstance(block, cst.IndentedBlock) else block
        if isinstance(owner, cst.ClassDef):
            qual = owner.name.value if scope.name.value == "__init__" else None
        else:
            qual = scope.name.value if isinstance(owner, cst.Module) else None
        return qual is not None and qual in ctx.program.builders_for_others

    def _wrapped_by_callee(self, m: str, scope: cst.CSTNode) -> bool:
        """`m` is passed (in `scope`) to a function of this file that wraps that parameter in
        DDP itself: a wrap here would make DDP(DDP(model))."""
        callees = self._callee_wraps()
        if not callees:
            return False
        for call, _ in self.f.calls:
            f = call.func
            fname = f.value if isinstance(f, cst.Name) else f.attr.value if isinstance(f, cst.Attribute) else None
            if fname not in callees or self.models.scope(call) is not scope:
                continue
            for func, param, method in callees[fname]:
                if method != isinstance(f, cst.Attribute):
                    continue
                value = _call_arg_for(call, func, param, method)
                if value is not None and dotted(value) == m:
                    return True
        return False

    def _blocks(self, node: cst.CSTNode, scope: cst.CSTNode) -> List[Tuple[cst.CSTNode, cst.CSTNode]]:
        """(block, child statement) pairs from `node` up to `scope`, innermost first."""
        chain = []
        while True:
            parent = self.ctx.parent(node)
            if parent is None:
                break
            if isinstance(parent, (cst.IndentedBlock, cst.Module)):
                chain.append((parent, node))
            if parent is scope or isinstance(parent, cst.Module):
                break
            node = parent
        return chain

    def _anchor(self, stmt0: cst.CSTNode, def_stmt: Optional[cst.CSTNode], scope: cst.CSTNode) -> cst.CSTNode:
        """The ancestor of the optimizer statement, in the innermost block that also holds the
        model's creation, so that one wrap covers every branch that builds an optimizer."""
        chain = self._blocks(stmt0, scope)
        if not chain:
            return stmt0
        if def_stmt is None:
            return chain[-1][1]
        for block, _ in self._blocks(def_stmt, scope):
            for b, child in chain:
                if b is block:
                    return child
        return chain[-1][1]

    def _merge_adjacent(self) -> None:
        """GANs: `optD = Adam(netD...)` directly followed by `optG = Adam(netG...)` get both wraps
        before the first optimizer statement."""
        by_anchor = {w.anchor: w for w in self.new if not w.after}
        for w in self.new:
            if w.after:
                continue
            while True:
                block = self.ctx.parent(w.anchor)
                body = getattr(block, "body", None)
                if not isinstance(body, (list, tuple)) or w.anchor not in body:
                    break
                i = list(body).index(w.anchor)
                if i == 0:
                    break
                prev = body[i - 1]
                other = by_anchor.get(prev)
                if other is None or other is w:
                    break
                if w.def_stmt is not None and self.models.idx(w.def_stmt) >= self.models.idx(prev):
                    break
                w.anchor = prev
        order = {id(w): i for i, w in enumerate(self.new)}
        self.new.sort(key=lambda w: (self.models.idx(w.anchor), w.after, order[id(w)]))

    # --- DataParallel (TM306) ----------------------------------------------------------
    def _plan_dp(self) -> None:
        by_key = {(w.name, w.klass if w.klass is not None and w.name.startswith(("self.", "cls.")) else w.scope): w
                  for w in self.new if w.extra_of is None}
        for site in self.dp_sites:
            if not self.active["TM306"]:
                continue
            if self._rewraps_wrapped(site.outer):
                # `if isinstance(m, DataParallel): m = MyDP(convert(m.module)); return m` (a
                # helper that converts a model and wraps it again only if it came wrapped): once
                # the program has no DataParallel left the branch never runs, so it stays as it is
                continue
            w = site.wrap
            if self._never_built(w):
                # `if self.parallel: self.encoder = DataParallel(self.encoder)` in a class that
                # never builds `self.encoder`: the branch cannot run, so it stays as written
                continue
            if not w.name:
                # `extractors[i] = DataParallel(extractors[i]).to(dev)`: no name to rebind, so the
                # DataParallel becomes `tm.wrap_model(...)` where it is
                site.action, site.target = "inplace", site.outer
                site.note_stmt = self.ctx.statement_of(site.outer)
                w.boundary, w.inclusive = site.note_stmt, False
                continue
            root = w.name.split(".")[0] if not w.name.startswith(("self.", "cls.")) else ".".join(w.name.split(".")[:2])
            if self.key(root, w.call) in self.covered_not_dp or self.key(w.name, w.call) in self.covered_not_dp:
                # the script wraps this model in DDP itself on another path (ImageNet example):
                # DataParallel is its single-process fallback, which only the user can retire
                site.action = "manual"
                site.reason = (f"this script also wraps `{root}` in DistributedDataParallel on another path: under "
                               f"torchrun drop the DataParallel and wrap the model once")
                site.note_stmt = self.ctx.statement_of(site.outer)
                continue
            if root != w.name:
                # `model.features = DataParallel(model.features)` (pytorch/examples' AlexNet/VGG):
                # under DDP the whole model is wrapped, so the submodule's DataParallel becomes
                # `tm.parallel_part(...)`, which keeps its `.module` level (and the checkpoints'
                # `features.module.*` keys) and runs the forward on the rank's own GPU
                nw = by_key.get(self.key(root, w.call))
                small = self.ctx.enclosing(site.outer, cst.BaseSmallStatement)
                if w.name == w.arg and self._is_dp_assign(site) and small is not None:
                    site.action, site.target, site.small = "part", w.call, small
                    site.note_stmt = self._next_statement(self.ctx.statement_of(site.outer)) or (
                        nw.anchor if nw is not None else self.ctx.statement_of(site.outer))
                else:
                    site.action = "manual"
                    site.reason = (f"DataParallel of the submodule `{w.name}`: under torchrun drop it and wrap the "
                                   f"whole model once with `{self.tm}.wrap_model({root})`")
                    site.note_stmt = self.ctx.statement_of(site.outer)
                continue
            small = self.ctx.enclosing(site.outer, cst.BaseSmallStatement)
            if w.name == w.arg and "." not in w.name and self._is_dp_assign(site) and small is not None \
                    and self._in_module_class(w.call):
                # `m = DataParallel(ASTModel(...)); m.load_state_dict(sd); self.v = m.module.v` in a
                # model's own __init__: a copy built to load a checkpoint with `module.` keys, never
                # trained as it is (the model that holds its parts is wrapped where it is trained).
                # `tm.parallel_part` keeps the `.module` level those lines read, with no DDP inside.
                site.action, site.target, site.small = "part", w.call, small
                site.note_stmt, site.loading_copy = self.ctx.statement_of(site.outer), True
                continue
            container = self.ctx.parent(small) if small is not None else None
            if small is None or not isinstance(container, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                # e.g. inside a decorator or a compound statement's header: convert in place
                site.action, site.target = "inplace", site.outer
                site.note_stmt = self.ctx.statement_of(site.outer)
                w.boundary, w.inclusive = site.note_stmt, False
                continue
            site.small = small
            line = self.ctx.statement_of(site.outer)  # the line, or the `if` of a one-line suite
            deferred = by_key.get(self.key(w.name, w.call))
            if deferred is not None and deferred.dp is site and w.name != w.arg:
                # `net = DataParallel(base)` before `base`'s weights are loaded: TM301 wraps `net`
                # before its optimizer, after them; here `net = base`
                site.action, site.target, site.note_stmt = "alias", w.call, line
                continue
            block = container if isinstance(container, cst.SimpleStatementSuite) else self.ctx.parent(container)
            owner = self.ctx.parent(block)
            if isinstance(owner, cst.Else):
                owner = self.ctx.parent(owner)
            in_if = isinstance(owner, cst.If)
            alone = False
            if in_if and block is owner.body and owner.orelse is None and len(block.body) == 1 and len(container.body) == 1:
                parent_if = self.ctx.parent(owner)
                alone = not (isinstance(parent_if, cst.If) and parent_if.orelse is owner)
            # `if n_gpu > 1: model = DataParallel(model)` + `else: <single-device code>`: every DDP
            # rank runs the single-device branch, so the `if` becomes the `else` body.
            collapse = (in_if and block is owner.body and isinstance(owner.orelse, cst.Else)
                        and len(block.body) == 1 and len(container.body) == 1
                        and not (isinstance(self.ctx.parent(owner), cst.If) and self.ctx.parent(owner).orelse is owner))
            assign = self._is_dp_assign(site)
            nw = by_key.get(self.key(w.name, w.call)) if (w.name == w.arg and assign) else None
            if nw is not None and self._rebound_between(w.name, nw, line):
                nw = None  # another model of that name (reloaded for testing): its DataParallel is its own
            if nw is None and w.name == w.arg and assign:
                # `def train(model, ...): <optimizer>; if n_gpu > 1: model = DataParallel(model)`:
                # TM301 wraps the model where train() is called.
                func = self.ctx.enclosing(site.outer, cst.FunctionDef)
                if func is not None and w.name in self.models.params(func):
                    nw = next((n for n in self.new if n.opt.via is not None and n.extra_of is None
                               and self.ctx.enclosing(n.opt.via.call, cst.FunctionDef) is func), None)
            if nw is not None:
                site.action = "collapse" if collapse else "remove"
                site.target = owner if (alone or collapse) else small
                nw.dp = site
                if alone or collapse:
                    site.note_stmt = self._next_statement(owner) or nw.anchor
                else:
                    site.note_stmt = owner if in_if else (self._next_statement(line) or nw.anchor)
                continue
            if collapse and assign and w.name == w.arg:
                site.action, site.target = "collapse", owner
                site.wrap_after = True
                site.note_stmt = self._next_statement(owner) or self._next_statement(owner, -1)
                w.boundary, w.inclusive = owner, False
                continue
            # Converted in place: `tm.wrap_model(<module>)` where the DataParallel was, but never
            # inside a `device_count() > 1` guard (the wrap must run on every rank).
            outer_if, moved = None, False
            if in_if and assign and w.name == w.arg and not (alone and assign) and not _exits_after(block, container):
                outer_if = owner
                while isinstance(self.ctx.parent(outer_if), cst.If):
                    outer_if = self.ctx.parent(outer_if)
                widest = self._widest_binding_if(owner, w.name) if "." not in w.name else None
                if widest is not None and widest is not outer_if and self._falls_through(outer_if, widest):
                    # `if net == "ResNet": <build>; if big_data: net = DataParallel(net)` inside one
                    # branch of a chain that builds the model on every path: every rank wraps
                    # whichever model it built, after the whole chain
                    outer_if = widest
                # a wrap after the `if` reads the name on every path: bound before it, or by every branch
                moved = "." in w.name or widest is outer_if or self._bound_before(w.name, outer_if)
            if in_if and alone and assign:
                site.action, site.target = "replace-if", owner
                site.note_stmt = owner
                boundary = owner
            elif moved:
                site.action, site.target = "move", outer_if
                site.note_stmt = outer_if
                boundary = outer_if
            else:
                site.action, site.target = "inplace", site.outer
                site.note_stmt = line
                site.conditional = in_if
                boundary = line
                if in_if and assign and w.name and "." not in w.name:
                    site.ensure_after = self._widest_binding_if(owner, w.name)
                    if site.ensure_after is None and w.name == w.arg and _exits_after(block, container):
                        # `if n_gpu > 1: model = DataParallel(model); return model`: the path
                        # past the `if` is wrapped too (wrapping twice returns the same DDP)
                        site.ensure_after = owner
            w.boundary, w.inclusive = boundary, False

    def _bound_before(self, name: str, statement: cst.CSTNode) -> bool:
        """`name` is bound before `statement` in its scope: by an assignment, loop or `with`
        target earlier in the source, or as a parameter of its function."""
        ctx = self.ctx
        scope = ctx.enclosing(statement, cst.FunctionDef) or ctx.module
        if isinstance(scope, cst.FunctionDef) and any(
                p.name.value == name for p in (*scope.params.params, *scope.params.posonly_params,
                                               *scope.params.kwonly_params)):
            return True
        start = ctx.position(statement) or 0
        for node in ctx.within(scope, cst.Assign, cst.AnnAssign, cst.For, cst.With, skip_defs=True):
            if (ctx.position(node) or 0) >= start:
                continue
            targets = ([t.target for t in node.targets] if isinstance(node, cst.Assign) else
                       [node.target] if isinstance(node, (cst.AnnAssign, cst.For)) else
                       [i.asname.name for i in node.items if i.asname is not None])
            if any(name in target_names(t) for t in targets):
                return True
        return False

    def _in_module_class(self, node: cst.CSTNode) -> bool:
        """`node` lies in a method of a model class (one that defines `forward`, or derives from
        a class named `...Module`)."""
        klass = self.ctx.enclosing(node, cst.ClassDef)
        if klass is None or self.ctx.enclosing(node, cst.FunctionDef) is None:
            return False
        if any((dotted(b.value) or "").endswith("Module") for b in klass.bases):
            return True
        return any(isinstance(s, cst.FunctionDef) and s.name.value == "forward" for s in klass.body.body)

    def _falls_through(self, inner: cst.CSTNode, outer: cst.CSTNode) -> bool:
        """`outer` holds `inner`, and no statement after it in a block between them leaves the
        block (`return`, `raise`, `break`, `continue`): a wrap after `outer` runs on that path."""
        node = inner
        for anc in self.ctx.ancestors(inner):
            if anc is outer:
                return True
            if isinstance(anc, cst.BaseSuite) and _exits_after(anc, node):
                return False
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Module)):
                return False
            if isinstance(anc, cst.BaseStatement):
                node = anc
        return False

    def _rebound_between(self, name: str, nw: NewWrap, line: cst.CSTNode) -> bool:
        """`name` is bound again between the DataParallel at `line` and the new wrap's anchor
        (`model = Net(); model.load_state_dict(...); model = DataParallel(model)` after training):
        the DataParallel wraps another model than the one TM301 wraps, so it is not that wrap's."""
        at, anchor = self.models.idx(line), self.models.idx(nw.anchor)
        low, high = min(at, anchor), max(at, anchor)
        return any(low < self.models.idx(self.ctx.statement_of(a)) < high
                   and value is not None and not mentions(self.models.text(value), name)  # not `model.cuda()`
                   for a, value in self.models.definitions(name, nw.scope, nw.klass))

    def _never_built(self, w: Wrap) -> bool:
        """The DataParallel wraps `self.x` of a class (deriving only from nn.Module) that assigns
        `self.x` nowhere else: dead code, which a wrap made unconditional would bring to life."""
        name = w.arg or w.name
        klass = self.models.class_of(w.call)
        if not name.startswith("self.") or name.count(".") != 1 or klass is None:
            return False
        if _project_bases(klass):
            return False
        own = self.ctx.statement_of(w.call)
        return not any(self.ctx.statement_of(a) is not own and self.models.class_of(a) is klass
                       for a, _ in self.models.assignments(name))

    def _rewraps_wrapped(self, node: cst.CSTNode) -> bool:
        """`node` runs only when a model is already a DataParallel: inside the body of an `if`
        whose test is `isinstance(x, <DataParallel or a subclass>)` or `hasattr(x, "module")`."""
        dp_names = {"DataParallel", *(c.rsplit(".", 1)[-1] for c in self.ctx.program.dp_classes)}
        child = node
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                return False
            if isinstance(anc, cst.If) and child is anc.body:
                for call in self.ctx.within(anc.test, cst.Call):
                    fn = dotted(call.func)
                    if fn == "isinstance" and len(call.args) == 2:
                        classes = {(dotted(n) or "").rsplit(".", 1)[-1]
                                   for n in self.ctx.within(call.args[1].value, cst.Name, cst.Attribute)}
                        if classes & dp_names:
                            return True
                    if fn == "hasattr" and len(call.args) == 2 and \
                            isinstance(call.args[1].value, cst.SimpleString) and \
                            call.args[1].value.evaluated_value == "module":
                        return True
            child = anc
        return False

    def _widest_binding_if(self, node: cst.If, name: str) -> Optional[cst.If]:
        """The outermost `if` around `node` (through `elif`, `else` and nested branches, not
        past a loop, `with`, `try` or `def`) whose every branch binds `name`."""
        chain = []
        for anc in [node, *self.ctx.ancestors(node)]:
            if isinstance(anc, cst.If):
                parent = self.ctx.parent(anc)
                if not (isinstance(parent, cst.If) and parent.orelse is anc):  # an `elif` is its `if`
                    chain.append(anc)
            elif isinstance(anc, (cst.For, cst.While, cst.With, cst.Try, cst.FunctionDef, cst.ClassDef, cst.Module)):
                break
        return next((c for c in reversed(chain) if _binds_on_every_path(c, name)), None)

    def _next_statement(self, statement: cst.CSTNode, step: int = 1) -> Optional[cst.CSTNode]:
        block = self.ctx.parent(statement)
        body = getattr(block, "body", None)
        if isinstance(body, (list, tuple)) and statement in body:
            i = list(body).index(statement) + step
            if 0 <= i < len(body):
                return body[i]
        return None

    # --- which bindings are wrapped after the migration ----------------------------------
    def final_wraps(self) -> List[Wrap]:
        if self._final is None:
            self._final = self._final_wraps()
        return self._final

    def _final_wraps(self) -> List[Wrap]:
        out = self._direct_wraps()
        out += self._instance_wraps(out)
        # `raw_model = model` after the wrap: the alias holds the wrapped model too
        by_name: Dict[str, List[Wrap]] = {}
        for w in out:
            by_name.setdefault(w.name, []).append(w)
        for a in self.f.assigns:
            if len(a.targets) != 1:
                continue
            alias, source = dotted(a.targets[0].target), dotted(a.value)
            if not alias or not source or alias == source or source not in by_name:
                continue
            statement = self.ctx.statement_of(a)
            for w in by_name[source]:
                if w.kind != "other" and self.applies(w, a, statement):
                    out.append(Wrap(alias, "alias-" + w.kind.rsplit("-", 1)[-1], self.models.scope(a),
                                    self.models.class_of(a), statement, False, statement=statement))
                    break
        return out

    def _instance_wraps(self, wraps: List[Wrap]) -> List[Wrap]:
        """`trainer = Trainer(cfg)` ... `torch.save(trainer.model.state_dict(), f)`: an attribute
        that the instance's class holds wrapped (`self.model = tm.wrap_model(self.model)` in its
        `__init__`, by this migration or by the program) is the wrapped model on the instance
        too, so its state and custom attributes go through `tm.unwrap` like `self.model` (else
        the checkpoint has `module.` keys). This file's classes from the wraps planned here,
        the program's other classes from `ModuleView.instance_attrs`."""
        held: Dict[str, Set[str]] = {}
        for w in wraps:
            if w.klass is not None and w.name.count(".") == 1 and w.name.startswith("self.") and w.kind != "other":
                held.setdefault(w.klass.name.value, set()).add(w.name[len("self."):])
        for spelled, attrs in self.ctx.program.instance_attrs.items():
            held.setdefault(spelled, set()).update(attrs)
        if not held:
            return []
        out = []
        for a in self.f.assigns:
            if len(a.targets) != 1 or not isinstance(a.value, cst.Call):
                continue
            name, made = dotted(a.targets[0].target), dotted(a.value.func)
            if not name or "." in name or made not in held:
                continue
            statement = self.ctx.statement_of(a)
            for attr in sorted(held[made]):
                out.append(Wrap(f"{name}.{attr}", "instance-tm", self.models.scope(a), None, statement, False,
                                statement=statement))
        return out

    def _direct_wraps(self) -> List[Wrap]:
        out = []
        for nw in self.new:
            out.append(Wrap(nw.name, "new", nw.scope, nw.klass, nw.anchor, not nw.after))
        for w in self.wraps:
            if w.kind == "dp" and not self.active["TM306"]:
                out.append(w)  # DataParallel kept (TM306 off): still `.module`
            elif w.kind != "other" and w.name:
                out.append(w)
        return out

    def applies(self, w: Wrap, node: cst.CSTNode, statement: Optional[cst.CSTNode] = None) -> bool:
        """Whether `node` (an access to `w.name`) sees the wrapped model."""
        statement = statement or self.ctx.statement_of(node)
        if w.statement is not None and statement is w.statement:
            return False
        fs = self.models.scope(node)
        if w.name.startswith(("self.", "cls.")):
            if self.models.class_of(node) is not w.klass:
                return False
            if fs is w.scope:
                return self._after(w, statement)
            # another method: if it calls the wrapping method (`self.build_optimizer()` in
            # `__init__`), only what follows that call sees the wrapped model
            calls = self._self_calls(w).get(fs)
            if calls:
                return self.models.idx(statement) >= min(self.models.idx(c) for c in calls)
            return True
        if fs is w.scope:
            return self._after(w, statement)
        if not isinstance(fs, cst.FunctionDef):
            return False
        root = w.name.split(".")[0]
        if root in self.models.params(fs):
            return self._receives_wrapped(fs, root)
        if self.models.assigned_in(fs, root):
            return False
        if w.scope is self.ctx.module:
            return True
        return any(a is w.scope for a in self.ctx.ancestors(fs))

    def _receives_wrapped(self, func: cst.FunctionDef, param: str) -> bool:
        """Whether parameter `param` of `func` may hold a wrapped model. A helper named like the
        model (`def evaluate(model, ...)`) often only ever gets the unwrapped module
        (`evaluate(model_without_ddp)`, `evaluate(model.module)`) or a model that is never
        wrapped: then its `model.encoder` is no AttributeError. Unknown callers (a method, a
        callback, another module of a single-file run) keep the old answer: it may."""
        key = ("receives", func, param)
        if key not in self._memo:
            self._memo[key] = True  # a recursive helper: assume it may while deciding
            calls = self.models.calls_of(func)
            if calls is None:
                found = True
            elif not calls:  # called from other modules only: the program's facts decide
                found = not self.ctx.program.followed
            else:
                found = any(self._passes_wrapped(call, func, param) for call in calls)
            self._memo[key] = found
        return self._memo[key]  # type: ignore[return-value]

    def _passes_wrapped(self, call: cst.Call, func: cst.FunctionDef, param: str) -> bool:
        """Whether `call` passes a wrapped model as `param`: a name a wrap reaches there, a wrap
        call, or an expression the analysis cannot follow; not `m.module`, `tm.unwrap(m)`, a
        name no wrap reaches (`model_without_ddp`), or the default."""
        positional = [p.name.value for p in (*func.params.posonly_params, *func.params.params)]
        value = None
        for i, a in enumerate(call.args):
            if a.star:
                return True
            if (a.keyword is not None and a.keyword.value == param) or (
                    a.keyword is None and i < len(positional) and positional[i] == param):
                value = strip_moves(a.value)
                break
        if value is None:
            return False
        if type(value) is cst.Call:
            name = self.ctx.resolve(value.func)
            return name != _TM_UNWRAP
        name = dotted(value)
        if name is None:
            return True
        if name.endswith(".module"):
            return False
        wraps = self._final if self._final is not None else self._direct_wraps()
        statement = self.ctx.statement_of(call)
        return any(w.name == name and self.applies(w, call, statement) for w in wraps)

    def _self_calls(self, w: Wrap) -> Dict[cst.CSTNode, List[cst.CSTNode]]:
        """Statements calling `self.<method holding the wrap>()`, by the method they are in."""
        if not isinstance(w.scope, cst.FunctionDef) or w.scope.name.value == "__init__":
            return {}
        key = ("self-calls", w.scope)
        if key not in self._memo:
            found: Dict[cst.CSTNode, List[cst.CSTNode]] = {}
            name = w.scope.name.value
            for call, _ in self.f.calls:
                f = call.func
                if isinstance(f, cst.Attribute) and f.attr.value == name and dotted(f.value) in ("self", "cls") \
                        and self.models.class_of(call) is w.klass:
                    found.setdefault(self.models.scope(call), []).append(self.ctx.statement_of(call))
            self._memo[key] = found
        return self._memo[key]  # type: ignore[return-value]

    def _branches(self, node: cst.CSTNode) -> Dict[cst.CSTNode, cst.CSTNode]:
        """For each `if` enclosing `node`: the branch (body or orelse) that holds it."""
        out: Dict[cst.CSTNode, cst.CSTNode] = {}
        child = node
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, cst.If) and (child is anc.body or child is anc.orelse):
                out[anc] = child
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
            child = anc
        return out

    def _exclusive(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """`a` and `b` sit in different branches of one `if`/`elif`/`else` chain."""
        branches = self._branches(a)
        if not branches:
            return False
        return any(branches.get(anc) not in (None, child) for anc, child in self._branches(b).items())

    def _after(self, w: Wrap, statement: Optional[cst.CSTNode]) -> bool:
        if statement is not None and self._exclusive(w.boundary, statement):
            return False
        i = self.models.idx(statement)
        if w.inclusive:
            return i >= self.models.idx(w.boundary)
        return i > self.models.last_idx(w.boundary)

    # --- TM303 / TM304 analysis --------------------------------------------------------
    def _freezes(self, w: Wrap, klass: Optional[cst.ClassDef]) -> Tuple[str, str]:
        """(freeze, unfreeze) descriptions of parameters whose requires_grad changes after wrapping."""
        methods: Dict[str, str] = {}
        if klass is not None and isinstance(klass.body, cst.IndentedBlock):
            for f in klass.body.body:
                if isinstance(f, cst.FunctionDef) and f.name.value != "__init__" \
                        and self.models.touches_requires_grad(f):
                    methods[f.name.value] = self.models.text(f)
        freeze = unfreeze = ""
        root = w.name
        method_calls, rg_assigns = self.models.requires_grad_changes()
        for call, attr in method_calls:
            func = call.func
            if attr != "requires_grad_" and attr not in methods:
                continue
            if not mentions(self.models.text(func.value), root):
                continue
            body = self.models.text(call) if attr == "requires_grad_" else methods[attr]
            is_freeze, is_unfreeze = bool(_FREEZE.search(body)), bool(_UNFREEZE.search(body))
            if not (is_freeze or is_unfreeze) or not self.applies(w, call):
                continue
            what = f"`{self.models.text(call)}`"
            if is_freeze and not freeze:
                freeze = what
            if is_unfreeze and not unfreeze:
                unfreeze = what
        for a in rg_assigns:
            loop = self.ctx.enclosing(a, cst.For, cst.FunctionDef)
            if not isinstance(loop, cst.For) or not mentions(self.models.text(loop.iter), root):
                continue
            if not self.applies(w, a):
                continue
            value = self.models.text(a.value)
            if value == "False" and self.models.text(loop.iter) in (f"{root}.parameters()",
                                                                     f"{root}.module.parameters()"):
                continue  # the whole model frozen (DINO's teacher): no backward reaches it, no reduction waits
            if value == "False" and not freeze:
                freeze = f"`for ... in {self.models.text(loop.iter)}: ...requires_grad = False`"
            elif value != "False" and not unfreeze:
                unfreeze = f"`for ... in {self.models.text(loop.iter)}: ...requires_grad = {value}`"
        return freeze, unfreeze

    def _unused_and_bn(self) -> None:
        tm = self.tm
        targets = []  # (what reports / carries the keywords, the binding it wraps)
        for nw in self.new:
            targets.append((nw, Wrap(nw.name, "new", nw.scope, nw.klass, nw.anchor, not nw.after)))
        for w in self.wraps:
            if w.kind in ("ddp", "tm", "apex") and w.name and w.call is not None:
                targets.append((w, w))
        for site in self.dp_sites:
            if site.action in ("replace-if", "move", "inplace"):
                targets.append((site, site.wrap))
        for owner, w in targets:
            scope = w.scope
            before = self.models.idx(w.boundary) if isinstance(owner, NewWrap) else self.models.idx(w.statement)
            wrapped = self.models.wrapped_arg(w.call) if w.call is not None else None
            origin = self.models.origin(w.arg or w.name, scope, w.klass, before, wrapped.value if wrapped else None)
            klass = self.models.model_class(origin)
            cond = self.models.conditional_submodules(klass)
            freeze, unfreeze = self._freezes(w, klass) if w.name else ("", "")  # (`extractors[i]`: no name to follow)
            reason = ""
            owner_class, heads = self.models.discarded_heads(origin, w.name)
            if freeze:
                reason = f"parameters are frozen after wrapping ({freeze})"
            elif cond:
                names = ", ".join(f"self.{n}" for n, _ in cond)
                reason = f"{klass.name.value}.forward() uses {names} only in some branches"
            elif heads:
                names = ", ".join(f"self.{n}" for n in heads)
                reason = (f"{owner_class}.forward() computes outputs with {names} that the training "
                          f"step discards, so those parameters get no gradient")
            def_stmt = owner.def_stmt if isinstance(owner, NewWrap) else self._def_statement(w, before)
            note_stmt = def_stmt or (owner.anchor if isinstance(owner, NewWrap) else w.statement)
            dup = isinstance(owner, NewWrap) and owner.bound is not None  # noted at its primary wrap
            if unfreeze and not dup:
                node = w.call if w.call is not None else owner.opt.call if isinstance(owner, NewWrap) else owner.outer
                self.notes["TM303"].append((node,
                    f"parameters of `{w.name}` are unfrozen after it is wrapped ({unfreeze}): DDP only "
                    f"synchronises parameters that required grad when it was built, so wrap after unfreezing "
                    f"or re-wrap with `{tm}.wrap_model` when the trainable set changes", note_stmt))
            bn = self.models.has_bn(origin) and not self.has_sync_bn
            if isinstance(owner, (NewWrap, DPSite)):
                owner.find_unused = reason
                owner.bn = bn
                owner.sync_bn = bn and self.active["TM304"] and self.sync_bn_applies
                if bn and self.active["TM304"] and not owner.sync_bn and not dup:
                    node = owner.opt.call if isinstance(owner, NewWrap) else owner.outer
                    self.advice.add(node)
                    self.notes["TM304"].append((node, self._bn_message(w.name), note_stmt))
                continue
            # an existing wrap call: in `ddp`, only bugs are reported (nothing else changes in a
            # script that is already distributed); `lint` also gives advice
            lint = self.ctx.options.mode == "lint"
            call = w.call
            fu = call_arg(call, "find_unused_parameters")
            fu_true = fu is not None and code(fu.value) == "True"
            if reason and fu is None:
                self.notes["TM303"].append((call, f"{reason}: DDP then fails with \"Expected to have finished "
                    f"reduction in the prior iteration\"; pass find_unused_parameters=True to the wrap "
                    f"(or make every parameter take part in each step)", w.statement))
            elif fu_true and not reason and lint and klass is not None and self.models.uses_every_submodule(klass):
                self.advice.add(call)
                self.notes["TM303"].append((call, f"find_unused_parameters=True costs an extra autograd graph "
                    f"traversal every step, and {klass.name.value}.forward() uses all its submodules "
                    f"unconditionally: drop it (or pass static_graph=True if the set of used parameters never "
                    f"changes)", w.statement))
            if not (bn and self.active["TM304"]) or call_arg(call, "sync_bn") is not None:
                continue
            if w.kind == "tm":
                # torchmigrate's own wrap: `ddp --sync-bn` adds the keyword; lint leaves it alone
                if self.sync_bn_applies and not lint:
                    self.sync_bn_fixes.append((call, f"`{w.name}` contains BatchNorm layers: convert them to "
                        f"SyncBatchNorm (`sync_bn=True`)", [replace(call, lambda c: set_kwarg(c, "sync_bn", expr("True")))]))
            elif lint:
                # user-written DDP: an unsafe fix converting the layers right before the wrap
                message = self._bn_message(w.name, True)
                if w.arg and w.arg.isidentifier() and isinstance(w.statement, cst.SimpleStatementLine):
                    fix = stmt(f"{w.arg} = {self.tm}.sync_batchnorm({w.arg})")
                    self.sync_bn_fixes.append((call, message, [insert_before(w.statement, [fix])]))
                else:
                    self.advice.add(call)
                    self.notes["TM304"].append((call, message, note_stmt))

    def _bn_message(self, name: str, plain_ddp: bool = False) -> str:
        how = (f"convert with `{name} = {self.tm}.sync_batchnorm({name})` before DDP (SyncBatchNorm where it runs: "
               f"distributed on CUDA)"
               if plain_ddp else f"pass `sync_bn=True` to `{self.tm}.wrap_model` (`torchmigrate ddp --sync-bn`)")
        return (f"`{name}` contains BatchNorm layers, which now normalise over each rank's own batch; "
                f"if per-rank batches are small, {how}")

    def _def_statement(self, w: Wrap, before: int) -> Optional[cst.CSTNode]:
        defs = self.models.definitions(w.arg or w.name, w.scope, w.klass, before)
        return self.ctx.statement_of(defs[-1][0]) if defs else None

    # --- attribute rewrites (TM302, and TM306 for DataParallel names) --------------------
    def _partial_methods(self) -> None:
        """A model whose method computes a loss through DDP (`tm.synced(self.critic).Q1(s, a)`,
        TD3's actor loss on one of the critic's two heads) may leave parameters without a gradient
        in that backward (the other head): DDP then refuses the next forward ("Expected to have
        finished reduction in the prior iteration") unless it looks for unused parameters."""
        for rw in self.rewrites:
            if not rw.synced:
                continue
            klasses = [k for k in self.f.classes.values() if isinstance(k.body, cst.IndentedBlock) and any(
                isinstance(f, cst.FunctionDef) and f.name.value == rw.attr for f in k.body.body)]
            if len(klasses) != 1 or not self.models.method_leaves_out(klasses[0], rw.attr):
                continue  # the method uses every submodule (or its class is not this file's to read)
            for owner in [*self.new, *self.dp_sites]:
                name = owner.name if isinstance(owner, NewWrap) else owner.wrap.name
                if name == rw.name and not owner.find_unused:
                    owner.find_unused = (f"`{rw.name}.{rw.attr}()` runs through DDP's forward and may use only part "
                                         "of the model")

    def _attributes(self) -> None:
        owner302 = self.active["TM302"]
        owner306 = self.active["TM306"]
        if not (owner302 or owner306):
            return
        wraps = self.final_wraps()
        dp_wraps = {id(s.wrap) for s in self.dp_sites}
        by_name: Dict[str, List[Wrap]] = {}
        for w in wraps:
            by_name.setdefault(w.name, []).append(w)
        if not by_name:
            return  # nothing wrapped: no access to rewrite
        found = []
        for node in self._accesses(by_name):
            name = dotted(node.value)
            candidates = by_name[name]
            attr = node.attr.value
            if attr.startswith("_") or (attr in _MODULE_API and attr != "module") or attr.startswith("register_"):
                continue
            parent = self.ctx.parent(node)
            if attr == "module" and isinstance(parent, (cst.AssignTarget, cst.Del)):
                continue
            if self._container(name, node):
                continue  # `nets.items()` of a dict of models: its modules are wrapped in place
            statement = self.ctx.statement_of(node)
            seen_by = [w for w in candidates if (w.full or attr not in ("module", *STATE_METHODS)
                                                 or self._prefixed_state(w, node, attr))
                       and self.applies(w, node, statement)]
            if seen_by and not (owner302 and self.ctx.options.mode == "lint" and self._checked_first(node, name)):
                found.append((node, name, attr, seen_by))
        # `model = DDP(model); model.nc = nc; ... model.nc` (yolov5): set on a wrapper the script
        # builds itself, and found on it. (Not on a wrap this migration adds: the module's own
        # code may read what the single-GPU script set on it, `self.temperature`.)
        on_wrapper = {attr for node, _, attr, seen_by in found
                      if attr != "module" and isinstance(self.ctx.parent(node), cst.AssignTarget)
                      and all(w.kind.rsplit("-", 1)[-1] in ("ddp", "apex", "dp") for w in seen_by)}
        for node, name, attr, seen_by in found:
            if attr in on_wrapper:
                continue
            is_dp = any(id(w) in dp_wraps or w.kind.endswith("-dp") for w in seen_by)
            if owner302:
                manual = self.ctx.options.mode == "lint" and attr in STATE_METHODS and not any(w.full for w in seen_by)
                synced = not is_dp and self._computes_loss(node)
                self.rewrites.append(AttrRewrite(node, name, attr, "TM302", is_dp, manual=manual, synced=synced))
            elif is_dp:  # TM306 alone must not leave `.module` behind on the model it unwrapped
                self.rewrites.append(AttrRewrite(node, name, attr, "TM306", True))
        if not owner302:
            return
        # `copy.deepcopy(model)`, `ModelEma(model)`, `AveragedModel(model)` after the wrap would
        # copy the DDP wrapper: copy the module itself.
        for call, qualified in self.f.calls:
            label = (qualified or dotted(call.func) or "").rsplit(".", 1)[-1]
            handed = [call_arg(call, None, 0)]
            if qualified is None and label == "isinstance" and self._asks_model_class(call):
                pass  # `isinstance(model, LatentODE)`: the wrapper is no LatentODE; ask the module
            elif self._picks_parameters(call):
                handed = [a for a in call.args if a.keyword is None and not a.star]
            elif not (label == "deepcopy" or _EMA.search(label)):
                continue
            statement = self.ctx.statement_of(call)
            for a in handed:
                name = dotted(a.value) if a is not None else None
                if name is not None and name in by_name and any(self.applies(w, call, statement) for w in by_name[name]):
                    self.rewrites.append(AttrRewrite(a.value, name, "", "TM302"))
        self._whole_model_uses(by_name)

    def _picks_parameters(self, call: cst.Call) -> bool:
        """A helper of the program that walks the submodules of the model handed to it and reads
        their parameters, to group them for an optimizer (`separate_bn_paras(model)`, which walks
        `model.modules()` and skips the model's own class by name): given the wrapper, it would
        walk one more container, the DDP itself, and list every parameter twice (the optimizer
        refuses duplicates). It gets the module itself; the parameters are the same."""
        func = call.func
        if self.ctx.program.parameter_pickers.get(dotted(func) or ""):
            return True
        own = self.f.functions.get(func.value) if isinstance(func, cst.Name) else None
        if own is None or not any(True for _ in self.ctx.within(own, cst.Return)):
            return False
        reads = {c.func.attr.value for c in self.ctx.within(own, cst.Call) if isinstance(c.func, cst.Attribute)}
        return bool(reads & {"parameters", "named_parameters"}) and bool(
            reads & {"modules", "children", "named_modules", "named_children"})

    def _asks_model_class(self, call: cst.Call) -> bool:
        """`isinstance(model, Cls)` with `Cls` a class of the program or a library's model class,
        not the wrappers' and modules' own (`nn.Module`, `DataParallel`, DDP: the program asks
        whether it wrapped), nor a tuple that names one of those."""
        if len(call.args) != 2 or any(a.keyword is not None or a.star for a in call.args):
            return False
        kinds = call.args[1].value
        names = [e.value for e in kinds.elements] if isinstance(kinds, cst.Tuple) else [kinds]
        spelled = [self.ctx.resolve(n) or dotted(n) or "" for n in names]
        return all(n and n.rsplit(".", 1)[-1] not in _WRAPPER_CLASSES for n in spelled)

    def _container(self, name: str, node: cst.CSTNode) -> bool:
        """`name` holds a dict, list or tuple of models wherever it is made (`nets = {"rep": ...}`,
        `self.members = [Net() for _ in range(n)]`): `tm.wrap_model` wraps its modules in place
        and returns the container itself, whose own methods need no `tm.unwrap`."""
        klass = self.models.class_of(node) if name.startswith(("self.", "cls.")) else None
        values = [v for _, v in self.models.definitions(name, self.models.scope(node), klass) if v is not None]
        return bool(values) and all(isinstance(v, _CONTAINERS) for v in values)

    def _computes_loss(self, node: cst.Attribute) -> bool:
        """`node` is the first method of the wrapped model called in a training step, between the
        forward and the loss that `backward()` takes (`loss = model.bpr_loss(u, i, j)`, `z =
        vae.encode(x)`), and the step never calls the model itself, nor hands it to a helper that may
        (`forward(model, batch)`): through `tm.unwrap` it would
        run outside DDP's forward and no gradient would be averaged, so it goes through
        `tm.synced`. One DDP forward per step is enough: it arms DDP for that backward, which
        then averages every parameter's gradient, however it was computed."""
        call = self.ctx.parent(node)
        if not (isinstance(call, cst.Call) and call.func is node) or node.attr.value in STATE_METHODS:
            return False
        chain = self._loss_chains().get(self.ctx.statement_of(node))
        if chain is None:
            return False
        name = dotted(node.value)

        def forwards(c: cst.Call) -> bool:
            """`model(x)` runs DDP's forward; `forward(model, batch)` hands it to a helper that may
            (if not, the runtime averages the step's gradients)."""
            return dotted(c.func) == name or any(not a.star and dotted(a.value) == name for a in c.args)

        block = self.ctx.parent(chain[0])
        body = list(getattr(block, "body", ()))
        before = body[:body.index(chain[0])] if chain[0] in body else []  # the step's earlier statements
        if any(forwards(c) for statement in before for c in self.ctx.within(statement, cst.Call)):
            return False  # `targets, scores = forward(model, i, data)` before the loss
        for statement in chain:
            for c in self.ctx.within(statement, cst.Call):
                func = c.func
                if forwards(c):
                    return False
                if isinstance(func, cst.Attribute) and dotted(func.value) == name \
                        and func.attr.value not in STATE_METHODS:
                    return func is node
        return False

    def _loss_chains(self) -> Dict[cst.CSTNode, List[cst.CSTNode]]:
        """Each statement of a training step's forward-to-loss chain -> the chain (the
        statements from the forward to the loss `backward()` takes, or the backward's own
        statement when it computes the loss inline)."""
        key = ("loss-chains",)
        if key not in self._memo:
            training, found = training_facts(self.ctx), {}
            for site in training.sites:
                last, _ = training.loss_definition(site)
                chain = ([] if last is None else training.forward_span(last)) + [site.statement]
                for statement in chain:
                    found.setdefault(statement, chain)
            self._memo[key] = found
        return self._memo[key]  # type: ignore[return-value]

    def _checked_first(self, node: cst.Attribute, name: str) -> bool:
        """`model.module if is_parallel(model) else model` (yolov5's de_parallel), `if
        hasattr(model, "module"): model.module...`: the access sits in the branch of a test
        that asks about `name` itself, so it cannot fail the way TM302 says. (`ddp`, and TM306
        converting DataParallel, still rewrite such branches: `tm.unwrap(model)` says the same
        more simply, and the converted model is no DataParallel any more.)"""
        child: cst.CSTNode = node
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.If, cst.IfExp)) and child is anc.body:
                for call in self.ctx.within(anc.test, cst.Call):
                    if any(dotted(a.value) == name for a in call.args):
                        return True
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                return False
            child = anc
        return False

    def _prefixed_state(self, w: Wrap, node: cst.Attribute, attr: str) -> bool:
        """`state_dict()` / `load_state_dict()` of a DDP the script builds itself, which has
        `module.`-prefixed keys. `ddp` moves both through `tm.unwrap` (checkpoints without the
        prefix, loaded the same way). `lint` reports only `X.state_dict()` saved by
        `torch.save`/`tm.save` where `X` is provably the DDP: wrapped unconditionally earlier in
        the same scope (not behind `if args.distributed:`, where `X` may be the plain module)."""
        if attr not in STATE_METHODS or w.kind.rsplit("-", 1)[-1] != "ddp":
            return False
        if self.ctx.options.mode == "ddp":
            return True
        return attr == "state_dict" and w.kind == "ddp" and self.models.scope(node) is w.scope \
            and self._in_scope_body(w.statement, w.scope) and self._saved(node)

    def _in_scope_body(self, statement: Optional[cst.CSTNode], scope: cst.CSTNode) -> bool:
        """`statement` runs whenever its function (or module) does: not nested in a block."""
        parent = self.ctx.parent(statement) if statement is not None else None
        return parent is scope or isinstance(scope, cst.FunctionDef) and parent is scope.body

    def _saved(self, node: cst.Attribute) -> bool:
        """`node()` is what a save writes: its object, or a value of a dict, list or tuple it is."""
        call = self.ctx.parent(node)
        if not (isinstance(call, cst.Call) and call.func is node):
            return False
        for anc in self.ctx.ancestors(call):
            if isinstance(anc, cst.Arg):
                save = self.ctx.parent(anc)
                return isinstance(save, cst.Call) and self.ctx.resolve(save.func) in _SAVES \
                    and call_arg(save, "obj", 0) is anc
            if not isinstance(anc, (cst.Dict, cst.DictElement, cst.List, cst.Tuple, cst.Element)):
                return False
        return False

    def _whole_model_uses(self, by_name: Dict[str, List[Wrap]]) -> None:
        """A wrapped model pickled whole into a checkpoint (`torch.save(model, f)`, or a value of
        the saved dict / list / tuple, also through `state = {...}` or `state["net"] = net`),
        which then holds a DDP object that cannot be loaded outside torchrun; and
        `writer.add_graph(model, ...)`, whose jit trace fails on DDP: use the module itself.
        Only for the wraps this migration makes (or `tm.wrap_model`): a DDP the script builds
        itself was saved that way before."""
        converted = {id(s.wrap) for s in self.dp_sites if s.action not in ("keep", "manual")}
        manual_dp = any(s.action in ("keep", "manual") for s in self.dp_sites)

        def ours(w: Wrap) -> bool:
            kind = w.kind.rsplit("-", 1)[-1]
            if kind in ("new", "tm"):
                return True
            if kind != "dp" or not self.active["TM306"]:
                return False
            return id(w) in converted or (w.kind != "dp" and not manual_dp)

        found: List[Tuple[cst.BaseExpression, str, str]] = []
        seen: Set[int] = set()

        def add(node: cst.BaseExpression, use: str) -> None:
            name = dotted(node) if type(node) in (cst.Name, cst.Attribute) else None
            if name is None or name not in by_name or id(node) in seen:
                return
            statement = self.ctx.statement_of(node)
            if any(ours(w) and self.applies(w, node, statement) for w in by_name[name]):
                seen.add(id(node))
                found.append((node, name, use))

        def subscripts() -> Dict[Tuple[str, cst.CSTNode], List[cst.BaseExpression]]:
            key = ("subscript-assigns",)
            if key not in self._memo:
                out: Dict[Tuple[str, cst.CSTNode], List[cst.BaseExpression]] = {}
                for a in self.f.assigns:
                    for t in a.targets:
                        if type(t.target) is cst.Subscript and type(t.target.value) is cst.Name:
                            out.setdefault((t.target.value.value, self.models.scope(a)), []).append(a.value)
                self._memo[key] = out
            return self._memo[key]  # type: ignore[return-value]

        def saved(root: cst.BaseExpression, scope: cst.CSTNode, before: int) -> None:
            # a loop, not a recursive closure (a reference cycle, see test_engine)
            stack = [(root, 0)]
            while stack:
                node, depth = stack.pop()
                if depth > 4:
                    continue
                tp = type(node)
                if tp in (cst.Name, cst.Attribute):
                    name = dotted(node)
                    if name in by_name:
                        add(node, "save")
                    elif tp is cst.Name:
                        # `state = {"net": net, ...}; torch.save(state, path)`
                        for a, value in self.models.assignments(node.value):
                            if value is not None and self.models.scope(a) is scope \
                                    and self.models.idx(self.ctx.statement_of(a)) < before:
                                stack.append((value, depth + 1))
                        for value in subscripts().get((node.value, scope), ()):
                            if self.models.idx(self.ctx.statement_of(value)) < before:
                                stack.append((value, depth + 1))
                elif tp is cst.Dict:
                    stack.extend((e.value, depth + 1) for e in reversed(node.elements) if type(e) is cst.DictElement)
                elif tp in (cst.List, cst.Tuple, cst.Set):
                    stack.extend((e.value, depth + 1) for e in reversed(node.elements) if type(e) is cst.Element)
                elif tp is cst.IfExp:
                    stack.extend(((node.orelse, depth + 1), (node.body, depth + 1)))
                elif tp is cst.Call and dotted(node.func) == "dict":
                    stack.extend((a.value, depth + 1) for a in reversed(node.args) if a.keyword is not None)

        for call, qualified in self.f.calls:
            if qualified in _SAVES:
                a = call_arg(call, "obj", 0)
                if a is not None and not a.star:
                    saved(a.value, self.models.scope(call), self.models.idx(self.ctx.statement_of(call)))
            elif type(call.func) is cst.Attribute and call.func.attr.value == "add_graph":
                a = call_arg(call, "model", 0)
                if a is not None and not a.star:
                    add(a.value, "graph")
        for node, name, use in found:
            self.rewrites.append(AttrRewrite(node, name, "", "TM302", use=use))

    def _accesses(self, names: Iterable[str]) -> List[cst.Attribute]:
        """Attribute accesses `name.attr` of these names, in source order, for the names TM302
        rewrites: a plain name (`model`) or one attribute of a name (`self.model`, an instance's
        `trainer.model`).

        Found from the index's Names that spell each name's last part, following the parents
        up, instead of visiting every attribute of the file (tens of thousands)."""
        parent_of = self.ctx.parents.get
        found = []
        for name in names:
            parts = name.split(".")
            if len(parts) == 1:
                for node in self.ctx.named(name):
                    parent = parent_of(node)
                    if type(parent) is cst.Attribute and parent.value is node:
                        found.append(parent)
            elif len(parts) == 2:  # `self.model`, or an instance's (`trainer.model`)
                for node in self.ctx.named(parts[1]):
                    value = parent_of(node)
                    if not (type(value) is cst.Attribute and value.attr is node
                            and type(value.value) is cst.Name and value.value.value == parts[0]):
                        continue
                    parent = parent_of(value)
                    if type(parent) is cst.Attribute and parent.value is value:
                        found.append(parent)
        found.sort(key=self.ctx.position)
        return found

    # --- TM305 -------------------------------------------------------------------------
    def _lr_notes(self) -> None:
        if not self.active["TM305"]:
            return
        # `ddp`: optimizers of models this migration wraps (an existing DDP script keeps its
        # learning rate untouched); `lint`: optimizers of user-written DDP models.
        if self.ctx.options.mode == "lint":
            wrapped = {w.name for w in self.final_wraps() if w.kind.rsplit("-", 1)[-1] in ("ddp", "apex")}
        else:
            wrapped = {w.name for w in self.new} | {s.wrap.name for s in self.dp_sites if s.action not in ("keep", "manual")} | {
                s.wrap.arg for s in self.dp_sites if s.action not in ("keep", "manual") and s.wrap.arg}
        if self._batch_scaled() or not self._loads_batches():
            return
        seen = set()
        opts = optimizers(self.ctx)
        for o in opts:
            if o.via is not None:
                continue
            models = set(o.models)
            callers = [c for c in opts if c.via is o]
            for c in callers:
                models |= set(c.models)
            if not (models & wrapped) or o.statement in seen:
                continue
            name = self.ctx.resolve(o.call.func)
            lr = call_arg(o.call, "lr", 1 if name and name.startswith("torch.optim.") else None)
            if lr is None and not (name and name.startswith("torch.optim.")):
                continue
            if lr is not None and self._scaled(lr.value):
                continue
            seen.add(o.statement)
            self.lr_sites.append((o, lr))

    def _loads_batches(self) -> bool:
        """The file, or its program, builds a DataLoader: only then does the global batch grow
        with the ranks. Full-batch training (a graph's nodes) and hand-made iterators keep it."""
        if self.ctx.program.program_loaders:
            return True
        return any((qualified or dotted(call.func) or "").rsplit(".", 1)[-1] == "DataLoader"
                   or (dotted(call.func) or "") in self.ctx.program.loader_classes
                   for call, qualified in self.f.calls)

    def _scaled(self, node: cst.BaseExpression) -> bool:
        text = self.models.text(node)
        if _WORLD.search(text):
            return True
        names = set(re.findall(r"[A-Za-z_][\w.]*", text))
        for n in names:
            for a, value in self.models.assignments(n):
                if value is not None and _WORLD.search(self.models.text(value)):
                    return True
        return False

    def _batch_scaled(self) -> bool:
        for call, name in self.f.calls:
            if name and name.endswith("DataLoader"):
                bs = call_arg(call, "batch_size", 1)
                if bs is not None and self._scaled(bs.value):
                    return True
        return False


def _exits_after(block: cst.CSTNode, line: cst.CSTNode) -> bool:
    """A statement after `line` in `block` leaves it (`return`, `raise`, `break`, `continue`):
    a wrap moved after the enclosing `if` would never run on that path."""
    body = list(getattr(block, "body", ()))
    if line not in body:
        return False
    for statement in body[body.index(line):]:
        smalls = statement.body if isinstance(statement, cst.SimpleStatementLine) else ()
        if any(isinstance(s, (cst.Return, cst.Raise, cst.Break, cst.Continue)) for s in smalls):
            return True
    return False

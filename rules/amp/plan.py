"""The AMP family's decisions: from the module's training facts (`program.training`), where
forward outputs go (`program.forward_outputs`) and the run's options, what this run changes so
that the rules agree.

`plan(ctx)` is computed once per module, in the first `leave_Module` that asks, and decides:

- ``skip``: a framework manages precision (nothing to do); ``adding``: this run adds AMP;
- ``blockers``: why the module cannot get AMP (optimizer closures, `model.half()`, apex O2/O3,
  no single place for the scaler), each with the rule that reports it;
- ``regions``: the statements each new `with tm.autocast():` covers (training forwards, then
  evaluation forwards), and the outputs read back in float32 after the block (``float_after``);
  ``region_manual``: forwards that need a change by hand first;
- ``scaler``: the one GradScaler every step shares (an existing one, or where a new one is
  created), ``scaler_owner`` (the rule that creates it), the backwards it scales
  (``scale_calls``), the steps routed through it (``step_calls``) and where ``update()`` goes;
- ``unscales``: where `unscale_()` goes before clipping or gradient reads;
- ``bce``, ``backward_moves``/``backward_inside``: BCE losses and backwards under autocast.

Unlike the facts, the plan depends on the options (`--amp`, the command) and on which rules of
the family run together (`enabled_codes`): a step gets a scaler only if TM402 (or apex's TM407)
creates one, and TM405's autocast inside `forward` counts only when TM405 runs. Each rule then
reports its own part of the plan, so every rule also works alone (`--select`, `explain`
examples) and exactly one rule edits any given node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted, last_import_before_defs
from torchmigrate.syntax.nodes import code
from torchmigrate.program.forward_outputs import OutputFacts, output_facts
from torchmigrate.program.precision import BCE_CLASSES, BCE_FUNCS, DATA_PARALLEL, apex_level, apex_o1, caller_dtype, \
    wrappable_forward
from torchmigrate.program.syntax import (binds, block_of, calls_by_method, calls_in, class_of, is_visible, line_of,
                                         method_name, owner_statement, reads, receiver, root_name, scope_of,
                                         statements, target_names)
from torchmigrate.program.training import Site, Step, TrainingFacts, training_facts
from torchmigrate.program.effects import NUMPY
from torchmigrate.program.writes import call_kinds
from torchmigrate.program.types import OTHER, TENSOR, kind_of, made_by, optimizer_wrapper_of
from torchmigrate.rule import Context
from torchmigrate.rules.amp.edits import dtype_arg, runtime_call, runtime_kwargs

BCE_BLOCKED = "uses BCELoss (TM409)"


def enabled_codes(ctx: Context) -> Set[str]:
    """The AMP rules running on this module (each `AmpRule` adds its code when it is built)."""
    return ctx.facts.setdefault("amp_enabled_rules", set())  # type: ignore[return-value]


def inline_forward(site: Site) -> str:
    """What to do by hand when the forward runs inside the backward's expression."""
    return (f"the forward runs inside `{code(site.call or site.statement)[:60]}`: assign the "
            "loss to a variable under `with tm.autocast():` and call backward on it")


@dataclass
class Region:
    """The statements `first` to `last` of one block go under a new `with tm.autocast():`."""

    first: cst.CSTNode
    last: cst.CSTNode
    kind: str  # "train" or "eval"
    float_after: List[str] = field(default_factory=list)  # forward outputs read after the block
    # outputs bound in the block that reach numpy after it (bf16 has no numpy dtype)
    to_numpy: List[str] = field(default_factory=list)


@dataclass
class ScalerInfo:
    """The one GradScaler the training steps share: an existing one, or where a new one goes."""

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
    """What this run does about the module's training steps (see the module docstring). `sites`,
    `steps`, `existing_scalers` and `autocast_withs` are the training facts' own lists, here for
    the rules that read them along with the decisions (empty when `skip`)."""

    skip: bool = False  # a framework manages precision, or nothing to do
    adding: bool = False  # this run adds AMP where it is missing
    sites: List[Site] = field(default_factory=list)
    steps: List[Step] = field(default_factory=list)
    blockers: List[Tuple[str, cst.CSTNode, str]] = field(default_factory=list)
    scaler: Optional[ScalerInfo] = None
    scaler_owner: Optional[str] = None  # "TM402" or "TM407": creates the scaler, converts steps
    regions: List[Region] = field(default_factory=list)
    region_manual: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    bce: List[Tuple[cst.CSTNode, str, bool]] = field(default_factory=list)  # TM409 findings (node, message, a note?)
    hazards: List[Tuple[cst.CSTNode, str, bool]] = field(default_factory=list)  # TM409: (node, why, a note)
    scale_calls: List[cst.Call] = field(default_factory=list)  # backward calls to scale
    step_calls: List[Step] = field(default_factory=list)  # steps to route through the scaler
    updates: List[Tuple[cst.CSTNode, cst.CSTNode]] = field(default_factory=list)  # (after, anchor)
    unscales: List[Tuple[cst.CSTNode, List[str]]] = field(default_factory=list)  # (before stmt, optimizers)
    apex_unscales: Dict[cst.CSTNode, List[str]] = field(default_factory=dict)
    backward_moves: List[cst.With] = field(default_factory=list)
    backward_inside: List[cst.CSTNode] = field(default_factory=list)
    existing_scalers: List[Tuple[str, cst.Call]] = field(default_factory=list)
    autocast_withs: List[cst.With] = field(default_factory=list)
    # id() of a step whose receiver is the program's optimizer wrapper that only steps the torch
    # optimizer it holds -> that optimizer's expression (`opt.optimizer`), what the scaler steps
    stepped: Dict[int, str] = field(default_factory=dict)

    def optimizer_text(self, step: Step) -> Optional[str]:
        """What the scaler steps (and unscales) for `step`."""
        if step.optimizer is None:
            return None
        return self.stepped.get(id(step)) or code(step.optimizer)


def plan(ctx: Context) -> Plan:
    """The module's AMP plan, decided once (in the first `leave_Module` that asks) and kept."""
    cached = ctx.facts.get("amp_plan")
    if cached is None:
        cached = ctx.facts["amp_plan"] = _Planner(ctx).build()
    return cached  # type: ignore[return-value]


class _Planner:
    """Decides a module's `Plan` from its training facts, the options and the rules enabled."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.facts = analysis.facts(ctx)
        self.training: TrainingFacts = training_facts(ctx)
        self.outputs: OutputFacts = output_facts(ctx)
        self.p = Plan()
        self.region_sites: Set[int] = set()  # id() of sites whose loss gets a new autocast region

    # -- entry ------------------------------------------------------------------------------
    def build(self) -> Plan:
        ctx, p, training = self.ctx, self.p, self.training
        if training.framework:
            p.skip = True
            return p
        p.sites, p.steps = training.sites, training.steps
        p.existing_scalers, p.autocast_withs = training.existing_scalers, training.autocast_withs
        enabled = enabled_codes(ctx)
        apex_sites = [s for s in p.sites if s.kind == "apex"]
        from_apex = bool(apex_sites) and apex_o1(ctx)
        amp_on = ctx.options.amp != "off"
        p.adding = amp_on and (ctx.options.migrating or (from_apex and "TM407" in enabled))
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

    def find_blockers(self) -> None:
        ctx, p = self.ctx, self.p
        for step in p.steps:
            if step.kind == "closure":
                p.blockers.append(("TM402", step.call,
                                   "optimizer closures are not supported with GradScaler: compute the "
                                   "loss outside the closure to use mixed precision, or keep fp32"))
            elif step.scope not in self.training.sites_by_scope and step.kind == "plain" and p.sites:
                p.blockers.append(("TM402", step.call,
                                   f"`{code(step.call)}` runs in a function without the `backward()` it "
                                   "applies: scale that loss with the GradScaler (`scaler.scale(loss)."
                                   "backward()`) and step through it (`scaler.step(opt); scaler.update()`)"))
        if any(s.kind == "apex" for s in p.sites) and not apex_o1(ctx):
            level, init = apex_level(ctx)
            p.blockers.append(("TM407", init or p.sites[0].statement, f"apex opt_level {level}"))
        self.type_blockers()
        self.hazard_blockers()
        for call in self.training.half_models():
            p.blockers.append(("TM402", call,
                               "`.half()` trains in pure fp16 (no fp32 master weights): remove it and "
                               "let autocast + GradScaler handle precision"))

    def hazard_blockers(self) -> None:
        """Code elsewhere in the program whose numbers change meaning under autocast
        (`ModuleView.amp_hazards`): no autocast and no scaler here, and TM409 says why at the first
        training backward: in `ddp`, as a note (also where a change would allow it, a BCE loss: the
        program trains in float32 as it did, so nothing is left to do for its distribution); in
        `amp`, which asks for mixed precision, as a TODO where a change would allow it."""
        ctx, p = self.ctx, self.p
        found = ctx.program.amp_hazards
        if not (p.adding and p.sites and found):
            return
        first = min(p.sites, key=lambda s: self.training.position(s.statement, s.scope)).statement
        reasons = sorted(found)
        more = f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""
        message = f"mixed precision is not added: {'; '.join(reasons[:3])}{more}"
        p.blockers.append(("TM409", first, message))
        # `ddp`: a note (mixed precision comes as a bonus there); `amp` asked for it: a TODO where a
        # change would allow it (a BCE loss)
        p.hazards.append((first, message, ctx.options.mode == "ddp" or not any(found.values())))

    def type_blockers(self) -> None:
        """A GradScaler scales a loss tensor and steps a torch optimizer (it reads
        `param_groups`): a step of the program's own optimizer wrapper (`ScheduledOptim`,
        `NoamOpt`) goes through the torch optimizer it holds when its `step()` does nothing
        else; otherwise, like the backward of an object that is not a tensor, no scaler (and
        no autocast) is added here and a TODO says why."""
        ctx, p = self.ctx, self.p
        for step in p.steps:
            if step.kind != "plain" or step.optimizer is None or step.scope not in self.training.sites_by_scope:
                continue
            wrapper = optimizer_wrapper_of(ctx, step.optimizer)
            kind = kind_of(ctx, step.optimizer)
            if wrapper is None and kind not in (OTHER, TENSOR):
                continue  # a torch optimizer, or nothing known against it
            text = code(step.optimizer)
            if wrapper is not None and wrapper.delegates:
                p.stepped[id(step)] = f"{text}.{wrapper.inner}"
                continue
            made = made_by(ctx, step.optimizer)
            what = f"an instance of the program's `{made}`" if made else (
                "the program's optimizer wrapper" if wrapper is not None else "an object of the program")
            inner = f" (`{text}.{wrapper.inner}`)" if wrapper is not None and wrapper.inner else ""
            p.blockers.append(("TM402", step.call,
                               f"`{text}` is {what}, not a torch optimizer (no `param_groups`), and its `step()` "
                               f"does more than step one: a GradScaler cannot step it, so mixed precision is not "
                               f"added here. To use it, step the torch optimizer it holds{inner} through a "
                               f"`tm.GradScaler()` inside that `step()` and scale the loss "
                               f"(`scaler.scale(loss).backward()`)"))
        for site in p.sites:
            if site.kind != "plain" or site.loss is None or kind_of(ctx, site.loss) != OTHER:
                continue
            p.blockers.append(("TM402", site.call,
                               f"`{code(site.loss)}` is not a tensor (an object of the program with its own "
                               f"`backward()`): a GradScaler scales loss tensors only, so mixed precision is not "
                               f"added here. To use it, scale the loss tensor where it is computed "
                               f"(`scaler.scale(loss).backward()`)"))

    # -- scaler ---------------------------------------------------------------------------
    def choose_scaler(self, from_apex: bool) -> None:
        ctx, p = self.ctx, self.p
        enabled = enabled_codes(ctx)
        needs = [s for s in p.sites if s.kind in ("plain", "apex") and not s.paired]
        plain_steps = [s for s in p.steps if s.kind == "plain" and s.scope in self.training.sites_by_scope]
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
                p.scaler.dtype = caller_dtype(ctx)
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
            if any(self.training.exclusive(step.call, s.statement) for s in scaled):
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
                         and self.training.hoist(ctx.statement_of(call)) is ctx.statement_of(call))
        info = ScalerInfo(target, new=False, scope=creation_scope, klass=klass, unconditional=unconditional)
        scopes = {s.scope for s in p.sites} | {s.scope for s in p.steps}
        self.scaler_scopes = {s for s in scopes if scaler_visible(ctx, info, s)}
        return info

    def under_autocast(self, site: Site) -> bool:
        """The forward and loss of this backward run under autocast after the migration (or
        the model's own `forward` enters autocast, as recommended for DataParallel)."""
        if self.training.covered(site.statement) or self.forward_autocast():
            return True
        last, inline = self.training.loss_definition(site)
        if inline or last is None:
            return False
        return self.training.covered(last) or last in self.training.autocast_set or id(site) in self.region_sites

    def forward_autocast(self) -> bool:
        """A `forward` method of this file runs under autocast (a `with` or a decorator), or TM405
        puts one under autocast in this run: the scaler then comes in this run, not the next."""
        cached = getattr(self, "_forward_autocast", None)
        if cached is None:
            cached = self._forward_autocast = self.training.forward_under_autocast() or self.dp_forward_wrapped()
        return cached

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
        use_scopes = {s.scope for s in p.sites if not s.paired} | {s.scope for s in p.steps if s.scope in self.training.sites_by_scope}
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
                loop = self.outermost_loop(after or before, creation_scope)
                if loop is not None:
                    after, before = None, loop
                return ScalerInfo(name, True, after, f"{name} = {creation}", scope=creation_scope, before=before)
        if any(class_of(ctx, s) is not None and any(
                st.optimizer is not None and (dotted(st.optimizer) or "").startswith("self.")
                for st in p.steps if st.scope is s) for s in use_scopes):
            return self.scaler_blocker("the training steps mix `self.<optimizer>` and plain names")
        # The optimizer is created in another function (`main()` builds it, `train(...)` steps
        # it): one module-level scaler that every function sees.
        anchor = last_import_before_defs(ctx.module)
        self.scaler_scopes = set(use_scopes)
        return ScalerInfo(name, True, anchor, f"{name} = {creation}", scope=ctx.module)

    def outermost_loop(self, statement: Optional[cst.CSTNode], scope: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The outermost `for`/`while` of `scope` around `statement`: an optimizer built again
        inside the epoch loop (a new one at each learning-rate milestone, each fold) keeps one
        scaler, made before the loop; beside the optimizer a new scaler would start from its
        initial scale (65536) on every pass and learn it again (fp16)."""
        found = None
        for anc in self.ctx.ancestors(statement) if statement is not None else ():
            if anc is scope or isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                break
            if isinstance(anc, (cst.For, cst.While)) and block_of(self.ctx, anc)[0] is not None:
                found = anc
        return found

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
        first = self.training.hoist(candidates[0])
        block, body = block_of(ctx, first)
        if block is None:
            return None
        hoisted = {self.training.hoist(c) for c in candidates} | {self.training.hoist(o.statement) for o in opts if o.statement is not None}
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
        the group's update, which then follows that statement instead of theirs. Steps nested in
        an earlier statement, after the backward (`if not aggressive: enc.step()` before
        `dec.step()`), share the later step's update: an update between the two would make the
        second step unscale its gradients again."""
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
                if anchor not in body:
                    continue
                # earlier statements of the block, back to its previous step or the backward pass:
                # steps nested there apply the same gradients (`if not aggressive: enc.step()`
                # before `dec.step()`), so this step's update serves them too
                begin = body.index(items[n - 1][0]) + 1 if n > 0 and items[n - 1][0] in body else 0
                for statement in reversed(body[begin:body.index(anchor)]):
                    nested = nested_steps(statement, step.scope)
                    if has_backward(statement) or any(through_loop(s, statement) for s in nested):
                        break
                    keys = {key_of(s) for s in nested}
                    if not nested or keys & seen:
                        if keys & seen:
                            break
                        continue
                    seen |= keys
                    replaced.update(block_of_step[id(s)] for s in nested)
                # later statements of the block, up to the next step of its own
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
            if s in self.training.contains:
                break
        return False

    # -- autocast regions -------------------------------------------------------------------
    def train_regions(self) -> None:
        ctx, p = self.ctx, self.p
        raw: Dict[cst.CSTNode, List[Tuple[int, int, Site]]] = {}
        for site in p.sites:
            if site.paired or site.kind == "scaled" and self.covered_site(site):
                continue
            if self.training.covered(site.statement) and site.kind != "apex":
                continue
            last, inline = self.training.loss_definition(site)
            if inline:
                p.region_manual.append((site.statement, inline_forward(site)))
                continue
            if last is None or self.training.covered(last) or last in self.training.autocast_set:
                continue
            span = self.training.forward_span(last)
            if self.calls_own_autocast(span):
                continue  # `outputs = self._predict(x)` whose body enters autocast (behind the program's own flag)
            first, last = span[0], self.before_own_loss(span)
            block, body = block_of(ctx, first)
            body = list(body)
            if last is None:
                continue  # no forward before the project's loss (it is under autocast already)
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

    def calls_own_autocast(self, span: List[cst.CSTNode]) -> bool:
        """A statement of the forward span enters autocast itself (`if use_amp: with autocast():
        <forward> else: <forward>`) or calls a function or method of this file that does (often
        behind the program's own `use_amp` flag): the program decides its precision there, and
        a second autocast around it would force it on, also on the path without a scaler."""
        ctx = self.ctx
        own = {id(w) for w in self.training.autocast_withs}
        if own and any(id(w) in own for statement in span for w in ctx.within(statement, cst.With)):
            return True
        key = "amp.autocast_functions"
        names = ctx.facts.get(key)
        if names is None:
            names = ctx.facts[key] = {f.name.value for f in (ctx.enclosing(w, cst.FunctionDef)
                                                             for w in self.training.autocast_withs) if f is not None}
        if not names:
            return False
        for statement in span:
            for call in ctx.within(statement, cst.Call):
                func = call.func
                name = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else None
                if name in names:
                    return True
        return False

    def before_own_loss(self, span: List[cst.CSTNode]) -> Optional[cst.CSTNode]:
        """Where the autocast block over the forward-to-loss `span` ends: before the statement
        that first hands forward outputs to the project's own loss code (`loss =
        focal_loss(out, y)`, `self.criterion(out, y)` with a criterion of the project's class)
        when no model runs from there on; None when no model runs before it either (the block
        is there already: `out = tm.to_float32(out)` follows it). Torch's
        losses are autocast-aware, a project's are not: a clamp to `1 - 1e-4` is 1.0 in bf16 and
        `log(1 - p)` is -inf. The outputs are read back in float32 after the block
        (`float_after`), so the project's loss runs in float32."""
        training = self.training
        own_loss = training.own_loss

        def runs_model(part: List[cst.CSTNode]) -> bool:
            return any(training.model_call(c) and not own_loss(c) for s in part for c in calls_in(self.ctx, s))

        # names read back in float32 before the span (`out = tm.to_float32(out)`): outputs of a
        # block an earlier run ended before this loss
        _, body = block_of(self.ctx, span[0])
        body = list(body)
        outputs: Set[str] = {t for s in body[:body.index(span[0])] if self.read_back(s) for t in binds(self.ctx, s)}
        for i, statement in enumerate(span):
            if any(own_loss(c) and reads(self.ctx, c) & outputs for c in calls_in(self.ctx, statement)):
                if not runs_model(span[i:]):
                    return span[i - 1] if runs_model(span[:i]) else None
                break
            outputs |= binds(self.ctx, statement)
        return span[-1]

    def read_back(self, statement: cst.CSTNode) -> bool:
        """`out = tm.to_float32(out)`: what `float_after` puts after an autocast block."""
        line = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        return isinstance(line, cst.Assign) and isinstance(line.value, cst.Call) and \
            self.ctx.resolve(line.value.func) == "torchmigrate.runtime.to_float32"

    def covered_site(self, site: Site) -> bool:
        last, inline = self.training.loss_definition(site)
        if inline:
            return False  # `scaler.scale(criterion(model(x), y)).backward()`: its forward has no autocast
        return last is None or self.training.covered(last) or last in self.training.autocast_set

    def region_statements(self, region: Region) -> List[cst.CSTNode]:
        block, body = block_of(self.ctx, region.first)
        body = list(body)
        return body[body.index(region.first): body.index(region.last) + 1]

    def region_problem(self, region: Region) -> Optional[str]:
        stmts = self.region_statements(region)
        if self.training.computes_bce(stmts):
            return BCE_BLOCKED
        escaped = self.outputs.numpy_escape(stmts)
        if escaped and region.kind == "train" and self.numpy_after(region, stmts, escaped):
            region.to_numpy.append(escaped)  # `escaped = tm.to_float32(escaped)` after the block
            escaped = None
        if escaped:
            return (f"`{escaped}` leaves autocast as a bf16/fp16 tensor and is converted to numpy later "
                    "(bf16 has no numpy dtype): add `.float()` before `.numpy()`, then put the forward "
                    "under `with tm.autocast():`")
        converts = self.converts_to_numpy(stmts)
        if converts is not None:
            return (f"`{code(converts.func)}(...)` converts tensors to numpy (`.numpy()`, in code of the program it "
                    "calls); inside autocast they are bf16/fp16, which has no numpy dtype: add `.float()` before "
                    "`.numpy()` there, then put the forward under `with tm.autocast():`")
        return None

    def converts_to_numpy(self, stmts: List[cst.CSTNode]) -> Optional[cst.Call]:
        """A call in `stmts` of the program's own code that converts a tensor with `.numpy()`
        (`assign = hungarian_assign(scores, target)` between the forward and the loss; the
        program's effects, through its calls, in any module)."""
        for statement in stmts:
            for call in self.ctx.within(statement, cst.Call):
                kinds = call_kinds(self.ctx, call)
                if kinds and NUMPY in kinds:
                    return call
        return None

    def numpy_after(self, region: Region, stmts: List[cst.CSTNode], name: str) -> bool:
        """`name` is bound in the training block itself and reaches numpy only after it
        (`results.append(recon_loss.cpu().detach().numpy())` a few lines down): converted to
        float32 right after the block, it needs no TODO (evaluation forwards whose outputs reach
        numpy stay in float32, see `eval_regions`). Not a list filled inside the block (`preds.append(out)`),
        nor a conversion inside the block."""
        ctx = self.ctx
        if not any(name in binds(ctx, s) for s in stmts):
            return False
        start, end = ctx.position(region.first) or 0, ctx.last_position(region.last)
        for call, _ in calls_by_method(ctx).get("numpy", ()):
            at = ctx.position(call) or 0
            if start <= at <= end:
                return False
        return True

    def eval_regions(self) -> None:
        ctx, p = self.ctx, self.p
        if p.region_manual:
            return  # the training forward could not get autocast: leave evaluation alike
        if not p.regions and not any(s.kind in ("scaled", "apex") for s in p.sites) and not p.scale_calls:
            return
        for loop, calls in self.training.eval_forwards().items():
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
            if any(self.training.barrier(s) for s in self.region_statements(region)):
                continue
            if self.outputs.leave_torch(self.region_statements(region), calls):
                # in bf16 the project's SSIM helper or a numpy metric would fail ("Input type
                # (float) and weight type (BFloat16)", no numpy dtype) or lose precision: the
                # evaluation stays in float32 rather than break the user's metric code
                continue
            why = self.region_problem(region)
            if why is None:
                p.regions.append(region)

    def float_after(self, region: Region) -> List[str]:
        """Forward outputs bound in `region` and read by the statements after it: the metrics
        computed there (a test loss, softmax probabilities, a running error) would otherwise be
        computed in bf16/fp16 (a test loss read 2.2700 instead of 2.3037), so the block is followed
        by `out = tm.to_float32(out)`. The training loss is not among them (its backward keeps
        the autocast behaviour), nor an output only used for shapes or an argmax."""
        ctx = self.ctx
        outputs = self.outputs.bound_in(self.region_statements(region))
        if not outputs:
            return list(region.to_numpy)
        _, body = block_of(ctx, region.last)
        body = list(body)
        autocast = {s for r in self.p.regions if r is not region for s in self.region_statements(r)}
        later = [s for s in body[body.index(region.last) + 1:] if s not in autocast and not self.training.covered(s)]
        found = [name for name in outputs if any(self.outputs.precise_use(name, s) for s in later)]
        return found + [name for name in region.to_numpy if name not in found]

    def bce_checks(self) -> None:
        p = self.p
        will_autocast = p.adding and not p.blockers and bool(p.sites)
        for call, name in self.facts.calls:
            if name in BCE_CLASSES or name in BCE_FUNCS:
                under = self.training.covered(call) or self.training.used_under_autocast(call)
                if will_autocast or under:
                    what = "nn.BCELoss" if name in BCE_CLASSES else "F.binary_cross_entropy"
                    better = "nn.BCEWithLogitsLoss" if name in BCE_CLASSES else "F.binary_cross_entropy_with_logits"
                    # a TODO where the program's own autocast runs it (it raises there); else a note:
                    # no autocast is added around it, and the program trains in float32 as it did
                    p.bce.append((call, f"`{what}` raises under CUDA autocast (unsafe in fp16): drop the final "
                                        f"sigmoid and use `{better}` on the logits, then put the forward and "
                                        "loss under `with tm.autocast():` and scale the loss with `tm.GradScaler()`"
                                  if under or self.ctx.options.mode != "ddp" else
                                  f"mixed precision is not added where `{what}` computes the loss (it raises under "
                                  f"CUDA autocast): to add it, drop the final sigmoid and use `{better}` on the "
                                  "logits, then put the forward and loss under `with tm.autocast():` and scale the "
                                  "loss with `tm.GradScaler()`", not under and self.ctx.options.mode == "ddp"))

    def existing_autocast_checks(self) -> None:
        ctx, p = self.ctx, self.p
        for site in p.sites:
            if site.kind == "apex" or site.call is None:
                continue
            w = None
            for anc in ctx.ancestors(site.call):
                if anc in self.training.autocast_set:
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
    def zeroed_in_pass(self, scope: cst.CSTNode, window: int, pos: int, stepped: List[str]) -> List[str]:
        """Optimizers of the program (stepped somewhere) that this pass zeroes before its backward
        (at `window`) but does not step before the gradient read at `pos` (`enc.zero_grad();
        dec.zero_grad(); loss.backward(); clip(all params); enc.step()`): the backward fills their
        gradients too, scaled, and a clip over all the parameters would count them scaled. Their
        gradients are fresh and never stepped in this pass, so unscaling them changes nothing
        else."""
        p = self.p
        known = {p.optimizer_text(st) for st in p.steps if st.kind in ("plain", "scaled")} - {None}
        previous = max((self.training.position(x.statement, scope) for x in p.sites if x.scope is scope
                        and self.training.position(x.statement, scope) < window), default=-1)
        out: List[str] = []
        for call in self.ctx.within(scope, cst.Call, skip_defs=True):
            if method_name(call) != "zero_grad" or not isinstance(call.func, cst.Attribute):
                continue
            text = code(call.func.value)
            if text in known and text not in stepped and text not in out \
                    and previous < self.training.position(call, scope) < window:
                out.append(text)
        return out

    def unscale_points(self) -> None:
        ctx, p = self.ctx, self.p
        # (scope, window, optimizer) -> statements given an unscale_ there: a consumer in the
        # other branch of an `if` (never run in the same pass) still needs its own
        done: Dict[Tuple[cst.CSTNode, int, str], List[cst.CSTNode]] = {}
        consumers = sorted(self.training.grad_consumers(), key=lambda c: self.training.position(c[0], c[1]))
        for s, scope, apex in consumers:
            if not p.scaler.new and not scaler_visible(ctx, p.scaler, s):
                continue
            pos = self.training.position(s, scope)
            before = [(self.training.position(x.statement, scope), x) for x in p.sites if x.scope is scope
                      and self.training.position(x.statement, scope) < pos and not self.training.exclusive(s, x.statement)]
            if not before:
                continue
            window, last_site = max(before, key=lambda b: b[0])
            if last_site.paired:
                continue  # the non-AMP branch of an optional-AMP script
            later_sites = [self.training.position(x.statement, scope) for x in p.sites if x.scope is scope
                           and self.training.position(x.statement, scope) > pos and not self.training.exclusive(s, x.statement)]
            horizon = min(later_sites) if later_sites else 1 << 30
            steps = [st for st in p.steps if st.scope is scope and st.kind in ("plain", "scaled")
                     and pos < self.training.position(st.call, scope) < horizon]
            names: List[str] = []
            for st in sorted(steps, key=lambda st: self.training.position(st.call, scope)):
                opt = p.optimizer_text(st)
                if opt and opt not in names:
                    names.append(opt)
            if not names:
                continue
            names += self.zeroed_in_pass(scope, window, pos, names)
            if self.training.has_unscale(scope, window, pos, s):
                continue
            names = [n for n in names if not any(
                not self.training.exclusive(s, other) for other in done.get((scope, window, n), ()))]
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

"""Training facts of one module: where the training steps are and what runs in them.

Built once per module on first use (`training_facts(ctx)`, kept in ``ctx.facts["training"]``),
whatever rules are enabled or options given: the AMP family's plan (`rules/amp/plan.py`) decides
from them where autocast goes, where the GradScaler is created and where gradients are unscaled;
the apex and checkpoint rules read them too. Nothing here formats a message or plans an edit.

- a `Site` is a training backward: ``loss.backward()``, an already scaled
  ``scaler.scale(loss).backward()``, or apex's ``with amp.scale_loss(...)`` block; only backwards
  in a function that also steps an optimizer count (``sites``);
- a `Step` is an optimizer step: ``opt.step()``, ``scaler.step(opt)``, or ``opt.step(closure)``;
- the autocast blocks already there (``autocast_withs``: ``with torch.autocast(...)``, also
  through a variable or a helper holding the context, nanoGPT's ``with ctx:``), and the
  GradScalers already created (``existing_scalers``);
- per statement: whether it runs under autocast (`covered`), is data preparation
  (`data_only`), calls a model (`calls_model`); where the loss of a backward is defined
  (`loss_definition`) and where the forward computing it starts (`forward_start`);
- evaluation forwards in grad-free loops (`eval_forwards`), gradient reads and clipping
  between backward and step (`grad_reads`, `clip_helpers`, `grad_consumers`), BCE losses
  (`bce_names`, `computes_bce`), trained models cast to fp16 (`half_models`).

Name resolution uses the import table (`ctx.resolve`), never across modules.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.precision import (APEX_AMP, AUTOCAST, BCE_CLASSES, BCE_FUNCS, FRAMEWORKS, SCALER,
                                            TM_AUTOCAST, TM_SCALER)
from torchmigrate.program.syntax import (binds, binds_all, block_of, calls_by_method, calls_in, calls_spelled,
                                         class_of, exclusive, line_of, method_name, owner_statement, reads, receiver,
                                         root_name, scope_of, statements, subnodes, suites)
from torchmigrate.syntax.imports import dotted

if TYPE_CHECKING:
    from torchmigrate.rule import Context


CLIP = frozenset({
    "torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad_norm",
    "torch.nn.utils.clip_grad.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_value_",
    "torch.nn.utils.clip_grad.clip_grad_norm", "torch.nn.utils.get_total_norm",
})
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


def looks_like_optimizer(name: str) -> bool:
    """`optimizer`, `self.opt_g`, `d_optim`: a name for an optimizer (not a scheduler or scaler)."""
    last = name.rsplit(".", 1)[-1].lower()
    if any(x in last for x in ("sched", "scaler", "warmup", "lr_")):
        return False
    return last.startswith("opt") or "optim" in last


@dataclass
class Site:
    """One training backward: `loss.backward()`, an already scaled one, or apex's scale_loss block."""

    call: Optional[cst.Call]  # the .backward() call (None for an apex block without one)
    statement: cst.CSTNode  # the statement holding it (the `with amp.scale_loss` block for apex)
    scope: cst.CSTNode
    loss: Optional[cst.BaseExpression]
    kind: str  # "plain", "scaled", "apex"
    paired: bool = False  # the plain branch of an optional-AMP `if` (the other one is scaled)


@dataclass
class Step:
    """One optimizer step: `opt.step()`, `scaler.step(opt)` ("scaled") or `opt.step(closure)`."""

    call: cst.Call
    scope: cst.CSTNode
    optimizer: Optional[cst.BaseExpression]  # the optimizer expression
    kind: str  # "plain", "scaled", "closure"


class TrainingFacts:
    """The training steps of one module and what runs in them: built once per module (see
    `training_facts`), whatever rules run; what to do with them is the AMP family's plan."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.facts = analysis.facts(ctx)
        self.resolved = {call: name for call, name in self.facts.calls}
        # a framework (Lightning, accelerate, DeepSpeed, ...) manages precision in this file
        self.framework = any(ctx.imports.imports_module(f) for f in FRAMEWORKS)
        self.sites: List[Site] = []
        self.steps: List[Step] = []
        self.existing_scalers: List[Tuple[str, cst.Call]] = []  # (target, GradScaler(...) call)
        self.autocast_withs: List[cst.With] = []
        self.contains: Set[cst.CSTNode] = set()  # statements (and ancestors) holding a backward/step
        self.order_cache: Dict[cst.CSTNode, Dict[cst.CSTNode, int]] = {}
        self.collect()
        self.training_scopes()

    # -- collection ----------------------------------------------------------------------------
    def collect(self) -> None:
        """Existing scalers and autocast blocks, then every backward and step of the file."""
        ctx = self.ctx
        scaler_names: Set[str] = set()
        holders: Set[str] = set()  # variables holding an autocast context (or factory)
        factories: Set[str] = set()  # same-file functions returning one
        for call, name in self.facts.calls:
            if name in SCALER or name == TM_SCALER:
                target = analysis._assign_target(ctx, call)
                if target:
                    self.existing_scalers.append((target, call))
                    scaler_names.add(target)
            elif name in AUTOCAST or name == TM_AUTOCAST:
                parent = ctx.parent(call)
                if isinstance(parent, cst.WithItem):
                    with_node = ctx.parent(parent)
                    if isinstance(with_node, cst.With):
                        self.autocast_withs.append(with_node)
                else:
                    self.autocast_holder(call, holders, factories)
            elif name == "functools.partial" and call.args and (
                    self.ctx.resolve(call.args[0].value) in AUTOCAST | {TM_AUTOCAST}):
                self.autocast_holder(call, holders, factories)  # `amp = partial(torch.autocast, "cuda")`
        if holders or factories:
            self.autocast_context_withs(holders, factories)
        self.scaler_names = scaler_names
        self.autocast_set = set(self.autocast_withs)
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
            self.sites.append(Site(None, w, scope_of(ctx, w), loss, "apex"))
        for site in self.sites:
            self.mark(site.statement)
        for step in self.steps:
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
        for call, _ in self.facts.calls:  # `with holder(...)` / `with factory(...)`
            func = call.func
            d = dotted(func)
            name = func.attr.value if isinstance(func, cst.Attribute) else d
            if not (d in holders or name in factories):
                continue
            item = self.ctx.parent(call)
            w = self.ctx.parent(item) if isinstance(item, cst.WithItem) else None
            if isinstance(w, cst.With) and w not in self.autocast_withs:
                self.autocast_withs.append(w)
        for w in self.with_statements():  # `with holder:`
            if w in self.autocast_withs:
                continue
            if any(isinstance(i.item, (cst.Name, cst.Attribute)) and dotted(i.item) in holders for i in w.items):
                self.autocast_withs.append(w)

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
        self.sites.append(Site(call, statement, scope_of(ctx, call), loss, kind))

    def add_step(self, call: cst.Call) -> None:
        ctx = self.ctx
        recv = receiver(call)
        name = dotted(recv) if recv is not None else None
        if name is None:
            return
        if name in self.scaler_names or name.rsplit(".", 1)[-1] in ("scaler", "grad_scaler", "amp_scaler"):
            opt = call.args[0].value if call.args else None
            self.steps.append(Step(call, scope_of(ctx, call), opt, "scaled"))
            return
        targets = {o.target for o in analysis.optimizers(ctx) if o.target}
        if name not in targets and not looks_like_optimizer(name):
            return
        kind = "closure" if call.args else "plain"
        self.steps.append(Step(call, scope_of(ctx, call), recv, kind))

    # -- which functions train ---------------------------------------------------------------
    def training_scopes(self) -> None:
        """Keep the backwards of functions that also step an optimizer (apex blocks always)."""
        steps_by_scope: Dict[cst.CSTNode, List[Step]] = {}
        for s in self.steps:
            steps_by_scope.setdefault(s.scope, []).append(s)
        kept = []
        for site in self.sites:
            if site.scope in steps_by_scope or site.kind == "apex":
                kept.append(site)
        self.sites = kept  # a backward without a step in its function is not a training step
        sites_by_scope = {s.scope for s in self.sites}
        for site in self.sites:
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
            others = [s for s in self.sites if s.kind == "scaled" and s is not site
                      and if_node in set(ctx.ancestors(s.statement))]
            if others:
                return True
            node = if_node

    # -- where statements run ----------------------------------------------------------------
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

    def forward_under_autocast(self) -> bool:
        """A `forward` method of this file runs under autocast (a `with` or a decorator)."""
        cached = getattr(self, "_forward_autocast", None)
        if cached is None:
            nodes: List[cst.CSTNode] = list(self.autocast_withs)
            nodes += [c for c, n in self.facts.calls if (n in AUTOCAST or n == TM_AUTOCAST)
                      and isinstance(self.ctx.parent(c), cst.Decorator)]
            cached = self._forward_autocast = any(
                getattr(self.ctx.enclosing(n, cst.FunctionDef), "name", None) is not None
                and self.ctx.enclosing(n, cst.FunctionDef).name.value == "forward" for n in nodes)
        return cached

    def loss_definition(self, site: Site) -> Tuple[Optional[cst.CSTNode], bool]:
        """(the last statement before the backward that assigns the loss, in the innermost block
        where one exists; whether the forward runs inside the backward's own expression instead,
        `criterion(model(x), y).backward()`, so that no statement defines the loss)."""
        ctx = self.ctx
        loss = site.loss
        if loss is None:
            return None, False
        names = set()
        inline_call = False
        for n in subnodes(loss):
            if isinstance(n, cst.Call):
                # `loss.mean()` is a method of a value; `criterion(...)`, `F.cross_entropy(...)`,
                # `torch.nn.functional.mse_loss(...)` compute the loss right there
                if not (isinstance(n.func, cst.Attribute) and root_name(n.func.value)) or ctx.resolve(n.func):
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
            return None, True
        node = site.statement
        while True:
            block, body = block_of(ctx, node)
            if block is None:
                return None, False
            index = list(body).index(node)
            for s in reversed(body[:index]):
                if binds(ctx, s) & names:
                    return s, False
            owner = owner_statement(ctx, block)
            if owner is None or isinstance(owner, (cst.FunctionDef, cst.ClassDef)):
                return None, False
            node = owner

    def barrier(self, statement: cst.CSTNode) -> bool:
        return statement in self.contains or statement in self.autocast_set or isinstance(
            statement, (cst.FunctionDef, cst.ClassDef))

    def data_only(self, statement: cst.CSTNode) -> bool:
        if isinstance(statement, cst.If):
            # `if use_cuda: x, y = x.cuda(), y.cuda()`
            return all(self.data_only(s) for block in suites(statement) for s in statements(block)) and \
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

    def forward_start(self, last: cst.CSTNode) -> cst.CSTNode:
        """The statement of `last`'s block where the forward computing `last` (a loss definition)
        begins: the earliest statement `last` depends on that calls a model, else the earliest
        dependency that does more than move data; never past a statement holding a backward, a
        step or an autocast block."""
        ctx = self.ctx
        block, body = block_of(ctx, last)
        body = list(body)
        index = body.index(last)
        deps = reads(ctx, last)
        start = last
        chain = [last]
        for s in reversed(body[:index]):
            if self.barrier(s):
                break
            if binds(ctx, s) & deps:
                deps |= reads(ctx, s)  # through a reshape too (`lp = out.view(-1, c)` between forward and loss)
                if self.data_only(s):
                    continue
                start = s
                chain.append(s)
        # The forward starts at the first model call the loss depends on: input preparation
        # before it (augmentation, `Variable(...)`, resizing) and whatever sits between
        # (`zero_grad()`, LR warm-up, plotting) stays outside.
        forward = [s for s in chain if self.calls_model(s)]
        if forward:
            return forward[-1]
        return start

    def forward_span(self, last: cst.CSTNode) -> List[cst.CSTNode]:
        """The statements of `last`'s block from `forward_start(last)` to `last` (a loss
        definition): the forward and the loss of one training step."""
        _, body = block_of(self.ctx, last)
        body = list(body)
        return body[body.index(self.forward_start(last)): body.index(last) + 1]

    def calls_model(self, statement: cst.CSTNode) -> bool:
        """`statement` calls a model (`model_call`)."""
        return any(self.model_call(call) for call in calls_in(self.ctx, statement))

    def model_call(self, call: cst.Call) -> bool:
        """`call` runs a model: a trained model, or a callable object held in a variable or
        attribute (`teacher(x)`, `self.backbone(x)`, `vae.encode(x)`). Library functions and
        classes (`F.interpolate`, `Variable`, also through star imports), builtins, data movement
        (`.to()`, `.float()`), aliases of library callables (`Tensor = torch.cuda.FloatTensor`)
        and helper functions not handed a trained model are not."""
        if self.resolved.get(call) is not None:
            return False
        models = self.model_roots()
        bound = self.file_bindings()
        func = call.func
        if isinstance(func, cst.Name):
            name = func.value
            if name in models:
                return True
            if name in self.facts.classes or name in _DATA_FUNCS or name in _BUILTINS:
                return False
            if name in self.facts.functions or name not in bound:  # a helper (here or star-imported)
                return any(analysis.model_root(r) in models for r in reads(self.ctx, call))
            return not self.alias_only(name)
        if isinstance(func, cst.Attribute):
            if func.attr.value in _DATA_METHODS:
                return False
            viewed = self.callee_name(func)
            owner = viewed.rsplit(".", 1)[0] if viewed and viewed != dotted(func) else root_name(func.value)
            if owner is None:
                return False  # a method of a call's result: the inner call decides
            if analysis.model_root(owner) in models:
                return True
            root = owner.split(".")[0]
            # `random.choice` from a star import, `Tensor.new(...)`
            return not (root in _BUILTINS or root not in bound or self.alias_only(root))
        return False

    def callee_name(self, func: cst.BaseExpression) -> Optional[str]:
        """The dotted name of what `func` calls, reading the runtime's `tm.unwrap(model).f` and
        `tm.synced(model).f` (an earlier run's rewrites) as `model.f`."""
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Call) and func.value.args \
                and self.ctx.resolve(func.value.func) in _RUNTIME_VIEWS:
            inner = dotted(func.value.args[0].value)
            return f"{inner}.{func.attr.value}" if inner else None
        return dotted(func)

    def own_loss(self, call: cst.Call) -> bool:
        """`call` computes a loss with the project's own code rather than torch's or a
        library's, and is not handed a trained model (so it runs no forward): a function of the
        program (`focal_loss(out, y)`, `losses.dice(out, y)`), or, named as a loss (`loss`,
        `crit` in its name), an object built from a program class (`criterion = FocalLoss()`,
        `self.criterion = ...`), a method of the enclosing class (`self.compute_loss(...)`) or
        of a trained model (`model.loss(...)`)."""
        func = call.func
        name = self.callee_name(func)
        models = self.model_roots()
        if name is None or self.resolved.get(call) is not None or any(
                analysis.model_root(r) in models for a in call.args for r in reads(self.ctx, a)):
            return False
        if analysis.model_root(name) in models:  # a trained model: its forward, or a loss method
            return isinstance(func, cst.Attribute) and _loss_named(func.attr.value)
        functions, classes, instances = self._own_code()
        if name in functions:
            return True
        if isinstance(func, cst.Attribute) and name.count(".") == 1 and name.split(".")[0] in ("self", "cls"):
            klass = self.ctx.enclosing(call, cst.ClassDef)
            if klass is not None and _loss_named(func.attr.value) and any(
                    isinstance(d, cst.FunctionDef) and d.name.value == func.attr.value for d in klass.body.body):
                return True
        if name in classes:
            return _loss_named(name)
        return any(_loss_named(name) or _loss_named(klass) for klass in instances.get(name, ()))

    def _own_code(self) -> Tuple[Set[str], Set[str], Dict[str, List[str]]]:
        """The program's functions and classes as this file spells them (module-level ones of
        this file too), and the names this file binds to an instance of one of those classes ->
        the classes (`criterion = FocalLoss()`, `self.criterion = losses.Dice()`)."""
        cached = getattr(self, "_own", None)
        if cached is None:
            functions = {n for n, d in self.facts.functions.items() if class_of(self.ctx, d) is None}
            functions |= self.ctx.program.own_functions
            classes = set(self.facts.classes) | self.ctx.program.own_classes
            instances: Dict[str, List[str]] = {}
            for a in self.facts.assigns:
                klass = dotted(a.value.func) if isinstance(a.value, cst.Call) else None
                if klass in classes:
                    for t in a.targets:
                        target = dotted(t.target)
                        if target:
                            instances.setdefault(target, []).append(klass)
            cached = self._own = (functions, classes, instances)
        return cached

    def file_bindings(self) -> Set[str]:
        """First parts of every name the file binds (assignments, loop and `with` targets,
        parameters, imports)."""
        cached = getattr(self, "_bindings", None)
        if cached is None:
            cached = {n.split(".")[0] for n in binds_all(self.ctx)}
            cached.update(self.ctx.imports.names)
            self._bindings = cached
        return cached

    def model_roots(self) -> Set[str]:
        cached = getattr(self, "_model_roots", None)
        if cached is None:
            cached = self._model_roots = set(analysis.trained_models(self.ctx))
        return cached

    def half_models(self) -> List[cst.Call]:
        """`.half()` calls that cast a trained model to fp16 (`model.half()`, `net =
        Net().half()`): it then trains in pure fp16, without fp32 master weights."""
        models = self.model_roots()
        out = []
        for call, _ in calls_by_method(self.ctx).get("half", ()):
            recv = receiver(call)
            target = analysis._assign_target(self.ctx, call)
            owner = root_name(recv) if recv is not None else None
            if (owner and analysis.model_root(owner) in models) or (target and target in models):
                out.append(call)
        return out

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

    # -- evaluation ----------------------------------------------------------------------------
    def eval_forwards(self) -> Dict[cst.CSTNode, List[cst.Call]]:
        """Evaluation loops and their forwards: calls of a trained model in a loop under
        `no_grad`/`inference_mode` that holds no backward or step, not already under autocast
        and not the deliberate non-AMP branch of an optional-AMP `if` (loop -> calls)."""
        cached = getattr(self, "_eval_forwards", None)
        if cached is None:
            ctx = self.ctx
            cached = self._eval_forwards = {}
            for call in calls_spelled(ctx, self.model_roots()):
                loop = ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef, cst.ClassDef)
                if not isinstance(loop, (cst.For, cst.While)) or loop in self.contains:
                    continue
                if self.covered(call) or not analysis.under_no_grad(ctx, loop) or self.non_amp_branch(call, loop):
                    continue
                cached.setdefault(loop, []).append(call)
        return cached

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

    # -- BCE losses (unsafe under autocast) ------------------------------------------------
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
        """Same-file functions that compute a BCE loss (one level); methods as `self.name`
        (`self.backward_D(netD, real, fake)` of a GAN trainer whose loss is in the method)."""
        cached = getattr(self, "_bce_funcs", None)
        if cached is None:
            cached = set()
            # BCE calls by resolved name, and calls of the variables holding a BCE loss module
            # (a call in both lists only adds its function's name twice).
            calls = analysis.calls_to(self.ctx, *BCE_FUNCS, *BCE_CLASSES) + calls_spelled(self.ctx, self.bce_names())
            for call in calls:
                func = self.ctx.enclosing(call, cst.FunctionDef)
                if func is not None:
                    cached.add(func.name.value if class_of(self.ctx, func) is None else "self." + func.name.value)
            self._bce_funcs = cached
        return cached

    def computes_bce(self, body: Sequence[cst.CSTNode]) -> bool:
        """One of the statements `body` computes a BCE loss: torch's function or module, a
        variable holding `nn.BCELoss()`, or a function of this file that computes one."""
        bce = self.bce_names()
        local_funcs = self.bce_functions()
        for s in body:
            for call in calls_in(self.ctx, s):
                name = self.ctx.resolve(call.func)
                d = dotted(call.func)
                if name in BCE_FUNCS or name in BCE_CLASSES or (d and d in bce) or (
                        isinstance(call.func, (cst.Name, cst.Attribute)) and d in local_funcs):
                    return True
        return False

    def used_under_autocast(self, call: cst.Call) -> bool:
        target = analysis._assign_target(self.ctx, call)
        if not target:
            return False
        return any(self.covered(other) for other in calls_spelled(self.ctx, (target,)))

    # -- statement order: what runs between a backward and its step -----------------------

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
                    stack.extend(reversed([t for block in suites(s) for t in statements(block)]))
            self.order_cache[scope] = cached
        return cached

    def position(self, node: cst.CSTNode, scope: cst.CSTNode) -> int:
        order = self.order(scope)
        n = node
        while n is not None and n not in order:
            n = self.ctx.parent(n)
        return order.get(n, -1)

    def exclusive(self, a: cst.CSTNode, b: cst.CSTNode) -> bool:
        """`a` and `b` sit in different branches of one `if` (`syntax.exclusive`)."""
        return exclusive(self.ctx, a, b)

    def has_unscale(self, scope: cst.CSTNode, start: int, end: int, consumer: Optional[cst.CSTNode] = None) -> bool:
        """An `unscale_()` runs in `scope` between positions `start` and `end` (not in the other
        branch of an `if` than `consumer`)."""
        for call, _ in calls_by_method(self.ctx).get("unscale_", ()):
            if scope_of(self.ctx, call) is scope:
                if start < self.position(call, scope) < end and not (
                        consumer is not None and self.exclusive(consumer, call)):
                    return True
        return False

    def clip_helpers(self) -> Set[str]:
        """Functions of this file that clip gradients, or use them by hand (`_touches_grad`)."""
        out = set()
        for call, name in self.facts.calls:
            if name in CLIP or _touches_grad(self.ctx, call):
                func = self.ctx.enclosing(call, cst.FunctionDef)
                if func is not None and func not in self.sites_by_scope and class_of(self.ctx, func) is None:
                    out.add(func.name.value)
        return out

    def grad_reads(self) -> List[cst.CSTNode]:
        """`p.grad` read between backward and step (gradient-norm logging, manual clipping)."""
        out = []
        for scope in self.sites_by_scope:
            order = self.order(scope)
            sites = [self.position(x.statement, scope) for x in self.sites if x.scope is scope]
            steps = [self.position(x.call, scope) for x in self.steps if x.scope is scope]
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


    def grad_consumers(self) -> List[Tuple[cst.CSTNode, cst.CSTNode, bool]]:
        """The statements of the training functions that use gradients: clipping (also through
        a clipping helper of this file or of another module, `ModuleView.clip_helpers`), then gradient reads between backward and step (see
        `grad_reads`), each statement once, as (statement, function, whether it clips apex's
        `amp.master_params(...)`)."""
        ctx = self.ctx
        consumers: List[Tuple[cst.CSTNode, cst.CSTNode, bool]] = []
        helper_clips = self.clip_helpers()
        seen_stmt: Set[cst.CSTNode] = set()
        for call, name in self.facts.calls:
            is_clip = name in CLIP or (isinstance(call.func, cst.Name) and call.func.value in helper_clips) or (
                dotted(call.func) in ctx.program.clip_helpers)
            if not is_clip:
                continue
            scope = scope_of(ctx, call)
            if scope not in self.sites_by_scope:
                continue
            s = self.outside_gradient_loops(line_of(ctx, call) or ctx.statement_of(call), scope)
            if s is None or s in seen_stmt:
                continue
            seen_stmt.add(s)
            apex = any(self.resolved.get(c) == f"{APEX_AMP}.master_params" for c in calls_in(ctx, call))
            consumers.append((s, scope, apex))
        for node in self.grad_reads():
            scope = scope_of(ctx, node)
            if scope not in self.sites_by_scope:
                continue
            s = self.outside_gradient_loops(line_of(ctx, node) or ctx.statement_of(node), scope)
            if s is None or s in seen_stmt:
                continue
            seen_stmt.add(s)
            consumers.append((s, scope, False))
        return consumers

    def outside_gradient_loops(self, s: Optional[cst.CSTNode], scope: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement an unscale_ for `s` goes before: `s` itself, or the outermost loop
        around it that holds no backward or step (`for p in params: clip_grad_norm_(p, c)`
        runs the clip once per parameter, and `unscale_` may run only once per step)."""
        if s is None:
            return None
        chosen = s
        for anc in self.ctx.ancestors(s):
            if anc is scope:
                break
            if isinstance(anc, (cst.For, cst.While)):
                if anc in self.contains:
                    break
                chosen = anc
        return chosen


_RUNTIME_VIEWS = frozenset({"torchmigrate.runtime.unwrap", "torchmigrate.runtime.synced"})


def _loss_named(name: str) -> bool:
    """`criterion`, `self.loss_fn`, `FocalLoss`, `compute_loss`: a name that says loss."""
    low = name.lower()
    return "loss" in low or "crit" in low


def _touches_grad(ctx: "Context", call: cst.Call) -> bool:
    """`p.grad.data.clamp_(-clip, clip)`, `p.grad.mul_(s)` (an in-place method on a gradient) or
    any method of a gradient (`p.grad.norm()`): a helper that calls one needs the gradients
    unscaled first, as for clipping (the program's other modules: `facts._changes_grad`)."""
    func = call.func
    if not isinstance(func, cst.Attribute):
        return False
    if isinstance(func.value, cst.Attribute) and func.value.attr.value == "grad":
        return True
    return func.attr.value.endswith("_") and not func.attr.value.startswith("_") and any(
        isinstance(n, cst.Attribute) and n.attr.value == "grad" for n in ctx.within(func.value, cst.Attribute))


def training_facts(ctx: Context) -> TrainingFacts:
    """The module's training facts, computed on first use and kept for the other rules."""
    found = ctx.facts.get("training")
    if found is None:
        found = ctx.facts["training"] = TrainingFacts(ctx)
    return found  # type: ignore[return-value]

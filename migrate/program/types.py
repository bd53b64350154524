"""What an expression of one module holds: a tensor, a module, an optimizer, a plain object of
the program, or something the analysis does not know.

Rules that rewrite a call on an object state what the object must be and ask here first:
`x.cuda()` becomes `x.to(tm.device())` only on a tensor or a module (a loss class of the
project with a `cuda()` of its own has no `.to()`), a GradScaler steps only a torch optimizer
and scales only a loss tensor. An answer of None means "not known": the rule then keeps the
user's code. Known is what the module shows:

- what a value is made by: torch's tensor functions (`torch.zeros`, `F.softmax`), `torch.nn`
  classes (modules), `torch.optim` classes (optimizers), model factories (`torchvision.models`,
  `timm.create_model`), the program's classes by their kind (`classes`, through
  `ModuleView.class_kinds`), a call of a module (`model(x)`: its output), tensor methods and
  arithmetic on a tensor, the moves of a module (`model.cuda()`, `net.to(device)`);
- where a name or `self.` attribute gets its value: every binding of it in its scope (its
  class's methods for `self.x`) must agree, assignments, loop targets over a data loader (the
  batches a loader yields), a parameter's annotation or the program's knowledge that it
  receives the trained model (`ModuleView.wrapped_params`);
- when the bindings do not say, how the module uses a name in the same scope: parameters
  taken from it (`x.parameters()`: a module) or tensor-only attributes (`x.shape`, `x.view()`).

Name resolution uses the import table (`ctx.resolve`); the program's classes come from the
program (`ctx.program`). Answers are kept per node in ``ctx.facts``.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.classes import (MODULE, OPTIMIZER, OTHER, TENSOR, OptimizerWrapper, library_base_kind,
                                         library_call_kind, optimizer_wrapper)
from torchmigrate.program.loaders import DATALOADERS, TQDM_CALLS, refs_at
from torchmigrate.syntax.imports import dotted

if TYPE_CHECKING:
    from torchmigrate.rule import Context

__all__ = ["MODULE", "OPTIMIZER", "OTHER", "TENSOR", "kind_of", "is_batch_source"]

# methods of a module that return the module itself
_MODULE_MOVES = frozenset({"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "train", "eval",
                           "requires_grad_", "share_memory", "type", "to_empty", "apply"})
# tensor methods whose result is not a tensor
_TENSOR_NOT_TENSOR = frozenset({"item", "tolist", "numpy", "size", "dim", "numel", "element_size",
                                "data_ptr", "stride", "storage", "untyped_storage", "is_contiguous",
                                "get_device", "backward", "register_hook"})
# used on a name, these say what it holds (when its bindings do not)
_MODULE_ONLY = frozenset({"parameters", "named_parameters", "modules", "named_modules", "children",
                          "named_children", "register_buffer", "register_forward_hook"})
_TENSOR_ONLY_ATTRS = frozenset({"shape", "dtype", "ndim", "is_cuda", "T"})
_TENSOR_ONLY_METHODS = frozenset({"view", "size", "unsqueeze", "squeeze", "permute", "transpose", "reshape",
                                  "contiguous", "item", "numel", "detach", "long", "masked_fill", "view_as",
                                  "expand", "repeat", "argmax", "softmax", "sigmoid", "clamp", "index_select"})
# calls that pass the batches of the iterable they are given through
_THROUGH = frozenset({"enumerate", "iter", "zip", "tqdm", "trange", "reversed"})
_LOADER_NAME = re.compile(r"(loader|dataloader|^dl$|_dl$|^dl_|_dl_|iterator|batches|prefetcher)", re.IGNORECASE)
_IN_PROGRESS = "in-progress"


def kind_of(ctx: Context, node: cst.BaseExpression) -> Optional[str]:
    """`TENSOR`, `MODULE`, `OPTIMIZER` or `OTHER` (a plain object of the program) when the
    module shows what `node` holds; None when it does not."""
    found = _kind(ctx, node)
    return None if found == _IN_PROGRESS else found


def _kind(ctx: Context, node: cst.BaseExpression) -> Optional[str]:
    """`kind_of`, or `_IN_PROGRESS` for a node whose kind is being worked out higher up: a
    binding that refers back to itself (`x = x.cuda()`) says nothing new. An answer that
    depended on such a node is kept only once that node is done."""
    facts = ctx.facts
    cache: Dict[cst.CSTNode, Optional[str]] = facts.setdefault("tm_kinds", {})  # type: ignore[assignment]
    if node in cache:
        return cache[node]
    progress: Set[cst.CSTNode] = facts.setdefault("tm_kinds_progress", set())  # type: ignore[assignment]
    if node in progress:
        facts["tm_kinds_partial"] = True
        return _IN_PROGRESS
    outer = facts.get("tm_kinds_partial", False)
    facts["tm_kinds_partial"] = False
    progress.add(node)
    try:
        found = _Kinds(ctx).of(node)
    finally:
        progress.discard(node)
    partial = facts["tm_kinds_partial"]
    if not partial or not progress:
        cache[node] = found
    facts["tm_kinds_partial"] = outer or (partial and bool(progress))
    return found


def _join(kinds: Iterable[Optional[str]]) -> Optional[str]:
    """The one kind all of `kinds` agree on, ignoring those still being worked out (then
    `_IN_PROGRESS` when there is nothing else); None when one is unknown or two differ."""
    every = set(kinds)
    found = every - {_IN_PROGRESS}
    if not found:
        return _IN_PROGRESS if every else None
    return found.pop() if len(found) == 1 else None


def annotation_kind(ctx: Context, annotation: cst.BaseExpression) -> Optional[str]:
    """`x: torch.Tensor`, `model: nn.Module`, `opt: Optimizer`, `loss: FocalLoss`."""
    name = ctx.resolve(annotation)
    if name is not None:
        if name in ("torch.Tensor", "torch.nn.Parameter"):
            return TENSOR
        if name.startswith("torch."):
            return library_base_kind(name)
        return None
    spelled = dotted(annotation)
    return class_kind(ctx, spelled) if spelled else None


def class_kind(ctx: Context, spelled: str, depth: int = 0) -> Optional[str]:
    """The kind of the program's class spelled `spelled` here; for a class of this module
    without the program's facts (a file alone), from its bases as this module resolves them."""
    known = ctx.program.class_kinds.get(spelled)
    if known is not None or depth > 8:
        return known
    klass = analysis.facts(ctx).classes.get(spelled)
    if klass is None:
        return None
    found = []
    for base in klass.bases:
        name = ctx.resolve(base.value)
        text = dotted(base.value)
        if name is None and text in analysis.facts(ctx).classes:
            found.append(class_kind(ctx, text, depth + 1))
        else:
            found.append(library_base_kind(name or text or ""))
    for kind in (MODULE, TENSOR, OPTIMIZER):
        if kind in found:
            return kind
    return None if None in found else OTHER


def is_batch_source(ctx: Context, node: cst.BaseExpression, depth: int = 0) -> bool:
    """`node` yields a data loader's batches: a DataLoader (the module's loader facts, or a
    name spelled like one: `train_loader`, `self.val_dl`, a `loader` parameter), also through
    `enumerate(...)`, `tqdm(...)`, `iter(...)`, `zip(...)`, or a name bound to one of those."""
    if depth > 3:
        return False
    if isinstance(node, cst.Call):
        name = ctx.resolve(node.func)
        if name in DATALOADERS or name in TQDM_CALLS or (dotted(node.func) or "") in ctx.program.loader_classes:
            return name not in TQDM_CALLS or any(is_batch_source(ctx, a.value, depth + 1) for a in node.args[:1])
        func = dotted(node.func) or ""
        if func.rsplit(".", 1)[-1] in _THROUGH:
            return any(is_batch_source(ctx, a.value, depth + 1) for a in node.args if a.keyword is None)
        return _makes_loader(ctx, node, func, depth)
    if not isinstance(node, (cst.Name, cst.Attribute)):
        return False
    if refs_at(ctx, node):
        return True
    text = dotted(node)
    if text is None:
        return False
    if _LOADER_NAME.search(text.rsplit(".", 1)[-1]):
        return True
    if isinstance(node, cst.Name):  # `pbar = tqdm(loader)`, `it = iter(loader)`
        return any(value is not None and is_batch_source(ctx, value, depth + 1)
                   for value, _ in _bindings(ctx, node) if value is not _PARAM)
    return False


def _makes_loader(ctx: Context, call: cst.Call, func: str, depth: int) -> bool:
    """`for x, y in get_loader(args):`: a call of the program's own function that returns a
    loader: spelled like one (`loader()`, `build_dataloader(cfg)`, `get_batches(data, bs)`), a
    training-loader factory of another module, or a function of this module whose every
    `return` gives a loader (`def data(): return DataLoader(ds, 8)`)."""
    if not func:
        return False
    if _LOADER_NAME.search(func.rsplit(".", 1)[-1]) or func in ctx.program.loader_factories:
        return True
    if "." in func or ctx.resolve(call.func) is not None:
        return False
    defs = [d for d in ctx.nodes(cst.FunctionDef) if d.name.value == func and ctx.enclosing(d, cst.FunctionDef,
                                                                                              cst.ClassDef) is None]
    if len(defs) != 1:
        return False
    returns = [r for r in ctx.within(defs[0], cst.Return, skip_defs=True) if r.value is not None]
    return bool(returns) and all(is_batch_source(ctx, r.value, depth + 1) for r in returns)


_PARAM = cst.Name("__param__")  # marks a parameter among a name's bindings


def _bindings(ctx: Context, use: cst.Name) -> List[tuple]:
    """How the plain name `use` gets its values in its scope: (value, how) pairs, where how is
    "=" (the value itself), "unpack" (an element of the value), "for" (an element of the
    iterable value), "?" (unknown); a parameter is (`_PARAM`, its `cst.Param`). Module-level
    bindings count for a name a function never binds."""
    own = _comprehension_binding(ctx, use)
    if own is not None:
        return [own]
    scope = ctx.scope_of(use)
    found = _scope_bindings(ctx, use.value, scope)
    if not found and not isinstance(scope, cst.Module):
        found = _scope_bindings(ctx, use.value, ctx.module)
    return found


_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)


def _comprehension_binding(ctx: Context, use: cst.Name) -> Optional[tuple]:
    """(iterable, "for") where `use` reads the variable of a comprehension around it (`[x.cuda()
    for x in batch]`): a scope of its own, whatever else the function binds to `x` (`[x.train()
    for x in (net, head)]` elsewhere)."""
    for anc in ctx.ancestors(use):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda, cst.BaseStatement)):
            return None
        if isinstance(anc, _COMPREHENSIONS):
            comp: Optional[cst.CompFor] = anc.for_in
            while comp is not None:
                if any(n.value == use.value for n in ctx.within(comp.target, cst.Name)):
                    if isinstance(comp.target, cst.Name):
                        return comp.iter, "for"
                    return None  # unpacked (`for k, v in d.items()`): not known here
                comp = comp.inner_for_in
    return None


def _scope_bindings(ctx: Context, name: str, scope: cst.CSTNode) -> List[tuple]:
    """The bindings of `name` in `scope`. Every binding of the name is read once, by scope (a
    common name such as `x` is bound in hundreds of functions of a long file)."""
    cache: Dict[str, Dict[int, List[tuple]]] = ctx.facts.setdefault("tm_bindings", {})  # type: ignore[assignment]
    by_scope = cache.get(name)
    if by_scope is None:
        by_scope = cache[name] = {}
        for n in ctx.named(name):
            binding = _binding(ctx, n)
            if binding is not None:
                by_scope.setdefault(id(ctx.scope_of(n)), []).append(binding)
    return by_scope.get(id(scope), [])


def _binding(ctx: Context, n: cst.CSTNode) -> Optional[tuple]:
    """(value, how) when the name or attribute `n` is bound here, else None."""
    child, parent = n, ctx.parent(n)
    how = "="
    path = []
    while isinstance(parent, (cst.Element, cst.StarredElement, cst.Tuple, cst.List)):
        how = "unpack"
        if isinstance(parent, (cst.Tuple, cst.List)):
            path.append(next((i for i, e in enumerate(parent.elements) if e is child), -1))
        child, parent = parent, ctx.parent(parent)
    if isinstance(parent, cst.AssignTarget):
        value = ctx.parent(parent).value  # type: ignore[union-attr]
        # `x, y = a, b`: x is bound to a
        if len(path) == 1 and isinstance(value, (cst.Tuple, cst.List)) and len(value.elements) == len(child.elements) \
                and not any(isinstance(e, cst.StarredElement) for e in value.elements):
            return value.elements[path[0]].value, "="
        return value, how
    if isinstance(parent, cst.AnnAssign) and parent.target is child:
        return (parent.value, how) if parent.value is not None else None
    if isinstance(parent, (cst.For, cst.CompFor)) and parent.target is child:
        return parent.iter, "for"
    if isinstance(parent, cst.Param) and parent.name is n:
        return _PARAM, parent
    if isinstance(parent, cst.NamedExpr) and parent.target is n:
        return parent.value, "="
    if isinstance(parent, cst.AsName) and parent.name is child:
        return None, "?"  # `with ... as x`, `except ... as x`
    return None  # a use, or `x += y` (which keeps what x is)


class _Kinds:
    """Works out the kind of one expression (see `kind_of`); `_IN_PROGRESS` passes through."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def k(self, node: cst.BaseExpression) -> Optional[str]:
        return _kind(self.ctx, node)

    def of(self, node: cst.BaseExpression) -> Optional[str]:
        tp = type(node)
        if tp is cst.Call:
            return self.call(node)  # type: ignore[arg-type]
        if tp is cst.Name:
            return self.name(node)  # type: ignore[arg-type]
        if tp is cst.Attribute:
            return self.attribute(node)  # type: ignore[arg-type]
        if tp is cst.Subscript:
            if self.batch_element(node.value):  # type: ignore[attr-defined]
                return TENSOR
            base = self.k(node.value)  # type: ignore[attr-defined]
            return base if base in (TENSOR, _IN_PROGRESS) else None
        if tp is cst.BinaryOperation:
            sides = (self.k(node.left), self.k(node.right))  # type: ignore[attr-defined]
            return TENSOR if TENSOR in sides else (_IN_PROGRESS if _IN_PROGRESS in sides else None)
        if tp is cst.Comparison:  # `(noise > 0)`: a mask
            sides = (self.k(node.left), *(self.k(c.comparator) for c in node.comparisons))  # type: ignore[attr-defined]
            return TENSOR if TENSOR in sides else (_IN_PROGRESS if _IN_PROGRESS in sides else None)
        if tp is cst.UnaryOperation:
            inner = self.k(node.expression)  # type: ignore[attr-defined]
            return inner if inner in (TENSOR, _IN_PROGRESS) else None
        if tp is cst.IfExp:
            return _join((self.k(node.body), self.k(node.orelse)))  # type: ignore[attr-defined]
        return None

    def call(self, call: cst.Call) -> Optional[str]:
        ctx = self.ctx
        spelled = dotted(call.func)
        if spelled is not None and (spelled in ctx.program.class_kinds or spelled in analysis.facts(ctx).classes):
            return class_kind(ctx, spelled)  # a class of the program, also imported from its module
        name = ctx.resolve(call.func)
        if name is not None:
            if name == "copy.deepcopy" and call.args:
                return self.k(call.args[0].value)
            return library_call_kind(name)
        func = call.func
        if isinstance(func, cst.Name) and func.value == "next" and call.args \
                and is_batch_source(ctx, call.args[0].value):
            return TENSOR  # `next(iter(loader))`: a batch
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            owner = self.k(func.value)
            if owner == _IN_PROGRESS:
                return _IN_PROGRESS
            if owner == TENSOR:
                return None if method in _TENSOR_NOT_TENSOR else TENSOR
            if owner == MODULE:
                if method in _MODULE_MOVES:
                    return MODULE
                return TENSOR if method == "forward" else None
        if isinstance(func, (cst.Name, cst.Attribute)) and self.k(func) == MODULE:
            return TENSOR  # `model(x)`, `criterion(out, y)`: the forward's output
        return None

    def batch_element(self, node: cst.BaseExpression) -> bool:
        """`node` is (part of) a batch: a name bound only by loops over a data loader (or
        `next(iter(loader))`)."""
        while isinstance(node, cst.Subscript) or isinstance(node, cst.Attribute) and dotted(node.value) != "self":
            node = node.value
        if not isinstance(node, cst.Name):
            return False
        bindings = _bindings(self.ctx, node)
        return bool(bindings) and all(
            how == "for" and is_batch_source(self.ctx, value)
            or how in ("=", "unpack") and isinstance(value, cst.Call) and isinstance(value.func, cst.Name)
            and value.func.value == "next" and bool(value.args) and is_batch_source(self.ctx, value.args[0].value)
            for value, how in bindings)

    def name(self, node: cst.Name) -> Optional[str]:
        ctx = self.ctx
        if node.value in ("self", "cls", "True", "False", "None") or ctx.resolve(node) is not None:
            return None  # an import, a constant
        if self.batch_element(node) or self._batch_here(node):
            return TENSOR
        kinds = [self.binding_kind(value, how) for value, how in _bindings(ctx, node)]
        found = _join(kinds) if kinds and None not in kinds else None
        if found is None or found == _IN_PROGRESS:
            used = self.used_as(node)
            if used is not None:
                return used
        return found

    def _batch_here(self, node: cst.Name) -> bool:
        """`node` reads what the innermost loop over a data loader that binds it gave, rebound
        nowhere in that loop before it (`for x, fx, y in test_loader: x, fx, y = x.cuda(), ...`),
        whatever else the name holds elsewhere in its function (`x = np.linspace(0, 1, s)` above
        the loop)."""
        ctx = self.ctx
        where = ctx.position(node)
        if where is None:
            return False
        for loop in ctx.ancestors(node):
            if isinstance(loop, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return False
            if not isinstance(loop, cst.For) or not any(
                    n.value == node.value for n in ctx.within(loop.target, cst.Name)):
                continue
            if not is_batch_source(ctx, loop.iter):
                return False
            # source order: what lies between the body's start and the read lies inside the body
            start = ctx.position(loop.body) or 0
            return not any(start <= (ctx.position(n) or 0) < where and _binding(ctx, n) is not None
                           and ctx.statement_of(n) is not ctx.statement_of(node)
                           for n in ctx.named(node.value) if n is not node)
        return False

    def binding_kind(self, value, how) -> Optional[str]:
        if value is _PARAM:
            return self.param_kind(how)
        if value is None or how == "?":
            return None
        if how == "for":
            if is_batch_source(self.ctx, value):
                return TENSOR
            if isinstance(value, (cst.List, cst.Tuple)):
                return _join(self.k(e.value) for e in value.elements) if value.elements else None
            inner = self.k(value)
            return inner if inner in (TENSOR, _IN_PROGRESS) else None
        kind = self.k(value)
        if how == "unpack":
            if isinstance(value, (cst.Tuple, cst.List)):
                return _join(self.k(e.value) for e in value.elements) if value.elements else None
            return kind if kind in (TENSOR, _IN_PROGRESS) else None
        return kind

    def param_kind(self, param: cst.Param) -> Optional[str]:
        ctx = self.ctx
        if param.annotation is not None:
            kind = annotation_kind(ctx, param.annotation.annotation)
            if kind is not None:
                return kind
        func = ctx.enclosing(param, cst.FunctionDef)
        if func is not None:
            klass = ctx.enclosing(func, cst.ClassDef)
            qual = f"{klass.name.value}.{func.name.value}" if klass is not None else func.name.value
            if param.name.value in ctx.program.wrapped_params.get(qual, ()):
                return MODULE
            return ctx.program.param_kinds.get(qual, {}).get(param.name.value)
        return None

    def attribute(self, node: cst.Attribute) -> Optional[str]:
        ctx = self.ctx
        if ctx.resolve(node) is not None:
            return None
        if dotted(node.value) == "self":
            return self.self_attribute(node)
        if self.batch_element(node):
            return TENSOR  # `batch.text`, `data.x`
        owner = self.k(node.value)
        if owner == TENSOR and node.attr.value in ("data", "grad", "T", "mT", "real", "imag"):
            return TENSOR
        return _IN_PROGRESS if owner == _IN_PROGRESS else None

    def self_attribute(self, node: cst.Attribute) -> Optional[str]:
        """`self.x`: what every `self.x = ...` in the methods of its class binds."""
        ctx = self.ctx
        klass = ctx.enclosing(node, cst.ClassDef)
        if klass is None:
            return None
        attr = node.attr.value
        if attr in ctx.program.wrapped_attrs.get(klass.name.value, ()):
            return MODULE
        kinds = []
        for n in ctx.named(attr):
            up = ctx.parent(n)
            if not (isinstance(up, cst.Attribute) and up.attr is n and dotted(up.value) == "self"
                    and ctx.enclosing(up, cst.ClassDef) is klass):
                continue
            binding = _binding(ctx, up)
            if binding is not None:
                kinds.append(self.binding_kind(*binding))
        if not kinds or None in kinds:
            return None
        return _join(kinds)

    def used_as(self, node: cst.Name) -> Optional[str]:
        """What the uses of the name in its scope say it is (parameters taken from it: a module;
        tensor-only attributes: a tensor), when they say one thing."""
        ctx = self.ctx
        scope = ctx.scope_of(node)
        if node.value in analysis.trained_models(ctx):
            return MODULE
        seen: Set[str] = set()
        for n in ctx.named(node.value):
            if ctx.scope_of(n) is not scope:
                continue
            up = ctx.parent(n)
            if not (isinstance(up, cst.Attribute) and up.value is n):
                continue
            attr = up.attr.value
            call = ctx.parent(up)
            called = isinstance(call, cst.Call) and call.func is up
            if called and attr in _MODULE_ONLY:
                seen.add(MODULE)
            elif attr in _TENSOR_ONLY_ATTRS and not called or called and attr in _TENSOR_ONLY_METHODS:
                seen.add(TENSOR)
        return seen.pop() if len(seen) == 1 else None


_WRAPS = ("DataParallel", "DistributedDataParallel", "wrap_model", "convert_sync_batchnorm", "sync_batchnorm")


def result_kind(ctx: Context, call: cst.Call) -> Optional[str]:
    """What the value of `call` (a move, `X(...).cuda()`) is known to be from where it goes:
    the module a wrapper takes (`DDP(build(args).cuda())`), or a name the module uses as a
    module or tensor (`model = build(args).cuda()`, then `model.parameters()`)."""
    parent = ctx.parent(call)
    if isinstance(parent, cst.Arg) and parent.keyword is None:
        outer = ctx.parent(parent)
        if isinstance(outer, cst.Call) and outer.args and outer.args[0] is parent \
                and (ctx.resolve(outer.func) or dotted(outer.func) or "").rsplit(".", 1)[-1] in _WRAPS:
            return MODULE
        return None
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        return kind_of(ctx, parent.targets[0].target)
    return None


def made_by(ctx: Context, node: cst.BaseExpression, depth: int = 0) -> Optional[str]:
    """The program's class (as this module spells it) that every binding of `node` makes:
    `opt = ScheduledOptim(...)`, `self.optimizer = NoamOpt(...)`, a parameter annotated with it.
    None when the bindings do not agree or are not calls of one of the program's classes."""
    if depth > 4:
        return None
    if isinstance(node, cst.Call):
        spelled = dotted(node.func)
        return spelled if spelled is not None and class_kind(ctx, spelled) is not None else None
    values: List[Optional[str]] = []
    if isinstance(node, cst.Name):
        for value, how in _bindings(ctx, node):
            if value is _PARAM:
                annotation = how.annotation
                values.append(dotted(annotation.annotation) if annotation is not None else None)
            else:
                values.append(made_by(ctx, value, depth + 1) if how == "=" and value is not None else None)
    elif isinstance(node, cst.Attribute) and dotted(node.value) == "self":
        klass = ctx.enclosing(node, cst.ClassDef)
        for n in ctx.named(node.attr.value):
            up = ctx.parent(n)
            if isinstance(up, cst.Attribute) and up.attr is n and dotted(up.value) == "self" \
                    and ctx.enclosing(up, cst.ClassDef) is klass:
                binding = _binding(ctx, up)
                if binding is not None:
                    value, how = binding
                    values.append(made_by(ctx, value, depth + 1) if how == "=" and value is not None else None)
    if not values or None in values or len(set(values)) != 1:
        return None
    return values[0]


def optimizer_wrapper_of(ctx: Context, node: cst.BaseExpression) -> Optional[OptimizerWrapper]:
    """The program's optimizer wrapper (`classes.OptimizerWrapper`) that `node` holds: an
    instance made here (`opt = NoamOpt(...)`), or a parameter (or the `self.` attribute storing
    one) that every call in the program passes one."""
    made = made_by(ctx, node)
    if made is not None:
        known = ctx.program.optimizer_wrappers.get(made)
        klass = analysis.facts(ctx).classes.get(made)
        if known is None and klass is not None and class_kind(ctx, made) == OTHER:
            tree = ast.parse(textwrap.dedent(ctx.module.code_for_node(klass)))  # a file alone
            known = optimizer_wrapper(tree.body[0])  # type: ignore[arg-type]
        return known
    param = _param_behind(ctx, node)
    if param is None:
        return None
    func = ctx.enclosing(param, cst.FunctionDef)
    klass = ctx.enclosing(func, cst.ClassDef) if func is not None else None
    qual = f"{klass.name.value}.{func.name.value}" if klass is not None else func.name.value if func else ""
    return ctx.program.param_wrappers.get(qual, {}).get(param.name.value)


def _param_behind(ctx: Context, node: cst.BaseExpression) -> Optional[cst.Param]:
    """The parameter `node` is bound to and nothing else: a parameter name, or a `self.x` that
    its class only ever assigns from one parameter (`self.opt = opt` in `__init__`)."""
    values: List[tuple] = []
    if isinstance(node, cst.Name):
        values = _bindings(ctx, node)
    elif isinstance(node, cst.Attribute) and dotted(node.value) == "self":
        klass = ctx.enclosing(node, cst.ClassDef)
        for n in ctx.named(node.attr.value):
            up = ctx.parent(n)
            if isinstance(up, cst.Attribute) and up.attr is n and dotted(up.value) == "self" \
                    and ctx.enclosing(up, cst.ClassDef) is klass:
                binding = _binding(ctx, up)
                if binding is not None:
                    values.append(binding)
        if len(values) == 1 and values[0][1] == "=" and isinstance(values[0][0], cst.Name):
            values = _bindings(ctx, values[0][0])
        else:
            return None
    if len(values) == 1 and values[0][0] is _PARAM:
        return values[0][1]
    return None

"""What a loop over a data loader leaves behind for the code after it. Facts only, no rule code.

A value computed from a loader's batches reaches the rest of the program only through:

- a name that the loop binds and that the code after it reads (`correct += ...`, `last = out`,
  the loop variable itself, `i` of `enumerate(loader)`);
- an object that outlives the loop and that the loop changes: a list it appends to
  (`preds.append(out)`), an attribute or item it stores (`self.best = ...`, `stats[k] += v`), a
  method it calls for the method's effect (`meter.update(v, n)`, `metric.add_batch(out, y)`,
  `writer.add_scalar(...)`), an object of unknown kind it calls (`metric(out, y)` on a stateful
  metric), or a function that may keep or write what it is handed (`save_image(out, path)`);
- leaving the loop early (`return`, `yield`, `break`), which ends it at a point that depends on
  the batches.

`loop_effects(ctx, loop)` lists them. What does not count: calls of torch, numpy, math and the
built-ins (except those that write files or communicate), methods of the values the loop itself
computes (`out.argmax(1)`, `loss.item()`), forwards of a model (one the module trains, one
handed over where the program wraps it, or a parameter a caller of this file hands a trained
model) and of a loss (`criterion(out, y)`, an object built from torch), helpers whose result
is used and that are handed only the loop's own values (`acc = accuracy(out, y)`), printing
and progress-bar display. The data plan decides from these facts (and from the metric facts,
which say whether one reduction after the loop makes a sum right) whether an evaluation
loader may be sharded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.collectives import is_collective
from torchmigrate.program.loaders import bind_params
from torchmigrate.program.metrics import binding_of, is_load, source_index
from torchmigrate.program.scopes import scope_of
from torchmigrate.program.syntax import local_calls, root_name
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code

if TYPE_CHECKING:
    from torchmigrate.rule import Context

# Libraries whose calls compute values and keep nothing (their writers are listed below).
_PURE_LIBRARIES = ("torch.", "numpy.", "math.", "statistics.", "operator.", "functools.", "itertools.",
                   "einops.", "torchvision.transforms.", "torchmigrate.runtime.")
_WRITERS = ("save", "savez", "savez_compressed", "save_npz", "savetxt", "tofile", "dump", "write", "imwrite", "imsave",
            "save_image", "write_video", "write_png", "write_jpeg")
_BUILTINS = frozenset({"len", "float", "int", "bool", "str", "max", "min", "sum", "abs", "round", "range",
                       "enumerate", "zip", "list", "tuple", "dict", "set", "sorted", "isinstance", "print",
                       "any", "all", "getattr", "hasattr", "iter", "next", "map", "filter", "reversed", "type",
                       "divmod", "pow", "repr", "format", "id", "hash", "slice"})
# Methods that only change how a model runs or where it lives, and progress-bar display.
_MODE_METHODS = frozenset({"eval", "train", "to", "cuda", "cpu", "float", "half", "double", "requires_grad_"})
_DISPLAY_METHODS = frozenset({"set_description", "set_description_str", "set_postfix", "set_postfix_str",
                              "refresh", "write"})
# Names of objects that keep what they are handed (`metric(out, y)` accumulates).
_STATEFUL = re.compile(r"(?i)metric|meter|evaluat|score|acc|confusion|track|count|stat|logger|writer|record|"
                       r"monitor|histor|saver|summar|cache|buffer|memory|bank|queue")
# Libraries whose callables, built here, are models or losses.
_MODEL_LIBRARIES = ("torch.", "torchvision.", "timm.", "transformers.", "torchaudio.", "segmentation_models_pytorch.")


@dataclass
class LoopEffects:
    """What a loop over a loader leaves for the code after it (see the module docstring)."""

    # names the loop binds that are read after it (before they are rebound) -> the first such read
    bound: Dict[str, cst.Name] = field(default_factory=dict)
    # lists that outlive the loop and that it appends to (`.append`) -> its first append
    appended: Dict[str, cst.Call] = field(default_factory=dict)
    # anything else that may carry per-batch values out of the loop: (node, what it is)
    kept: List[Tuple[cst.CSTNode, str]] = field(default_factory=list)
    leaves_early: Optional[cst.CSTNode] = None  # a return, yield or break of the loop


def loop_effects(ctx: Context, loop: cst.For) -> LoopEffects:
    """What `loop` leaves behind (computed once per loop)."""
    cache: Dict[cst.CSTNode, LoopEffects] = ctx.facts.setdefault("tm_loop_effects", {})  # type: ignore[assignment]
    found = cache.get(loop)
    if found is None:
        found = cache[loop] = _Effects(ctx, loop).compute()
    return found


class _Effects:
    def __init__(self, ctx: Context, loop: cst.For) -> None:
        self.ctx = ctx
        self.loop = loop
        self.fn = ctx.enclosing(loop, cst.FunctionDef)
        self.local = self._local_names()

    def compute(self) -> LoopEffects:
        ctx, loop = self.ctx, self.loop
        out = LoopEffects()
        early = ctx.within(loop.body, cst.Return, cst.Yield, skip_defs=True) + [
            b for b in ctx.within(loop.body, cst.Break, skip_defs=True) if self._breaks_this_loop(b)]
        out.leaves_early = min(early, key=ctx.position) if early else None
        for name in sorted(self.local, key=lambda n: _first_position(ctx, loop, n)):
            read = self._read_after(name)
            if read is not None:
                out.bound[name] = read
        for node in ctx.within(loop, cst.Assign, cst.AugAssign, cst.AnnAssign, skip_defs=True):
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            for target in targets:
                for store in _stores(target):
                    root = root_name(store)
                    if root is not None and root.split(".")[0] not in self.local:
                        out.kept.append((store, f"`{code(store)}` is stored"))
        resolved = source_index(ctx).resolved
        for call in ctx.within(loop, cst.Call, skip_defs=True):
            what = self._call(call, resolved.get(id(call)))
            if what == "append":
                out.appended.setdefault(dotted(call.func.value), call)  # type: ignore[attr-defined]
            elif what:
                out.kept.append((call, what))
        return out

    def _local_names(self) -> Set[str]:
        """Plain names bound inside the loop (its target included), comprehension variables too."""
        out: Set[str] = set()
        for node in self.ctx.within(self.loop, cst.Assign, cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor,
                                    cst.AsName, cst.NamedExpr, skip_defs=True):
            if isinstance(node, cst.Assign):
                targets = [t.target for t in node.targets]
            elif isinstance(node, cst.AsName):
                targets = [node.name]
            else:
                targets = [node.target]
            for target in targets:
                out.update(_plain_names(target))
        return out

    def _read_after(self, name: str) -> Optional[cst.Name]:
        """The first read of `name` after the loop, in its scope, before a statement rebinds it
        (a read in that statement counts: `x = x / n`; a loop that rebinds it as its own
        variable ends the search there)."""
        ctx = self.ctx
        index = source_index(ctx)
        start = index.end[self.loop]
        scope = scope_of(ctx, self.loop)
        stop = None
        for order, node in index.names(name):
            if order <= start or (stop is not None and order > stop):
                continue
            if scope_of(ctx, node) is not scope or not is_load(ctx, node):
                continue
            binding = binding_of(ctx, node)
            if binding is None or isinstance(binding, cst.AugAssign):
                return node
            if stop is None:
                stop = order if isinstance(binding, cst.For) else index.end.get(binding, order)
        return None

    def _breaks_this_loop(self, node: cst.Break) -> bool:
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.For, cst.While)):
                return anc is self.loop
        return False

    def _call(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """"append" for an append to a list that outlives the loop; a description of the call
        when it may keep or write per-batch values; None when it only computes."""
        func = call.func
        label = code(func)
        if name is not None:
            last = name.rsplit(".", 1)[-1]
            if is_collective(name):
                return f"`{label}(...)` communicates"
            if last in _WRITERS or last.startswith(("save", "write")):
                return f"`{label}(...)` writes"
            if name.startswith(_PURE_LIBRARIES) or name in _BUILTINS or name.startswith("tqdm."):
                return None
            return f"`{label}(...)` (a library call) may keep what it is handed"
        if isinstance(func, cst.Name):
            if func.value in _BUILTINS:
                return None
            if func.value in self.local or self._runs_forward(func.value):
                return None
            if self._helper(func.value) and self._result_used(call) and self._handed_own_values(call):
                return None
            return f"`{label}(...)` may keep what it is handed"
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            owner = root_name(func.value)
            if owner is None:
                return None  # a method of a value the loop computes (`model(x).argmax(1)`)
            head = owner.split(".")[0]
            if head in self.local:
                return None
            if method == "append" and isinstance(func.value, cst.Name):
                return "append"  # (what TM703 gathers; `extend`/`insert` it does not)
            if method in _DISPLAY_METHODS:
                return None
            if self._runs_forward(owner) and (method in _MODE_METHODS or self._result_used(call)):
                return None
            if self._helper(owner) and self._result_used(call) and self._handed_own_values(call):
                return None
            return f"`{label}(...)` may keep per-batch values in `{owner}`"
        return None  # `tm.unwrap(model)(x)`, `fns[i](x)`: the inner calls are checked

    def _result_used(self, call: cst.Call) -> bool:
        return not isinstance(self.ctx.parent(call), cst.Expr)

    def _handed_own_values(self, call: cst.Call) -> bool:
        """Every name the call is handed is the loop's own, a model, a number or a constant."""
        for arg in call.args:
            for n in self.ctx.within(arg.value, cst.Name):
                parent = self.ctx.parent(n)
                if isinstance(parent, cst.Attribute) and parent.attr is n:
                    continue
                if n.value in self.local or n.value in ("True", "False", "None") or self._runs_forward(n.value):
                    continue
                return False
        return True

    def _helper(self, name: str) -> bool:
        """A function of this module or of another module of the program (not an object's method)."""
        return name in analysis.facts(self.ctx).functions or name in self.ctx.program.own_functions

    def _runs_forward(self, name: str) -> bool:
        """Calling `name` (or its methods, for their result) runs a model or a loss, which keeps
        nothing of its inputs: the module trains it, the program hands this function's parameter
        a wrapped model, a caller in this file hands it a trained model, it is named as a loss
        (`criterion`, `loss_fn`) or built by torch (`nn.CrossEntropyLoss()`), or, failing those,
        it is a callable whose name and construction do not say it keeps state: not named as a
        metric, meter, evaluator, logger or counter, and not built here from another library's
        class (`torchmetrics.Accuracy()`)."""
        ctx = self.ctx
        root = analysis.model_root(name)
        models = set(analysis.trained_models(ctx))
        if root in models or _loss_named(name):
            return True
        head = root.split(".")[0]
        if self.fn is not None and head == root and head in _params(self.fn):
            if head in ctx.program.wrapped_params.get(_qual(ctx, self.fn), ()):
                return True
            for caller in local_calls(ctx).get(self.fn.name.value, ()):
                method = isinstance(caller.func, cst.Attribute)
                for param, value in bind_params(self.fn, caller, method):
                    owner = root_name(value)
                    if param == head and owner is not None and analysis.model_root(owner) in models:
                        return True
        if _STATEFUL.search(root.rsplit(".", 1)[-1]):
            return False
        for assign in analysis.facts(ctx).assigns:
            if isinstance(assign.value, cst.Call) and any(dotted(t.target) == root for t in assign.targets):
                built = ctx.resolve(assign.value.func)
                if built is not None and not built.startswith(_MODEL_LIBRARIES):
                    return False
        return True


def _loss_named(name: str) -> bool:
    low = name.rsplit(".", 1)[-1].lower()
    return "loss" in low or "crit" in low


def _params(fn: cst.FunctionDef) -> Set[str]:
    p = fn.params
    return {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}


def _qual(ctx: Context, fn: cst.FunctionDef) -> str:
    klass = ctx.enclosing(fn, cst.ClassDef)
    return f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value


def _plain_names(target: cst.CSTNode) -> List[str]:
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _plain_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return _plain_names(target.value)
    return []


def _stores(target: cst.CSTNode) -> List[cst.CSTNode]:
    """The attribute and item targets of an assignment (`self.x`, `d[k]`)."""
    if isinstance(target, (cst.Attribute, cst.Subscript)):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [s for el in target.elements for s in _stores(el.value)]
    if isinstance(target, cst.StarredElement):
        return _stores(target.value)
    return []


def _first_position(ctx: Context, loop: cst.For, name: str) -> int:
    begin, end = ctx.position(loop) or 0, ctx.last_position(loop)
    return min((o for o, _ in source_index(ctx).names(name) if begin <= o <= end), default=0)

"""Facts about a training script that several rules need, collected in the shared walk.

The `Facts` collector is registered ahead of every rule, so by the time any rule's
`leave_Module` runs it has seen the whole module. Derived facts (which expressions are trained
models, where process-group setup goes, whether the file is already distributed) are computed
on first use and cached on the context, so a rule family pays only for what it asks.

Names are resolved with the module's import table (see `imports.py`), never with LibCST's
metadata providers.
"""

from __future__ import annotations

import builtins
import keyword
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import libcst as cst

from torchmigrate.rule import Context, Rule
from torchmigrate.program import open_modes as open_modes_lib
from torchmigrate.syntax.imports import dotted, leading_import_anchor

# Calls that write a file as a statement of their own (resolved names): TM504 puts them on the
# main process, TM505 recognises the caches a program builds with them on first use.
FILE_WRITERS = frozenset({
    "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt",
    "matplotlib.pyplot.savefig", "imageio.imwrite", "imageio.imsave", "imageio.v2.imwrite",
    "imageio.v3.imwrite", "cv2.imwrite", "scipy.io.savemat", "scipy.io.wavfile.write", "scipy.sparse.save_npz",
    "soundfile.write", "torchaudio.save", "pickle.dump", "joblib.dump",
    "skimage.io.imsave", "matplotlib.pyplot.imsave", "matplotlib.image.imsave", "imageio.v2.imsave",
    "scipy.misc.imsave", "tifffile.imwrite", "tifffile.imsave", "nibabel.save", "SimpleITK.WriteImage",
})
# Methods that write a file whatever object has them (a figure, a DataFrame, a pathlib.Path).
FILE_WRITER_METHODS = frozenset({"savefig", "to_csv", "to_parquet", "to_pickle", "to_excel", "to_feather",
                                 "write_text", "write_bytes"})


def leading_text(node: cst.BaseExpression) -> Optional[str]:
    """The literal text an expression's string starts with: a string, the first part of an
    f-string or of a `+` chain, the first item of a list of words (`["cp", src, dst]`)."""
    while True:
        if isinstance(node, cst.SimpleString):
            value = node.evaluated_value
            return value if isinstance(value, str) else None
        if isinstance(node, cst.FormattedString):
            first = node.parts[0] if node.parts else None
            return first.value if isinstance(first, cst.FormattedStringText) else None
        if isinstance(node, cst.ConcatenatedString):
            node = node.left
        elif isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Modulo)):
            node = node.left
        elif isinstance(node, (cst.List, cst.Tuple)) and node.elements:
            node = node.elements[0].value
        else:
            return None


def opens_for_writing(call: cst.Call, names: Optional[Dict[str, str]] = None) -> bool:
    """`open(path, mode)` with a mode that writes: a literal, a conditional of literals, or a
    variable only ever given literals (`names`: `open_modes(ctx)`)."""
    return open_modes_lib.writes(open_mode(call, names))


def _own_open_mode(call: cst.Call) -> Optional[cst.SimpleString]:
    """The mode of a path's own `p.open("wb")` (its first argument, a short literal), else None:
    `gzip.open("a.gz")` names a file, not a mode."""
    if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "open" and call.args
            and call.args[0].keyword is None and isinstance(call.args[0].value, cst.SimpleString)):
        return None
    first = call.args[0].value.evaluated_value
    return call.args[0].value if isinstance(first, str) and len(first) <= 3 else None


def open_mode(call: cst.Call, names: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The mode of an `open`-like call: the second argument of `open(path, mode)` (also
    `gzip.open`, `io.open`, ...), the first of a path's `p.open(mode)`, or `mode=`; a literal, or
    every character a conditional of literals or a variable of `names` may hold."""
    mode = _own_open_mode(call)
    if mode is None and len(call.args) >= 2 and call.args[1].keyword is None:
        mode = call.args[1].value
    for a in call.args:
        if a.keyword is not None and a.keyword.value == "mode":
            mode = a.value
    return open_modes_lib.mode_of_cst(mode, names)


def open_modes(ctx: Context) -> Dict[str, str]:
    """The module's variables that only ever hold open modes (`open_type = "a" if ... else "w"`)."""
    return _cached(ctx, "open_modes", lambda: open_modes_lib.mode_names_cst(ctx.nodes(cst.Assign), ctx.nodes(cst.With)))


def opened_path(call: cst.Call) -> Optional[cst.BaseExpression]:
    """The path an `open`-like call opens: `p` of `p.open("w")`, else the first argument."""
    if _own_open_mode(call) is not None:
        return call.func.value  # type: ignore[attr-defined]
    return call.args[0].value if call.args and call.args[0].keyword is None else None


def opens_file_for_writing(call: cst.Call, name: Optional[str], names: Optional[Dict[str, str]] = None) -> bool:
    """A file opened for writing: `open(path, "w")`, `gzip.open(path, "wb")` (any module's
    `open`), or a path's own `p.open("wb")` (`pathlib`), not `PIL.Image.open` (`names`: the
    module's mode variables, `open_modes`)."""
    func = dotted(call.func) or ""
    if not (func == "open" or func.endswith(".open")) or (name or "") == "PIL.Image.open":
        return False
    return opens_for_writing(call, names)


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
    # For a call to a same-file helper or method that builds the optimizer from a parameter
    # (`optimizer = build_optimizer(model, cfg)`, `opt = model.configure_optimizers()`): the
    # optimizer inside it. `call` is then the helper call and `models` the caller's names.
    via: Optional["Optimizer"] = None
    # A call of a function that builds the optimizer (`get_optimizer(config, model)`), not the
    # optimizer's constructor: its first argument is no parameter list.
    builder: bool = False
    # A call that makes a model which builds its own optimizer over `self.parameters()`
    # (`model = SessionGraph(opt, n)`, `ModuleView.self_trained`): `models` is the name it is
    # bound to, wrapped right after the call.
    made: bool = False
    # A call of another module's function that steps the model's parameters by hand, building
    # no optimizer (`ModuleView.hand_steppers`): nothing is rebuilt on each call.
    by_hand: bool = False


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

    def leave_Module(self, node: cst.Module) -> None:
        # Runs before every rule's leave_Module (the collector is registered first).
        self.ctx.walked = True

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
    qualified prefix ending in '.'), in source order."""
    if ctx.walked:
        by_name = _cached(ctx, "calls_by_name", lambda: _calls_by_name(facts(ctx)))
    else:  # asked during the walk: the calls seen so far, not kept
        by_name = _calls_by_name(facts(ctx))
    lists = []
    for q in qualified:
        if q.endswith("."):
            lists.extend(found for name, found in by_name.items() if name.startswith(q))
        elif q in by_name:
            lists.append(by_name[q])
    spots = lists[0] if len(lists) == 1 else sorted({i for found in lists for i in found})
    calls = facts(ctx).calls
    return [calls[i][0] for i in spots]


def _calls_by_name(f: Facts) -> Dict[str, List[int]]:
    """Resolved name -> indexes of its calls in `Facts.calls` (a file calls a few hundred
    distinct names; rules ask `calls_to` thousands of times)."""
    out: Dict[str, List[int]] = {}
    for i, (_call, name) in enumerate(f.calls):
        if name:
            out.setdefault(name, []).append(i)
    return out


def is_distributed(ctx: Context) -> bool:
    """The file already sets up or uses torch.distributed / DDP / the runtime. In a migration, a
    DistributedSampler built only behind the program's own flag (`DistributedSampler(ds) if
    args.ngpu > 1 else None`, `if args.distributed: sampler = ...`) does not count: that flag is
    off in the run being migrated, so the file shards nothing and places nothing by rank."""
    def markers() -> bool:
        calls = calls_to(ctx, *DISTRIBUTED_MARKERS)
        if ctx.options.migrating:
            calls = [c for c in calls if not _flagged_sampler(ctx, c)]
        return bool(calls)

    return _cached(ctx, "is_distributed", markers)


_SAMPLERS = frozenset({"torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler"})


def _flagged_sampler(ctx: Context, call: cst.Call) -> bool:
    """A DistributedSampler built in a branch of a conditional expression or under an `if` of its
    function (not the `if __name__ == "__main__":` guard)."""
    if ctx.resolve(call.func) not in _SAMPLERS:
        return False
    node: cst.CSTNode = call
    while True:
        parent = ctx.parent(node)
        if parent is None or isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Module)):
            return False
        if isinstance(parent, cst.IfExp) and node is not parent.test:
            return True
        if isinstance(parent, (cst.If, cst.Else)) and node is not getattr(parent, "test", None) \
                and not _main_guard(parent):
            return True
        node = parent


def _main_guard(node: cst.CSTNode) -> bool:
    test = getattr(node, "test", None)
    return isinstance(test, cst.Comparison) and "__name__" in cst.Module(body=[]).code_for_node(test)


# --- optimizers and trained models ---------------------------------------------------------

def _is_optimizer(name: Optional[str], call: cst.Call) -> bool:
    if name:
        if name.startswith(_OPTIMIZER_MODULES):
            return not any(x in name + "." for x in _NOT_OPTIMIZERS) and name.rsplit(".", 1)[1][:1].isupper()
        if name.rsplit(".", 1)[-1] in _OPTIMIZER_NAMES and name.startswith(("transformers.", "torch_optimizer.")):
            return True
    func = call.func
    last = func.value if type(func) is cst.Name else func.attr.value if type(func) is cst.Attribute else ""
    return _foreign_optimizer(last, call)


# Optimizer classes of other libraries or of the script itself (pytorch_pretrained_bert's
# `BertAdam`, LAMB and LARS ports, `Lion`): an optimizer-like class name *and* a model's
# parameters as the first argument.
_OPTIMIZER_CLASS = re.compile(r"(?:Adam|SGD|RMSprop|Adagrad|Adadelta|Adamax|Lamb|LAMB|Lars|LARS|Adafactor|Lion|"
                              r"Ranger|NovoGrad|Novograd|Yogi|Sophia|Adan|Prodigy)[A-Za-z0-9]*$|Optimizer$")


def _foreign_optimizer(last: str, call: cst.Call) -> bool:
    if not last[:1].isupper() or not _OPTIMIZER_CLASS.search(last) or any(x in last for x in _NOT_OPTIMIZER_CALLS):
        return False
    params = _params_arg(call)
    return params is not None and bool(parameter_owners(params))


def model_root(expression: str) -> str:
    """`self.model.head` -> `self.model`; `model.backbone` -> `model`."""
    parts = expression.split(".")
    if parts[0] in ("self", "cls") and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def parameter_owners(node: cst.CSTNode) -> List[str]:
    """Dotted roots X of every `X.parameters()` / `X.named_parameters()` inside `node`."""
    found: List[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value in (
                "parameters", "named_parameters"):
            owner = dotted(n.func.value)
            if owner:
                root = model_root(owner)
                if root not in found:
                    found.append(root)
        stack.extend(reversed(n.children))
    return found


def container_owners(ctx: Context, node: cst.CSTNode) -> List[str]:
    """`parameter_owners`, where a receiver that is a member of a container or a loop's target
    is the container's models: `nets[k].parameters()` -> `nets`; `net.parameters()` in
    `for net in nets.values()` or `[p for m in models for p in m.parameters()]` -> `nets`,
    `models`; over a literal, `for m in (encoder, decoder)` -> `encoder`, `decoder`. The wrap
    then goes on what the program holds (`tm.wrap_model` wraps a container's modules in place)."""
    found: List[str] = []

    def add(owner: Optional[str]) -> None:
        if owner and model_root(owner) not in found:
            found.append(model_root(owner))

    for call in ctx.within(node, cst.Call):
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value in ("parameters", "named_parameters")):
            continue
        receiver = func.value
        while isinstance(receiver, cst.Subscript):
            receiver = receiver.value
        owner = dotted(receiver)
        loop_iter = loop_binding(ctx, call, owner) if owner and "." not in owner else None
        if loop_iter is None:
            add(owner)
            continue
        if isinstance(loop_iter, (cst.List, cst.Tuple, cst.Set)):
            for element in loop_iter.elements:
                add(dotted(element.value))
            continue
        members = literal_members(ctx, loop_iter, call)
        for member in members or [dotted(loop_iter)]:
            add(member)
    return found


def literal_members(ctx: Context, node: cst.BaseExpression, at: cst.CSTNode) -> List[str]:
    """The models a name holds when its only binding in the scope of `at` is a list or tuple of
    names (`models = [encoder, decoder]`): those are the models the program calls."""
    if not isinstance(node, cst.Name):
        return []
    scope = ctx.scope_of(at)
    values = [a.value for a in facts(ctx).assigns if ctx.scope_of(a) is scope
              and any(isinstance(t.target, cst.Name) and t.target.value == node.value for t in a.targets)]
    if len(values) != 1 or not isinstance(values[0], (cst.List, cst.Tuple)):
        return []
    names = [dotted(e.value) for e in values[0].elements]
    return names if names and all(names) and not any(isinstance(e, cst.StarredElement) for e in values[0].elements) else []


def loop_binding(ctx: Context, node: cst.CSTNode, name: str) -> Optional[cst.BaseExpression]:
    """What the innermost loop or comprehension around `node` (in its function) that binds
    `name` as its plain target iterates: the dict itself for `for net in nets.values()`."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        loops = [anc.for_in] if isinstance(anc, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)) else (
            [anc] if isinstance(anc, cst.For) else [])
        for loop in loops:
            while loop is not None:
                if isinstance(loop.target, cst.Name) and loop.target.value == name:
                    over = loop.iter
                    if isinstance(over, cst.Call) and isinstance(over.func, cst.Attribute) \
                            and over.func.attr.value == "values" and not over.args:
                        return over.func.value
                    return over
                loop = getattr(loop, "inner_for_in", None)
    return None


# `optimizer`, `optimizerD`, `opt_g`, `g_optimizer`, `optim`; not `optim_state_dict`, `opt_level`
_OPTIMIZER_TARGET = re.compile(r"^(?:[a-z]{1,4}_)?(?:optimi[sz]er|optim|opt)(?:_?[a-z0-9]{1,2})?$", re.IGNORECASE)
# `create_optimizer_v2`, `build_optimizer`, `get_optim`, `configure_optimizers`
_OPTIMIZER_FACTORY = re.compile(r"^_?(create|build|get|make|configure|init|setup|new|construct|prepare)_?"
                                r"\w*optim", re.IGNORECASE)
_NOT_OPTIMIZER_CALLS = ("scheduler", "Scheduler", "swa_utils", "AveragedModel", "EMA", "Ema")


def _assign_target(ctx: Context, call: cst.Call) -> Optional[str]:
    # Asked about every call of the file (`optimizers`): exact type tests, as in `dotted`.
    parent = ctx.parents.get(call)
    tp = type(parent)
    if tp is cst.Assign and len(parent.targets) == 1:  # type: ignore[union-attr]
        return dotted(parent.targets[0].target)  # type: ignore[union-attr]
    if (tp is cst.AnnAssign or tp is cst.AugAssign) and parent.value is call:  # type: ignore[union-attr]
        return dotted(parent.target)  # type: ignore[union-attr]
    return None


def _assigned_key(ctx: Context, call: cst.Call) -> Optional[str]:
    """`"optimizer"` for `config["optimizer"] = <call>`: the string key a call is stored under."""
    parent = ctx.parents.get(call)
    if type(parent) is cst.Assign and len(parent.targets) == 1:
        target = parent.targets[0].target
        if isinstance(target, cst.Subscript) and len(target.slice) == 1:
            index = target.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                key = index.value.evaluated_value
                return key if isinstance(key, str) else None
    return None


def _unwrapped_owners(ctx: Context, node: cst.CSTNode) -> List[str]:
    """`m` of `tm.unwrap(m).named_parameters()` (TM302's rewrite of a wrapped model's
    parameters, read on a second run): the model is the one wrapped."""
    found: List[str] = []
    for n in ctx.within(node, cst.Call, skip_defs=True):
        receiver = n.func.value if isinstance(n.func, cst.Attribute) and n.func.attr.value in (
            "parameters", "named_parameters") else None
        if isinstance(receiver, cst.Call) and receiver.args and ctx.resolve(receiver.func) == "torchmigrate.runtime.unwrap":
            owner = dotted(receiver.args[0].value)
            if owner and model_root(owner) not in found:
                found.append(model_root(owner))
    return found


def _picks_parameters(ctx: Context, func: cst.FunctionDef) -> bool:
    """A function of this file that reads a model's parameters (`def decay_groups(model, wd): for n,
    p in model.named_parameters(): ...`), not one that builds the model (`def build_model(config,
    device)`, whose arguments are no model)."""
    return any(isinstance(c.func, cst.Attribute) and c.func.attr.value in ("parameters", "named_parameters")
               for c in ctx.within(func, cst.Call))


def _param_method_owners(ctx: Context, params: cst.BaseExpression) -> List[str]:
    """Models whose parameters come through a method or helper that picks them: `X` for
    `Adam(X.get_params())`, `SGD(self.net.trainable_parameters())`, `Adam(get_parameter_groups(X,
    wd))` or `AdamW(decay_groups(X, wd))` (a function of this file), `Adam(util.get_param_groups(X,
    wd))` (of a module), where `X` may hold a module (`_model_like`)."""
    found: List[str] = []
    own = facts(ctx).functions
    stack = [params]
    while stack:
        n = stack.pop()
        if isinstance(n, cst.Call):
            func = n.func
            method = isinstance(func, cst.Attribute) and (ctx.resolve(func.value) is None or isinstance(func.value, cst.Call))
            label = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
            named = any(w in label.lower() for w in ("param", "group")) and label not in ("parameters", "named_parameters")
            candidates: List[cst.BaseExpression] = []
            if method and named:
                receiver = func.value  # `tm.unwrap(X).get_params()` (TM302's rewrite) is X's too
                if isinstance(receiver, cst.Call) and receiver.args and \
                        ctx.resolve(receiver.func) == "torchmigrate.runtime.unwrap":
                    receiver = receiver.args[0].value
                candidates = [receiver]
            elif (isinstance(func, cst.Name) and (named or label in own and _picks_parameters(ctx, own[label]))) \
                    or (named and not method) or (dotted(func) or "") in ctx.program.parameter_pickers:
                # `get_param_groups(net, wd)`, also a module's `util.get_param_groups(net, wd)`
                candidates = [a.value for a in n.args if not a.star and a.keyword is None]
            for value in candidates:
                if isinstance(value, cst.Call) and value.args and ctx.resolve(value.func) == "torchmigrate.runtime.unwrap":
                    value = value.args[0].value  # `separate_bn_paras(tm.unwrap(model))` (TM302's rewrite)
                owner = dotted(value)
                if owner and _model_like(ctx, owner, value) and model_root(owner) not in found:
                    found.append(model_root(owner))
        stack.extend(reversed(n.children))
    return found


def _params_arg(call: cst.Call) -> Optional[cst.BaseExpression]:
    params = call.args[0] if call.args and call.args[0].keyword is None and not call.args[0].star else None
    if params is None:
        params = next((a for a in call.args if a.keyword and a.keyword.value == "params"), None)
    return params.value if params is not None else None


def is_backward(call: cst.Call) -> bool:
    """`x.backward(...)`: a backward pass (with DDP, the gradient all-reduce)."""
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value == "backward"


NO_GRAD = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad",
                     "torch.autograd.grad_mode.no_grad", "torch.autograd.grad_mode.inference_mode"})


def under_no_grad(ctx: Context, node: cst.CSTNode) -> bool:
    """`node` runs with gradients off: inside `with torch.no_grad():` (or inference_mode) in
    its function, or in a function decorated with one."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.With):
            for item in anc.items:
                i = item.item
                if ctx.resolve(i.func if isinstance(i, cst.Call) else i) in NO_GRAD:
                    return True
        if isinstance(anc, cst.FunctionDef):
            for dec in anc.decorators:
                d = dec.decorator
                if ctx.resolve(d.func if isinstance(d, cst.Call) else d) in NO_GRAD:
                    return True
            return False
    return False


def runs_backward(ctx: Context, node: cst.CSTNode) -> bool:
    """`node` (a function, loop or block) runs a backward pass itself, not in a def inside it."""
    return any(is_backward(c) for c in ctx.within(node, cst.Call, skip_defs=True))


def training_loops(ctx: Context) -> List[cst.CSTNode]:
    """The loops of the module that run a backward pass themselves, not in a loop nested in them
    (the training steps, however they get their batches; an epoch loop around a batch loop is
    not one), in source order; computed once per module."""
    found = ctx.facts.get("tm_training_loops")
    if found is None:
        found = []
        for call in ctx.nodes(cst.Call):
            if is_backward(call):
                loop = ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef)
                if isinstance(loop, (cst.For, cst.While)) and loop not in found:
                    found.append(loop)
        ctx.facts["tm_training_loops"] = found
    return found  # type: ignore[return-value]


def trains_itself(ctx: Context, loop: cst.CSTNode) -> bool:
    """`loop` is one of the module's `training_loops`."""
    return loop in training_loops(ctx)


def _followed_names(node: cst.CSTNode) -> List[str]:
    """`_names_in`, where an attribute of the instance is named whole (`self.log_alpha`, not
    `self`): `Adam([self.log_alpha])` is over that tensor, not over every attribute the method
    assigns (`self.policy = Net()` beside it)."""
    out: List[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        text = dotted(n) if isinstance(n, cst.Attribute) else None
        if text is not None and text.split(".", 1)[0] in ("self", "cls"):
            found = [text]
        elif isinstance(n, (cst.Name, cst.Attribute)):
            found = _names_in(n)
        else:
            if not isinstance(n, cst.Lambda):
                stack.extend(reversed(n.children))
            continue
        out.extend(f for f in found if f not in out)
    return out


def _names_in(node: cst.CSTNode) -> List[str]:
    """Plain names read in an expression (not attribute names, not inside lambdas)."""
    out: List[str] = []

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            if n.value not in out:
                out.append(n.value)
            return
        if isinstance(n, cst.Attribute):
            go(n.value)
            return
        if isinstance(n, cst.Lambda):
            return
        for child in n.children:
            go(child)

    go(node)
    return out


def _assigned_owners(ctx: Context, call: cst.Call) -> List[str]:
    """Models whose parameters an argument of `call` holds, by the assignment of that very name in
    the same scope: `self.params = [p for p in self.model.parameters() if p.requires_grad]` then
    `get_optimizer("sgd", self.params, lr)` (a factory of another module)."""
    wanted = {dotted(a.value) for a in call.args if not a.star and isinstance(a.value, (cst.Name, cst.Attribute))} - {None}
    if not wanted:
        return []
    scope = ctx.scope_of(call)
    klass = ctx.enclosing(call, cst.ClassDef)
    found: List[str] = []
    for assign in facts(ctx).assigns:
        names = {dotted(t.target) for t in assign.targets} & wanted
        if not names:
            continue
        # a `self.` list is the class's, wherever it is kept: `reset()` builds the optimizer again
        # over the `self.parameters` that `__init__` collected
        same = ctx.scope_of(assign) is scope or (klass is not None and ctx.enclosing(assign, cst.ClassDef) is klass
                                                 and all(n.startswith("self.") for n in names))
        if same:
            for owner in parameter_owners(assign.value) or _param_method_owners(ctx, assign.value):
                if owner not in found:
                    found.append(owner)
    return found


def _followed_owners(ctx: Context, call: cst.Call, params: cst.BaseExpression) -> List[str]:
    """Models behind names passed as parameters: `params = [p for p in model.parameters() if
    p.requires_grad]`, `groups = [{"params": decay}, ...]` with `decay.append(p)` (or `params +=
    [{"params": [p]}]`) in a `for n, p in model.named_parameters()` loop, all in the same scope
    (followed a few names deep)."""
    names = set(_followed_names(params))
    if not names:
        return []
    scope = ctx.scope_of(call)
    found: List[str] = []
    seen: set = set()

    def add(owners: List[str]) -> None:
        for o in owners:
            if o not in found:
                found.append(o)

    for _ in range(3):
        new_names: set = set()
        for assign in facts(ctx).assigns:
            if assign in seen or ctx.scope_of(assign) is not scope:
                continue
            if any(n in names for t in assign.targets for n in _followed_names(t.target)):
                seen.add(assign)
                add(container_owners(ctx, assign.value) or _param_method_owners(ctx, assign.value))
                new_names.update(_followed_names(assign.value))
        for aug in ctx.nodes(cst.AugAssign):  # `params += list(net.parameters())` in a loop
            if aug not in seen and isinstance(aug.target, cst.Name) and aug.target.value in names \
                    and ctx.scope_of(aug) is scope:
                seen.add(aug)
                add(container_owners(ctx, aug.value))
                loop = ctx.enclosing(aug, cst.For, cst.FunctionDef)  # `params += [{"params": [v]}]` per parameter
                if isinstance(loop, cst.For):
                    add(container_owners(ctx, loop.iter) or _unwrapped_owners(ctx, loop.iter))
        for other, _ in facts(ctx).calls:
            func = other.func
            if (other not in seen and isinstance(func, cst.Attribute)
                    and func.attr.value in ("append", "extend", "add", "update", "insert")
                    and names.intersection(_followed_names(func.value)) and ctx.scope_of(other) is scope):
                seen.add(other)
                add(container_owners(ctx, other))
                loop = ctx.enclosing(other, cst.For, cst.FunctionDef)
                if isinstance(loop, cst.For):
                    add(container_owners(ctx, loop.iter) or _unwrapped_owners(ctx, loop.iter))
        new_names -= names
        if found or not new_names:
            break
        names |= new_names
    return found


_CONFIG_NAMES = {"args", "opt", "opts", "cfg", "config", "conf", "hparams", "hp", "params", "flags", "FLAGS",
                 "settings", "options", "self", "cls", "kwargs"}


def _factory_models(ctx: Context, call: cst.Call, name: Optional[str], functions) -> List[str]:
    """Models handed to an optimizer factory defined outside this file: the receiver of
    `model.configure_optimizers(...)`, or the model arguments of `create_optimizer(args, model)`."""
    func = call.func
    label = (name or dotted(func) or "").rsplit(".", 1)[-1]
    if not _OPTIMIZER_FACTORY.match(label) or label in functions or (dotted(func) or "") in ctx.program.optimizer_builders:
        return []  # (a builder of another module whose model parameter the program facts know)
    if isinstance(func, cst.Attribute) and ctx.resolve(func.value) is None:
        receiver = dotted(func.value)
        if receiver and _model_like(ctx, receiver, func.value):
            return [model_root(receiver)]
        return []
    out = []
    for a in call.args:
        if a.star or (a.keyword is not None and a.keyword.value not in ("model", "module", "net")):
            continue
        owner = dotted(a.value)
        if owner and "." not in owner and _model_like(ctx, owner, a.value) and owner not in out:
            out.append(owner)
    return out


def is_variable(name: str) -> bool:
    """`model`, `self.net.backbone`: a dotted name that can be assigned to (not `True`, `None`,
    a builtin such as `len`), so a suggestion `name = tm.wrap_model(name)` is code."""
    parts = name.split(".")
    return all(p.isidentifier() and not keyword.iskeyword(p) for p in parts) \
        and (len(parts) > 1 or not hasattr(builtins, parts[0]))


def _model_like(ctx: Context, name: str, node: cst.BaseExpression) -> bool:
    """A variable that may hold a module: not a constant, an import, a config object, a class
    or function of this file, or a list of parameters."""
    if not is_variable(name):
        return False
    root = model_root(name)
    if ctx.resolve(node) is not None or root in _CONFIG_NAMES or root.split(".")[-1] in _CONFIG_NAMES:
        return False
    if root in facts(ctx).classes or root in facts(ctx).functions or root == "self":
        return False
    for assign in facts(ctx).assigns:
        if any(dotted(t.target) == name for t in assign.targets):
            value = assign.value
            if isinstance(value, (cst.List, cst.ListComp, cst.GeneratorExp, cst.Tuple, cst.Dict, cst.DictComp)) \
                    or parameter_owners(value) or _text_value(value):
                return False
    return True


_STR_METHODS = {"split", "rsplit", "lower", "upper", "strip", "lstrip", "rstrip", "replace", "format", "join"}


def _text_value(value: cst.BaseExpression) -> bool:
    """A string, or a piece of one: open_clip's `timm_opt = opt.split("timm/")[-1]`, the name
    handed to `create_optimizer_v2(model, timm_opt)`, is no model."""
    while isinstance(value, cst.Subscript):
        value = value.value
    if isinstance(value, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return True
    return isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in _STR_METHODS


def _function_params(func: cst.FunctionDef) -> Tuple[List[str], List[str]]:
    """(positional-capable parameter names, keyword-only names)."""
    p = func.params
    positional = [x.name.value for x in (*p.posonly_params, *p.params)]
    return positional, [x.name.value for x in p.kwonly_params]


def _fits(call: cst.Call, func: cst.FunctionDef, method: bool) -> bool:
    """`call` can be a call of `func`: it gives every parameter without a default (a star
    argument may give any). `net.train()` is no call of `def train(self, dataset, net)`."""
    if any(a.star for a in call.args):
        return True
    p = func.params
    required = [x.name.value for x in (*p.posonly_params, *p.params) if x.default is None]
    if method and required and required[0] == _function_params(func)[0][0]:
        required = required[1:]
    given = sum(1 for a in call.args if a.keyword is None)
    named = {a.keyword.value for a in call.args if a.keyword is not None}
    return all(i < given or r in named for i, r in enumerate(required)) \
        and all(x.name.value in named for x in p.kwonly_params if x.default is None)


def _call_arg_for(call: cst.Call, func: cst.FunctionDef, param: str, method: bool) -> Optional[cst.BaseExpression]:
    positional, kwonly = _function_params(func)
    if method and positional:
        positional = positional[1:]
    for a in call.args:
        if a.keyword is not None and a.keyword.value == param:
            return a.value
    if param in positional:
        index = positional.index(param)
        plain = []
        for a in call.args:
            if a.star:
                return None
            if a.keyword is None:
                plain.append(a)
        if index < len(plain):
            return plain[index].value
    return None


def _helper_call_sites(ctx: Context, opt: "Optimizer") -> List["Optimizer"]:
    """Calls of the same-file function or method that creates `opt` from one of its parameters
    (a model, a parameter list, or `self.parameters()` in a model's own method), with the
    caller's names for the models."""
    func = ctx.enclosing(opt.call, cst.FunctionDef, cst.Lambda)
    if not isinstance(func, cst.FunctionDef):
        return []
    positional, kwonly = _function_params(func)
    klass = ctx.parent(ctx.parent(func))
    method = isinstance(klass, cst.ClassDef) and bool(positional)
    params = set(positional[1:] if method else positional) | set(kwonly)
    wanted = [m for m in opt.models if m in params]
    self_root = method and positional[0] in opt.models
    params_arg = None if opt.builder else _handed_params(ctx, opt)
    params_name = params_arg.value if isinstance(params_arg, cst.Name) and params_arg.value in params else None
    if not (wanted or self_root or params_name):
        return []
    name = func.name.value
    out = []
    for call, _ in facts(ctx).calls:
        if call is opt.call:
            continue
        f = call.func
        receiver = None
        if method:
            if not (isinstance(f, cst.Attribute) and f.attr.value == name):
                continue
            receiver = dotted(f.value)
            if receiver in ("self", "cls") and ctx.enclosing(call, cst.ClassDef) is not klass:
                continue
        elif not (isinstance(f, cst.Name) and f.value == name):
            continue
        if not _fits(call, func, method):
            continue  # `net.train()` beside `def train(self, dataset, net)`: another function
        models: List[str] = []
        if self_root and receiver not in (None, "self", "cls") and _model_like(ctx, receiver, f.value):
            models.append(model_root(receiver))
        for m in wanted:
            value = _call_arg_for(call, func, m, method)
            owner = dotted(value) if value is not None else None
            if owner is not None and _model_like(ctx, owner, value) and model_root(owner) not in models:
                models.append(model_root(owner))
        if params_name:
            value = _call_arg_for(call, func, params_name, method)
            for owner in parameter_owners(value) if value is not None else ():
                if owner not in models:
                    models.append(owner)
        out.append(Optimizer(call, ctx.statement_of(call), _assign_target(ctx, call), tuple(models), via=opt))
    return out


def _handed_params(ctx: Context, opt: "Optimizer") -> Optional[cst.BaseExpression]:
    """The parameter list `opt.call` builds its optimizer over: the constructor's first argument,
    or, for a call of a helper that builds it (`opt.via`), the argument that call hands the
    helper's parameter list. Not simply the helper call's first argument: `fetch_optimizer(args,
    model)` hands `args`, a configuration, not parameters."""
    if opt.via is None:
        return _params_arg(opt.call)
    inner = ctx.enclosing(opt.via.call, cst.FunctionDef, cst.Lambda)
    if not isinstance(inner, cst.FunctionDef) or opt.via.builder:
        return None
    positional, kwonly = _function_params(inner)
    method = isinstance(ctx.parent(ctx.parent(inner)), cst.ClassDef) and bool(positional)
    handed = _handed_params(ctx, opt.via)
    if not (isinstance(handed, cst.Name) and handed.value in {*(positional[1:] if method else positional), *kwonly}):
        return None
    return _call_arg_for(opt.call, inner, handed.value, method)


def optimizers(ctx: Context) -> List[Optimizer]:
    """Optimizer constructions, in order of appearance, then calls of same-file helpers that
    build one from a model they receive (see `Optimizer.via`)."""
    def compute() -> List[Optimizer]:
        out = []
        functions = facts(ctx).functions
        for call, name in facts(ctx).calls:
            if not _is_optimizer(name, call):
                # An optimizer-named target built by something else: `optimizer =
                # getattr(torch.optim, args.optim)(model.parameters(), lr=...)`,
                # `optimizer = create_optimizer(args, model)` (timm),
                # `optimizer = model.configure_optimizers(...)` (a method defined elsewhere).
                # `config["optimizer"] = optim_class(model.parameters(), lr=...)`: the key names it.
                target = _assign_target(ctx, call)
                label = target or _assigned_key(ctx, call)
                if not (label and _OPTIMIZER_TARGET.search(label.rsplit(".", 1)[-1])):
                    continue
                if name and any(x in name for x in _NOT_OPTIMIZER_CALLS):
                    continue
                args = cst.Tuple([cst.Element(a.value) for a in call.args])
                # the names handed in, by their assignment and what is appended to them
                # (`paras.append({"params": self.aux.parameters()})` under a flag)
                models = tuple(parameter_owners(args)) or tuple(dict.fromkeys(
                    [*_assigned_owners(ctx, call), *_followed_owners(ctx, call, args)]))
                builder = False
                if not models:
                    models = tuple(_factory_models(ctx, call, name, functions))
                    builder = bool(models)
                if not models and call.args:
                    models = tuple(_param_method_owners(ctx, args))
                if models:
                    out.append(Optimizer(call, ctx.statement_of(call), target, models, builder=builder))
                continue
            params = _params_arg(call)
            models = tuple(container_owners(ctx, params)) if params is not None else ()
            if params is not None and not models:
                models = tuple(_followed_owners(ctx, call, params) or _param_method_owners(ctx, params))
            out.append(Optimizer(call, ctx.statement_of(call), _assign_target(ctx, call), models))
        todo, seen = list(out), {o.call for o in out}
        sites: Dict[cst.Call, Optimizer] = {}
        depth = 0
        while todo and depth < 4:
            depth += 1
            found = []
            for opt in todo:
                for site in _helper_call_sites(ctx, opt):
                    if site.call not in seen:
                        seen.add(site.call)
                        sites[site.call] = site
                        found.append(site)
                    elif site.call in sites:
                        # a helper building two optimizers (`g_optimizer, d_optimizer =
                        # define_optimizer(g_A, g_B, d_A, d_B, config)`): its call trains them all
                        known = sites[site.call]
                        known.models = tuple(dict.fromkeys((*known.models, *site.models)))
            out.extend(found)
            todo = found
        out.extend(_program_helper_calls(ctx))
        out.extend(_self_training_models(ctx))
        return out

    return _cached(ctx, "optimizers", compute)


def _self_training_models(ctx: Context) -> List[Optimizer]:
    """Where a model that builds its own optimizer (`self.optimizer = Adam(self.parameters())`
    in its `__init__`, `ModuleView.self_trained`) is made and bound to a name, also moved or
    handed through a helper (`model = trans_to_cuda(SessionGraph(opt, n_node))`): for the
    model rules, its optimizer is created there, over that name's parameters."""
    classes = ctx.program.self_trained
    if not classes:
        return []
    out = []
    for assign in facts(ctx).assigns:
        if len(assign.targets) != 1:
            continue
        name = dotted(assign.targets[0].target)
        made = made_call(assign.value)
        if name and made is not None and dotted(made.func) in classes:
            out.append(Optimizer(made, ctx.statement_of(assign), None, (name,), builder=True, made=True))
    return out


def made_call(value: cst.BaseExpression) -> Optional[cst.Call]:
    """The call that makes the object `value` holds: `Net(...)`, also moved (`Net(...).cuda()`)
    or handed through a one-argument helper (`trans_to_cuda(Net(...))`)."""
    from torchmigrate.program.models import strip_moves  # (models reads this module)

    value = strip_moves(value)
    if isinstance(value, cst.Call) and len(value.args) == 1 and value.args[0].keyword is None \
            and not value.args[0].star:
        inner = strip_moves(value.args[0].value)
        if isinstance(inner, cst.Call) and (dotted(inner.func) or "").rsplit(".", 1)[-1][:1].isupper():
            return inner
    return value if isinstance(value, cst.Call) else None


def _program_helper_calls(ctx: Context) -> List[Optimizer]:
    """Calls of another module's function that builds an optimizer over the model it receives
    (`train(config, model, train_iter)` into train_eval.py; `ModuleView.optimizer_builders`):
    for this module's rules, the optimizer of the model passed there is created at the call."""
    builders = ctx.program.optimizer_builders
    if not builders:
        return []
    out = []
    for call, _ in facts(ctx).calls:
        found = builders.get(dotted(call.func) or "")
        if found is None:
            continue
        models: List[str] = []
        for position, param in found:  # each model the builder trains (`get_optimizers(d_net, g_net)`)
            value = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == param), None)
            positional = [a for a in call.args if a.keyword is None]
            if value is None and not any(a.star for a in positional) and position < len(positional):
                value = positional[position].value
            owner = dotted(value) if value is not None else None
            if owner is not None and _model_like(ctx, owner, value) and model_root(owner) not in models:
                models.append(model_root(owner))
        if models:
            out.append(Optimizer(call, ctx.statement_of(call), None, tuple(models), builder=True,
                                 by_hand=dotted(call.func) in ctx.program.hand_steppers))
    return out


def trained_models(ctx: Context) -> List[str]:
    """Dotted names of models whose parameters an optimizer trains, in order of appearance."""
    def compute() -> List[str]:
        seen: List[str] = []
        for opt in optimizers(ctx):
            for m in opt.models:
                if m not in seen and m not in ("self", "cls"):
                    seen.append(m)
        return seen

    return _cached(ctx, "trained_models", compute)


# --- entry point ---------------------------------------------------------------------------

def entry(ctx: Context) -> Optional[Entry]:
    """Where setup/cleanup go: first/last statement of the `__main__` block, or for a top-level
    script after the first block of top-level imports and at the end of the module."""
    def compute() -> Optional[Entry]:
        guard = facts(ctx).main_guard
        if guard is not None and isinstance(guard.body, cst.IndentedBlock):
            body = guard.body.body
            return Entry("main-guard", setup_before=body[0], setup_after=None, cleanup_after=body[-1])
        body = ctx.module.body
        if not body:
            return None
        anchor = leading_import_anchor(ctx.module)
        if anchor is None:
            return Entry("top-level", body[0], None, body[-1])
        return Entry("top-level", None, anchor, body[-1])

    return _cached(ctx, "entry", compute)

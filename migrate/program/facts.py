"""Cross-module facts of a program, from CPython's `ast` of each module (once per program).

What one module cannot see of itself:
- which of its functions' parameters (and which `self.` attributes of its classes) hold a model
  that the program trains, hence wraps in DDP: the model is built and its optimizer created in
  `train.py`, then passed to `engine.evaluate(model, loader)` or `utils.save_checkpoint(model)`,
  which read custom attributes or `state_dict()` through the wrapper;
- whether the program trains a model anywhere (so a library module's backward without an
  optimizer in sight is not "a model nobody wraps");
- which modules are entry points (only they set up the process group).

The facts are plain, picklable data (`ModuleView` per module) so files can still be processed
in worker processes. Name matching is syntactic and deliberately modest: a call counts when its
callee resolves, through the caller's imports, to a function or class of another module of the
program; everything else is left to the per-module rules and the runtime's safety nets.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from torchmigrate.program import amp_hazards, batch_coupling, collates, effects, inherited, splits
from torchmigrate.program.classes import MODULE, OTHER, argument_kind, class_kinds, optimizer_wrapper
from torchmigrate.program.devices import names_device
from torchmigrate.program.generators import endless_generators
from torchmigrate.program.graph import Graph
from torchmigrate.program.search_path import dotted_name
from torchmigrate.program.summing_modules import WHOLE, summing_outputs
from torchmigrate.program.view import ModuleView
from torchmigrate.program.astwalk import walk

# Optimizer classes by their last name (torch.optim and common ports). A call counts as an
# optimizer when its name is one of these or it is reached through an `optim` module.
OPTIMIZERS = frozenset({
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam",
    "LBFGS", "SparseAdam", "ASGD", "Lion", "LAMB", "Lamb", "LARS", "Lars", "BertAdam", "Adafactor",
    "FusedAdam", "FusedLAMB", "FusedSGD", "ZeroRedundancyOptimizer",
})
WRAPPERS = frozenset({"wrap_model", "DistributedDataParallel", "DDP", "DataParallel"})
FUNC_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class _Module:
    path: Path
    tree: ast.Module
    # local name -> (module path, symbol or None for the module itself)
    imports: Dict[str, Tuple[Path, Optional[str]]] = field(default_factory=dict)
    functions: Dict[str, ast.AST] = field(default_factory=dict)  # "f" / "Cls.m" -> def
    classes: Dict[str, ast.ClassDef] = field(default_factory=dict)
    stars: List[Path] = field(default_factory=list)  # the modules `from m import *` reads


def _strip_moves(node: ast.AST) -> ast.AST:
    """`model.to(dev)`, `model.cuda()`, `model.float()`: the same object."""
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and node.func.attr in ("to", "cuda", "cpu", "float", "half", "double", "train", "eval")):
        node = node.func.value
    return node


def _params(func: ast.AST) -> List[str]:
    a = func.args  # type: ignore[attr-defined]
    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _index(module: _Module) -> None:
    for node in module.tree.body:
        if isinstance(node, FUNC_TYPES):
            module.functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            module.classes[node.name] = node
            for item in node.body:
                if isinstance(item, FUNC_TYPES):
                    module.functions[f"{node.name}.{item.name}"] = item


def _files_named(own, name: str) -> List[Path]:
    """The files among `own` (the project files a module imports) that the module name `name`
    (a dotted name: its last part decides) denotes: `name.py`, or a package's
    `name/__init__.py`; the file whose folders spell more of the dotted name first
    (`utils.utils` is `utils/utils.py`, not the package `utils/__init__.py`)."""
    parts = name.split(".")
    last = parts[-1]
    found = [p for p in own if p.stem == last or (p.name == "__init__.py" and p.parent.name == last)]

    def spelled(p: Path) -> int:
        names = list((p.parent if p.name == "__init__.py" else p.with_suffix("")).parts)
        n = 0
        while n < min(len(parts), len(names)) and names[-1 - n] == parts[-1 - n]:
            n += 1
        return n

    return sorted(found, key=spelled, reverse=True) if len(found) > 1 else found


def _bind_imports(module: _Module, graph: Graph, modules: Dict[Path, "_Module"]) -> None:
    """Local names bound to another module of the program (or a symbol of one)."""
    own = set(graph.imports.get(module.path, ()))
    for node in graph.statements.get(module.path, ()):
        if isinstance(node, ast.ImportFrom):
            targets = _files_named(own, node.module or "")
            for alias in node.names:
                if alias.name == "*":  # every public function and class of the module
                    for target in targets:
                        if target in modules:
                            _star(module, modules[target].tree, target)
                            module.stars.append(target)
                    continue
                local = alias.asname or alias.name
                # `from models import resnet` (models/resnet.py), `from . import utils`; not
                # `from trainer import trainer`, a function of trainer.py named like its module
                package = (node.module or "").rsplit(".", 1)[-1]
                sub = [p for p in own if p.stem == alias.name and p.name != "__init__.py"
                       and (p.parent.name == package if package else p.parent == module.path.parent)]
                if sub:
                    module.imports[local] = (sub[0], None)
                elif targets:
                    module.imports[local] = (targets[0], alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                hit = _files_named(own, alias.name)
                if hit:
                    module.imports[alias.asname or alias.name] = (hit[0], None)


def _follow_reexports(modules: Dict[Path, "_Module"]) -> None:
    """Bind each imported name to the module that defines it: `from data import
    InfiniteDataLoader`, where data/__init__.py only imports the class from
    .infinite_dataloader, names the class of data/infinite_dataloader.py. Every fact kept
    about a class or function (a DataLoader subclass, a writer, a dataset that downloads) then
    reaches the modules that import it through a package."""
    defined = {p: _top_level_names(m.tree) for p, m in modules.items()}
    for _ in range(4):  # a star import also brings what the module imports from the program
        grew = False
        for m in modules.values():
            for target in m.stars:
                exported = _all_names(modules[target].tree)
                for name, bound in modules[target].imports.items():
                    if not name.startswith("_") and (exported is None or name in exported) and name not in m.imports:
                        m.imports[name], grew = bound, True
        if not grew:
            break
    for m in modules.values():
        for local, bound in list(m.imports.items()):
            path, symbol = bound
            seen: Set[Tuple[Path, str]] = set()
            while symbol is not None and path in modules and symbol not in defined[path] and (path, symbol) not in seen:
                seen.add((path, symbol))
                nxt = modules[path].imports.get(symbol)
                if nxt is None:
                    break
                path, symbol = nxt
            m.imports[local] = (path, symbol)


def _top_level_names(tree: ast.Module) -> Set[str]:
    """The names a module's own top-level statements define (functions, classes, assignments)."""
    out: Set[str] = set()
    for node in tree.body:
        if isinstance(node, (*FUNC_TYPES, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return out


def _reexports(path: Path, graph: Graph, modules: Dict[Path, "_Module"], library: Dict[Path, Dict[str, str]],
               depth: int = 0) -> Dict[str, str]:
    """Library names that `path` imports through a project module: `from dataloader import *`
    or `from dataloader import DataLoader` where dataloader.py itself imports `DataLoader` from
    torch (local name -> `torch.utils.data.DataLoader`). A star import brings what the module
    imports at its top level from outside the project (following its own star imports), only
    the names its `__all__` lists when it has one, none starting with `_`, and none `path`
    imports itself by name."""
    out: Dict[str, str] = {}
    if depth > 3:
        return out
    own = set(graph.imports.get(path, ()))
    explicit: Set[str] = set()
    stars: List[Path] = []
    for node in graph.statements.get(path, ()):
        if isinstance(node, ast.Import):
            explicit.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        if not (isinstance(node, ast.ImportFrom) and node.level == 0):
            continue
        targets = [t for t in _files_named(own, node.module or "") if t in modules]
        for alias in node.names:
            if alias.name == "*":
                stars.extend(targets)
                continue
            explicit.add(alias.asname or alias.name)
            for target in targets:
                m = modules[target]
                if alias.name in m.classes or alias.name in m.functions:
                    continue
                full = _library_of(target, modules, graph, library).get(alias.name)
                if full is not None:
                    out[alias.asname or alias.name] = full
    for target in stars:
        exported = _all_names(modules[target].tree)
        found = {**_library_of(target, modules, graph, library),
                 **_reexports(target, graph, modules, library, depth + 1)}
        for local, full in found.items():
            if not local.startswith("_") and local not in explicit and (exported is None or local in exported):
                out.setdefault(local, full)
    return out


_HIDDEN_STATE = frozenset({"init_hidden", "init_hidden_state", "begin_state", "init_states", "init_state"})


def _batch_consumers(modules: Dict[Path, "_Module"], kinds) -> Dict[str, str]:
    """Batch-size names the program hands to a model or loss class of its own that it builds
    (`NTXentLoss(device, config.batch_size, ...)`, `GRU4REC(..., batch_size=batch_size)`) or to
    `init_hidden(batch_size)`: the last part of the name -> `file:line Callee(...)`."""
    out: Dict[str, str] = {}
    for path, m in modules.items():
        for node in walk(m.tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            target = None
            if isinstance(func, ast.Name) and func.id in m.classes:
                target = (path, func.id)
            else:
                callee = _callee(m, modules, node)
                if callee is not None and callee[1].endswith(".__init__"):
                    target = (callee[0], callee[1][: -len(".__init__")])
            hidden = isinstance(func, ast.Attribute) and func.attr in _HIDDEN_STATE
            if not hidden and (target is None or kinds.get(target) != MODULE):
                continue
            init = _init_of(modules, target) if target is not None and not hidden else None
            passed = [(i, None, a) for i, a in enumerate(node.args)] + [(None, k.arg, k.value) for k in node.keywords]
            for position, keyword, a in passed:
                leaf = a.attr if isinstance(a, ast.Attribute) else a.id if isinstance(a, ast.Name) else None
                if not leaf or "batch_size" not in leaf.lower():
                    continue
                if init is not None and not _reads_param(modules, target, init, position, keyword):
                    continue  # stored and never read (`self.batch_size = batch_size`): sizes nothing
                shown = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "call")
                out.setdefault(leaf, f"{path.name}:{node.lineno} {shown}(...)")
    return out


def _init_of(modules: Dict[Path, "_Module"], target: Tuple[Path, str]) -> Optional[ast.AST]:
    return modules[target[0]].functions.get(f"{target[1]}.__init__") if target[0] in modules else None


# names a program gives its configuration (`args.lr`, `cfg.model`): what is read off them is a setting,
# not a model or data (compared lower-cased)
CONFIG_RECEIVERS = frozenset({"args", "opt", "opts", "config", "cfg", "conf", "flags", "hparams", "hp", "params",
                               "options", "settings", "hyperparams"})


def _reads_param(modules: Dict[Path, "_Module"], target: Tuple[Path, str], init: ast.AST,
                 position: Optional[int], keyword: Optional[str]) -> bool:
    """The class's `__init__` parameter that receives this argument is read for more than being
    stored (`self.batch_size = batch_size`), or the attribute it is stored in is read somewhere in
    the program (not on a configuration object): a model or loss sized by it. True when unsure."""
    names = _params(init)
    if keyword is not None:
        param = keyword if keyword in names else None
    else:
        index = position + 1  # past `self`
        param = names[index] if position is not None and index < len(names) else None
    if param is None:
        return True
    stored: Set[str] = set()
    for n in walk(init):
        if isinstance(n, ast.Name) and n.id == param and isinstance(n.ctx, ast.Load):
            parent_store = next((a for a in walk(init) if isinstance(a, ast.Assign) and a.value is n), None)
            if parent_store is None or not all(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                               and t.value.id == "self" for t in parent_store.targets):
                return True
            stored |= {t.attr for t in parent_store.targets}
    for m in modules.values():
        for n in walk(m.tree):
            if isinstance(n, ast.Attribute) and n.attr in stored and isinstance(n.ctx, ast.Load) and not (
                    isinstance(n.value, ast.Name) and n.value.id.lower() in CONFIG_RECEIVERS):
                return True
    return False


def _library_of(path: Path, modules: Dict[Path, "_Module"], graph: Graph,
                library: Dict[Path, Dict[str, str]]) -> Dict[str, str]:
    """`_library_imports` of a module, computed once per program build (`library` keeps them)."""
    found = library.get(path)
    if found is None:
        found = library[path] = _library_imports(path, modules[path].tree, graph)
    return found


def _library_imports(path: Path, tree: ast.Module, graph: Graph) -> Dict[str, str]:
    """`local name -> qualified name` for the module-level imports of `path` (in `try`/`if`
    blocks too) from outside the project."""
    own_stems = {p.stem for p in graph.imports.get(path, ())} | {p.parent.name for p in graph.imports.get(path, ())
                                                               if p.name == "__init__.py"}
    out: Dict[str, str] = {}
    top: List[ast.stmt] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        top.append(node)
        if isinstance(node, (ast.Try, ast.If)):
            stack.extend([*node.body, *node.orelse, *getattr(node, "finalbody", ()),
                          *(s for h in getattr(node, "handlers", ()) for s in h.body)])
    for node in top:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in own_stems or alias.name.rsplit(".", 1)[-1] in own_stems:
                    continue
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    out[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in own_stems or node.module.rsplit(".", 1)[-1] in own_stems:
                continue
            for alias in node.names:
                if alias.name != "*":
                    out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _all_names(tree: ast.Module) -> Optional[Set[str]]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return None


def _star(module: _Module, tree: ast.Module, target: Path) -> None:
    """`from target import *` binds the target's public top-level functions and classes."""
    for node in tree.body:
        if isinstance(node, (*FUNC_TYPES, ast.ClassDef)) and not node.name.startswith("_"):
            module.imports.setdefault(node.name, (target, node.name))


class _Scope:
    """One function (or the module body): the model names it trains and the calls it makes."""

    def __init__(self, module: _Module, node: ast.AST, klass: Optional[str]) -> None:
        self.module, self.node, self.klass = module, node, klass
        self.calls: List[ast.Call] = []
        self.models: Set[str] = set()
        self.instances: Dict[str, Tuple[Path, str]] = {}  # name -> (module, class) of the program
        self.assigns: List[ast.Assign] = []
        self.wrapped_at: Dict[str, int] = {}  # name -> line of its first `name = DDP(name)` here
        body = node.body if not isinstance(node, ast.Module) else [
            s for s in node.body if not isinstance(s, (*FUNC_TYPES, ast.ClassDef))]
        stack = list(body)
        while stack:
            n = stack.pop()
            if isinstance(n, (*FUNC_TYPES, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(n, ast.Call):
                self.calls.append(n)
            elif isinstance(n, ast.Assign):
                self.assigns.append(n)
            stack.extend(ast.iter_child_nodes(n))


def _optimizer_models(call: ast.Call, assigned: Optional[Dict[str, ast.AST]] = None) -> List[str]:
    """`X` for `Adam(X.parameters())`, `SGD([{"params": X.head.parameters()}])`, and for a method
    that picks them (`Adam(X.get_params())`, as `analysis._param_method_owners`), ...; with
    `assigned` (the scope's simple assignments), also through a name: `params =
    X.get_params(); Adam(params)`."""
    name = dotted_name(call.func) or ""
    last = name.rsplit(".", 1)[-1]
    # (a class of the program named as one: `class CustomOptimizer(optimizer_class)` in a factory)
    if not (last in OPTIMIZERS or ".optim." in f".{name}" and last[:1].isupper()
            or last[:1].isupper() and last.endswith("Optimizer")):
        return []
    out = []
    args = [*call.args, *(k.value for k in call.keywords)]
    args += [assigned[a.id] for a in args if assigned and isinstance(a, ast.Name) and a.id in assigned]
    for arg in args:
        for n in walk(arg):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and (n.func.attr in (
                    "parameters", "named_parameters") or any(w in n.func.attr.lower() for w in ("param", "group"))):
                owner = dotted_name(_strip_moves(n.func.value))
                if owner and owner.split(".")[0] in CONFIG_RECEIVERS:
                    continue
                if owner:
                    out.append(owner.split(".")[0] if not owner.startswith("self.") else ".".join(owner.split(".")[:2]))
    return out


def compute(graph: Graph, trees: Dict[Path, ast.Module], entries: Iterable[Path]) -> Dict[Path, ModuleView]:
    """A `ModuleView` for every module of the program."""
    modules: Dict[Path, _Module] = {}
    for path in graph.modules:
        tree = trees.get(path)
        if tree is None:
            continue
        m = _Module(path, tree)
        _index(m)
        modules[path] = m
    for m in modules.values():
        _bind_imports(m, graph, modules)
    _follow_reexports(modules)

    scopes: List[_Scope] = []
    for m in modules.values():
        scopes.append(_Scope(m, m.tree, None))
        for qual, func in m.functions.items():
            scopes.append(_Scope(m, func, qual.split(".")[0] if "." in qual else None))

    # Models trained with an optimizer, per scope; `self.x` ones class-wide.
    trains = False
    class_models: Dict[Tuple[Path, str], Set[str]] = {}
    self_trained = _self_trained(modules)
    for s in scopes:
        for call in s.calls:
            last = (dotted_name(call.func) or "").rsplit(".", 1)[-1]
            found = _optimizer_models(call)
            if last in WRAPPERS and call.args:
                inner = dotted_name(_strip_moves(call.args[0]))
                found += [inner] if inner else []
            if isinstance(call.func, ast.Attribute) and call.func.attr == "backward":
                trains = True  # a backward, whatever builds the optimizer (a factory over a parameter list)
            for name in found:
                trains = True
                if name.startswith("self.") and s.klass:
                    class_models.setdefault((s.module.path, s.klass), set()).add(name)
                else:
                    s.models.add(name)
        for a in s.assigns:  # model = tm.wrap_model(model) / DDP(model).cuda(): the target too
            made = made_class(a.value) if self_trained else None
            if made is not None and _made_key(s.module, modules, made) in self_trained:
                for t in a.targets:  # `model = SessionGraph(...)`, which builds its own optimizer
                    name = dotted_name(t)
                    if name and name.startswith("self.") and s.klass:
                        class_models.setdefault((s.module.path, s.klass), set()).add(name)
                    elif name:
                        s.models.add(name)
            value = _strip_moves(a.value)
            if isinstance(value, ast.Call) and (dotted_name(value.func) or "").rsplit(".", 1)[-1] in WRAPPERS:
                for t in a.targets:
                    name = dotted_name(t)
                    if name and not name.startswith("self."):
                        s.models.add(name)
                        s.wrapped_at[name] = min(a.lineno, s.wrapped_at.get(name, a.lineno))
    for s in scopes:
        if s.klass:
            s.models |= class_models.get((s.module.path, s.klass), set())
        s.models -= _module_aliases(s)
    base_wraps, base_wrapped = inherited.trained_in_bases(modules, class_models)
    rebatching = collates.rebatching(f for m in modules.values() for f in m.functions.values())

    # Instances of the program's classes: `stopper = EarlyStopping(...)` (per scope) or
    # `self.saver = Saver(...)` (class-wide), so `stopper(loss, model)` and
    # `self.saver.save(model)` reach `EarlyStopping.__call__` and `Saver.save`.
    class_instances: Dict[Tuple[Path, str], Dict[str, Tuple[Path, str]]] = {}
    for s in scopes:
        for a in s.assigns:
            if not isinstance(a.value, ast.Call):
                continue
            target = _callee(s.module, modules, a.value)
            if target is None or not target[1].endswith(".__init__"):
                continue
            klass = (target[0], target[1].split(".")[0])
            for t in a.targets:
                name = dotted_name(t)
                if name and name.startswith("self.") and s.klass:
                    class_instances.setdefault((s.module.path, s.klass), {})[name] = klass
                elif name:
                    s.instances[name] = klass
    for s in scopes:
        if s.klass:
            s.instances.update(class_instances.get((s.module.path, s.klass), {}))

    # a model passed to another module's function that builds its optimizer is wrapped by the
    # caller (TM301 there): it is one of the caller's models, and the function's parameter
    # receives the wrapped model like any other
    optimizer_params, hand_steppers = _optimizer_params(modules)
    training_params = _training_params(modules)
    for s in scopes:
        for call in s.calls:
            target = _callee(s.module, modules, call)
            builder = target and (target[0], target[1][:-len(".__init__")] if target[1].endswith(".__init__")
                                  else target[1])
            if target is None or target[0] == s.module.path or builder not in optimizer_params:
                continue
            trained = {param for _, param in optimizer_params[builder]}
            for bound, value in _bind(modules[target[0]].functions[target[1]], call, target[2]):
                name = dotted_name(_strip_moves(value)) if bound in trained else None
                if name and not name.startswith("self."):
                    s.models.add(name)

    wrapped: Dict[Tuple[Path, str], Set[str]] = {}
    attrs: Dict[Tuple[Path, str], Set[str]] = {}
    for _ in range(6):  # to a fixpoint: a parameter that holds a model passes it on
        changed = False
        for s in scopes:
            held = set(s.models) | wrapped.get((s.module.path, _qual(s)), set())
            if s.klass:
                held |= {f"self.{a}" for a in attrs.get((s.module.path, s.klass), set())}
            if not held:
                continue
            for call in s.calls:
                target = _callee(s.module, modules, call) or _method_of_instance(s, modules, call)
                if target is None:
                    continue
                path, qual, skip_self = target
                func = modules[path].functions.get(qual)
                if func is None:
                    continue
                for param, value in _bind(func, call, skip_self):
                    name = dotted_name(_strip_moves(value))
                    # DINO's `student = MultiCropWrapper(student, head)` before `student = DDP(student)`
                    # hands over the bare model
                    if name in held and call.lineno >= s.wrapped_at.get(name, 0):
                        bucket = wrapped.setdefault((path, qual), set())
                        if param not in bucket:
                            bucket.add(param)
                            changed = True
                            if qual.endswith(".__init__"):
                                klass = qual.split(".")[0]
                                for attr in _self_stores(func, param):
                                    attrs.setdefault((path, klass), set()).add(attr)
        if not changed:
            break

    instance_attrs = _instance_attrs(modules, class_models, attrs)
    made_here = _made_classes(modules, scopes, self_trained)
    loader_params = _loader_params(modules, scopes)
    flags = _flag_args(modules, scopes)
    factories = _loader_factories(modules, flags)
    outputs = {(p, name): summing_outputs(c) for p, m in modules.items() for name, c in m.classes.items()}
    summing = {key for key, found in outputs.items() if WHOLE in found}
    summing_parts = {key: found for key, found in outputs.items() if found and WHOLE not in found}
    endless = frozenset().union(*(endless_generators(m.tree) for m in modules.values()))
    loader_classes = {(p, name) for p, m in modules.items() for name, c in m.classes.items() if _loader_subclass(c)}
    # DataLoader subclasses whose calls cannot take a `sampler=` (their __init__ builds the
    # DataLoader's arguments itself): the loaders they make are sharded where they are iterated
    opaque_loaders = any(_derives_loader(c) and not _loader_subclass(c) for m in modules.values() for c in m.classes.values())
    all_kinds = class_kinds(modules)
    kinds = {key: kind for key, kind in all_kinds.items() if kind is not None}
    params_known, params_classes = _param_kinds(modules, scopes, all_kinds)
    pickled = frozenset(_pickled_keys(scopes))
    wrappers = {key: w for key, kind in kinds.items() if kind == OTHER
                and (w := optimizer_wrapper(modules[key[0]].classes[key[1]])) is not None}
    own_functions = {(p, name) for p, m in modules.items() for name in m.functions if "." not in name}
    clippers = {(p, name) for p, m in modules.items() for name, f in m.functions.items()
                if "." not in name and _clips(f)}
    own_classes = {(p, name) for p, m in modules.items() for name in m.classes}
    dp_classes = {(p, name): _dp_module_position(c) for p, m in modules.items() for name, c in m.classes.items()
                  if _dp_subclass(c)}
    heads = {(p, name): outs for p, m in modules.items() for name, c in m.classes.items()
             if len(outs := forward_outputs(c)) > 1}
    builders = _iterator_builders(modules)
    torch_programs = _torch_programs(graph, modules)
    devices = names_device(m.tree for m in modules.values())
    loader_names = {"DataLoader"} | {name for _, name in loader_classes}
    builds_loaders = any((dotted_name(c.func) or "").rsplit(".", 1)[-1] in loader_names
                         and not _own_non_loader(s, modules, c) for s in scopes for c in s.calls)
    builds_dataloaders = builds_loaders
    spelled_builders = {m.path: {spelled: builders[key] for key in builders for spelled in _spellings(m, modules, {key})}
                        for m in modules.values()}
    builds_loaders = builds_loaders or any(
        _training_iterator(c, spelled_builders[s.module.path][dotted_name(c.func)], getattr(s.node, "name", ""))
        for s in scopes for c in s.calls if (dotted_name(c.func) or "") in spelled_builders[s.module.path])
    # the program sets up torch.distributed itself (its own process group, DDP or sampler)
    distributed = any((dotted_name(c.func) or "").rsplit(".", 1)[-1] in _OWN_DISTRIBUTED for s in scopes for c in s.calls)
    entry_set = {Path(e).resolve() for e in entries}
    overridden = _print_overridden(graph, modules, scopes, entry_set)
    called, unguarded = _calls_from_elsewhere(modules, scopes)
    bindings = {path: effects.bindings_of(m.imports) for path, m in modules.items()}
    program_effects = _effects(modules, bindings)
    writer_classes = {(Path(p), name) for p, name in program_effects.writer_classes}
    builders_first = effects.first_run_builders(program_effects)
    several = len(modules) > 1
    views: Dict[Path, ModuleView] = {}
    consumers = _batch_consumers(modules, kinds)
    library: Dict[Path, Dict[str, str]] = {}  # each module's library imports, for `_reexports`
    library_datasets = _library_dataset_classes(modules, graph, library)
    dp_names = {"DataParallel", "data_parallel"} | {name for _, name in dp_classes}
    pickers = {(p, name): _walks_modules(f) for p, m in modules.items() for name, f in m.functions.items()
               if "." not in name and _picks_parameters(f)}  # -> whether it walks submodules
    data_parallel = any((dotted_name(c.func) or "").rsplit(".", 1)[-1] in dp_names for s in scopes for c in s.calls)
    coupled = batch_coupling.coupled_losses({p: m.tree for p, m in modules.items()})
    precision = amp_hazards.hazards({p: m.tree for p, m in modules.items()},
                                    lambda p: _library_of(p, modules, graph, library))
    for path, m in modules.items():
        views[path] = ModuleView(
            is_entry=path in entry_set or not several,
            followed=several,
            wrapped_params={q: frozenset(p) for (mp, q), p in wrapped.items() if mp == path},
            wrapped_attrs={k: frozenset(attrs.get((mp, k), set()) | base_wrapped.get((mp, k), set()))
                           for (mp, k) in {*attrs, *base_wrapped} if mp == path},
            base_wraps={k: frozenset(a) for (mp, k), a in base_wraps.items() if mp == path},
            rebatching_collates=rebatching,
            loader_params={q: {p: frozenset(k) for p, k in params.items()}
                           for (mp, q), params in loader_params.items() if mp == path},
            flag_args={q: {p: frozenset(v) for p, v in params.items()}
                       for (mp, q), params in flags.items() if mp == path},
            endless_generators=endless,
            summing_modules=frozenset(_spellings(m, modules, summing)),
            summing_parts={spelled: found for key, found in summing_parts.items()
                           for spelled in _spellings(m, modules, {key})},
            instance_attrs={spelled: frozenset(a) for key, a in instance_attrs.items()
                            for spelled in _spellings(m, modules, {key})},
            self_trained=frozenset(_spellings(m, modules, self_trained)),
            wrapped_where_made=frozenset(name for (p, name) in made_here if p == path),
            loader_classes=frozenset(_spellings(m, modules, loader_classes)),
            library_datasets=frozenset(_spellings(m, modules, library_datasets)),
            data_parallel=data_parallel,
            parameter_pickers={spelled: walks for k, walks in pickers.items()
                               if k[0] != path for spelled in _spellings(m, modules, {k})},
            class_kinds={spelled: kinds[key] for key in kinds for spelled in _spellings(m, modules, {key})},
            optimizer_wrappers={spelled: wrappers[key] for key in wrappers
                                for spelled in _spellings(m, modules, {key})},
            param_kinds={q: k for (mp, q), k in params_known.items() if mp == path},
            pickled_keys=pickled,
            param_wrappers={q: {p: wrappers[c] for p, c in found.items() if c in wrappers}
                            for (mp, q), found in params_classes.items() if mp == path
                            and any(c in wrappers for c in found.values())},
            reexports=_reexports(path, graph, modules, library),
            batch_consumers=consumers,
            amp_hazards=amp_hazards.for_module(path, precision),
            batch_coupled=frozenset({coupled} if coupled else ()),
            own_functions=frozenset(_spellings(m, modules, {k for k in own_functions if k[0] != path})),
            clip_helpers=frozenset(_spellings(m, modules, {k for k in clippers if k[0] != path})),
            own_classes=frozenset(_spellings(m, modules, {k for k in own_classes if k[0] != path})),
            dp_classes={spelled: dp_classes[key] for key in dp_classes
                        for spelled in _spellings(m, modules, {key})},
            forward_outputs={spelled: heads[key] for key in heads for spelled in _spellings(m, modules, {key})},
            iterator_builders={spelled: builders[key] for key in builders
                               for spelled in _spellings(m, modules, {key})},
            optimizer_builders={spelled: optimizer_params[key] for key in optimizer_params if key[0] != path
                                for spelled in _spellings(m, modules, {key})},
            hand_steppers=frozenset(_spellings(m, modules, {k for k in hand_steppers if k[0] != path})),
            training_params={spelled: training_params[key] for key in training_params if key[0] != path
                             for spelled in _spellings(m, modules, {key})},
            loader_factories=frozenset(_spellings(m, modules, {k for k in factories if k[0] != path})),
            program_trains=trains,
            program_loaders=builds_loaders,
            program_distributed=distributed,
            opaque_loaders=opaque_loaders,
            program_dataloaders=builds_dataloaders,
            program_torch=path in torch_programs,
            print_override=path in overridden,
            program_devices=devices,
            called_elsewhere=frozenset(q for p, q in called if p == path),
            builders_for_others=frozenset(q for p, q in optimizer_params if p == path
                                          and any(_spellings(other, modules, {(p, q)})
                                                  for o, other in modules.items() if o != path)),
            guarded_elsewhere=frozenset(q for p, q in called - unguarded if p == path),
            call_effects=effects.spelled_effects(program_effects, str(path)),
            call_writes=effects.written_arguments(program_effects, str(path)),
            first_run_builders=frozenset(q for p, q in builders_first if p == str(path)),
            writer_classes=frozenset(_spellings(m, modules, writer_classes)),
            bindings=bindings[path],
        )
    return views


_OWN_DISTRIBUTED = frozenset({"init_process_group", "DistributedDataParallel", "DistributedSampler"})


def program_effects(graph: Graph, trees: Dict[Path, ast.Module]) -> effects.ProgramEffects:
    """The effects of every function, method and class of the program (`program.effects`),
    with each module's imports bound to the program's modules as `compute` binds them."""
    modules: Dict[Path, _Module] = {}
    for path in graph.modules:
        if trees.get(path) is not None:
            modules[path] = _Module(path, trees[path])
    for m in modules.values():
        _bind_imports(m, graph, modules)
    _follow_reexports(modules)
    return _effects(modules, {path: effects.bindings_of(m.imports) for path, m in modules.items()})


def _effects(modules: Dict[Path, _Module], bindings: Dict[Path, effects.Bindings]) -> effects.ProgramEffects:
    return effects.combine(effects.summarize(m.tree, str(path), bindings[path]) for path, m in modules.items())


def _param_kinds(modules: Dict[Path, _Module], scopes: List[_Scope], kinds: Dict[Tuple[Path, str], Optional[str]]
                 ) -> Tuple[Dict[Tuple[Path, str], Dict[str, str]], Dict[Tuple[Path, str], Dict[str, Tuple[Path, str]]]]:
    """(module, "f" / "Cls.__init__") -> the parameters that every call of it in the program
    passes the same known kind (`DiceLoss(torch.ones(4))`: `weight` is a tensor), and those
    every call passes an instance of the same class of the program (`opt = NoamOpt(...)`,
    `LossCompute(gen, crit, opt)`)."""
    module_assigns = {s.module.path: s.assigns for s in scopes if isinstance(s.node, ast.Module)}
    seen: Dict[Tuple[Path, str], Dict[str, List[tuple]]] = {}
    for s in scopes:
        m = s.module
        assigns = s.assigns + (module_assigns.get(m.path, []) if s.node is not m.tree else [])
        for call in s.calls:
            target = _callee(m, modules, call)
            if target is None and isinstance(call.func, ast.Name):
                if call.func.id in m.classes:
                    target = (m.path, f"{call.func.id}.__init__", True)
                elif call.func.id in m.functions:
                    target = (m.path, call.func.id, False)
            if target is None:
                continue
            path, qual, skip_self = target
            func = modules[path].functions.get(qual)
            if func is None:
                continue
            for param, value in _bind(func, call, skip_self):
                seen.setdefault((path, qual), {}).setdefault(param, []).append(
                    argument_kind(m, modules, kinds, value, assigns))
    out_kinds: Dict[Tuple[Path, str], Dict[str, str]] = {}
    out_classes: Dict[Tuple[Path, str], Dict[str, Tuple[Path, str]]] = {}
    for key, params in seen.items():
        for param, found in params.items():
            if len(set(found)) != 1:
                continue
            kind, klass = found[0]
            if kind is not None:
                out_kinds.setdefault(key, {})[param] = kind
            if klass is not None:
                out_classes.setdefault(key, {})[param] = klass
    return out_kinds, out_classes


def _pickled_keys(scopes: List[_Scope]) -> Set[str]:
    """Keys of the dicts the program builds (for its checkpoints) whose value is a whole model
    or optimizer object rather than its state dict: `{"optimizer": optimizer, "model":
    model.module}`. A load that reads one of them gets a pickled object back."""
    found: Set[str] = set()
    for s in scopes:
        # optimizers, and the program's wrappers of one built over a model's parameters
        objects = {dotted_name(t) for a in s.assigns if isinstance(a.value, ast.Call) and (
                   _optimizer_models(a.value) or _over_parameters(a.value)) for t in a.targets} | s.models
        objects.discard(None)
        if not objects:
            continue
        body = s.node.body if not isinstance(s.node, ast.Module) else [
            n for n in s.node.body if not isinstance(n, (*FUNC_TYPES, ast.ClassDef))]
        stack = list(body)
        while stack:
            n = stack.pop()
            if isinstance(n, (*FUNC_TYPES, ast.ClassDef, ast.Lambda)):
                continue
            pairs: List[Tuple[Optional[ast.AST], ast.AST]] = []
            if isinstance(n, ast.Dict):
                pairs = list(zip(n.keys, n.values))
            elif isinstance(n, ast.Call) and dotted_name(n.func) == "dict":
                pairs = [(ast.Constant(k.arg), k.value) for k in n.keywords if k.arg]
            for key, value in pairs:
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.args:
                    value = value.args[0]  # `get_module(model)`, `deepcopy(model)`: still the object
                name = dotted_name(value)
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and name is not None \
                        and (name in objects or name.split(".")[0] in objects):
                    found.add(key.value)
            stack.extend(ast.iter_child_nodes(n))
    return found


def _over_parameters(call: ast.Call) -> bool:
    """`OptimWrapper(model.parameters(), lr=...)`: a call given a model's parameters."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "parameters"
               for a in (*call.args, *(k.value for k in call.keywords)) for n in walk(a))


def _loader_params(modules: Dict[Path, _Module], scopes: List[_Scope]) -> Dict[Tuple[Path, str], Dict[str, Set[str]]]:
    """(module, "f" or "Cls.m") -> parameter -> the splits of the data loaders that other
    modules hand it: "train" or "eval" where the argument's name says so (`val_loader`,
    `data.get_loader("test")`, `loaders["val"]`), "unknown" for a loader-like argument that
    says neither; followed through parameters that pass a loader on (also to functions of the
    same module: `run(model, loader)` calling `evaluate(model, loader)`), to a fixpoint."""
    out: Dict[Tuple[Path, str], Dict[str, Set[str]]] = {}
    for sweep in range(7):
        changed = False
        for s in scopes:
            held = out.get((s.module.path, _qual(s)), {})
            for call in s.calls:
                target = _callee(s.module, modules, call) or _method_of_instance(s, modules, call)
                local = target is None or target[0] == s.module.path
                target = _local_callee(s, call) if local else target
                if target is None:
                    continue
                path, qual, skip_self = target
                func = modules[path].functions.get(qual)
                if func is None:
                    continue
                for param, value in _bind(func, call, skip_self):
                    # within a module only what a parameter holds passes on: the module's own
                    # loaders are its loader facts' business
                    if local and dotted_name(value) not in held:
                        continue
                    kinds = _loader_kinds(value, held)
                    if not kinds and sweep and param in out.get((path, qual), {}):
                        # a parameter that takes loaders, handed something not named like one
                        kinds = _named_split(value)
                    bucket = out.setdefault((path, qual), {}).setdefault(param, set()) if kinds else None
                    if bucket is not None and not kinds <= bucket:
                        bucket |= kinds
                        changed = True
        if not changed:
            break
    return out


def _flag_args(modules: Dict[Path, _Module], scopes: List[_Scope]) -> Dict[Tuple[Path, str], Dict[str, Set[bool]]]:
    """(module, "f" or "Cls.m") -> parameter -> the literal `True`/`False` values its calls in
    the program pass it (its default where a call leaves it out). One loader factory called as
    `make_loader(train_set, shuffle=True)` and `make_loader(dev_set, shuffle=False)` builds both
    splits: its `shuffle` parameter says which one a call builds."""
    out: Dict[Tuple[Path, str], Dict[str, Set[bool]]] = {}
    for s in scopes:
        for call in s.calls:
            target = _callee(s.module, modules, call) or _method_of_instance(s, modules, call) or _local_callee(s, call)
            if target is None:
                continue
            path, qual, skip_self = target
            func = modules[path].functions.get(qual)
            if func is None or any(isinstance(a, ast.Starred) for a in call.args) \
                    or any(k.arg is None for k in call.keywords):
                continue
            passed = dict(_bind(func, call, skip_self))
            for param, default in _param_defaults(func).items():
                value = passed.get(param, default)
                if isinstance(value, ast.Constant) and isinstance(value.value, bool):
                    out.setdefault((path, qual), {}).setdefault(param, set()).add(value.value)
    return out


def _param_defaults(func: ast.AST) -> Dict[str, Optional[ast.AST]]:
    """Every parameter of `func` -> its default (None where it has none)."""
    a = func.args  # type: ignore[attr-defined]
    positional = [*a.posonlyargs, *a.args]
    defaults: Dict[str, Optional[ast.AST]] = {p.arg: None for p in (*positional, *a.kwonlyargs)}
    for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
        defaults[p.arg] = d
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        defaults[p.arg] = d
    return defaults


def _local_callee(s: _Scope, call: ast.Call) -> Optional[Tuple[Path, str, bool]]:
    """`f(...)` of a function of the scope's own module, `self.m(...)` of its own class."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in s.module.functions:
        return s.module.path, func.id, False
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self" and s.klass \
            and f"{s.klass}.{func.attr}" in s.module.functions:
        return s.module.path, f"{s.klass}.{func.attr}", True
    return None


def _loader_kinds(value: ast.AST, held: Dict[str, Set[str]]) -> Set[str]:
    """The splits a loader-like argument names ({"train"}, {"eval"}, {"unknown"}), the splits
    a parameter of the caller holds, or nothing for an argument that is not loader-like."""
    name = dotted_name(value)
    if name is not None and name in held:
        return set(held[name])
    text = []
    if isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant) and isinstance(value.slice.value, str):
        name = dotted_name(value.value)
        text.append(value.slice.value)
    elif isinstance(value, ast.Call):
        name = dotted_name(value.func)
        text += [a.value for a in value.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if name is None or not splits.named_like_loader(name):
        return set()
    found = splits.words(name.rsplit(".", 1)[-1]) + [w for t in text for w in splits.words(t)]
    return {splits.verdict(found) or "unknown"}


def _named_split(value: ast.AST) -> Set[str]:
    """The split an argument's name says (`val_data`: {"eval"}), {"unknown"} when it says none,
    nothing for a constant (`None`)."""
    if isinstance(value, ast.Constant):
        return set()
    name = dotted_name(value) or ""
    return {splits.verdict(splits.words(name.rsplit(".", 1)[-1])) or "unknown"}


def _module_aliases(s: _Scope) -> Set[str]:
    """Names the scope binds to a wrapper's module (`model_without_ddp = model.module`): the
    unwrapped model, even when its optimizer is built from it, so the helpers it is passed to
    (`save_model(model_without_ddp=model_without_ddp)`) do not receive a wrapped model."""
    out = set()
    for a in s.assigns:
        value = dotted_name(_strip_moves(a.value)) or ""
        if value.endswith(".module"):
            out.update(n for n in map(dotted_name, a.targets) if n)
    return out


def _assigns_builtin_print(node: ast.AST) -> bool:
    """`builtins.print = ...` (or `__builtin__.print`, Python 2's spelling) in `node`."""
    return any(isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Attribute) and t.attr == "print" and isinstance(t.value, ast.Name)
        and t.value.id in ("builtins", "__builtin__") for t in n.targets) for n in walk(node))


def _print_overridden(graph: Graph, modules: Dict[Path, _Module], scopes: List[_Scope],
                      entries: Set[Path]) -> Set[Path]:
    """The modules whose prints run after the program made `print` rank-aware by replacing
    `builtins.print`: those an entry reaches (through imports) when that entry's flow installs
    the override. It is installed by a top-level statement, a function of the entry itself
    (MoCo's `main_worker`, started by `mp.spawn`), or a function another reached module calls
    by name (`utils.setup_for_distributed(args.rank == 0)`, usually from `init_distributed_mode`)."""
    installers: Dict[Path, Set[str]] = {}  # module -> its functions that replace print
    for path, m in modules.items():
        for node in m.tree.body:
            if _assigns_builtin_print(node):
                installers.setdefault(path, set()).add(
                    node.name if isinstance(node, FUNC_TYPES) else "")
    if not installers:
        return set()
    called: Dict[Path, Set[str]] = {}
    for s in scopes:
        called.setdefault(s.module.path, set()).update(
            (dotted_name(c.func) or "").rsplit(".", 1)[-1] for c in s.calls)
    out: Set[Path] = set()
    for entry in entries:
        reached, todo = {entry}, [entry]
        while todo:
            for dep in graph.imports.get(todo.pop(), ()):
                if dep not in reached:
                    reached.add(dep)
                    todo.append(dep)
        names = set().union(*(called.get(p, set()) for p in reached))
        if any(p == entry or "" in funcs or funcs & names
               for p, funcs in installers.items() if p in reached):
            out |= reached
    return out


def _calls_from_elsewhere(modules: Dict[Path, _Module], scopes: List[_Scope]):
    """(module, qual) of the functions other modules call, and those with a call outside any
    rank guard."""
    called: Set[Tuple[Path, str]] = set()
    unguarded: Set[Tuple[Path, str]] = set()
    for s in scopes:
        guarded = _guarded_calls(s.node.body)
        for call in s.calls:
            target = _callee(s.module, modules, call) or _method_of_instance(s, modules, call)
            if target is None or target[0] == s.module.path:
                continue
            called.add(target[:2])
            if id(call) not in guarded:
                unguarded.add(target[:2])
    return called, unguarded


def _guarded_calls(body: List[ast.stmt], guarded: bool = False, out: Optional[Set[int]] = None) -> Set[int]:
    """ids of the calls in `body` that run only under a rank guard: in the body of `if <rank
    test>:`, or after `if <rank test>: return` (nested functions and classes left out)."""
    out = set() if out is None else out
    for stmt in body:
        if isinstance(stmt, (*FUNC_TYPES, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.If):
            rank = _rank_test(stmt.test)
            _guarded_calls(stmt.body, guarded or rank, out)
            _guarded_calls(stmt.orelse, guarded or (rank and bool(stmt.orelse)), out)
            if rank and not stmt.orelse and isinstance(stmt.body[-1], (ast.Return, ast.Continue, ast.Break)):
                guarded = True  # `if not is_main_process(): return`: the rest runs on some ranks only
            continue
        blocks = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
        blocks += [h.body for h in getattr(stmt, "handlers", ())]
        if blocks:
            for block in blocks:
                _guarded_calls(block, guarded, out)
            heads = [getattr(stmt, f) for f in ("test", "iter", "items") if getattr(stmt, f, None) is not None]
        else:
            heads = [stmt]
        if guarded:
            for head in heads:
                for node in walk(head) if not isinstance(head, list) else (n for h in head for n in walk(h)):
                    if isinstance(node, ast.Call):
                        out.add(id(node))
    return out


def _rank_test(test: ast.AST) -> bool:
    """A test that holds on some ranks only: a comparison of a rank (`rank == 0`,
    `dist.get_rank() == 0`, `args.local_rank in [-1, 0]`) or a main-process predicate
    (`is_main_process()`, `utils.is_master(args)`). The ast twin of the rules' rank_dependent,
    kept to names that hold a rank, not settings about ranks."""
    for node in walk(test):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
        parts = name.lower().split("_")
        if "main" in parts or "master" in parts or "rank0" in parts or (
                "rank" in parts and (parts.index("rank") == 0 or parts[parts.index("rank") - 1] in (
                    "local", "global", "world", "get", "node", "my", "process", "proc"))):
            return True
    return False


def _own_non_loader(s: "_Scope", modules: Dict[Path, _Module], call: ast.Call) -> bool:
    """`DataLoader(data, idx, bs)` of a class of the program that is named like torch's but does
    not derive from it (a hand-made batch iterator): it builds no torch loader."""
    name = dotted_name(call.func) or ""
    klass = s.module.classes.get(name) if "." not in name else None
    target = _callee(s.module, modules, call)
    if klass is None and target is not None:
        klass = modules[target[0]].classes.get(target[1].split(".")[0])
    return klass is not None and not _derives_loader(klass)


def _derives_loader(klass: ast.ClassDef) -> bool:
    """`class X(DataLoader)` (by its base's last name)."""
    return any((dotted_name(b) or "").rsplit(".", 1)[-1] == "DataLoader" for b in klass.bases)


_LIBRARY_DATASETS = ("torchvision.datasets.", "torchaudio.datasets.")


def _library_dataset_classes(modules: Dict[Path, _Module], graph: Graph,
                             library: Dict[Path, Dict[str, str]]) -> Set[Tuple[Path, str]]:
    """The program's classes that derive, directly or through its own classes in any module,
    from a torchvision or torchaudio dataset: built with `download=` they download."""
    direct = set()
    for path, m in modules.items():
        imported = _library_of(path, modules, graph, library)
        for name, klass in m.classes.items():
            for base in klass.bases:
                head, _, rest = (dotted_name(base) or "").partition(".")
                full = imported.get(head)
                if full is not None and f"{full}.{rest}".startswith(_LIBRARY_DATASETS):
                    direct.add((path, name))
    return {(path, name) for path, m in modules.items() for name in m.classes
            if (path, name) in direct or any(b in direct for b in inherited.bases(modules, (path, name)))}


def _picks_parameters(func: ast.AST) -> bool:
    """A function that reads a model's parameters (`for layer in model.modules(): ...
    layer.parameters()`, `model.named_parameters()`) and returns something."""
    nodes = list(walk(func))
    return any(isinstance(n, ast.Return) and n.value is not None for n in nodes) and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("parameters", "named_parameters")
        for n in nodes)


def _walks_modules(func: ast.AST) -> bool:
    """The function walks a model's submodules (`.modules()`, `.children()`, `.named_modules()`)."""
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in ("modules", "children", "named_modules", "named_children") for n in walk(func))


def _loader_subclass(klass: ast.ClassDef) -> bool:
    """`class AudioDataLoader(DataLoader)` whose `__init__` (if any) passes `**kwargs` on, so a
    `sampler=` added at its call sites reaches DataLoader."""
    if not any((dotted_name(b) or "").rsplit(".", 1)[-1] == "DataLoader" for b in klass.bases):
        return False
    for item in klass.body:
        if isinstance(item, FUNC_TYPES) and item.name == "__init__":
            return item.args.kwarg is not None
    return True


def forward_outputs(klass: ast.ClassDef) -> Tuple[FrozenSet[str], ...]:
    """For a `forward()` whose last statement is `return a, b, ...`: the `self.<submodule>`s
    each returned element depends on, following the names forward assigns (in order, through
    `if`/`for` bodies too). Empty when forward returns one value or a starred tuple."""
    forward = next((f for f in klass.body if isinstance(f, FUNC_TYPES) and f.name == "forward"), None)
    if forward is None or not forward.body or not isinstance(forward.body[-1], ast.Return) \
            or not isinstance(forward.body[-1].value, ast.Tuple):
        return ()
    deps: Dict[str, Set[str]] = {}

    def uses(expr: ast.AST) -> Set[str]:
        found: Set[str] = set()
        for node in walk(expr):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                found.add(node.attr)
            elif isinstance(node, ast.Name):
                found |= deps.get(node.id, set())
        return found

    def assign(statements: List[ast.stmt]) -> None:  # in source order, into nested blocks
        for node in statements:
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                got = uses(node.value)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for name in (n.id for t in targets for n in walk(t) if isinstance(n, ast.Name)):
                    deps[name] = deps.get(name, set()) | got
            for block in ("body", "orelse", "finalbody"):
                assign(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                assign(handler.body)

    for _ in range(2):  # twice: a loop body reads names that it assigns later
        assign(forward.body[:-1])
    returned = forward.body[-1].value.elts
    if any(isinstance(e, ast.Starred) for e in returned):
        return ()
    return tuple(frozenset(uses(e)) for e in returned)


def _iterator_builders(modules: Dict[Path, _Module]) -> Dict[Tuple[Path, str], Tuple[int, ...]]:
    """The program's hand-made batch iterators and what builds them, with the positions of the
    data arguments ((-1,): every positional argument, `minibatch(*tensors, batch_size=...)`):
    - classes with `__next__`/`__iter__` that are not datasets, loaders or modules, taking the
      data first (`DatasetIterater(batches, batch_size, device)`, `LMOrderedIterator(data, bsz,
      bptt)`);
    - functions that return one built from a parameter (`build_iterator(dataset, config)`);
    - generator functions slicing parameters into batches (`def minibatch(*tensors,
      batch_size)`, `def batch_iter(data, batch_size)`, `def batches(X, y, bs)` reading `X[idx]`
      and `y[idx]`: both, so the samples of the two stay paired once each is cut by rank)."""
    samplers = _sampler_classes(modules)
    classes = {(p, name): _class_data_positions(c) for p, m in modules.items() for name, c in m.classes.items()
               if _iterator_class(c) and (p, name) not in samplers}
    found = dict(classes)
    for p, m in modules.items():
        local = {name for (q, name) in classes if q == p} | _spellings(m, modules, set(classes))
        for name, func in m.functions.items():
            position = _builder_position(func, local) if "." not in name else None  # not methods:
            if position is not None:  # a Corpus.get_iterator builds from its own attributes
                found[(p, name)] = position
    return found


def _sampler_classes(modules: Dict[Path, _Module]) -> Set[Tuple[Path, str]]:
    """Classes of the program that a call takes as its `sampler=` or `batch_sampler=` (a
    DataLoader's), made in the argument or bound to the name passed: they hand out indices
    (`CategoriesSampler(dataset.label, n_batch, n_way, n_shot)` of few-shot episodes), so they are
    no batch iterators over data, and what they are built from is an index map that must not be
    cut by rank (the loader's batches are shared out instead, `tm.shard_sampler`)."""
    found: Set[Tuple[Path, str]] = set()
    for path, m in modules.items():
        made: Dict[str, List[ast.Call]] = {}
        keywords: List[ast.expr] = []
        for node in walk(m.tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                for target in node.targets:
                    made.setdefault(dotted_name(target) or "", []).append(node.value)
            elif isinstance(node, ast.Call):
                keywords += [k.value for k in node.keywords if k.arg in ("sampler", "batch_sampler")]
        for value in keywords:
            for call in [value] if isinstance(value, ast.Call) else made.get(dotted_name(value) or "", []):
                target = _callee(m, modules, call)
                if target is not None and target[1].endswith(".__init__"):
                    found.add((target[0], target[1][:-len(".__init__")]))
                elif isinstance(call.func, ast.Name) and call.func.id in m.classes:
                    found.add((path, call.func.id))
    return found


def _loader_factories(modules: Dict[Path, _Module],
                      flags: Dict[Tuple[Path, str], Dict[str, Set[bool]]]) -> Set[Tuple[Path, str]]:
    """Module-level functions not named for evaluation that return a DataLoader they build with no
    sampler of their own, shuffling (`shuffle=True`, or a `shuffle` parameter that no call of the
    program sets to False: `def get_loader(file, batch_size, shuffle=True): ... return
    DataLoader(dataset, batch_size, shuffle=shuffle)`): a training loader, which TM201 shards
    where it is built, so a caller that asks it for evaluation data gets it whole
    (`tm.unsharded(get_loader, ...)`). One whose calls pass both True and False builds both
    splits by its flag, which its own module handles."""
    found: Set[Tuple[Path, str]] = set()
    for p, m in modules.items():
        for name, func in m.functions.items():
            if "." in name or splits.verdict(splits.words(name)) == "eval":
                continue
            built = {}
            for n in walk(func):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                        and isinstance(n.value, ast.Call):
                    built[n.targets[0].id] = n.value
            for n in walk(func):
                if not isinstance(n, ast.Return) or n.value is None:
                    continue
                value = built.get(n.value.id) if isinstance(n.value, ast.Name) else n.value
                if not isinstance(value, ast.Call) or (dotted_name(value.func) or "").rsplit(".", 1)[-1] != "DataLoader":
                    continue
                keywords = {k.arg: k.value for k in value.keywords}
                shuffle = keywords.get("shuffle", value.args[2] if len(value.args) > 2 else None)
                if "sampler" in keywords or "batch_sampler" in keywords or len(value.args) > 3:
                    continue
                if isinstance(shuffle, ast.Constant) and shuffle.value is True or isinstance(shuffle, ast.Name) \
                        and False not in flags.get((p, name), {}).get(shuffle.id, {True}):
                    found.add((p, name))
    return found


def _training_params(modules: Dict[Path, _Module]) -> Dict[Tuple[Path, str], Tuple[Tuple[int, str], ...]]:
    """Module-level functions that train on data they are handed (`def train_model(model, db_gen,
    optimizer): for x, y in db_gen: ... loss.backward(); optimizer.step()`): (position, name) of
    each such parameter. A loader the caller hands there is a training loader, whatever its name
    says (`devset_gen`: VoxCeleb's "dev" split is its training set)."""
    found: Dict[Tuple[Path, str], Tuple[Tuple[int, str], ...]] = {}
    for p, m in modules.items():
        for name, func in m.functions.items():
            if "." in name:
                continue
            params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]  # type: ignore[attr-defined]
            trained = []
            for loop in walk(func):
                if not isinstance(loop, ast.For):
                    continue
                it = loop.iter
                while isinstance(it, ast.Call) and it.args and (dotted_name(it.func) or "").rsplit(".", 1)[-1] in (
                        "enumerate", "iter", "tqdm", "trange", "tqdm_notebook"):
                    it = it.args[0]
                if not (isinstance(it, ast.Name) and it.id in params):
                    continue
                calls = [n for stmt in loop.body for n in walk(stmt) if isinstance(n, ast.Call)
                         and isinstance(n.func, ast.Attribute)]
                if any(c.func.attr == "backward" for c in calls) and any(c.func.attr == "step" for c in calls):
                    trained.append(it.id)
            if trained:
                found[(p, name)] = tuple((params.index(x), x) for x in dict.fromkeys(trained))
    return found


def _hand_stepped(func: ast.AST) -> List[str]:
    """Models whose parameters `func` steps by hand from their gradients, with no optimizer
    (`for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`; TM301's `_trained_by_hand`):
    the root name of each, for `_optimizer_params`."""
    out = []
    for loop in walk(func):
        it = loop.iter if isinstance(loop, ast.For) else None
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)
                and it.func.attr in ("parameters", "named_parameters")):
            continue
        target = loop.target
        if it.func.attr == "named_parameters":
            target = target.elts[1] if isinstance(target, ast.Tuple) and len(target.elts) == 2 else None
        owner = dotted_name(it.func.value)
        if not isinstance(target, ast.Name) or not owner:
            continue
        p = target.id

        def is_p(n: ast.AST) -> bool:
            return isinstance(n, ast.Name) and n.id == p or (
                isinstance(n, ast.Attribute) and n.attr == "data" and isinstance(n.value, ast.Name) and n.value.id == p)

        body = [n for stmt in loop.body for n in walk(stmt)]
        reads_grad = any(isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.value, ast.Name)
                         and n.value.id == p for n in body)
        steps = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.endswith("_")
                    and not n.func.attr.startswith("_") and n.func.attr not in ("zero_", "requires_grad_")
                    and is_p(n.func.value) or isinstance(n, ast.AugAssign) and is_p(n.target)
                    or isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and is_p(t) for t in n.targets)
                    for n in body)
        if reads_grad and steps:
            out.append(owner.split(".")[0])
    return out


def _optimizer_params(modules: Dict[Path, _Module]) -> Tuple[Dict[Tuple[Path, str], Tuple[Tuple[int, str], ...]],
                                                              Set[Tuple[Path, str]]]:
    """Module-level functions that build an optimizer over a model they receive and do not wrap
    it themselves (`def train(config, model, train_iter): optimizer = Adam(model.parameters())`),
    and classes whose `__init__` does (`class Trainer: def __init__(self, model, loader): self.opt
    = SGD(model.parameters())`, keyed by the class): (position, name) of that parameter among the
    call's arguments, one for each model it trains (`get_optimizers(d_net, g_net)` builds two). A
    caller in another module passes the model, so that is where the DDP wrap belongs (its own
    module's rules see only a parameter). A function that steps the model's parameters by hand
    (`_hand_stepped`) counts too; those that build no optimizer at all are also returned apart."""
    found: Dict[Tuple[Path, str], Tuple[Tuple[int, str], ...]] = {}
    hand_only: Set[Tuple[Path, str]] = set()
    for p, m in modules.items():
        for name, func in m.functions.items():
            if "." in name and not name.endswith(".__init__"):
                continue
            params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]  # type: ignore[attr-defined]
            if "." in name:
                name, params = name.split(".")[0], params[1:]  # `Trainer(model, ...)`: `self` is not passed
            calls = [n for n in walk(func) if isinstance(n, ast.Call)]
            wrapped = {dotted_name(_strip_moves(c.args[0])) for c in calls if c.args and
                       (dotted_name(c.func) or "").rsplit(".", 1)[-1] in WRAPPERS}
            assigned = {n.targets[0].id: n.value for n in walk(func)
                        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
            trained = [x for c in calls for x in _optimizer_models(c, assigned) if x in params and x not in wrapped]
            by_hand = [x for x in _hand_stepped(func) if x in params and x not in wrapped and x not in trained]
            if trained or by_hand:
                found[(p, name)] = tuple((params.index(x), x) for x in dict.fromkeys(trained + by_hand))
            if by_hand and not trained:
                hand_only.add((p, name))
    return found, hand_only


def iterator_builders_of(definitions: Iterable[ast.stmt]) -> Dict[str, Tuple[int, ...]]:
    """`ModuleView.iterator_builders` of one module alone, from its top-level definitions (a
    file processed without its program: stdin, a fixture)."""
    classes = {d.name: _class_data_positions(d) for d in definitions if isinstance(d, ast.ClassDef) and _iterator_class(d)}
    found = dict(classes)
    for d in definitions:
        if isinstance(d, FUNC_TYPES) and (position := _builder_position(d, set(classes))) is not None:
            found[d.name] = position
    return found


_TRAINING = re.compile(r"train", re.IGNORECASE)
_NOT_TRAINING = re.compile(r"val|dev|test|eval", re.IGNORECASE)


def training_text(text: str) -> bool:
    """A name or expression that says training data (`train_data`, `self.train`, `corpus.train`)
    and not evaluation data (`dev_data`, `valid`, `test_iter`)."""
    return bool(_TRAINING.search(text)) and not _NOT_TRAINING.search(text)


def _training_iterator(call: ast.Call, positions: Tuple[int, ...], function: str) -> bool:
    """`call` builds a hand-made batch iterator over training data: a data argument (at the
    builder's `positions`; every positional one for -1) says training, or it is built in a
    function whose name does (`BPR_train_original`). TM201 shards these (`tm.shard_stream`)."""
    args = [a for a in call.args if not isinstance(a, ast.Starred)]
    args = args if -1 in positions else [args[p] for p in positions if p < len(args)]
    return bool(args) and (any(training_text(ast.unparse(a)) for a in args) or training_text(function))


def _iterator_class(klass: ast.ClassDef) -> bool:
    bases = " ".join(dotted_name(b) or "" for b in klass.bases)
    if any(word in bases for word in ("Dataset", "DataLoader", "Module", "Sampler")):
        return False
    methods = {f.name: f for f in klass.body if isinstance(f, FUNC_TYPES)}
    init = methods.get("__init__")
    if any(isinstance(n, ast.Call) and (dotted_name(n.func) or "").rsplit(".", 1)[-1] == "DataLoader"
           for n in walk(klass)):
        return False  # iterates a DataLoader it builds (`Batches(dataset, bs, shuffle)`): sharded where built
    return ("__next__" in methods or "__iter__" in methods) and init is not None and len(_params(init)) > 1


def _class_data_positions(klass: ast.ClassDef) -> Tuple[int, ...]:
    """The data arguments of an iterator class: the `__init__` parameters it keeps as attributes
    (`self.X = X`) that a method subscripts (`self.X[idx]`, not `self.cfg["bs"]`), so that
    `BatchIterator(X, y, bs)` gets both X and y cut by rank; the first one where none is found."""
    init = next(f for f in klass.body if isinstance(f, FUNC_TYPES) and f.name == "__init__")
    params = [p.arg for p in (*init.args.posonlyargs, *init.args.args)][1:]
    pairs = [(t, n.value) for n in walk(init) if isinstance(n, ast.Assign) for t in n.targets]
    pairs += [p for t, v in pairs if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple)
              and len(t.elts) == len(v.elts) for p in zip(t.elts, v.elts)]  # `self.X, self.y = X, y`
    kept = {t.attr: v.id for t, v in pairs if isinstance(v, ast.Name) and v.id in params
            and isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    read = {n.value.attr for n in walk(klass) if isinstance(n, ast.Subscript) and not isinstance(n.slice, ast.Constant)
            and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}
    return tuple(sorted(params.index(kept[a]) for a in read if a in kept)) or (0,)


def _builder_position(func: ast.AST, iterator_classes: Set[str]) -> Optional[Tuple[int, ...]]:
    """Where the data goes in a function that builds a batch iterator (see `_iterator_builders`):
    for a generator, every parameter it subscripts with something other than a literal key
    (`X[idx]`, `data[i:i + bs]`, not `cfg["bs"]`)."""
    args = func.args  # type: ignore[attr-defined]
    params = [p.arg for p in (*args.posonlyargs, *args.args) if p.arg != "self"]
    vararg = args.vararg
    body = ast.Module(body=func.body, type_ignores=[])  # type: ignore[attr-defined]
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in walk(body)):
        sliced = {dotted_name(n.value) for n in walk(body)
                  if isinstance(n, ast.Subscript) and not isinstance(n.slice, ast.Constant)}
        if vararg is not None and not params:
            return (-1,) if any(isinstance(n, ast.Name) and n.id == vararg.arg for n in walk(body)) else None
        return tuple(i for i, name in enumerate(params) if name in sliced) or None
    built: Dict[str, int] = {}
    for node in walk(body):
        call = node.value if isinstance(node, (ast.Assign, ast.Return)) else None
        if not (isinstance(call, ast.Call) and (dotted_name(call.func) or "") in iterator_classes and call.args):
            continue
        data = dotted_name(call.args[0])
        if data in params:
            if isinstance(node, ast.Return):
                return (params.index(data),)
            for t in node.targets:
                if isinstance(t, ast.Name):
                    built[t.id] = params.index(data)
    for node in walk(body):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Name) and node.value.id in built:
            return (built[node.value.id],)
    return None


def _dp_subclass(klass: ast.ClassDef) -> bool:
    """`class BalancedDataParallel(DataParallel)`: a DataParallel under another name."""
    return any((dotted_name(b) or "").rsplit(".", 1)[-1] == "DataParallel" for b in klass.bases)


def _dp_module_position(klass: ast.ClassDef) -> int:
    """Where the wrapped module sits among the positional arguments of the subclass: its
    `__init__`'s `module`/`model` parameter, or the first of `*args` passed on to
    DataParallel (`def __init__(self, gpu0_bsz, *args, **kwargs)`: 1); 0 without `__init__`."""
    for item in klass.body:
        if isinstance(item, FUNC_TYPES) and item.name == "__init__":
            names = [a.arg for a in item.args.posonlyargs + item.args.args][1:]
            for i, name in enumerate(names):
                if name in ("module", "model", "net", "network"):
                    return i
            return len(names) if item.args.vararg is not None else 0
    return 0


_CLIPS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"})


def _clips(func: ast.AST) -> bool:
    """A function that clips gradients (`torch.nn.utils.clip_grad_norm_(...)` in its body), or
    changes them in place by hand (`param.grad.data.clamp_(-clip, clip)`, PraNet's
    `clip_gradient(optimizer, clip)`): under a GradScaler they must be unscaled first."""
    return any(isinstance(n, ast.Call) and ((dotted_name(n.func) or "").rsplit(".", 1)[-1] in _CLIPS
                                            or _changes_grad(n)) for n in walk(func))


def _changes_grad(call: ast.Call) -> bool:
    """`p.grad.data.clamp_(...)`, `p.grad.mul_(s)`: an in-place method on a gradient."""
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr.endswith("_") and not func.attr.startswith("_") and any(
        isinstance(n, ast.Attribute) and n.attr == "grad" for n in walk(func.value))


def _spellings(m: _Module, modules: Dict[Path, _Module], classes: Set[Tuple[Path, str]]) -> Set[str]:
    """How module `m` names the given symbols of the program (`(path, name)`): its own by their
    names, imported ones by their local names, those of an imported module as `module.name`."""
    out = {name for (p, name) in classes if p == m.path}
    for local, (path, symbol) in m.imports.items():
        if symbol is not None and (path, symbol) in classes:
            out.add(local)
        elif symbol is None:
            out |= {f"{local}.{name}" for (p, name) in classes if p == path}
            # what the module re-exports (a package's `__init__` with `from .optim_util import *`)
            package = modules.get(path)
            if package is not None:
                out |= {f"{local}.{name}" for name, bound in package.imports.items()
                        if bound[1] is not None and bound in classes}
    return out


def _instance_attrs(modules: Dict[Path, _Module], class_models: Dict[Tuple[Path, str], Set[str]],
                    attrs: Dict[Tuple[Path, str], Set[str]]) -> Dict[Tuple[Path, str], Set[str]]:
    """Class -> the `self.` attributes its instances hold wrapped: those the class (or a base
    class of the program) trains, which TM301 wraps where it builds their optimizer, and those it
    stores from a parameter that receives a wrapped model. `trainer.model` of
    `trainer = Trainer(cfg)` is then the wrapped model wherever the trainer is made."""
    own: Dict[Tuple[Path, str], Set[str]] = {}
    for key, names in class_models.items():
        own.setdefault(key, set()).update(n[len("self."):] for n in names if n.count(".") == 1)
    for key, names in attrs.items():
        own.setdefault(key, set()).update(names)
    out: Dict[Tuple[Path, str], Set[str]] = {}
    for path, m in modules.items():
        for name in m.classes:
            key = (path, name)
            held = set(own.get(key, ()))
            for base in inherited.bases(modules, key):
                held |= own.get(base, set())
            if held:
                out[key] = held
    return out


def _self_trained(modules: Dict[Path, _Module]) -> Set[Tuple[Path, str]]:
    """Modules of the program that build their own optimizer over `self.parameters()`
    (`self.optimizer = Adam(self.parameters(), lr)` in `__init__`, as session-recommendation
    and some GAN models do): each instance is wrapped where it is made (see `_made_classes`),
    its optimizer already holding the parameters that DDP keeps."""
    return {(p, name) for p, m in modules.items() for name, c in m.classes.items()
            if any(isinstance(n, ast.Call) and "self" in _optimizer_models(n) for n in walk(c))}


def _made_classes(modules: Dict[Path, _Module], scopes: List["_Scope"],
                  classes: Set[Tuple[Path, str]]) -> Set[Tuple[Path, str]]:
    """Those of `classes` that some module makes and binds to a name (`model = SessionGraph(opt,
    n)`, also through a move, `trans_to_cuda(SessionGraph(...))`): TM301 wraps them there."""
    found: Set[Tuple[Path, str]] = set()
    for s in scopes:
        for a in s.assigns:
            made = made_class(a.value)
            if made is None or not any(dotted_name(t) for t in a.targets):
                continue
            key = _made_key(s.module, modules, made)
            if key in classes:
                found.add(key)
    return found


def _made_key(module: _Module, modules: Dict[Path, _Module], made: ast.Call) -> Optional[Tuple[Path, str]]:
    """The program class (module, name) that the call `made` builds, of another module or its own."""
    target = _callee(module, modules, made)
    if target is not None and target[1].endswith(".__init__"):
        return target[0], target[1][:-len(".__init__")]
    if isinstance(made.func, ast.Name) and made.func.id in module.classes:
        return module.path, made.func.id
    return None


def made_class(value: ast.AST) -> Optional[ast.Call]:
    """The call that makes the object `value` holds: `Net(...)`, also moved (`Net(...).cuda()`)
    or handed through a one-argument helper (`trans_to_cuda(Net(...))`)."""
    value = _strip_moves(value)
    if isinstance(value, ast.Call) and len(value.args) == 1 and not value.keywords \
            and isinstance(_strip_moves(value.args[0]), ast.Call):
        inner = _strip_moves(value.args[0])
        if isinstance(inner, ast.Call) and (dotted_name(inner.func) or "").rsplit(".", 1)[-1][:1].isupper():
            return inner
    return value if isinstance(value, ast.Call) else None


def _qual(s: _Scope) -> str:
    if isinstance(s.node, ast.Module):
        return "<module>"
    return f"{s.klass}.{s.node.name}" if s.klass else s.node.name  # type: ignore[attr-defined]


def _callee(module: _Module, modules: Dict[Path, _Module], call: ast.Call) -> Optional[Tuple[Path, str, bool]]:
    """(module, "f" or "Cls.__init__", skip self) for a call of another module's function/class."""
    func = call.func
    if isinstance(func, ast.Name):
        bound = module.imports.get(func.id)
        if bound is None or bound[1] is None:
            return None
        path, symbol = bound
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        bound = module.imports.get(func.value.id)
        if bound is None or bound[1] is not None:
            return None
        path, symbol = bound[0], func.attr
    else:
        return None
    target = modules.get(path)
    if target is None:
        return None
    if symbol not in target.classes and symbol not in target.functions and symbol in target.imports:
        # re-exported by the module it is reached through (`util.clip_grad_norm`, where
        # util/__init__.py has `from util.optim_util import *`)
        path, symbol = target.imports[symbol]
        target = modules.get(path)
        if target is None or symbol is None:
            return None
    if symbol in target.classes:
        return path, f"{symbol}.__init__", True
    if symbol in target.functions:
        return path, symbol, False
    return None


def _method_of_instance(s: "_Scope", modules: Dict[Path, _Module], call: ast.Call) -> Optional[Tuple[Path, str, bool]]:
    """`stopper(...)` -> `EarlyStopping.__call__`, `self.saver.save(...)` -> `Saver.save`,
    `Trainer(cfg).fit(loader)` -> `Trainer.fit`; a method the class inherits from a base class
    of the program -> the base's."""
    func = call.func
    name, method = dotted_name(func), "__call__"
    if name not in s.instances and isinstance(func, ast.Attribute):
        name, method = dotted_name(func.value), func.attr
    if name in s.instances:
        found = s.instances[name]
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call):
        made = _callee(s.module, modules, func.value)
        if made is None or not made[1].endswith(".__init__"):
            return None
        found = (made[0], made[1][:-len(".__init__")])
    else:
        return None
    for path, klass in (found, *inherited.bases(modules, found)):
        qual = f"{klass}.{method}"
        if qual in modules[path].functions:
            return path, qual, True
    return None


def _bind(func: ast.AST, call: ast.Call, skip_self: bool) -> List[Tuple[str, ast.AST]]:
    params = _params(func)
    positional = params[1:] if skip_self else params
    out = []
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Starred):
            break
        if i < len(positional):
            out.append((positional[i], arg))
    var_kw = func.args.kwarg.arg if func.args.kwarg is not None else None  # type: ignore[attr-defined]
    for kw in call.keywords:
        if kw.arg and kw.arg in params:
            out.append((kw.arg, kw.value))
        elif kw.arg and var_kw:  # `def __init__(self, **kwargs)`: read as `kwargs['model']`
            out.append((f"{var_kw}['{kw.arg}']", kw.value))
    return out


def _ref(node: ast.AST) -> Optional[str]:
    """`name`, `a.b`, or `kwargs['model']` / `kwargs.get('model')`: how a parameter is read."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return f"{node.value.id}['{node.slice.value}']"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and isinstance(node.func.value, ast.Name) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return f"{node.func.value.id}['{node.args[0].value}']"
    return dotted_name(node)


def _self_stores(init: ast.AST, param: str) -> List[str]:
    """`self.x = param` (or `param.to(dev)`, a tuple target) in `__init__`: the attributes."""
    out = []
    for n in walk(init):
        if not isinstance(n, ast.Assign):
            continue
        pairs = []
        for t in n.targets:
            if isinstance(t, ast.Tuple) and isinstance(n.value, ast.Tuple):
                pairs += list(zip(t.elts, n.value.elts))
            else:
                pairs.append((t, n.value))
        for t, v in pairs:
            name = dotted_name(t)
            if name and name.startswith("self.") and name.count(".") == 1 and _ref(_strip_moves(v)) == param:
                out.append(name[5:])
    return out


def _torch_programs(graph: Graph, modules: Dict[Path, "_Module"]) -> Set[Path]:
    """The modules connected by imports (either direction) to a module that uses torch: the
    parts of a torch program, also those that never mention torch (a helpers.py that pickles
    results and prints), which the engine must therefore read."""
    neighbours: Dict[Path, Set[Path]] = {p: set() for p in modules}
    for path, deps in graph.imports.items():
        for dep in deps:
            if path in neighbours and dep in neighbours:
                neighbours[path].add(dep)
                neighbours[dep].add(path)
    out: Set[Path] = set()
    todo = [p for p in modules if _uses_torch(graph.statements.get(p, ()))]
    while todo:
        path = todo.pop()
        if path not in out:
            out.add(path)
            todo.extend(neighbours[path] - out)
    return out


def _uses_torch(statements) -> bool:
    for node in statements:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("torch", "apex") for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "apex") and not node.level:
            return True
    return False

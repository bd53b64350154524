"""Models that a class trains but one of its base classes builds: `class Classifier(BaseTrainer)`
steps an optimizer over `self.model.parameters()`, while `BaseTrainer.__init__` (often in another
module) assigns `self.model = self.build_model()`.

The wrap belongs where the model is built, in the base class: the subclass's module sees no
assignment to wrap after, and the base class's module sees no optimizer. So the program tells
the base class's module which attributes to wrap (`ModuleView.base_wraps`) and the subclass's
module that they hold a wrapped model (`ModuleView.wrapped_attrs`), so it needs no TODO and its
custom attribute reads go through `tm.unwrap`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Set, Tuple

from torchmigrate.program.astwalk import walk
from torchmigrate.program.classes import project_base
from torchmigrate.program.search_path import dotted_name

if TYPE_CHECKING:
    from torchmigrate.program.facts import _Module

Key = Tuple[Path, str]  # (module, class name)


def _assigns(klass: ast.ClassDef, attr: str) -> bool:
    """Some method of `klass` assigns `self.<attr>`."""
    for node in walk(klass):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for n in walk(t):
                if isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) \
                        and n.value.id == "self":
                    return True
    return False


def _wraps(klass: ast.ClassDef) -> bool:
    """Some method of `klass` wraps a model itself (DataParallel, DDP, `tm.wrap_model`)."""
    from torchmigrate.program.facts import WRAPPERS

    return any(isinstance(n, ast.Call) and (dotted_name(n.func) or "").rsplit(".", 1)[-1] in WRAPPERS
               for n in walk(klass))


def bases(modules: Dict[Path, "_Module"], key: Key) -> List[Key]:
    """The program's own base classes of `key`, nearest first (breadth first, each once)."""
    out: List[Key] = []
    todo = [key]
    while todo:
        path, name = todo.pop(0)
        m = modules[path]
        for base in m.classes[name].bases:
            found = project_base(modules, m, base)
            if found is not None and found not in out and found != key:
                out.append(found)
                todo.append(found)
    return out


def trained_in_bases(modules: Dict[Path, "_Module"], class_models: Dict[Key, Set[str]]
                     ) -> Tuple[Dict[Key, Set[str]], Dict[Key, Set[str]]]:
    """(base class -> attributes it must wrap, subclass -> attributes a base class wraps for
    it), for every `self.<attr>` a class trains (`class_models`: "self.model") and never
    assigns itself, assigned by its nearest base class of the program that does."""
    to_wrap: Dict[Key, Set[str]] = {}
    wrapped: Dict[Key, Set[str]] = {}
    for key, names in class_models.items():
        klass = modules[key[0]].classes.get(key[1])
        if klass is None:
            continue
        if _wraps(klass):
            continue  # its own module wraps (a template method returning `DataParallel(model)`)
        for name in names:
            attr = name[len("self."):] if name.startswith("self.") else None
            if not attr or "." in attr or _assigns(klass, attr):
                continue
            for base in bases(modules, key):
                if _assigns(modules[base[0]].classes[base[1]], attr):
                    to_wrap.setdefault(base, set()).add(attr)
                    wrapped.setdefault(key, set()).add(attr)
                    break
    return to_wrap, wrapped


def of_tree(tree: ast.Module, path: Path) -> Dict[str, object]:
    """The `ModuleView` fields above for a module processed without its program (a fixture,
    stdin, `--no-follow`): its own classes only."""
    from torchmigrate.program.facts import _index, _Module, _optimizer_models, _self_trained, made_class

    m = _Module(path, tree)
    _index(m)
    trained: Dict[Key, Set[str]] = {}
    for name, klass in m.classes.items():
        found = {x for n in walk(klass) if isinstance(n, ast.Call) for x in _optimizer_models(n) if x.startswith("self.")}
        if found:
            trained[(path, name)] = found
    to_wrap, wrapped = trained_in_bases({path: m}, trained)
    own = {name for _, name in _self_trained({path: m})}
    calls = (made_class(n.value) for n in walk(tree) if isinstance(n, ast.Assign))
    made = {call.func.id for call in calls if call is not None and isinstance(call.func, ast.Name)}
    return {"base_wraps": {k: frozenset(a) for (_, k), a in to_wrap.items()},
            "wrapped_attrs": {k: frozenset(a) for (_, k), a in wrapped.items()},
            "self_trained": frozenset(own), "wrapped_where_made": frozenset(own & made)}

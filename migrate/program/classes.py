"""What each class of the program is: a module, an optimizer, a tensor, or none of these.

Cross-module, from CPython's `ast` (see `facts`): a class's kind follows its bases through the
program's own classes (`class FocalLoss(BaseLoss)`, `BaseLoss` in another module) to a library
base, read by its spelling (`nn.Module`, `torch.optim.Optimizer`, `object`). The rules that
rewrite a call on an object ask its kind (`types`): `x.cuda()` becomes `x.to(device)` only on a
tensor or a module, a GradScaler steps only a torch optimizer. A class whose chain ends in a base
the program cannot see (`SomeLibrary.Base`) has no kind: nothing is assumed of it.

Besides the kind, an `OptimizerWrapper` describes a project class that is stepped like an
optimizer but is not one (`ScheduledOptim`, `NoamOpt`: no `param_groups`, a `step()` that
updates the learning rate and then steps the torch optimizer it holds).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Dict, NamedTuple, Optional, Sequence, Tuple

from torchmigrate.program.search_path import dotted_name
from torchmigrate.program.astwalk import walk

if TYPE_CHECKING:
    from pathlib import Path

    from torchmigrate.program.facts import _Module

MODULE = "module"
OPTIMIZER = "optimizer"
TENSOR = "tensor"
OTHER = "other"  # a plain class of the program: none of the above

# Library bases that make a class none of the kinds above (builtins and the standard library).
_PLAIN_BASES = frozenset({
    "object", "ABC", "abc.ABC", "dict", "list", "tuple", "set", "str", "int", "float", "Exception",
    "Enum", "enum.Enum", "IntEnum", "enum.IntEnum", "NamedTuple", "typing.NamedTuple", "Generic",
    "typing.Generic", "Protocol", "typing.Protocol", "OrderedDict", "collections.OrderedDict",
    "defaultdict", "collections.defaultdict", "SimpleNamespace", "types.SimpleNamespace",
    "Dataset", "torch.utils.data.Dataset", "data.Dataset", "IterableDataset", "Sampler",
    "DataLoader", "torch.utils.data.DataLoader", "_LRScheduler", "LRScheduler",
    "lr_scheduler._LRScheduler", "lr_scheduler.LRScheduler", "torch.optim.lr_scheduler._LRScheduler",
    "torch.optim.lr_scheduler.LRScheduler",
})
_FUNC_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)
# torch functions whose result is not a tensor (or not always one)
_NOT_TENSOR_FUNCS = frozenset({
    "load", "save", "device", "manual_seed", "seed", "initial_seed", "no_grad", "enable_grad", "set_grad_enabled",
    "inference_mode", "is_tensor", "is_floating_point", "numel", "get_default_dtype", "set_default_dtype",
    "set_printoptions", "compile", "Generator", "Size", "dtype", "finfo", "iinfo", "autocast", "use_deterministic_algorithms",
    "set_num_threads", "get_num_threads", "is_grad_enabled", "typename", "get_rng_state", "set_rng_state",
})
# packages whose callables build models
_MODEL_FACTORIES = ("torchvision.models.", "timm.create_model", "timm.models.", "torch.hub.load",
                    "segmentation_models_pytorch.", "efficientnet_pytorch.", "pretrainedmodels.")
_TM = "torchmigrate.runtime."


class OptimizerWrapper(NamedTuple):
    """A class of the program that is stepped like an optimizer but is not a torch optimizer."""

    inner: str  # the `self.` attribute holding the torch optimizer its `step()` steps ("" unknown)
    delegates: bool  # its `step()` only steps that optimizer (nothing else happens in it)


def library_base_kind(text: str) -> Optional[str]:
    """The kind of a class deriving from the library class spelled `text`, or None."""
    if text in _PLAIN_BASES:
        return OTHER
    last = text.rsplit(".", 1)[-1]
    if last in ("Tensor", "Parameter"):
        return TENSOR
    if last == "Optimizer" or text.startswith(("optim.", "torch.optim.")) and last[:1].isupper():
        return OPTIMIZER
    if last.endswith(("Module", "ModuleList", "ModuleDict", "Sequential", "Loss")) \
            or text.startswith(("nn.", "torch.nn.")):
        return MODULE
    return None


def library_call_kind(name: str) -> Optional[str]:
    """The kind of what a call of the library callable `name` (resolved) returns."""
    if name.startswith(_TM):
        return MODULE if name[len(_TM):] in ("wrap_model", "unwrap", "sync_batchnorm") else None
    if name.startswith(_MODEL_FACTORIES):
        last = name.rsplit(".", 1)[-1]
        return MODULE if not last.startswith(("get_", "list_", "_")) and "Weights" not in last else None
    if name.startswith("transformers.") and name.endswith(".from_pretrained"):
        owner = name.rsplit(".", 2)[-2]
        return MODULE if owner.endswith("Model") or "For" in owner else None
    if name in ("copy.deepcopy",):
        return None
    if not name.startswith("torch."):
        return None
    rest = name[len("torch."):]
    if rest in ("autograd.Variable", "autograd.variable.Variable"):
        return TENSOR  # `Variable(x)` is `x` since torch 0.4
    if rest.startswith(("nn.functional.", "linalg.", "fft.", "special.")):
        return TENSOR
    if rest.startswith("nn.") and "." not in rest[3:]:
        last = rest[3:]
        if last in ("Parameter", "Buffer"):
            return TENSOR
        return MODULE if last[:1].isupper() else None
    if rest.startswith("nn.parallel.") or rest.startswith("nn.modules."):
        return MODULE if rest.rsplit(".", 1)[-1][:1].isupper() else None
    if rest.startswith("optim.") and rest.count(".") == 1 and rest[6:7].isupper():
        return OPTIMIZER
    if "." not in rest:
        if rest.endswith("Tensor") or rest == "tensor":
            return TENSOR
        if rest[:1].islower() and rest not in _NOT_TENSOR_FUNCS and not rest.startswith(("set_", "get_", "is_")):
            return TENSOR
    return None


def project_base(modules: Dict["Path", "_Module"], m: "_Module", base: ast.expr) -> Optional[Tuple["Path", str]]:
    """(module, class name) of the program's own class that `base`, a base written in module `m`,
    names (`BaseTrainer`, `base.BaseTrainer`, an imported name), or None for a library class."""
    text = dotted_name(base)
    if text is None:
        return None
    head, _, rest = text.partition(".")
    if not rest and text in m.classes:
        return m.path, text
    bound = m.imports.get(head)
    if bound is not None:
        path, symbol = bound
        other = modules.get(path)
        if other is not None:
            if symbol is not None and not rest and symbol in other.classes:
                return path, symbol
            if symbol is None and rest in other.classes:
                return path, rest
    return None


def class_kinds(modules: Dict[Path, _Module]) -> Dict[Tuple[Path, str], Optional[str]]:
    """(module, class name) -> the class's kind (None: unknown), for every class of the program."""
    kinds: Dict[Tuple[Path, str], Optional[str]] = {}

    def kind(path: Path, name: str) -> Optional[str]:
        key = (path, name)
        if key in kinds:
            return kinds[key]
        kinds[key] = None  # a cycle of bases (broken code) has no kind
        found = [base_kind(modules[path], b) for b in modules[path].classes[name].bases]
        result: Optional[str] = OTHER
        for k in (MODULE, TENSOR, OPTIMIZER):
            if k in found:
                result = k
                break
        else:
            if None in found:
                result = None
        kinds[key] = result
        return result

    def base_kind(m: _Module, base: ast.expr) -> Optional[str]:
        text = dotted_name(base)
        if text is None:
            return None
        own = project_base(modules, m, base)
        return kind(*own) if own is not None else library_base_kind(text)

    for path, m in modules.items():
        for name in m.classes:
            kind(path, name)
    return kinds


def optimizer_wrapper(klass: ast.ClassDef) -> Optional[OptimizerWrapper]:
    """`klass` (a plain class of the program) is stepped like an optimizer: it has a `step()`
    method. Its inner optimizer is the `self.X` whose `step()` that method calls."""
    step = next((f for f in klass.body if isinstance(f, _FUNC_TYPES) and f.name == "step"), None)
    if step is None:
        return None
    inner = ""
    for node in walk(step):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            owner = dotted_name(node.func.value) or ""
            if owner.startswith("self.") and owner.count(".") == 1:
                inner = owner[len("self."):]
                break
    body = [s for s in step.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    delegates = bool(inner) and len(body) == 1 and isinstance(body[0], (ast.Expr, ast.Return)) \
        and isinstance(body[0].value, ast.Call) and dotted_name(body[0].value.func) == f"self.{inner}.step"
    return OptimizerWrapper(inner, delegates)


# how programs spell torch's modules without importing them under their own names
_SPELLED = (("nn.functional.", "torch.nn.functional."), ("F.", "torch.nn.functional."), ("nn.", "torch.nn."),
            ("optim.", "torch.optim."))
_MOVES = frozenset({"to", "cuda", "cpu", "float", "half", "double", "detach", "clone", "contiguous"})


def argument_kind(m: _Module, modules: Dict[Path, _Module], kinds: Dict[Tuple[Path, str], Optional[str]],
                  node: ast.AST, assigns: Sequence[ast.Assign] = ()) -> Tuple[Optional[str], Optional[Tuple[Path, str]]]:
    """(kind, program class) of an argument a call passes, from what makes it: a torch call
    spelled as programs spell them (`torch.ones(4)`, `nn.Linear(...)`), a class of the program,
    a move of either (`torch.ones(4).cuda()`), or a name every one of `assigns` (the calling
    scope's) binds to one of those. (None, None) for anything else."""
    if isinstance(node, ast.Name):
        values = [a.value for a in assigns if any(isinstance(t, ast.Name) and t.id == node.id for t in a.targets)]
        found = {argument_kind(m, modules, kinds, v) for v in values}
        return found.pop() if len(found) == 1 else (None, None)
    if not isinstance(node, ast.Call):
        return None, None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in _MOVES:
        inner = argument_kind(m, modules, kinds, func.value)
        if inner[0] is not None:
            return inner
    name = dotted_name(func)
    if name is None:
        return None, None
    head, _, rest = name.partition(".")
    key: Optional[Tuple[Path, str]] = None
    if not rest and name in m.classes:
        key = (m.path, name)
    bound = m.imports.get(head)
    if key is None and bound is not None and bound[0] in modules:
        path, symbol = bound
        if symbol is not None and not rest:
            key = (path, symbol)
        elif symbol is None and rest:
            key = (path, rest)
        if key is None or key[1] not in modules[path].classes:
            return None, None
    if key is not None:
        return kinds.get(key), key
    for short, full in _SPELLED:
        if name.startswith(short):
            name = full + name[len(short):]
            break
    return library_call_kind(name), None

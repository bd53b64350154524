"""Code of the program whose numbers change meaning under autocast, wherever it sits: a fact of
the whole program, because the forward that reaches it (a model's layers, a loss class, an ODE
solver called from a model) is usually in another module than the training step that would get
`with tm.autocast():`.

Kinds (`Hazard.kind`):
- `BCE`: `nn.BCELoss` / `F.binary_cross_entropy` (built or called): autocast refuses it on CUDA
  ("unsafe to autocast"); the training module sees it only when it is in its own file;
- `DTYPE_TABLE`: a table keyed by floating dtypes without the half ones
  (`{torch.float32: 4e-3, torch.float64: 1e-5}`), read by a tensor's dtype (`eps[x.dtype]`): under
  bf16 autocast the lookup raises KeyError (the hyperbolic-manifold style);
- `BILINEAR`: `nn.Bilinear` / `F.bilinear`, and `torch.cross`, which take operands of one dtype:
  inputs that come from layers autocast ran in half precision meet a float32 weight or tensor and
  it raises ("All tensors must have the same dtype"; CPU autocast does not promote them);
- `SOLVER`: an adaptive ODE/SDE solver (`torchdiffeq.odeint`, `torchsde.sdeint`): its error
  control compares steps against tolerances (1e-5) far below bf16's resolution, so it takes many
  more steps or never meets them;
- `LOG_OF_PROB`: a hand-written log of a probability (`torch.log(torch.sigmoid(x))`,
  `torch.log(1 - torch.sigmoid(torch.mm(a, b)))`, `x.softmax(-1).log()`): in bf16/fp16 the
  sigmoid or softmax rounds to exactly 0 or 1 well inside the range training reaches, and the log
  becomes -inf, then NaN (`F.logsigmoid` / `log_softmax` compute the same safely);
- `LOG_DET`: a change-of-variables log-determinant summed over a flow's layers (`sldj`, `log_det`,
  `logdet` accumulated, `torch.slogdet`): the density of a normalizing flow is exact only if those
  sums are, and bf16 keeps 8 bits of mantissa: the log-likelihood and the trained model drift
  (Flow++: bits per dim 10.5 against 9.71 after two epochs);
- `FORWARD_NUMPY`: `.numpy()` inside a forward (a module's `forward`, the methods of its class and
  the functions of its file that it calls): under autocast the tensor is bf16/fp16 there, and bf16
  has no numpy dtype (TypeError), while fp16 silently computes the rest of the forward at half
  precision in numpy. The training step cannot convert what it never sees.

The AMP plan adds no autocast (and no GradScaler) to a program with one of them, and says where.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from torchmigrate.program.astwalk import walk
from torchmigrate.program.search_path import dotted_name

BCE, DTYPE_TABLE, SOLVER, BILINEAR, LOG_OF_PROB, FORWARD_NUMPY, LOG_DET = (
    "bce", "dtype-table", "solver", "bilinear", "log-of-prob", "forward-numpy", "log-det")

_BCE_NAMES = frozenset({"torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss", "torch.nn.functional.binary_cross_entropy"})
_SOLVER_PACKAGES = ("torchdiffeq", "torchsde")
_BILINEAR_NAMES = frozenset({"torch.nn.Bilinear", "torch.nn.modules.linear.Bilinear", "torch.nn.functional.bilinear",
                             "torch.bilinear"})
# also refuse operands of two dtypes, and CPU autocast does not promote them (`torch.cross` of a
# layer's bf16 output and a float32 tensor: "expected scalar type BFloat16 but found Float")
_SAME_DTYPE_NAMES = frozenset({"torch.cross", "torch.linalg.cross"})
_LOGS = frozenset({"log", "log2", "log10"})
# names of a change-of-variables log-determinant: `sldj`, `ldj`, `log_det`, `logdet`, `log_abs_det_jacobian`
_LOG_DET_NAME = re.compile(r"^(s?ldj|sum_log_det\w*|log_?(abs_?)?det(_?jac\w*)?|logdets?)$", re.IGNORECASE)
_LOG_DET_CALLS = frozenset({"torch.slogdet", "torch.logdet", "torch.linalg.slogdet"})
_PROBS = frozenset({"sigmoid", "softmax"})
_FULL = frozenset({"float32", "float64", "float", "double"})
_HALF = frozenset({"float16", "bfloat16", "half"})


@dataclass(frozen=True)
class Hazard:
    path: Path
    line: int
    kind: str
    what: str  # as the code spells it: `nn.BCELoss`, `odeint`, the table's first keys

    @property
    def location(self) -> str:
        return f"{self.path.name}:{self.line}"

    def reason(self, also: Iterable["Hazard"] = ()) -> str:
        """Why the program trains in float32 (or must change), naming this hazard and `also`,
        more of the same kind."""
        where = ", ".join(f"{h.location} `{h.what}`" for h in (self, *also))
        if self.kind == BCE:
            return (f"{where} computes a BCE loss, which raises under CUDA autocast (unsafe in fp16): use "
                    "`BCEWithLogitsLoss` on the logits, then add `with tm.autocast():` and `tm.GradScaler()`")
        if self.kind == BILINEAR:
            return (f"{where} takes operands of one dtype (a bilinear layer, a cross product), which autocast "
                    "does not cast: inputs from layers run in bf16/fp16 meet a float32 weight or tensor and it "
                    "raises, so the program trains in float32")
        if self.kind == DTYPE_TABLE:
            return (f"{where} is a table keyed by float32/float64 that the program reads by a tensor's dtype: "
                    "under bf16/fp16 autocast that lookup raises KeyError, so the program trains in float32")
        if self.kind == LOG_OF_PROB:
            return (f"{where}: the log of a sigmoid or softmax taken by hand; in bf16/fp16 the probability "
                    "rounds to exactly 0 or 1 and the log becomes -inf (then NaN), so the program trains in "
                    "float32 (F.logsigmoid / log_softmax compute it safely and would allow `with tm.autocast():`)")
        if self.kind == LOG_DET:
            return (f"{where}: a flow's log-determinant summed over its layers, which bf16/fp16 cannot keep "
                    "exact (8 bits of mantissa in bf16): the log-likelihood and the trained model would drift, so "
                    "the program trains in float32")
        if self.kind == FORWARD_NUMPY:
            return (f"{where} converts a tensor to numpy inside a forward: under bf16/fp16 autocast it has no "
                    "numpy dtype (TypeError), so the program trains in float32 (`.float()` before `.numpy()` "
                    "would allow `with tm.autocast():`)")
        return (f"{where} is an adaptive ODE/SDE solver: its error control works at tolerances far below "
                "bf16/fp16 resolution, so the program trains in float32")


def _qualified(spelled: Optional[str], library: Dict[str, str]) -> Optional[str]:
    """`nn.BCELoss` -> `torch.nn.BCELoss` through the module's library imports."""
    if not spelled:
        return None
    head, _, rest = spelled.partition(".")
    full = library.get(head)
    if full is None:
        return None
    return f"{full}.{rest}" if rest else full


def _float_key(node: ast.AST, library: Dict[str, str]) -> Optional[str]:
    """`torch.float32` (or `th.float64`, `float32` imported from torch) -> its last name."""
    full = _qualified(dotted_name(node), library)
    if full and full.startswith("torch.") and full.count(".") == 1:
        return full.split(".")[1]
    return None


def _probability(node: ast.AST) -> bool:
    """`torch.sigmoid(x)`, `F.softmax(x, -1)`, `x.sigmoid()`, and `1 - ...` of one."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.left, ast.Constant):
        node = node.right
    if not isinstance(node, ast.Call):
        return False
    name = dotted_name(node.func) or (node.func.attr if isinstance(node.func, ast.Attribute) else "")
    return name.rsplit(".", 1)[-1] in _PROBS


def _log_of_probability(call: ast.Call, full: str) -> bool:
    """`torch.log(torch.sigmoid(x))`, `torch.log(1 - torch.sigmoid(x))`, `x.softmax(-1).log()`
    (`full`: the call's function as the module's imports name it)."""
    if full in ("torch.log", "torch.log2", "torch.log10"):
        return len(call.args) == 1 and _probability(call.args[0])
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in _LOGS and not call.args and _probability(func.value)


def _log_det_sum(node: ast.AST) -> Optional[ast.AST]:
    """The target of `sldj += ...`, `sldj = sldj + ...`, `self.log_det += ...`: a log-determinant
    summed over layers (None for any other statement)."""
    if isinstance(node, ast.AugAssign):
        target = node.target
    elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.BinOp) \
            and isinstance(node.value.op, (ast.Add, ast.Sub)):
        target = node.targets[0]
    else:
        return None
    name = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else ""
    if not _LOG_DET_NAME.match(name):
        return None
    if isinstance(node, ast.Assign) and ast.unparse(node.value.left) != ast.unparse(target):
        return None
    return target


def _reads_by_dtype(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Attribute) and n.slice.attr == "dtype"
               for n in walk(tree))


def _forward_reach(tree: ast.Module) -> List[ast.AST]:
    """The functions a forward runs in this file: every class's `forward`, the methods of that
    class it calls through `self.`, and the file's functions it calls by name, transitively."""
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    reached: List[ast.AST] = []
    for cls in (n for n in walk(tree) if isinstance(n, ast.ClassDef)):
        methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        todo = [methods["forward"]] if "forward" in methods else []
        while todo:
            func = todo.pop()
            if any(func is r for r in reached):
                continue
            reached.append(func)
            for call in (n for n in walk(func) if isinstance(n, ast.Call)):
                f = call.func
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                    todo.extend([methods[f.attr]] if f.attr in methods else [])
                elif isinstance(f, ast.Name) and f.id in functions:
                    todo.append(functions[f.id])
    return reached


def _numpy_calls(func: ast.AST) -> Iterable[ast.Call]:
    """`x.numpy()` calls in `func` (not `x.float().numpy()`, which is safe)."""
    for node in walk(func):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
                and not node.args):
            inner = node.func.value
            while isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr in (
                    "detach", "cpu", "clone", "contiguous", "squeeze", "flatten"):
                inner = inner.func.value
            if not (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr in ("float", "double")):
                yield node


def hazards(trees: Dict[Path, ast.Module], library_of: Callable[[Path], Dict[str, str]]) -> List[Hazard]:
    """Every hazard of the program, in file and line order (dtype tables only where some module
    reads a table by a tensor's dtype)."""
    found: List[Hazard] = []
    by_dtype = any(_reads_by_dtype(t) for t in trees.values())
    for path in sorted(trees):
        library = library_of(path)
        for node in walk(trees[path]):
            if isinstance(node, ast.Call):
                spelled = dotted_name(node.func)
                full = _qualified(spelled, library) or ""
                if full in _BCE_NAMES:
                    found.append(Hazard(path, node.lineno, BCE, spelled or full))
                elif full in _BILINEAR_NAMES or full in _SAME_DTYPE_NAMES:
                    found.append(Hazard(path, node.lineno, BILINEAR, spelled or full))
                elif full.split(".")[0] in _SOLVER_PACKAGES and full.rsplit(".", 1)[-1].startswith(("odeint", "sdeint")):
                    found.append(Hazard(path, node.lineno, SOLVER, spelled or full))
                elif _log_of_probability(node, full):
                    found.append(Hazard(path, node.lineno, LOG_OF_PROB, ast.unparse(node)[:60]))
                elif full in _LOG_DET_CALLS:
                    found.append(Hazard(path, node.lineno, LOG_DET, spelled or full))
            elif isinstance(node, (ast.AugAssign, ast.Assign)) and (summed := _log_det_sum(node)) is not None:
                found.append(Hazard(path, node.lineno, LOG_DET, ast.unparse(summed)))
            elif by_dtype and isinstance(node, ast.Dict):
                keys = [k for k in (_float_key(k, library) for k in node.keys if k is not None) if k]
                if keys and set(keys) <= _FULL | _HALF and not set(keys) & _HALF:
                    found.append(Hazard(path, node.lineno, DTYPE_TABLE, "{" + ", ".join(f"torch.{k}: ..." for k in keys) + "}"))
        for func in _forward_reach(trees[path]):
            found.extend(Hazard(path, c.lineno, FORWARD_NUMPY, ast.unparse(c)[:60]) for c in _numpy_calls(func))
    found.sort(key=lambda h: (str(h.path), h.line))
    return found


def for_module(path: Path, found: Iterable[Hazard]) -> Dict[str, bool]:
    """The hazards the AMP plan of `path` must heed, as reason -> whether the program must change
    to get mixed precision: all but the BCE losses of the module itself, which its own training
    facts see and TM409 reports where they are. A BCE loss asks for a change (BCEWithLogitsLoss);
    a dtype table, a bilinear layer or a solver is a decision (the program trains in float32), not a TODO."""
    by_kind: Dict[str, List[Hazard]] = {}
    for h in found:
        if not (h.kind == BCE and h.path == path):
            by_kind.setdefault(h.kind, []).append(h)
    return {same[0].reason(same[1:]): kind == BCE for kind, same in by_kind.items()}

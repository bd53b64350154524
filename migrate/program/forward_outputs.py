"""Where the outputs of a forward go once they are bound: into numpy (`.numpy()`, a numpy,
sklearn or scipy function), into a function that is not torch's, or into later statements that
read their value (more than their shape, device or an argmax).

Facts only, whatever rules run or options are given: the AMP plan (`rules/amp/plan.py`) asks them
of the statements it would put under autocast, where outputs come out in bf16/fp16. bf16 has no
numpy dtype, the project's metric code may fail on it or lose precision, and a value read after
the block is read in reduced precision unless it is converted back first (`tm.to_float32`).
Built once per module on first use (`output_facts(ctx)`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.syntax import binds, calls_by_method, is_attr_name, method_name, reads, receiver, \
    root_name, scope_of, statements
from torchmigrate.program.training import training_facts
from torchmigrate.syntax.imports import dotted

if TYPE_CHECKING:
    from torchmigrate.rule import Context

# Methods that turn a low-precision tensor into something safe for numpy.
_SAFE_CONVERSIONS = frozenset({"argmax", "argmin", "float", "double", "long", "int", "bool", "item",
                              "tolist", "topk", "eq", "ne", "gt", "lt", "ge", "le", "round"})
# Attributes and methods that read a tensor's shape or order, not its value in its dtype.
_SHAPE_READS = frozenset({"shape", "device", "dtype", "size", "dim", "ndim", "numel", "requires_grad"})
_ORDER_READS = frozenset({"argmax", "argmin", "argsort"})  # same answer in bf16 up to ties
_TENSOR_BUILTINS = frozenset({"len", "print", "isinstance", "float", "int", "range", "enumerate", "zip", "list",
                              "tuple", "min", "max", "sum", "str", "round", "abs"})
_NUMPY_LIBRARIES = ("numpy", "sklearn", "scipy")


class OutputFacts:
    """Where forward outputs go in one module (see the module docstring). The training losses
    (what a training backward differentiates) are never counted as outputs: their backward
    keeps the autocast behaviour."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.training = training_facts(ctx)
        self.losses = {root_name(s.loss) for s in self.training.sites if s.loss is not None}
        self._appends: Optional[List[cst.Call]] = None  # `x.append(...)`, `x.extend(...)`
        self._to_numpy: List[tuple] = []  # `.numpy()` calls and calls into numpy-like libraries

    def numpy_escape(self, body: Sequence[cst.CSTNode]) -> Optional[str]:
        """A name bound by the statements `body` (not a loss) that reaches numpy later in their
        function without a conversion (`out.numpy()`, `np.mean(out)`, also after
        `preds.append(out)`), or None."""
        ctx = self.ctx
        bound: Set[str] = set()
        for s in body:
            bound |= binds(ctx, s)
        bound -= self.losses
        if not bound:
            return None
        # a conversion before the block's first binding reads the value the name held before it
        # (`fake = from_pool(fake.cpu().numpy())` after the generator's block made it float32)
        begin = ctx.position(body[0]) or 0
        first: Dict[str, int] = {}  # name -> where the block first binds it
        for s in body:
            for n in binds(ctx, s):
                first.setdefault(n, ctx.last_position(s) or 0)

        def before_bound(call: cst.Call, hit: str) -> bool:
            return begin <= (ctx.position(call) or 0) < first.get(hit, 0)
        scope = scope_of(ctx, body[0])
        if self._appends is None:
            by_method = calls_by_method(ctx)
            self._appends = [c for c, _ in (*by_method.get("append", ()), *by_method.get("extend", ()))]
            self._to_numpy = list(by_method.get("numpy", ())) + [(c, n) for c, n in analysis.facts(ctx).calls if (
                n and n.split(".")[0] in _NUMPY_LIBRARIES)]
        # one level of taint through lists: `preds.append(outputs)`
        for call in self._appends:
            if scope_of(ctx, call) is scope and reads(ctx, call) & bound and not _plain_numbers(call):
                r = root_name(receiver(call))
                if r:
                    bound.add(r)
        for call, name in self._to_numpy:
            if scope_of(ctx, call) is not scope:
                continue
            if method_name(call) == "numpy":
                chain = receiver(call)
                hit = _chain_hits(chain, bound)
                if hit and not before_bound(call, hit):
                    return hit
            elif name and name.split(".")[0] in _NUMPY_LIBRARIES:
                for a in call.args:
                    if isinstance(a.value, (cst.Name, cst.Attribute)) and dotted(a.value) in bound \
                            and not before_bound(call, dotted(a.value)):
                        return dotted(a.value)
        return None

    def leave_torch(self, body: Sequence[cst.CSTNode], forwards: List[cst.Call]) -> bool:
        """An output of the `forwards` reaches a function that is not torch's (the project's
        SSIM helper, a numpy or skimage metric) in the statements `body`."""
        ctx = self.ctx
        outputs: Set[str] = set()
        for call in forwards:
            if self._leaves_inline(call):
                return True
            assign = ctx.enclosing(call, cst.Assign)
            if assign is not None:
                for t in assign.targets:
                    outputs |= {n.value for n in ctx.within(t.target, cst.Name)} if not isinstance(
                        t.target, cst.Name) else {t.target.value}
        if not outputs:
            return False
        uses = (c for s in body for c in ctx.within(s, cst.Call, skip_defs=True))
        for use in uses:
            func = use.func
            if isinstance(func, cst.Attribute) and not isinstance(func.value, (cst.Name, cst.Attribute)):
                continue  # a method of a computed value: `(sr - hr).mean()`
            name = ctx.resolve(func) or dotted(func) or ""
            if not name or name.startswith(("torch.", "builtins.")) or name in _TENSOR_BUILTINS \
                    or isinstance(func, cst.Attribute) and dotted(func.value) in outputs:
                continue
            if any(n.value in outputs for a in use.args for n in ctx.within(a, cst.Name)) or any(
                    isinstance(a.value, cst.Name) and a.value.value in outputs for a in use.args):
                return True
        return False

    def _leaves_inline(self, forward: cst.Call) -> bool:
        """The forward's output leaves torch in the expression that calls it: `preds.append(
        model(x).cpu().numpy())` (bf16 has no numpy dtype), `metric_np(model(x), y)` with a function
        that is not torch's, `preds.append(model(x))` (a list converted later), as an output bound
        to a name would."""
        ctx = self.ctx
        for anc in ctx.ancestors(forward):
            if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement, cst.Lambda)):
                return False
            if not isinstance(anc, cst.Call):
                continue
            func = anc.func
            if isinstance(func, cst.Attribute) and func.attr.value in _SAFE_CONVERSIONS | _ORDER_READS \
                    and any(forward is c for c in ctx.within(func.value, cst.Call)):
                return False  # `model(x).argmax(1).tolist()`: no longer a half-precision value
            if isinstance(func, cst.Attribute) and func.attr.value == "numpy":
                return True
            if isinstance(func, cst.Attribute) and not isinstance(func.value, (cst.Name, cst.Attribute)):
                continue  # a method of a computed value: `model(x).detach()`
            name = ctx.resolve(func) or dotted(func) or ""
            if name and not name.startswith(("torch.", "builtins.")) and name not in _TENSOR_BUILTINS \
                    and any(forward is a.value or any(forward is c for c in ctx.within(a, cst.Call)) for a in anc.args):
                return True
        return False

    def bound_in(self, body: Sequence[cst.CSTNode]) -> List[str]:
        """The names the statements `body` (and the `with` blocks among them: a teacher's
        forward under `with torch.no_grad():`) bind to a model's floating output, in order;
        not the losses, not `pred = model(x).argmax(1)`."""
        outputs: List[str] = []
        for s in _through_withs(body):
            line = s.body[0] if isinstance(s, cst.SimpleStatementLine) and len(s.body) == 1 else None
            if not isinstance(line, cst.Assign) or not self.training.calls_model(s) or isinstance(
                    line.value, cst.Call) and method_name(line.value) in _SAFE_CONVERSIONS | _ORDER_READS:
                continue  # `pred = model(x).argmax(1)`: not a floating output
            for t in line.targets:
                names = [t.target] if isinstance(t.target, cst.Name) else (
                    [e.value for e in t.target.elements] if isinstance(t.target, (cst.Tuple, cst.List)) else [])
                outputs += [n.value for n in names if isinstance(n, cst.Name) and n.value not in self.losses
                            and n.value not in outputs]
        return outputs

    def precise_use(self, name: str, statement: cst.CSTNode) -> bool:
        """`statement` reads `name` for more than its shape, device or an argmax: a use where
        bf16 would change the number."""
        for ref in self.ctx.within(statement, cst.Name):
            if ref.value != name or is_attr_name(self.ctx, ref):
                continue
            parent = self.ctx.parent(ref)
            if isinstance(parent, cst.Attribute) and parent.value is ref:
                if parent.attr.value in _SHAPE_READS:
                    continue
                call = self.ctx.parent(parent)
                if isinstance(call, cst.Call) and call.func is parent and parent.attr.value in _ORDER_READS:
                    continue
            if isinstance(parent, cst.Arg):
                call = self.ctx.parent(parent)
                if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "len":
                    continue
            if isinstance(parent, cst.AssignTarget) or isinstance(parent, (cst.Tuple, cst.List)) and isinstance(
                    self.ctx.parent(parent), cst.AssignTarget):
                continue
            return True
        return False


def _chain_hits(node: Optional[cst.BaseExpression], bound: Set[str]) -> Optional[str]:
    """The name of `bound` that the method chain `node` (`out.detach().cpu()`) starts from,
    unless a conversion in the chain makes it safe for numpy."""
    while node is not None:
        if isinstance(node, (cst.Name, cst.Attribute)) and dotted(node) in bound:
            return dotted(node)
        if isinstance(node, cst.Attribute):
            node = node.value
        elif isinstance(node, cst.Subscript):
            node = node.value
        elif isinstance(node, cst.Call):
            meth = method_name(node)
            if meth in _SAFE_CONVERSIONS:
                return None
            if meth is not None:
                node = node.func.value
                continue
            for a in node.args:
                hit = _chain_hits(a.value, bound)
                if hit:
                    return hit
            return None
        else:
            return None
    return None


def _through_withs(body: Sequence[cst.CSTNode]) -> List[cst.CSTNode]:
    """The statements of `body`, those inside its `with` blocks in their place (a teacher's
    forward under `with torch.no_grad():`)."""
    out: List[cst.CSTNode] = []
    for s in body:
        out += _through_withs(list(statements(s.body))) if isinstance(s, cst.With) else [s]
    return out


def output_facts(ctx: Context) -> OutputFacts:
    """The module's output facts, computed on first use and kept."""
    found = ctx.facts.get("forward_outputs")
    if found is None:
        found = ctx.facts["forward_outputs"] = OutputFacts(ctx)
    return found  # type: ignore[return-value]


def _plain_numbers(append: cst.Call) -> bool:
    """`preds.append(out.mean().item())`, `.extend(out.tolist())`, `append(float(loss))`: what goes
    into the list is Python numbers, which any dtype converts to, not a tensor."""
    if len(append.args) != 1 or append.args[0].star:
        return False
    value = append.args[0].value
    if not isinstance(value, cst.Call):
        return False
    func = value.func
    if isinstance(func, cst.Attribute) and func.attr.value in ("item", "tolist") and not value.args:
        return True
    return isinstance(func, cst.Name) and func.value in ("float", "int", "round")

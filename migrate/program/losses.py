"""Whether a training loss sums over its batch instead of averaging it.

DDP averages the ranks' gradients. With each rank loading its share of the original batch, a
loss averaged over the batch then gives the original step exactly, while a loss summed over it
(`nn.MSELoss(reduction="sum")`, `size_average=False`, `x.sum()`, the VAE tutorial's `BCE + KLD`)
gives 1/world_size of it: the program trains with a smaller learning rate and nothing says so.
The model plan asks `summed_loss` of the loss every backward pass takes, and wraps the model
with `loss_reduction="sum"` when all of them sum.

Only what the code shows for sure counts as a sum: a torch loss with `reduction="sum"` (or the
old `size_average=False`), a `.sum()` or `torch.sum(...)` over the whole tensor, sums of those,
and those scaled by a number. A division by anything but a number (`/ x.size(0)`, `/ batch_size`)
is a mean; anything unknown (a library's loss object, a call this file does not define) is not a
sum, which keeps DDP's averaging, as before.
"""

from __future__ import annotations

from typing import List, Optional

import libcst as cst

from torchmigrate.program.metrics import is_number
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg
from torchmigrate.rule import Context

_DEPTH = 3  # names and the file's own loss functions followed this deep


def backward_loss(call: cst.Call) -> Optional[cst.BaseExpression]:
    """The loss of `loss.backward()` / `scaler.scale(loss).backward()`."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "backward"):
        return None
    value = func.value
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value == "scale" \
            and len(value.args) == 1:
        value = value.args[0].value
    return value


def summed_loss(ctx: Context, node: cst.BaseExpression, depth: int = 0) -> bool:
    """`node` is surely a loss summed over the batch (see the module's docstring)."""
    if depth > _DEPTH:
        return False
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        return summed_loss(ctx, node.expression, depth)
    if isinstance(node, cst.BinaryOperation):
        op = node.operator
        if isinstance(op, (cst.Add, cst.Subtract)):
            return summed_loss(ctx, node.left, depth) and summed_loss(ctx, node.right, depth)
        if isinstance(op, cst.Multiply):
            return (is_number(node.left) and summed_loss(ctx, node.right, depth)) or (
                is_number(node.right) and summed_loss(ctx, node.left, depth))
        if isinstance(op, cst.Divide):
            return is_number(node.right) and summed_loss(ctx, node.left, depth)
        return False
    if isinstance(node, cst.Name):
        value = _last_value(ctx, node)
        if value is None:
            return _summed_part(ctx, node)
        return summed_loss(ctx, value, depth + 1)
    if isinstance(node, cst.Call):
        return _summing_call(ctx, node, depth)
    return False


def _summing_call(ctx: Context, call: cst.Call, depth: int) -> bool:
    func = call.func
    name = ctx.resolve(func) or ""
    if name == "torch.sum":
        return len(call.args) == 1
    if isinstance(func, cst.Attribute) and func.attr.value == "sum":
        return not call.args  # `x.sum()`: over everything; `x.sum(1)` leaves a per-sample tensor
    if name.startswith("torch.nn.functional."):
        return _sum_reduction(call)
    if name.startswith("torch.nn.") and name.endswith("Loss"):
        return False  # `nn.MSELoss(reduction="sum")(a, b)`: rare; the object's call below
    criterion = dotted(func)
    if criterion:
        built = _criterion(ctx, criterion)
        if built is not None:
            return _sum_reduction(built)
        if _summing_instance(ctx, criterion):
            return True
        defined = _own_function(ctx, func)
        if defined is not None:
            returns = [r.value for r in ctx.within(defined, cst.Return, skip_defs=True) if r.value is not None]
            return bool(returns) and all(summed_loss(ctx, r, depth + 1) for r in returns)
    return False


def _sum_reduction(call: cst.Call) -> bool:
    reduction = arg(call, "reduction")
    if reduction is not None:
        return isinstance(reduction.value, cst.SimpleString) and reduction.value.evaluated_value == "sum"
    size_average = arg(call, "size_average")
    reduce = arg(call, "reduce")
    return (size_average is not None and _false(size_average.value)
            and (reduce is None or not _false(reduce.value)))


def _criterion(ctx: Context, name: str) -> Optional[cst.Call]:
    """The torch loss `name` (`criterion`, `self.criterion`) is built with in this file, when
    every assignment of it builds one."""
    built: List[cst.Call] = []
    for assign in ctx.nodes(cst.Assign):
        if any(dotted(t.target) == name for t in assign.targets):
            value = assign.value
            resolved = ctx.resolve(value.func) if isinstance(value, cst.Call) else None
            if not (resolved and resolved.startswith("torch.nn.") and resolved.endswith("Loss")):
                return None
            built.append(value)  # type: ignore[arg-type]
    if not built or len({_sum_reduction(b) for b in built}) != 1:
        return None
    return built[0]


def _summed_part(ctx: Context, name: cst.Name) -> bool:
    """`name` was last bound by unpacking the output of one of the program's modules whose
    forward returns a tuple with a summed loss at its position (`kld, nll, _, _ = model(x)`,
    `ModuleView.summing_parts`)."""
    parts = ctx.program.summing_parts
    scope = ctx.enclosing(name, cst.FunctionDef)
    if not parts or scope is None:
        return False
    where = ctx.position(name) or 0
    best, best_at = None, -1
    for assign in ctx.within(scope, cst.Assign, skip_defs=True):
        at = ctx.position(assign) or 0
        target = assign.targets[0].target if len(assign.targets) == 1 else None
        if best_at < at < where and isinstance(target, (cst.Tuple, cst.List)) \
                and not any(isinstance(e, cst.StarredElement) for e in target.elements):
            index = next((i for i, e in enumerate(target.elements)
                          if isinstance(e.value, cst.Name) and e.value.value == name.value), None)
            if index is not None:
                best, best_at = (assign.value, index), at
    if best is None or not isinstance(best[0], cst.Call):
        return False
    callee = dotted(best[0].func)
    return callee is not None and any(best[1] in parts[c] for c in _built_by(ctx, callee, set(parts)))


def _built_by(ctx: Context, name: str, classes) -> List[str]:
    """The classes among `classes` that every assignment of `name` in this file builds (moved
    or not: `model = VRNN(...).to(device)`), or none where one assignment builds another."""
    built = []
    for assign in ctx.nodes(cst.Assign):
        if any(dotted(t.target) == name for t in assign.targets):
            value = assign.value
            while isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) \
                    and value.func.attr.value in ("to", "cuda", "cpu", "train"):
                value = value.func.value
            if dotted(value) == name:
                continue  # `model = model.to(device)`: the same module, moved
            built.append(dotted(value.func) if isinstance(value, cst.Call) else None)
    return [built[0]] if built and built[0] in classes and len(set(built)) == 1 else []


def _summing_instance(ctx: Context, name: str) -> bool:
    """Every assignment of `name` in this file builds one of the program's modules whose forward
    returns a loss summed over the batch (`diffusion = GaussianDiffusion(model).to(device)`,
    `ModuleView.summing_modules`)."""
    classes = ctx.program.summing_modules
    return bool(classes) and bool(_built_by(ctx, name, classes))


def _own_function(ctx: Context, func: cst.BaseExpression) -> Optional[cst.FunctionDef]:
    """`loss_function` (or `self.loss_function`) defined in this file, once."""
    if isinstance(func, cst.Name):
        want, method = func.value, False
    elif isinstance(func, cst.Attribute) and dotted(func.value) == "self":
        want, method = func.attr.value, True
    else:
        return None
    found = [f for f in ctx.nodes(cst.FunctionDef) if f.name.value == want
             and isinstance(ctx.parent(ctx.parent(f)), cst.ClassDef) == method]
    return found[0] if len(found) == 1 else None


def _last_value(ctx: Context, name: cst.Name) -> Optional[cst.BaseExpression]:
    """The value last assigned to `name` before it, in its own function."""
    scope = ctx.enclosing(name, cst.FunctionDef)
    where = ctx.position(name) or 0
    best, best_at = None, -1
    for assign in ctx.within(scope, cst.Assign, skip_defs=True) if scope is not None else ():
        at = ctx.position(assign) or 0
        if at < where and at > best_at and len(assign.targets) == 1 and \
                isinstance(assign.targets[0].target, cst.Name) and assign.targets[0].target.value == name.value:
            best, best_at = assign.value, at
    return best


def _false(node: cst.BaseExpression) -> bool:
    return isinstance(node, cst.Name) and node.value == "False"

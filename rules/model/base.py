"""What the model rules share: the base class (which records the rules that run together, for
the plan), the `tm.wrap_model(...)` call TM301 and TM306 write, and the `tm.unwrap(...)`
rewrites of the plan's attribute accesses, which TM302 reports and TM306 for the names it
unwraps."""

from __future__ import annotations

from typing import Optional, Set, Union

import libcst as cst

from torchmigrate.finding import replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import expr, kwarg, with_args
from torchmigrate.rule import Context, Rule
from torchmigrate.rules.model.plan import STATE_METHODS, Plan, plan


class ModelRule(Rule):
    """Shared by the model rules: registers the rule as enabled for the plan (TM301 leaves the
    models differentiated by hand to TM309 when it runs)."""

    commands = frozenset({"ddp", "lint"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        ctx.facts.setdefault("model_rules", set()).add(self.code)

    def plan(self) -> Plan:
        return plan(self.ctx)

    def notes(self, code_: str) -> None:
        p = self.plan()
        for node, message, statement in p.notes[code_]:
            self.report(node, message, statement=statement, advice=node in p.advice)


def wrap_call(tm: str, module: cst.BaseExpression, find_unused: bool, sync_bn: bool,
              data_parallel: Union[bool, cst.BaseExpression] = False, summed: bool = False,
              move: bool = True) -> cst.Call:
    """`tm.wrap_model(module, ...)` with the keywords the plan chose (TM303, TM304): the one wrap
    statement TM301 inserts or TM306 writes in place of DataParallel. `data_parallel`: the wrap
    replaces an `nn.DataParallel`, which the model keeps in one process (code anywhere that reads
    `model.module` keeps working; `python train.py` still uses every GPU); an expression when the
    original used DataParallel only under that test (`data_parallel=torch.cuda.device_count() > 1`),
    so one process runs as the original did either way. `summed`: the program's losses sum over
    the batch (`Plan.sums_losses`), so the ranks' gradients are summed. `move=False`: the program
    moves the model to the GPU only under a test, so the wrap leaves it where it is."""
    args = [cst.Arg(module)]
    if find_unused:
        args.append(kwarg("find_unused_parameters", expr("True")))
    if sync_bn:
        args.append(kwarg("sync_bn", expr("True")))
    if isinstance(data_parallel, cst.BaseExpression):
        args.append(kwarg("data_parallel", data_parallel.with_changes(lpar=[], rpar=[])))
    elif data_parallel:
        args.append(kwarg("data_parallel", expr("True")))
    if summed:
        args.append(kwarg("loss_reduction", expr('"sum"')))
    if not move:
        args.append(kwarg("move", expr("False")))
    return with_args(cst.Call(func=expr(f"{tm}.wrap_model")), args)


def _is_unwrap(node: cst.BaseExpression, tm: str) -> bool:
    return isinstance(node, cst.Call) and dotted(node.func) == f"{tm}.unwrap"


def _unwrap_fix(tm: str, attr: str):
    def fix(node):
        if not attr:  # the model itself, passed to a copy
            return cst.Call(func=expr(f"{tm}.unwrap"), args=[cst.Arg(node)])
        if _is_unwrap(node.value, tm):
            return node
        call = cst.Call(func=expr(f"{tm}.unwrap"), args=[cst.Arg(node.value.with_changes(lpar=[], rpar=[]))])
        if attr == "module":
            return call.with_changes(lpar=node.lpar, rpar=node.rpar)
        return node.with_changes(value=call)
    return fix


def _synced_fix(tm: str):
    def fix(node: cst.Attribute) -> cst.Attribute:
        if isinstance(node.value, cst.Call) and dotted(node.value.func) == f"{tm}.synced":
            return node
        return node.with_changes(value=cst.Call(func=expr(f"{tm}.synced"),
                                                args=[cst.Arg(node.value.with_changes(lpar=[], rpar=[]))]))
    return fix


def report_rewrites(rule: Rule, p: Plan, owner: str) -> None:
    """The plan's `tm.unwrap` rewrites owned by `owner`: TM302's, or TM306's for the names it
    unwraps when TM302 does not run (so no `.module` is left on a converted DataParallel)."""
    tm = rule.ctx.tm
    seen: Set[cst.CSTNode] = set()
    for r in p.rewrites:
        if r.owner != owner:
            continue
        if not r.attr and r.use == "save":
            message = (f"saving the wrapped model `{r.name}` whole pickles the DDP wrapper, which cannot be loaded "
                       f"outside torchrun: save the module itself, `{tm}.unwrap({r.name})`")
        elif not r.attr and r.use == "graph":
            message = (f"add_graph traces the model with torch.jit, which fails on the DDP wrapper: trace the module "
                       f"itself, `{tm}.unwrap({r.name})`")
        elif not r.attr:
            message = (f"copying a wrapped model copies the DDP wrapper: copy the module itself, "
                       f"`{tm}.unwrap({r.name})`")
        elif r.attr == "module":
            message = f"`{r.name}.module` fails when the model is not wrapped: use `{tm}.unwrap({r.name})`"
        elif r.manual:
            rule.report(r.node, f"`{r.name}` is the DistributedDataParallel built here: `{r.name}.state_dict()` saves "
                                f"every key with a `module.` prefix, which the plain model cannot load; save "
                                f"`{r.name}.module.state_dict()` (or `{tm}.unwrap({r.name}).state_dict()`) and load "
                                "into the module the same way")
            continue
        elif r.synced:
            rule.report(r.node, f"`{r.name}.{r.attr}(...)` computes the training loss outside DDP's forward, so its "
                                f"gradients would not be averaged across ranks: run it through DDP's forward with "
                                f"`{tm}.synced({r.name}).{r.attr}(...)`",
                        edits=[replace(r.node, _synced_fix(tm))], imports=[rule.ctx.runtime_import()])
            continue
        elif r.attr in STATE_METHODS:
            message = (f"`{r.name}.{r.attr}` of a DDP model has `module.`-prefixed keys: "
                       f"use `{tm}.unwrap({r.name}).{r.attr}`")
        else:
            message = (f"DDP does not forward custom attributes (`{r.name}.{r.attr}` raises AttributeError): "
                       f"use `{tm}.unwrap({r.name}).{r.attr}`")
        edits = [replace(r.node, _unwrap_fix(tm, r.attr))]
        choice = _wrap_check(rule.ctx, r.node)
        if choice is not None and choice not in seen:
            # `m.module.state_dict() if type(m) is DDP else m.state_dict()`: both branches become
            # `tm.unwrap(m).state_dict()`, so keep one
            seen.add(choice)
            edits.append(replace(choice, _same_branches))
        rule.report(r.node, message, edits=edits, imports=[rule.ctx.runtime_import()])


_PURE_TESTS = {"type", "isinstance", "hasattr", "getattr", "len"}


def _wrap_check(ctx: Context, node: cst.CSTNode) -> Optional[cst.IfExp]:
    """The `a if <check> else b` whose branch holds `node`, when the check has no side effects."""
    child, parent = node, ctx.parent(node)
    while parent is not None and not isinstance(parent, (cst.BaseStatement, cst.BaseSmallStatement, cst.Lambda)):
        if isinstance(parent, cst.IfExp) and child is not parent.test:
            calls = ctx.within(parent.test, cst.Call)
            if all(isinstance(c.func, cst.Name) and c.func.value in _PURE_TESTS for c in calls):
                return parent
            return None
        child, parent = parent, ctx.parent(parent)
    return None


def _same_branches(node: cst.CSTNode) -> cst.CSTNode:
    if isinstance(node, cst.IfExp) and node.body.deep_equals(node.orelse):
        return node.body.with_changes(lpar=node.lpar, rpar=node.rpar) if node.lpar else node.body
    return node

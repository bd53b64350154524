"""What the rules of the AMP family share: the base class (which records the rules that run
together, for the plan), the runtime's AMP policy (which autocast/GradScaler calls TM410 takes
over, so TM406 leaves them alone), the scaler edits TM402 and apex's TM407 both make, and the
lookups of names the import rewrites (TM406, TM407, TM410) need.

Ownership of call nodes between TM406 (`torch.cuda.amp` -> `torch.amp`) and TM410 (the runtime's
AMP policy): in `ddp`/`amp` migrations with `--amp` other than `off` TM410 turns every existing
`autocast(...)`/`GradScaler(...)` (any flavour) into `tm.autocast(...)`/`tm.GradScaler(...)` and
TM406 leaves those calls alone (`policy_takes`); TM406 modernises in `lint` mode, with
`--amp off`, and for calls TM410 cannot express (`cache_enabled=`, `*args`).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Set

import libcst as cst

from torchmigrate.finding import insert_after, insert_before, replace
from torchmigrate.syntax.imports import is_import_line
from torchmigrate.syntax.nodes import code
from torchmigrate.program.precision import AUTOCAST, SCALER
from torchmigrate.program.syntax import is_attr_name, receiver, unparen
from torchmigrate.rule import Context, Rule
from torchmigrate.rules.amp.edits import call_node, call_stmt, dotted_node, runtime_kwargs
from torchmigrate.rules.amp.plan import Plan, enabled_codes


class AmpRule(Rule):
    """Base for the AMP family: registers itself so the plan knows which rules run together."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        enabled_codes(ctx).add(self.code)


def policy_active(ctx: Context) -> bool:
    """TM410 rewrites existing autocast/GradScaler calls to the runtime's in this run."""
    return ctx.options.migrating and ctx.options.amp != "off" and "TM410" in enabled_codes(ctx)


def convertible_call(call: cst.Call, qualified: str) -> bool:
    """TM410 can express this autocast/GradScaler call with the runtime's helpers."""
    if any(a.star for a in call.args):
        return False
    if qualified in AUTOCAST:
        legacy = qualified.startswith(("torch.cuda.", "torch.cpu."))
        params = ("enabled", "dtype", "cache_enabled") if legacy else ("device_type", "dtype", "enabled", "cache_enabled")
        positional = [a for a in call.args if a.keyword is None]
        if len(positional) > len(params):
            return False
        names = [p for p, _ in zip(params, positional)] + [a.keyword.value for a in call.args if a.keyword]
        return "cache_enabled" not in names
    return qualified in SCALER


def policy_takes(ctx: Context, call: cst.Call, qualified: Optional[str]) -> bool:
    return bool(qualified) and (qualified in AUTOCAST or qualified in SCALER) and policy_active(ctx) \
        and convertible_call(call, qualified)


def emit_scaler(rule: Rule, p: Plan) -> None:
    """Scaler creation, scaled backwards, steps through the scaler and updates (TM402, or TM407
    when it runs without TM402)."""
    ctx = rule.ctx
    s = p.scaler
    imports = [ctx.runtime_import()]
    def creation() -> cst.SimpleStatementLine:
        kwargs = runtime_kwargs(ctx, scaler=True)
        if s.dtype is not None and not kwargs:
            kwargs = {"dtype": s.dtype}
        return call_stmt(call_node(f"{ctx.tm}.GradScaler", **kwargs), target=s.text)

    if s.new and s.after is not None:
        line = creation()
        if isinstance(ctx.parent(s.after), cst.Module) and is_import_line(s.after):
            line = line.with_changes(leading_lines=[cst.EmptyLine()])
        rule.report(s.after, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[insert_after(s.after, [line])], imports=imports)
    elif s.new and s.before is not None:
        rule.report(s.before, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[insert_before(s.before, [creation()])], imports=imports)
    elif s.new:
        rule.report(ctx.module, f"create one GradScaler for the training steps: `{s.create}`",
                    edits=[replace(ctx.module, lambda m: m.with_changes(body=[creation(), *m.body]))],
                    imports=imports)
    for call in p.scale_calls:
        def fix(c: cst.Call, text=s.text) -> cst.Call:
            loss = unparen(c.func.value)
            scaled = cst.Call(func=dotted_node(f"{text}.scale"), args=[cst.Arg(loss)])
            return c.with_changes(func=c.func.with_changes(value=scaled))
        rule.report(call, f"scale the loss: `{s.text}.scale({code(receiver(call))}).backward()`",
                    edits=[replace(call, fix)])
    for step in p.step_calls:
        opt = p.optimizer_text(step)
        through = "" if opt == code(step.optimizer) else (
            f" (`{code(step.optimizer)}.step()` only steps `{opt}`, the torch optimizer the scaler needs)")
        rule.report(step.call, f"step through the scaler: `{s.text}.step({opt})`{through}",
                    edits=[replace(step.call, lambda c, o=step.optimizer, inner=None if opt == code(step.optimizer)
                                   else opt.rsplit(".", 1)[1], t=s.text: cst.Call(
                        func=dotted_node(f"{t}.step"), args=[cst.Arg(_stepped_node(_receiver(c, o), inner))]))])
    for anchor, _ in p.updates:
        update = f"{s.text}.update()"
        if isinstance(anchor, cst.Expr):
            edit = replace(anchor, lambda e: cst.FlattenSentinel([e, cst.Expr(call_node(f"{s.text}.update"))]))
        else:
            edit = insert_after(anchor, [call_stmt(call_node(f"{s.text}.update"))])
        rule.report(anchor, f"update the loss scale once per iteration: `{update}`", edits=[edit])


def _receiver(call: cst.Call, original: cst.BaseExpression) -> cst.BaseExpression:
    """What `call` (`<optimizer>.step()`, as other rules left it) is called on: with their
    edits (`tm.unwrap(model).optimizer` of TM302), else the optimizer as written."""
    return call.func.value if isinstance(call.func, cst.Attribute) else original


def _stepped_node(optimizer: cst.BaseExpression, inner: Optional[str]) -> cst.BaseExpression:
    """The optimizer expression itself, or `optimizer.<inner>` when the plan steps the torch
    optimizer a wrapper of the program holds (`Plan.stepped`)."""
    return optimizer if inner is None else cst.Attribute(value=optimizer, attr=cst.Name(inner))


def name_refs(ctx: Context, values: Iterable[str]) -> List[cst.Name]:
    """Every `Name` spelling one of `values` that is not an attribute name, in source order.

    Asked of the node index once the walk is done, instead of a `visit_Name` that would test
    each of the file's (many) names against a set of a few imported locals."""
    values = list(values)
    refs = [n for value in values for n in ctx.named(value) if not is_attr_name(ctx, n)]
    if len(values) > 1:
        refs.sort(key=ctx.position)
    return refs


def in_taken_call(ctx: Context, name: cst.Name, taken: Set[cst.Call]) -> bool:
    node: cst.CSTNode = name
    parent = ctx.parent(node)
    while isinstance(parent, cst.Attribute) and parent.value is node:
        node, parent = parent, ctx.parent(parent)
    return isinstance(parent, cst.Call) and parent.func is node and parent in taken

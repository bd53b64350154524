"""TM404: gradient accumulation under DDP skips the all-reduce on non-boundary batches."""

from __future__ import annotations

from typing import List, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, wrap
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.program.precision import TM_NO_SYNC
from torchmigrate.program.syntax import (binds, block_of, calls_in, line_of, method_name, owner_statement, reads,
                                         unparen)
from torchmigrate.program.training import training_facts
from torchmigrate.rule import Context, Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.edits import call_node, dotted_node, with_node
from torchmigrate.rules.amp.plan import Plan, plan
from torchmigrate.rules.model.plan import wrapped_models


class AccumNoSync(AmpRule):
    """
    ## What it does
    For gradient accumulation under DDP (`backward()` every batch, `step()` inside
    `if (i + 1) % k == 0:`), wraps the forward and backward of each batch in
    `with tm.no_sync(model, sync=<the step condition>):` so only the boundary batch
    all-reduces. The forward is inside the context, as DDP requires.

    ## Why is this bad?
    Without `no_sync` DDP all-reduces the gradients after every backward, k-1 times for
    nothing. The sync condition is the step condition, so gradients are reduced exactly before
    each step and never left rank-local. A step condition without an end-of-epoch clause
    (`or i + 1 == len(loader)`) carries the last partial window into the next epoch (or drops
    it at `zero_grad`): reported, not changed.

    ## Limitations
    Accumulation shapes other than "backward, then `if <cond>:` holding the step" are reported
    for a manual change. Only in `ddp` migrations (and `lint` of distributed code); it applies
    with `--amp off` too, since it is about DDP communication, not precision.
    """

    code = "TM404"
    name = "accum-no-sync"
    summary = "Skip DDP gradient sync on non-boundary accumulation steps"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(loader):
                loss = criterion(model(x), y) / accum
                loss.backward()
                if (i + 1) % accum == 0 or i + 1 == len(loader):
                    optimizer.step()
                    optimizer.zero_grad()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, (x, y) in enumerate(loader):
                with tm.no_sync(model, sync=(i + 1) % accum == 0 or i + 1 == len(loader)):
                    loss = criterion(model(x), y) / accum
                    loss.backward()
                if (i + 1) % accum == 0 or i + 1 == len(loader):
                    optimizer.step()
                    optimizer.zero_grad()
            """,
            mode="ddp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.mode == "lint" and not analysis.is_distributed(ctx):
            return
        if ctx.options.mode == "amp":
            return
        p = plan(ctx)
        if p.skip:
            return
        for item in accumulation(ctx, p):
            kind = item[0]
            if kind == "fix":
                _, first, last, model, cond, site = item
                items = f"{ctx.tm}.no_sync({model}, sync={code(cond)})"
                self.report(first, f"skip the gradient all-reduce on non-boundary accumulation steps: "
                                   f"`with {items}:`",
                            edits=[wrap(first, last, lambda body, m=model, c=cond: with_node(
                                call_node(f"{ctx.tm}.no_sync", dotted_node(m), sync=unparen(c)), body))],
                            imports=[ctx.runtime_import()])
            else:
                _, node_, message = item
                self.report(node_, message)


def _called_instances(ctx: Context, statements) -> List[str]:
    """Names called like a model in the forward (`model(x)`, `self.net(x)`) that are neither a
    library's function nor a function or class of the program: where no model of this module is
    known (one built and wrapped by another module's `build(args)`), the model the window's
    backward runs through."""
    f = analysis.facts(ctx)
    out: List[str] = []
    for s in statements:
        for c in calls_in(ctx, s):
            func = c.func
            name = dotted(func)
            if name is None or ctx.resolve(func) is not None or name in f.functions or name in f.classes:
                continue
            if isinstance(func, cst.Attribute) and dotted(func.value) != "self":
                continue  # a method (`loss.backward()`, `x.view(...)`)
            if name not in out:
                out.append(name)
    return out


def accumulation(ctx: Context, p: Plan) -> List[tuple]:
    """(kind, ...) items for TM404: ("fix", first, last, model, condition, site) or
    ("manual", node, message)."""
    cached = ctx.facts.get("amp_accumulation")
    if cached is not None:
        return cached  # type: ignore[return-value]
    out: List[tuple] = []
    training = training_facts(ctx)
    models = analysis.trained_models(ctx)
    done: Set[cst.CSTNode] = set()
    for site in p.sites:
        if site.paired or site.statement in done:
            continue
        steps = [st for st in p.steps if st.scope is site.scope and st.kind in ("plain", "scaled")]
        if not steps:
            continue
        block, body = block_of(ctx, site.statement)
        if block is None:
            continue
        body = list(body)
        index = body.index(site.statement)
        loop = owner_statement(ctx, block)
        if not isinstance(loop, (cst.For, cst.While)):
            continue
        later = body[index + 1:]
        # a step right after the backward, also on the same line (`loss.backward(); opt.step()`)
        direct = [s for s in body[index:] if any(ctx.statement_of(st.call) is s or line_of(ctx, st.call) is s
                                                 for st in steps)]
        if direct or any(_steps_each_one(ctx, s, st.call) for s in later for st in steps):
            continue
        holder = None
        for s in later:
            if isinstance(s, cst.If) and any(s.body in set(ctx.ancestors(st.call)) for st in steps):
                holder = s
                break
        if holder is None:
            nested = [st for st in steps if loop in set(ctx.ancestors(st.call))]
            if nested:
                out.append(("manual", site.statement,
                            "gradient accumulation with a step condition torchmigrate does not recognise: under "
                            "DDP wrap the forward and backward of non-boundary batches in "
                            "`with tm.no_sync(model, sync=<step condition>):`"))
                done.add(site.statement)
            continue
        if any(_is_no_sync(ctx, a) for a in ctx.ancestors(site.statement)):
            continue
        last_def, _ = training.loss_definition(site)
        if last_def is None or ctx.parent(last_def) is not block:
            first = site.statement
        else:
            first = training.forward_start(last_def)
        cond = holder.test
        between = body[body.index(first): body.index(holder)]
        if any(binds(ctx, s) & reads(ctx, cond) for s in between):
            out.append(("manual", holder, "the accumulation step condition uses values computed after the "
                                          "forward: wrap non-boundary batches in `tm.no_sync(model, sync=...)` by hand"))
            continue
        if not models:
            try:
                models = list(wrapped_models(ctx))
            except Exception:  # the model rules are not there
                models = []
        region_models = []
        for s in body[body.index(first): index + 1]:
            for c in calls_in(ctx, s):
                d = dotted(c.func)
                if d and d in models and d not in region_models:
                    region_models.append(d)
        if not models and not region_models:
            region_models = _called_instances(ctx, body[body.index(first): index + 1])
        if len(region_models) == 1:
            model = region_models[0]
        elif not region_models and len(models) == 1:
            model = models[0]
        else:
            out.append(("manual", site.statement, "gradient accumulation over several models: wrap the "
                                                  "non-boundary forward/backward in `tm.no_sync(...)` for each DDP model"))
            continue
        done.add(site.statement)
        out.append(("fix", first, site.statement, model, cond, site))
        if _drops_partial_window(cond):
            out.append(("manual", holder,
                        f"the last partial accumulation window of an epoch never steps (`{code(cond)}`): its "
                        "gradients carry into the next epoch or are dropped by zero_grad; add `or <last batch>` "
                        "to the condition if that is not intended"))
    ctx.facts["amp_accumulation"] = out
    return out


def _steps_each_one(ctx, statement: cst.CSTNode, step: cst.Call) -> bool:
    """`for optimizer in optimizers: optimizer.step()` after the backward: a loop that steps each
    of several optimizers (an encoder's and a decoder's) in every iteration, under no `if` of its
    own, is an unconditional step, not a gradient-accumulation window."""
    if not isinstance(statement, cst.For):
        return False
    chain = list(ctx.ancestors(step))
    if statement not in chain:
        return False
    inside = chain[:chain.index(statement)]
    return not any(isinstance(a, (cst.If, cst.IfExp, cst.While, cst.Try)) for a in inside)


def _is_no_sync(ctx: Context, node: cst.CSTNode) -> bool:
    if not isinstance(node, cst.With):
        return False
    for item in node.items:
        i = item.item
        if isinstance(i, cst.Call) and (method_name(i) == "no_sync" or ctx.resolve(i.func) == TM_NO_SYNC):
            return True
    return False


def _drops_partial_window(cond: cst.BaseExpression) -> bool:
    """`(i + 1) % k == 0` alone, without a last-batch clause."""
    if isinstance(cond, cst.Comparison) and len(cond.comparisons) == 1:
        left = unparen(cond.left)
        return isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Modulo)
    return False

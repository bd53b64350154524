"""TM604: `loss.item()` every step synchronises with the GPU."""

from __future__ import annotations

from typing import Dict, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety
from torchmigrate.syntax.nodes import code
from torchmigrate.program.syntax import calls_by_method, receiver, root_name
from torchmigrate.rule import Context, Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.plan import plan


class ItemSync(AmpRule):
    """
    ## What it does
    Reports `loss.item()` (or `float(loss)`) called on every iteration of a training loop, as a
    note: a performance hint that changes nothing about correctness, so it leaves no TODO in
    the code, does not count among the findings that need attention and never changes the exit
    status (in `lint` it prints as `TM604 note: ...`, a GitHub `::notice`, a SARIF `note`).

    ## Why is this bad?
    `.item()` copies the value to the host and waits for the GPU to finish all queued work: one
    synchronisation per step that stalls the CUDA stream and costs throughput, especially with
    AMP where the step itself is fast. Accumulate `loss.detach()` in a tensor and call
    `.item()` only when logging (every N steps or once per epoch). Under DDP the value is also
    rank-local unless reduced.
    """

    code = "TM604"
    name = "item-sync"
    summary = "loss.item() every step forces a host-device sync"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                running += loss.item()
            """,
            mode="amp",  # a note in the report; the code stays as it is
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.mode == "lint" and not analysis.is_distributed(ctx):
            return
        p = plan(ctx)
        if p.skip:
            return
        loops_done: Set[cst.CSTNode] = set()
        losses: Dict[cst.CSTNode, Set[str]] = {}
        for site in p.sites:
            loop = ctx.enclosing(site.statement, cst.For, cst.While, cst.FunctionDef)
            if isinstance(loop, (cst.For, cst.While)) and site.loss is not None:
                r = root_name(site.loss)
                if r:
                    losses.setdefault(loop, set()).add(r)
        if not losses:
            return
        for call, name in calls_by_method(ctx).get("item", ()):
            if call.args:
                continue
            owner = root_name(receiver(call))
            if owner is None:
                continue
            loop = ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef)
            if loop not in losses or loop in loops_done or owner not in losses[loop]:
                continue
            if any(isinstance(a, (cst.If, cst.IfExp)) for a in ctx.ancestors_until(call, loop)):
                continue  # only at log steps
            loops_done.add(loop)
            self.report(call, f"`{code(call)}` every step synchronises with the GPU: accumulate "
                              f"`{owner}.detach()` and call `.item()` only when logging", advice=True)

"""TM403: gradients are unscaled before clipping or reading them."""

from __future__ import annotations


import libcst as cst

from torchmigrate.finding import Safety, insert_before
from torchmigrate.rule import Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.edits import call_node, call_stmt, expr_of
from torchmigrate.rules.amp.plan import plan


class UnscaleBeforeClip(AmpRule):
    """
    ## What it does
    Inserts `scaler.unscale_(optimizer)` before gradient clipping
    (`clip_grad_norm_`, `clip_grad_value_`) and before code that reads `.grad` between
    `backward()` and the step (gradient-norm logging), once per optimizer and step. A helper of
    this file or of another module that clips, or changes gradients in place by hand
    (`param.grad.data.clamp_(-clip, clip)`), counts as clipping where it is called.

    ## Why is this bad?
    After `scaler.scale(loss).backward()` the gradients are multiplied by the loss scale
    (65536 at the start), so a clipping threshold or a logged norm is meaningless unless the
    gradients are unscaled first. `unscale_` may be called only once per optimizer per step
    ("unscale_() has already been called on this optimizer since the last update()").
    """

    code = "TM403"
    name = "unscale-before-clip"
    summary = "Unscale gradients before clipping or reading them"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            """,
            after="""
            import torch
            scaler = torch.amp.GradScaler("cuda")
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = criterion(model(x), y)
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            """,
            mode="lint",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip or p.scaler is None:
            return
        if p.scaler.new and p.scaler_owner is None:
            return
        for before, names in p.unscales:
            lines = [call_stmt(call_node(f"{p.scaler.text}.unscale_", expr_of(n))) for n in names]
            self.report(before, f"unscale the gradients first: `{p.scaler.text}.unscale_({', '.join(names)})`",
                        edits=[insert_before(before, lines)])

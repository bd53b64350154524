"""TM402: one GradScaler scales every training loss and steps every optimizer."""

from __future__ import annotations


import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.rule import Example
from torchmigrate.rules.amp.base import AmpRule, emit_scaler
from torchmigrate.rules.amp.plan import plan


class GradScalerRule(AmpRule):
    """
    ## What it does
    Scales every training loss with one shared `GradScaler` and steps the optimizers through
    it: `loss.backward()` becomes `scaler.scale(loss).backward()`, `optimizer.step()` becomes
    `scaler.step(optimizer)` followed by `scaler.update()`. `scaler = tm.GradScaler()` is created
    once, beside the optimizer (`self.scaler` in trainer classes; inside the `__main__` block
    when the optimizer is built there; at module level when the optimizer is built in another
    function than the one that steps it), and always before the first statement that runs a
    step using it. It is created only for training steps whose forward runs under autocast
    (existing, or added by TM401): when autocast is withheld (TM409's `BCELoss`, numpy outputs,
    a forward inside the `backward()` expression) the step is left as it is. A new scaler
    follows the dtype of the file's own autocast when that is one constant
    (`tm.GradScaler(dtype=torch.float16)`).

    Several losses or optimizers share the one scaler: each loss is scaled, each optimizer
    stepped through it, and `update()` runs once after the last step of the iteration. With
    gradient accumulation every backward is scaled and `step`/`update` stay inside the
    boundary `if`.

    ## Why is this bad?
    With fp16 autocast small gradients underflow to zero; loss scaling keeps them
    representable and skips steps whose gradients overflowed. The runtime's scaler is enabled
    only where it is needed (fp16 on CUDA) and is a pass-through otherwise, so the same script
    is right for bf16, fp16 and CPU runs.

    ## Limitations
    Manual: optimizer closures (`step(closure)`: "Closure use is not currently supported if
    GradScaler is enabled"), `model.half()`, steps in a function that does not call the
    backward they apply. The non-AMP branch of an optional-AMP script
    (`if use_amp: scaler.scale(loss).backward() else: loss.backward()`) is left alone.
    """

    code = "TM402"
    name = "grad-scaler"
    summary = "Scale losses and step optimizers through one GradScaler"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            scaler = tm.GradScaler()
            for x, y in loader:
                loss = criterion(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip:
            return
        for code_, node_, message in p.blockers:
            if code_ == self.code:
                self.report(node_, message)
        if p.scaler_owner == self.code:
            emit_scaler(self, p)

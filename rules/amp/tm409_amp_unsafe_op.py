"""TM409: BCELoss under autocast raises; BCEWithLogitsLoss is safe."""

from __future__ import annotations


import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.rule import Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.plan import plan


class AmpUnsafeOp(AmpRule):
    """
    ## What it does
    Reports `nn.BCELoss` / `F.binary_cross_entropy` used under autocast, or in a script that is
    being given autocast, and suggests the `WithLogits` form. The training step that uses it
    does not get autocast until it is changed.

    ## Why is this bad?
    On CUDA, `binary_cross_entropy` is on autocast's list of unsafe ops and raises
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast":
    after a sigmoid in fp16 the log underflows. `BCEWithLogitsLoss` fuses the sigmoid and is
    numerically safe (the model must then return logits, without the final sigmoid).

    The same holds for code elsewhere in the program (`program.amp_hazards`): a BCE loss built
    in another module, a table keyed by float32/float64 that the program reads by a tensor's
    dtype (`self.eps[x.dtype]`, KeyError under bf16), an adaptive ODE solver (`odeint`) whose
    tolerances lie below half-precision resolution, a log of a probability written by hand
    (`torch.log(1 - torch.sigmoid(x))`: the probability rounds to 1 in bf16, the log to -inf), a
    forward that converts a tensor with `.numpy()` (bf16 has no numpy dtype: TypeError), a normalizing
    flow's log-determinant summed over its layers (`sldj = sldj + ...`: its likelihood needs more
    than bf16's 8 bits of mantissa). Then no
    autocast and no GradScaler are added anywhere, and this rule says why at the first training
    backward.
    """

    code = "TM409"
    name = "amp-unsafe-op"
    summary = "BCELoss under autocast raises; use BCEWithLogitsLoss"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            import torch.nn as nn
            criterion = nn.BCELoss()
            with torch.autocast("cuda"):
                loss = criterion(torch.sigmoid(model(x)), y)
            """,
            mode="lint",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = plan(self.ctx)
        if p.skip or (self.ctx.options.migrating and self.ctx.options.amp == "off"):
            return
        for node_, message, note in p.bce:
            self.report(node_, message, advice=note)
        for node_, message, note in p.hazards:
            self.report(node_, message, advice=note)

"""TM411: gradients taken inside the loss (gradient penalties) under mixed precision."""

from __future__ import annotations

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.nodes import arg
from torchmigrate.rule import RUNTIME_MODULE, Example, Rule

_GRAD = "torch.autograd.grad"
_SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler")


class AmpGradPenalty(Rule):
    """
    ## What it does
    `torch.autograd.grad(outputs, inputs, ..., create_graph=True)`, the gradient a penalty term
    is built from (WGAN-GP, R1, StarGAN's `gradient_penalty`, MAML's inner step), becomes
    `tm.grad(outputs, inputs, ..., create_graph=True)` in a program that gets (or has) mixed
    precision. `tm.grad` follows the AMP recipe for gradient penalties: with an fp16
    `tm.GradScaler` it scales the outputs before differentiating and unscales the gradients
    after; with bf16, on the CPU or with AMP off it is `torch.autograd.grad` unchanged.

    ## Why is this bad?
    The backward of the loss is scaled by the GradScaler, but this gradient is not: its small
    fp16 values flush to zero, so the penalty silently becomes a constant and stops shaping
    the discriminator (or the inner step stops learning). An overflow in the scaled gradient
    gives inf, which reaches the loss, so the scaler skips that step as it should.

    Under `ddp` the call becomes `tm.grad` also without mixed precision: a penalty backpropagated
    on its own (`gp.backward()` after the critic's loss) gives the parameters that act linearly
    on the output (the last layer's bias) no gradient at all, and DDP, waiting for them, fails at
    the next forward ("Expected to have finished reduction in the prior iteration"). `tm.grad`
    adds a zero term over the parameters of the DDP models in the outputs' graph, so every one
    gets a gradient and the penalty's gradients are averaged across the ranks.

    Calls whose outputs the code already scales (`scaler.scale(out)`) are left alone, and so is a
    program that gets neither mixed precision nor DDP (`amp --amp off`), and code TM409 finds
    unsafe under autocast, such as the adaptive ODE solver whose divergence estimator calls
    `autograd.grad` inside the forward (its loss reaches every parameter directly).
    """

    code = "TM411"
    name = "amp-grad-penalty"
    summary = "Scale gradient penalties (autograd.grad with create_graph) like the loss under fp16"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            def gradient_penalty(y, x):
                dydx = torch.autograd.grad(outputs=y, inputs=x, grad_outputs=torch.ones_like(y),
                                           retain_graph=True, create_graph=True)[0]
                return ((dydx.flatten(1).norm(dim=1) - 1) ** 2).mean()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def gradient_penalty(y, x):
                dydx = tm.grad(outputs=y, inputs=x, grad_outputs=torch.ones_like(y),
                                           retain_graph=True, create_graph=True)[0]
                return ((dydx.flatten(1).norm(dim=1) - 1) ** 2).mean()
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        grads = analysis.calls_to(ctx, _GRAD)
        if not grads:
            return
        amp = True
        if ctx.options.migrating:
            if ctx.program.amp_hazards:
                return  # no mixed precision in this program (TM409 says why): an ODE's own gradients
            amp = ctx.options.amp != "off"
            if not amp and ctx.options.mode != "ddp":
                return  # no mixed precision and no DDP in this program
        elif not analysis.calls_to(ctx, *_SCALERS, RUNTIME_MODULE + ".GradScaler"):
            return  # lint: only files that scale their loss
        for call in grads:
            create = arg(call, "create_graph", 4)
            if create is None or (isinstance(create.value, cst.Name) and create.value.value in ("False", "None")):
                continue
            outputs = arg(call, "outputs", 0)
            if outputs is not None and ".scale(" in cst.Module(body=[]).code_for_node(outputs.value):
                continue
            positional = [a for a in call.args if a.keyword is None]
            if any(a.star for a in call.args) or len(positional) > 3:
                self.report(call, f"a gradient penalty under mixed precision: its fp16 gradients flush to zero "
                                  f"unless scaled like the loss; use `{ctx.tm}.grad(...)` (the AMP recipe)")
                continue
            why = ("a gradient penalty under mixed precision: its fp16 gradients flush to zero unless scaled like the "
                   "loss; tm.grad scales the outputs and unscales the gradients" if amp else
                   "a gradient penalty through a model in DDP: backpropagated on its own, it gives the parameters "
                   "that act linearly on the output no gradient, which DDP waits for; tm.grad gives them a zero one")
            self.report(call, why,
                        edits=[replace(call.func, lambda f: cst.parse_expression(f"{ctx.tm}.grad"))],
                        imports=[ctx.runtime_import()])

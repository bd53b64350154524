"""TM309: models DDP cannot wrap (differentiated by hand) get DDP's two jobs done explicitly."""

from __future__ import annotations

from typing import List

import libcst as cst

from torchmigrate.analysis import optimizers
from torchmigrate.finding import Safety, insert_before
from torchmigrate.syntax.imports import dotted
from torchmigrate.program.models import functional_model
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule


class FunctionalModelSync(ModelRule):
    """
    ## What it does
    For a model whose gradients the program takes by hand over its own parameters
    (`torch.autograd.grad(loss, net.parameters())`, MAML's inner step), which TM301 therefore
    does not wrap in DDP:
    - `tm.share_params(net)` before its optimizer is built: every rank starts from rank 0's
      weights (what DDP does when it wraps a model);
    - `tm.sync_grads(net)` before each step of that optimizer: the gradients are averaged across
      ranks (what DDP's backward does), so every rank takes the same step.

    ## Why is this bad?
    DistributedDataParallel does not support `torch.autograd.grad`: wrapped, such a model
    crashes ("One of the differentiated Tensors does not require grad", seen on MAML-Pytorch);
    unwrapped, every rank trains its own copy on its own data and the copies drift apart.
    """

    code = "TM309"
    name = "functional-model-sync"
    summary = "Share the weights and average the gradients of a model DDP cannot wrap"
    safety = Safety.SAFE
    commands = frozenset({"ddp"})
    examples = (
        Example(
            before="""
            import torch
            class Meta(torch.nn.Module):
                def __init__(self, net):
                    super().__init__()
                    self.net = net
                    self.meta_optim = torch.optim.Adam(self.net.parameters(), lr=1e-3)

                def forward(self, x, y):
                    loss = torch.nn.functional.mse_loss(self.net(x), y)
                    grad = torch.autograd.grad(loss, self.net.parameters())
                    self.meta_optim.zero_grad()
                    loss.backward()
                    self.meta_optim.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            class Meta(torch.nn.Module):
                def __init__(self, net):
                    super().__init__()
                    self.net = net
                    tm.share_params(self.net)
                    self.meta_optim = torch.optim.Adam(self.net.parameters(), lr=1e-3)

                def forward(self, x, y):
                    loss = torch.nn.functional.mse_loss(self.net(x), y)
                    grad = torch.autograd.grad(loss, self.net.parameters())
                    self.meta_optim.zero_grad()
                    loss.backward()
                    tm.sync_grads(self.net)
                    self.meta_optim.step()
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if ctx.options.mode != "ddp":
            return
        for o in optimizers(ctx):
            if o.via is not None or o.target is None or o.statement is None or not isinstance(ctx.parent(o.statement), (
                    cst.IndentedBlock, cst.Module)):
                continue
            for m in o.models:
                if functional_model(ctx, m) and not self._shared(m):
                    self._sync(o, m)

    def _shared(self, m: str) -> bool:
        return any((dotted(c.func) or "").endswith("share_params") and c.args and dotted(c.args[0].value) == m
                   for c in self.ctx.nodes(cst.Call))

    def _steps(self, target: str) -> List[cst.Call]:
        """`opt.step()` and `scaler.step(opt)` of the optimizer `target`."""
        out = []
        for call in self.ctx.nodes(cst.Call):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value == "step"):
                continue
            if dotted(func.value) == target or (call.args and dotted(call.args[0].value) == target):
                out.append(call)
        return out

    def _sync(self, o, m: str) -> None:
        ctx, tm = self.ctx, self.ctx.tm
        edits = [insert_before(o.statement, [cst.parse_statement(f"{tm}.share_params({m})")])]
        for step in self._steps(o.target):
            line = ctx.statement_of(step)
            if isinstance(line, cst.SimpleStatementLine) and isinstance(ctx.parent(line), cst.IndentedBlock):
                edits.append(insert_before(line, [cst.parse_statement(f"{tm}.sync_grads({m})")]))
        self.report(o.call, f"`{m}` is differentiated by hand (torch.autograd.grad over its parameters), which DDP does "
                            f"not support: every rank starts from rank 0's weights (`{tm}.share_params`) and averages "
                            f"its gradients before each step (`{tm}.sync_grads`)",
                    edits=edits, imports=[ctx.runtime_import()])

"""TM401: the forward pass and the loss of each training step (and evaluation forwards) run under autocast."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import libcst as cst

from torchmigrate.finding import Safety, replace, wrap
from torchmigrate.syntax.nodes import code
from torchmigrate.rule import Context, Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.edits import call_node, call_stmt, expr_of, runtime_kwargs, with_node
from torchmigrate.rules.amp.plan import BCE_BLOCKED, Region, plan


class AutocastForward(AmpRule):
    """
    ## What it does
    Runs the forward pass and the loss computation of each training step under
    `with tm.autocast():` (the runtime's autocast: bf16 where supported, else fp16; bf16 on
    CPU), leaving `backward()` outside. Evaluation loops (under `torch.no_grad()` /
    `inference_mode()`) get autocast too, without a scaler. A `backward()` written inside an
    existing autocast block is moved out of it.

    The wrapped run starts at the first statement the loss depends on that calls a model (a
    trained model, or a module held in a variable: `teacher(x)`, `vae.encode(x)`), so input
    preparation before it (`x.to(device)`, `Variable(...)`, resizing) and unrelated statements
    (`zero_grad()`, LR warm-up, plotting) stay outside; without such a call, at the first
    dependency that does more than move data. It ends at the last assignment of the loss before
    `backward()`; a loss computed by a helper call is wrapped as that call. Torch's losses are
    autocast-aware and run inside the block; a loss of the project's own (a function or class of
    the program, `self.compute_loss`, `model.loss`) is written for float32 inputs, so the block
    ends before it when no model runs after it, and the outputs it reads come back in float32:
    a focal loss clamping to `1 - 1e-4` (1.0 in bf16) took `log(0)` and stepped NaN. A forward already
    under autocast is left alone, also through a variable or helper that holds the context
    (`ctx = nullcontext() if cpu else torch.autocast(...)` then `with ctx:`, nanoGPT).

    Forward outputs bound in the block and read after it for more than a shape or an argmax
    (the accuracy, a test loss, softmax probabilities) are read back in float32 right after the
    block (`out = tm.to_float32(out)`, any nesting of tuples, lists and dicts): a metric computed
    on bf16 outputs is off in the third digit (a test loss of 2.2891 instead of 2.2852).

    ## Why is this bad?
    Without autocast the model runs in fp32 and gets none of the speed or memory benefits of
    tensor cores. Running `backward()` under autocast is "not recommended": backward ops run in
    the dtype autocast chose for the corresponding forward ops anyway (PyTorch AMP examples).

    ## Limitations
    Reported for a manual change instead: a forward written inside the `backward()` expression
    (`criterion(model(x), y).backward()`), outputs of the forward that are later converted to
    numpy (bf16 has no numpy dtype), `nn.BCELoss` (see TM409), optimizer closures, `model.half()`.
    With `--amp off` nothing is added.
    """

    code = "TM401"
    name = "autocast-forward"
    summary = "Run forward and loss (not backward) under autocast"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                out = model(x)
                loss = criterion(out, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                with tm.autocast():
                    out = model(x)
                    loss = criterion(out, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip:
            return
        for region in p.regions:
            what = "the forward and the loss" if region.kind == "train" else "the evaluation forward"
            self.report(region.first, f"run {what} under `with {ctx.tm}.autocast():`",
                        edits=[wrap(region.first, region.last, partial(_autocast_block, ctx, region))],
                        imports=[ctx.runtime_import()])
        for first, why in p.region_manual:
            if why == BCE_BLOCKED:
                continue  # TM409 reports it
            self.report(first, why)
        for w in p.backward_moves:
            self.report(w, "`backward()` runs inside autocast: move it (and what follows) out of the block",
                        edits=[replace(w, _move_backward_out)])
        for s in p.backward_inside:
            self.report(s, "`backward()` runs inside autocast: end the autocast block before the backward")


def _autocast_block(ctx: Context, region: Region, body: Sequence[cst.BaseStatement]):
    """`with tm.autocast():` around `body`, then the outputs the code after it reads back in
    float32 (`out = tm.to_float32(out)`), so metrics are not computed in bf16/fp16."""
    block = with_node(call_node(f"{ctx.tm}.autocast", **runtime_kwargs(ctx)), body)
    if not region.float_after:
        return block
    return cst.FlattenSentinel([block, *(call_stmt(expr_of(f"{ctx.tm}.to_float32({name})"), name)
                                         for name in region.float_after)])


def _move_backward_out(w: cst.With):
    body = list(w.body.body)
    split = next((i for i, s in enumerate(body) if ".backward(" in code(s)), None)
    if not split:
        return w
    inner = w.with_changes(body=w.body.with_changes(body=body[:split]))
    return cst.FlattenSentinel([inner, *body[split:]])

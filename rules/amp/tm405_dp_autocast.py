"""TM405: models kept under nn.DataParallel enter autocast inside their `forward`."""

from __future__ import annotations

from typing import Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, wrap
from torchmigrate.syntax.nodes import code
from torchmigrate.program.precision import (DATA_PARALLEL, caller_dtype, model_class, replica_settings_lost,
                                            wrappable_forward)
from torchmigrate.rule import Example
from torchmigrate.rules.amp.base import AmpRule
from torchmigrate.rules.amp.edits import call_node, runtime_kwargs, with_node
from torchmigrate.rules.amp.plan import plan


class DataParallelAutocast(AmpRule):
    """
    ## What it does
    For code that keeps `nn.DataParallel` (`torchmigrate amp`), runs the model's `forward`
    under `with tm.autocast():` inside the model class, when the class is defined in the file
    (with the caller's dtype when every autocast of the file names the same constant one). In
    `lint`, reports DataParallel models in files whose autocast is not CUDA's default fp16
    (`dtype=torch.bfloat16`, a dtype from a variable, `cache_enabled=`, `tm.autocast()`).

    ## Why is this bad?
    DataParallel runs each replica's forward in its own thread, and autocast state is
    thread-local. Since PyTorch 1.10 `parallel_apply` re-enters autocast in every replica
    thread, but only with the caller's *enabled* flag (`torch.autocast(device_type,
    enabled=...)`): the dtype and the weight-cast cache setting fall back to the thread's
    defaults. A bf16 autocast around `dp_model(x)` (what `tm.autocast()` picks on GPUs that
    support it) runs the replicas in fp16, CUDA's default autocast dtype: fp16 activations where
    bf16 was chosen, and an fp16 backward without loss scaling (small gradients underflow),
    since the scaler is disabled for bf16. Autocast entered inside `forward` runs in the replica's thread and keeps the dtype.

    ## Limitations
    A model class from another module (torchvision, timm) is reported for a manual change.
    Nothing is done when the dtype is forced to fp16 (`--amp fp16`), which the replicas
    already use.
    """

    code = "TM405"
    name = "dp-autocast"
    summary = "Put autocast inside forward for nn.DataParallel models"
    safety = Safety.SAFE
    commands = frozenset({"amp", "lint"})
    examples = (
        Example(
            before="""
            import torch.nn as nn
            class Net(nn.Module):
                def forward(self, x):
                    return self.fc(x)

            model = nn.DataParallel(Net().cuda())
            """,
            after="""
            import torch.nn as nn
            import torchmigrate.runtime as tm
            class Net(nn.Module):
                def forward(self, x):
                    with tm.autocast():
                        return self.fc(x)

            model = nn.DataParallel(Net().cuda())
            """,
            mode="amp",
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        p = plan(ctx)
        if p.skip or ctx.options.amp in ("off", "fp16") or p.blockers:
            return
        if ctx.options.mode == "ddp":
            return
        facts = analysis.facts(ctx)
        dp_calls = [call for call, name in facts.calls if name in DATA_PARALLEL and call.args]
        if not dp_calls:
            return
        if ctx.options.mode == "lint" and not replica_settings_lost(ctx):
            return
        kwargs = runtime_kwargs(ctx)
        if not kwargs and not p.regions:  # (new autocast regions use the runtime's policy)
            dtype = caller_dtype(ctx)
            if dtype is not None:
                kwargs = {"dtype": dtype}
        shown = ", ".join(f"{k}={code(v)}" for k, v in kwargs.items())
        done: Set[str] = set()
        for call in dp_calls:
            klass = model_class(ctx, call.args[0].value)
            if klass is None:
                self.report(call, "DataParallel replicas run autocast with CUDA's default dtype (fp16), not the "
                                  "caller's (bf16 with `tm.autocast()` where supported): put "
                                  f"`with tm.autocast({shown}):` inside the model's `forward`, or use DDP "
                                  "(`torchmigrate ddp`)")
                continue
            if klass.name.value in done:
                continue
            done.add(klass.name.value)
            forward, body = wrappable_forward(ctx, call)
            if forward is None:
                self.report(call, f"put `with tm.autocast({shown}):` inside `{klass.name.value}.forward`: "
                                  "DataParallel replicas run autocast with CUDA's default dtype (fp16), not the caller's")
                continue
            if not body:
                continue
            self.report(forward, f"run `{klass.name.value}.forward` under autocast: DataParallel replicas get "
                                 "only the caller's autocast on/off state, not its dtype (bf16 would run as fp16)",
                        edits=[wrap(body[0], body[-1], lambda b, kw=kwargs: with_node(
                            call_node(f"{ctx.tm}.autocast", **kw), b))],
                        imports=[ctx.runtime_import()])

"""TM408: the rest of apex (`apex.parallel.DistributedDataParallel`, SyncBatchNorm, fused
optimizers and norms) -> torch. What TM407 and TM408 share (the conversions decided once for
both, the apex imports) is in `apex`."""

from __future__ import annotations

from typing import Dict, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, replace
from torchmigrate.syntax.nodes import code, expr, with_args
from torchmigrate.rule import Example
from torchmigrate.program.precision import APEX_AMP
from torchmigrate.rules.amp.apex import ApexRule, ApexState, Collector, is_apex

_APEX_DDP = ("apex.parallel.DistributedDataParallel", "apex.parallel.distributed.DistributedDataParallel")
_APEX_SYNCBN_CONVERT = ("apex.parallel.convert_syncbn_model",)
_APEX_SYNCBN = ("apex.parallel.SyncBatchNorm", "apex.parallel.optimized_sync_batchnorm.SyncBatchNorm")
# apex class -> (torch replacement, keyword arguments torch does not take)
_APEX_CLASSES: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    # (older apex's FusedAdam also took `max_grad_norm` and `eps_inside_sqrt`)
    "apex.optimizers.FusedAdam": ("torch.optim.AdamW", ("bias_correction", "adam_w_mode", "set_grad_none",
                                                         "capturable", "master_weights", "max_grad_norm",
                                                         "eps_inside_sqrt")),
    "apex.optimizers.FusedSGD": ("torch.optim.SGD", ("wd_after_momentum", "materialize_master_grads",
                                                      "set_grad_none")),
    "apex.optimizers.FusedAdagrad": ("torch.optim.Adagrad", ("set_grad_none", "adagrad_w_mode")),
    "apex.normalization.FusedLayerNorm": ("torch.nn.LayerNorm", ("memory_efficient",)),
    "apex.normalization.MixedFusedLayerNorm": ("torch.nn.LayerNorm", ("memory_efficient",)),
    "apex.normalization.FusedRMSNorm": ("torch.nn.RMSNorm", ("memory_efficient",)),
    "apex.parallel.SyncBatchNorm": ("torch.nn.SyncBatchNorm", ("channel_last", "fuse_relu")),
}
class ApexParallel(ApexRule):
    """
    ## What it does
    Replaces the rest of apex with torch: `apex.parallel.DistributedDataParallel(model, ...)`
    becomes `tm.wrap_model(model)` (DDP on the process's device, plain model in one process),
    `convert_syncbn_model(model)` becomes `tm.sync_batchnorm(model)` (torch's SyncBatchNorm where
    it can run, distributed on CUDA; the model unchanged on CPU ranks and in one process),
    `apex.parallel.SyncBatchNorm` becomes `torch.nn.SyncBatchNorm`, `FusedAdam`/`FusedSGD`/
    `FusedAdagrad` become `torch.optim.AdamW`/`SGD`/`Adagrad` (`FusedAdam(adam_w_mode=False)`
    becomes `Adam`), `FusedLayerNorm`/`FusedRMSNorm` become `torch.nn.LayerNorm`/`RMSNorm`.
    apex-only arguments (`delay_allreduce`, `message_size`, `bias_correction`, ...) are dropped
    and listed in the finding. No apex import remains.

    ## Why is this bad?
    apex deprecated its DistributedDataParallel and SyncBatchNorm for the torch equivalents and
    then removed them (NVIDIA/apex#1896); importing them fails on current apex and apex is an
    extra CUDA build most machines do not have.

    ## Limitations
    Other apex modules (`FusedLAMB`, `apex.contrib`, `apex.fp16_utils`, `LARC`) are reported
    for a manual change.
    """

    code = "TM408"
    name = "apex-ddp"
    summary = "Replace apex DDP / SyncBN / fused modules with torch"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "amp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from apex.parallel import DistributedDataParallel as DDP, convert_syncbn_model
            model = convert_syncbn_model(model)
            model = DDP(model, delay_allreduce=True)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            model = tm.sync_batchnorm(model)
            model = tm.wrap_model(model)
            """,
            mode="ddp",
        ),
    )

    @staticmethod
    def decide(collector: Collector) -> None:
        _decide_parallel(collector)

    def leave_Module(self, node: cst.Module) -> None:
        self.report_decided()


def _decide_parallel(self: Collector) -> None:
    ctx = self.ctx
    state = self.state
    facts = analysis.facts(ctx)
    for call, name in facts.calls:
        if not is_apex(name) or name == APEX_AMP or name.startswith(APEX_AMP + "."):
            continue
        if name in _APEX_DDP:
            _ddp(self, call, state)
        elif name in _APEX_SYNCBN_CONVERT:
            state.converted.add(call)
            kept = [a for a in call.args if a.keyword is None][:1] + [
                a for a in call.args if a.keyword and a.keyword.value in ("process_group",)]
            dropped = [a.keyword.value for a in call.args if a.keyword and a.keyword.value != "process_group"]
            note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
            kept = kept[:1]  # tm.sync_batchnorm takes the model only (its process group is the default one)
            if any(a.keyword and a.keyword.value == "process_group" for a in call.args):
                dropped.append("process_group")
            note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
            self.report(call, f"apex `convert_syncbn_model` -> `{ctx.tm}.sync_batchnorm` (SyncBatchNorm where it runs: "
                              f"distributed on CUDA; the model as it is on CPU ranks and in one process){note}",
                        edits=[replace(call, lambda c, k=kept: with_args(
                            c.with_changes(func=expr(f"{ctx.tm}.sync_batchnorm")), k))],
                        imports=[ctx.runtime_import()])
        elif name in _APEX_CLASSES or name in _APEX_SYNCBN:
            target, drop = _APEX_CLASSES.get(name) or _APEX_CLASSES["apex.parallel.SyncBatchNorm"]
            if name == "apex.optimizers.FusedAdam":
                mode = next((a.value for a in call.args if a.keyword and a.keyword.value == "adam_w_mode"), None)
                if mode is not None and code(mode) in ("False", "0"):
                    target = "torch.optim.Adam"
                elif mode is not None and code(mode) not in ("True", "1"):
                    self.report(call, "`FusedAdam(adam_w_mode=...)` with a computed mode: use torch.optim.AdamW "
                                      "(decoupled weight decay) or torch.optim.Adam by hand")
                    continue
            dropped = [a.keyword.value for a in call.args if a.keyword and a.keyword.value in drop]
            if any(a.keyword is None for a in call.args[1:]) and "optimizers" in name:
                self.report(call, f"`{name.rsplit('.', 1)[1]}` with positional options: replace it by "
                                  f"`{target}` by hand")
                continue
            state.converted.add(call)
            note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
            self.report(call, f"apex `{name.rsplit('.', 1)[1]}` -> `{target}`{note}",
                        edits=[replace(call, lambda c, t=target, d=drop: with_args(
                            c.with_changes(func=expr(t)),
                            [a for a in c.args if not (a.keyword and a.keyword.value in d)]))],
                        imports=[Import("torch")])
        else:
            self.report(call, f"`{name}` has no automatic torch replacement: replace it by hand so no apex "
                              "import remains")

def _ddp(self, call: cst.Call, state: ApexState) -> None:
    ctx = self.ctx
    module = next((a for a in call.args if a.keyword is None), None) or next(
        (a for a in call.args if a.keyword and a.keyword.value == "module"), None)
    if module is None:
        return
    dropped = [a.keyword.value for a in call.args if a.keyword and a is not module]
    note = f" (dropped apex options: {', '.join(dropped)})" if dropped else ""
    state.converted.add(call)
    self.report(call, f"apex DistributedDataParallel -> `{ctx.tm}.wrap_model`{note}",
                edits=[replace(call, lambda c, m=module.value: cst.Call(
                    func=expr(f"{ctx.tm}.wrap_model"), args=[cst.Arg(m)]))],
                imports=[ctx.runtime_import()])

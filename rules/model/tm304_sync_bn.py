"""TM304: BatchNorm becomes SyncBatchNorm when the model is wrapped (opt-in: `--sync-bn`)."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety, replace
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule
from torchmigrate.rules.model.plan import DPSite, NewWrap


class SyncBN(ModelRule):
    """
    ## What it does
    For a wrapped model that contains BatchNorm layers (a model class of the file that uses
    `nn.BatchNorm*d`, directly or through its building blocks, or a torchvision ResNet-style
    model), `torchmigrate ddp --sync-bn` makes the wrap `tm.wrap_model(model, sync_bn=True)`,
    which converts the layers to `nn.SyncBatchNorm` before DDP (on CUDA; a no-op on CPU).
    Without `--sync-bn` the migration lists the models it wraps as notes (per-rank BatchNorm
    statistics are the documented difference from one process, not a defect: no TODO, not
    counted as needing attention). `lint` reports
    user-written `DistributedDataParallel(model)` with an unsafe fix that inserts
    `model = tm.sync_batchnorm(model)` before it (`--unsafe-fixes`: SyncBatchNorm where it can
    run, distributed on CUDA, so the script still runs on CPU ranks and as one process); a
    DDP the user wrote is otherwise left alone by `ddp`, and `tm.wrap_model` by `lint`.

    ## Why is this bad?
    Under DDP each rank normalises over its own per-rank batch. With small per-rank batches
    (detection, segmentation) the statistics get noisy and accuracy drops; SyncBatchNorm
    computes them over the global batch, at the cost of a collective per BatchNorm layer. The
    conversion must happen before DDP wraps the model (NVIDIA/apex#109).

    ## Example
    ```python
    model = ResNetLike().to(device)       # uses nn.BatchNorm2d
    model = tm.wrap_model(model)
    ```
    becomes, with `--sync-bn`,
    ```python
    model = ResNetLike().to(device)
    model = tm.wrap_model(model, sync_bn=True)
    ```
    """

    code = "TM304"
    name = "sync-bn"
    summary = "Convert BatchNorm to SyncBatchNorm when wrapping (opt-in: --sync-bn)"
    safety = Safety.UNSAFE
    examples = (
        Example(
            before="""
            import torch.nn as nn
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).cuda()
            model = DDP(model, device_ids=[local_rank])
            """,
            mode="lint",  # reported with an unsafe fix (applied with --unsafe-fixes)
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = self.plan()
        if not p.active[self.code]:
            return
        safety = Safety.SAFE if self.ctx.options.mode == "ddp" else Safety.UNSAFE
        for nw in [*p.new, *p.dp_sites]:
            if getattr(nw, "sync_bn", False) and getattr(nw, "bound", None) is None:
                name = nw.name if isinstance(nw, NewWrap) else nw.wrap.name
                anchor = nw.anchor if isinstance(nw, NewWrap) else (nw.target or nw.outer)
                if isinstance(nw, DPSite) and nw.action == "remove":
                    continue
                node_ = nw.opt.call if isinstance(nw, NewWrap) else nw.outer
                # The keyword itself is part of the one wrap statement TM301/TM306 write.
                self.report(node_, f"`{name}` contains BatchNorm layers: convert them to SyncBatchNorm when wrapping "
                                   "(`sync_bn=True`)", edits=[replace(anchor, lambda n: n)], safety=safety)
        for call, message, edits in p.sync_bn_fixes:
            imports = [self.ctx.runtime_import()] if any(e.kind != "replace" for e in edits) else []
            self.report(call, message, edits=edits, safety=safety, imports=imports)
        self.notes(self.code)

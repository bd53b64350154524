"""TM305: learning rates not scaled for the global batch, which grows with the number of ranks."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule


class LrWorldSize(ModelRule):
    """
    ## What it does
    Reports, once per optimizer, that the learning rate is not scaled with the number of
    processes, unless the learning rate or the DataLoader batch size already involves the world
    size (`lr * world_size`, `batch_size // dist.get_world_size()`). `ddp` reports the
    optimizers of the models it wraps (a TODO comment); `lint` those of user-written DDP models.

    ## Why is this bad?
    Every rank now loads `batch_size` samples and DDP averages the gradients, so N ranks train
    with a global batch of N × `batch_size` at the old learning rate. Whether to scale the
    learning rate (linear scaling rule) or to shrink the per-rank batch is a modelling choice
    (Lightning-AI/pytorch-lightning#3706, facebookresearch/detectron2#934); the tool does not
    make it silently.

    ## Example
    ```python
    model = tm.wrap_model(model)
    optimizer = SGD(model.parameters(), lr=args.lr)   # global batch is now N x larger
    ```
    """

    code = "TM305"
    name = "lr-world-size"
    summary = "Report learning rates not scaled for the larger global batch"
    safety = Safety.MANUAL
    examples = (
        Example(
            before="""
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            mode="lint",  # reported (in `ddp`, for the models the migration wraps: a TODO comment)
        ),
        Example(
            before="""
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size())
            """,
            mode="lint",  # not reported: the learning rate already scales with the world size
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if self.plan().active[self.code]:
            self.notes(self.code)

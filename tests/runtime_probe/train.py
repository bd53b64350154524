"""Probe launched by tests/test_runtime_dist.py (two-node torchrun on localhost, or plain python
processes with SLURM variables): a few DDP steps on per-rank data; writes <outdir>/rank<R>.json."""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import torchmigrate.runtime as tm


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors]).tolist()


def main(outdir):
    ctx = tm.setup(timeout=datetime.timedelta(seconds=60))
    res = {"rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
           "pg": dist.is_initialized() and dist.get_world_size(),
           "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT")}}
    tm.seed_everything(1, per_rank=True)  # different init per rank: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2))
    res["params_init"] = flat(model.parameters())
    model = tm.wrap_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    for _ in range(4):
        x, y = torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        with tm.autocast():
            loss = nn.functional.mse_loss(model(x.to(tm.device())).float(), y.to(tm.device()))
        loss.backward()
        opt.step()
    res["params"] = flat(model.parameters())
    res["loss_sum"] = tm.all_reduce(loss.item())
    res["count"] = tm.all_reduce(ctx.rank + 1)
    with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(res, f)
    tm.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])

"""Probe launched by tests/test_runtime_dist.py under torchrun (2 processes, gloo): train a
wrapped model held as a module global (what migrated scripts do), call tm.cleanup(), then check
that cleanup() released the DDP wrapper from the process group and that the wrapper still runs
plain forward/backward passes in this process. Writes <outdir>/rank<R>.json."""
import gc
import json
import os
import sys
import weakref

import torch
import torch._dynamo  # noqa: F401 - imported before the group exists: importing it later (as
#                       DDP's constructor does) keeps references to the live group for good
import torch.distributed as dist
from torch import nn

import torchmigrate.runtime as tm

outdir = sys.argv[1]
ctx = tm.setup()
group = weakref.ref(dist.group.WORLD)
torch.manual_seed(0)
model = tm.wrap_model(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
reducer = weakref.ref(model.reducer)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
tm.save(tm.unwrap(model).state_dict(), os.path.join(outdir, "model.pt"))
res = {"rank": ctx.rank, "wrapped": [c.__name__ for c in type(model).__mro__]}
tm.cleanup()
gc.collect()
res["pg_after"] = dist.is_initialized()
res["reducer_freed"] = reducer() is None
res["group_freed"] = group() is None
res["attrs"] = [getattr(model, a, "missing") is None for a in ("reducer", "logger", "process_group")]
x = torch.randn(5, 3)
model.eval()
with torch.no_grad():
    res["eval_same"] = torch.equal(model(x), model.module(x))
model.train()
model.zero_grad()
model(x).sum().backward()  # local backward: no hook into the destroyed group
res["grads"] = all(p.grad is not None for p in model.parameters())
res["unwrap_same"] = tm.unwrap(model) is model.module
with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump(res, f)

"""Probe launched by tests/test_runtime_dist.py under torchrun (2 processes, gloo): a critic
wrapped in DDP trained with a gradient penalty backpropagated on its own (WGAN-GP's
`gp.backward()` after the critic's loss), through `tm.grad`. Autograd gives the last layer's
bias no gradient from the penalty; without `tm.grad`'s zero term DDP fails at the next forward.
Each rank draws its own batches; the parameters must stay equal. Writes <outdir>/rank<R>.json."""
import json
import os
import sys

import torch
from torch import nn

import torchmigrate.runtime as tm

outdir = sys.argv[1]
ctx = tm.setup()
torch.manual_seed(0)
critic = tm.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
opt = torch.optim.SGD(critic.parameters(), lr=0.1)
torch.manual_seed(1 + ctx.rank)
for _ in range(3):
    x = torch.randn(6, 4)
    loss = critic(x).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    xi = x.clone().requires_grad_(True)
    out = critic(xi)
    g = tm.grad(outputs=out, inputs=xi, grad_outputs=torch.ones_like(out), create_graph=True)[0]
    penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
    opt.zero_grad()
    penalty.backward()
    opt.step()
params = [p.detach().flatten().tolist() for p in tm.unwrap(critic).parameters()]
with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump({"params": params}, f)
tm.cleanup()

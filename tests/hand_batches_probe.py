"""Runs a training program of fixtures/hand_batches/ (the original or its migrated copy) as
`__main__`, in this process, and records what it trained on: every training forward of its `Net`
(each input row, as text, padding zeros stripped), the optimizer steps, the parts of the index
sets `tm.shard_indices` handed out, and the final parameters of the `Net`. Writes
<outdir>/rank<RANK>.json. With PROBE_SEED=s, rank r first seeds random, numpy and torch with s + r, so
rank 0 draws what one process draws and the other ranks draw differently (unless the migration
makes them agree). Used by tests/test_hand_batches_e2e.py, under torchrun or alone."""
import json
import os
import runpy
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook

import torchmigrate.runtime as tm

script, outdir = sys.argv[1], sys.argv[2]
seen = {"forwards": [], "steps": 0, "parts": []}
nets = []


def row_text(row) -> str:
    values = row.reshape(-1).tolist()
    while values and values[-1] == 0:
        values.pop()
    return repr(values)


def record_forward(module, args):
    # (the runtime's DDP wrapper is named after the module it wraps: only the module itself counts)
    if type(module).__name__ == "Net" and not isinstance(module, DistributedDataParallel) and module.training \
            and torch.is_grad_enabled():
        if module not in nets:
            nets.append(module)
        seen["forwards"].append([row_text(row) for row in args[0]])


def count_step(optimizer, args, kwargs):
    seen["steps"] += 1


def recording(shard_indices):
    def wrapper(idx):
        part = shard_indices(idx)
        if not seen["parts"]:
            seen["parts"] = (part.nonzero().reshape(-1) if part.dtype == torch.bool else part).tolist()
        return part
    return wrapper


nn.modules.module.register_module_forward_pre_hook(record_forward)
register_optimizer_step_post_hook(count_step)
tm.shard_indices = recording(tm.shard_indices)
if os.environ.get("PROBE_SEED"):  # rank r seeds base + r: what rank 0 draws is what one process draws
    import random

    import numpy as np
    seed = int(os.environ["PROBE_SEED"]) + int(os.environ.get("RANK", "0"))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
seen["params"] = [v for p in nets[0].parameters() for v in p.detach().reshape(-1).tolist()]
with open(os.path.join(outdir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(seen, f)

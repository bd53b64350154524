"""Probe for tests/test_runtime_faults.py: a resumable DDP training loop that one rank breaks.

    python faults.py OUTDIR MODE      MODE: kill (SIGKILL itself), raise (an exception), ok

Every step all-reduces and rank 0 saves a checkpoint with tm.save; a restarted run resumes
from it. Rank 1 breaks at step 3 of the first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT), so `--max-restarts=1` finishes. Each rank writes
OUTDIR/rank<R>.json when it completes."""
import datetime
import json
import os
import signal
import sys
import time

import torch
from torch import nn

import torchmigrate.runtime as tm

STEPS = 6


def main(outdir, mode):
    ctx = tm.setup(timeout=datetime.timedelta(seconds=float(os.environ.get("FAULT_TIMEOUT", "60"))))
    ckpt = os.path.join(outdir, "ckpt.pt")
    torch.manual_seed(0)
    model = tm.wrap_model(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if os.path.exists(ckpt):
        state = tm.load(ckpt)
        tm.load_state_dict(model, state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    began = time.time()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(start, STEPS):
        if ctx.rank == 1 and step == 3 and first_attempt and mode != "ok":
            with open(os.path.join(outdir, "broke_at"), "w") as f:
                f.write(repr(time.time()))
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure on rank 1")
        opt.zero_grad()
        x = torch.full((2, 4), float(ctx.rank + step))
        model(x).sum().backward()
        opt.step()
        tm.all_reduce(step)
        tm.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt)
        tm.barrier()
    with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump({"start": start, "began": began, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}, f)
    tm.cleanup()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

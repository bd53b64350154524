"""What the runtime's safety nets cost a training step, under torchrun on 2 CPU ranks (gloo).

Runs the same small training loop (an MLP of `--layers` Linear layers, each step a forward, a
backward and an SGD step) three times and prints the median step time of each:

- ``default``: what a migrated program gets (``tm.wrap_model``'s gradient hooks, its
  parameter-drift checks, the write audit on rank 1);
- ``TORCHMIGRATE_CHECKS=0``: without the drift checks and the write audit;
- ``TORCHMIGRATE_DDP=plain``: plain DistributedDataParallel (no gradient hooks), checks off too.

    python benchmarks/runtime_checks.py --layers 40 --steps 200

With ``--worker`` it is the training loop itself (started by torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(layers: int, steps: int, width: int, out: str) -> None:
    import torch
    from torch import nn

    import torchmigrate.runtime as tm

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    model = tm.wrap_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, width)
    times = []
    for step in range(steps):
        start = time.process_time()  # CPU time: a loaded machine inflates it much less than wall time
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.process_time() - start)
    if tm.is_main():
        with open(out, "w") as f:
            json.dump(times[steps // 5:], f)  # the first fifth warms up
    tm.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--worker", metavar="OUT")
    args = ap.parse_args()
    if args.worker:
        worker(args.layers, args.steps, args.width, args.worker)
        return
    settings = {"default": {}, "TORCHMIGRATE_CHECKS=0": {"TORCHMIGRATE_CHECKS": "0"},
                "TORCHMIGRATE_DDP=plain": {"TORCHMIGRATE_DDP": "plain", "TORCHMIGRATE_CHECKS": "0"}}
    print(f"{args.layers} Linear({args.width}, {args.width}) layers ({2 * args.layers} parameters), batch 32, "
          f"2 gloo ranks, median of {args.steps - args.steps // 5} steps")
    for label, extra in settings.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            __file__, "--worker", out, "--layers", str(args.layers), "--width", str(args.width),
                            "--steps", str(args.steps)], env=env, check=True, capture_output=True)
            with open(out) as f:
                times = json.load(f)
        print(f"  {label:24s} {statistics.median(times) * 1000:7.3f} ms CPU/step")


if __name__ == "__main__":
    main()

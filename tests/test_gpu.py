"""Migrated example scripts on a real CUDA GPU (skipped without one).

The CPU suite runs every migrated script on gloo ranks with bf16 autocast and a disabled
GradScaler; what only a GPU shows is checked here, under `torchrun --standalone
--nproc-per-node=1` (one rank: one GPU is enough, and torchrun's variables are set as in a real
job):

  * the runtime puts the model and batches on `cuda:LOCAL_RANK` and the script trains there;
  * with `TORCHMIGRATE_AMP=fp16`, autocast really runs in float16 on CUDA and the GradScaler is
    enabled: where the script saves the scaler, the saved scale is a real (> 1) loss scale (with
    bf16 the runtime's scaler is off, but a script's own `GradScaler(enabled=flag)` wins);
  * with the default policy (`auto`), a GPU with bf16 support autocasts to bfloat16;
  * the checkpoint has no `module.` prefixes and loads into the single-process keys;
  * on a one-GPU machine, two NCCL ranks fail early with the runtime's own advice, and gloo
    ranks sharing the GPU (that advice) train.

tests/amp_probe/sitecustomize.py records the autocast contexts each run enters.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import AMP_PROBE, FIXTURES, autocast_seen
from launcher import torchrun

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPTS = FIXTURES / "scripts"
EPOCH_LINE = re.compile(r"epoch (\d+) loss ([0-9.]+|nan|inf)")
NOT_MONOTONE = {"gan.py"}  # the discriminator loss is not expected to fall every epoch
ALL = sorted(p.name for p in SCRIPTS.glob("*.py"))


def _env(out_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHMIGRATE_AMP", "CUDA_VISIBLE_DEVICES")}
    env.update(OUT_DIR=str(out_dir), EPOCHS="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", TM_AMP_PROBE=str(out_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(AMP_PROBE), os.environ.get("PYTHONPATH")])))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _state_dicts(obj, path=""):
    """Every (path, state dict) in a checkpoint: the dicts whose values are tensors."""
    if isinstance(obj, dict):
        if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
            yield path, obj
        for k, v in obj.items():
            yield from _state_dicts(v, f"{path}.{k}" if path else str(k))


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_migrated")
    for name in ALL:
        shutil.copy(SCRIPTS / name, root / name)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", *ALL], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return root


@pytest.mark.parametrize("amp", ["fp16", "auto"])
@pytest.mark.parametrize("name", ALL)
def test_migrated_script_trains_on_gpu(name, amp, migrated, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = torchrun("--standalone", "--nproc-per-node=1", migrated / name, cwd=tmp_path, timeout=300,
                   env=_env(out, TORCHMIGRATE_AMP=amp), stale=[out / "amp_*.json"])
    assert run.returncode == 0, run.report()
    epochs = [(int(e), float(v)) for e, v in EPOCH_LINE.findall(run.output)]
    assert [e for e, _ in epochs] == [0, 1, 2], run.output[-3000:]
    if name not in NOT_MONOTONE:
        assert epochs[-1][1] < epochs[0][1], f"loss must go down: {epochs}"

    seen = autocast_seen(out)
    cuda_autocast = {k: n for k, n in seen.items() if k.startswith("cuda:") and k.endswith(":True")}
    if cuda_autocast:  # scripts that own their `enabled=` flag may keep AMP off; none run on CPU
        expected = "torch.float16" if amp == "fp16" else (
            "torch.bfloat16" if torch.cuda.is_bf16_supported() else "torch.float16")
        assert set(cuda_autocast) == {f"cuda:{expected}:True"}, seen
    assert not [k for k in seen if k.startswith("cpu:") and k.endswith(":True")], seen

    ckpt = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    for where, state in _state_dicts(ckpt):
        assert not [k for k in state if str(k).startswith("module.")], where
        assert all(t.device.type == "cpu" for t in state.values())
    scalers = [v for k, v in ckpt.items() if k in ("scaler", "amp")] if isinstance(ckpt, dict) else []
    if amp == "fp16":  # an enabled scaler saves a real loss scale (a disabled one saves {})
        assert all(state and state["scale"] > 1 for state in scalers), scalers
    # with bf16 a script's own `GradScaler(enabled=flag)` stays as the script says (harmless)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_two_processes_on_one_gpu(migrated, tmp_path):
    """NCCL cannot put two ranks on one GPU: the runtime says so and how to go on; with the
    suggested TORCHMIGRATE_BACKEND=gloo both ranks share the GPU and train."""
    out = tmp_path / "out"
    out.mkdir()
    script = migrated / "main_function.py"
    nccl = torchrun("--standalone", "--nproc-per-node=2", script, cwd=tmp_path, timeout=300, env=_env(out))
    assert nccl.returncode != 0
    assert "NCCL needs one GPU per process" in nccl.output and "Duplicate GPU" not in nccl.output, nccl.report()
    gloo = torchrun("--standalone", "--nproc-per-node=2", script, cwd=tmp_path, timeout=300,
                    env=_env(out, TORCHMIGRATE_BACKEND="gloo"), stale=[out / "amp_*.json"])
    assert gloo.returncode == 0, gloo.report()
    assert [int(e) for e, _ in EPOCH_LINE.findall(gloo.output)] == [0, 1, 2], gloo.output[-3000:]
    assert any(k.startswith("cuda:") for k in autocast_seen(out)), "both ranks ran on the GPU"



NO_CUDA = """
import argparse
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--no_cuda", action="store_true")
args = p.parse_args()
model = nn.Linear(3, 3)
if not args.no_cuda:
    model = model.cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4, shuffle=True)
for (x,) in loader:
    if not args.no_cuda:
        x = x.cuda()
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained on", next(model.parameters()).device.type)
"""


def test_a_conditional_move_to_the_gpu_stays_conditional(tmp_path):
    """`--no_cuda` on a GPU machine: the migrated program trains on the CPU, as the original did
    (the wrap does not move a model the program left there); without it, on the GPU."""
    script = tmp_path / "train.py"
    script.write_text(NO_CUDA)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "train.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 1) and "move=False" in script.read_text(), proc.stdout + proc.stderr
    out = tmp_path / "out"
    out.mkdir()
    for flags, where in ((["--no_cuda"], "cpu"), ([], "cuda")):
        run = subprocess.run([sys.executable, str(script), *flags], cwd=tmp_path, capture_output=True, text=True,
                             timeout=300, env=_env(out))
        assert run.returncode == 0 and f"trained on {where}" in run.stdout, run.stdout + run.stderr

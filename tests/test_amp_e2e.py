"""AMP migrations, end to end: migrate example scripts written for apex and for `torch.cuda.amp`
(with accumulation and clipping) plus a plain accumulation script, then *train* them.

  1. `torchmigrate amp` on copies: no apex import remains, the output compiles, a second run
     changes nothing;
  2. each migrated script runs as `python script.py` on the CPU: training progresses (the last
     epoch's loss is below the first), bf16 autocast from the runtime is really entered, and
     the checkpoint holds the GradScaler state; the resumable ones resume from it;
  3. the `ddp`-migrated versions run under `torchrun --standalone --nproc-per-node=2` (gloo);
  4. with a CUDA GPU only: the fp16 + GradScaler path really scales the loss and skips steps
     whose gradients overflowed.

A test-only `sitecustomize.py` (tests/amp_probe/, put on PYTHONPATH) records which autocast
contexts the scripts enter.
"""

from __future__ import annotations

import ast
import math
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

SCRIPTS = FIXTURES / "scripts"
MIGRATED = ["apex_amp.py", "cuda_amp_accum.py", "grad_accum_resume.py"]
SCALER_KEY = {"apex_amp.py": "amp", "cuda_amp_accum.py": "scaler", "grad_accum_resume.py": "scaler"}
# cuda_amp_accum.py keeps its own `enabled=use_amp` (use_amp = torch.cuda.is_available()): no
# autocast on a CPU-only machine, as before the migration.
BF16_ON_CPU = {"apex_amp.py", "grad_accum_resume.py"}
RESUMABLE = {"apex_amp.py", "grad_accum_resume.py"}
EPOCH = re.compile(r"epoch (\d+) loss ([0-9.]+)")


def _env(out_dir: Path, gpu: bool = False, **extra) -> dict:
    """The scripts' environment: the probe on PYTHONPATH, no launcher variables, and the GPUs
    hidden unless ``gpu`` (the CPU tests assert on CPU autocast, also on a machine with a GPU)."""
    env = dict(os.environ)
    if gpu:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHMIGRATE_AMP", "RESUME"):
        env.pop(key, None)
    if not gpu:  # `auto` runs no autocast on the CPU: ask for bf16, to see the runtime enter it
        env["TORCHMIGRATE_AMP"] = "bf16"
    env.update(OUT_DIR=str(out_dir), EPOCHS="3", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONWARNINGS="ignore", TM_AMP_PROBE=str(out_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(AMP_PROBE), env.get("PYTHONPATH", "")])))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(args, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


def _cli(*args, cwd: Path) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "torchmigrate", *args], cwd, dict(os.environ), timeout=120)


def _apex_imports(source: str):
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "apex"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "apex":
            found.append(node.module)
    return found


def _epochs(output: str):
    return [(int(e), float(v)) for e, v in EPOCH.findall(output)]


def _check_checkpoint(path: Path, script: str) -> None:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    key = SCALER_KEY[script]
    assert key in ckpt, f"{script}: the checkpoint must hold the scaler state under {key!r}: {list(ckpt)}"
    assert isinstance(ckpt[key], dict)  # empty for a disabled scaler (bf16/CPU), else scale & co.


@pytest.fixture(scope="module")
def amp_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("amp_migrated")
    for name in MIGRATED:
        shutil.copy(SCRIPTS / name, folder / name)
    result = _cli("amp", *MIGRATED, cwd=folder)
    assert result.returncode in (0, 1), result.output  # 1: manual findings (TM604, TM404) remain
    assert "TM407" in result.output and "TM402" in result.output
    return folder


def test_amp_migration_output(amp_dir):
    for name in MIGRATED:
        source = (amp_dir / name).read_text(encoding="utf-8")
        assert source != (SCRIPTS / name).read_text(encoding="utf-8")
        assert not _apex_imports(source), name
        compile(source, name, "exec")
        assert "import torchmigrate.runtime as tm" in source
    before = {name: (amp_dir / name).read_bytes() for name in MIGRATED}
    _cli("amp", *MIGRATED, cwd=amp_dir)
    assert {name: (amp_dir / name).read_bytes() for name in MIGRATED} == before, "second run must be a no-op"


@pytest.mark.parametrize("name", MIGRATED)
def test_amp_migrated_script_trains_single_process(amp_dir, tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    run = _run([sys.executable, amp_dir / name], tmp_path, _env(out))
    assert run.returncode == 0, run.output[-4000:]
    epochs = _epochs(run.output)
    assert [e for e, _ in epochs] == [0, 1, 2], run.output[-2000:]
    assert epochs[-1][1] < epochs[0][1], f"loss must go down: {epochs}"
    _check_checkpoint(out / "checkpoint.pt", name)
    seen = autocast_seen(out)
    if name in BF16_ON_CPU:
        assert seen.get("cpu:torch.bfloat16:True", 0) > 0, seen
    if name in RESUMABLE:
        more = _run([sys.executable, amp_dir / name], tmp_path,
                    _env(out, EPOCHS=4, RESUME=out / "checkpoint.pt"))
        assert more.returncode == 0, more.output[-4000:]
        assert "resumed from epoch 2" in more.output
        assert [e for e, _ in _epochs(more.output)] == [3]
        _check_checkpoint(out / "checkpoint.pt", name)


@pytest.mark.parametrize("name", MIGRATED)
def test_ddp_migrated_script_trains_under_torchrun(tmp_path, name):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(SCRIPTS / name, work / name)
    result = _cli("ddp", name, cwd=work)
    assert result.returncode in (0, 1), result.output
    source = (work / name).read_text(encoding="utf-8")
    assert not _apex_imports(source)
    assert "tm.GradScaler(" in source and "tm.autocast(" in source
    out = tmp_path / "out"
    out.mkdir()
    run = torchrun("--standalone", "--nproc-per-node=2", work / name, env=_env(out), cwd=tmp_path,
                   timeout=300, stale=[out / "amp_*.json"])
    assert run.returncode == 0, run.report()
    epochs = _epochs(run.ranks[0])
    assert [e for e, _ in epochs] == [0, 1, 2], f"each epoch line once:\n{run.output[-3000:]}"
    assert _epochs(run.ranks[1]) == [], f"rank 1 logs no epoch line:\n{run.ranks[1][-3000:]}"
    assert epochs[-1][1] < epochs[0][1], f"loss must go down: {epochs}"
    _check_checkpoint(out / "checkpoint.pt", name)
    if name in BF16_ON_CPU:
        assert autocast_seen(out).get("cpu:torch.bfloat16:True", 0) > 0


INITIAL_TEST_LOSS = re.compile(r"initial test loss ([0-9.]+)")


def test_metrics_after_autocast_are_computed_in_float32(tmp_path):
    """amp_metrics.py computes its test loss (and a training accuracy from softmax
    probabilities) from the forward outputs after the forward. Migrated and run with bf16
    autocast, its first test loss (before any training step) must match the float32 original to
    1e-4: bf16 outputs read without `tm.to_float32` gave 2.2891 against 2.2852."""
    shutil.copy(SCRIPTS / "amp_metrics.py", tmp_path / "amp_metrics.py")
    result = _cli("amp", "amp_metrics.py", cwd=tmp_path)
    assert result.returncode in (0, 1), result.output
    source = (tmp_path / "amp_metrics.py").read_text(encoding="utf-8")
    assert source.count("logits = tm.to_float32(logits)") == 2, source
    fp32 = _run([sys.executable, SCRIPTS / "amp_metrics.py"], tmp_path, _env(tmp_path, TORCHMIGRATE_AMP="off"))
    amp = _run([sys.executable, tmp_path / "amp_metrics.py"], tmp_path, _env(tmp_path))
    assert fp32.returncode == 0 and amp.returncode == 0, fp32.output[-2000:] + amp.output[-2000:]
    assert autocast_seen(tmp_path).get("cpu:torch.bfloat16:True", 0) > 0
    want, got = (float(INITIAL_TEST_LOSS.search(r.output).group(1)) for r in (fp32, amp))
    assert abs(got - want) < 1e-4, (want, got)


def test_project_loss_runs_in_float32_after_the_autocast_block(tmp_path):
    """fixtures/TM401/project_loss trains with the project's focal loss, which clamps its
    probabilities to 1 - 1e-4: 1.0 in bf16, so `log(1 - p)` is -inf. Migrated, the autocast
    block ends before that loss and the logits are read back in float32: every epoch's loss
    stays finite and within 5 % of the float32 run (with the loss inside the block: NaN from
    the first epoch)."""
    case = FIXTURES / "TM401" / "project_loss"
    original, migrated = tmp_path / "original", tmp_path / "migrated"
    for folder in (original, migrated):
        folder.mkdir()
        for name in ("train", "losses"):
            shutil.copy(case / f"{name}.in.py", folder / f"{name}.py")
    result = _cli("amp", "train.py", cwd=migrated)
    assert result.returncode in (0, 1), result.output
    source = (migrated / "train.py").read_text(encoding="utf-8")
    assert "        logits = tm.to_float32(logits)\n        loss = criterion(" in source, source
    fp32 = _run([sys.executable, "train.py"], original, _env(tmp_path, TORCHMIGRATE_AMP="off"))
    amp = _run([sys.executable, "train.py"], migrated, _env(tmp_path))
    assert fp32.returncode == 0 and amp.returncode == 0, fp32.output[-2000:] + amp.output[-2000:]
    assert autocast_seen(tmp_path).get("cpu:torch.bfloat16:True", 0) > 0
    want, got = (_epochs(r.output) for r in (fp32, amp))
    assert len(got) == len(want) == 3, amp.output
    for (_, w), (_, g) in zip(want, got):
        assert math.isfinite(g) and abs(g - w) <= 0.05 * w, (want, got)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_fp16_grad_scaler_scales_and_skips_overflow():
    import torchmigrate.runtime as tm

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = tm.GradScaler(dtype="fp16")
    assert scaler.is_enabled()
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")

    with tm.autocast(dtype="fp16"):
        out = model(x)
        assert out.dtype == torch.float16
        loss = torch.nn.functional.cross_entropy(out, y)
    reference = torch.autograd.grad(loss, model.weight, retain_graph=True)[0]
    scaler.scale(loss).backward()
    scale = scaler.get_scale()
    assert scale > 1
    torch.testing.assert_close(model.weight.grad / scale, reference.float(), rtol=1e-2, atol=1e-4)
    before = model.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not torch.equal(before, model.weight), "a finite step is applied"

    # an overflowing step is skipped and the scale backs off
    optimizer.zero_grad()
    with tm.autocast(dtype="fp16"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(before, model.weight), "the step with inf gradients must be skipped"
    assert scaler.get_scale() == scale * 0.5


@cuda
def test_fp16_migrated_apex_script_on_gpu(amp_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run = _run([sys.executable, amp_dir / "apex_amp.py"], tmp_path, _env(out, gpu=True, TORCHMIGRATE_AMP="fp16"))
    assert run.returncode == 0, run.output[-4000:]
    epochs = _epochs(run.output)
    assert epochs[-1][1] < epochs[0][1]
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["amp"]
    assert state and state["scale"] > 1, state  # an enabled, really scaling GradScaler was saved
    assert autocast_seen(out).get("cuda:torch.float16:True", 0) > 0

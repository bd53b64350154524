"""Migrated example scripts are *run*: single process and under torchrun with 2 CPU ranks (gloo).

For each script in fixtures/scripts/ the test
  1. runs the original once (single process) to get its checkpoint keys,
  2. migrates a copy with `torchmigrate ddp`,
  3. checks the copy compiles and a second migration is a no-op,
  4. runs the copy with `torchrun --standalone --nproc-per-node=2` and asserts: exit 0, every
     per-epoch log line printed once, the checkpoint written by one rank only with exactly the
     single-process keys (no `module.`), ranks trained on disjoint shards, parameters identical
     across ranks at the end, and (where the script supports it) resuming from that checkpoint,
  5. runs the migrated copy as plain `python script.py`.
A test-only probe (tests/e2e_probe/sitecustomize.py) records samplers, saves and parameters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from launcher import Launch, torchrun

torch = pytest.importorskip("torch")

SCRIPTS = FIXTURES / "scripts"
PROBE = Path(__file__).parent / "e2e_probe"
EPOCH_LINE = re.compile(r"epoch (\d+) loss ([0-9.]+|nan|inf)")
RESUMABLE = {"main_function.py", "grad_accum_resume.py", "local_rank_launch.py", "apex_amp.py"}
NOT_MONOTONE = {"gan.py"}  # the discriminator loss is not expected to fall every epoch
CANNOT_RUN_ORIGINAL = {"apex_amp.py"}  # apex.amp no longer exists; only the migrated copy runs
ALL = sorted(p.name for p in SCRIPTS.glob("*.py"))


def _env(out_dir: Path, **extra) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHMIGRATE_AMP"):
        env.pop(key, None)
    env.update(OUT_DIR=str(out_dir), EPOCHS="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")  # CPU ranks, also where a GPU is
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(args, cwd: Path, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    proc.output = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    return proc


def _torchrun(script: Path, cwd: Path, env: dict) -> Launch:
    """Two CPU ranks; a retry after the gloo exit abort starts without the probe's old records."""
    probe = env.get("TM_PROBE_DIR")
    return torchrun("--standalone", "--nproc-per-node=2", script, env=env, cwd=cwd, timeout=180,
                    stale=[Path(probe) / "rank*.json"] if probe else [])


def _epochs(output: str):
    return [(int(m.group(1)), float(m.group(2))) for m in EPOCH_LINE.finditer(output)]


def _keys(path: Path):
    """Top-level keys and the keys of each nested state dict, as a comparable structure."""
    obj = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(obj, dict):
        return type(obj).__name__
    return {str(k): sorted(map(str, v.keys())) if isinstance(v, dict) else type(v).__name__
            for k, v in obj.items()}


def _assert_same_keys(got, expected) -> None:
    """Exactly the single-process keys; the AMP migration may add the scaler's state (TM503)."""
    if not isinstance(expected, dict):
        assert got == expected
        return
    assert set(got) - set(expected) <= {"scaler"}, sorted(set(got) - set(expected))
    assert {k: got[k] for k in expected if k in got} == expected


def _all_keys(structure) -> list:
    if isinstance(structure, dict):
        return [k for key, value in structure.items() for k in [key, *(value if isinstance(value, list) else [])]]
    return []


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """Migrate every script once; the per-script tests share the results."""
    out = {}
    root = tmp_path_factory.mktemp("migrated")
    for name in ALL:
        folder = root / name[:-3]
        folder.mkdir()
        shutil.copy(SCRIPTS / name, folder / name)
        proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", name], cwd=folder,
                              capture_output=True, text=True, timeout=120)
        out[name] = (folder, proc)
    return out


@pytest.mark.parametrize("name", ALL)
def test_migrated_script_trains_under_torchrun(name, migrated, tmp_path):
    folder, proc = migrated[name]
    script = folder / name
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: items need attention
    source = script.read_text()
    compile(source, name, "exec")
    assert "import apex" not in source and "from apex" not in source
    check = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--check", name], cwd=folder,
                           capture_output=True, text=True, timeout=120)
    assert "would be changed" not in check.stdout + check.stderr, "second migration must be a no-op"

    # 1. the original, single process: checkpoint keys to compare with
    expected_keys = None
    if name not in CANNOT_RUN_ORIGINAL:
        orig_out = tmp_path / "orig"
        orig_out.mkdir()
        orig = _run([sys.executable, str(SCRIPTS / name)], tmp_path, _env(orig_out))
        assert orig.returncode == 0, orig.output[-3000:]
        expected_keys = _keys(orig_out / "checkpoint.pt")

    # 4. torchrun, 2 ranks on CPU
    ddp_out, probe = tmp_path / "ddp", tmp_path / "probe"
    ddp_out.mkdir()
    probe.mkdir()
    env = _env(ddp_out, TM_PROBE_DIR=probe, PYTHONPATH=os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]))
    run = _torchrun(script, tmp_path, env)
    assert run.returncode == 0, run.report()
    epochs = _epochs(run.ranks[0])
    numbers = [e for e, _ in epochs]
    assert sorted(set(numbers)) == numbers and len(numbers) == 3, f"each epoch line once:\n{run.output[-3000:]}"
    assert _epochs(run.ranks[1]) == [], f"rank 1 logs no epoch line:\n{run.ranks[1][-3000:]}"
    if name not in NOT_MONOTONE:
        assert epochs[-1][1] < epochs[0][1], f"loss must go down: {epochs}"
    ckpt = ddp_out / "checkpoint.pt"
    assert ckpt.exists()
    keys = _keys(ckpt)
    assert not [k for k in _all_keys(keys) if k.startswith("module.")]
    if expected_keys is not None:
        _assert_same_keys(keys, expected_keys)

    records = [json.loads((probe / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["saves"], "rank 0 writes the checkpoint"
    assert not [s for s in records[1]["saves"] if "checkpoint" in s], "rank 1 must not write checkpoints"
    train = [[s for s in rec["samplers"] if s["shuffle"]] for rec in records]
    assert train[0] and len(train[0]) == len(train[1]), "a distributed training sampler is used"
    for s0, s1 in zip(*train):
        padding = s0["total_size"] - s0["dataset_len"]
        assert len(set(s0["indices"]) & set(s1["indices"])) <= padding, "ranks must get disjoint shards"
        assert set(s0["indices"]) | set(s1["indices"]) == set(range(s0["dataset_len"]))
    by_epoch = {s["epoch"]: tuple(s["indices"]) for s in train[0]}  # a loader may be read twice an epoch
    assert len(by_epoch) >= 2 and len(set(by_epoch.values())) == len(by_epoch), \
        "the shuffle must change every epoch (set_epoch)"
    assert records[0]["params"] and records[0]["params"] == records[1]["params"], "parameters identical across ranks"

    # resume from the checkpoint the distributed run wrote
    if name in RESUMABLE:  # from a copy: a retried run must not resume from its first attempt's save
        start = shutil.copy(ckpt, tmp_path / "resume_from.pt")
        resumed = _torchrun(script, tmp_path, _env(ddp_out, EPOCHS=5, RESUME=start))
        assert resumed.returncode == 0, resumed.report()
        assert [r.count("resumed from epoch") for r in resumed.ranks] == [1, 0], resumed.output[-3000:]
        assert [e for e, _ in _epochs(resumed.output)] == [3, 4]

    # 5. still a plain single-process script
    plain_out = tmp_path / "plain"
    plain_out.mkdir()
    plain = _run([sys.executable, str(script)], tmp_path, _env(plain_out))
    assert plain.returncode == 0, plain.output[-3000:]
    assert [e for e, _ in _epochs(plain.output)] == [0, 1, 2]
    if expected_keys is not None:
        _assert_same_keys(_keys(plain_out / "checkpoint.pt"), expected_keys)

"""Multi-module programs (fixtures/projects/) are migrated as a whole from their entry script and
*run*: under torchrun with 2 CPU ranks (gloo) and as one process.

Each project spreads the training program over several modules the way research repositories do
(a package with relative imports, `from helpers import *`, a Trainer class in its own module, a
data module returning loaders, an evaluation module returning means and counts, a utils module
writing checkpoints, samples and json, one module shared by two entry scripts). `torchmigrate ddp
ENTRY` must find and migrate every module; then the run must show: exit 0, every rank a disjoint
shard reshuffled every epoch, parameters and learning rates equal across ranks, files written by
rank 0 only, no `module.` keys, each epoch line once, and the program still running as
`python ENTRY`. The probe is tests/e2e_probe/sitecustomize.py.
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
from launcher import torchrun

torch = pytest.importorskip("torch")

PROJECTS = FIXTURES / "projects"
PROBE = Path(__file__).parent / "e2e_probe"
EPOCH_LINE = re.compile(r"epoch (\d+) loss ([0-9.]+)")
# project -> (entry scripts run in order, modules the migration must change besides the entries)
CASES = {
    "package_relative": (["train.py"], ["vision/data.py", "vision/engine.py", "vision/utils.py"]),
    "star_helpers": (["train.py"], ["helpers.py"]),
    "trainer_module": (["train.py"], ["trainer.py"]),
    "data_eval_modules": (["train.py"], ["data.py", "evaluate.py"]),
    "utils_writers": (["train.py"], ["utils.py"]),
    "shared_module": (["train.py", "finetune.py"], ["common.py"]),
}


def _env(out_dir: Path, **extra) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHMIGRATE_AMP"):
        env.pop(key, None)
    env.update(OUT_DIR=str(out_dir), EPOCHS="3", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _all_keys(obj) -> list:
    if isinstance(obj, dict):
        return [str(k) for k in obj] + [k for v in obj.values() for k in _all_keys(v)]
    return []


def _migrate(project: str, folder: Path) -> subprocess.CompletedProcess:
    entries = CASES[project][0]
    return subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", *entries], cwd=folder,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("project", sorted(CASES))
def test_project_migrates_and_trains(project, tmp_path):
    entries, modules = CASES[project]
    folder = tmp_path / project
    shutil.copytree(PROJECTS / project, folder)
    proc = _migrate(project, folder)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    report = proc.stdout + proc.stderr
    assert "found through imports" in report, report
    for module in modules:
        assert (folder / module).read_text() != (PROJECTS / project / module).read_text(), f"{module} not migrated"
        compile((folder / module).read_text(), module, "exec")
    again = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--check", *entries], cwd=folder,
                           capture_output=True, text=True, timeout=120)
    assert "would be changed" not in again.stdout + again.stderr, "a second migration must be a no-op"

    out_dir, probe = tmp_path / "ddp", tmp_path / "probe"
    out_dir.mkdir()
    for entry in entries:
        probe_dir = probe / entry
        probe_dir.mkdir(parents=True)
        env = _env(out_dir, TM_PROBE_DIR=probe_dir,
                   PYTHONPATH=os.pathsep.join([str(PROBE), os.environ.get("PYTHONPATH", "")]))
        run = torchrun("--standalone", "--nproc-per-node=2", entry, env=env, cwd=folder, timeout=180,
                       stale=[probe_dir / "rank*.json"])
        assert run.returncode == 0, run.report()
        epochs = [int(m.group(1)) for m in EPOCH_LINE.finditer(run.ranks[0])]
        assert epochs == [0, 1, 2], f"each epoch line once, on rank 0:\n{run.ranks[0][-3000:]}"
        assert not EPOCH_LINE.search(run.ranks[1]), f"rank 1 logs no epoch line:\n{run.ranks[1][-3000:]}"
        r0, r1 = (json.loads((probe_dir / f"rank{r}.json").read_text()) for r in (0, 1))

        train = [[s for s in rec["samplers"] if s["shuffle"]] for rec in (r0, r1)]
        assert train[0] and len(train[0]) == len(train[1]), "a distributed training sampler is used"
        for s0, s1 in zip(*train):
            padding = s0["total_size"] - s0["dataset_len"]
            assert len(set(s0["indices"]) & set(s1["indices"])) <= padding, "ranks must get disjoint shards"
        orders = [tuple(s["indices"]) for s in train[0]]
        assert len(set(orders)) == len(orders), "the shuffle must change every epoch"
        assert r0["params"] and r0["params"] == r1["params"], "parameters identical across ranks"
        assert r0["lrs"] and r0["lrs"] == r1["lrs"], f"learning rates identical across ranks: {r0['lrs']} {r1['lrs']}"
        assert r0["saves"] and not r1["saves"], f"only rank 0 saves: {r1['saves']}"
        assert not r1["writes"], f"only rank 0 writes files: {r1['writes']}"

    for ckpt in out_dir.rglob("*.pt"):
        obj = torch.load(ckpt, map_location="cpu", weights_only=False)
        assert not [k for k in _all_keys(obj) if k.startswith(("module.", "_orig_mod."))], ckpt

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    for entry in entries:
        plain = subprocess.run([sys.executable, entry], cwd=folder, env=_env(plain_dir), capture_output=True,
                               text=True, timeout=180)
        assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
        assert [int(m.group(1)) for m in EPOCH_LINE.finditer(plain.stdout)] == [0, 1, 2]


def test_no_follow_migrates_only_the_entry(tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(PROJECTS / "data_eval_modules", folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--no-follow", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    assert (folder / "data.py").read_text() == (PROJECTS / "data_eval_modules" / "data.py").read_text()
    assert (folder / "train.py").read_text() != (PROJECTS / "data_eval_modules" / "train.py").read_text()

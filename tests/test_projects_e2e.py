"""Multi-module programs (fixtures/projects/) are migrated as a whole from their entry script and
*run*: through `torchmigrate verify` (torchrun, 2 CPU ranks, gloo) and as one process.

Each project spreads the training program over several modules the way research repositories do
(a package with relative imports, `from helpers import *`, a Trainer class in its own module, a
data module returning loaders, an evaluation module returning means and counts, a utils module
writing checkpoints, samples and json, one module shared by two entry scripts). `torchmigrate ddp
ENTRY` must find and migrate every module; then every verify check must pass (clean exits,
disjoint shards reshuffled every epoch, parameters and learning rates equal across ranks, files
written by rank 0 only, no `module.` keys, no line printed by both ranks), each epoch line is
printed once, by rank 0, and the program still runs as `python ENTRY`.
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

torch = pytest.importorskip("torch")

PROJECTS = FIXTURES / "projects"
EPOCH_LINE = re.compile(r"epoch (\d+) loss ([0-9.]+)")
# project -> (entry scripts run in order, modules the migration must change besides the entries)
CASES = {
    "package_relative": (["train.py"], ["vision/data.py", "vision/engine.py", "vision/utils.py"]),
    "star_helpers": (["train.py"], ["helpers.py"]),
    "trainer_module": (["train.py"], ["trainer.py"]),
    # evaluate.py stays as it is: its validation loader reaches it from another module, so it is
    # kept whole and nothing there needs a reduction
    "data_eval_modules": (["train.py"], ["data.py"]),
    "utils_writers": (["train.py"], ["utils.py"]),
    "shared_module": (["train.py", "finetune.py"], ["common.py"]),
    # written for nn.DataParallel: a loss object with its own .cuda(), the project's optimizer
    # object, checkpoints that pickle the model and the optimizer, DataParallel checks in utils
    "dataparallel_objects": (["train.py"], ["losses.py", "utils.py"]),
    # loaded by names in config/train.json through importlib, never imported by name
    "config_driven": (["train.py"], ["trainer/trainer.py", "trainer/base_trainer.py"]),
    # a model that builds its own optimizer over self.parameters(): wrapped where it is made
    "model_owns_optimizer": (["train.py"], ["model.py"]),
    # the networks kept in a dict, one optimizer over all of them: each wrapped in place
    "models_in_dict": (["train.py"], []),
    # the loader built in data.py, the noise and labels drawn in trainer.py from the configured
    # batch size: they follow the loader's divided batch (`tm.batch_rows`)
    "gan_loader_elsewhere": (["train.py"], ["data.py", "trainer.py"]),
}
# project -> (file under OUT_DIR, its lines after a 3-epoch run under torchrun): written once
LINES_WRITTEN = {"config_driven": ("results.csv", ["epoch,loss", "0,", "1,", "2,"])}


RESUMABLE = {"package_relative", "dataparallel_objects"}  # reads RESUME (a checkpoint) and continues after its epoch


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


@pytest.mark.parametrize("project", sorted(CASES))
def test_project_migrates_and_trains(project, tmp_path):
    entries, modules = CASES[project]
    folder = tmp_path / project
    shutil.copytree(PROJECTS / project, folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", *entries], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), report
    assert "found through imports" in report, report
    for module in modules:
        assert (folder / module).read_text() != (PROJECTS / project / module).read_text(), f"{module} not migrated"
        compile((folder / module).read_text(), module, "exec")
    again = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--check", *entries], cwd=folder,
                           capture_output=True, text=True, timeout=120)
    assert "would be changed" not in again.stdout + again.stderr, "a second migration must be a no-op"

    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    for entry in entries:
        resume = []
        if project in RESUMABLE:  # a second run resumes from the checkpoint the first one wrote
            (tmp_path / "resumed").mkdir()
            resume = ["--resume-env", f"RESUME={out_dir / 'checkpoint.pt'}", "--resume-env", "EPOCHS=5",
                      "--resume-env", f"OUT_DIR={tmp_path / 'resumed'}"]
        run = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--format", "json", "--steps", "0",
                              "--epochs", "0", "--timeout", "240", *resume, entry], cwd=folder, env=_env(out_dir),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode in (0, 1) and run.stdout.startswith("{"), run.stdout[-2000:] + run.stderr[-3000:]
        verdict = json.loads(run.stdout)
        failed = [c for c in verdict["checks"] if c["status"] != "pass"]
        assert not failed, json.dumps(failed, indent=1)
        ranks = [r["output"] for r in verdict["ranks"]]
        assert [int(m.group(1)) for m in EPOCH_LINE.finditer(ranks[0])] == [0, 1, 2], ranks[0][-3000:]
        assert not EPOCH_LINE.search(ranks[1]), f"rank 1 logs no epoch line:\n{ranks[1][-3000:]}"
        if project == "gan_loader_elsewhere":  # fake rows match this rank's real rows: 16 / 2
            assert "rows 8 8" in ranks[0], ranks[0][-3000:]
        if project == "data_eval_modules":  # the per-class counts cover the whole validation set
            counts = [json.loads(c) for c in re.findall(r"per-class (\[[0-9, ]+\])", ranks[0])]
            assert len(counts) == 3 and all(sum(c) == 72 for c in counts), counts
        if resume:
            resumed = [r["output"] for r in verdict["resume_ranks"]]
            assert [r.count("resumed from epoch 2") for r in resumed] == [1, 0], resumed[0][-3000:]
            assert [int(m.group(1)) for m in EPOCH_LINE.finditer(resumed[0])] == [3, 4]

    if project in LINES_WRITTEN:
        name, starts = LINES_WRITTEN[project]
        lines = (out_dir / name).read_text().splitlines()
        assert len(lines) == len(starts) and all(l.startswith(s) for l, s in zip(lines, starts)), lines

    sys.path.insert(0, str(folder))  # checkpoints that pickle the program's own classes
    try:
        for ckpt in out_dir.rglob("*.pt"):
            obj = torch.load(ckpt, map_location="cpu", weights_only=False)
            assert not [k for k in _all_keys(obj) if k.startswith(("module.", "_orig_mod."))], ckpt
            for value in obj.values() if isinstance(obj, dict) else [obj]:
                assert not isinstance(value, torch.nn.parallel.DistributedDataParallel), "a wrapper pickled"
    finally:
        sys.path.remove(str(folder))

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    for entry in entries:
        plain = subprocess.run([sys.executable, entry], cwd=folder, env=_env(plain_dir), capture_output=True,
                               text=True, timeout=180)
        assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
        assert [int(m.group(1)) for m in EPOCH_LINE.finditer(plain.stdout)] == [0, 1, 2]
        if project == "gan_loader_elsewhere":  # one process: the whole batch, as the original
            assert "rows 16 16" in plain.stdout, plain.stdout


def test_no_follow_migrates_only_the_entry(tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(PROJECTS / "data_eval_modules", folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--no-follow", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr
    assert (folder / "data.py").read_text() == (PROJECTS / "data_eval_modules" / "data.py").read_text()
    assert (folder / "train.py").read_text() != (PROJECTS / "data_eval_modules" / "train.py").read_text()


def _outputs(run_dir: Path) -> dict:
    """What the writers_everywhere program leaves behind, read as one process would."""
    return {
        "history": (run_dir / "history.txt").read_text().splitlines(),
        "runs": (run_dir / "runs.csv").read_text().splitlines(),
        "log": (run_dir / "train.log").read_text().splitlines(),
        "params": json.loads((run_dir / "params.json").read_text()),
        "eval": json.loads((run_dir / "eval.json").read_text()),
        "cache": sorted(p.name for p in (run_dir / "cache").iterdir()),
        "previews": sorted(p.name for p in run_dir.glob("preview_*.pt")),
    }


def test_every_file_is_written_once(tmp_path):
    """A program whose files are written through helpers, a logger class, a log handler added in
    a utils module, a history handle kept open, a first-run cache folder and an evaluation json
    read back by every rank (fixtures/projects/writers_everywhere): after `torchmigrate ddp`,
    under torchrun on 2 CPU ranks, rank 1 writes nothing, every file holds each line once, every
    rank still reads what it needs; the report claims "rank 0 only" because it is true; and as
    one process the program writes the same files."""
    folder = tmp_path / "writers_everywhere"
    shutil.copytree(PROJECTS / "writers_everywhere", folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), report
    assert "done: writes, saves and logs on rank 0 only" in report and "written by every rank" not in report, report
    for module in ("train.py", "io_utils.py", "recorder.py"):
        assert (folder / module).read_text() != (PROJECTS / "writers_everywhere" / module).read_text(), module

    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    run = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--format", "json", "--steps", "0",
                          "--epochs", "0", "--timeout", "240", "train.py"], cwd=folder, env=_env(out_dir),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode in (0, 1) and run.stdout.startswith("{"), run.stdout[-2000:] + run.stderr[-3000:]
    verdict = json.loads(run.stdout)
    failed = [c for c in verdict["checks"] if c["status"] != "pass"]
    assert not failed, json.dumps(failed, indent=1)
    assert any("only rank 0 writes files" in json.dumps(c) for c in verdict["checks"]), verdict["checks"]
    ranks = [r["output"] for r in verdict["ranks"]]
    assert [r.count("final loss") for r in ranks] == [1, 0], ranks  # rank 1 read eval.json too (no crash)

    got = _outputs(out_dir / "run")
    assert [line.split()[0] for line in got["history"]] == ["0", "1", "2"]
    assert got["runs"][0] == "epoch,loss" and [r.split(",")[0] for r in got["runs"][1:]] == ["0", "1", "2"]
    assert got["log"] == [f"finished epoch {e}" for e in range(3)]
    assert got["params"] == {"lr": 0.05, "batch_size": 10}
    assert set(got["eval"]) == {"loss"}
    assert got["cache"] == [f"part_{i}.npy" for i in range(4)]
    assert got["previews"] == [f"preview_{e}.pt" for e in range(3)]

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    plain = subprocess.run([sys.executable, "train.py"], cwd=folder, env=_env(plain_dir), capture_output=True,
                           text=True, timeout=180)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
    alone = _outputs(plain_dir / "run")
    assert {k: len(v) for k, v in alone.items()} == {k: len(v) for k, v in got.items()}

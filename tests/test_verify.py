"""`torchmigrate verify` on deliberately broken programs (fixtures/verify/): each must fail the one
check its defect breaks, with a message a user can act on and the right `file:line`.

Every launch here is a real torchrun with 2 CPU ranks, so there is one launch per case; the checks'
finer logic is tested on hand-made records below, without launching anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from torchmigrate.cli import verify_checks as checks
from torchmigrate.cli.verify_checks import Run

BROKEN = FIXTURES / "verify"


def verify(*args, cwd: Path, env: dict | None = None, timeout: int = 240):
    """`torchmigrate verify --format json ARGS` in `cwd`: (exit code, report or None, stderr)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OUT_DIR": str(cwd), "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--format", "json", *map(str, args)],
                          cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else None
    return proc.returncode, report, proc.stderr


def by_name(report) -> dict:
    return {c["name"]: c for c in report["checks"]}


def failed(report) -> set:
    return {c["name"] for c in report["checks"] if c["status"] == "fail"}


CASES = {
    # script: (the failing check, text its message or evidence must hold, the file:line named)
    "unsharded_loader.py": ("sharded", "every rank iterates the whole dataset", "unsharded_loader.py:11"),
    "plateau_per_rank.py": ("lr", "ReduceLROnPlateau.step(metric) at plateau_per_rank.py:20 got a different metric",
                            "plateau_per_rank.py:20"),
    "every_rank_saves.py": ("writers", "rank 1 wrote checkpoint.pt (torch.save at every_rank_saves.py:18)",
                            "every_rank_saves.py:18"),
    "module_prefix.py": ("prefixes", "keys such as module.0.weight", "module_prefix.py:20"),
    "crash_rank1.py": ("exit", "rank 1 crashed at crash_rank1.py:16: RuntimeError: shard 1 has a corrupt sample",
                       "crash_rank1.py:16"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_broken_program_fails_the_right_check(name, tmp_path):
    pytest.importorskip("torch")
    check, text, where = CASES[name]
    code, report, err = verify("--steps", 3, "--epochs", 3, BROKEN / name, cwd=tmp_path)
    assert code == 1 and report, err
    assert check in failed(report), json.dumps(report["checks"], indent=1)
    found = by_name(report)[check]
    assert text in found["message"] + "\n".join(found["evidence"]), found
    assert where in found["where"], found
    if name == "crash_rank1.py":
        assert found["message"].startswith("rank 1 crashed"), found
    else:  # the defect breaks nothing else
        assert failed(report) == {check}, json.dumps(report["checks"], indent=1)


def test_a_program_that_never_stops_is_stopped_after_the_epochs(tmp_path):
    pytest.importorskip("torch")
    code, report, err = verify("--steps", 2, "--epochs", 2, BROKEN / "never_stops.py", cwd=tmp_path)
    assert code == 0 and report, err
    assert report["stopped_by_verify"] and [r["status"] for r in report["ranks"]] == ["stopped", "stopped"]
    assert by_name(report)["exit"]["message"] == "every rank was stopped by verify after the requested epochs"


def test_a_program_that_never_stops_is_stopped_at_the_timeout(tmp_path):
    pytest.importorskip("torch")
    code, report, err = verify("--steps", 2, "--epochs", 0, "--timeout", 45, BROKEN / "never_stops.py", cwd=tmp_path)
    assert code == 1 and report, err
    assert report["timed_out"] and failed(report) == {"exit"}, json.dumps(report["checks"], indent=1)
    exit_check = by_name(report)["exit"]
    assert exit_check["message"].startswith("the program did not stop within 45s"), exit_check
    assert [r["status"] for r in report["ranks"]] == ["terminated", "terminated"], report["ranks"]


def test_an_unmigrated_script_is_told_what_breaks_under_torchrun(tmp_path):
    """The original single-GPU script: no process group, every rank reads everything, writes the
    checkpoint and prints every line."""
    pytest.importorskip("torch")
    script = FIXTURES / "scripts" / "toplevel_classifier.py"
    code, report, err = verify("--steps", 2, "--epochs", 0, script, cwd=tmp_path, env={"EPOCHS": "2"})
    assert code == 1 and report, err
    assert failed(report) == {"sharded", "params", "writers", "logs"}, json.dumps(report["checks"], indent=1)
    checks_ = by_name(report)
    assert "every rank iterates the whole dataset" in checks_["sharded"]["evidence"][0]
    assert checks_["params"]["message"].startswith("no process group")
    assert any("rank 1 wrote checkpoint.pt" in e for e in checks_["writers"]["evidence"])
    assert any("epoch 0 loss" in e for e in checks_["logs"]["evidence"])


def test_usage_errors_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", str(tmp_path / "missing.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    (tmp_path / "t.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--resume-env", "NOVALUE", str(tmp_path / "t.py")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "expected NAME=VALUE" in proc.stderr


def test_help_says_it_runs_the_code():
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "RUNS YOUR CODE" in proc.stdout


# --- the checks on hand-made records (no launch) ---------------------------------------------

def _record(indices_per_epoch, *, sampler="DistributedSampler", shuffle=True, n=8):
    return {"status": "finished", "exit_code": 0, "error": None, "steps": 2, "process_group": True,
            "loaders": {"train.py:10": {"site": "train.py:10", "sampler": sampler, "shuffle": shuffle,
                                        "dataset_len": n, "drop_last": False,
                                        "iterations": [{"indices": i, "steps": 2, "batches": 2, "epoch": e}
                                                       for e, i in enumerate(indices_per_epoch)]}},
            "optimizers": [], "ddp": [], "writes": [], "saves": [], "loads": [], "plateau": []}


def test_padding_of_a_distributed_sampler_is_not_an_overlap():
    run = Run([_record([[0, 2, 4, 6]], n=7), _record([[1, 3, 5, 0]], n=7)], ["", ""])  # 0 twice: padding
    assert checks.sharded(run).status == "pass"


def test_a_missing_set_epoch_is_named():
    run = Run([_record([[0, 2, 4, 6], [0, 2, 4, 6]]), _record([[1, 3, 5, 7], [1, 3, 5, 7]])], ["", ""])
    check = checks.reshuffled(run)
    assert check.status == "fail" and "set_epoch is not called" in check.evidence[0] and check.where == ["train.py:10"]


def test_ranks_that_together_miss_samples_are_named():
    run = Run([_record([[0, 2]]), _record([[1, 3]])], ["", ""])
    check = checks.sharded(run)
    assert check.status == "fail" and "drew 4 of 8 samples" in check.evidence[0]


def test_warnings_and_tracebacks_are_not_duplicate_log_lines():
    out = "UserWarning: something\n  warnings.warn(x)\nTraceback (most recent call last):\n"
    assert checks.logs_once(Run([None, None], [out + "rank 0 only\n", out])).status == "pass"
    assert checks.logs_once(Run([None, None], ["epoch 0 loss 1\n", "epoch 0 loss 1\n"])).status == "fail"



def test_ranks_that_cannot_be_stopped_at_the_timeout_are_named_as_a_hang():
    """Ranks blocked inside a collective (C++ code) never run the probe's signal handler, so no
    rank leaves a record: the report says they hang (seen when one rank skipped a backward
    pass), not that no loader ended the run."""
    check = checks.exits(Run([None, None], ["", ""], timed_out=True, timeout=40))
    assert check.status == "fail" and "the ranks hang" in check.message, check
    stopped = checks.exits(Run([_record([[0, 2]]) | {"status": "terminated"}, None], ["", ""], timed_out=True,
                               timeout=40))
    assert "the ranks hang" not in stopped.message, stopped

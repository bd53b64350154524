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
from torchmigrate.cli import verify as verify_cli
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
    """After the full epochs, the shortened ones run on to the last epoch verify allows; the
    report then says plainly that the program's end (its final save) was not reached."""
    pytest.importorskip("torch")
    code, report, err = verify("--steps", 2, "--epochs", 2, BROKEN / "never_stops.py", cwd=tmp_path)
    assert code == 0 and report, err
    assert report["stopped_by_verify"] and [r["status"] for r in report["ranks"]] == ["stopped", "stopped"]
    assert by_name(report)["exit"]["message"] == "every rank was stopped by verify after the requested epochs"
    assert "final save was NOT reached" in by_name(report)["prefixes"]["message"]
    assert "stopped by verify at epoch 20" in err  # the progress line of that phase
    text = verify_cli.render(report)
    assert "the end of the program (a final save, a final evaluation) was NOT reached and NOT checked" in text


def test_the_final_save_is_reached_and_looked_into_without_numpy(tmp_path):
    """Defaults only, on the README's install (no numpy): the epochs after the first two are
    shortened so the save after the training loop runs; `module.` keys inside the saved list
    are found; one progress line per phase goes to stderr while the ranks run."""
    pytest.importorskip("torch")
    blocker = tmp_path / "no_numpy" / "numpy"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text('raise ModuleNotFoundError("No module named numpy", name="numpy")\n')
    code, report, err = verify(BROKEN / "prefix_in_final_list.py", cwd=tmp_path,
                               env={"PYTHONPATH": str(blocker.parent)})
    assert code == 1 and report, err
    assert failed(report) == {"prefixes"}, json.dumps(report["checks"], indent=1)
    assert "keys such as module.0.weight" in "\n".join(by_name(report)["prefixes"]["evidence"])
    assert by_name(report)["prefixes"]["where"] == ["prefix_in_final_list.py:24"]
    assert not report["stopped_by_verify"] and report["short_epochs"] == 3, report
    assert by_name(report)["params"]["status"] == "pass"  # hashed with torch alone
    progress = [line for line in err.splitlines() if line.startswith("verify [")]
    assert any("running the script" in line for line in progress), err
    assert any("running on to the program's end" in line for line in progress), err
    assert "the ranks ended; checking (rank 0: epoch 5, " in progress[-1], err


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


def test_the_runtimes_same_inputs_warning_fails_the_sharding_check():
    """Hand-made batches (no DataLoader verify can read) that every rank takes alike: the
    runtime's check of the model's inputs says so, and verify must not pass the program."""
    warning = ("torchmigrate.runtime: Net got the same inputs on every rank at two training steps (step 2): "
               "if they come from the training data, every rank trains on the same samples\n")
    no_loader = _record([]) | {"loaders": {}}
    check = checks.sharded(Run([no_loader, no_loader], [warning, ""]))
    assert check.status == "fail" and "same inputs on every rank" in check.evidence[0]
    assert checks.sharded(Run([no_loader, no_loader], ["", ""])).status == "skip"


def test_a_sampler_with_a_budget_is_judged_by_its_budget():
    """An iteration-budget sampler (`InfiniteSampler(len(ds), iterations * batch)` cut by rank)
    draws fewer samples than the dataset holds by design: disjoint shares that together make
    the budget pass; shares that miss part of the budget still fail."""
    budget = [_record([[0, 2]]), _record([[1, 3]])]
    for rec in budget:
        rec["loaders"]["train.py:10"]["sampler_len"] = 2
    assert checks.sharded(Run(budget, ["", ""])).status == "pass"
    for rec in budget:
        rec["loaders"]["train.py:10"]["sampler_len"] = 3
    assert checks.sharded(Run(budget, ["", ""])).status == "fail"


def test_a_sampler_drawing_more_than_the_dataset_may_repeat_samples():
    """Repeated augmentation (DeiT's RASampler with `len_factor=3`): each rank's share of an epoch
    is longer than its part of the dataset, so samples repeat across ranks by design."""
    rec = [_record([[0, 1, 2, 3, 4, 5, 0, 1]], n=8), _record([[6, 7, 0, 1, 2, 3, 6, 7]], n=8)]
    for r in rec:
        r["loaders"]["train.py:10"]["sampler_len"] = 8
    assert checks.sharded(Run(rec, ["", ""])).status == "pass"
    whole = [_record([list(range(8))], n=8), _record([list(range(8))], n=8)]  # every rank reads it all
    for r in whole:
        r["loaders"]["train.py:10"]["sampler_len"] = 8
    assert checks.sharded(Run(whole, ["", ""])).status == "fail"


def test_ranks_that_together_miss_samples_are_named():
    run = Run([_record([[0, 2]]), _record([[1, 3]])], ["", ""])
    check = checks.sharded(run)
    assert check.status == "fail" and "drew 4 of 8 samples" in check.evidence[0]


def test_warnings_and_tracebacks_are_not_duplicate_log_lines():
    out = "UserWarning: something\n  warnings.warn(x)\nTraceback (most recent call last):\n"
    assert checks.logs_once(Run([None, None], [out + "rank 0 only\n", out])).status == "pass"
    assert checks.logs_once(Run([None, None], ["epoch 0 loss 1\n", "epoch 0 loss 1\n"])).status == "fail"


def test_a_warning_message_over_several_lines_is_one_warning():
    """torch's "Converting a tensor with requires_grad=True to a scalar" runs over two lines
    before the indented source line; every rank prints it, as the original did."""
    out = ("/w/main.py:200: UserWarning: Converting a tensor with requires_grad=True to a scalar may lead to "
           "unexpected behavior.\nConsider using tensor.detach() first. (Triggered internally at x.cpp:820.)\n"
           "  total += float(loss)\n")
    assert checks.logs_once(Run([None, None], [out + "epoch 0\n", out])).status == "pass"
    assert checks.logs_once(Run([None, None], [out + "epoch 0\n", out + "epoch 0\n"])).status == "fail"



def test_ranks_that_cannot_be_stopped_at_the_timeout_are_named_as_a_hang():
    """Ranks blocked inside a collective (C++ code) never run the probe's signal handler, so no
    rank leaves a record: the report says they hang (seen when one rank skipped a backward
    pass), not that no loader ended the run."""
    check = checks.exits(Run([None, None], ["", ""], timed_out=True, timeout=40))
    assert check.status == "fail" and "the ranks hang" in check.message, check
    stopped = checks.exits(Run([_record([[0, 2]]) | {"status": "terminated"}, None], ["", ""], timed_out=True,
                               timeout=40))
    assert "the ranks hang" not in stopped.message, stopped


def test_a_failure_of_the_probe_is_the_tools_not_the_scripts():
    """A rank whose probe failed, or that left no record and whose traceback ends in the probe,
    is reported as torchmigrate's failure (its own check, first), never as the script's."""
    failed_rank = _record([[0, 2]]) | {"status": "probe_failed", "exit_code": 1,
                                        "error": {"where": None, "message": "TypeError: boom", "traceback": []},
                                        "probe_errors": ["hashing the parameters: TypeError: boom"]}
    run = Run([failed_rank, _record([[1, 3]])], ["", ""])
    exit_check = checks.exits(run)
    assert exit_check.status == "fail" and "verify's probe failed on rank 0 (a torchmigrate bug, not your script)" \
        == exit_check.message, exit_check
    probe = checks.probe(run)
    assert probe.status == "fail" and "not your script" in probe.message and "TypeError: boom" in probe.evidence[0]
    trace = ('Traceback (most recent call last):\n  File "/x/train.py", line 3, in <module>\n'
             '  File "/site/torchmigrate/cli/verify_probe.py", line 9, in _dump\nRuntimeError: Numpy is not available\n')
    silent = Run([None, _record([[1, 3]])], [trace, ""])
    assert "verify's probe failed before it could write one" in checks.exits(silent).evidence[0]
    assert checks.probe(silent) is not None
    killed = Run([None, _record([[1, 3]])], ["epoch 0\n", ""])
    assert "killed from outside" in checks.exits(killed).evidence[0] and checks.probe(killed) is None
    assert checks.probe(Run([_record([[0, 2]]), _record([[1, 3]])], ["", ""])) is None


def test_probe_looks_into_any_container_and_hashes_without_numpy(monkeypatch):
    torch = pytest.importorskip("torch")
    from torchmigrate.cli import verify_probe as probe

    sd = {"module.w": torch.zeros(2), "b": torch.ones(1)}
    for shape in ([sd], (sd, 1), {"a": {"b": [(sd,)]}}, ({"x": 1}, [[sd]])):
        assert probe._prefixed(shape) == ["module.w"], shape
    assert probe._prefixed([{"w": torch.zeros(1)}]) == []

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    params = [torch.arange(6.0).reshape(2, 3).t(), torch.zeros(0), torch.ones(2, dtype=torch.bfloat16)]
    assert probe._digest(params) == probe._digest([p.clone() for p in params])
    assert probe._digest(params) != probe._digest([params[0] + 1, *params[1:]])


def test_the_report_says_when_the_end_was_not_reached():
    report = {"script": "t.py", "nproc": 2, "device": "cpu", "steps": 10, "epochs": 2, "last_epoch": 20,
              "stopped_by_verify": True, "short_epochs": 18, "timed_out": False, "tool_failed": False,
              "checks": [checks.Check("exit", "every rank exits cleanly", "pass", "ok").to_json()]}
    text = verify_cli.render(report)
    assert "stopped by verify at epoch 20" in text and "was NOT reached and NOT checked" in text
    assert "All checks passed." not in text
    done = verify_cli.render(report | {"stopped_by_verify": False, "short_epochs": 3})
    assert done.endswith("All checks passed.") and "the 3 epoch(s) after the first 2 ran one optimizer step" in done
    broken = verify_cli.render(report | {"stopped_by_verify": False, "tool_failed": True})
    assert "torchmigrate verify itself failed (its probe, not your script)" in broken


def test_a_missing_file_the_script_opens_is_the_scripts_error_not_the_probes():
    """The probe wraps `open` to note writes; a FileNotFoundError from the real `open` (a file
    another rank has not written yet) is raised in that wrapper's last line, and is the script's."""
    import builtins
    import io
    import os

    import torch

    from torchmigrate.cli import verify_probe

    saved = (builtins.open, io.open, os.replace, os.rename, torch.save, torch.serialization.save, torch.load,
             torch.serialization.load)
    try:
        verify_probe._patch_files()
        try:
            open("/nonexistent/torchmigrate/vocab.json")
        except FileNotFoundError as exc:
            assert not verify_probe._raised_here(exc)
        else:
            raise AssertionError("expected FileNotFoundError")
    finally:
        (builtins.open, io.open, os.replace, os.rename, torch.save, torch.serialization.save, torch.load,
         torch.serialization.load) = saved


def test_equal_parameters_of_a_model_no_rank_shares_are_no_pass():
    """No DDP, no gradient averaging: both ranks trained the same copy on the same data, so
    their parameters agree, but nothing is distributed (the migration report's NOT DONE)."""
    def rec(in_ddp, synced=False):
        opt = {"name": "Adam", "where": "m.py:14", "hash": "same", "lrs": [0.001], "in_ddp": in_ddp}
        return _record([[0, 2]]) | {"optimizers": [opt], "synced": synced}

    lonely = checks.params_in_sync(Run([rec(False), rec(False)], ["", ""]))
    assert lonely.status == "fail" and "no model is wrapped in DDP" in lonely.message
    assert checks.params_in_sync(Run([rec(True), rec(True)], ["", ""])).status == "pass"
    assert checks.params_in_sync(Run([rec(False, True), rec(False, True)], ["", ""])).status == "pass"  # tm.sync_grads


def test_a_script_reading_its_loader_with_next_is_stopped_not_crashed(tmp_path):
    """`for _ in range(len(loader)): next(it)`: the epochs verify shortens end before the script's
    count; the StopIteration that follows is verify's doing, so the ranks count as stopped by
    verify and every other check still runs."""
    pytest.importorskip("torch")
    code, report, err = verify("--steps", 2, "--epochs", 1, BROKEN / "next_fixed_count.py", cwd=tmp_path)
    assert code == 0 and report, err
    assert [r["status"] for r in report["ranks"]] == ["stopped", "stopped"], report["ranks"]
    assert by_name(report)["exit"]["status"] == "pass", by_name(report)["exit"]
    assert by_name(report)["params"]["status"] == "pass"


def test_a_libraries_private_temporary_file_is_no_second_writer(tmp_path, monkeypatch):
    """torch_geometric writes a generated module per process into the system's temporary folder:
    not a file of the program. A file of the program's own folder (even one under /tmp), or a
    temporary path two ranks both write, still counts."""
    import tempfile

    own = tempfile.mkdtemp(dir=tempfile.gettempdir(), prefix="pyg_")
    write = lambda path: {"path": path, "how": "open", "where": "models/layer.py:14"}  # noqa: E731
    rank1 = _record([[1]]) | {"writes": [write(os.path.join(own, "MessagePassing_ab12.py"))]}
    monkeypatch.chdir(str(tmp_path))  # the program's folder
    assert checks.one_writer(Run([_record([[0]]), rank1], ["", ""])).status == "pass"
    shared = _record([[1]]) | {"writes": [write(os.path.join(own, "same.lock"))]}
    assert checks.one_writer(Run([_record([[0]]) | {"writes": [write(os.path.join(own, "same.lock"))]}, shared],
                                 ["", ""])).status == "fail"
    program = _record([[1]]) | {"writes": [write(str(tmp_path / "log.txt"))]}
    assert checks.one_writer(Run([_record([[0]]), program], ["", ""])).status == "fail"


def test_a_sampler_drawing_with_replacement_is_not_judged_for_overlap():
    """`tm.shard_sampler(WeightedRandomSampler(w, n))`: the drawn sequence repeats samples, so
    ranks share some by design; the check says it cannot judge instead of failing."""
    rank0, rank1 = _record([[0, 3, 3, 5]]), _record([[3, 1, 5, 5]])
    for rec in (rank0, rank1):
        rec["loaders"]["train.py:10"]["replacement"] = True
    assert checks.sharded(Run([rank0, rank1], ["", ""])).status == "skip"
    assert checks.sharded(Run([_record([[0, 3, 3, 5]]), _record([[3, 1, 5, 5]])], ["", ""])).status == "fail"


def test_verify_counts_no_bytecode_cache_or_installed_package_as_a_write(tmp_path, monkeypatch):
    """A library that imports its submodules lazily writes their `.pyc` files into site-packages on
    first use, from whichever rank gets there: no file of the program, so no "other ranks wrote"
    failure; a file of the program still counts."""
    import torchmigrate.cli.verify_probe as probe

    monkeypatch.setattr(probe, "record", {**probe.record, "writes": {}})
    for path in ("/usr/lib/python3/site-packages/librosa/core/__pycache__",
                 str(tmp_path / "lib" / "__pycache__" / "util.cpython-311.pyc"),
                 "/opt/venv/lib/python3.11/dist-packages/numba/cache.nbi", str(tmp_path / "metrics.csv")):
        probe._note_write(path, "open")
    assert list(probe.record["writes"]) == [str(tmp_path / "metrics.csv")]


def test_ranks_stopped_at_the_timeout_a_step_apart_are_not_compared():
    """A run stopped from outside: one rank a step ahead holds other parameters, rightly."""
    opt = {"where": "train.py:12", "name": "SGD", "in_ddp": True, "lrs": [0.1]}
    ranks = [_record([[0, 2]]) | {"steps": 7, "optimizers": [opt | {"hash": "a"}]},
             _record([[1, 3]]) | {"steps": 6, "optimizers": [opt | {"hash": "b"}]}]
    check = checks.params_in_sync(Run(ranks, ["", ""], timed_out=True, timeout=45))
    assert check.status == "skip" and "different numbers of optimizer steps (7, 6)" in check.message
    ranks[1]["steps"] = 7
    assert checks.params_in_sync(Run(ranks, ["", ""], timed_out=True, timeout=45)).status == "fail"


def test_an_endless_loader_is_read_as_drawn_not_listed_first(tmp_path):
    """An "infinite" DataLoader (a batch sampler that repeats forever): verify used to list the
    sampler before the first batch and hung until the timeout. Its first pass is now recorded
    as drawn: sharded, it passes; the same loader left whole fails the sharding check."""
    pytest.importorskip("torch")
    code, report, err = verify("--steps", 2, "--epochs", 1, BROKEN / "endless_loader.py", cwd=tmp_path)
    assert code == 0 and report and not report["timed_out"], err
    assert by_name(report)["sharded"]["status"] == "pass", by_name(report)["sharded"]
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "common.py").write_text((BROKEN / "common.py").read_text())
    text = (BROKEN / "endless_loader.py").read_text()
    (whole / "endless_whole.py").write_text(text.replace("sampler=tm.sampler(train_ds, shuffle=True)", "shuffle=True"))
    code, report, err = verify("--steps", 2, "--epochs", 1, whole / "endless_whole.py", cwd=whole)
    assert code == 1 and report and not report["timed_out"], err
    assert failed(report) == {"sharded"}, json.dumps(report["checks"], indent=1)

"""Evaluation that cannot disagree, run: a multi-module program (fixtures/projects/
eval_best_checkpoint: data.py builds the loaders, engine.py's evaluate() validates, train.py keeps
the best checkpoint by validation accuracy and steps ReduceLROnPlateau on the validation loss) is
migrated and trained under torchrun on 2 CPU ranks.

The validation loader reaches another module, so nothing proves that what evaluate() computes
from it is reduced (its predicted-class histogram is not): it is kept whole, and every rank must
compute the same validation numbers, equal to a one-process evaluation of the same weights; the
learning rates and parameters stay equal across ranks. The final test loop in train.py only sums
counts, so its loader is sharded (one batch more on rank 0) and the reduced accuracy equals the
one-process accuracy of the same weights.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURES
from launcher import torchrun

torch = pytest.importorskip("torch")

PROJECT = FIXTURES / "projects" / "eval_best_checkpoint"
EPOCHS = 4

# Runs train.py as `__main__` with engine.evaluate and ReduceLROnPlateau.step recorded, and writes
# this rank's records to OUT_DIR/rank<R>.json (the program itself is left exactly as migrated).
DRIVER = textwrap.dedent('''
    import json, os, runpy, sys
    import torch
    sys.path.insert(0, os.getcwd())
    import engine

    records = {"evaluate": [], "lr": []}
    original = engine.evaluate

    def evaluate(model, *args, **kwargs):
        loss, acc, predicted = original(model, *args, **kwargs)
        params = [float(p.detach().double().sum()) for p in model.parameters()]
        records["evaluate"].append({"loss": loss, "acc": acc, "predicted": predicted.tolist(), "params": params})
        return loss, acc, predicted

    engine.evaluate = evaluate
    step = torch.optim.lr_scheduler.ReduceLROnPlateau.step

    def recorded_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        records["lr"].append([g["lr"] for g in self.optimizer.param_groups])
        return out

    torch.optim.lr_scheduler.ReduceLROnPlateau.step = recorded_step
    try:
        runpy.run_path("train.py", run_name="__main__")
    finally:
        with open(os.path.join(os.environ["OUT_DIR"], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(records, f)
''')

# One process, the original (unmigrated) modules: the numbers of `last.pt` on the whole sets.
REFERENCE = textwrap.dedent('''
    import json, sys
    import torch
    import torch.nn as nn
    from data import get_loaders, get_test_set
    from engine import evaluate

    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4))
    model.load_state_dict(torch.load(sys.argv[1], map_location="cpu"))
    loss, acc, predicted = evaluate(model, get_loaders(16)[1], nn.CrossEntropyLoss(), "cpu")
    test = get_test_set()
    with torch.no_grad():
        test_acc = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
    print(json.dumps({"loss": loss, "acc": acc, "predicted": predicted.tolist(), "test_acc": test_acc}))
''')


def _env(out_dir, **extra):
    from test_projects_e2e import _env as project_env

    return project_env(out_dir, EPOCHS=str(EPOCHS), **extra)


def test_eval_kept_whole_agrees_across_ranks_and_with_one_process(tmp_path):
    original = tmp_path / "original"
    shutil.copytree(PROJECT, original)
    folder = tmp_path / "migrated"
    shutil.copytree(PROJECT, folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode in (0, 1), report
    # the report's one line: kept whole, why, the cost, the switch
    note = next(line for line in report.splitlines() if "TM203 `val_loader` kept whole" in line)
    assert "every rank evaluates the whole set" in note and "returned to another module" in note
    assert "--shard-eval" in note
    engine = (folder / "engine.py").read_text()
    evaluate = engine[engine.index("def evaluate"):]
    assert "tm." not in evaluate, "nothing is reduced again over a loader every rank iterates in full"
    assert "eval_sampler" not in (folder / "data.py").read_text()
    assert "sampler=tm.eval_sampler(test_dataset)" in (folder / "train.py").read_text()
    assert "hits, total = tm.all_reduce(hits, total)" in (folder / "train.py").read_text()

    (folder / "driver.py").write_text(DRIVER)
    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    run = torchrun("--standalone", "--nproc-per-node=2", "driver.py", env=_env(out_dir), cwd=folder, timeout=300,
                   stale=[out_dir / "*"])
    assert run.returncode == 0, run.report()
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]

    # every rank computed the same validation numbers, epoch after epoch ...
    assert len(ranks[0]["evaluate"]) == EPOCHS
    for field in ("loss", "acc", "predicted", "params"):
        assert [e[field] for e in ranks[0]["evaluate"]] == [e[field] for e in ranks[1]["evaluate"]], field
    # ... so the scheduler stepped alike and the learning rates (and parameters) stayed equal
    assert ranks[0]["lr"] == ranks[1]["lr"] and len(ranks[0]["lr"]) == EPOCHS
    assert len({tuple(lr) for lr in ranks[0]["lr"]}) > 1, "the plateau scheduler should have lowered the rate"

    # ... equal to one process evaluating the same weights on the whole validation set
    ref = subprocess.run([sys.executable, "-c", REFERENCE, str(out_dir / "last.pt")], cwd=original,
                         capture_output=True, text=True, timeout=120, env=_env(out_dir))
    assert ref.returncode == 0, ref.stderr
    expected = json.loads(ref.stdout)
    last = ranks[0]["evaluate"][-1]
    assert last["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert last["acc"] == pytest.approx(expected["acc"])
    assert last["predicted"] == expected["predicted"]
    assert sum(last["predicted"]) == 90, "each sample counted once, on every rank"

    # the best checkpoint is the epoch of the best validation accuracy (the same on every rank)
    accs = [e["acc"] for e in ranks[0]["evaluate"]]
    best = torch.load(out_dir / "best.pt", map_location="cpu", weights_only=False)
    assert best["epoch"] == accs.index(max(accs))

    # the sharded test loop: its reduced accuracy is the whole test set's
    printed = re.findall(r"test accuracy ([0-9.]+)", run.ranks[0])
    assert printed and float(printed[-1]) == pytest.approx(expected["test_acc"], abs=1e-6)
    assert "test accuracy" not in run.ranks[1]

    plain = subprocess.run([sys.executable, "train.py"], cwd=folder, env=_env(tmp_path), capture_output=True,
                           text=True, timeout=180)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert len(re.findall(r"^epoch \d+ ", plain.stdout, re.M)) == EPOCHS


MAIN_ONLY = FIXTURES / "projects" / "eval_main_only"

REFERENCE_MAIN_ONLY = textwrap.dedent('''
    import sys
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x, vx = torch.randn(128, 6, generator=g), torch.randn(37, 6, generator=g)
    vy = (vx.sum(1) > 0).long()
    model = nn.Linear(6, 2)
    model.load_state_dict(torch.load(sys.argv[1], map_location="cpu"))
    print(f"{(model(vx).argmax(1) == vy).float().mean().item():.6f}")
''')


def test_evaluation_on_the_main_process_only_still_works_on_the_whole_set(tmp_path):
    """Validation that the original runs under its own main-process guard: the loader is kept
    whole (nothing could be reduced under the guard), nothing waits for the other rank, and
    rank 0's accuracy is the whole validation set's, not a shard's."""
    folder = tmp_path / "p"
    shutil.copytree(MAIN_ONLY, folder)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "`val_loader` kept whole" in proc.stdout and "rank guard" in proc.stdout
    migrated = (folder / "train.py").read_text()
    assert "eval_sampler" not in migrated and "all_reduce" not in migrated
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = torchrun("--standalone", "--nproc-per-node=2", "train.py", env=_env(out_dir), cwd=folder, timeout=180,
                   stale=[out_dir / "*"])
    assert run.returncode == 0, run.report()
    printed = re.findall(r"val_acc ([0-9.]+)", run.ranks[0])
    assert len(printed) == 3 and not re.search(r"val_acc", run.ranks[1])
    ref = subprocess.run([sys.executable, "-c", REFERENCE_MAIN_ONLY, str(out_dir / "model.pt")],
                         capture_output=True, text=True, timeout=120, env=_env(out_dir))
    assert ref.returncode == 0, ref.stderr
    assert printed[-1] == ref.stdout.strip()

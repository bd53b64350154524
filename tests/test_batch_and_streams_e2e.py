"""The migrated program trains with the original's optimisation, and draws what it should.

For each plain training program in fixtures/batch_and_streams/ the test runs, through the probe
`torchmigrate verify` uses (`torchmigrate.cli.verify_probe`: optimizer steps, parameter hashes and
learning rates per rank) and tests/streams_probe (initial weights before DDP's broadcast, the
first dropout mask):
  1. the original as one process,
  2. the migrated copy (`torchmigrate ddp`, default batch policy) as one process,
  3. the migrated copy under `torchrun --nproc-per-node=2` on CPU ranks,
and asserts: every rank runs as many optimizer steps as the original (each loads batch_size / 2
samples, so the global batch and the step-based schedule are the original's) and ends with the
original's learning rate; parameters and learning rates are equal on both ranks; the initial
weights agree on both ranks (the program's seeding is kept) while the first dropout masks differ
(`tm.seed_per_rank()` before the training loop); and the migrated program as one process draws
and trains exactly as the original (same dropout mask, same parameters).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from launcher import launch_retrying_gloo_abort

pytest.importorskip("torch")

PROGRAMS = sorted((FIXTURES / "batch_and_streams").glob("*.py"))
PROBE = Path(__file__).parent / "streams_probe"


def _env(out: Path) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out.mkdir(parents=True, exist_ok=True)
    env.update(TM_VERIFY_DIR=str(out), STREAMS_PROBE_DIR=str(out), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               CUDA_VISIBLE_DEVICES="", TORCHMIGRATE_AMP="off",  # fp32 everywhere: the numbers compare exactly
               PYTHONPATH=os.pathsep.join([str(PROBE), env.get("PYTHONPATH", "")]))
    return env


def _ranks(out: Path, n: int):
    """(verify probe record, streams probe record) of each rank."""
    return [(json.loads((out / f"rank{r}.json").read_text()), json.loads((out / f"draws{r}.json").read_text()))
            for r in range(n)]


def _one_process(script: Path, out: Path):
    proc = subprocess.run([sys.executable, "-m", "torchmigrate.cli.verify_probe", script.name],
                          cwd=script.parent, env=_env(out), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _ranks(out, 1)[0]


def _training_epoch(record: dict) -> list:
    """The indices of the first epoch of the loader that optimizer steps ran on."""
    loader = next(v for v in record["loaders"].values() if any(it["steps"] for it in v["iterations"]))
    return loader["iterations"][0]["indices"]


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_two_ranks_keep_the_optimisation_and_part_the_streams(program, tmp_path, run_cli):
    original = tmp_path / "original" / program.name
    migrated = tmp_path / "migrated" / program.name
    for path in (original, migrated):
        path.parent.mkdir()
        shutil.copy(program, path)
    result = run_cli("ddp", migrated)
    assert result.exit_code in (0, 1), result.output
    text = migrated.read_text()
    assert "tm.per_rank_batch(" in text and "tm.seed_per_rank()" in text, text
    assert "TM305" not in text and "TM105" not in text, text  # decided, nothing asked

    (before, before_draws) = _one_process(original, tmp_path / "one")
    (alone, alone_draws) = _one_process(migrated, tmp_path / "alone")
    out = tmp_path / "two"
    env = _env(out)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchmigrate.cli.verify_probe", program.name]
    launched = launch_retrying_gloo_abort([cmd], [env], cwd=migrated.parent, timeout=300)
    assert launched.returncode == 0, launched.report()
    ranks = _ranks(out, 2)

    # the migrated program as one process is the original program
    assert alone["steps"] == before["steps"] and alone["optimizers"][0]["hash"] == before["optimizers"][0]["hash"]
    assert alone_draws == before_draws

    (rank0, draws0), (rank1, draws1) = ranks
    # the original's optimisation: as many steps, the same schedule, on every rank
    assert rank0["steps"] == rank1["steps"] == before["steps"] > 0
    assert rank0["optimizers"][0]["lrs"] == rank1["optimizers"][0]["lrs"]
    assert rank0["optimizers"][0]["lrs"] == pytest.approx(before["optimizers"][0]["lrs"], rel=1e-9)
    assert rank0["optimizers"][0]["hash"] == rank1["optimizers"][0]["hash"]
    # each rank loaded its half of the training data (the loaders as the probe names them: file:line)
    trained = [_training_epoch(r) for r in (before, rank0, rank1)]
    assert not set(trained[1]) & set(trained[2]) and set(trained[1]) | set(trained[2]) == set(trained[0])
    # randomness: the program's seeding agrees on every rank, training draws differ per rank
    assert draws0["initial"] == draws1["initial"]
    assert draws0["first_mask"] != draws1["first_mask"]

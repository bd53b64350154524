"""Two ranks train the original's model (issue 27): the migrated program under
`torchrun --nproc-per-node=2` ends with the parameters and learning rates the original ends with
as one process, within float tolerance, not merely "a model that trains".

fixtures/parity/regression.py reads its data in order, has no dropout or BatchNorm and clips its
gradients, so its run is deterministic: with the migration's default batch policy each rank loads
half of every batch (rank r the samples r, r + 2, ...), DDP averages the two halves' gradients into
the original batch's gradient, and every optimizer, clipping and scheduler step is the original's.
A migration that summed instead of averaging, trained each rank on the whole batch, stepped the
scheduler per rank or clipped before the reduction would end elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES
from launcher import torchrun

torch = pytest.importorskip("torch")

PROGRAM = FIXTURES / "parity" / "regression.py"


def _env(out: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith(
               ("TORCHMIGRATE_", "TORCHELASTIC_"))}
    out.mkdir(parents=True, exist_ok=True)
    env.update(OUT_DIR=str(out), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="",
               TORCHMIGRATE_AMP="off")  # fp32 on both sides: the comparison is of the optimisation alone
    return env


def test_two_ranks_end_with_the_original_parameters(tmp_path, run_cli):
    original, migrated = tmp_path / "original" / PROGRAM.name, tmp_path / "migrated" / PROGRAM.name
    for path in (original, migrated):
        path.parent.mkdir()
        shutil.copy(PROGRAM, path)
    result = run_cli("ddp", migrated)
    assert result.exit_code == 0, result.output
    text = migrated.read_text()
    assert "tm.wrap_model(" in text and "tm.per_rank_batch(32)" in text and "tm.sampler(" in text, text

    alone = subprocess.run([sys.executable, original.name], cwd=original.parent, env=_env(tmp_path / "one"),
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stdout + alone.stderr
    two = torchrun("--standalone", "--nproc-per-node=2", migrated.name, cwd=migrated.parent,
                   env=_env(tmp_path / "two"), timeout=300, stale=[tmp_path / "two" / "*"])
    assert two.returncode == 0, two.report()

    want = torch.load(tmp_path / "one" / "final.pt")
    got = torch.load(tmp_path / "two" / "final.pt")
    assert list(got) == list(want)  # no `module.` prefix
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)
    lrs = [json.loads((tmp_path / d / "lrs.json").read_text()) for d in ("one", "two")]
    assert lrs[1] == pytest.approx(lrs[0], rel=1e-12)
    # and the program's own weights moved: the comparison is not of two untrained models
    torch.manual_seed(0)
    torch.randn(256, 8), torch.randn(8, 1), torch.randn(256, 1)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).state_dict()
    assert not torch.allclose(fresh["0.weight"], want["0.weight"], atol=1e-3)

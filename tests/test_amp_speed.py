"""benchmarks/amp_speed.py end to end, at toy sizes: it migrates its plain script with the CLI and
every variant trains (the fp16 + GradScaler variant only where CUDA is). No timing assertions:
the numbers belong in the benchmark's output, not in the suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "amp_speed.py"


def test_amp_speed_benchmark_migrates_and_runs_every_variant(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH), "--width", "32", "--layers", "1", "--seq", "16",
                           "--batch", "16", "--steps", "3", "--warmup", "1", "--json", str(tmp_path / "amp.json")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "amp.json").read_text())
    rows = {r["variant"]: r for r in report["rows"]}
    expected = {"original", "migrated, AMP off", "migrated, bf16"} | (
        {"migrated, fp16"} if torch.cuda.is_available() else set())
    assert set(rows) == expected
    assert all(r["ms_per_step"] > 0 and r["final_loss"] == r["final_loss"] for r in rows.values())
    if report["device"] == "cpu":  # one process, AMP off: the migration must not change the maths
        assert rows["migrated, AMP off"]["final_loss"] == rows["original"]["final_loss"]
    assert "migrated, bf16" in proc.stdout and "speed-up" in proc.stdout

"""torchmigrate.runtime under faults (issue #15), on CPU with gloo: a rank killed mid-training, an
exception on one rank, a process killed while it saves, a busy MASTER_PORT, untrusted checkpoints.

Each launch is bounded by a timeout (a hang fails the test instead of stalling the suite) and the
time from the injected fault to the end of the job is asserted against `DETECT_BOUND`. Measured on
2 loaded cores: the job ends or restarts 2-6 s after the fault (a dead peer closes its gloo
sockets, which the others notice at once; torchrun's agent polls its workers every 0.1 s and
terminates the rest). The bound only has to exclude "waits for the 30-minute collective timeout".
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import torchmigrate.runtime as tm
from launcher import launch, torchrun
from test_runtime_dist import PROBES, clean_env, free_port

TIMEOUT = 120
DETECT_BOUND = 30.0  # seconds from the fault to the job's end or restart


def broke_at(outdir: Path) -> float:
    return float((outdir / "broke_at").read_text())


def test_sigkilled_rank_restarts_from_the_last_checkpoint(tmp_path):
    """Rank 1 is SIGKILLed at step 3 of 6. torchrun notices, stops rank 0 (blocked in a
    collective) and, with --max-restarts=1, starts both again: they resume from the checkpoint
    rank 0 saved after step 2 and finish."""
    run = torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
                   PROBES / "faults.py", tmp_path, "kill", env=clean_env(CUDA_VISIBLE_DEVICES=""),
                   timeout=TIMEOUT, stale=[tmp_path / "*"])
    assert run.returncode == 0, run.report()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["start"], r["restart"]) for r in ranks] == [(3, "1"), (3, "1")]
    assert min(r["began"] for r in ranks) - broke_at(tmp_path) < DETECT_BOUND


def test_exception_on_one_rank_stops_all_and_names_it(tmp_path):
    """Without torchrun's agent (two processes with SLURM variables, as `srun` starts them;
    the master address comes from SLURM_JOB_NODELIST): rank 1 raises at step 3. Both ranks
    exit non-zero promptly and both say which rank failed and why."""
    port = free_port()
    envs = [clean_env(CUDA_VISIBLE_DEVICES="", SLURM_PROCID=str(r), SLURM_LOCALID=str(r),
                      SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port))
            for r in (0, 1)]
    result = launch([[sys.executable, PROBES / "faults.py", tmp_path, "raise"]] * 2, envs,
                    timeout=TIMEOUT)
    ended = time.time()
    assert not result.timed_out and all(rc != 0 for rc in result.returncodes), result.report()
    assert ended - broke_at(tmp_path) < DETECT_BOUND
    why = "(RuntimeError: injected failure on rank 1)"
    assert f"torchmigrate.runtime: rank 0 stopped because rank 1 failed {why}" in result.outputs[0]
    assert f"torchmigrate.runtime: rank 1 failed {why}" in result.outputs[1]


SAVER = """
import sys, torch, torchmigrate.runtime as tm
step = int(sys.argv[2])
while True:
    step += 1
    tm.save({"step": step, "w": torch.full((4_000_000,), float(step))}, sys.argv[1])
"""


def test_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """A process saving 16 MB checkpoints in a loop is SIGKILLed at varied moments, three times;
    every time the file holds one complete checkpoint (tm.save writes a temp file in the same
    folder, fsyncs it, then renames it over the old one)."""
    path = tmp_path / "ckpt.pt"
    step = 0
    for attempt in range(3):
        saver = subprocess.Popen([sys.executable, "-c", SAVER, path, str(step)],
                                 env=clean_env(CUDA_VISIBLE_DEVICES=""))
        try:
            deadline = time.time() + 60
            while (not path.exists() or tm.load(path)["step"] <= step) and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.05 + 0.1 * attempt)  # somewhere in a later save
        finally:
            saver.send_signal(signal.SIGKILL)
            saver.wait()
        state = tm.load(path)
        assert state["step"] > step and torch.equal(state["w"], torch.full((4_000_000,), float(state["step"])))
        step = state["step"]
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")] == ["ckpt.pt"]


def test_busy_master_port_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = clean_env(CUDA_VISIBLE_DEVICES="", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        result = launch([[sys.executable, PROBES / "faults.py", tmp_path, "ok"]], [env], timeout=TIMEOUT)
    assert result.returncode != 0 and not result.timed_out
    assert f"torchmigrate.runtime: MASTER_PORT {port} on 127.0.0.1 is already in use" in result.output


class _Payload:
    """Pickles as a call to Path.touch(marker): code that would run when the file is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_load_never_runs_pickled_code_unless_asked(tmp_path):
    path, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"x": _Payload(marker)}, path)
    with pytest.raises(pickle.UnpicklingError):
        tm.load(path)
    assert not marker.exists()
    tm.load(path, weights_only=False)  # the caller's explicit choice: the code runs
    assert marker.exists()

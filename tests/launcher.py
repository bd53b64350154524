"""Start the suite's multi-process launches (torchrun, or several processes that rendezvous with
each other) and retry once when PyTorch's gloo backend aborts a rank at interpreter exit.

That abort is a known teardown race in PyTorch, not a fault of the code under test: after training
and saving finished, a C++ thread is destroyed while still joinable and the rank prints
`GLOO_EXIT_ABORT`; torchrun then reports a failure. It shows up about 1 run in 20 on 2 loaded
cores even with the runtime's barrier before `destroy_process_group`, and the suite launches
~30 groups, so one retry on exactly that message keeps CI honest without making it flaky. Any
other failure is returned unchanged, for the test to report with its full output.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

GLOO_EXIT_ABORT = "terminate called without an active exception"


@dataclass
class Launch:
    """How a group of processes ended: one command, return code and stdout+stderr per process;
    for a torchrun launch also what each of its workers printed, by local rank (`ranks`)."""

    args: list[list[str]]
    returncodes: list[int]
    outputs: list[str]
    timed_out: bool
    ranks: list[str] = field(default_factory=list)

    @property
    def returncode(self) -> int:
        """The first non-zero return code, else 0, so one process reads like `subprocess.run`."""
        return next((rc for rc in self.returncodes if rc), 0)

    @property
    def output(self) -> str:
        """Everything the processes printed, in launch order."""
        return "\n".join(self.outputs)

    def report(self) -> str:
        """Every command with its return code and full output, for an assertion message."""
        head = "timed out\n" if self.timed_out else ""
        return head + "\n".join(f"--- {a} rc={rc}\n{out}"
                                for a, rc, out in zip(self.args, self.returncodes, self.outputs))

    def printed_abort(self) -> bool:
        return GLOO_EXIT_ABORT in self.output or any(GLOO_EXIT_ABORT in r for r in self.ranks)


def launch(cmds: Sequence[Sequence], envs: Sequence[dict | None], *, cwd=None,
           timeout: float) -> Launch:
    """Start all commands at once (they may wait for each other) and wait for all of them; at the
    timeout the ones still running are killed, so a hung rendezvous cannot hang the suite."""
    args = [[str(a) for a in cmd] for cmd in cmds]
    procs = [subprocess.Popen(a, env=e, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for a, e in zip(args, envs)]
    outputs, timed_out = [], False
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, err = p.communicate()
        outputs.append(out + err)
    return Launch(args, [p.returncode for p in procs], outputs, timed_out)


def launch_retrying_gloo_abort(cmds: Sequence[Sequence], envs: Sequence[dict | None], *,
                               cwd=None, timeout: float = 180, stale: Iterable = (),
                               finish: Callable[[Launch], None] = lambda result: None) -> Launch:
    """`launch` the group; if it failed and printed `GLOO_EXIT_ABORT`, delete what matches the
    `stale` glob patterns (files or folders the first attempt wrote that the test would otherwise
    read) and launch the whole group once more. The second attempt's result is final. `finish`
    completes each attempt's result before it is judged (torchrun's per-rank logs)."""
    result = launch(cmds, envs, cwd=cwd, timeout=timeout)
    finish(result)
    if result.returncode == 0 or not result.printed_abort():
        return result
    for pattern in stale:
        for path in glob.glob(str(pattern)):
            _remove(path)
    result = launch(cmds, envs, cwd=cwd, timeout=timeout)
    finish(result)
    return result


def _remove(path: str) -> None:
    """Delete a stale file or a whole stale folder (a probe's checkpoint folder, say)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def torchrun_cmd(*args) -> list[str]:
    """`python -m torch.distributed.run ARGS`: this interpreter's torchrun, whatever is on PATH."""
    return [sys.executable, "-m", "torch.distributed.run", *(str(a) for a in args)]


def torchrun(*args, env: dict, cwd=None, timeout: float = 180, stale: Iterable = ()) -> Launch:
    """One torchrun launch, retried once on the gloo exit abort.

    torchrun tees each worker's stdout and stderr into its own files, and the result's `ranks`
    holds them: the workers share one console, where a line one rank prints in two writes
    (`print` writes the text, then the newline) can be split by another rank's line, so tests that
    ask *which rank* printed something read `ranks`, not the console."""
    with tempfile.TemporaryDirectory(prefix="torchrun-logs-") as logs:
        cmd = torchrun_cmd("--tee", "3", "--log-dir", logs, *args)
        return launch_retrying_gloo_abort([cmd], [env], cwd=cwd, timeout=timeout,
                                          stale=[*stale, Path(logs) / "*"],
                                          finish=lambda result: _read_rank_logs(result, logs))


def _read_rank_logs(result: Launch, logs: str) -> None:
    """Fill `result.ranks` from torchrun's `LOGS/<run>/attempt_0/<local rank>/std{out,err}.log`."""
    folders = glob.glob(os.path.join(logs, "*", "attempt_*", "*"))
    by_rank = sorted((int(os.path.basename(f)), f) for f in folders if os.path.basename(f).isdigit())
    result.ranks = ["".join(Path(f, name).read_text(errors="replace")
                            for name in ("stdout.log", "stderr.log") if Path(f, name).exists())
                    for _, f in by_rank]

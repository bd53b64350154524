"""`torchmigrate verify`: run a training script on N ranks under torchrun and say what is wrong.

This side never imports torch: it starts `python -m torch.distributed.run` as a child process
with every worker running the script through the probe
(`python -m torchmigrate.cli.verify_probe SCRIPT`), reads back what each rank recorded and
printed, and judges it with `torchmigrate.cli.verify_checks`.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import click

from torchmigrate.cli import verify_checks
from torchmigrate.cli.verify_checks import FAIL, Run

# A known PyTorch teardown race: a gloo rank aborts at interpreter exit after everything ran; it is
# not the script's fault, so such a launch is run once more (as the test suite's launcher does).
GLOO_EXIT_ABORT = "terminate called without an active exception"
# A program still training at this epoch is stopped there (after `--epochs` full epochs, the
# probe shortens each epoch to one step, so most programs reach their end, a final save, first).
LAST_EPOCH = 20
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Options:
    script: Path
    args: List[str]
    nproc: int = 2
    device: str = "cpu"
    steps: int = 10
    epochs: int = 2
    timeout: float = 300
    resume_args: Optional[List[str]] = None
    resume_env: Optional[dict] = None


class LaunchError(Exception):
    """torchrun itself could not start the ranks (no torch in this interpreter, a bad option)."""


def _env(options: Options, records: str, extra: Optional[dict] = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(TM_VERIFY_DIR=records, TM_VERIFY_STEPS=str(options.steps), TM_VERIFY_EPOCHS=str(options.epochs),
               TM_VERIFY_LAST_EPOCH=str(LAST_EPOCH),
               TM_VERIFY_ROOT=str(options.script.resolve().parent), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if options.device == "cpu":  # CPU ranks with gloo, also on a machine with GPUs
        env.update(CUDA_VISIBLE_DEVICES="", TORCHMIGRATE_BACKEND="gloo")
    env.update(extra or {})
    return env


class Watch:
    """What the ranks are doing while they run, on stderr: a line when a phase begins (started,
    each full epoch, the shortened epochs, the end), with each rank's epoch and optimizer steps,
    and a line every `HEARTBEAT` seconds when nothing changes, so a slow run is never silent."""

    HEARTBEAT = 15.0

    def __init__(self, records: str, options: Options, echo) -> None:
        self.records, self.options, self.echo = records, options, echo
        self.start = self.changed = time.monotonic()
        self.shown = None

    def _states(self) -> List[Optional[dict]]:
        return [_read(os.path.join(self.records, f"rank{r}.progress.json")) for r in range(self.options.nproc)]

    def _phase(self, state: Optional[dict]):
        if state is None:
            return (0, "starting")
        if state["phase"] == "started":
            return (1, "started")
        if state["phase"] == "training":
            full = not self.options.epochs or state["epoch"] <= self.options.epochs
            return (2, state["epoch"]) if full else (3, "short")
        return (4, state["phase"])

    def _describe(self, phase) -> str:
        rank_phase = phase[1]
        if phase[0] == 2:
            limit = f" of {self.options.epochs}" if self.options.epochs else ""
            return f"training epoch {rank_phase}{limit}"
        if phase[0] == 3:
            return (f"after {self.options.epochs} epoch(s), running on to the program's end with one optimizer "
                    f"step per epoch (stopped at epoch {LAST_EPOCH} if it is still training)")
        return {"starting": "starting the ranks", "started": "running the script (imports, data, model)",
                "stopped": f"stopped by verify at epoch {LAST_EPOCH}", "finished": "the script ended",
                "crashed": "a rank crashed", "exited": "a rank exited",
                "probe_failed": "verify's probe failed"}.get(rank_phase, str(rank_phase))

    def poll(self, final: bool = False) -> None:
        states = self._states()
        phases = [self._phase(st) for st in states]
        ahead = max(phases, key=lambda ph: (ph[0], str(ph[1]).zfill(6)))
        now = time.monotonic()
        if ahead == self.shown and now - self.changed < self.HEARTBEAT and not final:
            return
        if ahead[0] == 4 and (self.shown is None or self.shown[0] < 3) and self.options.epochs and any(
                st is not None and st.get("epoch", 0) > self.options.epochs for st in states):
            # the shortened epochs passed between two polls (a fast script): said all the same
            self.echo(f"verify [{now - self.start:5.1f}s] {self._describe((3, 'short'))}")
        still = "still " if ahead == self.shown else ""
        self.shown, self.changed = ahead, now
        ranks = "; ".join(f"rank {r}: " + ("not started" if st is None else
                                           f"epoch {st['epoch']}, {st['steps']} steps" if st["steps"] else st["phase"])
                          for r, st in enumerate(states))
        what = "the ranks ended; checking" if final else still + self._describe(ahead)
        self.echo(f"verify [{now - self.start:5.1f}s] {what} ({ranks})")


def _launch(options: Options, args: Sequence[str], extra_env: Optional[dict], folder: str, echo) -> Run:
    """One torchrun launch of the script under the probe; every rank's output goes to its own log."""
    records, logs = os.path.join(folder, "records"), os.path.join(folder, "logs")
    os.makedirs(records)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={options.nproc}",
           "--redirects", "3", "--log-dir", logs, "-m", "torchmigrate.cli.verify_probe", str(options.script),
           *args]
    watch = Watch(records, options, echo)
    echo(f"verify: running {options.script} on {options.nproc} {options.device.upper()} rank(s) under torchrun "
         f"(--timeout {options.timeout:g}s)")
    with open(os.path.join(folder, "launcher.log"), "w+") as out:
        proc = subprocess.Popen(cmd, env=_env(options, records, extra_env), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        deadline, timed_out = time.monotonic() + options.timeout, False
        while proc.poll() is None:
            if time.monotonic() > deadline:
                timed_out = True
                echo(f"verify: the --timeout of {options.timeout:g}s is over: stopping the ranks")
                _stop(proc)
                break
            watch.poll()
            time.sleep(0.25)
        out.seek(0)
        launcher = out.read()
    watch.poll(final=True)
    outputs = _rank_logs(logs, options.nproc)
    recs = [_read(os.path.join(records, f"rank{r}.json")) for r in range(options.nproc)]
    if all(rec is None for rec in recs) and not any(outputs) and proc.returncode and not timed_out:
        raise LaunchError(f"torchrun failed before any rank started:\n{launcher[-3000:]}")
    return Run(recs, outputs, timed_out, options.timeout)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the whole launch (each rank's probe records where it was), then SIGKILL it."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _rank_logs(logs: str, nproc: int) -> List[str]:
    """What each rank printed: torchrun's `LOGS/<run>/attempt_0/<rank>/std{out,err}.log`."""
    outputs = []
    for rank in range(nproc):
        text = ""
        for name in ("stdout.log", "stderr.log"):
            for path in glob.glob(os.path.join(logs, "*", "attempt_*", str(rank), name)):
                text += Path(path).read_text(errors="replace")
        outputs.append(text)
    return outputs


def _aborted(run: Run) -> bool:
    return any(GLOO_EXIT_ABORT in out for out in run.outputs) and verify_checks.exits(run).status == FAIL


def launch(options: Options, args: Sequence[str], extra_env: Optional[dict] = None, echo=None) -> Run:
    """Launch; once more when the only failure is gloo's teardown abort."""
    echo = echo or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="torchmigrate-verify-") as folder:
        run = _launch(options, args, extra_env, os.path.join(folder, "1"), echo)
        if _aborted(run):
            echo("verify: a rank aborted in gloo's teardown after the script ended (a known PyTorch race): "
                 "running it once more")
            run = _launch(options, args, extra_env, os.path.join(folder, "2"), echo)
        return run


def verify(options: Options, echo=None) -> dict:
    """Run the script (and its resumption), judge both; the report as plain data. `echo` gets
    the progress lines."""
    run = launch(options, options.args, echo=echo)
    checks = verify_checks.all_checks(run)
    resumed = None
    if options.resume_args is not None or options.resume_env:
        args = options.args if options.resume_args is None else options.resume_args
        if echo:
            echo("verify: the resume run")
        resumed = launch(options, args, options.resume_env, echo)
        checks.append(verify_checks.resumed(run, resumed))
    stopped = [rec["status"] == "stopped" for rec in run.records if rec]
    probe = verify_checks.probe(run, resumed)
    if probe is not None:
        checks.insert(0, probe)
    return {
        "script": str(options.script), "args": options.args, "nproc": options.nproc, "device": options.device,
        "steps": options.steps, "epochs": options.epochs, "last_epoch": LAST_EPOCH,
        "stopped_by_verify": bool(stopped) and all(stopped),
        "short_epochs": max((rec.get("short_epochs", 0) for rec in run.records if rec), default=0),
        "timed_out": run.timed_out, "passed": all(c.status != FAIL for c in checks),
        "tool_failed": probe is not None, "checks": [c.to_json() for c in checks],
        "ranks": _ranks(run), "resume_ranks": _ranks(resumed) if resumed else None,
    }


def _ranks(run: Run) -> list:
    return [{"rank": r, "status": rec["status"] if rec else None, "exit_code": rec["exit_code"] if rec else None,
             "output": out[-20000:]} for r, (rec, out) in enumerate(zip(run.records, run.outputs))]


def _how(report: dict) -> str:
    if report["stopped_by_verify"]:
        return (f"stopped by verify at epoch {report['last_epoch']}: the code after the training loop "
                "(a final save) did not run")
    if report["timed_out"]:
        return "timed out"
    if report["checks"][0]["status"] == FAIL:
        return "failed"
    if report["short_epochs"]:
        return (f"ran to its end; the {report['short_epochs']} epoch(s) after the first {report['epochs']} "
                "ran one optimizer step each")
    return "ran to its end"


def render(report: dict) -> str:
    """The terminal table: one line per check, its evidence and `file:line` indented below."""
    limit = (f"at most {report['steps']} optimizer steps per epoch" if report["steps"] else "every batch") + \
        (f", {report['epochs']} full epoch(s)" if report["epochs"] else "")
    lines = [f"torchmigrate verify {report['script']}: {report['nproc']} ranks on {report['device']} "
             f"({limit}; {_how(report)})", ""]
    width = max(len(c["title"]) for c in report["checks"])
    for c in report["checks"]:
        lines.append(f"  {c['status'].upper():4}  {c['title']:<{width}}  {c['message']}")
        lines += [f"{'':{width + 10}}{e}" for e in c["evidence"]]
        if c["status"] == FAIL and c["where"]:
            lines.append(f"{'':{width + 10}}at {', '.join(c['where'])}")
    failed = [c for c in report["checks"] if c["status"] == FAIL]
    lines.append("")
    if report["tool_failed"]:
        lines.append("torchmigrate verify itself failed (its probe, not your script): the checks above may be "
                     "incomplete. Please report it with the output of --format json.")
    elif failed:
        lines.append(f"{len(failed)} of {len(report['checks'])} checks failed.")
    else:
        lines.append("All checks passed." if not report["stopped_by_verify"] else
                     f"All checks passed, but only up to epoch {report['last_epoch']}: the end of the program (a "
                     "final save, a final evaluation) was NOT reached and NOT checked. To check it, make the "
                     "script train fewer epochs (its own option) and run verify again.")
    return "\n".join(lines)


def parse_env(pairs: Sequence[str]) -> dict:
    """`NAME=VALUE` pairs (for --resume-env) as a dict; ValueError names a bad one."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"expected NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def split_args(text: Optional[str]) -> Optional[List[str]]:
    return None if text is None else shlex.split(text)


@click.command("verify")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--nproc", type=click.IntRange(1, 64), default=2, show_default=True, help="Number of ranks.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cpu: gloo, GPUs hidden; cuda: the runtime's choice (NCCL), one GPU per rank.")
@click.option("--steps", type=click.IntRange(0), default=10, show_default=True,
              help="End each training epoch after K optimizer steps (0: the whole epoch).")
@click.option("--epochs", type=click.IntRange(0), default=2, show_default=True,
              help=f"Run E epochs of up to --steps optimizer steps, then shorten every later epoch to one "
                   f"step, so the program reaches its end (a final save) quickly; a program still training at "
                   f"epoch {LAST_EPOCH} is stopped there and the report says its end was not reached. "
                   "0: every epoch runs --steps steps, no stop.")
@click.option("--timeout", type=click.FloatRange(min=1), default=300, show_default=True,
              help="Stop the run after S seconds and report where each rank was.")
@click.option("--resume-args", metavar="ARGS", help="Run a second time with these script arguments "
              "(one shell-quoted string) and check it resumes from a file the first run wrote.")
@click.option("--resume-env", metavar="NAME=VALUE", multiple=True,
              help="Environment for that second run (repeatable); implies a resume run.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="text: a table for a terminal; json: the checks and each rank's output, for CI.")
def command(script, script_args, nproc, device, steps, epochs, timeout, resume_args, resume_env, fmt):
    """Run SCRIPT on N ranks under torchrun and check it trains correctly.

    \b
      torchmigrate verify train.py                       2 CPU ranks (gloo)
      torchmigrate verify --steps 5 train.py -- --lr 0.1 script arguments after --

    This RUNS YOUR CODE (as `torchrun --standalone --nproc-per-node N SCRIPT ARGS` would), with a
    probe that records, without changing your files: crashes, the samples each rank draws, final
    parameters and learning rates, files written, saved state dict keys and printed lines.
    Arguments after `--` go to the script unchanged. Checks: every rank exits cleanly, training
    loaders are sharded and reshuffled, parameters and learning rates equal on all ranks, only
    rank 0 writes files, no module./_orig_mod. keys in saved state dicts, log lines printed once
    (and with --resume-args/--resume-env, that a second run resumes from the checkpoint).

    Progress (one line per phase, with each rank's epoch and steps) goes to stderr.

    Exit codes: 0 every check passed, 1 a check failed, 2 usage error, torchrun could not start,
    or verify's own probe failed (a torchmigrate bug, reported as such).
    """
    try:
        options = Options(Path(script), list(script_args), nproc, device, steps, epochs, timeout,
                          split_args(resume_args), parse_env(resume_env))
        report = verify(options, echo=lambda line: click.echo(line, err=True))
    except (ValueError, LaunchError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report, indent=2) if fmt == "json" else render(report))
    sys.exit(2 if report["tool_failed"] else 0 if report["passed"] else 1)

"""Runs the engine over files: read, process, then diff, check or write; never raises for one file.

Results are plain, picklable records so files can be processed in worker processes (`-j N`)
with the output assembled in input order.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable, Dict, List, Optional, Sequence, Tuple

from torchmigrate.engine.textedits import line_map, unified_diff
from torchmigrate.engine import files
from torchmigrate.engine.outcome import Outcome, Record
from torchmigrate.errors import InputError
from torchmigrate.options import Options
from torchmigrate.program import effects
from torchmigrate.program.view import ModuleView

VENDORED_NAME = "torchmigrate_runtime.py"


@dataclass(frozen=True)
class Job:
    options: Options
    rule_codes: Tuple[str, ...]
    write: bool = False
    want_diff: bool = False
    vendor_runtime: bool = False
    # resolved path -> what the rest of its program says about the module (None: files alone)
    program: Optional[Dict[str, ModuleView]] = None
    # write every changed file at the end, all or none (a program), instead of one by one
    together: bool = False
    # path (as given to `run`) -> (rule codes, amp, shard_eval) from the settings that govern
    # the file (`cli.settings.FileSettings`); a file not in it gets `rule_codes` and `options`
    per_file: Optional[Dict[str, Tuple]] = None
    fix_edits: bool = False  # records carry the fixes not applied as text edits (json, sarif)
    to_stdout: bool = False  # the source comes from stdin and the new source goes to `Outcome.output`

    def settings(self, path: str) -> Tuple[Tuple[str, ...], Options]:
        """The rule codes and options for the file at `path`."""
        own = self.per_file.get(path) if self.per_file else None
        if own is None:
            return self.rule_codes, self.options
        codes, amp, shard_eval = own
        if amp == self.options.amp and shard_eval == self.options.shard_eval:
            return codes, self.options
        return codes, replace(self.options, amp=amp, shard_eval=shard_eval)


def process_file(path: str, job: Job, given: Optional[files.Decoded] = None) -> Outcome:
    """Process one file (`given`: its source, read from stdin). Never raises: any failure
    becomes `outcome.error` and the file is left as it was, so one bad file never stops the
    others."""
    from torchmigrate.engine.process import process_source  # LibCST: only when a file is processed
    from torchmigrate.rules import get_rule

    outcome = Outcome(path)
    try:
        codes, options = job.settings(path)
        rules = [get_rule(code) for code in codes]
        decoded = given or files.read(Path(path))
        view = job.program.get(os.path.realpath(path)) if job.program else None
        skipped: List[Tuple[str, Exception]] = []
        while True:
            try:
                result = process_source(decoded.text, path, options, rules, view, job.fix_edits)
                break
            except InputError:
                raise
            except Exception as exc:
                failing = _failing_rule(exc, rules)
                if failing is None or len(skipped) >= MAX_SKIPPED_RULES:
                    raise
                skipped.append((failing.code, exc))
                rules = [r for r in rules if r is not failing]
        # a migration's findings are found on the source as read; once it is written (or
        # printed), they point into the file the user opens next
        where = (line_map(result.source, result.new_source)
                 if options.migrating and result.changed and (job.write or job.to_stdout) else None)
        records = [
            Record(path, where(f.line) if where else f.line, f.col, f.code, f.message, f.safety.value, f.applied,
                   f.fix, f.advice)
            for f in result.findings if not f.suppressed
        ]
        outcome.warnings = tuple(f"Invalid rule code provided to `# torchmigrate: ignore` at {path}:{line}: {code}"
                                 for line, code in result.unknown_ignores)
        if job.to_stdout:
            outcome.output = files.encode(result.new_source, decoded.encoding)
        new_bytes = files.encode(result.new_source, decoded.encoding) if result.changed and job.write else None
        outcome.records = records
        outcome.changed = result.changed
        outcome.digest = decoded.digest
        if result.changed:
            if job.want_diff:
                outcome.diff = unified_diff(result.source, result.new_source, path)
            if new_bytes is not None and job.together:
                outcome.pending = (new_bytes, decoded.stamp)
            elif new_bytes is not None:
                files.atomic_write(Path(path), new_bytes, decoded.stamp)
                outcome.written = True
        uses_runtime = outcome.uses_runtime = options.runtime_module in result.new_source
        outcome.signals = signals(result.new_source)
        if options.mode == "ddp":  # what the migrated module still writes on every rank: the report
            outcome.effects = effects.summarize_source(result.new_source, os.path.realpath(path),
                                                       view.bindings if view is not None else {},
                                                       entry=view is None or view.is_entry)
        if job.vendor_runtime and job.write and uses_runtime and not job.together:
            outcome.vendored = vendor_runtime(Path(path).parent)
        if skipped:
            outcome.skipped_rules = tuple(code for code, _ in skipped)
            outcome.error = (1, 0, "; ".join(
                f"internal error ({type(exc).__name__}: {_short(exc)}) in {code}, which was skipped for this file "
                f"(what it does is NOT done here; the other rules' changes were kept); please report it"
                for code, exc in skipped))
    except InputError as exc:
        _failed(outcome, exc.line, exc.col, exc.message)
    except Exception as exc:  # a bug in a rule or the engine: report it, keep going
        kept = "" if outcome.written else "; the file was left unchanged"
        _failed(outcome, 1, 0, f"internal error ({type(exc).__name__}: {exc}){kept}; please report it")
    return outcome


# training data that no DataLoader carries, once sharded (hand-made batch loops, batches read at a
# cursor, full-batch indices)
_HAND_MADE = ("shard_range(", "shard_batches(", "shard_indices(", "rank_part(")
# signal -> any of these in a migrated source
_SIGNALS = {
    "trains": (".backward(",),
    # signs that the program means to train, here or in code it hands its model to
    "means_to_train": (".backward(", ".fit(", ".train(", "Trainer(", ".parameters(", "optim.", "DataLoader("),
    "wraps": ("wrap_model(", "DistributedDataParallel(", "DDP(", "sync_grads("),
    "loaders": ("DataLoader(", "DataLoader as ", "shard_stream(", *_HAND_MADE),  # `DataLoader as DL`
    "shards": ("tm.sampler(", "eval_sampler(", "shard_sampler(", "DistributedSampler(", ".sampler(", "shard_stream(",
               *_HAND_MADE),
}


def signals(source: str) -> Tuple[str, ...]:
    """Cheap textual facts about a migrated file, for the program summary (not for decisions).
    Comment lines do not count: a TODO that says "wrap the model with `tm.wrap_model(...)`" is
    the opposite of a wrap."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    return tuple(name for name, needles in _SIGNALS.items() if any(n in code for n in needles))


def write_together(outcomes: Sequence[Outcome], job: Job, groups: Sequence[Sequence[str]]) -> None:
    """Write the pending changes, each group of files (one program) as one change
    (`files.write_all`): all of a group or none. A group that could not be written gets an
    error on the file that failed and on each of its other files."""
    by_path = {os.path.realpath(o.path): o for o in outcomes}
    grouped = {os.path.realpath(p) for g in groups for p in g}
    sets = [list(g) for g in groups] + [[p] for p in by_path if p not in grouped]
    for group in sets:
        ready = [by_path[os.path.realpath(p)] for p in group if os.path.realpath(p) in by_path]
        ready = [o for o in ready if o.pending is not None and (o.error is None or o.skipped_rules)]
        try:
            files.write_all([(Path(o.path), o.pending[0], o.pending[1]) for o in ready])
        except files.ChangeSetError as exc:
            failed = os.path.realpath(exc.path)
            for o in ready:
                o.pending = None
                if os.path.realpath(o.path) == failed:
                    _failed(o, 1, 0, exc.message)
                else:
                    _failed(o, 1, 0, f"not written: {exc.path} of the same program could not be written "
                                     "(a program is written whole or not at all)")
            continue
        for o in ready:
            o.pending = None
            o.written = True
            if job.vendor_runtime and o.uses_runtime:
                o.vendored = vendor_runtime(Path(o.path).parent)


# rules that may fail on one file before it is given up (left unchanged, as for any other failure)
MAX_SKIPPED_RULES = 3


def _failing_rule(exc: Exception, rules: Sequence[type]) -> Optional[type]:
    """The rule whose code raised `exc`: the innermost frame of its traceback whose `self` is
    one of `rules` (a helper or a family's plan called from the rule sits deeper, without one).
    None for a failure of the engine or of the shared facts: then no rule can be blamed, and
    the file is left as it was. Read only after a failure: nothing is wrapped on the way."""
    kinds = tuple(rules)
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if kinds and isinstance(owner, kinds):
            found = type(owner)
        tb = tb.tb_next
    return found


def _short(exc: Exception) -> str:
    """The exception's message, one line of at most 120 characters (a KeyError of a syntax node
    prints the whole node)."""
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 120 else line[:117] + "..."


def _failed(outcome: Outcome, line: int, col: int, message: str) -> None:
    outcome.error = (line, col, message)
    if not outcome.written:  # when only a step after the write failed, keep what was done
        outcome.records = []
        outcome.changed = False
        outcome.diff = ""
        outcome.output = None


def path_error(path: str, message: str) -> Outcome:
    """The outcome of a path that could not be processed at all (missing, not a regular file):
    line 0 means no position, so every output format reports it as it reports a file's error."""
    return Outcome(path, error=(0, 0, message))


def runtime_source() -> str:
    """The runtime shim's source, located without importing it (importing it imports torch)."""
    import importlib.util

    spec = importlib.util.find_spec("torchmigrate.runtime")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text(encoding="utf-8")


def vendor_runtime(folder: Path) -> str:
    target = folder / VENDORED_NAME
    source = runtime_source()
    if not target.exists() or target.read_text(encoding="utf-8") != source:
        if target.exists():
            files.atomic_write(target, source.encode("utf-8"))
        else:
            target.write_text(source, encoding="utf-8")
    return str(target)


def _process_all(names: Sequence[str], job: Job, progress: Optional[Callable[[int], None]] = None) -> List[Outcome]:
    """`process_file` for each name, with Python's cyclic garbage collector paused.

    A parse allocates about a million small objects; with automatic collection on, the
    collector runs hundreds of times per file and each pass walks every node still alive (the
    whole tree, until the file is done): about 8% of a migration's time. Almost all of it is
    freed by reference counting anyway, so collection is paused and the youngest generation,
    which holds everything a file left behind (a few reference cycles), is collected after each
    file: memory stays flat.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        results = []
        for name in names:
            results.append(process_file(name, job))
            gc.collect(0)
            if progress:
                progress(1)
        return results
    finally:
        if enabled:
            gc.enable()


# `-j 0` (the default) runs this many files or more in worker processes, one per usable CPU.
# Below it, starting the pool costs more than it saves (a file takes ~10-40 ms).
AUTO_JOBS_MIN_FILES = 8


def auto_jobs(files: int) -> int:
    """Worker processes for `files` files: one per CPU this process may use, at most one per
    four files, and none (1: in-process) for small runs such as a one-file pre-commit call."""
    if files < AUTO_JOBS_MIN_FILES:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))  # what a container or taskset allows, not the host
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, files // 4))


def run(paths: Sequence[Path], job: Job, jobs: int = 1, progress: Optional[Callable[[int], None]] = None) -> List[Outcome]:
    """Process every file and return the outcomes in input order.

    With `jobs > 1` files are processed in worker processes, a few per task; results are put
    back in input order, so the output does not depend on scheduling. `progress(n)` is called
    as `n` more files are done.
    """
    names = [str(p) for p in paths]
    if jobs > 1 and len(names) > 1:
        try:
            return _run_parallel(names, job, jobs, progress)
        except _NoPool:
            pass  # no worker processes here (a sandbox without semaphores): do it in-process
    return _process_all(names, job, progress)


class _NoPool(Exception):
    """Worker processes cannot be started on this system."""


def _run_parallel(names: List[str], job: Job, jobs: int, progress) -> List[Outcome]:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    workers = min(jobs, len(names))
    size = max(1, min(16, len(names) // (workers * 4)))
    chunks = [names[i:i + size] for i in range(0, len(names), size)]
    done: Dict[int, List[Outcome]] = {}
    try:
        pool = ProcessPoolExecutor(max_workers=workers)
    except (OSError, NotImplementedError, ImportError) as exc:
        raise _NoPool() from exc
    with pool:
        futures = {pool.submit(_process_all, chunk, job): i for i, chunk in enumerate(chunks)}
        for future in as_completed(futures):
            i = futures[future]
            try:
                done[i] = future.result()
            except Exception:  # a worker died (a native crash, killed): see _isolated below
                continue
            if progress:
                progress(len(chunks[i]))
    for i, chunk in enumerate(chunks):
        if i not in done:
            done[i] = [_isolated(name, job) for name in chunk]
            if progress:
                progress(len(chunk))
    return [outcome for i in range(len(chunks)) for outcome in done[i]]


def _isolated(name: str, job: Job) -> Outcome:
    """`process_file` in a process of its own, for the files of a worker that died.

    When one worker dies the pool is broken and every chunk not yet finished fails with it,
    whichever file was at fault. Each of those files gets a fresh process, so only the file
    that kills its process is reported (by the signal or exit code that ended it) and the
    rest of the run is kept. A plain process and a pipe, not a one-worker pool: the pool
    forgets its dead worker's exit code in a race with its own cleanup.
    """
    import multiprocessing

    receive, send = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.Process(target=_process_and_send, args=(send, name, job))
    process.start()
    send.close()
    try:
        outcome: Optional[Outcome] = receive.recv()
    except EOFError:  # it died before sending
        outcome = None
    process.join()
    if outcome is not None:
        return outcome
    return Outcome(name, error=(1, 0, f"internal error: the process working on this file died "
                                      f"({_death(process.exitcode or 0)}); the file was left unchanged, please report it"))


def _process_and_send(send, name: str, job: Job) -> None:
    send.send(process_file(name, job))
    send.close()


def _death(exitcode: int) -> str:
    """`exit code 3` or `signal SIGSEGV` for a dead process's exit code."""
    import signal

    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


PROGRESS_MIN_FILES = 20


class Progress:
    """A one-line progress bar on stderr for long runs: only when stderr is a terminal and the
    run has more than `PROGRESS_MIN_FILES` files; erased when done, so it never mixes with output."""

    def __init__(self, total: int, stream: Optional[IO[str]] = None, label: str = "files",
                 min_files: int = PROGRESS_MIN_FILES) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total = total
        self.done = 0
        self.label = label
        self.enabled = total > min_files and _is_terminal(self.stream)
        self._last = 0.0

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if self.done < self.total and now - self._last < 0.05:
            return
        self._last = now
        width = 30
        filled = width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (width - filled)
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {self.label}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False

"""Runs the engine over files: read, process, then diff, check or write; never raises for one file.

Results are plain, picklable records so files can be processed in worker processes (`-j N`)
with the output assembled in input order.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from torchmigrate import files
from torchmigrate.diff import unified_diff
from torchmigrate.engine import InputError, process_source
from torchmigrate.rule import Options

VENDORED_NAME = "torchmigrate_runtime.py"


@dataclass(frozen=True)
class Record:
    """A finding as reported to the user."""

    path: str
    line: int
    col: int
    code: str
    message: str
    safety: str
    applied: bool

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col + 1}"


@dataclass
class Outcome:
    path: str
    records: List[Record] = field(default_factory=list)
    changed: bool = False
    written: bool = False
    diff: str = ""
    error: Optional[Tuple[int, int, str]] = None
    vendored: Optional[str] = None

    @property
    def open_records(self) -> List[Record]:
        """Findings still needing attention after this run."""
        return [r for r in self.records if not r.applied]


@dataclass(frozen=True)
class Job:
    options: Options
    rule_codes: Tuple[str, ...]
    write: bool = False
    want_diff: bool = False
    vendor_runtime: bool = False


def process_file(path: str, job: Job) -> Outcome:
    from torchmigrate.rules import get_rule

    rules = [get_rule(code) for code in job.rule_codes]
    outcome = Outcome(path)
    try:
        decoded = files.read(Path(path))
        result = process_source(decoded.text, path, job.options, rules)
        records = [
            Record(path, f.line, f.col, f.code, f.message, f.safety.value, f.applied)
            for f in result.findings if not f.suppressed
        ]
        outcome.records = records
        outcome.changed = result.changed
        if result.changed:
            if job.want_diff:
                outcome.diff = unified_diff(result.source, result.new_source, path)
            if job.write:
                files.atomic_write(Path(path), files.encode(result.new_source, decoded.encoding))
                outcome.written = True
        uses_runtime = job.options.runtime_module in result.new_source
        if job.vendor_runtime and job.write and uses_runtime:
            outcome.vendored = vendor_runtime(Path(path).parent)
    except InputError as exc:
        outcome.error = (exc.line, exc.col, exc.message)
        outcome.records = []
        outcome.changed = False
    return outcome


def runtime_source() -> str:
    """The runtime shim's source, located without importing it (importing it imports torch)."""
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


def run(paths: Sequence[Path], job: Job, jobs: int = 1, progress=None) -> List[Outcome]:
    names = [str(p) for p in paths]
    if jobs > 1 and len(names) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=jobs) as pool:
            chunks = max(1, len(names) // (jobs * 4))
            results = []
            for outcome in pool.map(process_file, names, [job] * len(names), chunksize=chunks):
                results.append(outcome)
                if progress:
                    progress(outcome)
            return results
    results = []
    for name in names:
        outcome = process_file(name, job)
        results.append(outcome)
        if progress:
            progress(outcome)
    return results


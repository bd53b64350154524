"""What processing one file produced: plain, picklable records that the output formats, the
report and the lint cache share (no engine or LibCST import, see `errors`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from torchmigrate.engine.textedits import TextEdit


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
    fix: Optional[Tuple[TextEdit, ...]] = None  # a fix this run did not apply (with `Job.fix_edits`)
    advice: bool = False  # a note: correct either way (see `Finding.advice`)

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
    # rules that failed on this file and were left out of its run (`error` says how): the other
    # rules' changes were kept, and what these do is not done in this file
    skipped_rules: Tuple[str, ...] = ()
    vendored: Optional[str] = None
    # with `Job.together`: the new bytes and the read's stamp, for `write_together`
    pending: Optional[Tuple[bytes, Tuple[int, int, int]]] = None
    uses_runtime: bool = False  # the (new) source imports the runtime
    # what the file does once migrated, read off its new source (see `signals`): the report's
    # program summary says what the program does under torchrun, and what it does not
    signals: Tuple[str, ...] = ()
    # a file that starts the program (a shell script, Makefile, README: see `launchers`), not
    # one of its Python modules
    launch: bool = False
    # what the report tells without asking for anything (`path:line: text`): a launch line
    # that stays valid, and how to scale it
    notes: Tuple[str, ...] = ()
    # with `ddp`: the migrated module's effects (`program.effects.ModuleSummary`), so the report
    # can tell which files the program still writes on every rank
    effects: Optional[object] = None
    # what is wrong with the file's suppression comments (stderr, as Ruff's `warning:` lines)
    warnings: Tuple[str, ...] = ()
    digest: str = ""  # hash of the bytes processed (`program.fs.digest`): the lint cache's key
    output: Optional[bytes] = None  # with `Job.to_stdout`: the new source, encoded as the input

    @property
    def open_records(self) -> List[Record]:
        """Findings still needing attention after this run (advice is not among them)."""
        return [r for r in self.records if not r.applied and not r.advice]

    @property
    def advice_records(self) -> List[Record]:
        """Notes: advice that changes nothing about correctness (see `Finding.advice`)."""
        return [r for r in self.records if r.advice and not r.applied]

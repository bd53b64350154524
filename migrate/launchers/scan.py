"""TM801 over a program's launch files: find them, read their commands, and rewrite or report
each command that starts a file of the program.

A command is this rule's business only when its script resolves to a file of the program
(migrated by `ddp`, or linted): tried against the launch file's folder, the folder of the last
`cd` before it, the project root and the working directory, then, for README commands written
from another folder, as the unique program file whose path ends the same way. A script that
exists beside the launch file (or where its `cd` went) but is not the program's is that
command's, and ends the search: a sibling copy's README does not start this program. A launcher whose
script only the shell knows (`$SCRIPT`, options in `$DIST_ARGS`, a launcher kept in a variable)
is reported with the torchrun command to use, never guessed at.

The results are `Outcome`s like a Python file's: TM801 records, a diff, and the new bytes for
the program's all-or-nothing write (`runner.write_together`).
"""

from __future__ import annotations

import ast
import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from torchmigrate.engine.textedits import unified_diff
from torchmigrate.engine import files
from torchmigrate.engine.outcome import Outcome, Record
from torchmigrate.errors import InputError
from torchmigrate.launchers import Settings, convert, kind_of, loops
from torchmigrate.launchers.convert import LAUNCH, Launch
from torchmigrate.launchers.entries import Places, tails
from torchmigrate.launchers.shell import Command, commands
from torchmigrate.program.graph import relpath

CODE = "TM801"
MAX_BYTES = 4 * 1024 * 1024  # a launch file larger than this is not a launch file
_SUPPRESS = "torchmigrate: ignore"
_SKIP_FILE = "torchmigrate: skip-file"


class Program:
    """The Python files a launch command may start, and how to find one from a command.

    `ddp` rewrites only commands that start a file of the program it migrated; `lint` (with
    `any_script`) checks every command whose script is an existing Python file, as a pre-commit
    hook given only `run.sh` must."""

    def __init__(self, paths: Iterable[Path], roots: Iterable[Path] = (), any_script: bool = False) -> None:
        self.files: Dict[str, Path] = {os.path.realpath(p): Path(p) for p in paths}
        self.roots = [Path(r) for r in roots]
        self.any_script = any_script

    def resolve(self, word: str, module: bool, bases: Sequence[Path]) -> Optional[str]:
        """The resolved path of the program file that `word` names, or None."""
        candidates = tails(word, module)
        for tail in candidates:
            for i, base in enumerate(bases):
                real = os.path.realpath(os.path.join(base, tail))
                if real in self.files or self.any_script and real.endswith(".py") and os.path.isfile(real):
                    return real
                if i == 0 and os.path.isfile(real):
                    # beside the launch file (or where its `cd` went) the command finds a script
                    # of its own: another copy or another project (`../orig/README.md`'s
                    # `python train.py` starts orig/train.py), never this program's
                    return None
        parts = [p for p in PurePath(candidates[0]).parts if p not in (".", "")]
        if not parts or ".." in parts or os.path.isabs(candidates[0]):
            return None
        hits = [real for real in self.files if PurePath(real).parts[-len(parts):] == tuple(parts)]
        return hits[0] if len(hits) == 1 else None


@dataclass
class Result:
    """TM801 over one launch file's text."""

    text: str  # the new text (the old one when nothing is rewritten)
    records: List[Record]
    notes: List[str]
    started: List[str]  # the resolved program files that the rewritten commands start


def check(path: Path, text: str, program: Program, settings: Settings) -> Result:
    """TM801 over the text of the launch file `path` (its name says what kind of file it is)."""
    if _SKIP_FILE in text:
        return Result(text, [], [], [])
    scanner = _Scanner(path, text, kind_of(path) or "sh", program, settings)
    edits = scanner.run()
    new = convert.apply(text, edits) if edits and settings.apply else text
    return Result(new, scanner.records, scanner.notes, scanner.started)


def process(path: Path, program: Program, settings: Settings) -> Outcome:
    """TM801 over one launch file. Never raises: a file that cannot be read is an error."""
    outcome = Outcome(str(path), launch=True)
    try:
        data, stamp = _read(path)
    except InputError as exc:
        outcome.error = (exc.line, exc.col, exc.message)
        return outcome
    text = data.decode("utf-8", "surrogateescape")  # every byte comes back as it was
    result = check(path, text, program, settings)
    settings.links[os.path.realpath(path)] = result.started
    outcome.records = result.records
    outcome.notes = tuple(result.notes)
    if result.text != text:
        outcome.changed = True
        if settings.want_diff:
            outcome.diff = unified_diff(text, result.text, str(path))
        if settings.write:
            new_bytes = result.text.encode("utf-8", "surrogateescape")
            if settings.together:
                outcome.pending = (new_bytes, stamp)
            else:
                try:
                    files.atomic_write(path, new_bytes, stamp)
                    outcome.written = True
                except InputError as exc:
                    outcome.error = (1, 0, exc.message)
                    outcome.records, outcome.changed, outcome.diff = [], False, ""
    return outcome


def _read(path: Path) -> Tuple[bytes, Tuple[int, int, int]]:
    """As `files.read`: never blocks on a named pipe that carries a launch file's name."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as handle:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InputError("not a regular file")
            stamp = files._stamp(st)
            data = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise InputError(f"too large for a launch file (over {MAX_BYTES // 2 ** 20} MiB)")
    if b"\x00" in data:
        raise InputError("not a text file (contains NUL bytes)")
    return data, stamp


class _Scanner:
    """The commands of one launch file, in order: edits, records and notes."""

    def __init__(self, path: Path, text: str, kind: str, program: Program, settings: Settings) -> None:
        self.path, self.text, self.kind = path, text, kind
        self.program, self.settings = program, settings
        self.records: List[Record] = []
        self.notes: List[str] = []
        self.started: List[str] = []  # the program files of the lines rewritten
        self.places = Places(path, program.roots)
        self.commands: List[Command] = []

    def run(self) -> List[convert.Edit]:
        out: List[convert.Edit] = []
        self.commands = commands(self.text, self.kind)
        for command in self.commands:
            if self._suppressed(command):
                continue
            self.places.follow(command)
            launch = convert.parse(command, self.kind)
            if launch is None:
                if LAUNCH in command.source():
                    self._report(command.words[0], "runs torch.distributed.launch from a variable or builds it "
                                 f"in one: torchmigrate cannot see which script it starts; use torchrun instead: "
                                 f"`{convert.suggest(command.source())}`")
                continue
            if launch.style == "run":
                continue
            out += self._launch(launch)
        return out

    def _launch(self, launch: Launch) -> List[convert.Edit]:
        script = launch.script_word
        target = None
        if script is not None and not script.opaque:
            target = self.program.resolve(script.value, launch.module, self.places.bases)
        if launch.style == "python":
            return self._one_process(launch, target) if target is not None else []
        where = launch.words[launch.interpreter]
        if target is None:
            new = convert.new_command(launch, self.kind)
            if script is None:
                self._report(where, "keeps a torch.distributed.launch command without its script (in a "
                             "variable, the script given where it is used): torchmigrate cannot tell which script it "
                             f"starts; use `{new}`")
            elif script.opaque:
                self._report(where, f"starts {script.raw} with the deprecated torch.distributed.launch: "
                             f"torchmigrate cannot tell which script that is; use `{new}`")
            return []
        name = self._display(target)
        new = convert.new_command(launch, self.kind)
        if launch.problem:
            self._report(where, f"starts {name} with the deprecated torch.distributed.launch, but "
                         f"{launch.problem}: rewrite it by hand as `{new}`")
            return []
        old_rank = None if launch.option("--use-env") else self._old_local_rank(target)
        if old_rank is not None:
            self._report(where, f"starts {name} with torch.distributed.launch, which passes --local-rank, "
                         f"but {_unfixed_rank(name, old_rank)}, then use `{new}`")
            return []
        self._report(where, f"starts {name} with the deprecated torch.distributed.launch (it passes "
                     f"--local-rank; the migrated program runs under torchrun): `{new}`", fix=True)
        self.started.append(target)
        return convert.edits(launch, self.kind)

    def _one_process(self, launch: Launch, target: str) -> List[convert.Edit]:
        name = self._display(target)
        command = launch.command
        passes_rank = any(w.value.partition("=")[0] in convert.LOCAL_RANK_ARGS for w in launch.args())
        if command.in_loop and (passes_rank or command.background):
            return self._loop(launch, target)
        if passes_rank and command.background:
            self._report(launch.words[launch.interpreter],
                         f"starts the ranks of {name} by hand (background processes): replace them with one "
                         f"torchrun command, `{convert.scale_hint(launch)}` (N: the processes started here)")
            return []
        if self.settings.mode != "ddp":
            return []
        line = self._line_col(launch.words[launch.interpreter])[0]
        under_srun = any(w.value.rsplit("/", 1)[-1] == "srun" for w in launch.words[:launch.interpreter])
        if under_srun:
            text = (f"runs {name} as one rank per SLURM task (the runtime reads SLURM_PROCID, SLURM_LOCALID and "
                    "SLURM_NTASKS): valid; start one task per GPU (--ntasks-per-node=GPUs per node)")
        else:
            text = (f"runs {name} as one process: valid after the migration; to use N GPUs of one node: "
                    f"`{convert.scale_hint(launch)}`")
        self.notes.append(f"{self.path}:{line}: {text}")
        return []

    def _loop(self, launch: Launch, target: str) -> List[convert.Edit]:
        """Ranks started by hand in a loop: one torchrun command when the loop is plain (`loops`)."""
        name = self._display(target)
        where = launch.words[launch.interpreter]
        plan = loops.plan(launch, self.kind, self.commands)
        if isinstance(plan, str):
            self._report(where, f"starts the ranks of {name} by hand (a loop), which torchmigrate cannot rewrite: "
                         f"{plan}; replace the loop with one torchrun command, `{loops.hint(launch)}` "
                         "(N: the processes it starts)")
            return []
        old_rank = self._old_local_rank(target) if plan.local_rank else None
        if old_rank is not None:
            self._report(where, f"starts the ranks of {name} by hand (a loop) with --local_rank, but "
                         f"{_unfixed_rank(name, old_rank)}, then replace the loop with `{plan.command}`")
            return []
        self._report(where, f"starts the ranks of {name} by hand ({plan.count} background processes in a loop): "
                     f"one torchrun command starts the same processes, `{plan.command}`", fix=True)
        self.started.append(target)
        return [(plan.start, plan.end, plan.command)]

    def _report(self, word, message: str, fix: bool = False) -> None:
        line, col = self._line_col(word)
        applied = fix and self.settings.apply
        self.records.append(Record(str(self.path), line, col, CODE, message, "safe" if fix else "manual", applied))

    def _line_col(self, word) -> Tuple[int, int]:
        line_start = self.text.rfind("\n", 0, word.start) + 1
        return self.text.count("\n", 0, word.start) + 1, word.start - line_start

    def _suppressed(self, command: Command) -> bool:
        """`# torchmigrate: ignore` or `ignore[TM801]` on one of the command's lines."""
        start = self.text.rfind("\n", 0, command.start) + 1
        end = self.text.find("\n", command.end)
        span = self.text[start:end if end >= 0 else len(self.text)]
        at = span.find(_SUPPRESS)
        if at < 0:
            return False
        rest = span[at + len(_SUPPRESS):]
        return not rest.startswith("[") or CODE in rest.split("]", 1)[0]

    def _display(self, target: str) -> str:
        known = self.program.files.get(target)
        return str(known) if known is not None else relpath(Path(target))

    def _old_local_rank(self, target: str) -> Optional[int]:
        """The line where the program file parses --local_rank the old launcher's way, unless
        TM102 rewrote it in this run."""
        python = self.settings.python.get(target)
        if python is not None and any(r.code == "TM102" and r.applied for r in python.records):
            return None
        try:
            source = Path(target).read_bytes()
        except OSError:
            return None
        return old_local_rank(source)


def old_local_rank(source: bytes) -> Optional[int]:
    """The line of an argparse `--local_rank`/`--local-rank` option that torchrun breaks:
    required (torchrun passes no such argument), or with a default that does not read the
    LOCAL_RANK environment variable (every process keeps it). None when there is none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        flags = {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        if not flags & set(convert.LOCAL_RANK_ARGS):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        action = keywords.get("action")
        if action is not None and not (isinstance(action, ast.Constant) and action.value == "store"):
            continue
        required = keywords.get("required")
        default = keywords.get("default")
        if isinstance(required, ast.Constant) and required.value:
            return node.lineno
        if default is None or "LOCAL_RANK" not in ast.dump(default):
            return node.lineno
    return None


def link_groups(groups: Sequence[Sequence[str]], links: Dict[str, List[str]]) -> List[List[str]]:
    """The program's write groups with each launch file joined to the files it starts, so a
    launch file is written together with the program it launches, or not at all."""
    parent: Dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in groups:
        for member in group[1:]:
            parent[root(os.path.realpath(member))] = root(os.path.realpath(group[0]))
    for launch_file, started in links.items():
        for target in started:
            parent[root(target)] = root(launch_file)
    members: Dict[str, List[str]] = {}
    for x in list(parent):
        members.setdefault(root(x), []).append(x)
    return [m for m in members.values() if len(m) > 1]


def _unfixed_rank(name: str, line: int) -> str:
    """Why a script whose `--local_rank` option ignores `LOCAL_RANK` must be fixed before its
    launch command becomes torchrun's, and how."""
    return (f"{name}:{line} parses --local_rank without reading LOCAL_RANK: under torchrun every process would "
            f"keep the default. Fix it first (TM102: `torchmigrate lint --select TM102 --fix {name}`)")

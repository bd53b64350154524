"""From a command's paths and options to what it processes: the files (given, found in folders,
followed through imports) or the source on stdin, and the settings of each.

`-` as the only path reads the source from stdin; `--stdin-filename NAME` names it, for the
settings that govern it, for `--force-exclude` and in every message (without it: `-`). A
source from stdin is processed alone, as with `--no-follow`: its imports are not followed.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

from torchmigrate.cli.config import ConfigError, Configs
from torchmigrate.cli.discover import Discovery
from torchmigrate.cli.settings import FileSettings, Selection, Settings
from torchmigrate.engine.files import Decoded, decode
from torchmigrate.engine.runner import Outcome, path_error
from torchmigrate.errors import InputError

if TYPE_CHECKING:
    from torchmigrate.program.build import Program

STDIN = "-"


@dataclass
class Inputs:
    files: List[Path] = field(default_factory=list)
    errors: List[Outcome] = field(default_factory=list)  # paths that could not be processed at all
    per_file: Dict[str, FileSettings] = field(default_factory=dict)  # see `Job.per_file`
    codes: Tuple[str, ...] = ()  # every rule code enabled for some file
    program: Optional["Program"] = None  # files only (stdin is processed alone)
    left_out: Callable[..., bool] = lambda path, is_dir=False: False  # what discovery leaves out
    reads_stdin: bool = False  # `-`: the source comes from stdin, the new source goes to stdout
    stdin: Optional[Decoded] = None  # that source (None if it could not be decoded: see `errors`)
    stdin_name: str = STDIN
    excluded: int = 0  # paths given by name that --force-exclude left out (stdin included)
    batch_policy: str = "global"  # see `Options.batch_policy`


@dataclass(frozen=True)
class Request:
    """The options every command shares about what to read and how to configure it."""

    command: str
    paths: Tuple[str, ...]
    selection: Selection = Selection()
    amp: Optional[str] = None
    shard_eval: Optional[bool] = None  # --shard-eval / --no-shard-eval (None: the settings decide)
    batch_policy: Optional[str] = None
    config: Optional[str] = None
    stdin_filename: Optional[str] = None
    force_exclude: bool = False
    respect_gitignore: bool = True
    follow: bool = True


def gather(request: Request, cache=None) -> Inputs:
    """Raises ConfigError (a usage error: exit 2) for bad settings, selectors or paths."""
    paths = request.paths or ((STDIN,) if request.stdin_filename else ())
    if not paths:
        raise ConfigError("no paths given (use `-` to read the source from stdin)")
    if STDIN in paths and len(paths) > 1:
        raise ConfigError("`-` (stdin) cannot be combined with other paths")
    if request.stdin_filename and paths != (STDIN,):
        raise ConfigError("--stdin-filename names the source read from stdin: give `-` as the only path")
    configs = Configs(request.config)
    settings = Settings(request.command, request.selection, request.amp, configs, request.shard_eval,
                        request.batch_policy)
    discovery = Discovery(configs, request.respect_gitignore, request.force_exclude)
    inputs = Inputs()
    if paths == (STDIN,):
        _read_stdin(inputs, request.stdin_filename, discovery)
        name = inputs.stdin_name
        inputs.per_file[name] = settings.for_file(Path(request.stdin_filename or "stdin.py"))
    else:
        _discover(inputs, paths, discovery, request, cache)
        for file in inputs.files:
            inputs.per_file[str(file)] = settings.for_file(file)
    inputs.codes = tuple(sorted({c for s in inputs.per_file.values() for c in s.codes})) \
        or settings.for_file(Path.cwd() / "stdin.py").codes
    first = inputs.files[0] if inputs.files else Path(request.stdin_filename or Path.cwd() / "stdin.py")
    inputs.batch_policy = settings.batch_policy_for(first)
    return inputs


def _read_stdin(inputs: Inputs, name: Optional[str], discovery: Discovery) -> None:
    inputs.reads_stdin = True
    inputs.stdin_name = name or STDIN
    if name and discovery.forced_out(Path(name), is_dir=False):
        inputs.excluded = 1
    data = sys.stdin.buffer.read()
    try:
        inputs.stdin = decode(data)
    except InputError as exc:
        inputs.errors.append(Outcome(inputs.stdin_name, error=(exc.line, exc.col, exc.message)))


def _discover(inputs: Inputs, paths: Sequence[str], discovery: Discovery, request: Request, cache=None) -> None:
    """The files and their program; with the lint cache (`cache`), a program build reused when
    nothing it read or looked at changed. Launch files named (`run.sh`) are TM801's."""
    from torchmigrate import launchers
    from torchmigrate.program.fs import PLAIN

    follow = request.follow
    inputs.left_out = discovery.left_out
    found, bad = discovery.discover(paths)
    found, launch_files = launchers.split(found)
    named = [Path(p) for p in paths if not _is_dir(p)]
    if request.command != "lint" and launch_files:  # `ddp run.sh`: the scripts it starts are the entries
        scripts = list({os.path.realpath(s): s for s in _launched(launch_files)}.values())
        seen = {os.path.realpath(f) for f in found}
        scripts = [s for s in scripts if os.path.realpath(s) not in seen]
        found, named = found + scripts, named + scripts
    inputs.excluded = discovery.excluded_count
    inputs.errors = [path_error(path, why) for path, why in bad]
    if not found and not bad and not inputs.excluded:
        inputs.errors.append(path_error(", ".join(paths), "no Python files found"))
    def build_program(fs=None, parts=None, scans=None):
        from torchmigrate.program.build import build  # only when the cache cannot answer

        return build(found, named, follow, exclude=discovery.left_out, fs=fs or PLAIN, parts=parts, scans=scans)

    # what decides which files the build leaves out, for the cached build's key
    key = [repr(request.config), str(request.force_exclude), str(request.respect_gitignore)]
    program = cache.program(found, named, follow, key, build_program) if cache is not None else build_program()
    inputs.program = program
    inputs.files = program.files


def _launched(launch_files: Sequence[Path]) -> List[Path]:
    """The scripts that the launch files given by name start (see `launchers.entries`). Raises
    ConfigError when one cannot be found: a program migrated without its entry would be half
    done, so nothing is."""
    from torchmigrate.launchers.entries import started

    scripts: List[Path] = []
    problems: List[str] = []
    for path in launch_files:
        found = started(path)
        problems += found.problems
        if not found.scripts and not found.problems:
            unknown = f"; only the shell knows {', '.join(found.unknown)}" if found.unknown else ""
            problems.append(f"{path}: starts no Python script of its project that torchmigrate can find{unknown}")
        scripts += found.scripts
    if problems:
        raise ConfigError("cannot migrate the program that a launch file starts (nothing was written):\n  "
                          + "\n  ".join(problems) + "\nname the entry script instead (`torchmigrate ddp train.py`)")
    return scripts


def _is_dir(path: str) -> bool:
    try:
        return os.path.isdir(path)
    except (OSError, ValueError):  # a name the system refuses: reported by discovery
        return False

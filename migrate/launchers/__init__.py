"""Launch commands (TM801): the shell scripts, Makefiles, SLURM batch files and README code
blocks that start a program, brought to torchrun along with the program.

`shell` reads the commands of such a file, `convert` turns a `torch.distributed.launch` command
into its torchrun form, `scan` decides per command (rewrite, report, or a note) and makes the
file's `Outcome`. The CLI calls `run` after the Python files are processed and adds its
outcomes to theirs, so diffs, reports, the lint formats and the program's all-or-nothing write
cover launch files too. This module itself is light (finding the files); the rest is imported
only when there are launch files to read, and never imports LibCST.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from torchmigrate.program.fs import SKIP_DIRS, is_virtualenv
from torchmigrate.engine.outcome import Outcome

CODE = "TM801"
MAKEFILE_NAMES = ("Makefile", "makefile", "GNUmakefile")
SUFFIXES = {".sh": "sh", ".bash": "sh", ".sbatch": "sh", ".slurm": "sh", ".mk": "make",
            ".md": "markdown", ".markdown": "markdown", ".rst": "rst"}


def kind_of(path: PurePath) -> Optional[str]:
    """`sh`, `make`, `markdown` or `rst` for a file that may hold launch commands, else None."""
    if path.name in MAKEFILE_NAMES:
        return "make"
    return SUFFIXES.get(path.suffix.lower())


def is_launch_file(path: PurePath) -> bool:
    return kind_of(path) is not None


def split(found: Sequence[Path]) -> Tuple[List[Path], List[Path]]:
    """Files named on the command line: (Python files, launch files)."""
    python = [f for f in found if not is_launch_file(f)]
    return python, [f for f in found if is_launch_file(f)]


def files_for(paths: Sequence[str], codes: Sequence[str], exclude: Callable[[Path], bool],
              around_scripts: bool) -> List[Path]:
    """The launch files to check when TM801 is selected: those named, those under the folders
    named and, with `around_scripts` (a migration of named scripts), those in the project of
    each script named (`ddp train.py` finds `scripts/train.sh` beside it)."""
    if CODE not in codes:
        return []
    found: Dict[str, Path] = {}
    for arg in paths:
        path = Path(arg)
        try:
            if path.is_dir():
                for f in _walk(path, exclude):
                    found.setdefault(os.path.realpath(f), f)
            elif is_launch_file(path) and path.is_file():
                found.setdefault(os.path.realpath(path), path)
        except OSError:
            continue  # discovery reports the path
    scripts = [Path(p) for p in paths if around_scripts and p.endswith(".py") and os.path.isfile(p)]
    if scripts:
        from torchmigrate.program.graph import project_root, relpath

        for script in scripts:
            try:
                root = project_root(script)
            except OSError:
                continue
            for f in _walk(root, exclude):
                found.setdefault(os.path.realpath(f), f if script.is_absolute() else Path(relpath(f)))
    return list(found.values())


def _walk(root: Path, exclude: Callable[[Path], bool]) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if d not in SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")
            and not is_virtualenv(base / d) and not exclude(base / d))
        for name in sorted(filenames):
            if name in MAKEFILE_NAMES or os.path.splitext(name)[1].lower() in SUFFIXES:
                path = base / name
                if not exclude(path):
                    yield path


@dataclass
class Settings:
    """How `run` treats the commands of the launch files."""

    mode: str  # "ddp" (rewrite as part of the migration) or "lint"
    apply: bool  # rewrite the lines (ddp, lint --fix)
    write: bool  # and write the files (not --dry-run/--check)
    want_diff: bool = False
    together: bool = False  # leave the bytes in `pending` for the program's write
    # resolved path -> the outcome of that Python file in this run (was TM102 applied?)
    python: Dict[str, Outcome] = field(default_factory=dict)
    # filled in: resolved launch file -> the resolved program files its rewritten lines start
    links: Dict[str, List[str]] = field(default_factory=dict)


def run(launch_files: Sequence[Path], program_files: Sequence[Path], paths: Sequence[str],
        settings: Settings, python: Sequence[Outcome] = ()) -> List[Outcome]:
    """TM801 over each launch file, for the program made of `program_files`."""
    if not launch_files:
        return []
    from torchmigrate.launchers.scan import Program, process

    settings.python = {os.path.realpath(o.path): o for o in python if not o.launch}
    roots = [Path(p) for p in paths if os.path.isdir(p)]
    program = Program(program_files, roots, any_script=settings.mode == "lint")
    return [process(Path(p), program, settings) for p in launch_files]


def link_groups(groups: Sequence[Sequence[str]], settings: Optional[Settings]) -> List[List[str]]:
    """The program's write groups, each launch file joined to the program files it starts."""
    if settings is None or not settings.links:
        return [list(g) for g in groups]
    from torchmigrate.launchers.scan import link_groups as link

    return link(groups, settings.links)

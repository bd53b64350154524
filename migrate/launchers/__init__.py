"""Launch commands (TM801): the shell scripts, Makefiles, SLURM batch files and README code
blocks that start a program, brought to torchrun along with the program.

`shell` reads the commands of such a file, `convert` turns a `torch.distributed.launch` command
into its torchrun form, `scan` decides per command (rewrite, report, or a note) and makes the
file's `Outcome`. This package never imports LibCST: the CLI calls it after the Python files
are processed and adds its outcomes to theirs, so diffs, reports, the lint formats and the
program's all-or-nothing write cover launch files too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

from torchmigrate.launchers.scan import CODE, Program, Settings, find, is_launch_file, link_groups, process
from torchmigrate.outcome import Outcome

__all__ = ["CODE", "Settings", "split", "files_for", "run", "link_groups"]


def split(found: Sequence[Path]) -> Tuple[List[Path], List[Path]]:
    """Files named on the command line: (Python files, launch files)."""
    python = [f for f in found if not is_launch_file(f)]
    return python, [f for f in found if is_launch_file(f)]


def files_for(paths: Sequence[str], codes: Sequence[str], exclude: Callable[[Path], bool],
              around_scripts: bool) -> List[Path]:
    """The launch files to check when TM801 is selected: named, in the folders named and, with
    `around_scripts` (a migration of named scripts), in each named script's project."""
    if CODE not in codes:
        return []
    scripts = [Path(p) for p in paths if around_scripts and p.endswith(".py") and os.path.isfile(p)]
    return find(paths, scripts, exclude)


def run(launch_files: Sequence[Path], program_files: Sequence[Path], paths: Sequence[str],
        settings: Settings, python: Sequence[Outcome] = ()) -> List[Outcome]:
    """TM801 over each launch file, for the program made of `program_files`."""
    settings.python = {os.path.realpath(o.path): o for o in python if not o.launch}
    roots = [Path(p) for p in paths if os.path.isdir(p)]
    program = Program(program_files, roots, any_script=settings.mode == "lint")
    return [process(Path(p), program, settings) for p in launch_files]


"""The Python scripts a launch file starts: `torchmigrate ddp run.sh` migrates them with it.

A launch file is usually run from the project root or from its own folder (`bash
scripts/train.sh`, `cd scripts && ./train.sh`), after any `cd` in it, so a script word is
looked for where the shell could find it: the folder of the last `cd`, the file's folder, its
project root and the working directory (`Places`, shared with the TM801 scan). Only scripts
inside the project are taken: torchmigrate migrates the user's code, never what a command
starts from elsewhere. A module (`-m pkg.train`) not found in the project is someone else's
(`-m pip`, `-m http.server`) and is passed over; a script path that is missing or outside the
project makes the launch file unusable as the program's entry (`problems`), as does a file
that starts no script torchmigrate can find (a script in `$SCRIPT`, set elsewhere).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional

from torchmigrate.launchers import convert, kind_of
from torchmigrate.launchers.shell import Command, commands
from torchmigrate.program.graph import project_root, relpath


class Places:
    """The folders a launch file's commands resolve a script against, in the shell's order."""

    def __init__(self, path: Path, roots: Iterable[Path] = ()) -> None:
        self.path = path
        try:
            self.root = project_root(path)
        except OSError:
            self.root = path.parent
        self.fixed = list(dict.fromkeys([path.parent, self.root, Path.cwd(), *roots]))
        self.cwd: Optional[Path] = None  # after a `cd DIR` in the file

    @property
    def bases(self) -> List[Path]:
        return [self.cwd, *self.fixed] if self.cwd else self.fixed

    def follow(self, command: Command) -> None:
        """Track `cd DIR`/`pushd DIR` (relative to the file's folder); `cd $X`, `cd -`: unknown."""
        words = command.words
        if words[0].value not in ("cd", "pushd"):
            return
        if len(words) < 2 or words[1].opaque or words[1].value == "-":
            self.cwd = None
            return
        self.cwd = Path(os.path.normpath((self.cwd or self.path.parent) / words[1].value))


@dataclass
class Started:
    """What one launch file starts."""

    scripts: List[Path] = field(default_factory=list)  # as the user would name them (relative if the file is)
    problems: List[str] = field(default_factory=list)  # `path:line: why`
    unknown: List[str] = field(default_factory=list)  # scripts only the shell knows (`$SCRIPT`)


def started(path: Path) -> Started:
    """The project's Python scripts that the commands of the launch file `path` start."""
    out = Started()
    try:
        text = path.read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        out.problems.append(f"{path}: cannot read: {exc.strerror or exc}")
        return out
    kind = kind_of(path) or "sh"
    places = Places(path)
    root = os.path.realpath(places.root)
    seen = set()
    for command in commands(text, kind):
        places.follow(command)
        launch = convert.parse(command, kind)
        word = launch.script_word if launch is not None else None
        if word is None:
            continue
        where = f"{path}:{command.line}"
        if word.opaque:
            out.unknown.append(f"{word.raw} ({where})")
            continue
        found = _find(word.value, launch.module, places.bases)
        if found is None:
            if not launch.module and word.value.endswith(".py"):
                out.problems.append(f"{where}: starts {word.value}, which is not there")
            continue
        if not found.startswith(root + os.sep):
            out.problems.append(f"{where}: starts {found}, outside the project ({places.root}): torchmigrate "
                                "migrates only the project's own files")
        elif found not in seen:
            seen.add(found)
            out.scripts.append(Path(found) if path.is_absolute() else Path(relpath(Path(found))))
    return out


def tails(word: str, module: bool) -> List[str]:
    """The relative paths a script word may name: `pkg.train` is `pkg/train.py` or
    `pkg/train/__main__.py`."""
    rel = word.replace(".", "/") + ".py" if module else word
    return [rel, rel[:-3] + "/__main__.py"] if module else [rel]


def _find(word: str, module: bool, bases: List[Path]) -> Optional[str]:
    if not module and not word.endswith(".py"):
        return None
    for tail in tails(word, module):
        for base in bases:
            real = os.path.realpath(os.path.join(base, tail))
            if os.path.isfile(real):
                return real
    return None

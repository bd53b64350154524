"""Which files a command works on: the paths given by name, and `*.py` under the folders given.

A folder's walk skips VCS, cache, build and virtualenv folders, what the `exclude` patterns of
the settings governing each folder leave out (see `config.py`), and, unless
`--no-respect-gitignore`, what ignore files leave out (`ignore.py`). A path given by name is
always taken, whatever its suffix, unless `--force-exclude` applies the exclusions to it too
(for pre-commit, which passes every staged file by name). What is not a regular file (a named
pipe, a device, a link to one) is reported and skipped: reading it could block forever or never
end. A path the system refuses to look at (too long, not permitted) is reported for that path
alone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

from torchmigrate.cli.config import Configs, absolute
from torchmigrate.cli.ignore import IgnoreFiles, Patterns
from torchmigrate.program.fs import SKIP_DIRS, is_virtualenv

class Discovery:
    """Finds the files to process and answers whether a path is left out."""

    def __init__(self, configs: Configs, respect_gitignore: bool = True, force_exclude: bool = False) -> None:
        self.configs = configs
        self.respect_gitignore = respect_gitignore
        self.force_exclude = force_exclude
        self.ignore_files = IgnoreFiles()
        self.excluded_count = 0  # paths given by name that --force-exclude left out

    def excluded(self, path: Path, is_dir: bool = False) -> bool:
        """Left out by the `exclude` patterns of the settings governing `path`'s folder."""
        config = self.configs.for_file(path)
        patterns = Patterns.of(config.root, config.exclude)
        return patterns is not None and patterns.match(absolute(path), is_dir)

    def left_out(self, path: Path, is_dir: bool = False) -> bool:
        """Left out of a folder's walk, or of the modules followed through imports."""
        path = absolute(path)
        return self.excluded(path, is_dir) or (self.respect_gitignore and self.ignore_files.ignored(path, is_dir))

    def forced_out(self, path: Path, is_dir: bool) -> bool:
        """With --force-exclude, whether a path given by name is left out: by the `exclude`
        patterns, or because it lies in a folder a walk always skips (`build/`, `venv/`, ...)."""
        if not self.force_exclude:
            return False
        path = absolute(path)
        root = self.configs.for_folder(path.parent).root or Path.cwd()
        try:
            folders = path.relative_to(root).parts[: None if is_dir else -1]
        except ValueError:
            folders = ()
        return self.excluded(path, is_dir) or any(part in SKIP_DIRS for part in folders)

    def discover(self, paths: Iterable[str]) -> Tuple[List[Path], List[Tuple[str, str]]]:
        """Python files under `paths` (in order, deduplicated) and (path, error) for bad arguments."""
        found: List[Path] = []
        errors: List[Tuple[str, str]] = []
        seen = set()

        def take(file: Path, arg: str) -> None:
            why = _not_regular(file)
            if why:
                errors.append((arg, why))
                return
            key = os.path.normcase(os.path.abspath(file))
            if key not in seen:
                seen.add(key)
                found.append(file)

        for arg in paths:
            path = Path(arg)
            try:
                is_dir, exists, is_link = path.is_dir(), path.exists(), path.is_symlink()
            except (OSError, ValueError) as exc:
                errors.append((arg, f"cannot read: {getattr(exc, 'strerror', None) or exc}"))
                continue
            if exists and self.forced_out(path, is_dir):
                self.excluded_count += 1
            elif is_dir:
                for file in self._walk(path):
                    take(file, str(file))
            elif exists:
                take(path, arg)
            elif is_link:
                errors.append((arg, "broken symbolic link"))
            else:
                errors.append((arg, "no such file or directory"))
        return found, errors

    def _walk(self, root: Path) -> Iterator[Path]:
        for dirpath, dirnames, filenames in os.walk(root):
            base = Path(dirpath)
            dirnames[:] = sorted(
                d for d in dirnames
                if d not in SKIP_DIRS and not d.endswith(".egg-info")
                and not is_virtualenv(base / d) and not self.left_out(base / d, is_dir=True)
            )
            for name in sorted(filenames):
                if name.endswith(".py"):
                    file = base / name
                    if not self.left_out(file):
                        yield file


_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(path: Path) -> Optional[str]:
    """Why `path` (followed through symlinks) is skipped, or None for a regular file. A path
    that cannot be looked at is taken: its read reports why."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return f"skipped: {kind}, not a regular file"

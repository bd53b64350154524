"""The file-system questions a program build asks (`graph`, `build`), in one place.

A build's result depends on the files it reads and on what it learns about others: which
module files exist, where symbolic links lead, which folder holds a `pyproject.toml`. Asking
through a `FileSystem` lets the lint cache record every answer (`Recorder`) and later check, by
asking again (`unchanged`), that reusing the recorded build is the same as building again,
without parsing anything. Any new answer (a module file that appeared, an edited file, a link
that moved) means a new build.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Tuple, Union


try:  # hashlib's blake2b itself, without loading OpenSSL for the other hashes (3 ms a run)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - a Python built without it
    from hashlib import blake2b


# folders no walk enters (version control, caches, builds, virtualenvs by their usual names)
SKIP_DIRS = {
    ".git", ".hg", ".svn", "__pycache__", "build", "dist", ".venv", "venv", "env", ".env",
    ".tox", ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache", "site-packages",
    "node_modules", ".eggs", ".torchmigrate_cache",
}


def is_virtualenv(path: Path) -> bool:
    """A virtualenv's folder (it has `pyvenv.cfg`): installed code, never walked."""
    return (path / "pyvenv.cfg").exists()


def digest(data: bytes) -> str:
    """The content hash the cache keys on (BLAKE2b, 128 bits: fast, no practical collision)."""
    return blake2b(data, digest_size=16).hexdigest()


class FileSystem:
    """The plain file system."""

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def exists(self, path: Path) -> bool:
        return path.exists()

    def resolve(self, path: Path) -> Path:
        return path.resolve()

    def realpath(self, path: Union[str, Path]) -> str:
        return os.path.realpath(path)

    def read(self, path: Path) -> Optional[bytes]:
        try:
            return path.read_bytes()
        except OSError:
            return None

    def listing(self, folder: Path) -> str:
        """The entries of `folder`, sorted, one a line, folders ending in `/` (empty if it cannot
        be listed): what a walk of the project sees there."""
        return list_folder(folder)


# what a walk of the project reads (see `project`): modules, launch files (shell scripts, SLURM
# files, Makefiles, documents with shell blocks), configuration and packaging files
WALKED_SUFFIXES = (".py", ".sh", ".bash", ".sbatch", ".slurm", ".mk", ".md", ".markdown", ".rst",
                   ".json", ".yaml", ".yml", ".toml", ".cfg")
WALKED_NAMES = {"Makefile", "makefile", "GNUmakefile", "pyvenv.cfg"}
# a folder tagged as a cache (https://bford.info/cachedir/), such as the lint cache: never walked
CACHE_TAG = "CACHEDIR.TAG"


def list_folder(folder: Union[str, Path]) -> str:
    """What a walk of the project sees in `folder`: its subfolders (less version control,
    caches, builds and folders tagged as caches) and the files it may read, so that outputs a
    run writes (checkpoints, logs, the lint cache itself) do not change the answer."""
    names = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                name = entry.name
                if name.startswith(".") or name in SKIP_DIRS:
                    continue
                if entry.is_dir():
                    if not name.endswith(".egg-info") and not os.path.exists(os.path.join(entry.path, CACHE_TAG)):
                        names.append(name + "/")
                elif name in WALKED_NAMES or name.lower().endswith(WALKED_SUFFIXES):
                    names.append(name)
    except OSError:
        return ""
    return "\n".join(sorted(names))


PLAIN = FileSystem()


class Realpaths:
    """`os.path.realpath` for many files of a few folders: each folder is resolved once, each
    file costs one `lstat` (a file that is a symbolic link is resolved in full). The folders'
    answers are kept for the life of the object: one run."""

    def __init__(self) -> None:
        self._folders: Dict[str, str] = {}

    def __call__(self, path: Union[str, Path]) -> str:
        path = os.path.abspath(path)
        folder, name = os.path.split(path)
        real = self._folders.get(folder)
        if real is None:
            real = self._folders[folder] = os.path.realpath(folder)
        full = os.path.join(real, name)
        try:
            if stat.S_ISLNK(os.lstat(full).st_mode):
                return os.path.realpath(full)
        except OSError:
            pass
        return full
Answer = Union[bool, str, None]
_ERROR = "!error"  # the question raised OSError (a name too long, a loop of links)


class Recorder(FileSystem):
    """A FileSystem that remembers every answer it gave, and the hash of every file it read."""

    def __init__(self) -> None:
        self.answers: Dict[Tuple[str, str], Answer] = {}
        self.reads: Dict[str, Optional[str]] = {}

    def _ask(self, kind: str, path, ask) -> Answer:
        try:
            answer = ask()
        except OSError:
            self.answers[(kind, str(path))] = _ERROR
            raise
        self.answers[(kind, str(path))] = answer if isinstance(answer, (bool, type(None))) else str(answer)
        return answer

    def is_file(self, path: Path) -> bool:
        return self._ask("is_file", path, lambda: path.is_file())

    def exists(self, path: Path) -> bool:
        return self._ask("exists", path, lambda: path.exists())

    def resolve(self, path: Path) -> Path:
        return Path(self._ask("resolve", path, lambda: path.resolve()))

    def realpath(self, path: Union[str, Path]) -> str:
        return self._ask("realpath", path, lambda: os.path.realpath(path))

    def listing(self, folder: Path) -> str:
        text = list_folder(folder)
        self.answers[("listing", str(folder))] = digest(text.encode("utf-8", "surrogateescape"))  # kept short
        return text

    def read(self, path: Path) -> Optional[bytes]:
        data = super().read(path)
        self.reads[str(path)] = None if data is None else digest(data)
        return data


def unchanged(answers: Iterable[Tuple[str, str, Answer]], reads: Dict[str, Optional[str]],
              content: Callable[[str], Optional[str]], realpath: Optional[Callable[[str], str]] = None) -> bool:
    """Would a build ask the same questions and get the same answers now? `content(path)` is
    the hash of a file's bytes now (None if it cannot be read); `realpath` may remember the
    answers to `os.path.realpath` of this run."""
    realpath = realpath or Realpaths()
    for kind, path, answer in answers:
        try:
            if kind == "is_file":
                now: Answer = os.path.isfile(path)
            elif kind == "exists":
                now = os.path.exists(path)
            elif kind in ("resolve", "realpath"):  # Path.resolve() is os.path.realpath()
                now = realpath(path)
            elif kind == "listing":
                now = digest(list_folder(path).encode("utf-8", "surrogateescape"))
            else:
                return False
        except OSError:
            now = _ERROR
        if now != answer:
            return False
    return all(content(path) == expected for path, expected in reads.items())

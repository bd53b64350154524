"""Which paths discovery leaves out: `exclude` patterns and ignore files (`.gitignore`).

Both use gitignore's pattern language through the maintained `pathspec` library (imported only
when a pattern or an ignore file exists: a pre-commit run over named files never pays for it).
Ignore files are read as git and Ruff read them: `.gitignore` files count inside a git
repository only (up to its root), `.ignore` files anywhere, and the repository's
`.git/info/exclude` too; each file's patterns are relative to its folder, a deeper file
overrides a shallower one and `.ignore` overrides `.gitignore` in the same folder. The global
git excludes file (`core.excludesFile`) is not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


def _spec(lines: Iterable[str]):
    from pathspec import GitIgnoreSpec

    return GitIgnoreSpec.from_lines(lines)


def _relative(path: Path, folder: Path, is_dir: bool) -> Optional[str]:
    """`path` relative to `folder` as gitignore matches it (a folder ends with `/`); None
    when `path` is not inside `folder`."""
    try:
        rel = path.relative_to(folder).as_posix()
    except ValueError:
        return None
    if rel == ".":
        return None
    return rel + "/" if is_dir else rel


class Patterns:
    """Compiled `exclude` patterns, relative to a folder; one compilation per settings file."""

    _cache: Dict[Tuple[Path, Tuple[str, ...]], "Patterns"] = {}

    def __init__(self, root: Path, patterns: Sequence[str]) -> None:
        self.root = root
        self.spec = _spec(patterns) if patterns else None

    @classmethod
    def of(cls, root: Optional[Path], patterns: Sequence[str]) -> Optional["Patterns"]:
        if root is None or not patterns:
            return None
        key = (root, tuple(patterns))
        found = cls._cache.get(key)
        if found is None:
            found = cls._cache[key] = cls(root, patterns)
        return found

    def match(self, path: Path, is_dir: bool) -> bool:
        rel = _relative(path, self.root, is_dir)
        return rel is not None and self.spec is not None and bool(self.spec.match_file(rel))


IGNORE_FILE = ".ignore"
GITIGNORE = ".gitignore"


class IgnoreFiles:
    """Whether an (absolute) path is ignored by the ignore files above it."""

    def __init__(self) -> None:
        self._specs: Dict[Path, object] = {}  # ignore file -> spec, or None when absent or empty
        self._repos: Dict[Path, Optional[Path]] = {}  # folder -> its repository's root
        self._chains: Dict[Path, List[Tuple[Path, object]]] = {}  # folder -> see `_chain`

    def ignored(self, path: Path, is_dir: bool) -> bool:
        for folder, spec in self._chain(path.parent):
            rel = _relative(path, folder, is_dir)
            verdict = None if rel is None else spec.check_file(rel).include  # type: ignore[attr-defined]
            if verdict is not None:  # True: ignored; False: re-included by a `!pattern`
                return verdict
        return False

    def _chain(self, parent: Path) -> List[Tuple[Path, object]]:
        """(folder, spec) of the ignore files that govern the paths in `parent`, the one that
        decides first: nearest folder first, `.ignore` before `.gitignore`, the repository's
        `.git/info/exclude` last. Worked out once per folder: a walk asks for every file, and
        most folders have none."""
        found = self._chains.get(parent)
        if found is None:
            found = []
            repo = self._repo(parent)
            for folder in (parent, *parent.parents):
                names = (IGNORE_FILE, GITIGNORE) if repo is not None and _within(folder, repo) else (IGNORE_FILE,)
                found += [(folder, spec) for spec in (self._spec(folder / name) for name in names) if spec is not None]
            if repo is not None:
                spec = self._spec(repo / ".git" / "info" / "exclude")
                found += [(repo, spec)] if spec is not None else []
            self._chains[parent] = found
        return found

    def _spec(self, ignore_file: Path):
        spec = self._specs.get(ignore_file, _UNREAD)
        if spec is _UNREAD:
            spec = self._specs[ignore_file] = _read(ignore_file)
        return spec

    def _repo(self, folder: Path) -> Optional[Path]:
        """The root of the git repository holding `folder` (a folder with a `.git` entry)."""
        if folder in self._repos:
            return self._repos[folder]
        found = folder if (folder / ".git").exists() else (
            None if folder.parent == folder else self._repo(folder.parent))
        self._repos[folder] = found
        return found


_UNREAD = object()


def _read(ignore_file: Path):
    try:
        lines = ignore_file.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:  # absent (the usual case), a folder, unreadable: no patterns
        return None
    if not any(line.strip() and not line.startswith("#") for line in lines):
        return None
    return _spec(lines)


def _within(folder: Path, root: Path) -> bool:
    return folder == root or root in folder.parents

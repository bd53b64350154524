"""Settings files, found per path as Ruff finds its own.

Each file uses the closest settings file in the folders above it: `torchmigrate.toml` (its
top-level keys) or a `pyproject.toml` with a `[tool.torchmigrate]` table (one without the table
does not count, so a sub-package's packaging file does not hide the project's settings); in
one folder `torchmigrate.toml` wins. Settings are not merged across folders: the closest file
is the whole configuration. `--config PATH` forces one file for every path; its `exclude`
patterns are then relative to the working directory (Ruff does the same).

Keys: `select`, `extend-select`, `ignore` (rule codes, prefixes or names), `exclude`,
`extend-exclude` (gitignore-style patterns relative to the settings file's folder), `amp` and
`shard-eval` (also spelled `shard_eval`: shard evaluation loaders even where the reduction of
what is computed from them is not proven, see `--shard-eval`) and
`batch-policy` (`ddp`: "global" or "per-gpu"; the settings of the program's first file decide).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

from torchmigrate.options import BATCH_POLICIES

KEYS = {"select", "extend-select", "ignore", "exclude", "extend-exclude", "amp", "shard-eval", "shard_eval",
        "batch-policy"}
_BOOLEANS = ("shard-eval", "shard_eval")
AMP_VALUES = ("auto", "bf16", "fp16", "off")
# In one folder, the first of these that holds torchmigrate settings is used.
NAMES = ("torchmigrate.toml", "pyproject.toml")


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Config:
    select: Tuple[str, ...] = ()
    extend_select: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()
    exclude: Tuple[str, ...] = ()  # gitignore-style patterns, relative to `root`
    amp: Optional[str] = None
    shard_eval: Optional[bool] = None  # None: not set here
    batch_policy: Optional[str] = None  # `ddp`: "global" or "per-gpu" (see `Options.batch_policy`)
    path: Optional[Path] = None  # the settings file; None: the defaults
    root: Optional[Path] = None  # the folder `exclude` is relative to (None: nothing to exclude)

    @property
    def where(self) -> str:
        """How error messages name these settings."""
        if self.path is None:
            return "the default settings"
        return f"{self.path} [tool.torchmigrate]" if self.path.name == "pyproject.toml" else str(self.path)


def _strings(value, key: str, where: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{where}: {key} must be a list of strings")


def parse(path: Path, root: Optional[Path] = None) -> Optional[Config]:
    """The settings in `path` (None: a pyproject.toml without a [tool.torchmigrate] table);
    `exclude` is relative to `root`, by default the file's folder. Raises ConfigError."""
    if sys.version_info >= (3, 11):  # imported here: a project without settings files never needs it
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if path.name == "pyproject.toml":
        section = data.get("tool", {}).get("torchmigrate")
        if section is None:
            return None
    else:
        section = data
    config = Config(path=path)
    where = config.where
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: must be a table")
    unknown = set(section) - KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(KEYS))})")
    amp = section.get("amp")
    if amp is not None and amp not in AMP_VALUES:
        raise ConfigError(f"{where}: amp must be one of {', '.join(AMP_VALUES)}")
    for key in _BOOLEANS:
        if key in section and not isinstance(section[key], bool):
            raise ConfigError(f"{where}: {key} must be true or false")
    shard_eval = section.get("shard-eval", section.get("shard_eval"))
    policy = section.get("batch-policy")
    if policy is not None and policy not in BATCH_POLICIES:
        raise ConfigError(f"{where}: batch-policy must be one of {', '.join(BATCH_POLICIES)}")
    strings = {key: _strings(section.get(key, []), key, where) for key in KEYS - {"amp", "batch-policy", *_BOOLEANS}}
    return Config(
        select=strings["select"], extend_select=strings["extend-select"], ignore=strings["ignore"],
        exclude=strings["exclude"] + strings["extend-exclude"], amp=amp, shard_eval=shard_eval,
        batch_policy=policy, path=path,
        root=root or path.parent,
    )


def absolute(path: Path) -> Path:
    """The path made absolute without resolving links (the user's view of the tree)."""
    return Path(os.path.abspath(path))


class Configs:
    """The settings for each path: the closest settings file above it, or the forced one."""

    def __init__(self, forced: Optional[str] = None) -> None:
        self.forced: Optional[Config] = None
        if forced is not None:
            path = Path(forced)
            if not path.is_file():
                raise ConfigError(f"--config {forced}: no such file")
            self.forced = parse(path, root=Path.cwd()) or Config(path=path)
        self._folders: Dict[Path, Config] = {}
        self._names: Dict[str, Config] = {}  # `for_file`'s answers by folder name

    def for_file(self, path: Path) -> Config:
        """As `for_folder` of the file's folder; a run asks this for every file, so the answer
        is kept by the folder's name (no Path objects built for a folder already seen)."""
        folder = os.path.dirname(os.path.abspath(path))
        found = self._names.get(folder)
        if found is None:
            found = self._names[folder] = self.for_folder(Path(folder))
        return found

    def for_folder(self, folder: Path) -> Config:
        if self.forced is not None:
            return self.forced
        folder = absolute(folder)
        known = self._folders.get(folder)
        if known is not None:
            return known
        chain = []
        found = None
        for current in (folder, *folder.parents):
            if current in self._folders:
                found = self._folders[current]
                break
            chain.append(current)
            found = self._own(current)
            if found is not None:
                break
        found = found or Config()
        for current in chain:
            self._folders[current] = found
        return found

    def _own(self, folder: Path) -> Optional[Config]:
        """The settings file of `folder` itself, if it has one."""
        for name in NAMES:
            candidate = folder / name
            try:
                if not candidate.is_file():
                    continue
            except OSError:
                continue
            config = parse(candidate)
            if config is not None:
                return config
        return None

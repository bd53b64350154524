"""`[tool.torchmigrate]` from the nearest pyproject.toml: select, ignore, exclude, amp."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KEYS = {"select", "ignore", "exclude", "extend-exclude", "amp"}


class ConfigError(Exception):
    pass


@dataclass(frozen=True)
class Config:
    select: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()
    exclude: Tuple[str, ...] = ()
    amp: Optional[str] = None
    path: Optional[Path] = None


def find_pyproject(start: Path) -> Optional[Path]:
    start = start.resolve()
    for folder in [start, *start.parents] if start.is_dir() else [start.parent, *start.parent.parents]:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def _strings(value, key: str, path: Path) -> Tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{path}: [tool.torchmigrate] {key} must be a list of strings")


def load(paths: Sequence[str]) -> Config:
    """Config from the pyproject.toml nearest to the first path (or the working directory)."""
    start = Path(paths[0]) if paths else Path.cwd()
    try:
        exists = start.exists()
    except (OSError, ValueError):  # e.g. a name too long: discovery reports it for that path
        exists = False
    if not exists:
        start = Path.cwd()
    pyproject = find_pyproject(start)
    if pyproject is None:
        return Config()
    try:
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{pyproject}: cannot read: {exc}") from None
    section = data.get("tool", {}).get("torchmigrate")
    if section is None:
        return Config()
    unknown = set(section) - KEYS
    if unknown:
        raise ConfigError(f"{pyproject}: unknown [tool.torchmigrate] keys: {', '.join(sorted(unknown))}")
    amp = section.get("amp")
    if amp is not None and amp not in ("auto", "bf16", "fp16", "off"):
        raise ConfigError(f"{pyproject}: [tool.torchmigrate] amp must be auto, bf16, fp16 or off")
    base = pyproject.parent
    exclude = _strings(section.get("exclude", []), "exclude", pyproject) + _strings(
        section.get("extend-exclude", []), "extend-exclude", pyproject)
    return Config(
        select=_strings(section.get("select", []), "select", pyproject),
        ignore=_strings(section.get("ignore", []), "ignore", pyproject),
        exclude=exclude + tuple(str(base / e) for e in exclude),
        amp=amp,
        path=pyproject,
    )

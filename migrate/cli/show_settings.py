"""`--show-settings`: the settings that apply to each file given, and where each one came from
(Ruff's `--show-settings`, its most used debugging aid: "why does this rule not run here?").

Nothing is processed: the answer is what a run with the same options would use for the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from torchmigrate.cli.config import Config, Configs
from torchmigrate.cli.discover import Discovery
from torchmigrate.cli.inputs import Request
from torchmigrate.cli.settings import Settings


def _listed(values: Sequence[str]) -> str:
    return ", ".join(values) if values else "(none)"


def _origin(config: Config, forced: bool) -> str:
    if config.path is None:
        return "no settings file in the folders above the file: the defaults"
    if forced:
        return f"{config.where} (--config)"
    return f"{config.where} (the closest settings file above the file)"


def _selection_lines(config: Config, request: Request) -> List[str]:
    """The two layers of rule selection, the settings file's then the command line's."""
    where = config.where if config.path is not None else "defaults"
    lines = []
    for key, value in (("select", config.select), ("extend-select", config.extend_select), ("ignore", config.ignore)):
        if value or key == "select":
            lines.append(f"  {key:<16}{_listed(value) if value else '(not set: every rule)'}  [{where}]")
    for key, value in (("--select", request.selection.select), ("--extend-select", request.selection.extend_select),
                       ("--ignore", request.selection.ignore)):
        if value:
            lines.append(f"  {key:<16}{_listed(value)}  [command line{', replaces the above' if key == '--select' else ''}]")
    return lines


def _amp_line(config: Config, request: Request) -> Optional[str]:
    if request.command == "lint":
        return None
    if request.amp:
        return f"  {'amp':<16}{request.amp}  [--amp]"
    if config.amp:
        return f"  {'amp':<16}{config.amp}  [{config.where}]"
    return f"  {'amp':<16}auto  [default]"


def _exclusion_lines(path: Path, config: Config, discovery: Discovery, request: Request) -> List[str]:
    lines = [f"  {'exclude':<16}{_listed(config.exclude)}" + (f"  [{config.where}; relative to {config.root}]"
                                                            if config.exclude else "")]
    if discovery.forced_out(path, is_dir=False):
        state = "yes: left out (--force-exclude)"
    elif discovery.excluded(path):
        state = ("matched by `exclude`, but processed: a path given by name is always processed unless "
                 "--force-exclude is given (pre-commit passes staged files by name)")
    elif request.respect_gitignore and discovery.ignore_files.ignored(Path(os.path.abspath(path)), False):
        state = "ignored by .gitignore/.ignore when a folder is searched; processed when given by name"
    else:
        state = "no"
    lines.append(f"  {'excluded':<16}{state}")
    lines.append(f"  {'force-exclude':<16}{'yes' if request.force_exclude else 'no'}  [command line]")
    lines.append(f"  {'gitignore':<16}{'respected' if request.respect_gitignore else 'not read'}  [command line]")
    return lines


def _cache_line(paths: Sequence[str], cache_dir: Optional[str], no_cache: bool) -> str:
    from torchmigrate.engine import cache

    if no_cache:
        return f"  {'cache':<16}off  [--no-cache]"
    where = cache.location(cache_dir or "", paths)
    origin = ("--cache-dir" if cache_dir else f"${cache.ENV}" if os.environ.get(cache.ENV)
              else "default: beside the nearest pyproject.toml, else in the working directory")
    return f"  {'cache':<16}{where}  [{origin}]"


def describe(request: Request, cache: Optional[Tuple[Optional[str], bool]] = None) -> str:
    """The settings of every path in `request.paths` (ConfigError for bad settings, as a run)."""
    configs = Configs(request.config)
    settings = Settings(request.command, request.selection, request.amp, configs)
    discovery = Discovery(configs, request.respect_gitignore, request.force_exclude)
    blocks = []
    for name in request.paths:
        path = Path(request.stdin_filename or "stdin.py") if name == "-" else Path(name)
        config = configs.for_file(path)
        codes = settings.for_file(path).codes
        lines = [f"Settings for {request.stdin_filename or name} (torchmigrate {request.command}):",
                 f"  {'settings file':<16}{_origin(config, configs.forced is not None)}"]
        lines += _selection_lines(config, request)
        lines.append(f"  {'rules enabled':<16}{_listed(codes)}  ({len(codes)} rules)")
        amp = _amp_line(config, request)
        lines += [amp] if amp else []
        lines += _exclusion_lines(path, config, discovery, request)
        if request.command == "lint" and cache is not None:
            lines.append(_cache_line(request.paths, *cache))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)

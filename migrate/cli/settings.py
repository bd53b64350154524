"""The rules and the AMP mode each file is processed with: the command line over the settings
file that governs the file (see `config.py`).

As in Ruff, the settings file and then the command line each make one layer of selection:
a layer's `select` replaces what the layers before it enabled, its `extend-select` adds to that
and its `ignore` takes away (so `--select TM406` enables TM406 even where the file's settings
ignore it). `--amp` replaces the file's `amp`, `--shard-eval`/`--no-shard-eval` its `shard-eval`,
`--batch-policy` the `batch-policy` of the settings of the first file. A selector that selects no
rule at all (a typo such as TM210) is an error wherever it is written, so a run never reports
a clean result for rules it did not run; on the command line, a `--select` that selects no rule
of the command at hand (`ddp --select TM405`, an `amp`-only rule) is one too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from torchmigrate.cli.config import Config, ConfigError, Configs
from torchmigrate.options import COMMANDS

HINT = "use codes such as TM201, prefixes such as TM2, or rule names; see `torchmigrate rules`"


def split(values: Sequence[str]) -> Tuple[str, ...]:
    """`("TM2,TM406", "TM5")` -> `("TM2", "TM406", "TM5")`."""
    return tuple(c.strip() for v in values for c in v.split(",") if c.strip())


@dataclass(frozen=True)
class Selection:
    """The rule selectors of the command line."""

    select: Tuple[str, ...] = ()
    extend_select: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()


def _unknown(selectors: Iterable[str], command: Optional[str] = None) -> List[str]:
    """The selectors that select no rule (of `command`, when given): a typo such as TM210 or
    TM999 would otherwise select nothing and report a clean run."""
    from torchmigrate.cli.catalogue import all_rules  # cached descriptions on a warm lint
    from torchmigrate.rules import matches

    rules = [r for r in all_rules() if command is None or command in r.commands]
    return [s for s in selectors if not any(matches(r, s) for r in rules)]


def _check(selectors: Sequence[str], where: str, command: Optional[str] = None) -> None:
    bad = _unknown(selectors)
    if bad:
        raise ConfigError(f"{where}: unknown rule selector {', '.join(map(repr, bad))} ({HINT})")
    if command is None:
        return
    for selector in _unknown(selectors, command):
        runs_in = [f"torchmigrate {c}" for c in COMMANDS if not _unknown([selector], c)]
        raise ConfigError(f"{where}: {selector!r} selects no rule that `torchmigrate {command}` runs "
                          f"(only rules of {' and '.join(runs_in)})")


def enabled(command: str, layers: Sequence[Tuple[Sequence[str], Sequence[str], Sequence[str]]]) -> Tuple[str, ...]:
    """The codes of `command`'s rules enabled by layers of (select, extend-select, ignore)."""
    from torchmigrate.cli.catalogue import all_rules  # cached descriptions on a warm lint
    from torchmigrate.rules import matches

    rules = [r for r in all_rules() if command in r.commands]

    def chosen(selectors):
        return {r.code for r in rules if any(matches(r, s) for s in selectors)}

    codes = {r.code for r in rules}
    for select, extend, ignore in layers:
        if select:
            codes = chosen(select)
        codes = (codes | chosen(extend)) - chosen(ignore)
    return tuple(sorted(codes))


class FileSettings(NamedTuple):
    """What one file is processed with."""

    codes: Tuple[str, ...]
    amp: str
    shard_eval: bool = False


class Settings:
    """What each file gets: rule codes, AMP mode and whether evaluation is sharded regardless,
    from the command line and its settings."""

    def __init__(self, command: str, cli: Selection, amp: Optional[str], configs: Configs,
                 shard_eval: Optional[bool] = None, batch_policy: Optional[str] = None) -> None:
        _check(cli.select, "--select", command)
        _check(cli.extend_select, "--extend-select", command)
        _check(cli.ignore, "--ignore")
        self.command = command
        self.cli = cli
        self.amp = amp
        self.shard_eval = shard_eval
        self.batch_policy = batch_policy
        self.configs = configs
        self._codes: Dict[Optional[Path], Tuple[str, ...]] = {}

    def codes(self, config: Config) -> Tuple[str, ...]:
        """The rule codes enabled under `config` (its selectors checked on first use)."""
        found = self._codes.get(config.path)
        if found is None:
            for key, selectors in (("select", config.select), ("extend-select", config.extend_select),
                                   ("ignore", config.ignore)):
                _check(selectors, f"{config.where}: {key}")
            cli = self.cli
            found = self._codes[config.path] = enabled(self.command, [
                (config.select, config.extend_select, config.ignore), (cli.select, cli.extend_select, cli.ignore)])
        return found

    def for_file(self, path: Path) -> FileSettings:
        """The rule codes, amp and shard-eval for the file at `path`."""
        config = self.configs.for_file(path)
        shard_eval = self.shard_eval if self.shard_eval is not None else bool(config.shard_eval)
        return FileSettings(self.codes(config), self.amp or config.amp or "auto", shard_eval)

    def batch_policy_for(self, path: Path) -> str:
        """The batch policy of a program whose first file is `path`: `--batch-policy`, else its
        settings' `batch-policy`, else "global". One value per run, since the global batch is the
        program's, not a file's."""
        return self.batch_policy or self.configs.for_file(path).batch_policy or "global"

"""The rule catalogue: one module per rule family, each rule a `torchmigrate.rule.Rule`.

Rules are collected from every module of this package and of its family packages (`amp/`,
`data/`: the family's plan and one rule per file), so adding a family means adding a module or a
package; codes are stable and never renumbered.
"""

from __future__ import annotations

import importlib
import re
import pkgutil
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Type

if TYPE_CHECKING:
    from torchmigrate.rule import Rule

_REGISTRY: Dict[str, Type["Rule"]] = {}


def all_rules() -> List[Type["Rule"]]:
    """Every rule, sorted by code. (Importing this package alone does not import the rule
    modules nor LibCST: `select` also works on the cached descriptions of `catalogue`.)"""
    if not _REGISTRY:
        from torchmigrate.rule import Rule

        for module in _rule_modules(__path__, __name__):
            for value in vars(module).values():
                if isinstance(value, type) and issubclass(value, Rule) and value.code and value.__module__ == module.__name__:
                    if value.code in _REGISTRY and _REGISTRY[value.code] is not value:
                        raise RuntimeError(f"duplicate rule code {value.code}")
                    _REGISTRY[value.code] = value
    return [_REGISTRY[code] for code in sorted(_REGISTRY)]


def _rule_modules(path, package: str):
    """The modules of this package and of its family packages (`rules/amp/`, `rules/data/`: a
    plan and one rule per file), imported; names starting with `_` are not rule modules."""
    for info in pkgutil.iter_modules(path):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        yield module
        if info.ispkg:
            yield from _rule_modules(module.__path__, module.__name__)


def get_rule(code: str) -> Type["Rule"]:
    rules = {r.code: r for r in all_rules()}
    by_name = {r.name: r for r in all_rules()}
    key = code.strip()
    if key.upper() in rules:
        return rules[key.upper()]
    if key in by_name:
        return by_name[key]
    raise KeyError(code)


_PREFIX = re.compile(r"^TM\d{0,3}$", re.IGNORECASE)


def matches(rule: Type[Rule], selector: str) -> bool:
    """A selector is a code or code prefix (`TM`, `TM2`, `TM406`, any case) or a rule name."""
    selector = selector.strip()
    return bool(_PREFIX.match(selector)) and rule.code.startswith(selector.upper()) or rule.name == selector


def select(codes=(), ignore=(), command: str = "lint", rules: Optional[Sequence] = None) -> List[Type["Rule"]]:
    """Rules enabled for `command`, filtered by `--select`/`--ignore` codes or prefixes, out of
    `rules` (default: every rule)."""
    chosen = [r for r in (all_rules() if rules is None else rules) if command in r.commands]
    if codes:
        chosen = [r for r in chosen if any(matches(r, p) for p in codes)]
    if ignore:
        chosen = [r for r in chosen if not any(matches(r, p) for p in ignore)]
    return chosen

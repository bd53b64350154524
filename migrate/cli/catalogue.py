"""The rule catalogue as the CLI needs it to select rules and print results: codes, names,
summaries, safety, commands and documentation, without importing the rules.

Importing the rule modules imports LibCST (a third of a second); a lint run whose results all
come from the cache needs none of it. With a cache in use (`use`), the descriptions are kept
beside the results, under the tool's fingerprint, so they are those of exactly this code.
Without one, or on the first run, the rules themselves are imported and described.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Sequence

from torchmigrate.options import Safety

_store = None  # a cache.Store, with `use`
_rules: Optional[List] = None


@dataclass(frozen=True)
class RuleInfo:
    """What a Rule class says about itself, as plain data (the same attribute names)."""

    code: str
    name: str
    summary: str
    safety: Safety
    commands: FrozenSet[str]
    doc: str

    def documentation(self) -> str:
        return self.doc


def use(store) -> None:
    """Keep and reuse the descriptions in this cache store."""
    global _store, _rules
    _store, _rules = store, None


def all_rules() -> List:
    """Every rule (its class, or its cached description), sorted by code. Once the rules are
    imported (a file was processed, or another command ran in this process), the registry
    itself, as it is now."""
    global _rules
    from torchmigrate import rules

    if _store is None or rules._REGISTRY:
        return rules.all_rules()
    if _rules is None:
        _rules = _cached() or _describe()
    return _rules


def _cached() -> Optional[List[RuleInfo]]:
    data = _store.read("catalogue.json")
    try:
        return [RuleInfo(r["code"], r["name"], r["summary"], Safety(r["safety"]), frozenset(r["commands"]), r["doc"])
                for r in data["rules"]] if data else None
    except (KeyError, TypeError, ValueError):
        return None


def _describe() -> List:
    from torchmigrate.rules import all_rules as classes

    rules = classes()
    _store.write("catalogue.json", {"rules": [
        {"code": r.code, "name": r.name, "summary": r.summary, "safety": r.safety.value,
         "commands": sorted(r.commands), "doc": r.documentation()} for r in rules]})
    return rules


def select(codes: Sequence[str] = (), ignore: Sequence[str] = (), command: str = "lint") -> List:
    from torchmigrate.rules import select as choose

    return choose(codes, ignore, command, rules=all_rules())


def get_rule(code: str):
    return next(r for r in all_rules() if r.code == code)

"""`torchmigrate explain CODE`: the rule's own docstring and examples, rendered as text."""

from __future__ import annotations

from torchmigrate.diff import unified_diff
from torchmigrate.rule import Rule


def render(rule: type[Rule]) -> str:
    parts = [f"{rule.code} ({rule.name}) — {rule.summary}", "",
             f"Fix safety: {rule.safety.value}. Commands: {', '.join(sorted(rule.commands))}.", "",
             rule.documentation()]
    for i, example in enumerate(rule.examples, start=1):
        parts.append("")
        parts.append(f"Example {i} ({example.mode}):")
        if example.after_text is None:
            parts.append("  Left unchanged:")
            parts.append(_indent(example.before_text))
        else:
            diff = unified_diff(example.before_text, example.after_text, "example.py")
            parts.append(_indent("".join(diff.splitlines(keepends=True)[2:])))
    return "\n".join(parts).rstrip() + "\n"


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())

"""`torchmigrate explain CODE`: the rule's own docstring and examples, rendered as text.

The examples printed here are the rule's `examples`, each labelled with the exact command that
turns its "before" into its "after" (`command_line`); tests/test_examples.py runs that very
command through the CLI on each example, so what the documentation shows is what the tool writes.
An example shows its rule alone (`--select CODE`), or with the rules it relies on (`also`): the
whole command runs every rule, and other rules would change the same snippet too.
"""

from __future__ import annotations

from typing import List

from torchmigrate.rule import Example, Rule

SAFETY = {
    "safe": "safe (applied by `torchmigrate ddp`/`amp` and by `torchmigrate lint --fix`)",
    "unsafe": ("unsafe (may change behaviour: applied only by `torchmigrate lint --fix --unsafe-fixes`; "
               "a migration leaves a `# TODO(torchmigrate)` comment instead)"),
    "manual": "manual (reported only; a migration leaves a `# TODO(torchmigrate)` comment saying what to do)",
}

COMMAND = {"ddp": "torchmigrate ddp", "amp": "torchmigrate amp", "lint": "torchmigrate lint --fix"}


def command_line(rule: type[Rule], example: Example) -> str:
    """The command that writes the example's "after" (give it the file of the "before")."""
    codes = ",".join((rule.code, *example.also))
    flags = "".join(f" {f}" for f in example.flags)
    return f"{COMMAND.get(example.mode, example.mode)}{flags} --select {codes}"


def render(rule: type[Rule]) -> str:
    parts: List[str] = [
        f"{rule.code} ({rule.name}): {rule.summary}",
        "",
        f"Fix safety: {SAFETY.get(rule.safety.value, rule.safety.value)}.",
        f"Checked by: {', '.join(f'torchmigrate {c}' for c in sorted(rule.commands))}.",
        "",
        rule.documentation(),
    ]
    if rule.examples:
        parts += ["", "## Before and after", ""]
        for i, example in enumerate(rule.examples, start=1):
            parts += _example(example, i if len(rule.examples) > 1 else None, command_line(rule, example))
    return "\n".join(parts).rstrip() + "\n"


def _example(example: Example, number, command: str) -> List[str]:
    title = f"Example {number}" if number else "Example"
    if not example.file.endswith(".py"):  # a launch file (TM801)
        title += f" ({example.file})"
    before = example.before_text
    if example.after_text is None:
        return [f"{title}: left unchanged by `{command}`:", "", _indent(before), ""]
    return [f"{title}, before:", "", _indent(before), "",
            f"after `{command}`:", "", _indent(example.after_text), ""]


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.rstrip("\n").splitlines())

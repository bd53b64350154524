"""The README's generated parts equal what the code generates, so they cannot drift.

- the rules table (section "Rules") is `torchmigrate rules --format markdown`;
- the CLI reference (section "CLI reference") is each command's `--help`.

Both sit between `<!-- begin: NAME -->` / `<!-- end: NAME -->` markers. To regenerate them
after adding or changing a rule or an option, run from the repository root:

    python tests/test_readme.py

(it rewrites only the text between the markers; `--check` exits 1 instead of writing).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REGENERATE = "python tests/test_readme.py"

CLI_COMMANDS = ("ddp", "amp", "lint", "verify", "rules", "explain")


def rules_table() -> str:
    from click.testing import CliRunner

    from torchmigrate.cli.commands import main

    result = CliRunner().invoke(main, ["rules", "--format", "markdown"], prog_name="torchmigrate")
    assert result.exit_code == 0, result.output
    return result.stdout.rstrip("\n")


def cli_reference() -> str:
    from click.testing import CliRunner

    from torchmigrate.cli.commands import main

    parts = []
    for command in ("",) + CLI_COMMANDS:
        args = [command, "--help"] if command else ["--help"]
        result = CliRunner().invoke(main, args, prog_name="torchmigrate", terminal_width=100)
        assert result.exit_code == 0, result.output
        title = f"torchmigrate {command}".strip()
        parts.append(f"### `{title}`\n\n```text\n{result.stdout.rstrip()}\n```")
    return "\n\n".join(parts)


BLOCKS = {"rules-table": rules_table, "cli-reference": cli_reference}


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- begin: {re.escape(name)}\b[^>]*-->)(.*?)(<!-- end: {re.escape(name)} -->)", re.DOTALL)


def current(text: str, name: str) -> str:
    match = _pattern(name).search(text)
    assert match, f"README.md has no `<!-- begin: {name} -->` ... `<!-- end: {name} -->` block"
    return match.group(2).strip("\n")


def regenerate(text: str) -> str:
    for name, generate in BLOCKS.items():
        content = generate()
        text = _pattern(name).sub(lambda m: f"{m.group(1)}\n{content}\n{m.group(3)}", text, count=1)
    return text


def test_readme_rules_table_is_generated():
    text = README.read_text(encoding="utf-8")
    assert current(text, "rules-table") == rules_table(), (
        "README.md's rules table is out of date (rules were added or changed). "
        f"Regenerate it with `{REGENERATE}` from the repository root, then commit README.md."
    )


def test_readme_cli_reference_is_generated():
    text = README.read_text(encoding="utf-8")
    assert current(text, "cli-reference") == cli_reference(), (
        "README.md's CLI reference is out of date (a command's options or help changed). "
        f"Regenerate it with `{REGENERATE}` from the repository root, then commit README.md."
    )


def test_readme_snippets_match_the_shipped_hooks():
    text = README.read_text(encoding="utf-8")
    hooks = (ROOT / ".pre-commit-hooks.yaml").read_text(encoding="utf-8")
    for hook_id in re.findall(r"^- id: (\S+)", hooks, re.MULTILINE):
        assert hook_id in text, f"README.md does not show the {hook_id} hook"
    assert "id: torchmigrate-lint" in text
    assert "torchmigrate lint --format github" in text
    assert "torchmigrate rules --format markdown" in text and REGENERATE in text


def test_readme_test_section_is_what_ci_runs():
    """One command sets the suite up and runs it (`bash .ci/run`), and the script ends with the
    test command the README gives; it never upgrades pip in the user's environment."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Running the tests"):]
    assert "bash .ci/run" in section and "python -m pytest -q -n auto" in section
    script = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-1] == "python -m pytest -q -n auto"
    assert not re.search(r"install[^\n]*(-U|--upgrade)[^\n]*\bpip\b", script)


def main(argv) -> int:
    text = README.read_text(encoding="utf-8")
    new = regenerate(text)
    if "--check" in argv:
        if new != text:
            print(f"README.md is out of date; run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new, encoding="utf-8")
        print("README.md updated")
    else:
        print("README.md is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Every `fixtures/<CODE>/<case>.in.py` is a test.

The output must equal `<case>.out.py` (or the input, when there is no `.out.py`), must compile,
and migrating the output again must change nothing (idempotency).
"""

from __future__ import annotations

import pytest

from conftest import FIXTURES, check_launch, fixture_settings, migrate
from torchmigrate.engine.process import process_source
from torchmigrate.rules import all_rules

CASES = sorted(p for p in FIXTURES.glob("TM*/*.in.py"))


@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.name[:-6]}" for p in CASES])
def test_fixture(case):
    source = case.read_text(encoding="utf-8")
    options, rules = fixture_settings(source, case.parent.name)
    expected_path = case.with_name(case.name[: -len(".in.py")] + ".out.py")
    expected = expected_path.read_text(encoding="utf-8") if expected_path.exists() else source
    out = migrate(source, options, rules)
    assert out == expected
    compile(out, str(expected_path), "exec")
    assert migrate(out, options, rules) == out, "second run must be a no-op"


# Findings that change no text (a manual rule in `lint` mode, advice): `<case>.findings` beside
# `<case>.in.py` lists the findings of the rule(s) on the input, one `LINE:COL CODE` a line, with
# ` note` after advice (an empty file: none), so a false positive that leaves no trace in the
# output still fails.
FINDING_CASES = sorted(p for p in FIXTURES.glob("TM*/*.findings"))


@pytest.mark.parametrize("case", FINDING_CASES, ids=[f"{p.parent.name}/{p.stem}" for p in FINDING_CASES])
def test_fixture_findings(case):
    source = case.with_name(case.stem + ".in.py").read_text(encoding="utf-8")
    options, rules = fixture_settings(source, case.parent.name)
    found = process_source(source, "fixture.py", options, rules).findings
    assert [f"{f.line}:{f.col} {f.code}{' note' if f.advice else ''}" for f in found] \
        == case.read_text(encoding="utf-8").split("\n")[:-1]


# Launch files (TM801): `fixtures/TM801/<case>.in.<ext>` with `<case>.out.<ext>` (none: unchanged),
# checked as text as `<case>.<ext>` (`.sh`, `.sbatch`, `.mk`, `.md`, `.rst`); the program is
# `train.py` unless the first line says `fixture: program=train.py,src/main.py`.
LAUNCH_CASES = sorted(p for p in FIXTURES.glob("TM*/*.in.*") if not p.name.endswith(".py"))


@pytest.mark.parametrize("case", LAUNCH_CASES, ids=[f"{p.parent.name}/{p.name}" for p in LAUNCH_CASES])
def test_launch_fixture(case):
    source = case.read_text(encoding="utf-8")
    stem, ext = case.name.split(".in.")
    expected_path = case.with_name(f"{stem}.out.{ext}")
    expected = expected_path.read_text(encoding="utf-8") if expected_path.exists() else source
    result = check_launch(source, f"{stem}.{ext}")
    assert result.text == expected
    again = check_launch(result.text, f"{stem}.{ext}")
    assert again.text == result.text, "second run must be a no-op"
    assert not [r for r in again.records if r.applied], "nothing left to rewrite"


def test_every_rule_has_fixtures():
    missing = [r.code for r in all_rules() if not list((FIXTURES / r.code).glob("*.in.*"))]
    assert not missing, f"rules without fixtures: {missing}"


def test_fixture_dirs_name_real_rules():
    codes = {r.code for r in all_rules()}
    dirs = {p.name for p in FIXTURES.glob("TM*") if p.is_dir()}
    assert dirs <= codes, f"fixture folders for unknown rules: {sorted(dirs - codes)}"


# Multi-module fixtures: `fixtures/<CODE>/<case>/` holds a small program (`train.in.py`, the
# entry, and the modules it imports, each `<name>.in.py` with an optional `<name>.out.py`; launch
# files too: `run.in.sh`/`run.out.sh`, `Makefile.in`/`Makefile.out`). The case is migrated from
# its entry with `torchmigrate ddp` (following imports, all rules), and every file must come out
# as its `.out` (or unchanged); a second run changes nothing.
PROGRAMS = sorted(p for p in FIXTURES.glob("TM*/*/") if (p / "train.in.py").exists())


def _real_name(name: str, part: str = "in") -> str:
    """`train.in.py` -> `train.py`, `Makefile.in` -> `Makefile` (and the `out` names alike)."""
    return name[: -len(part) - 1] if name.endswith(f".{part}") else name.replace(f".{part}.", ".", 1)


def _expected_name(name: str) -> str:
    return name[:-3] + ".out" if name.endswith(".in") else name.replace(".in.", ".out.", 1)


@pytest.mark.parametrize("case", PROGRAMS, ids=[f"{p.parent.name}/{p.name}" for p in PROGRAMS])
def test_program_fixture(case, tmp_path, run_cli):
    inputs = sorted(p for p in case.rglob("*") if p.is_file() and (".in." in p.name or p.name.endswith(".in")))
    for src in inputs:
        dest = tmp_path / src.relative_to(case).with_name(_real_name(src.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read_bytes())
    result = run_cli("ddp", tmp_path / "train.py")
    assert result.exit_code in (0, 1), result.output
    for src in inputs:
        name = _real_name(src.name)
        expected = src.with_name(_expected_name(src.name))
        got = (tmp_path / src.relative_to(case)).with_name(name).read_text(encoding="utf-8")
        assert got == (expected if expected.exists() else src).read_text(encoding="utf-8"), name
        if name.endswith(".py"):
            compile(got, name, "exec")
    again = run_cli("ddp", "--check", tmp_path / "train.py")
    assert "would be changed" not in again.output, again.output

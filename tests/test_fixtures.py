"""Every `fixtures/<CODE>/<case>.in.py` is a test.

The output must equal `<case>.out.py` (or the input, when there is no `.out.py`), must compile,
and migrating the output again must change nothing (idempotency).
"""

from __future__ import annotations

import pytest

from conftest import FIXTURES, fixture_settings, migrate
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


def test_every_rule_has_fixtures():
    missing = [r.code for r in all_rules() if not list((FIXTURES / r.code).glob("*.in.py"))]
    assert not missing, f"rules without fixtures: {missing}"


def test_fixture_dirs_name_real_rules():
    codes = {r.code for r in all_rules()}
    dirs = {p.name for p in FIXTURES.glob("TM*") if p.is_dir()}
    assert dirs <= codes, f"fixture folders for unknown rules: {sorted(dirs - codes)}"


# Multi-module fixtures: `fixtures/<CODE>/<case>/` holds a small program (`train.in.py`, the
# entry, and the modules it imports, each `<name>.in.py` with an optional `<name>.out.py`). The
# case is migrated from its entry with `torchmigrate ddp` (following imports, all rules), and
# every module must come out as its `.out.py` (or unchanged); a second run changes nothing.
PROGRAMS = sorted(p for p in FIXTURES.glob("TM*/*/") if (p / "train.in.py").exists())


@pytest.mark.parametrize("case", PROGRAMS, ids=[f"{p.parent.name}/{p.name}" for p in PROGRAMS])
def test_program_fixture(case, tmp_path, run_cli):
    inputs = sorted(case.rglob("*.in.py"))
    for src in inputs:
        dest = tmp_path / src.relative_to(case).with_name(src.name[: -len(".in.py")] + ".py")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    result = run_cli("ddp", tmp_path / "train.py")
    assert result.exit_code in (0, 1), result.output
    for src in inputs:
        name = src.name[: -len(".in.py")]
        expected = src.with_name(name + ".out.py")
        got = (tmp_path / src.relative_to(case)).with_name(name + ".py").read_text(encoding="utf-8")
        assert got == (expected if expected.exists() else src).read_text(encoding="utf-8"), name
        compile(got, name, "exec")
    again = run_cli("ddp", "--check", tmp_path / "train.py")
    assert "would be changed" not in again.output, again.output

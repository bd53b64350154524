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

"""Each rule's documented examples (what `torchmigrate explain` prints) are run as tests,
so documentation cannot drift from behaviour."""

from __future__ import annotations

import pytest

from conftest import check_launch, migrate
from torchmigrate.explain import render
from torchmigrate.rule import Options
from torchmigrate.rules import all_rules

EXAMPLES = [(rule, i, ex) for rule in all_rules() for i, ex in enumerate(rule.examples)]


@pytest.mark.parametrize("rule,index,example", EXAMPLES, ids=[f"{r.code}-{i}" for r, i, _ in EXAMPLES])
def test_documented_example(rule, index, example):
    options = Options(mode=example.mode, fix=example.mode == "lint")
    before = example.before_text
    expected = example.after_text if example.after_text is not None else before
    if not example.file.endswith(".py"):  # a launch file (TM801)
        out = check_launch(before, example.file).text
        assert out == expected
        assert check_launch(out, example.file).text == out
        return
    out = migrate(before, options, [rule])
    assert out == expected
    assert migrate(out, options, [rule]) == out


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.code)
def test_rule_is_documented(rule):
    assert rule.code and rule.name and rule.summary
    assert rule.examples, f"{rule.code} has no example"
    text = render(rule)
    assert rule.code in text and "What it does" in text and "Why is this bad" in text

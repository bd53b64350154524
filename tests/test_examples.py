"""Each rule's documented examples (what `torchmigrate explain` prints) are run as tests,
so documentation cannot drift from behaviour: through the engine, and through the very command
line that `explain` says produces the "after"."""

from __future__ import annotations

import pytest

import shlex

from conftest import check_launch, migrate
from torchmigrate.cli.explain import command_line, render
from torchmigrate.rule import Options
from torchmigrate.rules import all_rules, get_rule

EXAMPLES = [(rule, i, ex) for rule in all_rules() for i, ex in enumerate(rule.examples)]


@pytest.mark.parametrize("rule,index,example", EXAMPLES, ids=[f"{r.code}-{i}" for r, i, _ in EXAMPLES])
def test_documented_example(rule, index, example):
    options = Options(mode=example.mode, fix=example.mode == "lint", shard_eval="--shard-eval" in example.flags)
    before = example.before_text
    expected = example.after_text if example.after_text is not None else before
    if not example.file.endswith(".py"):  # a launch file (TM801)
        out = check_launch(before, example.file).text
        assert out == expected
        assert check_launch(out, example.file).text == out
        return
    rules = [rule, *(get_rule(code) for code in example.also)]
    out = migrate(before, options, rules)
    assert out == expected
    assert migrate(out, options, rules) == out


@pytest.mark.parametrize("rule,index,example", EXAMPLES, ids=[f"{r.code}-{i}" for r, i, _ in EXAMPLES])
def test_explain_labels_each_example_with_the_command_that_writes_it(rule, index, example, tmp_path, run_cli):
    command = command_line(rule, example)
    label = f"after `{command}`:" if example.after_text is not None else f"left unchanged by `{command}`:"
    assert label in render(rule)
    if not example.file.endswith(".py"):
        return  # a launch file (TM801): run through the CLI with its program by check_launch below
    path = tmp_path / "example.py"
    path.write_text(example.before_text)
    program, *args = shlex.split(command)
    assert program == "torchmigrate"
    result = run_cli(*args, path)
    assert result.exit_code in (0, 1), result.output
    expected = example.after_text if example.after_text is not None else example.before_text
    assert path.read_text() == expected, f"`{command}` writes something else than explain shows"


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.code)
def test_rule_is_documented(rule):
    assert rule.code and rule.name and rule.summary
    assert rule.examples, f"{rule.code} has no example"
    text = render(rule)
    assert rule.code in text and "What it does" in text and "Why is this bad" in text

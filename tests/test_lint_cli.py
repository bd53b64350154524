"""`torchmigrate lint` output formats and options, the review experience (`--dry-run` colour and
summary, progress bar, `-j`), and `explain`.

Tests that need a fix of a given safety register small fake rules (TM99x) in the registry for
the duration of one test, so they do not depend on which real rules exist yet.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import libcst as cst
import pytest

from conftest import FIXTURES, ROOT
from torchmigrate.cli import formats
from torchmigrate.finding import Safety, replace_with
from torchmigrate.syntax.nodes import expr
from torchmigrate.rule import Example, Rule
from torchmigrate.rules import _REGISTRY, all_rules

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"
AMP_EXPECTED = FIXTURES / "TM406" / "from_import.out.py"
SCHEMA = Path(__file__).parent / "data" / "sarif-schema-2.1.0.json"
ANSI = "\x1b["

AMP_LINES = [  # what `lint` reports for AMP_SCRIPT: (line, column)
    (2, 1), (5, 10), (7, 10),
]


# --- fake rules --------------------------------------------------------------------------------

_DOC = """
    ## What it does
    A rule used by the tests only.

    ## Why is this bad?
    It is not.
    """


class FakeUnsafe(Rule):
    __doc__ = _DOC
    code = "TM990"
    name = "fake-unsafe"
    summary = "Replace torch.foo with torch.bar (unsafe | test)"
    safety = Safety.UNSAFE
    commands = frozenset({"lint"})
    examples = (Example("import torch\ntorch.foo()\n", "import torch\ntorch.bar()\n", mode="lint"),)

    def visit_Call(self, node: cst.Call) -> None:
        if self.ctx.resolve(node.func) == "torch.foo":
            self.report(node.func, "torch.foo is deprecated; use torch.bar",
                        edits=[replace_with(node.func, expr("torch.bar"))])


class FakeManual(Rule):
    __doc__ = _DOC
    code = "TM991"
    name = "fake-manual"
    summary = "Report torch.baz"
    safety = Safety.MANUAL
    commands = frozenset({"lint"})

    def visit_Call(self, node: cst.Call) -> None:
        if self.ctx.resolve(node.func) == "torch.baz":
            self.report(node, "torch.baz needs a manual change: 100% sure, a,b: c\nsecond line")


class FakeCrash(Rule):
    __doc__ = _DOC
    code = "TM992"
    name = "fake-crash"
    summary = "Crashes on files that call torch.crash"
    commands = frozenset({"lint", "ddp"})

    def visit_Call(self, node: cst.Call) -> None:
        if self.ctx.resolve(node.func) == "torch.crash":
            raise ValueError("boom")


@pytest.fixture
def fake_rules(monkeypatch):
    all_rules()  # populate the registry first
    for rule in (FakeUnsafe, FakeManual, FakeCrash):
        monkeypatch.setitem(_REGISTRY, rule.code, rule)
    return (FakeUnsafe, FakeManual, FakeCrash)


FAKE_SOURCE = "import torch\n\ntorch.foo()\ntorch.baz()\n"


@pytest.fixture
def amp_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(AMP_SCRIPT.read_bytes())
    return path


# --- text ------------------------------------------------------------------------------------

def test_text_format_lines_and_summary(amp_file, run_cli):
    result = run_cli("lint", "--select", "TM406", amp_file)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    expected = [f"{amp_file}:{line}:{col}: TM406 " for line, col in AMP_LINES]
    assert [l[: len(e)] for l, e in zip(lines, expected)] == expected
    assert re.fullmatch(r".+:\d+:\d+: TM\d{3} .+", lines[0])
    assert lines[3] == "Found 3 findings."
    assert lines[4] == "3 fixable with --fix."
    assert result.stderr == ""


def test_text_format_clean(tmp_path, run_cli):
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\nx = torch.zeros(1)\n")
    result = run_cli("lint", "--select", "TM406", clean)
    assert result.exit_code == 0 and result.stdout == "All checks passed!\n"


def test_relative_paths_stay_relative(amp_file, run_cli, monkeypatch):
    monkeypatch.chdir(amp_file.parent)
    result = run_cli("lint", "--select", "TM406", "train.py")
    assert result.stdout.startswith("train.py:2:1: TM406 ")


# --- json ------------------------------------------------------------------------------------

def test_json_format(amp_file, run_cli):
    result = run_cli("lint", "--format", "json", "--select", "TM406", amp_file)
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [(d["line"], d["column"]) for d in data] == AMP_LINES
    assert set(data[0]) == {"path", "line", "column", "code", "name", "message", "safety", "fixed", "fix", "level"}
    assert data[0]["path"] == str(amp_file) and data[0]["name"] == "torch-cuda-amp"
    assert all(d["safety"] == "safe" and d["fixed"] is False for d in data)
    fixed = json.loads(run_cli("lint", "--format", "json", "--fix", "--select", "TM406", amp_file).stdout)
    assert all(d["fixed"] for d in fixed) and len(fixed) == 3


# --- github ----------------------------------------------------------------------------------

def test_github_escaping():
    assert formats.escape_data("100% a\r\nb") == "100%25 a%0D%0Ab"
    assert formats.escape_property("dir:a,b%.py\n") == "dir%3Aa%2Cb%25.py%0A"


def test_github_format(amp_file, run_cli):
    result = run_cli("lint", "--format", "github", "--select", "TM406", amp_file)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0] == (f"::error file={formats.escape_property(str(amp_file))},line=2,col=1,title=TM406::"
                        "`from torch.cuda.amp import ...` is deprecated; import from torch.amp")
    for line, (lineno, col) in zip(lines, AMP_LINES):
        assert re.fullmatch(rf"::error file=[^,]+,line={lineno},col={col},title=TM406::.+", line)


def test_github_paths_are_workspace_relative(amp_file, run_cli, monkeypatch):
    monkeypatch.chdir(amp_file.parent)
    for arg in (amp_file, "train.py"):  # absolute inside the workspace, or relative
        result = run_cli("lint", "--format", "github", "--select", "TM406", arg)
        assert result.stdout.startswith("::error file=train.py,line=2,col=1,title=TM406::")


def test_github_format_escapes_paths_and_messages(tmp_path, run_cli, fake_rules):
    folder = tmp_path / "a:b,c"
    folder.mkdir()
    path = folder / "x.py"
    path.write_text(FAKE_SOURCE)
    result = run_cli("lint", "--format", "github", "--select", "TM991", path)
    assert result.exit_code == 1
    (line,) = result.stdout.splitlines()
    escaped = str(path).replace(":", "%3A").replace(",", "%2C")
    assert line == (f"::error file={escaped},line=4,col=1,title=TM991::"
                    "torch.baz needs a manual change: 100%25 sure, a,b: c%0Asecond line")


def test_github_format_annotates_input_errors(tmp_path, run_cli):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nprint 'x'\n")
    result = run_cli("lint", "--format", "github", bad)
    assert result.exit_code == 2
    assert result.stdout.startswith(f"::error file={bad},line=2,col=")
    assert "title=torchmigrate::syntax error" in result.stdout
    assert f"{bad}:2:" in result.stderr


# --- sarif -----------------------------------------------------------------------------------

def _sarif(run_cli, *args):
    result = run_cli("lint", "--format", "sarif", *args)
    return result, json.loads(result.stdout)


def _validate(log):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft4Validator(schema, format_checker=jsonschema.FormatChecker())
    errors = sorted(validator.iter_errors(log), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_sarif_is_valid_against_the_official_schema(amp_file, run_cli, monkeypatch):
    monkeypatch.chdir(amp_file.parent)
    result, log = _sarif(run_cli, "--select", "TM406", "train.py")
    assert result.exit_code == 1
    _validate(log)
    # Also what the schema cannot say: the fields GitHub code scanning and other viewers read.
    assert log["version"] == "2.1.0" and "sarif-schema-2.1.0.json" in log["$schema"]
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "torchmigrate" and driver["version"]
    rules = {r["id"]: r for r in driver["rules"]}
    tm406 = rules["TM406"]
    assert tm406["name"] == "torch-cuda-amp"
    assert tm406["shortDescription"]["text"] and tm406["fullDescription"]["text"]
    assert tm406["defaultConfiguration"]["level"] == "error"
    assert "## Why is this bad?" in tm406["help"]["markdown"]
    assert len(run["results"]) == 3
    for result, (line, col) in zip(run["results"], AMP_LINES):
        assert result["ruleId"] == "TM406" and result["level"] == "error"
        assert driver["rules"][result["ruleIndex"]]["id"] == "TM406"
        assert result["message"]["text"]
        (location,) = result["locations"]
        physical = location["physicalLocation"]
        assert physical["artifactLocation"] == {"uri": "train.py", "uriBaseId": "%SRCROOT%"}
        assert physical["region"] == {"startLine": line, "startColumn": col}
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"] == amp_file.parent.resolve().as_uri() + "/"
    assert run["invocations"][0]["executionSuccessful"] is True


def test_sarif_absolute_paths_errors_and_no_findings(tmp_path, run_cli, monkeypatch):
    other = tmp_path / "dir with space"
    other.mkdir()
    bad = other / "bad.py"
    bad.write_text("import torch\nprint 'x'\n")
    good = other / "good.py"
    good.write_text("import torch\n")
    monkeypatch.chdir(ROOT)
    result, log = _sarif(run_cli, bad, good)
    assert result.exit_code == 2
    _validate(log)
    (run,) = log["runs"]
    assert run["results"] == []
    invocation = run["invocations"][0]
    assert invocation["executionSuccessful"] is False
    (note,) = invocation["toolExecutionNotifications"]
    location = note["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"] == bad.as_uri() and "%20" in location["artifactLocation"]["uri"]
    assert location["region"]["startLine"] == 2


def test_sarif_with_every_rule_and_fake_rules(amp_file, run_cli, fake_rules):
    amp_file.write_text(AMP_SCRIPT.read_text() + FAKE_SOURCE.replace("import torch\n", ""))
    result, log = _sarif(run_cli, "--ignore", "TM992", amp_file)
    _validate(log)
    ids = [r["id"] for r in log["runs"][0]["tool"]["driver"]["rules"]]
    assert ids == sorted(ids) and {"TM406", "TM990", "TM991"} <= set(ids) and "TM992" not in ids
    assert {r["ruleId"] for r in log["runs"][0]["results"]} == {"TM406", "TM990", "TM991"}


# --- select / ignore -------------------------------------------------------------------------

@pytest.mark.parametrize("args,codes", [
    ((), {"TM406", "TM990", "TM991"}),
    (("--select", "TM990"), {"TM990"}),
    (("--select", "TM990,TM991"), {"TM990", "TM991"}),
    (("--select", "TM990", "--select", "TM406"), {"TM990", "TM406"}),
    (("--select", "TM99"), {"TM990", "TM991"}),
    (("--select", "tm99"), {"TM990", "TM991"}),
    (("--select", "fake-manual"), {"TM991"}),
    (("--ignore", "TM99"), {"TM406"}),
    (("--ignore", "TM990", "--ignore", "TM4"), {"TM991"}),
    (("--select", "TM9", "--ignore", "TM991"), {"TM990"}),
    (("--select", "TM2"), set()),
])
def test_select_and_ignore(amp_file, run_cli, fake_rules, args, codes):
    amp_file.write_text(AMP_SCRIPT.read_text() + FAKE_SOURCE.replace("import torch\n", ""))
    result = run_cli("lint", "--format", "json", "--ignore", "TM992", *args, amp_file)
    found = {d["code"] for d in json.loads(result.stdout)}
    assert found & {"TM406", "TM990", "TM991"} == codes  # real rules may add their own findings
    if "--select" in args:
        assert found == codes
        assert result.exit_code == (1 if codes else 0)


def test_unknown_selector_is_a_usage_error(amp_file, run_cli):
    for args in (("--select", "TM40X"), ("--ignore", "E501"), ("--select", "TM406,bogus")):
        result = run_cli("lint", *args, amp_file)
        assert result.exit_code == 2 and "unknown rule selector" in result.stderr


# --- fixes and exit codes --------------------------------------------------------------------

def test_fix_applies_safe_fixes_only(tmp_path, run_cli, fake_rules):
    path = tmp_path / "t.py"
    path.write_text(AMP_SCRIPT.read_text() + "torch.foo()\n")
    result = run_cli("lint", "--select", "TM406,TM990", path)
    assert result.exit_code == 1
    assert "4 findings" in result.stdout and "3 fixable with --fix" in result.stdout
    assert "1 hidden fix can be enabled with --unsafe-fixes" in result.stdout
    fixed = run_cli("lint", "--fix", "--select", "TM406,TM990", path)
    assert fixed.exit_code == 1  # the unsafe one remains
    assert path.read_text() == AMP_EXPECTED.read_text() + "torch.foo()\n"
    assert "Found 4 findings (3 fixed, 1 remaining)." in fixed.stdout
    assert "TM990" in fixed.stdout and "TM406" not in fixed.stdout


def test_unsafe_fixes_needs_fix_to_write(tmp_path, run_cli, fake_rules):
    path = tmp_path / "t.py"
    path.write_text(FAKE_SOURCE)
    before = path.read_bytes()
    shown = run_cli("lint", "--unsafe-fixes", "--select", "TM990", path)
    assert shown.exit_code == 1 and path.read_bytes() == before
    assert "1 fixable with --fix" in shown.stdout
    done = run_cli("lint", "--fix", "--unsafe-fixes", "--select", "TM990", path)
    assert done.exit_code == 0, done.output
    assert path.read_text() == "import torch\n\ntorch.bar()\ntorch.baz()\n"
    assert "Found 1 finding (1 fixed, 0 remaining)." in done.stdout
    assert run_cli("lint", "--select", "TM990", path).exit_code == 0


def test_manual_findings_keep_exit_1_after_fix(tmp_path, run_cli, fake_rules):
    path = tmp_path / "t.py"
    path.write_text(FAKE_SOURCE)
    result = run_cli("lint", "--fix", "--unsafe-fixes", "--select", "TM99", "--ignore", "TM992", path)
    assert result.exit_code == 1
    assert path.read_text() == "import torch\n\ntorch.bar()\ntorch.baz()\n"
    assert f"{path}:4:1: TM991 torch.baz needs a manual change" in result.stdout


def test_exit_zero(amp_file, tmp_path, run_cli):
    assert run_cli("lint", "--select", "TM406", amp_file).exit_code == 1
    assert run_cli("lint", "--select", "TM406", "--exit-zero", amp_file).exit_code == 0
    assert amp_file.read_bytes() == AMP_SCRIPT.read_bytes()
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nprint 'x'\n")
    assert run_cli("lint", "--exit-zero", amp_file, bad).exit_code == 2  # input errors still count


def test_exit_codes(amp_file, tmp_path, run_cli):
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\n")
    lint = lambda *args: run_cli("lint", "--select", "TM406", *args).exit_code  # noqa: E731
    assert lint(clean) == 0
    assert lint(amp_file) == 1
    assert lint("--format", "bogus", clean) == 2
    assert lint("--no-such-option", clean) == 2
    assert lint(tmp_path / "missing.py") == 2
    assert lint("--fix", amp_file) == 0  # all fixed
    assert lint(amp_file) == 0


def test_statistics(tmp_path, run_cli, fake_rules):
    for i in range(2):
        (tmp_path / f"a{i}.py").write_text(AMP_SCRIPT.read_text() + "torch.baz()\n")
    result = run_cli("lint", "--statistics", "--select", "TM406,TM991", tmp_path)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == ["6\tTM406\t[*] torch-cuda-amp", "2\tTM991\t    fake-manual"]
    data = json.loads(run_cli("lint", "--statistics", "--format", "json", "--select", "TM406,TM991", tmp_path).stdout)
    assert data == [{"code": "TM406", "name": "torch-cuda-amp", "count": 6, "fixable": 6},
                    {"code": "TM991", "name": "fake-manual", "count": 2, "fixable": 0}]
    assert run_cli("lint", "--statistics", "--exit-zero", "--select", "TM406,TM991", tmp_path).exit_code == 0


# --- one bad file never stops the others; -j keeps the order ---------------------------------

def _mixed_tree(root: Path) -> list:
    root.mkdir(exist_ok=True)
    names = []
    for i in range(12):
        name = root / f"f{i:02d}.py"
        if i == 3:
            name.write_bytes(b"import torch\nprint 'py2'\n")
        elif i == 7:
            name.write_bytes(b"import torch\nx = '\xff\xfe'\n")
        elif i == 9:
            name.write_text("import torch\ntorch.crash()\n")
        elif i % 2:
            name.write_text("import torch\nx = 1\n")
        else:
            name.write_bytes(AMP_SCRIPT.read_bytes())
        names.append(name)
    return names


def test_rule_crash_is_reported_and_the_rest_processed(tmp_path, run_cli, fake_rules):
    names = _mixed_tree(tmp_path / "src")
    result = run_cli("lint", "--fix", "--select", "TM406,TM992", tmp_path / "src")
    assert result.exit_code == 2
    errs = result.stderr.splitlines()
    assert [l.split(":", 1)[0] for l in errs] == [str(names[3]), str(names[7]), str(names[9])]
    assert "syntax error" in errs[0] and "decode" in errs[1] and "internal error (ValueError: boom)" in errs[2]
    for i, name in enumerate(names):
        if i % 2 == 0:
            assert name.read_text() == AMP_EXPECTED.read_text()  # fixed despite the failures
    assert names[9].read_text() == "import torch\ntorch.crash()\n"


def test_a_rule_that_fails_on_a_file_is_skipped_there_and_the_other_rules_changes_kept(tmp_path, run_cli, fake_rules):
    """One rule's bug must not cost the file every other rule's change: the failing rule is
    left out of that file's run, the error names it, and the exit code still says so."""
    name = tmp_path / "train.py"
    name.write_text(AMP_SCRIPT.read_text() + "torch.crash()\n")
    result = run_cli("lint", "--fix", "--select", "TM406,TM992", name)
    assert result.exit_code == 2
    [err] = result.stderr.splitlines()
    assert "internal error (ValueError: boom) in TM992, which was skipped for this file" in err
    assert name.read_text() == AMP_EXPECTED.read_text() + "torch.crash()\n"


def test_a_migration_names_what_a_failing_rule_left_undone(tmp_path, run_cli, fake_rules, monkeypatch):
    """Under `ddp`, the report says the file was processed without the rule and counts what it
    does as NOT DONE; the data is still sharded and the model wrapped by the other rules."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".git").write_text("")
    (tmp_path / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
        "model = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2, shuffle=True)\n"
        "for x, y in loader:\n    loss = ((model(x) - y) ** 2).mean()\n    opt.zero_grad()\n"
        "    loss.backward()\n    opt.step()\ntorch.crash()\n")
    result = run_cli("ddp", "--select", "TM101,TM201,TM301,TM992", "train.py")
    assert result.exit_code == 2, result.output
    text = (tmp_path / "train.py").read_text()
    assert "tm.sampler(" in text and "tm.wrap_model(" in text
    assert "TM992 failed on train.py (an internal error, see errors above) and was skipped there" in result.output
    assert "1 file processed without a rule that failed on it" in result.output


def test_parallel_output_is_deterministic(tmp_path):
    src = tmp_path / "src"
    names = _mixed_tree(src)
    names[9].write_text("import torch\nx = 2\n")  # no fake rules in a subprocess
    env = _clean_env()

    def lint(*args):
        return subprocess.run([sys.executable, "-m", "torchmigrate", "lint", *args, str(src)],
                              capture_output=True, text=True, env=env, cwd=tmp_path)

    serial = lint("-j", "1")
    assert serial.returncode == 2
    assert serial.stdout.count("TM406") == 3 * 6  # six good files with findings
    for args in (("-j", "4"), ("-j", "0"), ("--jobs", "3", "--format", "json")):
        parallel = lint(*args)
        assert parallel.returncode == 2
        if "json" not in args:
            assert parallel.stdout == serial.stdout
        assert parallel.stderr == serial.stderr
    data = json.loads(lint("-j", "3", "--format", "json").stdout)
    assert [d["path"] for d in data] == sorted(d["path"] for d in data)


def test_default_jobs_use_every_cpu_only_for_runs_worth_a_pool(monkeypatch):
    from torchmigrate.engine import runner

    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert runner.auto_jobs(1) == 1  # a one-file pre-commit call: no pool start-up
    assert runner.auto_jobs(runner.AUTO_JOBS_MIN_FILES - 1) == 1
    assert runner.auto_jobs(runner.AUTO_JOBS_MIN_FILES) == 2  # at most one worker per four files
    assert runner.auto_jobs(1000) == 4  # one per usable CPU


def test_without_worker_processes_the_run_goes_on_in_process(tmp_path, monkeypatch):
    """Sandboxes without POSIX semaphores cannot start a process pool: same results, serially."""
    import concurrent.futures

    from torchmigrate.engine import runner
    from torchmigrate.rule import Options

    def refuse(*args, **kwargs):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", refuse)
    paths = []
    for i in range(10):
        path = tmp_path / f"f{i}.py"
        path.write_text("from torch.cuda.amp import autocast\n")
        paths.append(path)
    job = runner.Job(Options(mode="lint"), ("TM406",))
    outcomes = runner.run(paths, job, jobs=4)
    assert [o.path for o in outcomes] == [str(p) for p in paths]
    assert all(o.error is None and [r.code for r in o.records] == ["TM406"] for o in outcomes)


# --- --dry-run: summary, colour on a terminal only, progress bar -----------------------------

def test_dry_run_summary(amp_file, tmp_path, run_cli):
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\n")
    result = run_cli("ddp", "--dry-run", "--select", "TM406", amp_file, clean)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "1 file would be changed; 0 findings need attention."
    assert result.stdout.startswith("--- ") and "Nothing" not in result.stdout
    nothing = run_cli("ddp", "--dry-run", "--select", "TM406", clean)
    assert nothing.exit_code == 0
    assert nothing.stdout == ""
    assert nothing.stderr.strip() == "Nothing to change (1 file checked)."


def test_dry_run_nothing_to_change_but_findings(tmp_path, run_cli, fake_rules, monkeypatch):
    monkeypatch.setattr(FakeUnsafe, "commands", frozenset({"lint", "ddp"}))
    path = tmp_path / "t.py"
    path.write_text("import torch\n# TODO(torchmigrate): TM990 torch.foo is deprecated; use torch.bar\ntorch.foo()\n")
    before = path.read_bytes()
    result = run_cli("ddp", "--dry-run", "--select", "TM990", path)
    assert result.stderr.splitlines()[-1] == "Nothing to change (1 file checked); 1 finding needs attention."
    assert result.stdout == "" and path.read_bytes() == before


def test_dry_run_summary_counts_findings(tmp_path, run_cli, fake_rules, monkeypatch):
    monkeypatch.setattr(FakeUnsafe, "commands", frozenset({"lint", "ddp"}))
    path = tmp_path / "t.py"
    path.write_text(AMP_SCRIPT.read_text() + "torch.foo()\n")
    result = run_cli("ddp", "--dry-run", "--select", "TM406,TM990", path)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "1 file would be changed; 1 finding needs attention."
    assert "Needs attention:" in result.stderr and f"{path}:10:1: TM990 torch.foo is deprecated" in result.stderr
    assert "TODO(torchmigrate): TM990" in result.stdout  # an unsafe fix is not applied by a migration


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "CLICOLOR", "CLICOLOR_FORCE")}
    env.update(TERM="xterm-256color", COLUMNS="100", **extra)
    return env


def _run_tty(args, *, stdout_tty: bool, stderr_tty: bool, env, cwd):
    """Run a command with stdout and/or stderr on a pseudo-terminal; returns (stdout, stderr, rc)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                            stdout=slave if stdout_tty else subprocess.PIPE,
                            stderr=slave if stderr_tty else subprocess.PIPE)
    os.close(slave)
    chunks = []

    def read_tty():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO once the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)

    reader = threading.Thread(target=read_tty)
    reader.start()
    out, err = proc.communicate(timeout=120)
    reader.join(timeout=30)
    os.close(master)
    tty = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")
    out = tty if stdout_tty else out.decode()
    err = tty if stderr_tty and not stdout_tty else (err.decode() if err is not None else "")
    return out, err, proc.returncode


def _dry_run(path, env, *, stdout_tty):
    return _run_tty([sys.executable, "-m", "torchmigrate", "ddp", "--dry-run", "--select", "TM406", str(path)],
                    stdout_tty=stdout_tty, stderr_tty=False, env=env, cwd=path.parent)


def test_diff_is_coloured_on_a_terminal_only(amp_file):
    out, err, rc = _dry_run(amp_file, _clean_env(), stdout_tty=True)
    assert rc == 1
    assert "\x1b[32m+scaler = GradScaler(\"cuda\", enabled=use_amp)" in out  # green addition
    assert "\x1b[31m-scaler = GradScaler(enabled=use_amp)" in out  # red removal
    assert err.splitlines()[-1] == "1 file would be changed; 0 findings need attention."

    piped, err, rc = _dry_run(amp_file, _clean_env(), stdout_tty=False)
    assert rc == 1 and ANSI not in piped
    assert "+scaler = GradScaler(\"cuda\", enabled=use_amp)" in piped
    assert amp_file.read_bytes() == AMP_SCRIPT.read_bytes()


def test_no_color_and_force_color(amp_file):
    out, _, _ = _dry_run(amp_file, _clean_env(NO_COLOR="1"), stdout_tty=True)
    assert ANSI not in out and "+scaler" in out
    out, _, _ = _dry_run(amp_file, _clean_env(NO_COLOR=""), stdout_tty=True)  # empty: not set
    assert ANSI in out
    out, _, _ = _dry_run(amp_file, _clean_env(FORCE_COLOR="1"), stdout_tty=False)
    assert "\x1b[32m+" in out
    out, _, _ = _dry_run(amp_file, _clean_env(FORCE_COLOR="1", NO_COLOR="1"), stdout_tty=False)
    assert ANSI not in out


def test_progress_bar_only_on_a_terminal_for_long_runs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(25):
        (src / f"m{i:02d}.py").write_text("import torch\nx = torch.zeros(1)\n")
    args = [sys.executable, "-m", "torchmigrate", "lint", "--select", "TM406", str(src)]
    out, err, rc = _run_tty(args, stdout_tty=False, stderr_tty=True, env=_clean_env(), cwd=tmp_path)
    assert rc == 0 and out == "All checks passed!\n"
    assert "25/25 files" in err and "\r[" in err
    assert err.endswith("\r\x1b[K")  # erased when done
    out, err, rc = _run_tty(args, stdout_tty=True, stderr_tty=False, env=_clean_env(), cwd=tmp_path)
    assert rc == 0 and "files" not in err and "files" not in out  # stderr piped: no bar
    few = [sys.executable, "-m", "torchmigrate", "lint", "--select", "TM406", *[str(p) for p in sorted(src.iterdir())[:20]]]
    _, err, _ = _run_tty(few, stdout_tty=False, stderr_tty=True, env=_clean_env(), cwd=tmp_path)
    assert "files" not in err  # 20 files or fewer: no bar


# --- explain ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.code)
def test_explain_prints_the_tested_examples(rule, run_cli):
    result = run_cli("explain", rule.code)
    assert result.exit_code == 0
    text = result.stdout
    assert text.startswith(f"{rule.code} ({rule.name}): {rule.summary}")
    assert rule.documentation() in text
    for example in rule.examples:  # the very examples tests/test_examples.py runs
        for code in (example.before_text, example.after_text):
            if code is not None:
                indented = "\n".join("    " + l if l else "" for l in code.rstrip("\n").splitlines())
                assert indented in text


def test_explain_by_name_and_case(run_cli):
    assert run_cli("explain", "tm406").stdout == run_cli("explain", "TM406").stdout
    assert run_cli("explain", "torch-cuda-amp").stdout == run_cli("explain", "TM406").stdout
    unknown = run_cli("explain", "TM999")
    assert unknown.exit_code == 2 and "unknown rule" in unknown.stderr


def test_rules_markdown_escapes_pipes(run_cli, fake_rules):
    table = run_cli("rules", "--format", "markdown").stdout
    row = next(l for l in table.splitlines() if l.startswith("| TM990 "))
    assert row == "| TM990 | `fake-unsafe` | unsafe | lint | Replace torch.foo with torch.bar (unsafe \\| test) |"


def test_input_errors_are_not_reported_as_all_clear(tmp_path, run_cli):
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"import torch\nprint 'py2'\n")
    result = run_cli("lint", bad)
    assert result.exit_code == 2
    assert "All checks passed" not in result.stdout
    assert "1 file could not be checked" in result.stdout


# --- the first hour (issue 28): what a new user meets -----------------------------------------

def _lint(*args, cwd=None, input=None):
    return subprocess.run([sys.executable, "-m", "torchmigrate", "lint", "--no-cache", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, input=input)


def test_syntax_errors_are_reported_in_files_that_do_not_mention_torch(tmp_path):
    """As Ruff: every file linted is parsed, so a broken file never reads as "All checks passed"."""
    (tmp_path / "util.py").write_text("def f(:\n    pass\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    proc = _lint(tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"util\.py:1:7: syntax error: ", proc.stderr), proc.stderr
    assert "ok.py" not in proc.stderr
    compiled_only = tmp_path / "ret.py"  # what only CPython's compiler refuses
    compiled_only.write_text("return 1\n")
    assert _lint(compiled_only).returncode == 2
    skipped = tmp_path / "skipped.py"
    skipped.write_text("# torchmigrate: skip-file\ndef f(:\n")
    assert _lint(skipped).returncode == 0


def test_unknown_codes_in_ignore_comments_are_warned_about(tmp_path):
    """A typo in a suppression suppresses nothing: a `warning:` line names it (Ruff's warning for
    an invalid rule code in a `# noqa`); known codes and prefixes are accepted, as is a bare
    `ignore`, and in files that do not mention torch too."""
    script = tmp_path / "t.py"
    script.write_text("import torch\n"
                      "a = torch.zeros(1)  # torchmigrate: ignore[TM999, TM2]\n"
                      "b = 1  # torchmigrate: ignore[tm201,TM406]\n"
                      "c = 2  # torchmigrate: ignore\n"
                      "s = '# torchmigrate: ignore[TM000]'\n")
    (tmp_path / "plain.py").write_text("x = 1  # torchmigrate: ignore[TM21O]\n")
    proc = _lint(script, tmp_path / "plain.py")
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: Invalid rule code provided to `# torchmigrate: ignore` at {script}:2: TM999",
        f"warning: Invalid rule code provided to `# torchmigrate: ignore` at {script}:3: tm201",
        f"warning: Invalid rule code provided to `# torchmigrate: ignore` at {tmp_path / 'plain.py'}:1: TM21O",
    ], proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_show_settings_says_what_applies_to_a_file_and_where_it_came_from(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nignore = ["TM406"]\nexclude = ["legacy/"]\n'
                                             'amp = "bf16"\n')
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "old.py").write_text("import torch\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "torchmigrate.toml").write_text('select = ["TM2"]\n')
    (tmp_path / "sub" / "train.py").write_text("import torch\n")
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "lint", "--show-settings", "--force-exclude",
                           "--extend-select", "TM406", "legacy/old.py", "sub/train.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    old, sub = (" ".join(block.split()) for block in proc.stdout.split("\n\n"))  # spaces aligned: one here
    assert old.startswith("Settings for legacy/old.py (torchmigrate lint):")
    assert f"settings file {tmp_path / 'pyproject.toml'} [tool.torchmigrate] (the closest settings file" in old
    assert f"ignore TM406 [{tmp_path / 'pyproject.toml'} [tool.torchmigrate]]" in old
    assert "--extend-select TM406 [command line]" in old and "TM406" in old.split("rules enabled")[1]
    assert "excluded yes: left out (--force-exclude)" in old
    assert "cache " in old
    assert f"settings file {tmp_path / 'sub' / 'torchmigrate.toml'} (the closest" in sub
    enabled = sub.split("rules enabled ")[1].split(" (")[0].split(", ")
    assert enabled == ["TM201", "TM202", "TM203", "TM204", "TM406"], sub
    assert "excluded no" in sub
    ddp = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--show-settings", "legacy/old.py"],
                         capture_output=True, text=True, cwd=tmp_path)
    shown = " ".join(ddp.stdout.split())
    assert ddp.returncode == 0 and "amp bf16 [" in shown, ddp.stdout + ddp.stderr
    assert "matched by `exclude`, but processed" in shown
    assert (tmp_path / "legacy" / "old.py").read_text() == "import torch\n"  # nothing processed


DATA_PARALLEL = """\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


def train(steps=5):
    torch.manual_seed(0)
    net = Net()
    if torch.cuda.device_count() > 1:
        net = nn.DataParallel(net, device_ids=[0, 1])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    torch.save(net.module.state_dict() if isinstance(net, nn.DataParallel) else net.state_dict(), "net.pt")


if __name__ == "__main__":
    train()
"""


@pytest.mark.slow
def test_a_dataparallel_fix_leaves_a_program_that_runs_under_torchrun(tmp_path):
    """`lint --fix` (the torchmigrate-fix hook) replaces DataParallel with tm.wrap_model: the
    result must run under torchrun (the runtime sets the process group up on first use) and
    train in sync, not stop with "no process group"."""
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(DATA_PARALLEL)
    fixed = _lint("--fix", script)
    assert "tm.wrap_model(net, data_parallel=torch.cuda.device_count() > 1)" in script.read_text(), script.read_text()
    assert fixed.returncode in (0, 1), fixed.stdout + fixed.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "verify", "--format", "json", "--steps", "0",
                           "--epochs", "0", script], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600)
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["exit"]["status"] == "pass", json.dumps(report["ranks"], indent=1)[-3000:]
    assert checks["params"]["status"] == "pass" and checks["writers"]["status"] == "pass", json.dumps(checks)

"""Inputs and verdicts: a path that fails is reported the same way by every command and format
(never next to "All checks passed!"), `-` reads stdin, and each exit code means one thing."""

from __future__ import annotations

import json

import pytest

from conftest import FIXTURES

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"
AMP_EXPECTED = FIXTURES / "TM406" / "from_import.out.py"
AMP = AMP_SCRIPT.read_text()
# trains without a DataLoader: `ddp` migrates it but leaves findings and a NOT DONE status
NO_LOADER = AMP_SCRIPT


# --- paths that fail -------------------------------------------------------------------------

def test_a_missing_path_is_an_input_error_in_every_format(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "clean.py").write_text("import torch\n")
    text = run_cli("lint", "clean.py", "nope.py")
    assert text.exit_code == 2
    assert text.stderr == "nope.py: no such file or directory\n"
    assert "All checks passed" not in text.stdout
    assert text.stdout == "No findings in the files checked; 1 file could not be checked (see the errors).\n"
    github = run_cli("lint", "--format", "github", "nope.py")
    assert github.exit_code == 2 and github.stdout == "::error file=nope.py,title=torchmigrate::no such file or directory\n"
    sarif = json.loads(run_cli("lint", "--format", "sarif", "nope.py").stdout)
    invocation = sarif["runs"][0]["invocations"][0]
    assert invocation["executionSuccessful"] is False
    assert invocation["toolExecutionNotifications"][0]["locations"][0]["physicalLocation"] == {
        "artifactLocation": {"uri": "nope.py", "uriBaseId": "%SRCROOT%"}}
    ddp = run_cli("ddp", "--dry-run", "clean.py", "nope.py")
    assert ddp.exit_code == 2 and "nope.py: no such file or directory" in ddp.stderr
    assert ddp.stderr.strip().endswith("1 file could not be processed (see errors above).")


def test_findings_and_failed_paths_both_show_in_the_summary(tmp_path, run_cli):
    path = tmp_path / "train.py"
    path.write_text(AMP)
    result = run_cli("lint", "--select", "TM406", path, tmp_path / "nope.py")
    assert result.exit_code == 2
    assert result.stdout.splitlines()[-1] == "1 file could not be checked (see the errors)."


# --- stdin -----------------------------------------------------------------------------------

def test_lint_reads_stdin_and_names_it(run_cli):
    result = run_cli("lint", "--select", "TM406", "--stdin-filename", "src/train.py", "-", input=AMP)
    assert result.exit_code == 1
    assert result.stdout.startswith("src/train.py:2:1: TM406 ")
    plain = run_cli("lint", "--select", "TM406", "-", input=AMP)
    assert plain.stdout.startswith("-:2:1: TM406 ")
    implied = run_cli("lint", "--select", "TM406", "--stdin-filename", "x.py", input=AMP)  # as Ruff: `-` implied
    assert implied.stdout.startswith("x.py:2:1: TM406 ")


def test_lint_fix_on_stdin_prints_the_fixed_source(run_cli):
    result = run_cli("lint", "--fix", "--select", "TM406", "-", input=AMP)
    assert result.exit_code == 0
    assert result.stdout == AMP_EXPECTED.read_text()
    assert "Found 3 findings (3 fixed, 0 remaining)." in result.stderr


@pytest.mark.parametrize("command", ["ddp", "amp"])
def test_migration_of_stdin_prints_what_it_would_write(tmp_path, run_cli, command):
    path = tmp_path / "train.py"
    path.write_bytes(NO_LOADER.read_bytes())
    run_cli(command, "--no-follow", path)
    result = run_cli(command, "--stdin-filename", "train.py", "-", input=NO_LOADER.read_text())
    assert result.stdout == path.read_text()  # the same as the file written in place
    assert "Changes:" in result.stderr and "train.py:" in result.stderr
    diff = run_cli(command, "--dry-run", "-", input=NO_LOADER.read_text())
    assert diff.exit_code == 1 and diff.stdout.startswith("--- a/-\n+++ b/-\n")
    check = run_cli(command, "--check", "-", input=path.read_text())
    assert check.exit_code == 0 and "Nothing to change" in check.stdout


def test_stdin_uses_the_settings_and_excludes_of_its_filename(tmp_path, run_cli, monkeypatch):
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "torchmigrate.toml").write_text('select = ["TM2"]\n')
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nexclude = ["vendor/"]\n')
    monkeypatch.chdir(tmp_path)
    other = run_cli("lint", "--stdin-filename", "legacy/old.py", "-", input=AMP)
    assert other.exit_code == 0 and other.stdout == "All checks passed!\n"  # TM2 only there
    excluded = run_cli("ddp", "--force-exclude", "--stdin-filename", "vendor/lib.py", "-", input=AMP)
    assert excluded.exit_code == 0 and excluded.stdout == AMP  # as Ruff: passed through unchanged
    assert run_cli("lint", "--force-exclude", "--stdin-filename", "vendor/lib.py", "-", input=AMP).exit_code == 0
    assert run_cli("lint", "--stdin-filename", "vendor/lib.py", "-", input=AMP).exit_code == 1


def test_stdin_input_errors(run_cli):
    bad = run_cli("ddp", "--stdin-filename", "bad.py", "-", input="import torch\nprint 'x'\n")
    assert bad.exit_code == 2 and bad.stdout == "" and bad.stderr.startswith("bad.py:2:")
    undecodable = run_cli("lint", "-", input=b"import torch\nx = '\xff'\n")
    assert undecodable.exit_code == 2 and undecodable.stderr.startswith("-:2:1: cannot decode")
    for args in (("-", "x.py"), ("--stdin-filename", "a.py", "x.py"), ("--vendor-runtime", "-"), ()):
        result = run_cli("ddp", *args, input=AMP)
        assert result.exit_code == 2 and result.stderr.startswith("error: "), args


# --- exit codes ------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["ddp", "amp"])
def test_a_preview_exits_1_only_when_a_change_is_due(tmp_path, run_cli, command):
    path = tmp_path / "train.py"
    path.write_bytes(NO_LOADER.read_bytes())
    assert run_cli(command, "--check", path).exit_code == 1  # a change is due
    assert run_cli(command, "--dry-run", path).exit_code == 1
    done = run_cli(command, path)
    assert done.exit_code == 1 and "need" in done.stdout  # findings that need a person remain
    assert ("NOT DONE under torchrun" in done.stdout) == (command == "ddp")
    check = run_cli(command, "--check", path)
    assert check.exit_code == 0, check.output  # nothing to change: findings do not count
    assert check.stdout.splitlines()[-1].startswith("Nothing to change (1 file checked)")
    assert run_cli(command, "--dry-run", path).exit_code == 0


def test_ddp_check_still_says_what_is_not_done(tmp_path, run_cli):
    path = tmp_path / "train.py"
    path.write_bytes(NO_LOADER.read_bytes())
    run_cli("ddp", path)
    check = run_cli("ddp", "--check", path)
    assert "finding" in check.stdout.splitlines()[-1] and "NOT DONE under torchrun" in check.stdout


@pytest.mark.parametrize("command", [(), ("ddp",), ("amp",), ("lint",)])
def test_help_documents_the_exit_codes(run_cli, command):
    text = run_cli(*command, "--help").stdout
    assert "Exit codes:" in text
    assert "a change is due" in text and "findings remain" in text and "usage or input error" in text

"""Settings as Ruff reads them: rule selectors checked, the closest settings file per file,
`--config`, `--force-exclude`, and ignore files (`.gitignore`, `.ignore`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURES

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"


def _tree(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _found(result) -> dict:
    """{relative path: sorted codes} from `lint --format json` output."""
    found: dict = {}
    for d in json.loads(result.stdout):
        found.setdefault(Path(d["path"]).as_posix(), set()).add(d["code"])
    return {k: sorted(v) for k, v in found.items()}


AMP = AMP_SCRIPT.read_text()


# --- selectors -------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [("lint",), ("ddp", "--dry-run"), ("amp", "--check")])
@pytest.mark.parametrize("option", ["--select", "--ignore", "--extend-select"])
@pytest.mark.parametrize("selector", ["TM999", "TM210", "TM0", "TM4067", "E501", "torch-cuda-ampp"])
def test_a_selector_that_selects_no_rule_is_a_usage_error(tmp_path, run_cli, command, option, selector):
    path = tmp_path / "train.py"
    path.write_text(AMP)
    result = run_cli(*command, option, f"TM406,{selector}" if option != "--ignore" else selector, path)
    assert result.exit_code == 2, result.output
    assert f"error: {option}: unknown rule selector {selector!r}" in result.stderr
    assert "All checks passed" not in result.stdout and "Nothing to change" not in result.output
    assert path.read_text() == AMP


def test_a_select_of_rules_the_command_does_not_run_is_a_usage_error(tmp_path, run_cli):
    path = tmp_path / "train.py"
    path.write_text(AMP)
    result = run_cli("ddp", "--dry-run", "--select", "TM405", path)  # dp-autocast: amp and lint only
    assert result.exit_code == 2
    assert "'TM405' selects no rule that `torchmigrate ddp` runs" in result.stderr
    assert run_cli("amp", "--check", "--select", "TM2", path).exit_code == 2
    assert run_cli("ddp", "--dry-run", "--ignore", "TM405", "--select", "TM406", path).exit_code == 1


@pytest.mark.parametrize("key", ["select", "extend-select", "ignore"])
def test_a_bad_selector_in_the_settings_is_a_usage_error_naming_the_file(tmp_path, run_cli, key):
    _tree(tmp_path, {"pyproject.toml": f'[tool.torchmigrate]\n{key} = ["TM999"]\n', "train.py": AMP})
    result = run_cli("lint", tmp_path / "train.py")
    assert result.exit_code == 2
    assert f"{tmp_path / 'pyproject.toml'} [tool.torchmigrate]: {key}: unknown rule selector 'TM999'" in result.stderr


def test_extend_select_adds_to_select(tmp_path, run_cli):
    _tree(tmp_path, {"train.py": AMP + "model = torch.nn.DataParallel(model)\n"})
    path = tmp_path / "train.py"
    only = _found(run_cli("lint", "--format", "json", "--select", "TM406", path))
    both = _found(run_cli("lint", "--format", "json", "--select", "TM406", "--extend-select", "TM306", path))
    assert only == {str(path.as_posix()): ["TM406"]} and both == {str(path.as_posix()): ["TM306", "TM406"]}


# --- the closest settings file ---------------------------------------------------------------

def test_each_file_uses_the_closest_settings_file(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {
        "pyproject.toml": '[tool.torchmigrate]\nselect = ["TM406"]\n',
        "train.py": AMP,
        "sub/pyproject.toml": '[project]\nname = "no-torchmigrate-table"\n',  # does not count
        "sub/a.py": AMP,
        "other/torchmigrate.toml": 'ignore = ["TM406"]\n',  # top-level keys; not merged with the root's
        "other/pyproject.toml": '[tool.torchmigrate]\nselect = ["TM2"]\n',  # torchmigrate.toml wins
        "other/b.py": AMP + "model = torch.nn.DataParallel(model)\n",
        "other/deep/c.py": AMP,
    })
    monkeypatch.chdir(tmp_path)
    result = run_cli("lint", "--format", "json", "--no-follow", ".")
    assert _found(result) == {"train.py": ["TM406"], "sub/a.py": ["TM406"], "other/b.py": ["TM306", "TM405"]}
    # the first path does not decide for the others any more
    assert _found(run_cli("lint", "--format", "json", "other/b.py", "train.py")) == {
        "other/b.py": ["TM306", "TM405"], "train.py": ["TM406"]}
    # the command line still wins over every file's settings
    assert _found(run_cli("lint", "--format", "json", "--select", "TM406", "other/b.py")) == {"other/b.py": ["TM406"]}


def test_excludes_are_relative_to_their_settings_file(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {
        "pyproject.toml": '[tool.torchmigrate]\nexclude = ["legacy/", "/top_only.py"]\n',
        "legacy/old.py": AMP, "keep.py": AMP, "top_only.py": AMP, "pkg/top_only.py": AMP,
        "pkg/torchmigrate.toml": 'extend-exclude = ["gen_*.py"]\n',
        "pkg/gen_a.py": AMP, "pkg/legacy/x.py": AMP,
    })
    monkeypatch.chdir(tmp_path)
    found = _found(run_cli("lint", "--format", "json", "--no-follow", "."))
    # pkg/ has its own settings: the root's excludes do not apply there
    assert sorted(found) == ["keep.py", "pkg/legacy/x.py", "pkg/top_only.py"]


def test_config_option_forces_one_file_relative_to_the_working_directory(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {
        "pyproject.toml": '[tool.torchmigrate]\nselect = ["TM2"]\n',
        "conf/ci.toml": 'select = ["TM406"]\nexclude = ["skip/"]\n',
        "src/a.py": AMP, "skip/b.py": AMP,
    })
    monkeypatch.chdir(tmp_path)
    result = run_cli("lint", "--format", "json", "--config", "conf/ci.toml", ".")
    assert _found(result) == {"src/a.py": ["TM406"]}
    missing = run_cli("lint", "--config", "conf/nope.toml", ".")
    assert missing.exit_code == 2 and "--config conf/nope.toml: no such file" in missing.stderr
    (tmp_path / "conf" / "bad.toml").write_text('selekt = ["TM2"]\n')
    bad = run_cli("lint", "--config", "conf/bad.toml", ".")
    assert bad.exit_code == 2 and "unknown keys: selekt" in bad.stderr


def test_force_exclude_applies_excludes_to_paths_given_by_name(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {"pyproject.toml": '[tool.torchmigrate]\nexclude = ["legacy"]\n',
                     "legacy/old.py": AMP, "build/gen.py": AMP, "train.py": AMP})
    monkeypatch.chdir(tmp_path)
    assert run_cli("lint", "legacy/old.py").exit_code == 1  # by name: taken, as Ruff does
    forced = run_cli("lint", "--force-exclude", "legacy/old.py", "build/gen.py")
    assert forced.exit_code == 0 and forced.stdout == "All checks passed!\n"
    assert "every path given is excluded" in forced.stderr
    assert _found(run_cli("lint", "--format", "json", "--force-exclude", "legacy/old.py", "train.py")) == {
        "train.py": ["TM406"]}
    assert run_cli("ddp", "--force-exclude", "legacy/old.py").exit_code == 0
    assert (tmp_path / "legacy" / "old.py").read_text() == AMP


# --- ignore files ----------------------------------------------------------------------------

def _git_init(root: Path) -> None:
    subprocess.run(["git", "init", "-q", str(root)], check=True)


def test_gitignore_is_respected_in_a_repository(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {".gitignore": "gen/\n*_pb2.py\n!keep_pb2.py\n", "gen/a.py": AMP, "x_pb2.py": AMP,
                     "keep_pb2.py": AMP, "src/train.py": AMP, "src/.gitignore": "local.py\n", "src/local.py": AMP})
    monkeypatch.chdir(tmp_path)
    everything = {"gen/a.py", "x_pb2.py", "keep_pb2.py", "src/train.py", "src/local.py"}
    assert set(_found(run_cli("lint", "--format", "json", "."))) == everything  # no repository: not read
    _git_init(tmp_path)
    assert set(_found(run_cli("lint", "--format", "json", "."))) == {"keep_pb2.py", "src/train.py"}
    # the root's .gitignore also applies when only a subfolder is searched
    (tmp_path / "src" / "gen").mkdir()
    (tmp_path / "src" / "gen" / "b.py").write_text(AMP)
    assert set(_found(run_cli("lint", "--format", "json", "src"))) == {"src/train.py"}
    assert set(_found(run_cli("lint", "--format", "json", "--no-respect-gitignore", "."))) == everything | {"src/gen/b.py"}
    # a file given by name is checked whatever the ignore files say (as Ruff; --force-exclude neither)
    assert set(_found(run_cli("lint", "--format", "json", "--force-exclude", "gen/a.py"))) == {"gen/a.py"}


def test_dot_ignore_and_info_exclude(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {".ignore": "scratch/\n", "scratch/a.py": AMP, "train.py": AMP})
    monkeypatch.chdir(tmp_path)
    assert set(_found(run_cli("lint", "--format", "json", "."))) == {"train.py"}  # .ignore: also outside git
    _git_init(tmp_path)
    (tmp_path / ".git" / "info").mkdir(exist_ok=True)
    (tmp_path / ".git" / "info" / "exclude").write_text("train.py\n")
    result = run_cli("lint", "--format", "json", ".")
    assert result.exit_code == 2 and "no Python files found" in result.stderr


def test_imports_are_not_followed_into_ignored_modules(tmp_path, run_cli, monkeypatch):
    _tree(tmp_path, {".gitignore": "generated.py\n", "generated.py": AMP,
                     "train.py": "import torch\nimport generated\n" + AMP})
    _git_init(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = run_cli("ddp", "train.py")
    assert "generated.py" not in result.output and (tmp_path / "generated.py").read_text() == AMP

"""The hooks in .pre-commit-hooks.yaml, run by the real `pre-commit` tool.

`pre-commit try-repo REPO HOOK` installs REPO into a fresh virtualenv (pip, from PyPI for
torchmigrate's dependencies) and runs HOOK on the staged files of the repository in the working
directory, exactly as a user's commit would. try-repo builds that virtualenv anew on every call
(about 20 s: it uses a throw-away store), so only the first test uses it; the others run
`pre-commit run` with a `.pre-commit-config.yaml` naming the same repository and commit, the way
users install the hooks, and share one cached environment (PRE_COMMIT_HOME is a temporary
directory of the test session).

REPO is a snapshot of this checkout's working tree (tracked files plus untracked, non-ignored
ones), committed to a temporary git repository. Pointing try-repo at the checkout itself would
test HEAD plus *tracked* changes only (its shadow commit leaves out new untracked files), so a
new module or hook file would silently be missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"
AMP_EXPECTED = FIXTURES / "TM406" / "from_import.out.py"
CLEAN = "import torch\n\nmodel = torch.nn.Linear(2, 2)\nprint(model(torch.zeros(1, 2)).sum())\n"

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "pre_commit", "--version"], capture_output=True).returncode != 0
    or shutil.which("git") is None,
    reason="needs git and pre-commit (pip install -e '.[test]')",
)


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GIT_", "PRE_COMMIT")) and k not in ("SKIP", "NO_COLOR", "FORCE_COLOR")}
    env.update(PRE_COMMIT_HOME=str(home), PRE_COMMIT_COLOR="never", GIT_TERMINAL_PROMPT="0",
               GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    return env


def _git(cwd: Path, *args: str, env: dict) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"git {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _init(repo: Path, env: dict) -> None:
    repo.mkdir(parents=True, exist_ok=True)
    _git(repo, "init", "-q", env=env)
    _git(repo, "config", "user.email", "t@example.com", env=env)
    _git(repo, "config", "user.name", "t", env=env)
    _git(repo, "config", "commit.gpgsign", "false", env=env)


def _working_tree_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True)
    if out.returncode == 0:
        names = [n for n in out.stdout.decode().split("\0") if n]
    else:  # not a git checkout (e.g. an unpacked sdist): take the package and its metadata
        names = [str(p.relative_to(ROOT)) for d in ("migrate", "rules", "runtime") for p in (ROOT / d).rglob("*.py")]
        names += ["pyproject.toml", "README.md", ".pre-commit-hooks.yaml"]
    return [n for n in names if (ROOT / n).is_file()]


@pytest.fixture(scope="session")
def precommit(tmp_path_factory):
    """(run, hook_repo): `run(project, hook, *args)` runs `pre-commit try-repo` in `project`."""
    base = tmp_path_factory.mktemp("precommit")
    home = base / "home"
    env = _env(home)
    hook_repo = base / "torchmigrate"
    _init(hook_repo, env)
    for name in _working_tree_files():
        target = hook_repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    assert (hook_repo / ".pre-commit-hooks.yaml").is_file()
    _git(hook_repo, "add", "-A", env=env)
    _git(hook_repo, "commit", "-q", "-m", "snapshot", env=env)
    _git(hook_repo, "branch", "-M", "main", env=env)  # the README's snippet names this branch
    rev = _git(hook_repo, "rev-parse", "HEAD", env=env).strip()

    def try_repo(project: Path, hook: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pre_commit", "try-repo", str(hook_repo), hook, "--verbose", *args],
            cwd=project, env=env, capture_output=True, text=True, timeout=900,
        )

    def run(project: Path, hook: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pre_commit", "run", hook, "--verbose", *args],
            cwd=project, env=env, capture_output=True, text=True, timeout=900,
        )

    config = (f"repos:\n  - repo: {hook_repo.as_posix()}\n    rev: {rev}\n"
              "    hooks:\n      - id: torchmigrate-lint\n      - id: torchmigrate-fix\n")
    return {"try_repo": try_repo, "run": run, "env": env, "config": config, "hook_repo": hook_repo, "rev": rev}


@pytest.fixture
def project(tmp_path, precommit):
    """A user's repository with one commit holding a README and the hooks' configuration."""
    env = precommit["env"]
    repo = tmp_path / "project"
    _init(repo, env)
    (repo / "README.md").write_text("# a project\n")
    (repo / ".pre-commit-config.yaml").write_text(precommit["config"])
    _git(repo, "add", "README.md", ".pre-commit-config.yaml", env=env)
    _git(repo, "commit", "-q", "-m", "init", env=env)
    return repo


def _stage(repo: Path, env: dict, files: dict) -> None:
    for name, content in files.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        _git(repo, "add", name, env=env)


def _explain(result) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def test_manifest_is_valid():
    out = subprocess.run([sys.executable, "-m", "pre_commit", "validate-manifest", str(ROOT / ".pre-commit-hooks.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_try_repo_staged_bad_file_fails_the_lint_hook(project, precommit):
    env = precommit["env"]
    _stage(project, env, {"train.py": AMP_SCRIPT.read_text(), "ok.py": CLEAN})
    result = precommit["try_repo"](project, "torchmigrate-lint")
    assert result.returncode == 1, _explain(result)
    assert "torchmigrate lint" in result.stdout and "Failed" in result.stdout
    assert "train.py:2:1: TM406 " in result.stdout
    assert "ok.py:" not in result.stdout
    assert (project / "train.py").read_text() == AMP_SCRIPT.read_text()  # lint never writes


def test_staged_bad_file_fails(project, precommit):
    env = precommit["env"]
    _stage(project, env, {"src/train.py": AMP_SCRIPT.read_text()})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 1, _explain(result)
    assert "src/train.py:2:1: TM406 " in result.stdout and "Failed" in result.stdout


def test_clean_file_passes(project, precommit):
    env = precommit["env"]
    _stage(project, env, {"pkg/clean.py": CLEAN, "pkg/other.py": "print('no torch here')\n"})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 0, _explain(result)
    assert "torchmigrate lint" in result.stdout and "Passed" in result.stdout


def test_no_python_files_staged_passes(project, precommit):
    env = precommit["env"]
    _stage(project, env, {"notes.txt": "torch.cuda.amp is old\n", "data.json": "{}\n"})
    for hook in ("torchmigrate-lint", "torchmigrate-fix"):
        result = precommit["run"](project, hook)
        assert result.returncode == 0, _explain(result)
        assert "(no files to check)" in result.stdout and "Skipped" in result.stdout


def test_unstaged_bad_file_is_not_checked(project, precommit):
    env = precommit["env"]
    _stage(project, env, {"clean.py": CLEAN})
    (project / "untracked.py").write_text(AMP_SCRIPT.read_text())
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 0, _explain(result)
    assert (project / "untracked.py").read_text() == AMP_SCRIPT.read_text()


def test_fix_hook_fixes_then_passes(project, precommit):
    env, run = precommit["env"], precommit["run"]
    # Hook arguments as users pass them; TM406 only, so the expected output is its fixture's.
    config = precommit["config"].replace("- id: torchmigrate-fix\n", "- id: torchmigrate-fix\n        args: [--select, TM406]\n")
    config = config.replace("- id: torchmigrate-lint\n", "- id: torchmigrate-lint\n        args: [--select, TM406]\n")
    assert config.count("args:") == 2
    (project / ".pre-commit-config.yaml").write_text(config)
    _git(project, "commit", "-q", "-am", "only TM406", env=env)
    _stage(project, env, {"train.py": AMP_SCRIPT.read_text()})
    result = run(project, "torchmigrate-fix")
    assert result.returncode == 1, _explain(result)  # files were modified: pre-commit stops the commit
    assert "files were modified by this hook" in result.stdout
    assert (project / "train.py").read_text() == AMP_EXPECTED.read_text()
    _git(project, "add", "train.py", env=env)
    again = run(project, "torchmigrate-fix")
    assert again.returncode == 0, _explain(again)
    lint = run(project, "torchmigrate-lint", "--all-files")
    assert lint.returncode == 0, _explain(lint)


def test_excluded_staged_file_is_skipped(project, precommit):
    """pre-commit names every staged file: the shipped hooks pass --force-exclude, so the
    project's `exclude` patterns hold for them as for `torchmigrate lint .`."""
    env = precommit["env"]
    _stage(project, env, {"pyproject.toml": '[tool.torchmigrate]\nexclude = ["legacy/"]\n',
                          "legacy/old.py": AMP_SCRIPT.read_text()})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 0, _explain(result)
    _stage(project, env, {"train.py": AMP_SCRIPT.read_text()})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 1 and "train.py:2:1: TM406" in result.stdout and "legacy" not in result.stdout


def _readme_snippet() -> str:
    """The first `.pre-commit-config.yaml` example of the README (the one with `rev:`)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = next(b for b in text.split("```yaml\n")[1:] if "rev:" in b.split("```")[0])
    return block.split("```")[0]


def test_readme_snippet_works_after_autoupdate_freeze(project, precommit):
    """The README's snippet as a user copies it (only the URL is this checkout's): `rev: main`
    installs, and `pre-commit autoupdate --freeze` pins the branch's full SHA, which pre-commit
    then uses without its mutable-reference warning."""
    env = precommit["env"]
    snippet = _readme_snippet()
    assert "rev: main" in snippet and "https://github.com/OWNER/torchmigrate" in snippet
    config = snippet.replace("https://github.com/OWNER/torchmigrate", precommit["hook_repo"].as_posix())
    (project / ".pre-commit-config.yaml").write_text(config)
    frozen = subprocess.run([sys.executable, "-m", "pre_commit", "autoupdate", "--freeze"], cwd=project, env=env,
                            capture_output=True, text=True, timeout=300)
    assert frozen.returncode == 0, _explain(frozen)
    assert f"rev: {precommit['rev']}" in (project / ".pre-commit-config.yaml").read_text()
    _git(project, "add", ".pre-commit-config.yaml", env=env)
    _stage(project, env, {"train.py": AMP_SCRIPT.read_text()})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 1 and "train.py:2:1: TM406 " in result.stdout, _explain(result)
    assert "mutable reference" not in result.stdout + result.stderr


def _readme_local_snippet() -> str:
    """The README's `repo: local` example (torchmigrate from the developer's own environment)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return next(b.split("```")[0] for b in text.split("```yaml\n")[1:] if "repo: local" in b.split("```")[0])


def test_readme_local_hook_respects_exclude_and_says_to_install_it(project, precommit):
    """The local hook as the README gives it: staged files excluded by the project's settings
    are skipped (--force-exclude), the others checked; the README says to `pre-commit install`."""
    env = dict(precommit["env"])
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # language: system
    (project / ".pre-commit-config.yaml").write_text(_readme_local_snippet())
    _stage(project, env, {".pre-commit-config.yaml": _readme_local_snippet(),
                          "pyproject.toml": '[tool.torchmigrate]\nexclude = ["legacy/"]\n',
                          "legacy/old.py": AMP_SCRIPT.read_text(), "train.py": CLEAN})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 0, _explain(result)
    _stage(project, env, {"train.py": AMP_SCRIPT.read_text()})
    result = precommit["run"](project, "torchmigrate-lint")
    assert result.returncode == 1 and "train.py:2:1: TM406" in result.stdout and "legacy" not in result.stdout, \
        _explain(result)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### pre-commit"):text.index("### GitHub Actions")]
    assert "pre-commit install" in section
    install = subprocess.run([sys.executable, "-m", "pre_commit", "install"], cwd=project, env=env,
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0 and (project / ".git" / "hooks" / "pre-commit").is_file(), _explain(install)

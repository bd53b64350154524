"""The lint cache: a hit gives exactly the output a fresh run gives, and nothing it depends on
can change without the result being computed again (file, configuration, the modules of the
program, the tool), whatever happens to the cache folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import libcst as cst
import pytest

from conftest import FIXTURES
from torchmigrate.engine import cache, runner
from torchmigrate.cli import catalogue
from torchmigrate.finding import Safety
from torchmigrate.program import build as program_build
from torchmigrate.rule import Rule
from torchmigrate.rules import _REGISTRY, all_rules

SCRIPTS = FIXTURES / "scripts"
FORMATS = [("--format", "text"), ("--format", "json"), ("--format", "github"), ("--format", "sarif"),
           ("--statistics",), ("--statistics", "--format", "json"), ("--diff",), ("--fix", "--diff"),
           ("--diff", "--show-fixes")]


@pytest.fixture
def project(tmp_path):
    """Three training scripts with findings, and a file that does not parse."""
    root = tmp_path / "project"
    root.mkdir()
    for name in ("apex_amp.py", "local_rank_launch.py", "dataparallel.py"):
        shutil.copy(SCRIPTS / name, root / name)
    (root / "broken.py").write_text("import torch\ndef f(:\n")
    return root


@pytest.fixture
def processed(monkeypatch):
    """The files the engine processes (a cache hit processes none)."""
    seen = []
    real = runner.process_file

    def spy(path, job):
        seen.append(Path(path).name)
        return real(path, job)

    monkeypatch.setattr(runner, "process_file", spy)
    return seen


def lint(run_cli, *args):
    result = run_cli("lint", "-j", "1", *map(str, args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: " ".join(f))
def test_a_hit_gives_the_output_of_a_fresh_run(project, run_cli, processed, fmt):
    fresh = lint(run_cli, "--no-cache", *fmt, project)
    assert fresh[0] == 2  # findings, and a file that cannot be checked
    if "--diff" in fmt:
        assert fresh[1].count("+++ ") == 3, fresh[1]  # the three scripts' diffs
    first = lint(run_cli, *fmt, project)
    processed.clear()
    warm = lint(run_cli, *fmt, project)
    assert fresh == first == warm
    if fmt in (("--format", "json"), ("--format", "sarif")):
        return  # these carry each fix's edits, which the cache does not keep: always computed
    assert processed == ["broken.py"]  # an input error is never stored


def test_warnings_about_ignore_comments_are_kept_with_the_result(tmp_path, run_cli, processed):
    (tmp_path / "t.py").write_text("import torch\nx = torch.zeros(1)  # torchmigrate: ignore[TM999]\n")
    fresh = lint(run_cli, "--no-cache", tmp_path / "t.py")
    assert "warning: Invalid rule code provided to `# torchmigrate: ignore` at" in fresh[2] and "t.py:2: TM999" in fresh[2]
    lint(run_cli, tmp_path / "t.py")
    processed.clear()
    assert lint(run_cli, tmp_path / "t.py") == fresh and processed == []


def test_a_warm_run_imports_no_libcst(project, tmp_path):
    (project / "broken.py").unlink()
    env = {**os.environ, "TORCHMIGRATE_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"}
    command = [sys.executable, "-X", "importtime", "-m", "torchmigrate", "lint", str(project)]
    cold = subprocess.run(command, capture_output=True, text=True, env=env)
    warm = subprocess.run(command, capture_output=True, text=True, env=env)
    assert cold.returncode == warm.returncode == 1 and cold.stdout == warm.stdout
    assert "libcst" in cold.stderr
    assert "libcst" not in warm.stderr


def test_editing_a_file_invalidates_its_result(project, run_cli, processed):
    before = lint(run_cli, "--select", "TM406", project)[1]
    processed.clear()
    assert lint(run_cli, "--select", "TM406", project)[1] == before and processed == ["broken.py"]
    script = project / "dataparallel.py"
    script.write_text(script.read_text() + "\nscaler = torch.cuda.amp.GradScaler()\n")
    processed.clear()
    after = lint(run_cli, "--select", "TM406", project)[1]
    assert sorted(processed) == ["broken.py", "dataparallel.py"]
    assert "dataparallel.py" not in before and "dataparallel.py" in after


def test_a_configuration_change_invalidates(project, run_cli):
    (project / "broken.py").unlink()
    _, everything, _ = lint(run_cli, "--exit-zero", project)
    assert "TM102" in everything
    (project / "pyproject.toml").write_text('[tool.torchmigrate]\nignore = ["TM102"]\n')
    _, ignored, _ = lint(run_cli, "--exit-zero", project)
    assert "TM102" not in ignored and ignored != everything
    (project / "pyproject.toml").write_text('[tool.torchmigrate]\nselect = ["TM102"]\n')
    _, selected, _ = lint(run_cli, "--exit-zero", project)
    assert {line.split()[1] for line in selected.splitlines() if ": TM" in line} == {"TM102"}
    (project / "pyproject.toml").unlink()
    assert lint(run_cli, "--exit-zero", project)[1] == everything


class FakeViewRule(Rule):
    """
    ## What it does
    Reports what the rest of the program says about the module (tests only).

    ## Why is this bad?
    It is not.
    """

    code = "TM994"
    name = "fake-view"
    summary = "Report the parameters that receive a wrapped model from another module"
    safety = Safety.MANUAL
    commands = frozenset({"lint"})

    def leave_Module(self, node: cst.Module) -> None:
        for func, params in sorted(self.ctx.program.wrapped_params.items()):
            self.report(node, f"{func} receives a wrapped model in {', '.join(sorted(params))}")


def test_a_change_to_another_module_of_the_program_invalidates(tmp_path, run_cli, processed, monkeypatch):
    """engine.py does not change, but what train.py passes it does."""
    all_rules()
    monkeypatch.setitem(_REGISTRY, FakeViewRule.code, FakeViewRule)
    (tmp_path / "engine.py").write_text("import torch\n\n\ndef evaluate(model, loader):\n    return model(loader)\n")
    train = tmp_path / "train.py"
    train.write_text("import torch\nimport torchmigrate.runtime as tm\nfrom engine import evaluate\n"
                     "model = tm.wrap_model(torch.nn.Linear(2, 2))\nopt = torch.optim.SGD(model.parameters())\n"
                     "evaluate(model, [])\n")
    first = lint(run_cli, "--select", "TM994", tmp_path)[1]
    assert "engine.py:1:1: TM994 evaluate receives a wrapped model in model" in first
    processed.clear()
    assert lint(run_cli, "--select", "TM994", tmp_path)[1] == first and processed == []
    train.write_text(train.read_text().replace("evaluate(model, [])", "evaluate(torch.nn.Linear(2, 2), [])"))
    second = lint(run_cli, "--select", "TM994", tmp_path)[1]
    assert "engine.py" not in second
    assert sorted(processed) == ["engine.py", "train.py"]


def test_a_new_module_file_rebuilds_the_program(tmp_path, run_cli, monkeypatch):
    builds = []
    real = program_build.build
    monkeypatch.setattr(program_build, "build", lambda *a, **k: builds.append(1) or real(*a, **k))
    (tmp_path / "train.py").write_text("import torch\nimport helpers\n")
    lint(run_cli, tmp_path / "train.py")
    lint(run_cli, tmp_path / "train.py")
    assert len(builds) == 1
    (tmp_path / "helpers.py").write_text("import torch\n")  # `import helpers` now finds a module
    lint(run_cli, tmp_path / "train.py")
    assert len(builds) == 2


def test_editing_one_script_of_a_folder_recomputes_that_programs_facts_only(tmp_path, run_cli, monkeypatch):
    """A folder of separate scripts (examples, experiments): after one is edited, the build
    computes the facts of that script's program only, and its result reflects the edit."""
    from torchmigrate.program import facts as program_facts

    computed = []
    real = program_facts.compute
    monkeypatch.setattr(program_facts, "compute",
                        lambda part, *a, **k: computed.append(sorted(p.name for p in part.modules)) or real(part, *a, **k))
    for name in ("apex_amp.py", "local_rank_launch.py", "dataparallel.py"):
        shutil.copy(SCRIPTS / name, tmp_path / name)
    first = lint(run_cli, tmp_path)[1]
    assert sorted(computed) == [["apex_amp.py"], ["dataparallel.py"], ["local_rank_launch.py"]]
    computed.clear()
    edited = tmp_path / "dataparallel.py"
    edited.write_text(edited.read_text() + "\nx = 1\n")
    second = lint(run_cli, tmp_path)[1]
    assert computed == [["dataparallel.py"]]
    assert second == first  # (the appended line changes no finding)
    edited.write_text("import torch\nmodel = torch.nn.DataParallel(torch.nn.Linear(2, 2))\n")
    computed.clear()
    third = lint(run_cli, tmp_path)[1]
    assert computed == [["dataparallel.py"]] and third != first


def test_a_new_tool_version_invalidates_and_old_versions_are_pruned(project, run_cli, processed, monkeypatch, tmp_path):
    root = tmp_path / "cache"
    lint(run_cli, "--cache-dir", root, project)
    old = [root / f"{i:032x}" for i in range(cache.KEEP + 1)]
    for i, folder in enumerate(old):
        folder.mkdir()
        os.utime(folder, (1000 + i, 1000 + i))
    processed.clear()
    monkeypatch.setattr(cache, "_fingerprint", "f" * 32)
    lint(run_cli, "--cache-dir", root, project)
    assert len(processed) == 4  # everything computed again
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(kept) == cache.KEEP and "f" * 32 in kept  # the newest versions, this one included


def test_the_fingerprint_covers_every_source_of_the_tool(monkeypatch):
    def of(changed=None):
        monkeypatch.setattr(cache, "_fingerprint", None)
        return cache.fingerprint(lambda path: "edited" if changed and path.endswith(changed) else "same")

    base = of()
    for source in (os.path.join("rules", "launch", "plan.py"), os.path.join("launchers", "shell.py"),
                   os.path.join("engine", "process.py"),
                   os.path.join("program", "facts.py")):
        assert of(source) != base, source
    monkeypatch.setattr(cache, "_fingerprint", None)


def test_stat_signatures_see_an_edit_that_keeps_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.Hashes, "RACY_NS", 0)
    path = tmp_path / "f.py"
    path.write_text("x = 1\n")
    before = os.stat(path)
    index = tmp_path / "hashes.json"
    hashes = cache.Hashes(index)
    first = hashes.of(str(path))
    hashes.save(cache.Store(tmp_path / "store", "t"))  # (writes `index` through the store's writer)
    assert json.loads(index.read_text())["files"][str(path)][4] == first
    time.sleep(0.01)
    path.write_text("x = 2\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same mtime: ctime moved
    assert cache.Hashes(index).of(str(path)) != first


def test_a_file_hashed_just_after_a_change_is_not_remembered(tmp_path):
    path = tmp_path / "f.py"
    path.write_text("x = 1\n")
    hashes = cache.Hashes(tmp_path / "hashes.json")
    hashes.of(str(path))
    assert not hashes.changed  # written within RACY_NS: hashed again next time


def test_corrupt_entries_are_ignored(project, run_cli, tmp_path, monkeypatch):
    monkeypatch.setattr(cache.Hashes, "RACY_NS", 0)  # hashes.json too
    root = tmp_path / "cache"
    expected = lint(run_cli, "--cache-dir", root, project)
    garbage = [b"", b"{", b"\x00\xff\xfe", b"[]", b'{"key": 1, "records": 3}', b'{"files": {"x": 1}}',
               b'{"key": null}', b"null", b'{"files": {"/x": [1, 2, 3, 4, 5]}}', b'{"files": []}']
    entries = [p for p in root.rglob("*") if p.is_file() and p.name != ".gitignore"]
    assert {p.parent.name for p in entries} >= {"files", "programs", "runs", "cache"}  # hashes.json in cache/
    for i, entry in enumerate(entries):
        entry.write_bytes(garbage[i % len(garbage)])
    assert lint(run_cli, "--cache-dir", root, project) == expected
    assert lint(run_cli, "--cache-dir", root, project) == expected


def test_parallel_runs_share_one_cache(project, tmp_path):
    (project / "broken.py").unlink()
    env = {**os.environ, "TORCHMIGRATE_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"}
    command = [sys.executable, "-m", "torchmigrate", "lint", "-j", "1", "--format", "json", str(project)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) for _ in range(4)]
    outputs = [run.communicate() for run in runs]
    assert {run.returncode for run in runs} == {1}
    assert len({out for out, _ in outputs}) == 1
    entries = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert not [p for p in entries if p.name.startswith(".tmp-")]
    for entry in entries:
        if entry.suffix == ".json":
            json.loads(entry.read_bytes())
    again = subprocess.run(command, capture_output=True, env=env)
    assert again.stdout == outputs[0][0]


def test_where_the_cache_goes(tmp_path, run_cli, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("import torch\n")
    monkeypatch.delenv(cache.ENV)
    monkeypatch.chdir(tmp_path / "src")
    lint(run_cli, "train.py")
    assert (tmp_path / cache.DIRNAME / ".gitignore").read_text() == cache.GITIGNORE  # beside pyproject.toml
    monkeypatch.setenv(cache.ENV, str(tmp_path / "from-env"))
    lint(run_cli, "train.py")
    assert (tmp_path / "from-env" / ".gitignore").exists()
    lint(run_cli, "--cache-dir", tmp_path / "from-option", "train.py")
    assert (tmp_path / "from-option" / ".gitignore").exists()
    lint(run_cli, "--no-cache", "--cache-dir", tmp_path / "never", "train.py")
    assert not (tmp_path / "never").exists()


def test_fix_fixes_again_what_was_fixed_before(tmp_path, run_cli):
    """A fix writes the file: its result is not kept, so the same bytes are fixed again."""
    script = tmp_path / "train.py"
    before, after = (FIXTURES / "TM406" / "from_import.in.py"), (FIXTURES / "TM406" / "from_import.out.py")
    for _ in range(2):
        script.write_bytes(before.read_bytes())
        assert lint(run_cli, "--select", "TM406", script)[0] == 1
        assert lint(run_cli, "--select", "TM406", "--fix", script)[0] == 0
        assert script.read_text() == after.read_text()
        assert lint(run_cli, "--select", "TM406", script)[0] == 0


def test_catalogue_descriptions_match_the_rules(tmp_path):
    catalogue.use(cache.Store(tmp_path, "t"))
    try:
        described = catalogue._describe()  # the rules, described into the store
        cached = catalogue._cached()
    finally:
        catalogue.use(None)
    assert described == all_rules() and len(cached) == len(described)
    for rule, info in zip(described, cached):
        assert (rule.code, rule.name, rule.summary, rule.safety, rule.commands, rule.documentation()) == \
            (info.code, info.name, info.summary, info.safety, info.commands, info.documentation())


def test_a_recalled_program_has_the_same_views(tmp_path):
    (tmp_path / "utils.py").write_text("def save(model):\n    return model.state_dict()\n")
    (tmp_path / "train.py").write_text("import torch\nfrom utils import save\nmodel = torch.nn.Linear(1, 1)\n"
                                       "opt = torch.optim.SGD(model.parameters())\nsave(model)\n")
    files = [tmp_path / "train.py", tmp_path / "utils.py"]

    def build(fs=None, parts=None, scans=None):
        return program_build.build(files, [], True, fs=fs or program_build.PLAIN, parts=parts, scans=scans)

    made = cache.LintCache(tmp_path / "cache").program(files, [], True, (), build)
    recalled = cache.LintCache(tmp_path / "cache").program(files, [], True, (), lambda *a: pytest.fail("rebuilt"))
    assert made.views and {k: recalled.views.get(k) for k in made.views} == made.views
    assert (made.files, made.entries, made.followed, made.groups) == \
        (recalled.files, recalled.entries, recalled.followed, recalled.groups)


def test_a_cache_that_cannot_be_written_is_no_cache(project, run_cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    expected = lint(run_cli, "--no-cache", project)
    assert lint(run_cli, "--cache-dir", blocker / "cache", project) == expected
    assert blocker.read_text() == "not a folder"


def test_a_warm_run_writes_nothing(project, run_cli, tmp_path, monkeypatch):
    monkeypatch.setattr(cache.Hashes, "RACY_NS", 0)
    (project / "broken.py").unlink()
    root = tmp_path / "cache"
    lint(run_cli, "--cache-dir", root, project)

    def state():
        return {p: p.stat().st_mtime_ns for p in root.rglob("*")}

    before = state()
    time.sleep(0.01)
    lint(run_cli, "--cache-dir", root, project)
    assert state() == before


def test_a_program_handing_loaders_to_another_module_is_cached(tmp_path, run_cli, processed):
    """A view with a dict of sets in a dict (the loaders train.py hands engine.evaluate) is
    stored and recalled (before, the cold run stopped with "frozenset is not JSON serializable")."""
    (tmp_path / "engine.py").write_text("import torch\n\n\ndef evaluate(model, loader):\n"
                                        "    return [model(x) for x in loader]\n")
    (tmp_path / "train.py").write_text("import torch\nfrom torch.utils.data import DataLoader\nfrom engine import evaluate\n"
                                       "model = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                                       "val_loader = DataLoader(torch.randn(4, 2), batch_size=2)\nevaluate(model, val_loader)\n")
    first = lint(run_cli, tmp_path)
    assert first[0] in (0, 1), first
    processed.clear()
    assert lint(run_cli, tmp_path) == first and processed == []


def test_a_module_view_survives_the_cache_unchanged():
    """Every kind of ModuleView field (sets, dicts of sets, of positions, of per-output sets
    whose order matters) comes back from the stored JSON as it went in."""
    import json

    from torchmigrate.engine.cache import _view, _view_json
    from torchmigrate.program.classes import OptimizerWrapper
    from torchmigrate.program.view import ModuleView

    view = ModuleView(is_entry=False, followed=True, wrapped_params={"evaluate": frozenset({"model"})},
                      loader_classes=frozenset({"AudioDataLoader"}), dp_classes={"BalancedDataParallel": 1},
                      forward_outputs={"nets.Net": (frozenset({"body", "cls"}), frozenset({"aux"}))},
                      iterator_builders={"build_iterator": (0,)}, optimizer_builders={"engine.train": ((1, "model"),)},
                      loader_params={"evaluate": {"loader": frozenset({"eval"})}},
                      flag_args={"make_loader": {"shuffle": frozenset({True, False})}},
                      optimizer_wrappers={"ScheduledOptim": OptimizerWrapper("_optimizer", True)},
                      call_writes={"f|save": (frozenset({1}), frozenset({"path"}))},
                      program_trains=True)
    assert _view(json.loads(json.dumps(_view_json(view)))) == view

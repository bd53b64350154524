"""CLI contract: commands, --dry-run/--check, exit codes, bad input never loses work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"
AMP_EXPECTED = FIXTURES / "TM406" / "from_import.out.py"


@pytest.fixture
def amp_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(AMP_SCRIPT.read_bytes())
    return path


def test_cli_does_not_import_torch():
    code = (
        "import sys; from torchmigrate.cli.commands import main; import torchmigrate.rules as r; r.all_rules();"
        "from torchmigrate.engine.runner import runtime_source; runtime_source();"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch.'))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_python_dash_m_and_console_script(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torchmigrate", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and "torchmigrate" in out.stdout
    exe = Path(sys.executable).with_name("torchmigrate")
    if exe.exists():
        assert subprocess.run([str(exe), "rules"], capture_output=True).returncode == 0


def test_dry_run_prints_diff_and_leaves_file(amp_file, run_cli):
    before = amp_file.read_bytes()
    result = run_cli("ddp", "--dry-run", "--select", "TM406", amp_file)
    assert result.exit_code == 1  # a change is due
    assert '-scaler = GradScaler(enabled=use_amp)' in result.stdout
    assert '+scaler = GradScaler("cuda", enabled=use_amp)' in result.stdout
    assert "+from torch.amp import autocast, GradScaler" in result.stdout
    assert "\x1b[" not in result.stdout  # not a terminal: no colour
    assert amp_file.read_bytes() == before


def test_diff_alias_and_check(amp_file, run_cli):
    before = amp_file.read_bytes()
    assert run_cli("amp", "--diff", amp_file).exit_code == 1
    result = run_cli("ddp", "--check", amp_file)
    assert result.exit_code == 1 and result.stdout.count("---") == 0
    assert amp_file.read_bytes() == before


def test_in_place_rewrite_then_clean(amp_file, run_cli):
    result = run_cli("ddp", "--select", "TM406", amp_file)
    assert result.exit_code == 0, result.output
    assert amp_file.read_text() == AMP_EXPECTED.read_text()
    assert "TM406" in result.output
    again = run_cli("ddp", "--check", "--select", "TM406", amp_file)
    assert again.exit_code == 0
    assert "Nothing to change" in again.output


def test_lint_reports_and_fixes(amp_file, run_cli):
    result = run_cli("lint", amp_file)
    assert result.exit_code == 1
    assert f"{amp_file}:2:1: TM406" in result.stdout
    assert "fixable with --fix" in result.stdout
    assert run_cli("lint", "--exit-zero", amp_file).exit_code == 0
    fixed = run_cli("lint", "--fix", "--select", "TM406", amp_file)
    assert fixed.exit_code == 0, fixed.output
    assert amp_file.read_text() == AMP_EXPECTED.read_text()
    assert run_cli("lint", "--select", "TM406", amp_file).exit_code == 0


def test_lint_json(amp_file, run_cli):
    result = run_cli("lint", "--format", "json", amp_file)
    data = json.loads(result.stdout)
    assert {d["code"] for d in data} == {"TM406"}
    assert all(d["line"] >= 1 and d["column"] >= 1 for d in data)


def test_select_and_ignore(amp_file, run_cli):
    assert run_cli("lint", "--ignore", "TM4", amp_file).exit_code == 0
    assert run_cli("lint", "--select", "TM406", amp_file).exit_code == 1
    assert run_cli("lint", "--select", "TM2", amp_file).exit_code == 0


def test_rules_and_explain(run_cli):
    listing = run_cli("rules")
    assert listing.exit_code == 0 and "TM406" in listing.stdout
    data = json.loads(run_cli("rules", "--format", "json").stdout)
    assert any(r["code"] == "TM406" for r in data)
    explained = run_cli("explain", "TM406")
    assert explained.exit_code == 0
    assert "torch.cuda.amp" in explained.stdout and '    scaler = GradScaler("cuda", enabled=use_amp)' in explained.stdout
    assert run_cli("explain", "torch-cuda-amp").exit_code == 0
    assert run_cli("explain", "TM999").exit_code == 2


def test_report_file_text_and_json(amp_file, tmp_path, run_cli):
    report = tmp_path / "report.json"
    run_cli("ddp", "--dry-run", "--select", "TM406", "--report", report, amp_file)
    data = json.loads(report.read_text())
    assert data["changes"]["TM406"] >= 3 and data["files_changed"] == [str(amp_file)]
    text = tmp_path / "report.txt"
    run_cli("ddp", "--dry-run", "--report", text, amp_file)
    assert "TM406" in text.read_text() and "would be changed" in text.read_text()


# --- bad input -----------------------------------------------------------------------------

BAD = {
    "py2.py": b"import torch\nprint 'hello'\n",
    "async_kw.py": b"import torch\nx = torch.zeros(1)\nx.cuda(async=True)\n",
    "undecodable.py": b"import torch\nname = '\xff\xfe\xfa'\n",
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_exit_2_file_untouched_others_processed(tmp_path, run_cli, name):
    bad = tmp_path / name
    bad.write_bytes(BAD[name])
    good = tmp_path / "good.py"
    good.write_bytes(AMP_SCRIPT.read_bytes())
    result = run_cli("ddp", "--select", "TM406", bad, good)
    assert result.exit_code == 2
    assert bad.read_bytes() == BAD[name]
    assert good.read_text() == AMP_EXPECTED.read_text()  # the other file is still migrated
    line = next(l for l in result.stderr.splitlines() if l.startswith(str(bad)))
    path, lineno, col, message = line.split(":", 3)
    assert int(lineno) >= 1 and int(col) >= 1 and message.strip()
    assert list(tmp_path.glob(".*.tmp")) == []


def test_syntax_error_position(tmp_path, run_cli):
    bad = tmp_path / "py2.py"
    bad.write_bytes(BAD["py2.py"])
    result = run_cli("lint", bad)
    assert result.exit_code == 2
    assert f"{bad}:2:" in result.stderr and "syntax error" in result.stderr


def test_missing_path_and_empty_directory(tmp_path, run_cli):
    result = run_cli("lint", tmp_path / "nope.py")
    assert result.exit_code == 2 and "no such file" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("hi")
    result = run_cli("ddp", empty)
    assert result.exit_code == 2 and "no Python files" in result.stderr


def test_dry_run_and_check_never_write_even_with_errors(tmp_path, run_cli):
    good = tmp_path / "good.py"
    good.write_bytes(AMP_SCRIPT.read_bytes())
    bad = tmp_path / "bad.py"
    bad.write_bytes(BAD["py2.py"])
    for flag in ("--dry-run", "--check"):
        assert run_cli("ddp", flag, good, bad).exit_code == 2
        assert good.read_bytes() == AMP_SCRIPT.read_bytes()


def test_directory_discovery_skips_venv_git_build(tmp_path, run_cli):
    for folder in (".git", "venv", "build", "__pycache__", "pkg"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.py").write_bytes(AMP_SCRIPT.read_bytes())
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr\n")
    result = run_cli("lint", "--format", "json", tmp_path)
    paths = {Path(d["path"]).parent.name for d in json.loads(result.stdout)}
    assert paths == {"pkg"}


def test_config_select_ignore_exclude(tmp_path, run_cli, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nignore = ["TM406"]\nexclude = ["legacy"]\n')
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "old.py").write_bytes(AMP_SCRIPT.read_bytes())
    (tmp_path / "train.py").write_bytes(AMP_SCRIPT.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert run_cli("lint", ".").exit_code == 0
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nselect = ["TM4"]\nexclude = ["legacy"]\n')
    result = run_cli("lint", "--format", "json", ".")
    assert {Path(d["path"]).name for d in json.loads(result.stdout)} == {"train.py"}
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nbogus = 1\n')
    assert run_cli("lint", ".").exit_code == 2


def test_a_bad_settings_file_beside_the_program_is_a_clear_error(tmp_path, run_cli):
    """`ddp train.py` also looks for launch files in the project's folders; a settings file
    there that cannot be read stops the run with its message (exit 2, no traceback), before
    anything is written."""
    source = "import torch\nprint(torch.zeros(1))\n"
    (tmp_path / "train.py").write_text(source)
    (tmp_path / "tools" / "scripts").mkdir(parents=True)
    (tmp_path / "tools" / "pyproject.toml").write_text("[tool.torchmigrate]\nbogus = 1\n")
    result = run_cli("ddp", tmp_path / "train.py")
    assert result.exit_code == 2, result.output
    assert "unknown keys: bogus" in result.output and "Traceback" not in result.output
    assert (tmp_path / "train.py").read_text() == source


def test_suppressions(tmp_path, run_cli):
    path = tmp_path / "t.py"
    path.write_text("from torch.cuda.amp import autocast  # torchmigrate: ignore[TM406]\n")
    assert run_cli("lint", path).exit_code == 0
    path.write_text("# torchmigrate: skip-file\nfrom torch.cuda.amp import autocast\n")
    assert run_cli("lint", path).exit_code == 0
    assert run_cli("ddp", path).exit_code == 0
    assert "torch.cuda.amp" in path.read_text()


def test_the_report_opens_with_what_the_program_does_under_torchrun(tmp_path, run_cli):
    """The summary names what was made distributed, with where, and says what was not."""
    scripts = Path(__file__).parent.parent / "fixtures" / "scripts"
    for name in ("toplevel_classifier.py", "maml_functional.py", "helper_loaders.py", "token_stream_lm.py"):
        shutil.copy(scripts / name, tmp_path / name)
    plain = run_cli("ddp", "--dry-run", tmp_path / "toplevel_classifier.py").output
    assert "Under torchrun:" in plain and "done: models wrapped in DDP (gradients averaged): " in plain
    assert "done: training data sharded" in plain and "NOT DONE" not in plain
    functional = run_cli("ddp", "--dry-run", tmp_path / "maml_functional.py").output
    assert "done: functional models kept in sync" in functional
    assert "done: models wrapped in DDP" not in functional
    drawn = run_cli("ddp", "--dry-run", tmp_path / "helper_loaders.py").output
    assert "done: random configuration drawn once and shared by every rank" in drawn
    stream = run_cli("ddp", "--dry-run", tmp_path / "token_stream_lm.py").output
    assert "done: training data sharded" in stream


def test_positions_after_an_in_place_migration_point_into_the_written_file(tmp_path):
    """The report of `ddp --dry-run` points into the file as it is; the report of an in-place
    `ddp` into the file as written (lines added above a finding move it down)."""
    import re

    script = tmp_path / "train.py"
    shutil.copy(FIXTURES / "scripts" / "toplevel_classifier.py", script)
    original = script.read_text().splitlines()
    finding = re.compile(r"train\.py:(\d+):(\d+): (TM\d+)")
    preview = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--dry-run", str(script)],
                             capture_output=True, text=True)
    done = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", str(script)], capture_output=True, text=True)
    before, after = finding.findall(preview.stderr), finding.findall(done.stdout)
    written = script.read_text().splitlines()
    assert before and [c for _, _, c in before] == [c for _, _, c in after], (preview.stderr, done.stdout)
    assert any(b[0] != a[0] for b, a in zip(before, after))  # the migration moved them
    for (line, col, code), (new_line, new_col, _) in zip(before, after):
        assert new_col == col
        assert original[int(line) - 1].strip() == written[int(new_line) - 1].strip(), (code, line, new_line)


# --- decisions instead of questions: the batch policy and advice ----------------------------

TRAIN_WITH_ITEM = """\
import torch
from torch.utils.data import DataLoader

torch.manual_seed(0)
loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
for epoch in range(3):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()
"""


def test_ddp_decides_the_batch_and_the_streams(tmp_path, run_cli):
    """Default policy: the global batch is kept and the ranks' streams part at the loop; the
    `.item()` every step is a note, so nothing needs attention and the run exits 0."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_ITEM)
    result = run_cli("ddp", script)
    out = script.read_text()
    assert "batch_size=tm.per_rank_batch(args.batch_size)" in out and "lr=args.lr)" in out
    assert "tm.seed_per_rank()\nfor epoch" in out and "TODO" not in out
    assert "done: the original's global batch kept" in result.output
    assert "Notes:" in result.output and "TM604" in result.output.split("Notes:")[1]
    assert "0 findings need attention. 1 note of advice" in result.output
    assert result.exit_code == 0, result.output


def test_ddp_batch_policy_per_gpu_option_and_setting(tmp_path, run_cli):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_ITEM)
    run_cli("ddp", "--batch-policy", "per-gpu", script)
    out = script.read_text()
    assert "batch_size=args.batch_size," in out and "lr=args.lr * tm.world_size())" in out
    script.write_text(TRAIN_WITH_ITEM)
    (tmp_path / "torchmigrate.toml").write_text('batch-policy = "per-gpu"\n')
    run_cli("ddp", script)
    assert "lr=args.lr * tm.world_size())" in script.read_text()
    script.write_text(TRAIN_WITH_ITEM)
    run_cli("ddp", "--batch-policy", "global", script)  # the command line over the settings
    assert "tm.per_rank_batch(args.batch_size)" in script.read_text()
    (tmp_path / "torchmigrate.toml").write_text('batch-policy = "twice"\n')
    bad = run_cli("ddp", script)
    assert bad.exit_code == 2 and "batch-policy must be one of global, per-gpu" in bad.output


def test_lint_advice_is_a_note_in_every_format(tmp_path, run_cli):
    script = tmp_path / "dist.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n" + TRAIN_WITH_ITEM)
    text = run_cli("lint", "--select", "TM604", script)
    assert text.exit_code == 0 and "TM604 note: `loss.item()`" in text.output and "All checks passed!" in text.output
    github = run_cli("lint", "--select", "TM604", "--format", "github", script)
    assert github.exit_code == 0 and github.output.startswith("::notice ")
    sarif = json.loads(run_cli("lint", "--select", "TM604", "--format", "sarif", script).output)
    assert [r["level"] for r in sarif["runs"][0]["results"]] == ["note"]
    records = json.loads(run_cli("lint", "--select", "TM604", "--format", "json", script).output)
    assert [(r["code"], r["level"]) for r in records] == [("TM604", "note")]

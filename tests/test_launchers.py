"""TM801: launch commands in shell scripts, Makefiles, SLURM files and READMEs (see also the
`fixtures/TM801` cases, run by test_fixtures.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import FIXTURES, check_launch
from torchmigrate.launchers import convert, kind_of
from torchmigrate.launchers.shell import commands

TRAIN = """import argparse
import torch
parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
args = parser.parse_args()
model = torch.nn.Linear(2, 2)
"""
LAUNCH = "python -m torch.distributed.launch --nproc_per_node=2 train.py --lr 1\n"
TORCHRUN = "torchrun --standalone --nproc-per-node=2 train.py --lr 1\n"


def words(text: str, kind: str = "sh"):
    return [[w.raw for w in c.words] for c in commands(text, kind)]


# --- reading commands ----------------------------------------------------------------------------

def test_words_keep_quotes_substitutions_and_redirections():
    text = 'A="x y" python "my dir/t.py" --n $(nproc --all) ${X:-1} `date` 2>&1 | tee log; echo done\n'
    assert words(text) == [['A="x y"', "python", '"my dir/t.py"', "--n", "$(nproc --all)", "${X:-1}", "`date`", "2>&1"],
                           ["tee", "log"], ["echo", "done"]]


def test_continuations_comments_heredocs_and_loops():
    text = ("python a.py \\\n  --x 1 # a comment\n"
            "cat <<EOF\npython b.py\nEOF\n"
            "for i in 1 2; do\n  python c.py $i &\ndone\npython d.py\n")
    found = commands(text, "sh")
    assert [[w.raw for w in c.words] for c in found] == [["python", "a.py", "--x", "1"], ["cat", "<<EOF"],
                                                          ["python", "c.py", "$i"], ["python", "d.py"]]
    assert [(c.in_loop, c.background) for c in found] == [(False, False), (False, False), (True, True), (False, False)]
    assert [c.line for c in found] == [1, 3, 7, 9]


def test_crlf_continuation():
    assert words("python a.py \\\r\n  --x 1\r\npython b.py\r\n") == [["python", "a.py", "--x", "1"], ["python", "b.py"]]


def test_markdown_and_rst_blocks_only():
    md = "python prose.py\n\n```bash\n$ python a.py\n```\n\n```python\npython b.py\n```\n"
    assert words(md, "markdown") == [["python", "a.py"]]  # the prompt is not a word
    rst = "Run::\n\n    python a.py\n\ntext python b.py\n\n.. code-block:: python\n\n   python c.py\n"
    assert words(rst, "rst") == [["python", "a.py"]]


@pytest.mark.parametrize("name,kind", [("run.sh", "sh"), ("job.sbatch", "sh"), ("job.SLURM", "sh"),
                                       ("Makefile", "make"), ("rules.mk", "make"), ("README.md", "markdown"),
                                       ("index.rst", "rst"), ("train.py", None), ("notes.txt", None)])
def test_kinds(name, kind):
    assert kind_of(Path(name)) == kind


# --- decisions -----------------------------------------------------------------------------------

def test_standalone_only_for_one_local_node():
    def form(line):
        launch = convert.parse(commands(line, "sh")[0], "sh")
        return convert.new_command(launch, "sh")

    assert form("python -m torch.distributed.launch --nproc_per_node=2 --master_port=1234 t.py") == \
        "torchrun --standalone --nproc-per-node=2 t.py"
    assert form("python -m torch.distributed.launch --nnodes=$N --nproc_per_node=2 t.py") == \
        "torchrun --nnodes=$N --nproc-per-node=2 t.py"
    assert form("python -m torch.distributed.launch --master_addr=host1 --master_port=1 t.py") == \
        "torchrun --master-addr=host1 --master-port=1 t.py"
    assert form("python -m torch.distributed.launch --node_rank=1 --nproc_per_node=2 t.py") == \
        "torchrun --node-rank=1 --nproc-per-node=2 t.py"


def test_kept_fixture_reports_each_command_it_cannot_rewrite():
    text = (FIXTURES / "TM801" / "kept.in.sh").read_text(encoding="utf-8")
    result = check_launch(text, "kept.sh")
    assert result.text == text
    found = {(r.line, r.safety, r.applied) for r in result.records}
    assert found == {(line, "manual", False) for line in (10, 11, 12, 13, 16, 23)}
    messages = {r.line: r.message for r in result.records}
    assert "$DIST_ARGS, set elsewhere" in messages[10] and "`torchrun --standalone --nproc-per-node=2 $DIST_ARGS train.py`" in messages[10]
    assert "--nproc is not an option torchrun knows" in messages[11]
    assert "starts $SCRIPT" in messages[12]
    assert '`LAUNCHER="torchrun --nproc-per-node=4"`' in messages[13]
    assert "by hand (a loop)" in messages[16] and "`torchrun --standalone --nproc-per-node=N train.py`" in messages[16]
    assert "log.$i depends on the loop's $i" in messages[16]
    assert "a while loop: torchmigrate cannot count its iterations" in messages[23]
    # the one-process commands stay, with a note on how to scale them
    assert [n.split(":")[1] for n in result.notes] == ["5", "6", "7"]
    assert "torchrun --standalone --nproc-per-node=N train.py --gpu 0" in result.notes[0]


def test_srun_one_task_per_rank_is_noted_as_valid():
    result = check_launch("srun python train.py --epochs 3\n", "job.sbatch")
    assert not result.records and "one rank per SLURM task" in result.notes[0]


def test_background_processes_passing_local_rank_are_ranks_by_hand():
    text = "python train.py --local_rank 0 &\npython train.py --local_rank 1 &\nwait\n"
    result = check_launch(text, "run.sh")
    assert [r.line for r in result.records] == [1, 2] and "background processes" in result.records[0].message


LOOP = "for i in 0 1; do CUDA_VISIBLE_DEVICES=$i python train.py --local_rank $i --lr 1 & done; wait\n"


@pytest.mark.parametrize("text,name,expected", [
    (LOOP, "run.sh", TORCHRUN),
    ("train:\n\tfor i in 0 1; do python train.py --local_rank $$i --lr 1 & done; wait\n", "Makefile",
     "train:\n\t" + TORCHRUN),
    ("N=2\nfor ((r=0; r<N; ++r)); do RANK=$r WORLD_SIZE=$N python train.py --lr 1 &\ndone\n", "run.sh",
     "N=2\ntorchrun --standalone --nproc-per-node=$N train.py --lr 1 &\n"),
    # the loop's wait also waits for eval.py: the torchrun line stays in the background before it
    ("python eval.py &\n" + LOOP.replace("; wait", "\nwait"), "run.sh", "python eval.py &\n" + TORCHRUN.strip() + " &\nwait\n"),
])
def test_a_loop_of_ranks_becomes_one_torchrun_line(text, name, expected):
    result = check_launch(text, name)
    assert result.text == expected
    [record] = result.records
    assert (record.safety, record.applied) == ("safe", True) and "background processes in a loop)" in record.message
    assert check_launch(result.text, name).text == result.text


@pytest.mark.parametrize("loop,why", [
    (LOOP.replace("0 1", "1 2"), "the loop's values (1 2) are not 0 to 1"),
    (LOOP.replace("--lr 1", "--seed $i"), "--seed $i` depends"),
    (LOOP.replace("--lr 1 &", "--lr 1 > log.$i &"), "log.$i depends on the loop's $i"),
    (LOOP.replace("python", "echo $i; python"), "does more than start one background process"),
    (LOOP.replace("--local_rank $i ", "").replace("CUDA_VISIBLE_DEVICES=$i", "WORLD_SIZE=2"), "may be independent runs"),
    (LOOP.replace("0 1", "$(seq 0 $((N - 1)))"), "are not all numbers"),
    ("for ((r=0; r<$N; r++)); do RANK=$r python train.py & done\n", "$N is not set in this file"),
    ("for n in 0 1; do for i in 0 1; do RANK=$i python train.py & done; done\n", "inside a loop within a loop"),
    ("for i in 0 1; do RANK=$i WORLD_SIZE=4 python train.py & done\n", "WORLD_SIZE is 4, not the 2 processes"),
])
def test_loops_that_are_not_plain_are_reported_with_the_command_to_use(loop, why):
    result = check_launch(loop, "run.sh")
    assert result.text == loop
    assert result.records and all(r.safety == "manual" for r in result.records)
    message = result.records[-1].message
    assert why.replace("` depends", "") in message and "torchrun --standalone --nproc-per-node=N train.py" in message
    assert "$i" not in message.split("`torchrun")[1]  # the hint drops what depends on the loop


def test_lint_reports_without_rewriting():
    result = check_launch(LAUNCH, "run.sh", mode="lint")
    assert result.text == LAUNCH
    [record] = result.records
    assert (record.code, record.safety, record.applied) == ("TM801", "safe", False)
    assert f"`{TORCHRUN.strip()}`" in record.message
    assert not result.notes  # lint says nothing about valid commands


def test_suppression_and_skip_file():
    assert check_launch(LAUNCH.rstrip() + "  # torchmigrate: ignore\n", "run.sh").text.startswith("python -m")
    assert check_launch(LAUNCH.rstrip() + "  # torchmigrate: ignore[TM101]\n", "run.sh").text.startswith("torchrun")
    skipped = "# torchmigrate: skip-file\n" + LAUNCH
    assert check_launch(skipped, "run.sh").text == skipped


# --- through the CLI -----------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(TRAIN)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "run.sh").write_text("cd ..\n" + LAUNCH.replace("train.py", "src/train.py"))
    (tmp_path / "README.md").write_text("```bash\n" + LAUNCH.replace("train.py", "src/train.py") + "```\n")
    return tmp_path


def test_ddp_rewrites_the_launch_files_of_the_script_it_migrates(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    result = run_cli("ddp", "src/train.py")
    assert result.exit_code in (0, 1), result.output
    expected = TORCHRUN.replace("train.py", "src/train.py")
    assert (project / "scripts" / "run.sh").read_text() == "cd ..\n" + expected
    assert (project / "README.md").read_text() == "```bash\n" + expected + "```\n"
    assert "TM801 dist-launch                  2" in result.output
    assert "3 files changed" in result.output
    again = run_cli("ddp", "--check", "src/train.py")
    assert again.exit_code == 0 or "would be changed" not in again.output, again.output


def test_a_sibling_copys_readme_is_not_this_programs(tmp_path, run_cli, monkeypatch):
    """Two copies of one repository side by side (`orig/` and `mig/`, each a package with
    `__init__.py`, so the project reaches their common folder): `python train.py` in
    orig/README.md starts orig/train.py, so migrating mig/train.py leaves it alone."""
    for copy in ("orig", "mig"):
        (tmp_path / copy).mkdir()
        (tmp_path / copy / "__init__.py").write_text("")
        (tmp_path / copy / "train.py").write_text(TRAIN)
        (tmp_path / copy / "README.md").write_text("```bash\n" + LAUNCH + "```\n")
    monkeypatch.chdir(tmp_path / "mig")
    result = run_cli("ddp", "train.py")
    assert result.exit_code in (0, 1), result.output
    assert (tmp_path / "mig" / "README.md").read_text() == "```bash\n" + TORCHRUN + "```\n"
    assert (tmp_path / "orig" / "README.md").read_text() == "```bash\n" + LAUNCH + "```\n"
    assert "orig" not in result.output, result.output


def test_dry_run_and_check_cover_launch_files(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    assert run_cli("ddp", "src/train.py").exit_code in (0, 1)  # the Python file is migrated
    (project / "scripts" / "run.sh").write_text(LAUNCH.replace("train.py", "../src/train.py"))
    before = (project / "scripts" / "run.sh").read_bytes()
    check = run_cli("ddp", "--check", "src/train.py")
    assert check.exit_code == 1 and "1 file would be changed" in check.output
    dry = run_cli("ddp", "--dry-run", "src/train.py")
    assert dry.exit_code == 1
    assert "-python -m torch.distributed.launch" in dry.stdout and "+torchrun --standalone" in dry.stdout
    assert (project / "scripts" / "run.sh").read_bytes() == before


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_program_and_launch_files_are_written_together_or_not_at_all(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    run_sh = project / "scripts" / "run.sh"
    run_sh.chmod(stat.S_IRUSR)
    try:
        result = run_cli("ddp", "src/train.py")
    finally:
        run_sh.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert result.exit_code == 2
    assert "read-only" in result.output
    assert (project / "src" / "train.py").read_text() == TRAIN  # the Python file was not written either
    assert (project / "README.md").read_text().count("torch.distributed.launch") == 1


def test_the_launch_line_waits_for_tm102(project, run_cli, monkeypatch):
    """torchrun passes no --local_rank: a script that still expects it keeps the old line."""
    monkeypatch.chdir(project)
    result = run_cli("ddp", "--select", "TM801", "src/train.py")
    assert result.exit_code == 1
    assert "src/train.py:4 parses --local_rank without reading LOCAL_RANK" in result.output
    assert "torch.distributed.launch" in (project / "scripts" / "run.sh").read_text()
    # with --use_env the launcher never passed it: the command is rewritten
    (project / "README.md").unlink()
    (project / "scripts" / "run.sh").write_text(LAUNCH.replace("train.py", "src/train.py").replace("=2", "=2 --use_env"))
    assert run_cli("ddp", "--select", "TM801", "src/train.py").exit_code == 0
    assert (project / "scripts" / "run.sh").read_text() == TORCHRUN.replace("train.py", "src/train.py")


def test_a_loop_passing_local_rank_waits_for_tm102(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(TRAIN)
    Path("run.sh").write_text(LOOP)
    only = run_cli("ddp", "--select", "TM801", "train.py")
    assert only.exit_code == 1 and "train.py:4 parses --local_rank without reading LOCAL_RANK" in only.output
    assert Path("run.sh").read_text() == LOOP
    result = run_cli("ddp", "train.py")  # TM102 makes it read LOCAL_RANK in the same run
    assert result.exit_code in (0, 1), result.output
    assert Path("run.sh").read_text() == TORCHRUN


# --- `ddp run.sh`: the launch file names the program -------------------------------------------

def test_ddp_given_a_launch_file_migrates_the_scripts_it_starts(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    (project / "README.md").unlink()
    check = run_cli("ddp", "--check", "scripts/run.sh")
    assert check.exit_code == 1 and "2 files would be changed" in check.output, check.output
    dry = run_cli("ddp", "--dry-run", "scripts/run.sh")
    assert "+++ b/src/train.py" in dry.stdout and "+torchrun --standalone" in dry.stdout
    assert (project / "src" / "train.py").read_text() == TRAIN
    result = run_cli("ddp", "scripts/run.sh")
    assert result.exit_code in (0, 1) and "2 files changed" in result.output, result.output
    assert "LOCAL_RANK" in (project / "src" / "train.py").read_text()
    assert (project / "scripts" / "run.sh").read_text() == "cd ..\n" + TORCHRUN.replace("train.py", "src/train.py")
    monkeypatch.chdir(project / "scripts")  # run from its own folder, as `cd scripts && ./run.sh`
    assert run_cli("ddp", "--check", "run.sh").exit_code == 0


@pytest.mark.parametrize("name,line", [
    ("Makefile", "train:\n\tpython src/train.py --lr 1\n"),
    ("job.sbatch", "#SBATCH --nodes=1\nsrun torchrun --nproc-per-node=2 src/train.py\n"),
    ("README.md", "```bash\npip install -e .\npython -m pip list\npython src/train.py\n```\n"),
])
def test_ddp_given_a_makefile_sbatch_or_readme(project, run_cli, monkeypatch, name, line):
    monkeypatch.chdir(project)
    (project / name).write_text(line)
    result = run_cli("ddp", name)
    assert result.exit_code in (0, 1), result.output
    assert "LOCAL_RANK" in (project / "src" / "train.py").read_text()
    assert (project / name).read_text() == line  # nothing to rewrite in it
    assert (project / "scripts" / "run.sh").read_text().startswith("cd ..\npython -m torch.distributed.launch")


def test_ddp_given_two_launch_files_of_one_script(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    result = run_cli("ddp", "scripts/run.sh", "README.md")
    assert result.exit_code in (0, 1) and "3 files changed" in result.output, result.output
    assert "torch.distributed.launch" not in (project / "README.md").read_text()


@pytest.mark.parametrize("text,why", [
    ("python src/tain.py\n", "run.sh:1: starts src/tain.py, which is not there"),
    ("python $SCRIPT --lr 1\n", "starts no Python script of its project that torchmigrate can find; only the shell "
                                 "knows $SCRIPT (run.sh:1)"),
    ("python ../elsewhere.py\n", "outside the project"),
    ("python src/train.py\npython tools/gone.py\n", "run.sh:2: starts tools/gone.py, which is not there"),
])
def test_ddp_given_a_launch_file_whose_scripts_cannot_be_found(project, run_cli, monkeypatch, text, why):
    monkeypatch.chdir(project)
    (project.parent / "elsewhere.py").write_text(TRAIN)
    (project / "run.sh").write_text(text)
    result = run_cli("ddp", "run.sh")
    assert result.exit_code == 2
    assert why in result.stderr and "nothing was written" in result.stderr
    assert (project / "src" / "train.py").read_text() == TRAIN and (project / "run.sh").read_text() == text


@pytest.mark.skipif(os.name != "posix", reason="file modes")
def test_ddp_run_sh_writes_the_program_and_the_launch_file_together(project, run_cli, monkeypatch):
    monkeypatch.chdir(project)
    run_sh = project / "scripts" / "run.sh"
    run_sh.chmod(stat.S_IRUSR)
    try:
        result = run_cli("ddp", "scripts/run.sh")
    finally:
        run_sh.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert result.exit_code == 2 and "read-only" in result.output
    assert (project / "src" / "train.py").read_text() == TRAIN


def test_bytes_and_newlines_are_kept(tmp_path, run_cli):
    (tmp_path / "train.py").write_text(TRAIN)
    data = b"# caf\xe9 (latin-1)\r\n" + LAUNCH.replace("\n", "\r\n").encode() + b"echo \xff\r\n"
    (tmp_path / "run.sh").write_bytes(data)
    assert run_cli("ddp", tmp_path).exit_code in (0, 1)
    assert (tmp_path / "run.sh").read_bytes() == data.replace(LAUNCH.strip().encode(), TORCHRUN.strip().encode())


def test_lint_folder_named_file_and_fix(tmp_path, run_cli, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text(TRAIN.replace("default=0", 'default=int(os.environ.get("LOCAL_RANK", 0))'))
    Path("run.sh").write_text(LAUNCH)
    folder = run_cli("lint", "--select", "TM801", ".")
    assert folder.exit_code == 1 and "run.sh:1:1: TM801 starts train.py" in folder.output
    assert "1 fixable with --fix" in folder.output
    named = run_cli("lint", "--select", "TM801", "--format", "json", "run.sh")
    assert [r["code"] for r in json.loads(named.stdout)] == ["TM801"]
    only_python = run_cli("lint", "--select", "TM801", "train.py")  # a pre-commit run on Python files
    assert only_python.exit_code == 0
    github = run_cli("lint", "--select", "TM801", "--format", "github", ".")
    assert github.stdout.startswith("::error file=run.sh,line=1,col=1,title=TM801::")
    fixed = run_cli("lint", "--select", "TM801", "--fix", ".")
    assert fixed.exit_code == 0 and Path("run.sh").read_text() == TORCHRUN


def test_excluded_launch_files_are_left_alone(tmp_path, run_cli):
    (tmp_path / "pyproject.toml").write_text('[tool.torchmigrate]\nexclude = ["legacy"]\n')
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "run.sh").write_text(LAUNCH.replace("train.py", "../train.py"))
    run_cli("ddp", tmp_path / "train.py")
    assert (tmp_path / "legacy" / "run.sh").read_text().startswith("python -m torch.distributed.launch")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_named_pipe_called_run_sh_is_reported_not_read(tmp_path, run_cli):
    (tmp_path / "train.py").write_text(TRAIN)
    os.mkfifo(tmp_path / "run.sh")
    result = run_cli("lint", "--select", "TM801", tmp_path)  # would block forever on a plain open()
    assert result.exit_code == 2 and "run.sh:1:1: not a regular file" in result.stderr

"""No input can kill or hang a run (issue #15): what LibCST's native parser cannot take, files
that are not regular files, a report that cannot be written and paths the system refuses each
become an input error for that one path (exit 2, the file untouched) while every other file is
still processed, in-process (`-j 1`) and in worker processes (`-j 2`).

The CLI runs in a subprocess with a timeout where the failure being guarded against is a
segfault or a hang, which would otherwise take the test session down with it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import FIXTURES
from torchmigrate.engine import process as engine, files, runner
from torchmigrate.engine.process import InputError, check_parser_depth, python_tree
from torchmigrate.rule import Options
from torchmigrate.rules import select

GOOD_SCRIPT = FIXTURES / "scripts" / "cuda_amp_accum.py"

# Valid Python that crashed LibCST 1.9's parser (SIGSEGV) or that it misreported as a syntax error.
PARSER_KILLERS = {
    "and_chain.py": "import torch\nok = " + " and ".join(["x"] * 8000) + "\n",
    "plus_chain.py": "import torch\ntotal = " + " + ".join(["x"] * 8000) + "\n",
    "attribute_chain.py": "import torch\ny = x" + ".a" * 20000 + "\n",
    "string_pieces.py": "import torch\ns = " + " ".join(["'a'"] * 8000) + "\n",
}


def cli(*args, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchmigrate", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def good_file(folder: Path, name: str = "good.py") -> Path:
    path = folder / name
    path.write_bytes(GOOD_SCRIPT.read_bytes())
    return path


@pytest.mark.parametrize("command", [("ddp", "-j", "1"), ("lint", "--fix", "-j", "2")])
def test_what_the_parser_cannot_take_is_an_input_error(tmp_path, command):
    for name, source in PARSER_KILLERS.items():
        (tmp_path / name).write_text(source)
    good = good_file(tmp_path, "zz_good.py")  # sorted last: processed after every bad file
    result = cli(*command, ".", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    for name, source in PARSER_KILLERS.items():
        assert f"{name}:2:1: too deeply nested for the parser" in result.stderr
        assert (tmp_path / name).read_text() == source
    assert good.read_bytes() != GOOD_SCRIPT.read_bytes()  # the good file was still processed


def depth_error(source: str):
    try:
        check_parser_depth(python_tree(source), source)
    except InputError as exc:
        return exc
    return None


def test_parser_depth_counts_what_libcst_nests(monkeypatch):
    """Chains count one level per term, implicitly concatenated strings one per literal (also
    over several lines, where CPython merges them into one node); the same number of terms
    side by side (a list, separate statements) nests nothing."""
    monkeypatch.setattr(engine, "MAX_PARSER_DEPTH", 100)
    assert depth_error("x = " + " or ".join(["a"] * 120) + "\n")
    assert depth_error("x = (\n" + "".join(f"    'piece{i}'\n" for i in range(120)) + ")\n")
    assert depth_error("x = a" + "[0]" * 120 + "\n")
    assert not depth_error("x = [" + ", ".join(["'a'"] * 500) + "]\n")
    assert not depth_error("x = 1\n" * 500 + "y = " + " + ".join(["a"] * 80) + "\n")
    error = depth_error("import torch\n\ndef f():\n    return " + " - ".join(["a"] * 200) + "\n")
    assert (error.line, error.col) == (4, 4) and "more than 100 levels" in error.message


@pytest.mark.skipif(multiprocessing.get_start_method(allow_none=False) != "fork",
                    reason="the workers must inherit the patched limit")
def test_a_crashing_worker_loses_only_its_file(tmp_path, monkeypatch):
    """If a worker process dies anyway (here: the parser crashes with the depth check off),
    the files it shared a chunk with, and all later ones, are still processed."""
    monkeypatch.setattr(engine, "MAX_PARSER_DEPTH", 10 ** 9)
    names = [good_file(tmp_path, f"a{i}.py") for i in range(3)]
    bad = tmp_path / "b.py"
    bad.write_text(PARSER_KILLERS["and_chain.py"])
    names += [bad] + [good_file(tmp_path, f"c{i}.py") for i in range(3)]
    job = runner.Job(Options(mode="lint"), tuple(r.code for r in select(command="lint")))
    handler = faulthandler.is_enabled()  # pytest's: the forked worker would print its stack
    faulthandler.disable()
    try:
        outcomes = runner.run(names, job, jobs=2)
    finally:
        if handler:
            faulthandler.enable()
    assert [o.path for o in outcomes] == [str(p) for p in names]
    crashed = [o for o in outcomes if o.error]
    assert [o.path for o in crashed] == [str(bad)]
    assert "died (signal SIGSEGV)" in crashed[0].error[2]
    assert all(o.records for o in outcomes if o is not crashed[0])


# --- what is not a regular file -------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("jobs", ["1", "2"])
def test_pipes_and_devices_are_skipped_not_read(tmp_path, jobs):
    folder = tmp_path / "src"
    folder.mkdir()
    os.mkfifo(folder / "x.py")
    (folder / "zero.py").symlink_to("/dev/zero")
    good = good_file(folder)
    os.mkfifo(tmp_path / "named.py")
    result = cli("ddp", "-j", jobs, "src", "named.py", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    for path in ("src/x.py", "named.py"):
        assert f"{path}: skipped: a named pipe, not a regular file" in result.stderr
    assert "src/zero.py: skipped: a character device, not a regular file" in result.stderr
    assert good.read_bytes() != GOOD_SCRIPT.read_bytes()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_read_never_blocks_on_a_pipe(tmp_path):
    """A pipe put in place after discovery: opening it for reading would wait for a writer."""
    pipe = tmp_path / "late.py"
    os.mkfifo(pipe)
    outcome = {}

    def read():
        try:
            files.read(pipe)
        except InputError as exc:
            outcome["error"] = exc.message

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # release the blocked open before failing
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("files.read blocked on a named pipe")
    assert outcome == {"error": "not a regular file"}


def test_read_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_SOURCE_BYTES", 100)
    path = tmp_path / "big.py"
    path.write_text("x = 1\n" * 20)
    with pytest.raises(InputError, match="too large"):
        files.read(path)


# --- reports and arguments ------------------------------------------------------------------

def test_report_into_a_missing_folder_is_refused_before_any_write(tmp_path, run_cli):
    good = good_file(tmp_path)
    result = run_cli("ddp", "--report", tmp_path / "nowhere" / "report.json", good)
    assert result.exit_code == 2
    assert "error: --report" in result.stderr and "does not exist" in result.stderr
    assert good.read_bytes() == GOOD_SCRIPT.read_bytes()


def test_a_path_the_system_refuses_is_one_input_error(tmp_path, run_cli):
    good = good_file(tmp_path)
    too_long = tmp_path / ("n" * 5000 + ".py")
    result = run_cli("ddp", too_long, good)
    assert result.exit_code == 2
    assert f"{too_long}: cannot read: File name too long" in result.stderr
    assert good.read_bytes() != GOOD_SCRIPT.read_bytes()

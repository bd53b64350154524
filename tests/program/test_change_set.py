"""A program is written as one change: every changed file, or none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchmigrate.engine import files

PROJECT = Path(__file__).resolve().parents[2] / "fixtures" / "projects" / "data_eval_modules"


def test_write_all_writes_every_file(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("a = 1\n")
    b.write_text("b = 1\n")
    files.write_all([(a, b"a = 2\n", None), (b, b"b = 2\n", None)])
    assert (a.read_text(), b.read_text()) == ("a = 2\n", "b = 2\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "b.py"], "no temporary file is left"


def test_a_refused_file_writes_none(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("a = 1\n")
    b.write_text("b = 1\n")
    b.chmod(0o444)
    with pytest.raises(files.ChangeSetError, match="cannot write: file is read-only") as caught:
        files.write_all([(a, b"a = 2\n", None), (b, b"b = 2\n", None)])
    assert caught.value.path == b
    assert (a.read_text(), b.read_text()) == ("a = 1\n", "b = 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.py", "b.py"]


def test_a_failed_rename_restores_the_files_done(tmp_path, monkeypatch):
    paths = [tmp_path / f"m{i}.py" for i in range(3)]
    for p in paths:
        p.write_text("old\n")
    real_replace = os.replace
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # the third rename fails
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(files.ChangeSetError, match="cannot write: No space left on device") as caught:
        files.write_all([(p, b"new\n", None) for p in paths])
    assert caught.value.path == paths[2]
    monkeypatch.setattr(os, "replace", real_replace)
    assert [p.read_text() for p in paths] == ["old\n"] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0.py", "m1.py", "m2.py"]


def test_cli_writes_no_module_of_a_program_when_one_cannot_be_written(tmp_path):
    folder = tmp_path / "p"
    shutil.copytree(PROJECT, folder)
    (folder / "data.py").chmod(0o444)
    before = {p.name: p.read_text() for p in folder.glob("*.py")}
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "train.py"], cwd=folder,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.py:1:1: cannot write: file is read-only" in proc.stderr
    assert "train.py:1:1: not written: data.py of the same program could not be written" in proc.stderr
    assert {p.name: p.read_text() for p in folder.glob("*.py")} == before


def test_unrelated_scripts_are_written_independently(tmp_path):
    """Two scripts that do not import each other are two programs: one that cannot be written
    does not hold back the other."""
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("import torch\nprint(torch.ones(1))\n")
    (tmp_path / "a.py").chmod(0o444)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "a.py", "b.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "a.py:1:1: cannot write: file is read-only" in proc.stderr
    assert "tm.print" in (tmp_path / "b.py").read_text()

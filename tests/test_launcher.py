"""The torchrun launcher's retry (tests/launcher.py): exactly one more launch of the whole group, and
only when the gloo exit abort was printed. Fake ranks stand in for torchrun: each appends its name to
a log per run and, when asked to, aborts the way gloo does on its first run only."""
from __future__ import annotations

import sys

import pytest

from launcher import GLOO_EXIT_ABORT, launch_retrying_gloo_abort

FAKE_RANK = f'''
import os, sys
log, name, mode = sys.argv[1:]
first = not os.path.exists(log) or name not in open(log).read().split()
with open(log, "a") as f:
    f.write(name + "\\n")
if mode == "abort-always" or (mode == "abort-first" and first):
    print({GLOO_EXIT_ABORT!r}, file=sys.stderr)
    sys.exit(1)
if mode == "fail":
    print("some other error", file=sys.stderr)
    sys.exit(1)
print(name, "done")
'''


@pytest.fixture
def rank(tmp_path):
    """`rank(name, mode)`: the command of one fake rank logging to tmp_path/runs.log."""
    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    return lambda name, mode: [sys.executable, script, tmp_path / "runs.log", name, mode]


def runs(tmp_path) -> list[str]:
    return (tmp_path / "runs.log").read_text().split()


def test_abort_relaunches_the_whole_group_once_without_stale_files(tmp_path, rank):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "rank0.json").write_text("{}")
    (tmp_path / "out" / "ckpt").mkdir()
    result = launch_retrying_gloo_abort([rank("a", "abort-first"), rank("b", "ok")], [None, None],
                                        timeout=60, stale=[tmp_path / "out" / "*"])
    assert result.returncode == 0, result.report()
    assert sorted(runs(tmp_path)) == ["a", "a", "b", "b"]
    assert list((tmp_path / "out").iterdir()) == []
    assert "a done" in result.output and GLOO_EXIT_ABORT not in result.output


def test_abort_twice_is_final(tmp_path, rank):
    result = launch_retrying_gloo_abort([rank("a", "abort-always")], [None], timeout=60)
    assert result.returncode == 1 and GLOO_EXIT_ABORT in result.output
    assert runs(tmp_path) == ["a", "a"]


@pytest.mark.parametrize("mode,returncode,printed", [("fail", 1, "some other error"), ("ok", 0, "a done")])
def test_anything_else_runs_once(tmp_path, rank, mode, returncode, printed):
    (tmp_path / "keep.json").write_text("{}")
    result = launch_retrying_gloo_abort([rank("a", mode)], [None], timeout=60,
                                        stale=[tmp_path / "*.json"])
    assert result.returncode == returncode and printed in result.report()
    assert runs(tmp_path) == ["a"] and (tmp_path / "keep.json").exists()

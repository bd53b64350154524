"""benchmarks/corpus_check.py classifies each file correctly (fake engines) and runs on real input."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import corpus_check as cc  # noqa: E402


class _Engine:
    InputError = type("FakeInputError", (Exception,), {})

    def __init__(self, fn):
        self.fn = fn

    def run(self, source, path):
        return self.fn(source), collections.Counter(), collections.Counter()


def _boom(source):
    raise ValueError("boom")


@pytest.mark.parametrize("fn, status", [
    (lambda s: s, "ok"),
    (_boom, "crash"),
    (lambda s: s + "def (:\n", "compile"),
    (lambda s: s + "x = 1\n", "idem"),
])
def test_statuses(tmp_path, fn, status):
    path = tmp_path / "script.py"
    path.write_text("import torch\n", encoding="utf-8")
    result = cc.check_file(path, "ddp", _Engine(fn), tmp_path)
    assert result.status == status
    if status in ("crash", "compile", "idem"):
        assert result.detail


def test_parse_error_is_excluded(tmp_path):
    path = tmp_path / "py2.py"
    path.write_text("print 'hello'\n", encoding="utf-8")
    results = [cc.check_file(path, "ddp", _Engine(lambda s: s), tmp_path)]
    assert results[0].status == "parse"
    _, rates = cc.summary(results, ["ddp"])
    assert rates["ddp"] == 1.0  # nothing left in the denominator


def test_static_warnings():
    before = "import torch\n\ndef f():\n    return g\n\nif __name__ == '__main__':\n    g = 1\n    f()\n"
    after = "import torch\nx = tm.a()\nimport t as tm\n\ndef f():\n    return g + s\n\nif __name__ == '__main__':\n    g = 1\n    f()\ns = 2\n"
    undef, order = cc.static_warnings(before, after)
    assert undef == []
    assert "<module>: tm" in order
    assert any(o.startswith("after main guard: s = 2") for o in order)


def test_real_engine_on_fixture_scripts(tmp_path):
    scripts = sorted((ROOT / "fixtures" / "scripts").glob("*.py"))
    assert scripts
    engine = cc.InProcess("ddp", (), (), "auto", False)
    for path in scripts[:3]:
        result = cc.check_file(path, "ddp", engine, tmp_path)
        assert result.status in cc.STATUSES

"""Atomic writes: a failure at any step leaves the original intact and no temporary file."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from torchmigrate.engine import files
from torchmigrate.engine.process import InputError

ORIGINAL = b"import torch\r\nx = 1\r\n"
NEW = b"import torch\r\nx = 2\r\n"


def leftovers(folder: Path):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(ORIGINAL)
    path.chmod(0o640)
    return path


def test_write_replaces_content_and_keeps_mode(target):
    files.atomic_write(target, NEW)
    assert target.read_bytes() == NEW
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert leftovers(target.parent) == []


@pytest.mark.parametrize("step", ["os.replace", "os.fsync", "os.chmod"])
def test_failure_during_write_keeps_original(target, monkeypatch, step):
    module, name = step.split(".")
    real = getattr(os, name)

    def boom(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(os, name, boom)
    with pytest.raises(InputError) as info:
        files.atomic_write(target, NEW)
    monkeypatch.setattr(os, name, real)
    assert "cannot write" in info.value.message and "injected" in info.value.message
    assert target.read_bytes() == ORIGINAL
    assert leftovers(target.parent) == []


def test_failure_while_writing_data(target, monkeypatch):
    real_fdopen = os.fdopen

    class Failing:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()
            return False

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Failing(real_fdopen(fd, mode)))
    with pytest.raises(InputError, match="No space left"):
        files.atomic_write(target, NEW)
    assert target.read_bytes() == ORIGINAL
    assert leftovers(target.parent) == []


def test_interrupt_during_write_keeps_original(target, monkeypatch):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write(target, NEW)
    assert target.read_bytes() == ORIGINAL
    assert leftovers(target.parent) == []


def test_temp_file_cannot_be_created(target, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(InputError, match="cannot create a temporary file"):
        files.atomic_write(target, NEW)
    assert target.read_bytes() == ORIGINAL


def test_read_only_file_is_refused_even_for_root(target):
    target.chmod(0o444)
    with pytest.raises(InputError, match="read-only"):
        files.atomic_write(target, NEW)
    assert target.read_bytes() == ORIGINAL
    assert leftovers(target.parent) == []


def test_symlink_target_is_rewritten_link_kept(tmp_path, target):
    link = tmp_path / "link.py"
    link.symlink_to(target.name)
    files.atomic_write(link, NEW)
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_bytes() == NEW


def test_file_changed_since_read_is_not_overwritten(target):
    decoded = files.read(target)
    target.write_bytes(b"import torch\r\n# edited by the user meanwhile\r\n")
    with pytest.raises(InputError, match="changed on disk"):
        files.atomic_write(target, NEW, decoded.stamp)
    assert b"edited by the user" in target.read_bytes()
    assert leftovers(target.parent) == []


def test_file_deleted_since_read(target):
    decoded = files.read(target)
    target.unlink()
    with pytest.raises(InputError, match="disappeared"):
        files.atomic_write(target, NEW, decoded.stamp)
    assert not target.exists() and leftovers(target.parent) == []


def test_unchanged_stamp_writes(target):
    decoded = files.read(target)
    files.atomic_write(target, NEW, decoded.stamp)
    assert target.read_bytes() == NEW


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_owner_is_kept_when_root(target):
    os.chown(target, 12345, 23456)
    files.atomic_write(target, NEW)
    st = target.stat()
    assert (st.st_uid, st.st_gid) == (12345, 23456)


@pytest.mark.parametrize("data, encoding", [
    (b"\xef\xbb\xbfimport torch\n", "utf-8-sig"),
    (b"# -*- coding: latin-1 -*-\nname = 'caf\xe9'\n", "iso-8859-1"),
    (b"import torch\r\nx = 1\r\n", "utf-8"),
])
def test_decode_encode_round_trip(data, encoding):
    decoded = files.decode(data)
    assert decoded.encoding == encoding
    assert not decoded.text.startswith("\ufeff")
    assert files.encode(decoded.text, decoded.encoding) == data

"""Hostile and unusual inputs through the CLI: a clear `path:line:col: message`, the contract's
exit code (2 for input errors), the file untouched, the other files still processed, and no
temporary file left behind."""

from __future__ import annotations

import os
import re
import stat
import tempfile
import time
from pathlib import Path

import pytest

from conftest import FIXTURES

SCRIPTS = FIXTURES / "scripts"
# A script every mode changes (torch.cuda.amp -> torch.amp, DDP, ...): the "good" file of a run.
GOOD_SCRIPT = SCRIPTS / "cuda_amp_accum.py"
ERROR_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+):(?P<col>\d+): (?P<message>.+)$")


def leftovers(folder: Path):
    return sorted(str(p) for p in folder.rglob("*.tmp"))


def error_for(result, path: Path):
    """The parsed `path:line:col: message` line for `path` on stderr."""
    for line in result.stderr.splitlines():
        match = ERROR_LINE.match(line)
        if match and match["path"] == str(path):
            assert int(match["line"]) >= 1 and int(match["col"]) >= 1
            return match
    raise AssertionError(f"no error line for {path} in:\n{result.stderr}")


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.py"
    path.write_bytes(GOOD_SCRIPT.read_bytes())
    return path


def expected_good(run_cli, tmp_path) -> bytes:
    """What `ddp` makes of the good script on its own."""
    alone = tmp_path / "alone" / "good.py"
    alone.parent.mkdir()
    alone.write_bytes(GOOD_SCRIPT.read_bytes())
    run_cli("ddp", alone)
    return alone.read_bytes()


def run_bad(run_cli, tmp_path, good, name: str, data: bytes, command=("ddp",)):
    bad = tmp_path / name
    bad.write_bytes(data)
    result = run_cli(*command, bad, good)
    return bad, result


# --- unparsable input -------------------------------------------------------------------------

SYNTAX = {
    "python2.py": (b"import torch\n\nprint 'epoch', 1\nx = torch.zeros(1)\n", 3, "print"),
    "python2_except.py": (b"import torch\ntry:\n    pass\nexcept Exception, e:\n    pass\n", 4, ""),
    "async_kwarg.py": (b"import torch\nx = torch.zeros(1)\ny = x.cuda(async=True)\n", 3, ""),
    "mixed_tabs.py": (b"import torch\n\ndef f(x):\n    if x:\n\treturn x.cuda()\n    return x\n", 5, "tab"),
    "tab_dedent.py": (b"import torch\nif torch.cuda.is_available():\n\tif True:\n        pass\n", 4, "tab"),
    "return_outside.py": (b"import torch\nreturn torch.zeros(1)\n", 2, "outside function"),
    "too_deep.py": (b"import torch\nx = " + b"(" * 300 + b"1" + b")" * 300 + b"\n", 2, "nested"),
}


@pytest.mark.parametrize("name", sorted(SYNTAX))
@pytest.mark.parametrize("command", [("ddp",), ("lint",), ("ddp", "--check"), ("amp", "--dry-run")])
def test_syntax_errors(tmp_path, run_cli, good, name, command):
    data, line, words = SYNTAX[name]
    bad, result = run_bad(run_cli, tmp_path, good, name, data, command)
    assert result.exit_code == 2, result.output
    match = error_for(result, bad)
    assert int(match["line"]) == line
    assert "syntax error" in match["message"] and words.lower() in match["message"].lower()
    assert bad.read_bytes() == data
    if command == ("ddp",):
        assert good.read_bytes() == expected_good(run_cli, tmp_path)  # the other file is done
    else:
        assert good.read_bytes() == GOOD_SCRIPT.read_bytes()
    assert leftovers(tmp_path) == []


def test_python2_message_is_pythons(tmp_path, run_cli, good):
    bad, result = run_bad(run_cli, tmp_path, good, "py2.py", SYNTAX["python2.py"][0], ("lint",))
    assert "Missing parentheses in call to 'print'" in error_for(result, bad)["message"]


# --- encodings and newlines ---------------------------------------------------------------------

def migrated(run_cli, tmp_path, name: str, data: bytes, *flags) -> bytes:
    path = tmp_path / name
    path.write_bytes(data)
    result = run_cli("ddp", *flags, path)
    assert result.exit_code in (0, 1), result.output
    assert leftovers(tmp_path) == []
    return path.read_bytes()


@pytest.mark.parametrize("script", ["cuda_amp_accum.py", "main_function.py", "dataparallel.py"])
def test_crlf_preserved_exactly(tmp_path, run_cli, script):
    lf = (SCRIPTS / script).read_bytes()
    assert b"\r" not in lf
    out_lf = migrated(run_cli, tmp_path, "lf.py", lf)
    out_crlf = migrated(run_cli, tmp_path, "crlf.py", lf.replace(b"\n", b"\r\n"))
    assert out_lf != lf  # something was rewritten
    assert out_crlf == out_lf.replace(b"\n", b"\r\n")
    assert b"\n" not in out_crlf.replace(b"\r\n", b"")


def test_utf8_bom_preserved(tmp_path, run_cli):
    plain = GOOD_SCRIPT.read_bytes()
    out_plain = migrated(run_cli, tmp_path, "plain.py", plain)
    out_bom = migrated(run_cli, tmp_path, "bom.py", b"\xef\xbb\xbf" + plain)
    assert out_bom == b"\xef\xbb\xbf" + out_plain
    assert out_bom.count(b"\xef\xbb\xbf") == 1


def test_latin1_with_coding_cookie_preserved(tmp_path, run_cli):
    text = "# -*- coding: latin-1 -*-\n" + GOOD_SCRIPT.read_text() + "AUTHOR = 'Ren\u00e9e M\u00fcller'\n"
    out_utf8 = migrated(run_cli, tmp_path, "utf8.py", text.replace("latin-1", "utf-8").encode("utf-8"))
    out_latin = migrated(run_cli, tmp_path, "latin.py", text.encode("latin-1"))
    assert b"Ren\xe9e M\xfcller" in out_latin  # still latin-1 bytes
    assert out_latin.decode("latin-1") == out_utf8.decode("utf-8").replace("utf-8", "latin-1", 1)
    compile(out_latin, "latin.py", "exec")


def test_latin1_without_cookie_is_a_clear_error(tmp_path, run_cli, good):
    data = b"import torch\nname = 'caf\xe9'\n"
    bad, result = run_bad(run_cli, tmp_path, good, "nocookie.py", data)
    assert result.exit_code == 2
    match = error_for(result, bad)
    assert int(match["line"]) == 2 and "cannot decode" in match["message"]
    assert bad.read_bytes() == data


def test_unknown_coding_cookie(tmp_path, run_cli, good):
    data = b"# -*- coding: klingon -*-\nimport torch\n"
    bad, result = run_bad(run_cli, tmp_path, good, "klingon.py", data)
    assert result.exit_code == 2 and "klingon" in error_for(result, bad)["message"]
    assert bad.read_bytes() == data


@pytest.mark.parametrize("command", [("ddp",), ("lint",)])
def test_empty_file(tmp_path, run_cli, command):
    path = tmp_path / "empty.py"
    path.write_bytes(b"")
    result = run_cli(*command, path)
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == b""


def test_only_comments_and_no_trailing_newline(tmp_path, run_cli):
    data = b"# torch training notes\n# nothing here"
    path = tmp_path / "notes.py"
    path.write_bytes(data)
    assert run_cli("ddp", path).exit_code == 0
    assert path.read_bytes() == data


def test_no_trailing_newline_rewrite(tmp_path, run_cli):
    data = GOOD_SCRIPT.read_bytes().rstrip(b"\n")
    out = migrated(run_cli, tmp_path, "nonl.py", data)
    assert not out.endswith(b"\n") and out != data
    compile(out, "nonl.py", "exec")


# --- size -----------------------------------------------------------------------------------------

def big_script(size: int) -> str:
    """A realistic training script grown to `size` characters by adding renamed copies of its
    helper functions (the kind of file code generators produce)."""
    source = (SCRIPTS / "main_function.py").read_text()
    head, rest = source.split("\n\ndef make_dataset", 1)
    funcs, guard = ("def make_dataset" + rest).rsplit("\n\nif __name__", 1)
    parts = [head]
    total = len(head)
    i = 0
    while total < size:
        copy = re.sub(r"\bdef (\w+)", lambda m: f"def {m.group(1)}_{i}", funcs)
        parts.append(copy)
        total += len(copy) + 2
        i += 1
    parts.append("\n\nif __name__" + guard)
    return "\n\n".join(parts)


def test_two_megabyte_script(tmp_path, run_cli):
    text = big_script(2_000_000)
    assert len(text.encode()) >= 2_000_000
    path = tmp_path / "generated.py"
    path.write_text(text)
    start = time.perf_counter()
    result = run_cli("ddp", path)
    elapsed = time.perf_counter() - start
    assert result.exit_code in (0, 1), result.output[-2000:]
    out = path.read_text()
    assert out != text and "import torchmigrate.runtime as tm" in out
    compile(out, str(path), "exec")
    assert leftovers(tmp_path) == []
    print(f"2 MB ddp: {elapsed:.1f} s")  # no timing assertion: the machines are noisy


# --- files that are not what they seem ----------------------------------------------------------

@pytest.mark.parametrize("name, data, words", [
    ("binary.py", bytes(range(256)) * 8, "not a text file"),
    ("png.py", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(7, 256, 4)), "not a text file"),
    ("garbage.py", b"import torch\n" + bytes(range(128, 256)), "cannot decode"),
], ids=["binary", "png", "undecodable"])  # short, fixed ids: pytest-xdist workers must agree
def test_binary_file_named_py(tmp_path, run_cli, good, name, data, words):
    bad, result = run_bad(run_cli, tmp_path, good, name, data)
    assert result.exit_code == 2
    assert words in error_for(result, bad)["message"]
    assert bad.read_bytes() == data
    assert good.read_bytes() == expected_good(run_cli, tmp_path)
    assert leftovers(tmp_path) == []


def test_read_only_file(tmp_path, run_cli, good):
    data = GOOD_SCRIPT.read_bytes()
    bad = tmp_path / "readonly.py"
    bad.write_bytes(data)
    bad.chmod(0o444)
    result = run_cli("ddp", bad, good)
    assert result.exit_code == 2
    assert "read-only" in error_for(result, bad)["message"]
    assert bad.read_bytes() == data and stat.S_IMODE(bad.stat().st_mode) == 0o444
    assert good.read_bytes() == expected_good(run_cli, tmp_path)
    assert leftovers(tmp_path) == []
    # Reading it is fine: lint and --check still work on a read-only file.
    assert run_cli("ddp", "--check", bad).exit_code == 1
    assert run_cli("lint", "--exit-zero", bad).exit_code == 0


def test_symlink_target_rewritten_link_kept(tmp_path, run_cli):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "train.py"
    target.write_bytes(GOOD_SCRIPT.read_bytes())
    link = tmp_path / "link.py"
    link.symlink_to(Path("real") / "train.py")
    result = run_cli("ddp", link)
    assert result.exit_code in (0, 1), result.output
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "train.py")
    assert target.read_bytes() == expected_good(run_cli, tmp_path)
    assert leftovers(tmp_path) == []


def test_broken_symlink(tmp_path, run_cli):
    link = tmp_path / "dangling.py"
    link.symlink_to(tmp_path / "nowhere.py")
    result = run_cli("lint", link)
    assert result.exit_code == 2 and "broken symbolic link" in result.stderr


def test_file_deleted_between_discovery_and_read(tmp_path, run_cli, good, monkeypatch):
    from torchmigrate.engine import files

    doomed = tmp_path / "doomed.py"
    doomed.write_bytes(GOOD_SCRIPT.read_bytes())
    real_read = files.read

    def read(path):
        if Path(path).name == "doomed.py":
            Path(path).unlink()
        return real_read(path)

    monkeypatch.setattr(files, "read", read)
    result = run_cli("ddp", doomed, good)
    assert result.exit_code == 2
    assert "disappeared" in error_for(result, doomed)["message"]
    assert not doomed.exists()
    monkeypatch.setattr(files, "read", real_read)
    assert good.read_bytes() == expected_good(run_cli, tmp_path)
    assert leftovers(tmp_path) == []


def test_file_edited_while_processing_is_not_overwritten(tmp_path, run_cli, monkeypatch):
    from torchmigrate.engine import process as engine  # the runner imports it when it processes a file

    path = tmp_path / "train.py"
    path.write_bytes(GOOD_SCRIPT.read_bytes())
    real = engine.process_source

    def process_source(*args, **kwargs):
        result = real(*args, **kwargs)
        path.write_bytes(GOOD_SCRIPT.read_bytes() + b"# saved from the editor meanwhile\n")
        return result

    monkeypatch.setattr(engine, "process_source", process_source)
    result = run_cli("ddp", path)
    assert result.exit_code == 2
    assert "changed on disk" in error_for(result, path)["message"]
    assert path.read_bytes().endswith(b"# saved from the editor meanwhile\n")
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory(tmp_path, run_cli):
    folder = tmp_path / "locked"
    folder.mkdir()
    path = folder / "train.py"
    path.write_bytes(GOOD_SCRIPT.read_bytes())
    folder.chmod(0o555)
    try:
        result = run_cli("ddp", path)
    finally:
        folder.chmod(0o755)
    assert result.exit_code == 2
    assert "cannot write" in error_for(result, path)["message"]
    assert path.read_bytes() == GOOD_SCRIPT.read_bytes()
    assert leftovers(tmp_path) == []


def test_temp_file_cannot_be_created(tmp_path, run_cli, good, monkeypatch):
    """The unwritable directory case as root sees it (root ignores directory permissions):
    the temporary file cannot be created."""
    from torchmigrate.engine import files

    folder = tmp_path / "locked"
    folder.mkdir()
    path = folder / "train.py"
    path.write_bytes(GOOD_SCRIPT.read_bytes())
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if Path(dir) == folder:
            raise PermissionError(13, "Permission denied")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    result = run_cli("ddp", path, good)
    assert result.exit_code == 2
    message = error_for(result, path)["message"]
    assert "cannot write" in message and "temporary file" in message and "Permission denied" in message
    assert path.read_bytes() == GOOD_SCRIPT.read_bytes()
    monkeypatch.setattr(tempfile, "mkstemp", real)
    assert good.read_bytes() == expected_good(run_cli, tmp_path)
    assert leftovers(tmp_path) == []


def test_rename_fails_during_cli_write(tmp_path, run_cli, monkeypatch):
    path = tmp_path / "train.py"
    path.write_bytes(GOOD_SCRIPT.read_bytes())

    def boom(*args):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", boom)
    result = run_cli("ddp", path)
    assert result.exit_code == 2
    assert "Read-only file system" in error_for(result, path)["message"]
    assert path.read_bytes() == GOOD_SCRIPT.read_bytes()
    assert leftovers(tmp_path) == []


def test_directory_named_py_and_missing_file(tmp_path, run_cli, good):
    folder = tmp_path / "pkg.py"
    folder.mkdir()
    result = run_cli("lint", "--exit-zero", tmp_path / "missing.py", good)
    assert result.exit_code == 2 and "no such file" in result.stderr

"""Reading and safely writing the user's files (which files: `discover.py`).

Never lose the user's work: decoding keeps the exact encoding and BOM so the file can be
written back byte-for-byte the same except for the intended edits, and writes go to a
temporary file in the same directory that replaces the original only once it is complete.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from torchmigrate.errors import InputError
from torchmigrate.program.fs import digest


@dataclass(frozen=True)
class Decoded:
    text: str
    encoding: str  # codec name used to write the text back ("utf-8-sig" keeps a BOM)
    stamp: Optional[Tuple[int, int, int]] = None  # (inode, size, mtime_ns) when read from disk
    digest: str = ""  # hash of the bytes read (`program.fs.digest`), for the lint cache


def decode(data: bytes) -> Decoded:
    """Decode like Python does (BOM, coding cookie, UTF-8 default), keeping what is needed to
    write the text back in the same encoding. Newlines are kept as they are."""
    if b"\x00" in data:
        raise InputError("not a text file (contains NUL bytes)")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:
        raise InputError(f"cannot decode: {exc.msg if hasattr(exc, 'msg') else exc}") from None
    try:
        text = data.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        line = data[: getattr(exc, "start", 0)].count(b"\n") + 1
        raise InputError(f"cannot decode as {encoding}: {exc.reason if hasattr(exc, 'reason') else exc}", line) from None
    if encoding == "utf-8-sig" and text.startswith("\ufeff"):
        text = text[1:]
    return Decoded(text, encoding)


def _stamp(st: os.stat_result) -> Tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


# A source file larger than this is refused rather than read: the parse would take minutes.
MAX_SOURCE_BYTES = 64 * 1024 * 1024


def read(path: Path) -> Decoded:
    """Read a source file, bounded: opening never blocks (O_NONBLOCK, for a named pipe put in
    place after discovery), only a regular file is read, and at most `MAX_SOURCE_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with open(fd, "rb") as handle:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError
            if not stat.S_ISREG(st.st_mode):
                raise InputError("not a regular file")
            stamp = _stamp(st)
            data = handle.read(MAX_SOURCE_BYTES + 1)
    except FileNotFoundError:
        raise InputError("file disappeared before it could be read") from None
    except IsADirectoryError:
        raise InputError("is a directory") from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise InputError(f"too large to process (over {MAX_SOURCE_BYTES // 2 ** 20} MiB)")
    decoded = decode(data)
    return Decoded(decoded.text, decoded.encoding, stamp, digest(data))


def encode(text: str, encoding: str) -> bytes:
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as exc:
        raise InputError(f"the rewritten file cannot be encoded as {encoding}: {exc.reason}") from None


def atomic_write(path: Path, data: bytes, expect: Optional[Tuple[int, int, int]] = None) -> None:
    """Replace the file's content atomically, keeping its mode (and owner, where allowed);
    follows symlinks to the target. With `expect` (the `Decoded.stamp` of the read), a file
    that changed on disk since it was read is not overwritten.

    The data goes to a temporary file in the target's folder, is flushed and fsynced, then
    renamed over the target: at every moment the target holds either the old or the new
    content, and on any failure the temporary file is removed.
    """
    staged = stage(path, data, expect)
    try:
        os.replace(staged.tmp, staged.target)
    except BaseException as exc:
        staged.discard()
        if isinstance(exc, OSError):
            raise InputError(f"cannot write: {exc.strerror or exc}") from None
        raise


@dataclass
class Staged:
    """New content written and fsynced beside its target, not yet renamed over it."""

    target: Path
    tmp: str

    def discard(self) -> None:
        try:
            os.unlink(self.tmp)
        except OSError:
            pass


def stage(path: Path, data: bytes, expect: Optional[Tuple[int, int, int]] = None) -> Staged:
    """The first half of `atomic_write`: every check, and the complete temporary file (same
    mode and owner as the target). Raises InputError, leaving nothing behind."""
    target = Path(os.path.realpath(path))
    try:
        st = target.stat()
    except FileNotFoundError:
        raise InputError("cannot write: the file disappeared while it was being processed") from None
    except OSError as exc:
        raise InputError(f"cannot write: {exc.strerror or exc}") from None
    mode = stat.S_IMODE(st.st_mode)
    # Read-only means no write bit at all, even for root (who os.access() says can write).
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH) or not os.access(target, os.W_OK):
        raise InputError("cannot write: file is read-only")
    if expect is not None and _stamp(st) != expect:
        raise InputError("cannot write: the file changed on disk while it was being processed; run again")
    try:
        import tempfile  # only when writing: a lint run writes nothing

        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise InputError(f"cannot write: cannot create a temporary file in {target.parent}: "
                         f"{exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        if hasattr(os, "chown") and (st.st_uid, st.st_gid) != _owner(tmp):
            try:
                os.chown(tmp, st.st_uid, st.st_gid)
            except OSError:
                pass  # not permitted (not root): the file becomes ours, as with any editor
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot write: {exc.strerror or exc}") from None
        raise
    return Staged(target, tmp)


class ChangeSetError(InputError):
    """One file of a change set could not be written (`path`); no file of the set was."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


def write_all(changes: Sequence[Tuple[Path, bytes, Optional[Tuple[int, int, int]]]]) -> None:
    """Write several files as one change: every file gets its new content, or none does.

    All temporary files are written first (any check failing there leaves every file as it
    was); then each original is kept under a hard link beside it and the new file is renamed
    over it. If a rename fails, the files already replaced get their originals back. A
    migrated program is never left half old, half new. Raises ChangeSetError for the file.
    """
    staged: List[Tuple[Staged, Path]] = []
    try:
        for path, data, expect in changes:
            try:
                staged.append((stage(path, data, expect), path))
            except InputError as exc:
                raise ChangeSetError(path, exc.message) from None
    except BaseException:
        for s, _ in staged:
            s.discard()
        raise
    done: List[Tuple[Staged, str]] = []
    try:
        for s, path in staged:
            backup = f"{s.tmp}.orig"
            try:
                os.link(s.target, backup)
            except OSError:
                backup = ""
            try:
                os.replace(s.tmp, s.target)
            except OSError as exc:
                if backup:
                    os.unlink(backup)
                raise ChangeSetError(path, f"cannot write: {exc.strerror or exc}") from None
            done.append((s, backup))
    except BaseException:
        for s, backup in reversed(done):
            if backup:
                with contextlib.suppress(OSError):
                    os.replace(backup, s.target)
        for s, _ in staged[len(done):]:
            s.discard()
        raise
    for _, backup in done:
        if backup:
            with contextlib.suppress(OSError):
                os.unlink(backup)


def _owner(path: str) -> Tuple[int, int]:
    st = os.stat(path)
    return st.st_uid, st.st_gid

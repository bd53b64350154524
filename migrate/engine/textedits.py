"""A fix as text replacements (what `lint --format json/sarif` hand to editors and bots), and
the unified diff of a changed file (`--dry-run`).

Fixes are made on the syntax tree, so the replacements are read off the source before and
after the fix: the changed runs of lines (difflib), each trimmed to the characters that differ.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class TextEdit:
    """Replace the text from (line, col) up to (end_line, end_col) with `content`. Lines are
    1-based, columns 0-based code points; the end is exclusive (start == end: an insertion)."""

    line: int
    col: int
    end_line: int
    end_col: int
    content: str


def text_edits(old: str, new: str) -> Tuple[TextEdit, ...]:
    """The smallest replacements, in order, that turn `old` into `new`."""
    import difflib  # here: a warm lint run, which reads its results from the cache, never diffs

    a, b = lines(old), lines(new)
    edits: List[TextEdit] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        before, after = "".join(a[i1:i2]), "".join(b[j1:j2])
        prefix = _common_prefix(before, after)
        if before[prefix - 1:prefix + 1] == "\r\n":  # never between the two ends of a CRLF
            prefix -= 1
        suffix = _common_prefix(before[prefix:][::-1], after[prefix:][::-1])
        cut = len(before) - suffix
        if suffix and before[cut - 1:cut + 1] == "\r\n":
            suffix -= 1
        start = _position(before, prefix, i1 + 1)
        end = _position(before, len(before) - suffix, i1 + 1)
        edits.append(TextEdit(*start, *end, after[prefix:len(after) - suffix]))
    return tuple(edits)


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def lines(text: str) -> List[str]:
    """The lines of `text`, ends kept; only CR, LF and CRLF end a line (as for Python and SARIF;
    `str.splitlines` also splits at form feeds and other separators)."""
    return _LINE.findall(text)


def _common_prefix(x: str, y: str) -> int:
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def _position(text: str, offset: int, first_line: int) -> Tuple[int, int]:
    """(line, column) of `offset` in `text`, whose first line is `first_line`."""
    head = lines(text[:offset])
    if not head or head[-1].endswith(("\n", "\r")):
        return first_line + len(head), 0
    return first_line + len(head) - 1, len(head[-1])


def unified_diff(old: str, new: str, path: str) -> str:
    import difflib  # only when there is a diff to show

    prefix = ("", "") if os.path.isabs(path) else ("a/", "b/")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=f"{prefix[0]}{path}", tofile=f"{prefix[1]}{path}",
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def line_map(old: str, new: str):
    """Where each line of `old` is in `new`: a function from a 1-based line of `old` to one of
    `new` (an unchanged line: the same line, moved; a changed one: its counterpart in the
    replacement, else the first line after what was removed), so a report made on the source
    as it was read points into the file as written."""
    import difflib

    a, b = lines(old), lines(new)
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()

    def where(line: int) -> int:
        index = line - 1
        for tag, i1, i2, j1, j2 in blocks:
            if i1 <= index < i2:
                if tag == "equal":
                    return j1 + (index - i1) + 1
                return (j1 + min(index - i1, max(j2 - j1 - 1, 0)) + 1) if j2 > j1 else min(j1 + 1, max(len(b), 1))
        return line if index < len(a) else min(line + len(b) - len(a), max(len(b), 1))

    return where

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
    as it was read points into the file as written.

    A patience alignment, O(n log n) even for a generated file of megabytes: the lines that
    occur once in each file anchor it (the longest run of them in the same order), and each gap
    between two anchors matches its common first and last lines; what is left in a gap was
    replaced. A migration inserts and replaces lines, never reorders them, so this is exact
    for it wherever a line can be told apart."""
    import bisect
    from collections import Counter

    a, b = lines(old), lines(new)
    count_a, count_b = Counter(a), Counter(b)
    in_b = {line: j for j, line in enumerate(b) if count_b[line] == 1}
    pairs = [(i, in_b[line]) for i, line in enumerate(a) if count_a[line] == 1 and line in in_b]
    tails: List[int] = []  # patience sorting: the longest run of pairs increasing in both files
    tail_at: List[int] = []
    before: List[int] = []
    for k, (_, j) in enumerate(pairs):
        at = bisect.bisect_left(tails, j)
        if at == len(tails):
            tails.append(j)
            tail_at.append(k)
        else:
            tails[at], tail_at[at] = j, k
        before.append(tail_at[at - 1] if at else -1)
    anchors: List[Tuple[int, int]] = []
    k = tail_at[-1] if tail_at else -1
    while k >= 0:
        anchors.append(pairs[k])
        k = before[k]
    anchors.reverse()
    to_new = [0] * len(a)
    start_a = start_b = 0
    for end_a, end_b in [*anchors, (len(a), len(b))]:
        _align_gap(a, b, start_a, end_a, start_b, end_b, to_new)
        if end_a < len(a):
            to_new[end_a] = end_b
        start_a, start_b = end_a + 1, end_b + 1
    last = max(len(b), 1)

    def where(line: int) -> int:
        return min(to_new[line - 1] + 1, last) if 0 < line <= len(a) else min(line + len(b) - len(a), last)

    return where


def _align_gap(a: List[str], b: List[str], i1: int, i2: int, j1: int, j2: int, to_new: List[int]) -> None:
    """`a[i1:i2]` against `b[j1:j2]`: equal first and last lines matched, then what lies between
    aligned by difflib when it is small (a file of repeated lines has few anchors), else taken
    as replaced: its counterpart in the replacement, or, removed, the line that now follows."""
    while i1 < i2 and j1 < j2 and a[i1] == b[j1]:
        to_new[i1] = j1
        i1, j1 = i1 + 1, j1 + 1
    while i1 < i2 and j1 < j2 and a[i2 - 1] == b[j2 - 1]:
        i2, j2 = i2 - 1, j2 - 1
        to_new[i2] = j2
    blocks = [("replace", i1, i2, j1, j2)]
    if i2 > i1 and j2 > j1 and (i2 - i1) * (j2 - j1) <= _SMALL_GAP:
        import difflib

        blocks = [(tag, i1 + x1, i1 + x2, j1 + y1, j1 + y2) for tag, x1, x2, y1, y2 in
                  difflib.SequenceMatcher(None, a[i1:i2], b[j1:j2], autojunk=False).get_opcodes()]
    for tag, x1, x2, y1, y2 in blocks:
        for i in range(x1, x2):
            to_new[i] = (y1 + (i - x1) if tag == "equal" else y1 + min(i - x1, y2 - y1 - 1) if y2 > y1 else y1)


_SMALL_GAP = 4_000_000  # lines x lines that difflib aligns in well under a second

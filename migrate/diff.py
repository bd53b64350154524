"""Unified diffs for `--dry-run`, coloured only when the output is a terminal."""

from __future__ import annotations

import difflib
import os
from typing import IO, Optional

import click


def unified_diff(old: str, new: str, path: str) -> str:
    prefix = ("", "") if os.path.isabs(path) else ("a/", "b/")
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True),
        fromfile=f"{prefix[0]}{path}", tofile=f"{prefix[1]}{path}",
    )
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def use_color(stream: Optional[IO] = None) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set (https://no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    stream = stream or click.get_text_stream("stdout")
    return bool(getattr(stream, "isatty", lambda: False)())


def colorize(diff: str) -> str:
    out = []
    for line in diff.splitlines(keepends=True):
        if line.startswith(("+++", "---")):
            out.append(click.style(line, bold=True))
        elif line.startswith("@@"):
            out.append(click.style(line, fg="cyan"))
        elif line.startswith("+"):
            out.append(click.style(line, fg="green"))
        elif line.startswith("-"):
            out.append(click.style(line, fg="red"))
        else:
            out.append(line)
    return "".join(out)

"""The colours of `--dry-run` diffs, only when the output is a terminal (the diffs themselves:
`engine.textedits.unified_diff`)."""

from __future__ import annotations

import os
import sys
from typing import IO, Optional

import click


def use_color(stream: Optional[IO] = None) -> bool:
    """Colour only on a terminal. A non-empty NO_COLOR turns it off (https://no-color.org);
    a FORCE_COLOR other than "", "0" or "false" turns it on even when piped (NO_COLOR wins);
    TERM=dumb turns it off on a terminal."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR", "").strip().lower() not in ("", "0", "false", "no"):
        return True
    if os.environ.get("TERM") == "dumb":
        return False
    stream = stream or sys.stdout
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def colorize(diff: str) -> str:
    """ANSI colours as git uses them: bold file headers, cyan hunks, red removals, green additions."""
    out = []
    for line in diff.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        end = line[len(body):]
        if line.startswith(("+++", "---")):
            body = click.style(body, bold=True)
        elif line.startswith("@@"):
            body = click.style(body, fg="cyan")
        elif line.startswith("+"):
            body = click.style(body, fg="green")
        elif line.startswith("-"):
            body = click.style(body, fg="red")
        out.append(body + end)
    return "".join(out)

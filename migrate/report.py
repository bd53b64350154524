"""What the user reads after `ddp`/`amp` (in place, `--dry-run`, `--check`): the migration report.

Lint output (`--format text/json/github/sarif`, `--statistics`) lives in `formats.py`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Dict, List, Optional, Sequence

from torchmigrate.formats import error_lines
from torchmigrate.runner import Outcome

__all__ = ["error_lines", "target_problem", "write", "migration_summary", "migration_text", "migration_json", "summary_line"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def migration_summary(outcomes: Sequence[Outcome], dry_run: bool) -> Dict:
    changes = Counter(r.code for o in outcomes for r in o.records if r.applied)
    attention = [r for o in outcomes for r in o.open_records]
    changed_files = [o.path for o in outcomes if o.changed]
    return {
        "files_checked": len(outcomes),
        "files_changed": changed_files,
        "dry_run": dry_run,
        "changes": dict(sorted(changes.items())),
        "attention": [r.__dict__ for r in attention],
        "errors": error_lines(outcomes),
    }


def summary_line(outcomes: Sequence[Outcome], dry_run: bool) -> str:
    """The last line of a migration report: `N files would be changed; M findings need attention.`
    (`changed` when written), or `Nothing to change (N files checked)[; M findings need attention].`"""
    n_files = sum(1 for o in outcomes if o.changed)
    attention = sum(len(o.open_records) for o in outcomes)
    n_errors = sum(1 for o in outcomes if o.error)
    checked = len(outcomes) - n_errors
    need = f"{_plural(attention, 'finding')} {'needs' if attention == 1 else 'need'} attention"
    if not n_files:
        line = f"Nothing to change ({_plural(checked, 'file')} checked)"
        line += f"; {need}." if attention else "."
    else:
        verb = "would be changed" if dry_run else "changed"
        line = f"{n_files} file{'' if n_files == 1 else 's'} {verb}; {need}."
    if n_errors:
        line += f" {_plural(n_errors, 'file')} could not be processed (see errors above)."
    return line


def migration_text(outcomes: Sequence[Outcome], dry_run: bool, names: Dict[str, str]) -> str:
    data = migration_summary(outcomes, dry_run)
    lines: List[str] = []
    if data["changes"]:
        lines.append("Changes:" if not dry_run else "Changes (not written):")
        for code, n in data["changes"].items():
            lines.append(f"  {code} {names.get(code, ''):<28} {n}")
    attention = [r for o in outcomes for r in o.open_records]
    if attention:
        lines.append("Needs attention:")
        for r in attention:
            lines.append(f"  {r.location}: {r.code} {r.message}")
    lines.append(summary_line(outcomes, dry_run))
    return "\n".join(lines)


def migration_json(outcomes: Sequence[Outcome], dry_run: bool) -> str:
    return json.dumps(migration_summary(outcomes, dry_run), indent=2)


def target_problem(path: str) -> Optional[str]:
    """Why `--report PATH` could not be written, checked before any file is processed (so a
    typo in the folder name does not surface only after every file was rewritten); None if
    it can be."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{path}: the folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{path}: the folder {folder} is not writable"
    return None


def write(path: str, content: str) -> Optional[str]:
    """Write the report; the error line if that fails after all (disk full, a race)."""
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(content)
    except OSError as exc:
        return f"{path}: cannot write the report: {exc.strerror or exc}"
    return None

"""What the user reads after `ddp`/`amp` (in place, `--dry-run`, `--check`): the migration report.

Lint output (`--format text/json/github/sarif`, `--statistics`) lives in `formats.py`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence

from torchmigrate.formats import error_lines
from torchmigrate.runner import Outcome

__all__ = ["error_lines", "migration_summary", "migration_text", "migration_json", "summary_line"]


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


def program_lines(outcomes: Sequence[Outcome], followed: Sequence[Path]) -> List[str]:
    """Which files made up the program, so a user sees that `utils/ckpt.py` was migrated too."""
    if not followed:
        return []
    keys = {os.path.realpath(p) for p in followed}
    imported = [o for o in outcomes if os.path.realpath(o.path) in keys]
    lines = [f"Program: {len(outcomes)} files ({_plural(len(imported), 'module')} found through imports)"]
    for o in outcomes:
        state = "error" if o.error else ("changed" if o.changed else "unchanged")
        how = "imported" if o in imported else "given"
        lines.append(f"  {o.path}  [{how}, {state}]")
    return lines


def migration_text(outcomes: Sequence[Outcome], dry_run: bool, names: Dict[str, str],
                   followed: Sequence[Path] = ()) -> str:
    data = migration_summary(outcomes, dry_run)
    lines: List[str] = program_lines(outcomes, followed)
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

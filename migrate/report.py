"""What the user reads after a run: lint output and the migration report."""

from __future__ import annotations

import json
from collections import Counter
from typing import Dict, List, Sequence

from torchmigrate.runner import Outcome, Record


def error_lines(outcomes: Sequence[Outcome]) -> List[str]:
    return [f"{o.path}:{o.error[0]}:{o.error[1] + 1}: {o.error[2]}" for o in outcomes if o.error]


def lint_text(outcomes: Sequence[Outcome], fixed_mode: bool) -> str:
    lines = []
    remaining = [r for o in outcomes for r in o.open_records]
    for r in remaining:
        lines.append(f"{r.location}: {r.code} {r.message}")
    fixed = sum(1 for o in outcomes for r in o.records if r.applied)
    fixable = sum(1 for r in remaining if r.safety == "safe" and not fixed_mode)
    if remaining:
        summary = f"Found {len(remaining)} finding{'s' if len(remaining) != 1 else ''}"
        if fixed:
            summary += f" ({fixed} fixed, {len(remaining)} remaining)"
        elif fixable:
            summary += f" ({fixable} fixable with --fix)"
        lines.append(summary + ".")
    elif fixed:
        lines.append(f"Found {fixed} finding{'s' if fixed != 1 else ''} ({fixed} fixed, 0 remaining).")
    else:
        lines.append("All checks passed!")
    return "\n".join(lines)


def statistics(outcomes: Sequence[Outcome], names: Dict[str, str]) -> str:
    counts = Counter(r.code for o in outcomes for r in o.open_records)
    return "\n".join(f"{n:5d}\t{code}\t{names.get(code, '')}" for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def migration_summary(outcomes: Sequence[Outcome], dry_run: bool) -> Dict:
    changes = Counter(r.code for o in outcomes for r in o.records if r.applied)
    attention = [r for o in outcomes for r in o.open_records]
    changed_files = [o.path for o in outcomes if o.changed]
    return {
        "files_changed": changed_files,
        "dry_run": dry_run,
        "changes": dict(sorted(changes.items())),
        "attention": [r.__dict__ for r in attention],
        "errors": error_lines(outcomes),
    }


def migration_text(outcomes: Sequence[Outcome], dry_run: bool, names: Dict[str, str]) -> str:
    data = migration_summary(outcomes, dry_run)
    lines = []
    if data["changes"]:
        lines.append("Changes:")
        for code, n in data["changes"].items():
            lines.append(f"  {code} {names.get(code, ''):<24} {n}")
    attention = [r for o in outcomes for r in o.open_records]
    if attention:
        lines.append("Needs attention:")
        for r in attention:
            lines.append(f"  {r.path}:{r.line}: {r.code} {r.message}")
    n_files = len(data["files_changed"])
    verb = "would be changed" if dry_run else "changed"
    if n_files or attention:
        lines.append(
            f"{n_files} file{'s' if n_files != 1 else ''} {verb}; "
            f"{len(attention)} finding{'s' if len(attention) != 1 else ''} need{'s' if len(attention) == 1 else ''} attention."
        )
    else:
        lines.append("Nothing to change.")
    return "\n".join(lines)


def migration_json(outcomes: Sequence[Outcome], dry_run: bool) -> str:
    return json.dumps(migration_summary(outcomes, dry_run), indent=2)


def lint_json(outcomes: Sequence[Outcome]) -> str:
    return json.dumps(
        [
            {"path": r.path, "line": r.line, "column": r.col + 1, "code": r.code,
             "message": r.message, "safety": r.safety, "fixed": r.applied}
            for o in outcomes for r in o.records
        ],
        indent=2,
    )

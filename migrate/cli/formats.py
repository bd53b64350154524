"""`torchmigrate lint --format {text,json,github,sarif}` and `--statistics`.

Every formatter takes the run's outcomes (input order) and returns the text to print on
stdout. Input errors (syntax errors, unreadable files) are printed to stderr by the CLI as
`path:line:col: message`; the `github` and `sarif` formats also carry them, so a CI job shows
them as annotations or tool notifications.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Type

from torchmigrate import __version__
from torchmigrate.engine.outcome import Outcome, Record

if TYPE_CHECKING:  # rules are classes or their cached descriptions (see `catalogue`); no LibCST here
    from torchmigrate.rule import Rule

FORMATS = ("text", "json", "github", "sarif")

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
SARIF_VERSION = "2.1.0"
INFORMATION_URI = "https://pypi.org/project/torchmigrate/"

RuleTypes = Sequence[Type["Rule"]]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _remaining(outcomes: Sequence[Outcome]) -> List[Record]:
    return [r for o in outcomes for r in o.open_records]


def _fixed(outcomes: Sequence[Outcome]) -> int:
    return sum(1 for o in outcomes for r in o.records if r.applied)


def error_lines(outcomes: Sequence[Outcome]) -> List[str]:
    """`path:line:col: message`, or `path: message` for a path that could not be read at all."""
    return [f"{o.path}:{o.error[0]}:{o.error[1] + 1}: {o.error[2]}" if o.error[0] else f"{o.path}: {o.error[2]}"
            for o in outcomes if o.error]


# --- text ------------------------------------------------------------------------------------

def text(outcomes: Sequence[Outcome], fix: bool = False, unsafe_fixes: bool = False) -> str:
    """Ruff's shape: one `path:line:col: CODE message` line per finding, then a summary."""
    remaining = _remaining(outcomes)
    lines = [f"{r.location}: {r.code} {r.message}" for r in remaining]
    advice = [r for o in outcomes for r in o.advice_records]
    lines += [f"{r.location}: {r.code} note: {r.message}" for r in advice]
    fixed = _fixed(outcomes)
    safe = sum(1 for r in remaining if r.safety == "safe")
    unsafe = sum(1 for r in remaining if r.safety == "unsafe")
    if remaining or fixed:
        total = len(remaining) + fixed
        summary = f"Found {_plural(total, 'finding')}"
        if fixed:
            summary += f" ({fixed} fixed, {len(remaining)} remaining)"
        lines.append(summary + ".")
        hints = []
        fixable = safe + (unsafe if unsafe_fixes else 0)
        if fixable and not fix:
            hints.append(f"{fixable} fixable with --fix")
        if unsafe and not unsafe_fixes:
            hints.append(f"{unsafe} hidden fix{'es' if unsafe > 1 else ''} can be enabled with --unsafe-fixes")
        if hints:
            lines.append("; ".join(hints) + ".")
    errors = sum(1 for o in outcomes if o.error)
    if errors:  # never "All checks passed!" when an input failed
        lines.append(("" if remaining or fixed else "No findings in the files checked; ")
                     + f"{_plural(errors, 'file')} could not be checked (see the errors).")
    elif not remaining and not fixed:
        lines.append("All checks passed!")
    if advice:
        lines.append(f"{_plural(len(advice), 'note')} of advice: correct either way, not counted as findings.")
    return "\n".join(lines)


def fixes_text(outcomes: Sequence[Outcome], names: Dict[str, str], would: bool = False) -> str:
    """`--show-fixes`: the fixes applied (or, with `would`, to be applied) per file and rule."""
    parts = []
    for o in outcomes:
        counts = Counter(r.code for r in o.records if r.applied)
        if counts:
            parts.append(f"- {o.path}:")
            parts += [f"    {n} × {code} ({names.get(code, '')})" for code, n in sorted(counts.items())]
    total = sum(1 for o in outcomes for r in o.records if r.applied)
    if not total:
        return f"No findings {'would be' if would else 'were'} fixed."
    return f"{'Would fix' if would else 'Fixed'} {_plural(total, 'finding')}:\n" + "\n".join(parts)


def would_fix_line(outcomes: Sequence[Outcome], unsafe_fixes: bool) -> str:
    """The summary of `lint --diff` (on stderr: stdout is the diff)."""
    fixed = _fixed(outcomes)
    hidden = sum(1 for r in _remaining(outcomes) if r.safety == "unsafe") if not unsafe_fixes else 0
    line = f"Would fix {_plural(fixed, 'finding')}" if fixed else "No findings would be fixed"
    rest = len(_remaining(outcomes))
    if rest:
        line += f"; {rest} would remain"
        if hidden:
            line += f" ({hidden} fixable with --unsafe-fixes)"
    return line + "."


# --- json ------------------------------------------------------------------------------------

def _json_fix(record: Record) -> Optional[Dict]:
    """The fix this run did not apply, as edits of the file as it is now (null: none)."""
    if record.fix is None:
        return None
    return {"edits": [
        {"content": e.content, "location": {"line": e.line, "column": e.col + 1},
         "end_location": {"line": e.end_line, "column": e.end_col + 1}}
        for e in record.fix]}


def json_records(outcomes: Sequence[Outcome], names: Dict[str, str]) -> List[Dict]:
    return [
        {"path": r.path, "line": r.line, "column": r.col + 1, "code": r.code, "name": names.get(r.code, ""),
         "message": r.message, "safety": r.safety, "fixed": r.applied, "fix": _json_fix(r),
         "level": "note" if r.advice else "error"}
        for o in outcomes for r in o.records
    ]


def json_(outcomes: Sequence[Outcome], rules: RuleTypes) -> str:
    """Every finding of the run, fixed ones included (`"fixed": true`); `"fix"` holds the edits
    of a fix not applied (columns 1-based, the end exclusive), as Ruff's json output does."""
    return json.dumps(json_records(outcomes, {r.code: r.name for r in rules}), indent=2)


# --- GitHub Actions workflow commands ---------------------------------------------------------

def escape_data(value: str) -> str:
    """Escape a workflow command's message (as @actions/core's `escapeData`)."""
    return value.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(value: str) -> str:
    """Escape a workflow command's property value (as @actions/core's `escapeProperty`)."""
    return escape_data(value).replace(":", "%3A").replace(",", "%2C")


def _command(path: str, line: int, col: int, title: str, message: str, kind: str = "error") -> str:
    """An `::error` annotation (`::notice` for advice); line 0: on the file as a whole."""
    where = (("file", path), ("line", line), ("col", col)) if line else (("file", path),)
    props = ",".join(f"{k}={escape_property(str(v))}" for k, v in (*where, ("title", title)))
    return f"::{kind} {props}::{escape_data(message)}"


def _workspace_path(path: str) -> str:
    """GitHub resolves annotation paths against the workspace (the working directory of the
    job), so an absolute path inside it is made relative."""
    if os.path.isabs(path):
        cwd = os.getcwd()
        try:
            if os.path.commonpath([cwd, path]) == cwd:
                return Path(os.path.relpath(path, cwd)).as_posix()
        except ValueError:  # another drive on Windows
            pass
    return Path(path).as_posix() if os.sep != "/" else path


def github(outcomes: Sequence[Outcome]) -> str:
    """`::error file=...,line=...,col=...,title=TM201::message`: an annotation per finding."""
    lines = []
    for o in outcomes:
        if o.error:
            lines.append(_command(_workspace_path(o.path), o.error[0], o.error[1] + 1, "torchmigrate", o.error[2]))
        for r in o.open_records:
            lines.append(_command(_workspace_path(r.path), r.line, r.col + 1, r.code, r.message))
        for r in o.advice_records:
            lines.append(_command(_workspace_path(r.path), r.line, r.col + 1, r.code, r.message, "notice"))
    return "\n".join(lines)


# --- SARIF 2.1.0 -----------------------------------------------------------------------------

def _artifact_location(path: str) -> Dict:
    """A relative path stays relative to %SRCROOT% (the working directory); others become file URIs."""
    from urllib.parse import quote  # only SARIF needs it

    norm = os.path.normpath(path)
    if not os.path.isabs(norm) and not norm.startswith(".." + os.sep) and norm != "..":
        return {"uri": quote(Path(norm).as_posix()), "uriBaseId": "%SRCROOT%"}
    return {"uri": Path(os.path.abspath(norm)).as_uri()}


def _sections(doc: str) -> Dict[str, str]:
    """`## Heading` -> body, for the rule docstrings written in Ruff's shape."""
    out: Dict[str, str] = {}
    heading = ""
    for line in doc.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip().lower()
            out[heading] = ""
        else:
            out[heading] = (out.get(heading, "") + "\n" + line).strip("\n")
    return {k: v.strip() for k, v in out.items()}


def _rule_descriptor(rule: Type[Rule]) -> Dict:
    doc = rule.documentation()
    sections = _sections(doc)
    what = " ".join(sections.get("what it does", "").split()) or rule.summary
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": what},
        "help": {"text": doc, "markdown": doc},
        "defaultConfiguration": {"level": "error"},
        "properties": {"fixSafety": rule.safety.value, "commands": sorted(rule.commands),
                       "tags": sorted(rule.commands)},
    }


def _sarif_fix(record: Record) -> Dict:
    """A SARIF `fix`: the replacements that apply the finding's fix to its file."""
    return {
        "description": {"text": f"{record.safety} fix for {record.code}"},
        "artifactChanges": [{
            "artifactLocation": _artifact_location(record.path),
            "replacements": [
                {"deletedRegion": {"startLine": e.line, "startColumn": e.col + 1,
                                   "endLine": e.end_line, "endColumn": e.end_col + 1},
                 "insertedContent": {"text": e.content}}
                for e in record.fix or ()],
        }],
    }


def _notification(o: Outcome) -> Dict:
    """An input error; one without a position (a missing path) names the artifact only."""
    line, col, message = o.error
    location: Dict = {"artifactLocation": _artifact_location(o.path)}
    if line:
        location["region"] = {"startLine": line, "startColumn": col + 1}
    return {"level": "error", "message": {"text": message}, "locations": [{"physicalLocation": location}]}


def sarif_log(outcomes: Sequence[Outcome], rules: RuleTypes, cwd: Optional[str] = None) -> Dict:
    """The run as a SARIF 2.1.0 log: one run, every enabled rule, one result per open finding."""
    descriptors = [_rule_descriptor(r) for r in rules]
    index = {r.code: i for i, r in enumerate(rules)}
    results = []
    for o in outcomes:
        for r in o.open_records + o.advice_records:
            result = {
                "ruleId": r.code,
                "level": "note" if r.advice else "error",
                "message": {"text": r.message},
                "locations": [{"physicalLocation": {
                    "artifactLocation": _artifact_location(r.path),
                    "region": {"startLine": max(r.line, 1), "startColumn": r.col + 1},
                }}],
            }
            if r.code in index:
                result["ruleIndex"] = index[r.code]
            if r.fix is not None:
                result["fixes"] = [_sarif_fix(r)]
            results.append(result)
    notifications = [_notification(o) for o in outcomes if o.error]
    base = Path(cwd or os.getcwd()).resolve().as_uri().rstrip("/") + "/"
    run = {
        "tool": {"driver": {
            "name": "torchmigrate",
            "version": __version__,
            "semanticVersion": __version__,
            "informationUri": INFORMATION_URI,
            "rules": descriptors,
        }},
        "originalUriBaseIds": {"%SRCROOT%": {"uri": base}},
        "invocations": [{"executionSuccessful": not notifications,
                         "toolExecutionNotifications": notifications}],
        "columnKind": "unicodeCodePoints",
        "results": results,
    }
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def sarif(outcomes: Sequence[Outcome], rules: RuleTypes) -> str:
    return json.dumps(sarif_log(outcomes, rules), indent=2)


# --- statistics ------------------------------------------------------------------------------

def statistics_rows(outcomes: Sequence[Outcome], rules: RuleTypes) -> List[Dict]:
    names = {r.code: r.name for r in rules}
    remaining = _remaining(outcomes)
    counts = Counter(r.code for r in remaining)
    fixable = Counter(r.code for r in remaining if r.safety == "safe")
    return [
        {"code": code, "name": names.get(code, ""), "count": n, "fixable": fixable[code]}
        for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    ]


def statistics(outcomes: Sequence[Outcome], rules: RuleTypes, fmt: str = "text") -> str:
    """A count per rule of the findings that remain (`[*]`: some have a safe fix)."""
    rows = statistics_rows(outcomes, rules)
    if fmt == "json":
        return json.dumps(rows, indent=2)
    width = max((len(str(row["count"])) for row in rows), default=1)
    return "\n".join(
        f"{row['count']:>{width}}\t{row['code']}\t{'[*] ' if row['fixable'] else '    '}{row['name']}"
        for row in rows
    )


def render(fmt: str, outcomes: Sequence[Outcome], rules: RuleTypes, *, fix: bool = False,
           unsafe_fixes: bool = False) -> str:
    if fmt == "json":
        return json_(outcomes, rules)
    if fmt == "github":
        return github(outcomes)
    if fmt == "sarif":
        return sarif(outcomes, rules)
    return text(outcomes, fix, unsafe_fixes)


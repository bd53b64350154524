"""What the user reads after `ddp`/`amp` (in place, `--dry-run`, `--check`): the migration report.

Lint output (`--format text/json/github/sarif`, `--statistics`) lives in `formats.py`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torchmigrate.cli.formats import error_lines
from torchmigrate.engine.outcome import Outcome

__all__ = ["error_lines", "target_problem", "write", "migration_summary", "migration_text", "migration_json",
           "summary_line", "not_done"]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def migration_summary(outcomes: Sequence[Outcome], dry_run: bool, ddp: bool = False,
                      unresolved: Sequence[str] = ()) -> Dict:
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
        "not_done": not_done(outcomes, unresolved) if ddp else [],
        "advice": [r.__dict__ for o in outcomes for r in o.advice_records],
        "notes": [n for o in outcomes for n in o.notes],
    }


def summary_line(outcomes: Sequence[Outcome], dry_run: bool, ddp: bool = False,
                 unresolved: Sequence[str] = ()) -> str:
    """The last line of a migration report: `N files would be changed; M findings need attention.`
    (`changed` when written), or `Nothing to change (N files checked)[; M findings need attention].`"""
    n_files = sum(1 for o in outcomes if o.changed)
    attention = sum(len(o.open_records) for o in outcomes)
    missing = len(not_done(outcomes, unresolved)) if ddp else 0
    n_errors = sum(1 for o in outcomes if o.error and not o.skipped_rules)
    n_partial = sum(1 for o in outcomes if o.skipped_rules)
    checked = len(outcomes) - n_errors
    need = f"{_plural(attention, 'finding')} {'needs' if attention == 1 else 'need'} attention"
    if not n_files:
        line = f"Nothing to change ({_plural(checked, 'file')} checked)"
        line += f"; {need}." if attention else "."
    else:
        verb = "would be changed" if dry_run else "changed"
        line = f"{n_files} file{'' if n_files == 1 else 's'} {verb}; {need}."
    advice = sum(len(o.advice_records) for o in outcomes)
    if advice:
        line += f" {_plural(advice, 'note')} of advice (see Notes)."
    if missing:
        line += f" NOT DONE under torchrun: {missing} (see above)."
    if n_errors:
        line += f" {_plural(n_errors, 'file')} could not be processed (see errors above)."
    if n_partial:
        line += f" {_plural(n_partial, 'file')} processed without a rule that failed on it (see errors above)."
    return line


def unresolved_lines(unresolved: Sequence[str]) -> List[str]:
    """Imports that look like the program's own modules but that the tool found nowhere: what
    they do (a loader, a checkpoint helper) is not migrated, and the user must know it."""
    if not unresolved:
        return []
    return ["Not followed: imports of what looks like the project's own code, found nowhere from where the "
            "program runs (set PYTHONPATH as the program's launch script does, or pass those files too), and "
            "modules loaded by a name known only at run time that no configuration file of the project names; "
            "nothing in them was checked or migrated:"] + [f"  {u}" for u in unresolved]


def program_lines(outcomes: Sequence[Outcome], followed: Sequence[Path]) -> List[str]:
    """Which files made up the program, so a user sees that `utils/ckpt.py` was migrated too."""
    if not followed:
        return []
    keys = {os.path.realpath(p) for p in followed}
    imported = [o for o in outcomes if os.path.realpath(o.path) in keys]
    lines = [f"Program: {len(outcomes)} files ({_plural(len(imported), 'module')} found through imports)"]
    for o in outcomes:
        state = "error" if o.error and not o.skipped_rules else ("changed" if o.changed else "unchanged")
        state += f", without {', '.join(o.skipped_rules)}" if o.skipped_rules else ""
        how = "launch commands" if o.launch else "imported" if o in imported else "given"
        lines.append(f"  {o.path}  [{how}, {state}]")
    return lines


WRITES_DONE = "writes, saves and logs on rank 0 only"
_DONE = (  # (what, rule codes whose applied changes show it[, words their message holds, or "!" + lacks])
    ("models wrapped in DDP (gradients averaged)", ("TM301", "TM306", "TM407"), "!parallel_part"),
    ("a loss summed over its batch keeps its step: the ranks' gradients summed, not averaged",
     ("TM301",), "loss_reduction=\"sum\""),
    ("functional models kept in sync (tm.share_params, gradients averaged by tm.sync_grads)", ("TM309",)),
    ("training data sharded (loaders, token streams, hand-made batches)", ("TM201",)),
    ("evaluation loaders sharded (each sample once)", ("TM203",), "shard it"),  # not a kept-whole loader's order
    ("epoch loops reshuffling (set_epoch)", ("TM202",)),
    (WRITES_DONE, ("TM501", "TM504", "TM505", "TM601", "TM602")),
    ("metrics reduced across ranks", ("TM701", "TM703")),
    ("random configuration drawn once and shared by every rank", ("TM107",), "!drawn alike on every rank"),
    ("orders and splits drawn alike on every rank (tm.agreed): one draw, which sharding cuts into disjoint shares",
     ("TM107",), "drawn alike on every rank"),
    ("the original's global batch kept: each rank loads batch_size / world_size (batch policy global)",
     ("TM305",), "per_rank_batch"),
    ("learning rates scaled with the world size (batch policy per-gpu)", ("TM305",), "is scaled with it"),
    ("each rank draws its own random numbers once training starts (tm.seed_per_rank)", ("TM105",)),
    ("steps skipped by all ranks together", ("TM108",)),
)


def every_rank_writes(outcomes: Sequence[Outcome]) -> List[str]:
    """`path:line (how path-expression)` of each place where the migrated program still writes a
    file on every rank: read off the migrated sources' effects (`program.effects`), through the
    calls between modules, so a write left in a helper, a class or a module the rules did not
    change counts wherever it runs unguarded."""
    from torchmigrate.program import effects  # only for a migration's report

    summaries = [o.effects for o in outcomes if o.effects is not None]
    if not summaries:
        return []
    shown = {os.path.realpath(o.path): o.path for o in outcomes}
    out: Dict[str, str] = {}
    for w in effects.unguarded_writes(effects.combine(summaries)):  # type: ignore[arg-type]
        where = f"{shown.get(w.path, w.path)}:{w.line}"
        if where not in out:
            target = f" {w.target}" if w.target and len(w.target) <= 40 else ""
            out[where] = f"{where} ({w.how}{target})"
    return list(out.values())


def not_done(outcomes: Sequence[Outcome], unresolved: Sequence[str] = ()) -> List[str]:
    """What the program still does wrong under torchrun, whatever the findings say: a program
    that trains with no model wrapped in DDP, or builds loaders and shards none of them, or
    writes files on every rank, or whose own modules were not all found (nothing in those was
    migrated), or in whose files no training step is seen at all (it trains in code the tool did
    not read, and "0 findings need attention" would claim a migration that did not happen)."""
    have = {s for o in outcomes for s in o.signals}
    out = []
    if unresolved:
        out.append(f"{_plural(len(unresolved), 'import')} of the program's own code not followed (see \"Not "
                   "followed\"): whatever those modules train, load, save or print is NOT migrated")
    for o in outcomes:
        if o.skipped_rules:
            out.append(f"{', '.join(o.skipped_rules)} failed on {o.path} (an internal error, see errors above) and "
                       f"{'was' if len(o.skipped_rules) == 1 else 'were'} skipped there: what "
                       f"{'it does' if len(o.skipped_rules) == 1 else 'they do'} is NOT done in that file")
    writes = every_rank_writes(outcomes)
    if writes:
        shown = ", ".join(writes[:6]) + (f", +{len(writes) - 6} more" if len(writes) > 6 else "")
        out.append(f"files still written by every rank (each rank writes the same file: torn or duplicated "
                   f"content; see the TM504/TM601 findings, or guard them with `if tm.is_main():`): {shown}")
    if "means_to_train" in have and "trains" not in have and not unresolved and not any(o.error for o in outcomes):
        out.append("no training step (a `.backward(...)`) in any file of the program the tool read: if it trains, "
                   "it does so in code the tool did not reach (a package imported from outside this project, a "
                   "library's trainer), and nothing there is made distributed (no DDP, no sharded data)")
    if "trains" in have and "wraps" not in have:
        out.append("no model is wrapped in DDP although the program trains: gradients are NOT synchronised, "
                   "every rank trains its own copy " + _see(outcomes, "TM301", "which model an optimizer trains"))
    if "loaders" in have and "shards" not in have:
        out.append("no DataLoader is sharded: every rank iterates the whole dataset "
                   + _see(outcomes, "TM201", "how the training data is loaded"))
    if "trains" in have and "loaders" not in have and "shards" not in have:  # (a loader subclass named `FastLoader`)
        out.append("the program builds no DataLoader: every rank trains on the same batches unless the code "
                   "shares them out by rank " + _see(outcomes, "TM201", "how the training data is loaded"))
    return out


def _see(outcomes: Sequence[Outcome], code: str, unknown: str) -> str:
    """Where the findings of `code` that need the user are, or that there are none (a summary line
    must not point to findings that do not exist)."""
    where = [r.location for o in outcomes for r in o.records if r.code == code and not r.applied and not r.advice]
    if not where:
        return f"(no finding says where: the tool could not tell {unknown}: do it by hand)"
    return f"(see {code} at {', '.join(where[:3])}" + (f", +{len(where) - 3} more)" if len(where) > 3 else ")")


def torchrun_lines(outcomes: Sequence[Outcome], unresolved: Sequence[str] = ()) -> List[str]:
    """The program summary: what the program does under torchrun after this run, where, and
    prominently what it does not."""
    applied = [r for o in outcomes for r in o.records if r.applied]
    lines = []
    missing = not_done(outcomes, unresolved)
    # (writes the run left to the user, as TODOs, are not done either: never claim them)
    listed = any(m.startswith("files still written by every rank") for m in missing)
    partly = listed or any(r.code in ("TM501", "TM504", "TM505") and not r.applied and not r.advice
                           for o in outcomes for r in o.records)
    for what, codes, *words in _DONE:
        where = [r.location for r in applied if r.code in codes and all(
            (w[1:] not in r.message) if w.startswith("!") else (w in r.message) for w in words)]
        if where:
            shown = ", ".join(where[:3]) + (f", +{len(where) - 3} more" if len(where) > 3 else "")
            if what == WRITES_DONE and partly:  # never claim more than was done
                lines.append(f"  partly done: some writes, saves and logs moved to rank 0 ({shown}), NOT all "
                             + ("(see below)" if listed else "(see the TM501/TM504/TM505 findings that need attention)"))
            else:
                lines.append(f"  done: {what}: {shown}")
    lines += [f"  NOT DONE: {m}" for m in missing]
    return (["Under torchrun:"] + lines) if lines else []


def migration_text(outcomes: Sequence[Outcome], dry_run: bool, names: Dict[str, str],
                   followed: Sequence[Path] = (), ddp: bool = False, unresolved: Sequence[str] = ()) -> str:
    """The report; with `ddp`, it opens with what the program does under torchrun."""
    data = migration_summary(outcomes, dry_run)
    lines: List[str] = program_lines(outcomes, followed) + unresolved_lines(unresolved) + (
        torchrun_lines(outcomes, unresolved) if ddp else [])
    if data["changes"]:
        lines.append("Changes:" if not dry_run else "Changes (not written):")
        for code, n in data["changes"].items():
            lines.append(f"  {code} {names.get(code, ''):<28} {n}")
    attention = [r for o in outcomes for r in o.open_records]
    if attention:
        lines.append("Needs attention:")
        for r in attention:
            lines.append(f"  {r.location}: {r.code} {r.message}")
    # advice (correct either way) and what the launch files tell, apart from what needs a person
    notes = [f"{r.location}: {r.code} {r.message}" for o in outcomes for r in o.advice_records]
    notes += [n for o in outcomes for n in o.notes]
    if notes:
        lines.append("Notes:")
        lines += [f"  {n}" for n in notes]
    lines.append(summary_line(outcomes, dry_run, ddp, unresolved))
    return "\n".join(lines)


def migration_json(outcomes: Sequence[Outcome], dry_run: bool, ddp: bool = False,
                   unresolved: Sequence[str] = ()) -> str:
    data = migration_summary(outcomes, dry_run, ddp, unresolved)
    data["unresolved_imports"] = list(unresolved)
    return json.dumps(data, indent=2)


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

"""Command line interface (click). Importing this module never imports torch.

Exit codes follow Ruff's and say one thing each (see `EXIT_CODES`): a run that writes (`ddp`,
`amp`, `lint --fix`) exits 1 when findings remain that need a person, as `ruff check --fix`;
a run that only previews (`--check`, `--dry-run`, `lint --diff`) exits 1 when a change is due,
as `ruff format --check` and `ruff check --diff`, whatever findings remain; 2 is a usage or
input error.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, NoReturn, Optional

import click

from torchmigrate import __version__, launchers
from torchmigrate.cli import formats, report
from torchmigrate.cli.config import ConfigError
from torchmigrate.cli.diff import colorize, use_color
from torchmigrate.cli.inputs import Inputs, Request, gather
from torchmigrate.cli.settings import Selection, split
from torchmigrate.engine.runner import (AUTO_JOBS_MIN_FILES, VENDORED_NAME, Job, Outcome, Progress, auto_jobs,
                                        process_file, run, write_together)
from torchmigrate.options import BATCH_POLICIES, RUNTIME_MODULE, Options

AMP_CHOICES = ("auto", "bf16", "fp16", "off")

EXIT_CODES = """\b
Exit codes:
  0  nothing left to do: no finding remains, no change is due
  1  in place (ddp, amp, lint --fix) or lint: findings remain that need a
     person (or, ddp, the program is NOT DONE under torchrun);
     previews (--check, --dry-run, lint --diff): a change is due
     (findings that need a person do not count: lint reports them)
  2  usage or input error (bad option, settings or selector; a path that
     is missing or cannot be read or parsed)"""


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


def _rule_names():
    from torchmigrate.cli.catalogue import all_rules

    return {r.code: r.name for r in all_rules()}


def _gather(command: str, paths, select, extend_select, ignore, amp: Optional[str], common, cache=None) -> Inputs:
    selection = Selection(split(select), split(extend_select), split(ignore))
    try:
        return gather(Request(command, tuple(paths), selection, amp, **common), cache)
    except ConfigError as exc:
        _fail(str(exc))


def _launch_files(paths, inputs: Inputs, around_scripts: bool) -> List[Path]:
    """The shell scripts, Makefiles and READMEs to check beside the Python files. A settings
    file met on the way that cannot be read is an error (exit 2), as it is in discovery, and
    comes before anything is written."""
    try:
        return launchers.files_for(paths, inputs.codes, inputs.left_out, around_scripts=around_scripts)
    except ConfigError as exc:
        _fail(str(exc))


def _run_files(files: List[Path], job: Job, jobs: int) -> List[Outcome]:
    """Run the job over these files (all of a run's, or the lint cache's misses); a progress bar
    goes to stderr on a terminal for long runs."""
    try:
        with Progress(len(files), sys.stderr) as progress:
            return run(files, job, jobs=jobs or auto_jobs(len(files)), progress=progress)
    except KeyboardInterrupt:  # writes are atomic: every file is either done or untouched
        click.echo("\nInterrupted (every file was either fully processed or left untouched).", err=True)
        sys.exit(130)


def _run(inputs: Inputs, job: Job, jobs: int) -> List[Outcome]:
    """Run the job over the inputs, then add the paths that could not be processed at all."""
    if inputs.reads_stdin:
        done = [process_file(inputs.stdin_name, job, inputs.stdin)] if inputs.stdin and not inputs.excluded else []
        return done + inputs.errors
    return _run_files(inputs.files, job, jobs) + inputs.errors


def _data_whole_where_unwrapped(outcomes: List[Outcome], inputs: Inputs, job: Job, jobs: int) -> List[Outcome]:
    """A program that trains, shards its data, and yet wraps no model in DDP (its optimizer is
    built where the tool cannot wrap, its training runs a method other than `forward`) would
    train one model per rank, each on part of the data: worse than the original. Its files are
    migrated again with the training data kept whole (`Options.shard_training`), so every rank
    trains the same model on the same data until the model is wrapped; the report says so.
    Nothing is written before this (`Job.together`)."""
    groups = [set(g) for g in (inputs.program.groups if inputs.program else [])]
    by_path = {os.path.realpath(o.path): o for o in outcomes}
    groups += [{p} for p in by_path if not any(p in g for g in groups)]
    redo = set()
    for group in groups:
        signals = {s for p in group if p in by_path for s in by_path[p].signals}
        if {"trains", "shards"} <= signals and "wraps" not in signals:
            redo |= group
    if not redo:
        return outcomes
    again = replace(job, options=replace(job.options, shard_training=False))
    if inputs.reads_stdin:
        return _run(inputs, again, jobs)
    files = [f for f in inputs.files if os.path.realpath(f) in redo]
    fresh = {os.path.realpath(o.path): o for o in _run_files(files, again, jobs)}
    return [fresh.get(os.path.realpath(o.path), o) for o in outcomes]


def _echo_errors(outcomes: List[Outcome]) -> bool:
    """The warnings (`warning: ...`, as Ruff's) then the input errors, on stderr; True if any
    error."""
    for outcome in outcomes:
        for warning in outcome.warnings:
            click.echo(f"warning: {warning}", err=True)
    lines = report.error_lines(outcomes)
    for line in lines:
        click.echo(line, err=True)
    return bool(lines)


def _echo_output(outcomes: List[Outcome], inputs: Inputs) -> None:
    """The new source of stdin on stdout; a source --force-exclude leaves out goes through
    unchanged (as Ruff does, so an editor's buffer is never emptied); nothing after an error."""
    data = next((o.output for o in outcomes if o.output is not None), None)
    if data is None and inputs.excluded and inputs.stdin is not None:
        data = inputs.stdin.text.encode(inputs.stdin.encoding)
    if data is not None:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _warn_all_excluded(inputs: Inputs) -> None:
    if inputs.excluded and not inputs.files and not inputs.reads_stdin:
        click.echo("warning: no Python files to process: every path given is excluded (--force-exclude)", err=True)


# --- options ---------------------------------------------------------------------------------

paths_argument = click.argument("paths", nargs=-1, type=click.Path(allow_dash=True))
jobs_option = click.option("-j", "--jobs", type=click.IntRange(0, 256), default=0, metavar="N",
                           help="Process files in N worker processes; 0 (the default): one per CPU for runs "
                                f"of {AUTO_JOBS_MIN_FILES} files or more, else in-process. Output order is unchanged.")
follow_option = click.option(
    "--follow/--no-follow", default=True, show_default=True,
    help="Follow the imports of the scripts into their project (sibling modules, packages, relative imports) "
         "and treat them as one program; --no-follow: only the files given.")


class _Commands(click.Group):
    """The commands, with `verify` (subprocesses, signals, a probe) imported only when it is
    run or listed: every lint run in a pre-commit hook pays for each module the CLI imports."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), "verify"])

    def get_command(self, ctx, name):
        if name == "verify":
            from torchmigrate.cli.verify import command

            return command
        return super().get_command(ctx, name)


def _common_options(func):
    """Rule selection, settings and file discovery: the same for ddp, amp and lint."""
    options = [
        click.option("--select", multiple=True, metavar="CODES",
                     help="Only these rule codes, prefixes or names, comma-separated or repeated (e.g. TM2,TM406); "
                          "replaces `select` of the settings. A selector that selects no rule is an error."),
        click.option("--extend-select", multiple=True, metavar="CODES",
                     help="Also these rules, on top of --select or `select`."),
        click.option("--ignore", multiple=True, metavar="CODES",
                     help="Skip these rule codes, prefixes or names, comma-separated or repeated."),
        click.option("--config", "config", type=click.Path(dir_okay=False), metavar="FILE",
                     help="Use these settings (a pyproject.toml or torchmigrate.toml) for every file, instead of "
                          "the closest settings file above each one; its exclude patterns are then relative to "
                          "the working directory."),
        click.option("--force-exclude", is_flag=True,
                     help="Apply the exclude patterns (and the folders a walk always skips) to paths given by name "
                          "too, as pre-commit passes every staged file by name."),
        click.option("--respect-gitignore/--no-respect-gitignore", "respect_gitignore", default=True,
                     show_default=True,
                     help="Leave out what .gitignore (in a git repository), .ignore and .git/info/exclude ignore "
                          "when searching folders."),
        click.option("--stdin-filename", metavar="NAME",
                     help="With `-` as the path: the name of the source read from stdin, used to find its settings "
                          "and excludes and in messages."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _common(config, force_exclude, respect_gitignore, stdin_filename, follow):
    return dict(config=config, force_exclude=force_exclude, respect_gitignore=respect_gitignore,
                stdin_filename=stdin_filename, follow=follow)


show_settings_option = click.option(
    "--show-settings", is_flag=True,
    help="Print the settings that apply to each path given (settings file, rules enabled, amp, exclusion, "
         "cache) and where each came from; process nothing.")


def _show_settings(command: str, paths, select, extend_select, ignore, amp, common, cache=None) -> NoReturn:
    """`--show-settings`: what a run with these options would use for each path, then exit 0."""
    from torchmigrate.cli.show_settings import describe

    if not paths:
        _fail("--show-settings needs the paths to describe (e.g. `torchmigrate lint --show-settings src/train.py`)")
    request = Request(command, tuple(paths), Selection(split(select), split(extend_select), split(ignore)), amp,
                      **common)
    try:
        click.echo(describe(request, cache))
    except ConfigError as exc:
        _fail(str(exc))
    sys.exit(0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(__version__, prog_name="torchmigrate")
def main() -> None:
    """Migrate PyTorch training scripts to torchrun + DDP + AMP, and lint distributed code.

    \b
      torchmigrate ddp train.py            rewrite in place (DDP + AMP)
      torchmigrate ddp --dry-run train.py  print the diff and the report, write nothing
      torchmigrate lint src/               report findings (pre-commit hook, CI)
      torchmigrate verify train.py         run it on 2 CPU ranks and check it trains correctly
      torchmigrate explain TM406           a rule's documentation and example
    """


# --- ddp / amp -------------------------------------------------------------------------------

def _migrate(command: str, paths, dry_run: bool, check: bool, amp: Optional[str], sync_bn: bool,
             report_file: Optional[str], vendor: bool, jobs: int, select, extend_select, ignore, common) -> None:
    problem = report_file and report.target_problem(report_file)
    if problem:
        _fail(f"--report {problem}")
    inputs = _gather(command, paths, select, extend_select, ignore, amp, common)
    if inputs.reads_stdin and vendor:
        _fail("--vendor-runtime writes the runtime beside the script: it needs a file, not stdin")
    preview = dry_run or check
    options = Options(mode=command, amp=amp or "auto", sync_bn=sync_bn, shard_eval=bool(common.get("shard_eval")),
                      batch_policy=inputs.batch_policy,
                      runtime_module="torchmigrate_runtime" if vendor else RUNTIME_MODULE)
    write = not preview and not inputs.reads_stdin
    # the program summary judges DDP only when the rules that make it are on for every file
    whole = command == "ddp" and all({"TM201", "TM301"} <= set(s.codes) for s in inputs.per_file.values())
    program = inputs.program
    launch_files = [] if inputs.reads_stdin else _launch_files(paths, inputs, around_scripts=True)
    job = Job(options, inputs.codes, write=write, want_diff=dry_run, vendor_runtime=vendor,
              program=(program.views or None) if program else None,
              together=write and (len(inputs.files) > 1 or bool(launch_files) or whole), per_file=inputs.per_file,
              to_stdout=inputs.reads_stdin and not preview)
    outcomes = _run(inputs, job, jobs)
    if whole:
        outcomes = _data_whole_where_unwrapped(outcomes, inputs, job, jobs)
    launch = launchers.Settings(command, apply=True, write=write, want_diff=dry_run, together=job.together)
    outcomes += launchers.run(launch_files, inputs.files, paths, launch, outcomes)
    if job.together:
        write_together(outcomes, job, launchers.link_groups(program.groups if program else [], launch))
    color = use_color(sys.stdout)
    for outcome in outcomes:
        if outcome.diff:
            click.echo(colorize(outcome.diff) if color else outcome.diff, nl=False, color=color)
    if job.to_stdout:
        _echo_output(outcomes, inputs)
    errors = _echo_errors(outcomes)
    _warn_all_excluded(inputs)
    text = report.migration_text(outcomes, preview, _rule_names(), program.followed if program else (), whole,
                                 program.unresolved if program else ())
    # stdout carries only the diff (--dry-run, for `git apply`) or the migrated source (stdin);
    # the report and its summary line then go to stderr.
    click.echo(text, err=dry_run or job.to_stdout)
    if report_file:
        content = (report.migration_json(outcomes, preview, whole, program.unresolved if program else ())
                   if report_file.endswith(".json") else text) + "\n"
        problem = report.write(report_file, content)
        if problem:
            click.echo(f"error: --report {problem}", err=True)
            errors = True
    for path in sorted({o.vendored for o in outcomes if o.vendored}):
        click.echo(f"Wrote {path}")
    if errors:
        sys.exit(2)
    if preview:
        sys.exit(1 if any(o.changed for o in outcomes) else 0)
    if any(o.open_records for o in outcomes) or (whole and report.not_done(outcomes, program.unresolved if program else ())):
        sys.exit(1)


def _migration_options(func):
    func = follow_option(func)
    func = click.option("--report", "report_file", type=click.Path(dir_okay=False),
                        help="Also write the report to FILE (JSON if it ends in .json).")(func)
    func = click.option("--amp", type=click.Choice(AMP_CHOICES), default=None,
                        help="Mixed precision: auto (runtime picks bf16/fp16), bf16, fp16 or off.")(func)
    func = click.option("--check", is_flag=True,
                        help="Write nothing; exit 1 if a change is due, 0 if not (findings that need a person "
                             "are reported but do not count).")(func)
    func = click.option("--dry-run", "--diff", "dry_run", is_flag=True,
                        help="Print the unified diff and the report; write nothing; exit as --check.")(func)
    return func


@main.command(epilog=EXIT_CODES)
@paths_argument
@_migration_options
@click.option("--sync-bn", is_flag=True, help="Convert BatchNorm layers to SyncBatchNorm (TM304).")
@click.option("--batch-policy", type=click.Choice(BATCH_POLICIES), default=None,
              help="global (default): each rank loads batch_size / world_size samples, so the global batch, the "
                   "steps per epoch and the learning rate stay the original's. per-gpu: each rank loads the whole "
                   "batch_size and the learning rate is scaled by the world size (TM305). Replaces `batch-policy` "
                   "of the settings.")
@click.option("--shard-eval/--no-shard-eval", "shard_eval", default=None,
              help="Shard evaluation loaders even where the tool cannot prove that every value computed from them "
                   "is reduced across ranks (a TODO names what is not). By default such a loader is kept whole: "
                   "every rank evaluates the whole set, as the original did. Replaces `shard-eval` of the settings.")
@click.option("--vendor-runtime", is_flag=True,
              help=f"Write the runtime shim beside each script as {VENDORED_NAME} and import it from there.")
@_common_options
@show_settings_option
@jobs_option
def ddp(paths, dry_run, check, amp, report_file, follow, sync_bn, batch_policy, shard_eval, vendor_runtime, select, extend_select,
        ignore, config, force_exclude, respect_gitignore, stdin_filename, show_settings, jobs):
    """Rewrite training scripts in place for torchrun + DDP (+ AMP).

    With --dry-run, print the unified diff (coloured on a terminal) and the report, write nothing.
    A launch file as the path (run.sh, a Makefile, a SLURM batch file, a README) migrates the
    scripts it starts together with its launch commands. `-` as the path reads a script from
    stdin and prints the migrated script to stdout (the report goes to stderr; its imports are
    not followed).
    """
    common = dict(_common(config, force_exclude, respect_gitignore, stdin_filename, follow), batch_policy=batch_policy)
    if show_settings:
        _show_settings("ddp", paths, select, extend_select, ignore, amp, common)
    _migrate("ddp", paths, dry_run, check, amp, sync_bn, report_file, vendor_runtime, jobs, select, extend_select,
             ignore, dict(common, shard_eval=shard_eval))


@main.command(epilog=EXIT_CODES)
@paths_argument
@_migration_options
@click.option("--vendor-runtime", is_flag=True,
              help=f"Write the runtime shim beside each script as {VENDORED_NAME} and import it from there.")
@_common_options
@show_settings_option
@jobs_option
def amp(paths, dry_run, check, amp, report_file, follow, vendor_runtime, select, extend_select, ignore,
        config, force_exclude, respect_gitignore, stdin_filename, show_settings, jobs):
    """Add or modernise mixed precision only (no DDP).

    Code that keeps nn.DataParallel gets autocast inside the model's forward. `-` as the path
    reads a script from stdin and prints the new script to stdout (the report goes to stderr).
    """
    common = _common(config, force_exclude, respect_gitignore, stdin_filename, follow)
    if show_settings:
        _show_settings("amp", paths, select, extend_select, ignore, amp, common)
    _migrate("amp", paths, dry_run, check, amp, False, report_file, vendor_runtime, jobs, select, extend_select,
             ignore, common)


# --- lint ------------------------------------------------------------------------------------

@main.command(epilog=EXIT_CODES)
@paths_argument
@click.option("--fix", is_flag=True, help="Apply safe fixes in place.")
@click.option("--unsafe-fixes", is_flag=True,
              help="Also count fixes that may change behaviour as fixable; with --fix, apply them too.")
@click.option("--diff", is_flag=True,
              help="Print the diff of what --fix would change and write nothing; exit 1 if a fix is due.")
@click.option("--show-fixes", is_flag=True, help="List the fixes applied (with --diff: that would be), per file.")
@click.option("--format", "fmt", type=click.Choice(formats.FORMATS), default="text", show_default=True,
              help="text: path:line:col: CODE message; json (with each fix's edits); github: workflow "
                   "annotations; sarif: SARIF 2.1.0 (with `fixes`).")
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when findings remain (input errors still exit 2).")
@click.option("--statistics", is_flag=True, help="Print a count per rule instead of each finding.")
@follow_option
@_common_options
@show_settings_option
@jobs_option
@click.option("--cache-dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Where to keep the results of unchanged files (default: $TORCHMIGRATE_CACHE_DIR, else "
                   ".torchmigrate_cache beside pyproject.toml or in the working directory).")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
def lint(paths, fix, unsafe_fixes, diff, show_fixes, fmt, exit_zero, statistics, follow, select, extend_select,
         ignore, config, force_exclude, respect_gitignore, stdin_filename, show_settings, jobs, cache_dir, no_cache):
    """Report rule findings (pre-commit hook / CI).

    Suppress one line with `# torchmigrate: ignore[TM201]`, a file with
    `# torchmigrate: skip-file`; configure with [tool.torchmigrate] in pyproject.toml or a
    torchmigrate.toml (the closest one above each file). `-` as the path reads the source from
    stdin; with --fix the fixed source goes to stdout and the findings to stderr.
    """
    from torchmigrate.cli import catalogue
    from torchmigrate.engine import cache as lint_cache

    if show_settings:
        _show_settings("lint", paths, select, extend_select, ignore, None, _common(
            config, force_exclude, respect_gitignore, stdin_filename, follow), (cache_dir, no_cache))
    # json and sarif carry each fix's edits, which the cache does not keep: those runs compute
    cache = None if paths == ("-",) or stdin_filename or (fmt in ("json", "sarif") and not statistics) \
        else lint_cache.open_for_lint(
        None if no_cache else cache_dir or "", paths)
    catalogue.use(cache.store if cache is not None else None)
    inputs = _gather("lint", paths, select, extend_select, ignore, None, _common(
        config, force_exclude, respect_gitignore, stdin_filename, follow), cache=cache)
    fix = fix or diff
    options = Options(mode="lint", fix=fix, unsafe_fixes=fix and unsafe_fixes)
    # The imported modules inform the checks (a model wrapped by the caller) but only the files
    # given are checked, as a pre-commit hook expects.
    program = inputs.program
    to_stdout = inputs.reads_stdin and fix and not diff
    job = Job(options, inputs.codes, write=fix and not diff and not inputs.reads_stdin, want_diff=diff,
              program=(program.views or None) if program else None, per_file=inputs.per_file,
              fix_edits=fmt in ("json", "sarif") and not statistics, to_stdout=to_stdout)
    if cache is not None and not inputs.reads_stdin:
        outcomes = cache.run(inputs.files, job, lambda todo: _run_files(todo, job, jobs)) + inputs.errors
    else:
        outcomes = _run(inputs, job, jobs)
    if not inputs.reads_stdin:
        launch_files = _launch_files(paths, inputs, around_scripts=False)
        outcomes += launchers.run(launch_files, inputs.files, paths,
                                  launchers.Settings("lint", apply=fix and not diff, write=fix and not diff), outcomes)
    errors = _echo_errors(outcomes)
    _warn_all_excluded(inputs)
    if diff:
        _lint_diff(outcomes, show_fixes, unsafe_fixes, errors)
    if to_stdout:
        _echo_output(outcomes, inputs)
    _lint_report(outcomes, inputs.codes, fmt, statistics, fix, unsafe_fixes, show_fixes, err=to_stdout)
    if errors:
        sys.exit(2)
    if not exit_zero and any(o.open_records for o in outcomes):
        sys.exit(1)


def _lint_diff(outcomes: List[Outcome], show_fixes: bool, unsafe_fixes: bool, errors: bool) -> NoReturn:
    """`lint --diff`: the diff on stdout, what would be fixed on stderr; exit 1 if a fix is due."""
    color = use_color(sys.stdout)
    for outcome in outcomes:
        if outcome.diff:
            click.echo(colorize(outcome.diff) if color else outcome.diff, nl=False, color=color)
    if show_fixes:
        click.echo(formats.fixes_text(outcomes, _rule_names(), would=True), err=True)
    click.echo(formats.would_fix_line(outcomes, unsafe_fixes), err=True)
    sys.exit(2 if errors else 1 if any(o.changed for o in outcomes) else 0)


def _lint_report(outcomes, codes, fmt, statistics, fix, unsafe_fixes, show_fixes, err: bool) -> None:
    from torchmigrate.cli.catalogue import get_rule

    rules = [get_rule(code) for code in codes]
    if statistics:
        out = formats.statistics(outcomes, rules, "json" if fmt == "json" else "text")
    else:
        out = formats.render(fmt, outcomes, rules, fix=fix, unsafe_fixes=unsafe_fixes)
        if show_fixes and fmt == "text":
            out = "\n".join(filter(None, [formats.fixes_text(outcomes, _rule_names()), out]))
    if out:
        click.echo(out, err=err)


# --- rules / explain -------------------------------------------------------------------------

def markdown_table(rules) -> str:
    """The rules table of the README (`torchmigrate rules --format markdown`)."""
    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| Code | Name | Fix | Commands | What it does |", "|---|---|---|---|---|"]
    for r in rules:
        lines.append(f"| {r.code} | `{r.name}` | {r.safety.value} | {', '.join(sorted(r.commands))} | {cell(r.summary)} |")
    return "\n".join(lines)



@main.command("rules")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text", show_default=True)
def list_rules(fmt):
    """List every rule with its code, name, safety and commands."""
    from torchmigrate.rules import all_rules
    import json

    rules = all_rules()
    if fmt == "json":
        click.echo(json.dumps([
            {"code": r.code, "name": r.name, "summary": r.summary, "safety": r.safety.value,
             "commands": sorted(r.commands)} for r in rules], indent=2))
    elif fmt == "markdown":
        click.echo(markdown_table(rules))
    else:
        for r in rules:
            click.echo(f"{r.code}  {r.name:<28} {r.safety.value:<7} {r.summary}")


@main.command()
@click.argument("code")
def explain(code):
    """Print a rule's documentation with its before/after example."""
    from torchmigrate.cli.explain import render
    from torchmigrate.rules import get_rule

    try:
        rule = get_rule(code)
    except KeyError:
        _fail(f"unknown rule {code!r}; see `torchmigrate rules`")
    click.echo(render(rule))

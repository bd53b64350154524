"""Command line interface (click). Exit codes follow Ruff: 0 clean or all fixed, 1 findings
remain or a change is due, 2 usage or input error. Importing this module never imports torch."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import click

from torchmigrate import __version__, formats, launchers, report
from torchmigrate.config import Config, ConfigError, load as load_config
from torchmigrate.diff import colorize, use_color
from torchmigrate.files import discover
from torchmigrate.options import RUNTIME_MODULE, Options
from torchmigrate.runner import (AUTO_JOBS_MIN_FILES, VENDORED_NAME, Job, Outcome, Progress, auto_jobs, run,
                                 write_together)

AMP_CHOICES = ("auto", "bf16", "fp16", "off")


def _codes(values: Sequence[str]) -> Tuple[str, ...]:
    return tuple(c.strip() for v in values for c in v.split(",") if c.strip())


def _rule_names():
    from torchmigrate.catalogue import all_rules

    return {r.code: r.name for r in all_rules()}


def _config(paths: Sequence[str]) -> Config:
    try:
        return load_config(paths)
    except ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _discover(paths: Sequence[str], config: Config) -> Tuple[List[Path], List[str]]:
    found, bad = discover(paths, config.exclude)
    errors = [f"{p}: {why}" for p, why in bad]
    if not found and not bad:
        errors.append(f"{', '.join(paths)}: no Python files found")
    return found, errors


def _run(files: List[Path], job: Job, jobs: int) -> List[Outcome]:
    """Run the job over the files; a progress bar goes to stderr on a terminal for long runs."""
    if jobs == 0:
        jobs = auto_jobs(len(files))
    try:
        with Progress(len(files), sys.stderr) as progress:
            return run(files, job, jobs=jobs, progress=progress)
    except KeyboardInterrupt:  # writes are atomic: every file is either done or untouched
        click.echo("\nInterrupted (every file was either fully processed or left untouched).", err=True)
        sys.exit(130)


_SELECTOR = re.compile(r"^TM\d{0,3}$", re.IGNORECASE)


def _check_selectors(codes: Sequence[str], where: str) -> None:
    from torchmigrate.catalogue import all_rules

    names = {r.name for r in all_rules()}
    bad = [c for c in codes if not _SELECTOR.match(c) and c not in names]
    if bad:
        click.echo(f"error: {where}: unknown rule selector {', '.join(map(repr, bad))} "
                   "(use codes such as TM201, prefixes such as TM2, or rule names; see `torchmigrate rules`)", err=True)
        sys.exit(2)


def _select(command: str, select: Sequence[str], ignore: Sequence[str], config: Config):
    from torchmigrate.catalogue import select as select_rules

    select_codes, ignore_codes = _codes(select), _codes(ignore)
    _check_selectors(select_codes + ignore_codes, "--select/--ignore")
    _check_selectors(tuple(config.select) + tuple(config.ignore), str(config.path or "pyproject.toml"))
    rules = select_rules(select_codes or config.select, ignore_codes + config.ignore, command)
    return tuple(r.code for r in rules)


paths_argument = click.argument("paths", nargs=-1, required=True, type=click.Path())
jobs_option = click.option("-j", "--jobs", type=click.IntRange(0, 256), default=0, metavar="N",
                           help="Process files in N worker processes; 0 (the default): one per CPU for runs "
                                f"of {AUTO_JOBS_MIN_FILES} files or more, else in-process. Output order is unchanged.")
select_option = click.option("--select", multiple=True, metavar="CODES",
                             help="Only these rule codes or prefixes, comma-separated or repeated (e.g. TM2,TM406).")
follow_option = click.option(
    "--follow/--no-follow", default=True, show_default=True,
    help="Follow the imports of the scripts into their project (sibling modules, packages, relative imports) "
         "and treat them as one program; --no-follow: only the files given.")
ignore_option = click.option("--ignore", multiple=True, metavar="CODES",
                             help="Skip these rule codes or prefixes, comma-separated or repeated.")


class _Commands(click.Group):
    """The commands, with `verify` (subprocesses, signals, a probe) imported only when it is
    run or listed: every lint run in a pre-commit hook pays for each module the CLI imports."""

    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), "verify"])

    def get_command(self, ctx, name):
        if name == "verify":
            from torchmigrate.verify import command

            return command
        return super().get_command(ctx, name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="torchmigrate")
def main() -> None:
    """Migrate PyTorch training scripts to torchrun + DDP + AMP, and lint distributed code.

    \b
      torchmigrate ddp train.py            rewrite in place (DDP + AMP)
      torchmigrate ddp --dry-run train.py  print the diff and the report, write nothing
      torchmigrate lint src/               report findings (pre-commit hook, CI)
      torchmigrate verify train.py         run it on 2 CPU ranks and check it trains correctly
      torchmigrate explain TM406           a rule's documentation and example

    Exit codes: 0 clean or all fixed, 1 findings remain or a change is due, 2 usage or input error.
    """


def _program(paths: Sequence[str], files: List[Path], config: Config, follow: bool, cache=None):
    """The program(s) the files make up: with `follow`, the project modules they import join.
    With the lint cache, a build reused when nothing it read or looked at changed."""
    def build(fs=None):
        from torchmigrate.program.build import build
        from torchmigrate.program.fs import PLAIN

        return build(files, named, follow, exclude=_exclude(config), fs=fs or PLAIN)

    named = [Path(p) for p in paths if not _is_dir(p)]
    return cache.program(files, named, follow, config.exclude, build) if cache is not None else build()


def _exclude(config: Config):
    from torchmigrate.files import _excluded

    return lambda path: _excluded(path, config.exclude)


def _is_dir(path: str) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:  # a name the system refuses: reported by discovery
        return False


def _migrate(command: str, paths, dry_run: bool, check: bool, amp: Optional[str], sync_bn: bool,
             report_file: Optional[str], vendor: bool, jobs: int, select, ignore, follow: bool = True) -> None:
    problem = report_file and report.target_problem(report_file)
    if problem:
        click.echo(f"error: --report {problem}", err=True)
        sys.exit(2)
    config = _config(paths)
    files, errors = _discover(paths, config)
    files = launchers.split(files)[0]
    program = _program(paths, files, config, follow)
    files = program.files
    options = Options(
        mode=command, amp=amp or config.amp or "auto", sync_bn=sync_bn,
        runtime_module="torchmigrate_runtime" if vendor else RUNTIME_MODULE,
    )
    write = not (dry_run or check)
    codes = _select(command, select, ignore, config)
    launch_files = launchers.files_for(paths, codes, _exclude(config), around_scripts=True)
    # the program summary judges DDP only when the rules that make it are on
    whole = command == "ddp" and {"TM201", "TM301"} <= set(codes)
    job = Job(options, codes, write=write, want_diff=dry_run, vendor_runtime=vendor, program=program.views or None,
              together=write and (len(files) > 1 or bool(launch_files)))
    outcomes = _run(files, job, jobs)
    launch = launchers.Settings(command, apply=True, write=write, want_diff=dry_run, together=job.together)
    outcomes += launchers.run(launch_files, files, paths, launch, outcomes)
    if job.together:
        write_together(outcomes, job, launchers.link_groups(program.groups, launch))
    diff_out = sys.stdout
    color = use_color(diff_out)
    for outcome in outcomes:
        if outcome.diff:
            click.echo(colorize(outcome.diff) if color else outcome.diff, nl=False, color=color)
    errors += report.error_lines(outcomes)
    for line in errors:
        click.echo(line, err=True)
    text = report.migration_text(outcomes, dry_run or check, _rule_names(), program.followed, whole)
    # With --dry-run stdout carries only the diff (so it can be piped to `git apply`); the
    # report and its summary line go to stderr.
    click.echo(text, err=dry_run)
    if report_file:
        content = (report.migration_json(outcomes, dry_run or check, whole) if report_file.endswith(".json") else text) + "\n"
        problem = report.write(report_file, content)
        if problem:
            click.echo(f"error: --report {problem}", err=True)
            errors.append(problem)
    vendored = sorted({o.vendored for o in outcomes if o.vendored})
    for path in vendored:
        click.echo(f"Wrote {path}")
    if errors:
        sys.exit(2)
    if (dry_run or check) and any(o.changed for o in outcomes):
        sys.exit(1)
    if any(o.open_records for o in outcomes) or (whole and report.not_done(outcomes)):
        sys.exit(1)


def _migration_options(func):
    func = follow_option(func)
    func = click.option("--report", "report_file", type=click.Path(dir_okay=False),
                        help="Also write the report to FILE (JSON if it ends in .json).")(func)
    func = click.option("--amp", type=click.Choice(AMP_CHOICES), default=None,
                        help="Mixed precision: auto (runtime picks bf16/fp16), bf16, fp16 or off.")(func)
    func = click.option("--check", is_flag=True, help="Write nothing; exit 1 if a change is due.")(func)
    func = click.option("--dry-run", "--diff", "dry_run", is_flag=True,
                        help="Print the unified diff and the report; write nothing.")(func)
    return func


@main.command()
@paths_argument
@_migration_options
@click.option("--sync-bn", is_flag=True, help="Convert BatchNorm layers to SyncBatchNorm (TM304).")
@click.option("--vendor-runtime", is_flag=True,
              help=f"Write the runtime shim beside each script as {VENDORED_NAME} and import it from there.")
@select_option
@ignore_option
@jobs_option
def ddp(paths, dry_run, check, amp, report_file, follow, sync_bn, vendor_runtime, select, ignore, jobs):
    """Rewrite training scripts in place for torchrun + DDP (+ AMP).

    With --dry-run, print the unified diff (coloured on a terminal) and the report, write nothing.
    """
    _migrate("ddp", paths, dry_run, check, amp, sync_bn, report_file, vendor_runtime, jobs, select, ignore, follow)


@main.command()
@paths_argument
@_migration_options
@click.option("--vendor-runtime", is_flag=True,
              help=f"Write the runtime shim beside each script as {VENDORED_NAME} and import it from there.")
@select_option
@ignore_option
@jobs_option
def amp(paths, dry_run, check, amp, report_file, follow, vendor_runtime, select, ignore, jobs):
    """Add or modernise mixed precision only (no DDP).

    Code that keeps nn.DataParallel gets autocast inside the model's forward.
    """
    _migrate("amp", paths, dry_run, check, amp, False, report_file, vendor_runtime, jobs, select, ignore, follow)


@main.command()
@paths_argument
@select_option
@ignore_option
@click.option("--fix", is_flag=True, help="Apply safe fixes in place.")
@click.option("--unsafe-fixes", is_flag=True,
              help="Also count fixes that may change behaviour as fixable; with --fix, apply them too.")
@click.option("--format", "fmt", type=click.Choice(formats.FORMATS), default="text", show_default=True,
              help="text: path:line:col: CODE message; json; github: workflow annotations; sarif: SARIF 2.1.0.")
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when findings remain (input errors still exit 2).")
@click.option("--statistics", is_flag=True, help="Print a count per rule instead of each finding.")
@follow_option
@jobs_option
@click.option("--cache-dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Where to keep the results of unchanged files (default: $TORCHMIGRATE_CACHE_DIR, else "
                   ".torchmigrate_cache beside pyproject.toml or in the working directory).")
@click.option("--no-cache", is_flag=True, help="Neither read nor write the cache.")
def lint(paths, select, ignore, fix, unsafe_fixes, fmt, exit_zero, statistics, follow, jobs, cache_dir, no_cache):
    """Report rule findings (pre-commit hook / CI).

    Exit 0 when nothing remains (or everything was fixed), 1 when findings remain, 2 on bad
    input. Suppress one line with `# torchmigrate: ignore[TM201]`, a file with
    `# torchmigrate: skip-file`; configure with [tool.torchmigrate] in pyproject.toml.
    """
    from torchmigrate import cache as lint_cache
    from torchmigrate.catalogue import get_rule

    config = _config(paths)
    cache = lint_cache.open_for_lint(None if no_cache else cache_dir or "", paths)
    files, errors = _discover(paths, config)
    files = launchers.split(files)[0]
    codes = _select("lint", select, ignore, config)
    options = Options(mode="lint", amp=config.amp or "auto", fix=fix, unsafe_fixes=fix and unsafe_fixes)
    # The imported modules inform the checks (a model wrapped by the caller) but only the files
    # given are checked, as a pre-commit hook expects.
    program = _program(paths, files, config, follow, cache)
    job = Job(options, codes, write=fix, program=program.views or None)
    if cache is not None:
        outcomes = cache.run(files, job, lambda todo: _run(todo, job, jobs))
    else:
        outcomes = _run(files, job, jobs)
    launch_files = launchers.files_for(paths, codes, _exclude(config), around_scripts=False)
    outcomes += launchers.run(launch_files, program.files, paths, launchers.Settings("lint", apply=fix, write=fix),
                              outcomes)
    rules = [get_rule(code) for code in codes]
    errors += report.error_lines(outcomes)
    for line in errors:
        click.echo(line, err=True)
    if statistics:
        out = formats.statistics(outcomes, rules, "json" if fmt == "json" else "text")
    else:
        out = formats.render(fmt, outcomes, rules, fix=fix, unsafe_fixes=unsafe_fixes)
    if out:
        click.echo(out)
    if errors:
        sys.exit(2)
    if not exit_zero and any(o.open_records for o in outcomes):
        sys.exit(1)


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
    from torchmigrate.explain import render
    from torchmigrate.rules import get_rule

    try:
        rule = get_rule(code)
    except KeyError:
        click.echo(f"error: unknown rule {code!r}; see `torchmigrate rules`", err=True)
        sys.exit(2)
    click.echo(render(rule))

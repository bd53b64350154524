"""Command line interface (click). Exit codes follow Ruff: 0 clean or all fixed, 1 findings
remain or a change is due, 2 usage or input error. Importing this module never imports torch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import click

from torchmigrate import __version__, report
from torchmigrate.config import Config, ConfigError, load as load_config
from torchmigrate.diff import colorize, use_color
from torchmigrate.files import discover
from torchmigrate.rule import RUNTIME_MODULE, Options
from torchmigrate.runner import VENDORED_NAME, Job, Outcome, run

AMP_CHOICES = ("auto", "bf16", "fp16", "off")


def _codes(values: Sequence[str]) -> Tuple[str, ...]:
    return tuple(c.strip() for v in values for c in v.split(",") if c.strip())


def _rule_names():
    from torchmigrate.rules import all_rules

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


def _run(files: List[Path], job: Job, jobs: int, quiet: bool = False) -> List[Outcome]:
    return run(files, job, jobs=jobs)


def _select(command: str, select: Sequence[str], ignore: Sequence[str], config: Config):
    from torchmigrate.rules import select as select_rules

    rules = select_rules(_codes(select) or config.select, _codes(ignore) + config.ignore, command)
    return tuple(r.code for r in rules)


paths_argument = click.argument("paths", nargs=-1, required=True, type=click.Path())
jobs_option = click.option("-j", "--jobs", type=click.IntRange(1, 256), default=1, show_default=True,
                           help="Process files in N worker processes (output order is unchanged).")
select_option = click.option("--select", multiple=True, metavar="CODES",
                             help="Only these rule codes or prefixes (e.g. TM2,TM406).")
ignore_option = click.option("--ignore", multiple=True, metavar="CODES", help="Skip these rule codes or prefixes.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="torchmigrate")
def main() -> None:
    """Migrate PyTorch training scripts to torchrun + DDP + AMP, and lint distributed code."""


def _migrate(command: str, paths, dry_run: bool, check: bool, amp: Optional[str], sync_bn: bool,
             report_file: Optional[str], vendor: bool, jobs: int, select, ignore) -> None:
    config = _config(paths)
    files, errors = _discover(paths, config)
    options = Options(
        mode=command, amp=amp or config.amp or "auto", sync_bn=sync_bn,
        runtime_module="torchmigrate_runtime" if vendor else RUNTIME_MODULE,
    )
    write = not (dry_run or check)
    job = Job(options, _select(command, select, ignore, config), write=write, want_diff=dry_run,
              vendor_runtime=vendor)
    outcomes = _run(files, job, jobs)
    diff_out = click.get_text_stream("stdout")
    color = use_color(diff_out)
    for outcome in outcomes:
        if outcome.diff:
            click.echo(colorize(outcome.diff) if color else outcome.diff, nl=False, color=color)
    errors += report.error_lines(outcomes)
    for line in errors:
        click.echo(line, err=True)
    text = report.migration_text(outcomes, dry_run or check, _rule_names())
    click.echo(text, err=dry_run)
    if report_file:
        content = (report.migration_json(outcomes, dry_run or check) if report_file.endswith(".json") else text) + "\n"
        Path(report_file).write_text(content, encoding="utf-8")
    vendored = sorted({o.vendored for o in outcomes if o.vendored})
    for path in vendored:
        click.echo(f"Wrote {path}")
    if errors:
        sys.exit(2)
    if (dry_run or check) and any(o.changed for o in outcomes):
        sys.exit(1)
    if any(o.open_records for o in outcomes):
        sys.exit(1)


def _migration_options(func):
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
def ddp(paths, dry_run, check, amp, report_file, sync_bn, vendor_runtime, select, ignore, jobs):
    """Rewrite training scripts in place for torchrun + DistributedDataParallel (+ AMP)."""
    _migrate("ddp", paths, dry_run, check, amp, sync_bn, report_file, vendor_runtime, jobs, select, ignore)


@main.command()
@paths_argument
@_migration_options
@click.option("--vendor-runtime", is_flag=True,
              help=f"Write the runtime shim beside each script as {VENDORED_NAME} and import it from there.")
@select_option
@ignore_option
@jobs_option
def amp(paths, dry_run, check, amp, report_file, vendor_runtime, select, ignore, jobs):
    """Add or modernise mixed precision only (no DDP)."""
    _migrate("amp", paths, dry_run, check, amp, False, report_file, vendor_runtime, jobs, select, ignore)


@main.command()
@paths_argument
@select_option
@ignore_option
@click.option("--fix", is_flag=True, help="Apply safe fixes in place.")
@click.option("--unsafe-fixes", is_flag=True, help="Also apply fixes that change behaviour (implies --fix).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when findings remain.")
@click.option("--statistics", is_flag=True, help="Print a count per rule instead of each finding.")
@jobs_option
def lint(paths, select, ignore, fix, unsafe_fixes, fmt, exit_zero, statistics, jobs):
    """Report rule findings (pre-commit hook / CI). Exit 1 if any remain."""
    config = _config(paths)
    files, errors = _discover(paths, config)
    fix = fix or unsafe_fixes
    options = Options(mode="lint", amp=config.amp or "auto", fix=fix, unsafe_fixes=unsafe_fixes)
    job = Job(options, _select("lint", select, ignore, config), write=fix)
    outcomes = _run(files, job, jobs)
    errors += report.error_lines(outcomes)
    for line in errors:
        click.echo(line, err=True)
    if statistics:
        text = report.statistics(outcomes, _rule_names())
        if text:
            click.echo(text)
    elif fmt == "json":
        click.echo(report.lint_json(outcomes))
    else:
        click.echo(report.lint_text(outcomes, fix))
    if errors:
        sys.exit(2)
    if not exit_zero and any(o.open_records for o in outcomes):
        sys.exit(1)


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
        click.echo("| code | name | safety | commands | what it does |")
        click.echo("|---|---|---|---|---|")
        for r in rules:
            click.echo(f"| {r.code} | {r.name} | {r.safety.value} | {', '.join(sorted(r.commands))} | {r.summary} |")
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

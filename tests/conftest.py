"""Shared helpers: run the engine on a string the way the CLI would."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

import pytest

from torchmigrate.engine.process import process_source
from torchmigrate.rule import Options
from torchmigrate.rules import get_rule, select

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
# On PYTHONPATH with TM_AMP_PROBE=<dir>, its sitecustomize.py records the autocast contexts a
# script enters (device:dtype:enabled -> count) in <dir>/amp_<pid>.json.
AMP_PROBE = Path(__file__).parent / "amp_probe"

_HEADER = re.compile(r"#\s*fixture:\s*(.*)")


def fixture_settings(source: str, code: str):
    """Mode and rules for a fixture: the rule alone in its first command, unless the first
    line says otherwise, e.g. `# fixture: mode=amp select=TM401,TM402 amp=bf16` (`batch=per-gpu`:
    the batch policy of `ddp --batch-policy`)."""
    rule = get_rule(code)
    mode = next(m for m in ("ddp", "amp", "lint") if m in rule.commands)
    settings = {"mode": mode, "select": code, "amp": "auto", "sync_bn": "0", "unsafe": "0", "shard_eval": "0", "batch": "global"}
    first = source.splitlines()[0] if source else ""
    match = _HEADER.match(first)
    if match:
        for item in match.group(1).split():
            key, _, value = item.partition("=")
            settings[key] = value
    options = Options(mode=settings["mode"], amp=settings["amp"], sync_bn=settings["sync_bn"] == "1",
                      fix=settings["mode"] == "lint", unsafe_fixes=settings["unsafe"] == "1",
                      shard_eval=settings["shard_eval"] == "1", batch_policy=settings["batch"])
    if settings["select"] == "all":
        rules = select(command=settings["mode"])
    else:
        rules = [get_rule(c) for c in settings["select"].split(",")]
    return options, rules


def migrate(source: str, options: Options, rules: Sequence) -> str:
    return process_source(source, "fixture.py", options, rules).new_source


LAUNCH_ROOT = Path("/fixture")  # launch files are checked as text, as if in this folder


def check_launch(text: str, name: str, scripts: Sequence[str] = ("train.py",), mode: str = "ddp"):
    """TM801 over the text of a launch file called `name` whose program is `scripts` (paths
    relative to the file's folder); nothing is read from disk. A `fixture: program=a.py,b.py`
    first line names the program instead."""
    from torchmigrate.launchers.scan import Program, Settings, check

    first = text.splitlines()[0] if text else ""
    match = re.search(r"fixture:\s*(.*)", first)  # in any comment syntax: #, <!-- -->, ..
    if match:
        for item in match.group(1).replace("-->", "").split():
            key, _, value = item.partition("=")
            if key == "program":
                scripts = value.split(",")
    program = Program([LAUNCH_ROOT / s for s in scripts], [LAUNCH_ROOT])
    return check(LAUNCH_ROOT / name, text, program, Settings(mode, apply=mode == "ddp", write=False))


@pytest.fixture(autouse=True)
def _lint_cache(tmp_path_factory, monkeypatch):
    """Each test gets a lint cache of its own (tests/test_cache.py tests the cache itself): a
    result cached by one test must never hide what another test patched in."""
    monkeypatch.setenv("TORCHMIGRATE_CACHE_DIR", str(tmp_path_factory.mktemp("lint-cache")))


@pytest.fixture
def run_cli():
    from click.testing import CliRunner

    from torchmigrate.cli.commands import main

    def invoke(*args, **kwargs):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kwargs)

    return invoke


def autocast_seen(out_dir: Path) -> dict:
    """The autocast contexts the AMP probe recorded in `out_dir`, summed over processes."""
    seen: dict = {}
    for f in out_dir.glob("amp_*.json"):
        for k, v in json.loads(f.read_text()).items():
            seen[k] = seen.get(k, 0) + v
    return seen

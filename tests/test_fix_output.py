"""Fixes can be previewed and handed on: `lint --diff` (alone or with --fix), `--show-fixes`,
and the edits of each fix in `--format json` and in SARIF `fixes`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from torchmigrate.engine.textedits import TextEdit, lines, text_edits

AMP_SCRIPT = FIXTURES / "TM406" / "from_import.in.py"
AMP_EXPECTED = FIXTURES / "TM406" / "from_import.out.py"
DATA = Path(__file__).parent / "data"


def apply(text: str, edits) -> str:
    """`text` with `edits` (in order, not overlapping) applied: what a consumer of the json or
    SARIF output does."""
    starts = [0]
    for line in lines(text):
        starts.append(starts[-1] + len(line))
    out, at = [], 0
    for e in edits:
        begin, end = starts[e.line - 1] + e.col, starts[e.end_line - 1] + e.end_col
        out += [text[at:begin], e.content]
        at = end
    return "".join(out) + text[at:]


@pytest.fixture
def amp_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes(AMP_SCRIPT.read_bytes())
    return path


@pytest.mark.parametrize("flags", [("--fix", "--diff"), ("--diff",)])
def test_lint_diff_shows_the_fixes_and_writes_nothing(amp_file, run_cli, flags):
    result = run_cli("lint", *flags, "--select", "TM406", amp_file)
    assert result.exit_code == 1  # a fix is due
    assert amp_file.read_bytes() == AMP_SCRIPT.read_bytes()
    assert result.stdout.startswith(f"--- {amp_file}\n+++ {amp_file}\n")
    assert '+scaler = GradScaler("cuda", enabled=use_amp)' in result.stdout
    assert "Found" not in result.stdout  # stdout is a patch; the summary goes to stderr
    assert result.stderr.strip() == "Would fix 3 findings."
    run_cli("lint", "--fix", "--select", "TM406", amp_file)
    nothing = run_cli("lint", *flags, "--select", "TM406", amp_file)
    assert nothing.exit_code == 0 and nothing.stdout == "" and nothing.stderr.strip() == "No findings would be fixed."


def test_lint_diff_counts_what_would_remain(tmp_path, run_cli):
    path = tmp_path / "t.py"
    path.write_text("import torch\nimport torch.nn.functional as F\nwith torch.cuda.amp.autocast():\n"
                    "    loss = F.binary_cross_entropy(p, y)\n")
    result = run_cli("lint", "--diff", "--select", "TM406,TM409", path)
    assert result.exit_code == 1 and "+with torch.amp.autocast(\"cuda\"):" in result.stdout
    assert result.stderr.strip() == "Would fix 1 finding; 1 would remain."


def test_show_fixes_lists_the_fixes_per_file_and_rule(amp_file, tmp_path, run_cli):
    other = tmp_path / "other.py"
    other.write_bytes(AMP_SCRIPT.read_bytes())
    result = run_cli("lint", "--fix", "--show-fixes", "--select", "TM406", amp_file, other)
    assert result.exit_code == 0
    assert result.stdout == (
        f"Fixed 6 findings:\n- {amp_file}:\n    3 × TM406 (torch-cuda-amp)\n- {other}:\n    3 × TM406 (torch-cuda-amp)\n"
        "Found 6 findings (6 fixed, 0 remaining).\n")
    preview = run_cli("lint", "--diff", "--show-fixes", "--select", "TM406", amp_file)
    assert preview.stderr.startswith("No findings would be fixed.")


def _apply_all(text: str, fixes) -> str:
    """Every fix applied to `text`, the last in the file first (they do not overlap)."""
    edits = sorted((e for fix in fixes for e in fix), key=lambda e: (e.line, e.col), reverse=True)
    for e in edits:
        text = apply(text, (e,))
    return text


def _json_edits(fix) -> tuple:
    return tuple(TextEdit(e["location"]["line"], e["location"]["column"] - 1, e["end_location"]["line"],
                          e["end_location"]["column"] - 1, e["content"]) for e in fix["edits"])


def test_json_carries_each_fix_as_edits(amp_file, run_cli):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((DATA / "torchmigrate-lint.schema.json").read_text())
    data = json.loads(run_cli("lint", "--format", "json", "--select", "TM406", amp_file).stdout)
    jsonschema.validate(data, schema)
    assert len(data) == 3 and all(d["fix"] for d in data)
    source = AMP_SCRIPT.read_text()
    for d in data:  # each fix stands alone and touches its finding's line
        alone = apply(source, _json_edits(d["fix"]))
        assert alone != source and d["line"] in {e["location"]["line"] for e in d["fix"]["edits"]}
        compile(alone, "t.py", "exec")
    assert _apply_all(source, [_json_edits(d["fix"]) for d in data]) == AMP_EXPECTED.read_text()
    fixed = json.loads(run_cli("lint", "--format", "json", "--fix", "--select", "TM406", amp_file).stdout)
    jsonschema.validate(fixed, schema)
    assert all(d["fixed"] and d["fix"] is None for d in fixed)


def test_json_fix_is_null_without_a_fix(tmp_path, run_cli):
    path = tmp_path / "t.py"
    path.write_text("import torch\nimport torch.nn.functional as F\nwith torch.autocast('cuda'):\n"
                    "    loss = F.binary_cross_entropy(p, y)\n")
    data = json.loads(run_cli("lint", "--format", "json", "--select", "TM409", path).stdout)
    assert [(d["code"], d["safety"], d["fix"]) for d in data] == [("TM409", "manual", None)]


def test_sarif_results_carry_fixes(amp_file, run_cli, monkeypatch):
    jsonschema = pytest.importorskip("jsonschema")
    monkeypatch.chdir(amp_file.parent)
    log = json.loads(run_cli("lint", "--format", "sarif", "--select", "TM406", "train.py").stdout)
    schema = json.loads((DATA / "sarif-schema-2.1.0.json").read_text())
    jsonschema.Draft4Validator(schema).validate(log)
    results = log["runs"][0]["results"]
    fixes = []
    for result in results:
        (fix,) = result["fixes"]
        (change,) = fix["artifactChanges"]
        assert change["artifactLocation"] == {"uri": "train.py", "uriBaseId": "%SRCROOT%"}
        fixes.append(tuple(TextEdit(r["deletedRegion"]["startLine"], r["deletedRegion"]["startColumn"] - 1,
                                    r["deletedRegion"]["endLine"], r["deletedRegion"]["endColumn"] - 1,
                                    r["insertedContent"]["text"]) for r in change["replacements"]))
    assert _apply_all(AMP_SCRIPT.read_text(), fixes) == AMP_EXPECTED.read_text()


@pytest.mark.parametrize("old,new", [
    ("a\nb\nc\n", "a\nB\nc\n"), ("a\nb\n", "x\na\nb\n"), ("a\nb\n", "a\nb\nc\n"), ("a\nb", "a"),
    ("", "x\n"), ("x = f(1)\n", "x = g(1, 2)\n"), ("a\r\nb\r\n", "a\r\nc\r\n"), ("a\rb\r", "a\rb\n"),
    ("x\x0cy\nz\n", "x\x0cy\nZ\n"), ("é = 1\n", "é = 2\n"),
])
def test_text_edits_turn_the_old_text_into_the_new(old, new):
    edits = text_edits(old, new)
    assert apply(old, edits) == new
    assert all((e.line, e.col) <= (e.end_line, e.end_col) for e in edits)


def test_text_edits_are_minimal_and_count_lines_as_python_does():
    (edit,) = text_edits("x\x0cy\nz = 1\n", "x\x0cy\nz = 2\n")  # a form feed does not end a line
    assert edit == TextEdit(2, 4, 2, 5, "2")

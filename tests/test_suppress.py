"""Suppression comments are read from comments only, never from string literals."""

from __future__ import annotations

from torchmigrate.engine.suppress import ALL, Suppressions

CUDA_AMP = "from torch.cuda.amp import autocast"


def test_a_comment_suppresses_its_line():
    found = Suppressions.scan(f"{CUDA_AMP}  # torchmigrate: ignore[TM406, TM41]\nx = 1  # torchmigrate: ignore\n")
    assert found.lines == {1: frozenset({"TM406", "TM41"}), 2: ALL}
    assert found.covers("TM406", 1) and found.covers("TM410", 1) and not found.covers("TM201", 1)
    assert found.covers("TM201", 2) and not found.covers("TM406", 3)


def test_text_in_a_string_literal_suppresses_nothing():
    source = (
        'HELP = "add  # torchmigrate: ignore[TM406]  to silence a line"\n'
        f"{CUDA_AMP}\n"
        'DOC = """\n'
        "# torchmigrate: skip-file\n"
        "x = 1  # torchmigrate: ignore\n"
        '"""\n'
    )
    found = Suppressions.scan(source)
    assert not found.skip_file and found.lines == {}


def test_skip_file_only_as_a_comment_of_its_own():
    assert Suppressions.scan(f"# torchmigrate: skip-file\n{CUDA_AMP}\n").skip_file
    assert not Suppressions.scan(f"{CUDA_AMP}  # see torchmigrate: skip-file\n").skip_file


def test_source_that_does_not_tokenize_keeps_the_comments_before_the_error():
    found = Suppressions.scan(f"{CUDA_AMP}  # torchmigrate: ignore[TM406]\nx = (\n")
    assert found.lines == {1: frozenset({"TM406"})}


def test_lint_reports_a_line_whose_ignore_text_is_in_a_string(tmp_path, run_cli):
    path = tmp_path / "t.py"
    path.write_text(f'{CUDA_AMP}; NOTE = "# torchmigrate: ignore[TM406]"\n')
    result = run_cli("lint", "--select", "TM406", path)
    assert result.exit_code == 1 and f"{path}:1:1: TM406" in result.stdout
    path.write_text(f'"""# torchmigrate: skip-file"""\n{CUDA_AMP}\n')
    assert run_cli("lint", "--select", "TM406", path).exit_code == 1

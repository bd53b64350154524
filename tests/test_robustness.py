"""Property tests: the engine never crashes, leaves code without torch alone, and turns torch
programs assembled from fixture fragments into compiling, idempotent output.

Examples are few and derandomized so CI stays fast and deterministic (well under a minute);
for a longer, random fuzzing session run e.g.

    TM_FUZZ=500 python -m pytest -q tests/test_robustness.py

and record any failure's minimal input.
"""

from __future__ import annotations

import os
import random
import sys
import textwrap
from functools import lru_cache
from typing import List, Tuple

import hypothesmith
import libcst as cst
import pytest
from hypothesis import HealthCheck, assume, given, note, reject, settings
from hypothesis import strategies as st

from conftest import FIXTURES, ROOT
from torchmigrate.engine import process as engine
from torchmigrate.syntax import positions
from torchmigrate.engine.process import InputError, RewriteError, process_source
from torchmigrate.rule import Options
from torchmigrate.rules import select

FUZZ = int(os.environ.get("TM_FUZZ", "0"))


def fuzz_settings(examples: int):
    return settings(
        max_examples=FUZZ or examples,
        deadline=None,
        derandomize=not FUZZ,
        database=None if not FUZZ else settings.default.database,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much, HealthCheck.large_base_example,
                               HealthCheck.function_scoped_fixture],
    )


MODES = {
    "ddp": Options(mode="ddp"),
    "amp": Options(mode="amp"),
    "lint": Options(mode="lint"),
    "lint-fix": Options(mode="lint", fix=True, unsafe_fixes=True),
}


@lru_cache(maxsize=None)
def rules_for(mode: str):
    return tuple(select(command="lint" if mode.startswith("lint") else mode))


def run(source: str, mode: str) -> engine.SourceResult:
    return process_source(source, "generated.py", MODES[mode], rules_for(mode))


def compiles(source: str) -> bool:
    try:
        engine.check_syntax(source)
    except InputError:
        return False
    return True


@pytest.fixture
def no_prefilter(monkeypatch):
    """Every file goes through the parser and all rules, whatever its words."""
    monkeypatch.setattr(engine, "PREFILTER", ("",))


# --- hypothesmith: arbitrary Python --------------------------------------------------------------

def check_arbitrary(source: str) -> None:
    for mode in MODES:
        try:
            result = run(source, mode)
        except RewriteError:
            raise
        except InputError:
            continue  # unparsable or not compilable input: reported, never a crash
        assert result.new_source == source, f"{mode} changed a file without torch code"
        assert not [f for f in result.findings if not f.suppressed and "torch" not in source], result.findings


@fuzz_settings(30)
@given(source=hypothesmith.from_grammar())
def test_grammar_programs_never_crash_and_stay_unchanged(source, no_prefilter):
    check_arbitrary(source)


@fuzz_settings(20)
@given(source=hypothesmith.from_node())
def test_cst_programs_never_crash_and_stay_unchanged(source, no_prefilter):
    check_arbitrary(source)


@fuzz_settings(20)
@given(source=hypothesmith.from_node())
def test_cst_programs_importing_torch(source):
    """The same programs after `import torch`: no crash, and any rewrite compiles and is final."""
    source = "import torch\nimport torch.nn as nn\n" + source
    for mode in ("ddp", "lint-fix"):
        try:
            result = run(source, mode)
        except RewriteError:
            raise
        except InputError:
            return
        if result.changed:
            compile(result.new_source, "out.py", "exec", dont_inherit=True)
            assert run(result.new_source, mode).new_source == result.new_source


def test_prefilter_leaves_files_without_torch_unchanged_but_checks_their_syntax():
    source = "import numpy as np\nx = np.zeros(3)\nprint(x)\n"
    for mode in MODES:
        assert run(source, mode).new_source == source
        with pytest.raises(InputError):  # a syntax error is reported in every file, as Ruff does
            run(source.replace("print(x)", "print x"), mode)


# --- torch programs assembled from fixture fragments ---------------------------------------------

def _sources() -> List[Tuple[str, str]]:
    paths = sorted(FIXTURES.glob("TM*/*.in.py")) + sorted((FIXTURES / "scripts").glob("*.py"))
    out = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if compiles(text) and "\t" not in text:  # (fragments of a file whose indentation mixes
            out.append((f"{path.parent.name}/{path.name}", text))  # tabs in would not fit others)
    return out


@lru_cache(maxsize=None)
def fragments() -> Tuple[Tuple[str, Tuple[str, ...], Tuple[str, ...]], ...]:
    """For each fixture file: (name, its import statements, its other top-level statements),
    each statement as text with its leading comments."""
    out = []
    for name, text in _sources():
        module = cst.parse_module(text)
        imports, others = [], []
        for stmt in module.body:
            code = module.code_for_node(stmt)
            is_import = isinstance(stmt, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
            if is_import:
                if "__future__" not in code:
                    imports.append(code)
            else:
                others.append(code)
        out.append((name, tuple(imports), tuple(others)))
    return tuple(out)


@st.composite
def torch_programs(draw) -> str:
    """Concatenate, shuffle and subsample the top-level statements of 1-4 fixture files."""
    pool = fragments()
    scripts = [i for i, (name, _, _) in enumerate(pool) if name.startswith("scripts/")]
    chosen = draw(st.lists(st.sampled_from(range(len(pool))), min_size=1, max_size=4, unique=True))
    if scripts and draw(st.booleans()):  # usually one whole training script in the mix
        extra = draw(st.sampled_from(scripts))
        chosen = [extra] + [i for i in chosen if i != extra]
    keep = draw(st.sampled_from([1.0, 0.8, 0.5]))
    pick = random.Random(draw(st.integers(0, 2 ** 16)))
    imports: List[str] = []
    body: List[str] = []
    for index in chosen:
        _, imps, others = pool[index]
        imports.extend(i for i in imps if i not in imports)
        body.extend(s for s in others if keep == 1.0 or pick.random() < keep)
    seed = draw(st.integers(0, 2 ** 16))
    if draw(st.booleans()):
        random.Random(seed).shuffle(body)
    if draw(st.booleans()):  # a main guard at the end, as in real scripts, sometimes twice
        guards = [s for s in body if s.lstrip().startswith("if __name__")]
        body = [s for s in body if s not in guards] + guards
    body = [s if s.endswith("\n") else s + "\n" for s in body]
    if draw(st.booleans()):  # the script style of pytorch/examples: everything inside main()
        defs = [s for s in body if s.lstrip().startswith(("def ", "class ", "@"))]
        rest = [s for s in body if s not in defs and not s.lstrip().startswith("if __name__")]
        if rest:
            inner = "".join(textwrap.indent(s, "    ", lambda line: True) for s in rest)
            body = defs + ["\n\ndef main():\n" + inner, '\n\nif __name__ == "__main__":\n    main()\n']
    program = "".join(imports) + "".join(body)
    names = [pool[i][0] for i in chosen]
    note(f"fragments of: {names}, seed {seed}")
    return program


def check_torch_program(source: str, mode: str) -> None:
    try:
        first = run(source, mode)
    except RewriteError as exc:
        pytest.fail(f"{mode}: rewrite does not compile: {exc.message}\n--- input ---\n{source}")
    output = first.new_source
    compile(output, "out.py", "exec", dont_inherit=True)
    second = run(output, mode)
    if second.new_source != output:
        import difflib

        diff = "".join(difflib.unified_diff(output.splitlines(True), second.new_source.splitlines(True),
                                            "first run", "second run"))
        pytest.fail(f"{mode}: second run is not a no-op:\n{diff}\n--- input ---\n{source}")


# Fixture inputs that hit a known rule bug (minimal cases in the xfail tests further down).
KNOWN_FIXTURE_BUGS: dict = {}  # (fixture, mode) -> description; none known now


@pytest.mark.parametrize("mode", ["ddp", "amp", "lint-fix"])
def test_each_fixture_file_compiles_and_is_idempotent(mode):
    """The deterministic base case of the property below: every fixture input on its own."""
    failures, known = [], []
    for name, text in _sources():
        try:
            check_torch_program(text, mode)
        except BaseException as exc:  # noqa: BLE001 - collect them all, report once
            if type(exc).__name__ in ("KeyboardInterrupt", "SystemExit"):
                raise
            if (name, mode) in KNOWN_FIXTURE_BUGS:
                known.append(f"{name}: {KNOWN_FIXTURE_BUGS[name, mode]}")
            else:
                failures.append(f"{name}: {str(exc).splitlines()[0][:300]}")
    assert not failures, "\n".join(failures)
    if known:
        pytest.xfail("known rule bugs: " + "; ".join(known))


@fuzz_settings(25)
@given(source=torch_programs())
def test_fragment_programs_ddp(source):
    assume(compiles(source))
    check_torch_program(source, "ddp")


@fuzz_settings(15)
@given(source=torch_programs())
def test_fragment_programs_amp(source):
    assume(compiles(source))
    check_torch_program(source, "amp")


@fuzz_settings(15)
@given(source=torch_programs())
def test_fragment_programs_lint_fix(source):
    assume(compiles(source))
    check_torch_program(source, "lint-fix")


# --- realistic scripts: the benchmark corpus (renamed identifiers, duplicated functions) -----------

# Known rule bugs, recognised by what the second run adds; each has a minimal case below.
KNOWN_BUGS: dict = {}  # name -> regex every second-run diff line matches; none known now

# Two identical training loops in two functions (the TM403 fixture), run with every rule.
TM403_TWO_LOOPS = (FIXTURES / "TM403" / "two_functions.in.py").read_text(encoding="utf-8")


def _second_run_additions(source: str, mode: str) -> List[str]:
    first = run(source, mode).new_source
    second = run(first, mode).new_source
    import difflib

    return [line.rstrip("\n") for line in difflib.unified_diff(first.splitlines(True), second.splitlines(True), n=0)
            if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]


def _known(lines: List[str]) -> str:
    for name, pattern in KNOWN_BUGS.items():
        if lines and all(pattern.match(line) for line in lines):
            return name
    return ""


@pytest.mark.parametrize("mode", ["ddp", "amp"])
def test_tm403_two_identical_loops(mode):
    """Was a rule bug: TM403 keyed the loops it handled by position only, so a second identical
    loop in another function clipped scaled gradients."""
    assert _second_run_additions(TM403_TWO_LOOPS, mode) == []


TM401_FORWARD_IN_BACKWARD = """\
import torch

model = torch.nn.Linear(2, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
"""


@pytest.mark.parametrize("mode", ["ddp", "amp"])
def test_tm401_forward_inside_backward(mode):
    """Was a rule bug: `F.cross_entropy(model(x), y).backward()` was read as a method call on
    an object named `torch.nn.functional`, so the autocast region went back to the statement
    binding `model` (its construction) and a second run wrapped the data move in autocast.
    Now the forward inside the backward is reported for a manual change, and nothing moves."""
    result = run(TM401_FORWARD_IN_BACKWARD, mode)
    assert "with tm.autocast():\n    model = " not in result.new_source
    assert any(f.code == "TM401" and "forward runs inside" in f.message for f in result.findings)
    assert _second_run_additions(TM401_FORWARD_IN_BACKWARD, mode) == []


@pytest.mark.parametrize("mode", ["ddp", "amp"])
def test_generated_training_scripts_compile_and_are_idempotent(mode):
    """Scripts varied like the benchmark corpus (benchmarks/corpus.py): output compiles and a
    second run is a no-op, apart from the known rule bugs above (reported as xfail)."""
    corpus = _corpus()
    sources = [p.read_text(encoding="utf-8") for p in corpus.fixture_scripts()]
    rng = random.Random(1)
    unknown, known = [], set()
    for i in range(16):
        text = corpus.vary(sources, rng, i)
        try:
            result = run(text, mode)
        except RewriteError as exc:
            unknown.append(f"script {i}: {exc.message}")
            continue
        compile(result.new_source, f"generated_{i}.py", "exec", dont_inherit=True)
        added = _second_run_additions(text, mode)
        if added:
            bug = _known(added)
            if bug:
                known.add(bug)
            else:
                unknown.append(f"script {i}: second run changes:\n" + "\n".join(added[:20]))
    assert not unknown, "\n\n".join(unknown)
    if known:
        pytest.xfail("known rule bugs: " + "; ".join(sorted(known)))


def _corpus():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import corpus
    finally:
        sys.path.pop(0)
    return corpus


@fuzz_settings(8)
@given(seed=st.integers(0, 2 ** 32 - 1), mode=st.sampled_from(["ddp", "amp", "lint-fix"]))
def test_varied_scripts_property(seed, mode):
    """The same check as a property (for long TM_FUZZ runs); known rule bugs are rejected."""
    corpus = _corpus()
    sources = [p.read_text(encoding="utf-8") for p in corpus.fixture_scripts()]
    text = corpus.vary(sources, random.Random(seed), seed % 1000)
    try:
        result = run(text, mode)
    except RewriteError as exc:
        pytest.fail(f"{mode}: {exc.message}\n--- input ---\n{text}")
    compile(result.new_source, "generated.py", "exec", dont_inherit=True)
    added = _second_run_additions(text, mode)
    if added and _known(added):
        reject()
    assert added == [], f"{mode}: second run changes:\n" + "\n".join(added) + "\n--- input ---\n" + text


# --- engine internals on the same programs ---------------------------------------------------------

@fuzz_settings(20)
@given(source=torch_programs())
def test_regenerate_matches_full_codegen(source, monkeypatch_regenerate):
    """The applier's output text copies untouched top-level statements from the source; it must
    equal LibCST's own code generation of the edited module."""
    assume(compiles(source))
    run(source, "ddp")


@fuzz_settings(30)
@given(source=st.one_of(hypothesmith.from_grammar(), hypothesmith.from_node()))
def test_fast_printer_matches_libcst_on_arbitrary_programs(source):
    """`codegen`'s printer against LibCST's code generation, for the module and each node."""
    from torchmigrate.syntax.codegen import code_for, module_code
    from torchmigrate.syntax.walk import walk

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        reject()
    assert module_code(module) == module.code
    parents: dict = {}
    walk(module, {}, {}, parents)
    for node in parents:
        if type(node) is not cst.Annotation:  # no code of its own
            assert code_for(node, module) == module.code_for_node(node), type(node).__name__


@pytest.fixture
def monkeypatch_regenerate(monkeypatch):
    real = positions.regenerate

    def checked(new, layout):
        text = real(new, layout)
        assert text == new.code
        return text

    monkeypatch.setattr(engine, "regenerate", checked)


def test_positions_match_libcst_position_provider():
    """Lazy positions agree with LibCST's PositionProvider on every node of real scripts."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    from torchmigrate.syntax.walk import walk

    for path in sorted((FIXTURES / "scripts").glob("*.py"))[:4]:
        module = cst.parse_module(path.read_text(encoding="utf-8"))
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        expected = wrapper.resolve(PositionProvider)
        parents: dict = {}
        walk(module, {}, {}, parents)
        nodes = [n for n in parents if isinstance(n, (cst.BaseExpression, cst.BaseStatement, cst.BaseSmallStatement))]
        got = positions.positions(module, nodes)
        for node in nodes:
            start = expected[node].start
            assert got[node] == (start.line, start.column), (path.name, type(node).__name__)


def test_deep_nesting_is_an_input_error_not_a_crash():
    # Deeper than Python's default recursion limit (1000), which the engine raises while it works.
    deep = "import torch\nx = " + " + ".join(["torch.ones(1)"] * 1100) + "\n"
    for mode in ("lint",):
        try:
            result = run(deep, mode)
        except InputError as exc:
            assert "nested" in exc.message
        else:
            compile(result.new_source, "deep.py", "exec", dont_inherit=True)
    too_deep = "import torch\nx = " + "(" * 5000 + "1" + ")" * 5000 + "\n"  # would crash LibCST's parser
    with pytest.raises(InputError, match="nested"):
        run(too_deep, "lint")


def test_rewrite_that_would_not_compile_is_refused(monkeypatch):
    """A rule bug that produces invalid code never reaches the file: RewriteError, exit 2."""
    source = (FIXTURES / "scripts" / "cuda_amp_accum.py").read_text()
    real = engine.check_syntax
    calls = []

    def check(text, what="syntax error"):
        calls.append(what)
        if what != "syntax error":
            raise InputError(f"{what}: invalid syntax", 3, 0)
        return real(text, what)

    monkeypatch.setattr(engine, "check_syntax", check)
    with pytest.raises(RewriteError, match="internal error.*left unchanged"):
        run(source, "ddp")
    # the input is compiled only to tell whose fault it is: it compiles, so it is the rewrite's
    assert calls == ["the rewritten code would not compile", "syntax error"]


def test_input_that_only_the_compiler_refuses_is_the_inputs_error():
    """`return` outside a function parses (CPython's parser and LibCST's accept it); only the
    compiler refuses it. In a file the migration rewrites, the error is the input's (exit 2 with
    Python's message and line), not an internal error blamed on the rules."""
    source = (FIXTURES / "scripts" / "cuda_amp_accum.py").read_text() + "return None\n"
    line = source.count("\n")
    with pytest.raises(InputError) as raised:
        run(source, "ddp")
    assert not isinstance(raised.value, RewriteError)
    assert "outside function" in raised.value.message and raised.value.line == line

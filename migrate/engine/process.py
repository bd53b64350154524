"""One file in, findings and new source out: parse once, run all rules in one walk, apply.

`lint`, `lint --fix`, `ddp`, `amp`, `--dry-run` and `--check` all go through `process_source`;
they differ only in which findings' edits are accepted and what is done with the result.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import libcst as cst

from torchmigrate.engine.apply import apply_edits
from torchmigrate.engine.suppress import Suppressions
from torchmigrate.engine.textedits import TextEdit, text_edits
from torchmigrate.errors import InputError
from torchmigrate.finding import Edit, EditKind, Finding, Safety
from torchmigrate.program import effects
from torchmigrate.program.view import ModuleView
from torchmigrate.rule import Context, Options, RuleType
from torchmigrate.syntax.layout import statement_lines
from torchmigrate.syntax.positions import positions_and_layout, regenerate
from torchmigrate.syntax.walk import walk

# Cheap prefilter: a file alone that never mentions these cannot need a change. A module of a
# torch program is always analysed (see `process_source`).
PREFILTER = ("torch", "apex")


# `lint --fix` repeats until no fix applies, at most this many passes.
MAX_FIX_PASSES = 5
# Deep enough for anything CPython's own parser accepts (it stops near 3000 nested levels).
RECURSION_LIMIT = 12000


class RewriteError(InputError):
    """The rewritten code would not compile (a rule bug): the file is left as it was."""


@dataclass
class SourceResult:
    source: str
    new_source: str
    findings: List[Finding] = field(default_factory=list)
    # (line, code) of each code in a `# torchmigrate: ignore[...]` that names no rule
    unknown_ignores: List[Tuple[int, str]] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.new_source != self.source


def _syntax_error(exc: BaseException, what: str) -> InputError:
    """CPython's verdict on a source, as the InputError the CLI reports (exit 2)."""
    if isinstance(exc, SyntaxError):  # includes IndentationError and TabError
        version = "Python %d.%d" % sys.version_info[:2]
        return InputError(f"{what}: {exc.msg} ({version})", exc.lineno or 1, max((exc.offset or 1) - 1, 0))
    if isinstance(exc, (RecursionError, MemoryError)):
        return InputError(f"{what}: too deeply nested to compile")
    return InputError(f"{what}: {exc}")  # ValueError, e.g. "source code string cannot contain null bytes"


def check_syntax(source: str, what: str = "syntax error") -> None:
    """Raise InputError unless CPython compiles `source`: also what its parser accepts but its
    compiler refuses (`return` outside a function, `nonlocal` at module level, ...)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. invalid escape sequences: not ours to report
            compile(source, "<torchmigrate>", "exec", dont_inherit=True)
    except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:
        raise _syntax_error(exc, what) from None


def python_tree(source: str) -> ast.Module:
    """CPython's own parse of `source`, run before LibCST sees it.

    It gives Python's own message and position (TabError, Python 2 `print x`, `async=True`,
    ...), rejects what the interpreter would reject where LibCST is lenient, and stops nesting
    deep enough to crash LibCST's native parser. The tree gives the statements' lines (see
    `layout.statement_lines`). What only CPython's compiler refuses is checked once the result
    is known: `check_syntax` on the rewritten code, or on the input when nothing changes.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(source, "<torchmigrate>")
    except (SyntaxError, RecursionError, MemoryError, ValueError) as exc:
        raise _syntax_error(exc, "syntax error") from None


# The deepest expression handed to LibCST's native parser, counted as nesting levels of CPython's
# tree (a chain `a and b and c` or implicitly concatenated strings count one level per term, as
# LibCST nests them). Measured with LibCST 1.9 on an 8 MiB stack, main thread: 7,100 `and` terms
# crash the process (SIGSEGV), 3,500 concatenated strings fail as a bogus syntax error, and the
# parse time grows about quadratically with depth (1,000 nested subscripts `a[0][0]...` take ~8
# s, 2,000 over a minute). Real code stays far below: this bounds both the crash and the time.
MAX_PARSER_DEPTH = 1000
_STRINGS = (ast.JoinedStr, ast.Constant)


def check_parser_depth(tree: ast.Module, source: str) -> None:
    """Raise InputError where an expression nests deeper than LibCST's parser can take (see
    `MAX_PARSER_DEPTH`), before the parser sees it: a crash there would end the whole run.

    Cheap: a subtree on one line spanning `n` characters nests at most `n` levels, so a walk
    goes down only where the depth so far plus that span could reach the limit; for ordinary
    code it visits little more than the statements.
    """
    limit = MAX_PARSER_DEPTH
    lines: Optional[List[str]] = None
    stack: List[Tuple[ast.AST, int, ast.AST]] = [(tree, 0, tree)]
    while stack:
        node, depth, statement = stack.pop()
        if isinstance(node, ast.BoolOp):
            depth += len(node.values) - 1
        elif isinstance(node, _STRINGS) and isinstance(getattr(node, "value", ""), (str, bytes)):
            lines = lines if lines is not None else io.StringIO(source, newline="").readlines()
            depth += _string_pieces(node, lines) - 1
        if depth > limit:
            raise InputError(f"too deeply nested for the parser (more than {limit} levels of nesting)",
                             getattr(statement, "lineno", 1), getattr(statement, "col_offset", 0))
        for child in ast.iter_child_nodes(node):
            end = getattr(child, "end_lineno", None)
            if end is not None and end == child.lineno and depth + child.end_col_offset - child.col_offset <= limit:
                continue  # too short to reach the limit
            stack.append((child, depth + 1, child if isinstance(child, ast.stmt) else statement))


def _string_pieces(node: ast.expr, lines: List[str]) -> int:
    """How many literals are implicitly concatenated into the string `node` (CPython merges
    them into one node; LibCST nests one level per literal)."""
    chunk = [line.encode("utf-8") for line in lines[node.lineno - 1:node.end_lineno]]
    chunk[-1] = chunk[-1][:node.end_col_offset]
    chunk[0] = chunk[0][node.col_offset:]
    text = "(" + b"".join(chunk).decode("utf-8", "replace") + ")"
    try:
        return sum(1 for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                   if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_START", -1))
    except (tokenize.TokenError, SyntaxError):
        return 1


def _no_validation(node: cst.CSTNode) -> None:
    """Stands in for `CSTNode.__post_init__` while the parser builds a tree (see `_parser_nodes`)."""


@contextmanager
def _parser_nodes() -> Iterator[None]:
    """Skip LibCST's per-node validation for the nodes its parser builds.

    Every LibCST node validates itself on construction (`CSTNode.__post_init__` calls
    `_validate`): whitespace nodes match a regular expression, parentheses balance, and so on.
    For a tree built by LibCST's own parser from code that CPython has just parsed this
    cannot fail, yet it is about a sixth of `parse_module` (LibCST's source says as much: "it
    might make more sense to move validation work into the visitor, which would allow us to
    avoid validating the tree when parsing a file"). `_validate` has no side effects. Nodes the
    rules build later are validated as usual, and the rewritten code is compiled before it is
    written. The class attribute is restored even if parsing fails.
    """
    original = cst.CSTNode.__dict__.get("__post_init__")
    if original is None:  # a LibCST that validates differently: leave it alone
        yield
        return
    cst.CSTNode.__post_init__ = _no_validation  # type: ignore[method-assign]
    try:
        yield
    finally:
        cst.CSTNode.__post_init__ = original  # type: ignore[method-assign]


def _retabbed(source: str) -> Optional[str]:
    """`source` with the tabs of its indentation expanded to spaces (Python's 8 columns), where
    it mixes tabs and spaces in a way Python accepts but LibCST's tokenizer does not (a
    function indented with tabs beside others indented with spaces): the same blocks, so the
    same program. Lines that continue a string literal keep their text. None where there is
    nothing to expand."""
    import io
    import tokenize

    lines = source.splitlines(keepends=True)
    if not any(line[:len(line) - len(line.lstrip(" \t"))].count("\t") for line in lines):
        return None
    inside: set = set()  # 1-based lines that continue a string literal
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    out = []
    for number, line in enumerate(lines, 1):
        body = line.lstrip(" \t")
        lead = line[:len(line) - len(body)]
        out.append(line if number in inside or "\t" not in lead else lead.expandtabs(8) + body)
    return "".join(out)


def parse(source: str) -> Tuple[cst.Module, Optional[Dict[int, int]], str]:
    """LibCST's tree of `source`, its statements' lines (None if they cannot be mapped), and the
    text it is the tree of: `source`, or `source` with the tabs of its indentation expanded where
    LibCST refuses a mix of tabs and spaces that Python accepts (`_retabbed`)."""
    tree = python_tree(source)
    check_parser_depth(tree, source)
    text = source
    try:
        with _parser_nodes():
            try:
                module = cst.parse_module(source)
            except cst.ParserSyntaxError:
                retabbed = _retabbed(source)
                if retabbed is None:
                    raise
                module = cst.parse_module(retabbed)  # (a failure here reports the original's error)
                text = retabbed
    except cst.ParserSyntaxError as exc:
        line, col = exc.raw_line, exc.raw_column
        match = re.search(r"error at (\d+):(\d+)", exc.message)
        if match:
            line, col = int(match.group(1)), int(match.group(2)) - 1
        message = exc.message.replace("parser error: ", "")
        message = re.sub(r"^error at \d+:\d+: ", "", message)
        raise InputError(f"syntax error: {message}", line, max(col, 0)) from None
    except (RecursionError, MemoryError) as exc:
        raise InputError(f"cannot parse: {type(exc).__name__}") from None
    return module, statement_lines(module, tree), text


def accepted(finding: Finding, options: Options) -> bool:
    """Whether this run applies the finding's edits."""
    if finding.suppressed or not finding.edits:
        return False
    if finding.safety is Safety.SAFE:
        return options.migrating or options.fix
    if finding.safety is Safety.UNSAFE:
        return options.unsafe_fixes
    return False


# Libraries that own process-group setup, wrapping and mixed precision: a script written for
# them is already distributed, and rewriting it for DDP would fight the library.
FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning", "deepspeed", "horovod", "colossalai")


def _managing_framework(ctx: Context):
    """(library, import line) when the file imports one of FRAMEWORKS, else None. Its helpers
    alone (`from pytorch_lightning.utilities import rank_zero_only`, `accelerate.utils`) manage
    nothing: such a file is migrated like any other."""
    for full in ctx.imports.names.values():
        root = full.split(".")[0]
        if root in FRAMEWORKS and not _helpers_only(full):
            for stmt in ctx.imports.import_statements:
                if any(root == _root_of(small) for small in stmt.body):
                    return root, stmt
    return None


def _helpers_only(full: str) -> bool:
    """`pytorch_lightning.utilities.rank_zero_only`, `lightning.pytorch.utilities.seed`,
    `accelerate.utils.set_seed`: a framework's utility modules, not its trainer."""
    return any(part in ("utilities", "utils") for part in full.split(".")[1:-1])


def _root_of(node) -> str:
    from torchmigrate.syntax.imports import dotted

    if isinstance(node, cst.ImportFrom) and node.module is not None and not node.relative:
        return (dotted(node.module) or "").split(".")[0]
    if isinstance(node, cst.Import):
        return next(((dotted(a.name) or "").split(".")[0] for a in node.names
                     if (dotted(a.name) or "").split(".")[0] in FRAMEWORKS), "")
    return ""


def run_rules(module: cst.Module, path: str, options: Options, rules: Sequence[RuleType],
              program: Optional[ModuleView] = None) -> Context:
    from torchmigrate.analysis import Facts

    ctx = Context(module, path, options, program)
    ctx.enabled = frozenset(r.code for r in rules)
    if options.migrating:
        framework = _managing_framework(ctx)
        if framework is not None:
            name, stmt = framework
            ctx.findings.append(Finding(
                code="TM101", node=stmt, safety=Safety.MANUAL, todo=False,
                message=f"uses {name}, which launches, wraps and scales training itself; not migrated"))
            return ctx
    visits: Dict[type, list] = {}
    leaves: Dict[type, list] = {}
    for rule_cls in (Facts, *rules):
        rule = rule_cls(ctx)
        v, l = rule_cls.callbacks()
        for node_type, attr in v:
            visits.setdefault(node_type, []).append(getattr(rule, attr))
        for node_type, attr in l:
            leaves.setdefault(node_type, []).append(getattr(rule, attr))
    walk(module, visits, leaves, ctx.parents, ctx.preorder)
    return ctx


@contextmanager
def _deep_recursion() -> Iterator[None]:
    """Room for deeply nested (generated) code; anything deeper is reported, not a crash."""
    old = sys.getrecursionlimit()
    if old < RECURSION_LIMIT:
        sys.setrecursionlimit(RECURSION_LIMIT)
    try:
        yield
    except RecursionError:
        # The parser's depth is checked first (check_parser_depth), so this is a rule that
        # recursed without end (a bug of this tool), or rarely code just under that depth.
        raise InputError("recursion without end while processing this file (a torchmigrate bug, please report "
                         "it; or code nested too deeply): the file is left unchanged") from None
    finally:
        if old < RECURSION_LIMIT:
            sys.setrecursionlimit(old)


class _OwnView(ModuleView):
    """The view of a file processed alone, with what its own classes and code say
    (`effects.class_fields`, `effects.effect_fields`: the latter reads the whole file once
    more), each group worked out the first time a rule asks for one of its fields: in `lint`,
    most files never do. A file that CPython cannot parse (too deeply nested, a syntax error)
    keeps the empty view, and the parse that follows reports what is wrong with it. The lazy
    fields are properties (below), so reading any other field costs what it does on a view."""

    def __init__(self, source: str, path: str) -> None:
        object.__setattr__(self, "_tm_pending", [source, path, None, {effects.class_fields, effects.effect_fields}])
        super().__init__()

    def _tm_fill(self, group) -> None:
        pending = self.__dict__["_tm_pending"]
        if group not in pending[3]:
            return
        pending[3].discard(group)
        try:
            if pending[2] is None:
                pending[2] = ast.parse(pending[0])
            found = group(pending[2], pending[1])
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            found = {}
        for key, value in found.items():
            object.__setattr__(self, key, value)


def _lazy_field(name: str, group) -> property:
    """A field of `_OwnView` worked out with its `group` on first read; the dataclass's own
    `__init__` stores its default through the setter."""
    def read(self):
        self._tm_fill(group)
        return self.__dict__["_tm_fields"][name]

    def store(self, value) -> None:
        self.__dict__.setdefault("_tm_fields", {})[name] = value

    return property(read, store)


for _group, _names in ((effects.class_fields, effects.CLASS_FIELDS), (effects.effect_fields, effects.EFFECT_FIELDS)):
    for _name in _names:
        setattr(_OwnView, _name, _lazy_field(_name, _group))


def _own_view(source: str, path: str) -> ModuleView:
    return _OwnView(source, path)


def process_source(source: str, path: str, options: Options, rules: Sequence[RuleType],
                   program: Optional[ModuleView] = None, fix_edits: bool = False) -> SourceResult:
    """`program`: what the rest of the program says about this module (None: a file alone).
    With `fix_edits`, each finding whose fix was not applied gets it as text edits against
    the result's new source (`Finding.fix`)."""
    # A module of a torch program matters even where it never mentions torch: the entry whose
    # torch code lives in other modules (`Solver(cfg).train()`) needs its process group, and a
    # helpers.py that pickles results, writes files and prints runs on every rank. The
    # prefilter skips only files that are no part of one.
    part_of_torch_program = program is not None and program.followed and program.program_torch
    suppressions = Suppressions.scan(source)
    unknown = suppressions.unknown(known_codes())
    if suppressions.skip_file:
        return SourceResult(source, source, unknown_ignores=unknown)
    if not part_of_torch_program and not any(word in source for word in PREFILTER):
        check_syntax(source)  # a syntax error is reported in every file, as Ruff does
        return SourceResult(source, source, unknown_ignores=unknown)
    with _deep_recursion():
        if program is None:  # a file alone: the effects of its own code still count
            program = _own_view(source, path)
        result = _process(source, path, options, rules, suppressions, program, fix_edits)
        result.unknown_ignores = unknown
        if options.migrating or not result.changed:
            return result
        # `lint --fix`: one fix can enable another (removing DataParallel makes the file
        # distributed, which turns on the DDP checks), so fix until nothing changes, as Ruff
        # does. A migration runs every rule unconditionally and needs one pass.
        applied = [f for f in result.findings if f.applied]
        for _ in range(MAX_FIX_PASSES - 1):
            again = _process(result.new_source, path, options, rules, Suppressions.scan(result.new_source), program,
                             fix_edits)
            applied += [f for f in again.findings if f.applied]
            result = SourceResult(source, again.new_source, again.findings, unknown)
            if not again.changed:
                break
        result.findings = applied + [f for f in result.findings if not f.applied]
        return result


_KNOWN_CODES: FrozenSet[str] = frozenset()


def known_codes() -> FrozenSet[str]:
    """Every rule's code, for checking the codes of suppression comments."""
    global _KNOWN_CODES
    if not _KNOWN_CODES:
        from torchmigrate.rules import all_rules

        _KNOWN_CODES = frozenset(r.code for r in all_rules())
    return _KNOWN_CODES


def _process(source: str, path: str, options: Options, rules: Sequence[RuleType],
             suppressions: Suppressions, program: Optional[ModuleView] = None,
             fix_edits: bool = False) -> SourceResult:
    original = source
    module, lines, source = parse(source)  # (the text parsed: a migrated file's indentation expanded)
    ctx = run_rules(module, path, options, rules, program)
    findings = ctx.findings = _outside_self_test(ctx, ctx.findings)
    if not findings:
        ctx.close()
        check_syntax(source)
        return SourceResult(source, source)
    where, layout = positions_and_layout(module, [f.node for f in findings], source, ctx.parents, lines)
    for finding in findings:
        finding.line, finding.col = where.get(finding.node, (1, 0))
        finding.suppressed = suppressions.covers(finding.code, finding.line)
    edits: List[Edit] = []
    imports = []
    for finding in findings:
        if accepted(finding, options):
            finding.applied = True
            edits.extend(_normalise(ctx, finding.edits))
            imports.extend(finding.imports)
        elif options.migrating and finding.todo and not finding.suppressed and not finding.advice \
                and finding.safety is not Safety.SAFE:
            stmt = finding.statement or ctx.statement_of(finding.node)
            if stmt is not None:
                edits.append(Edit(EditKind.TODO, stmt, text=" ".join(f"{finding.code} {finding.message}".split())))
    new_source = source
    if edits or imports:
        new_module = apply_edits(module, edits, ctx.parents, imports, ctx.imports)
        new_source = regenerate(new_module, layout)
    # (else the fixes left are found in the next pass; none as edits of a file whose
    # indentation was expanded: they would not fit the text on disk)
    if fix_edits and new_source == source and source is original:
        for finding in findings:
            if finding.fixable and not finding.applied and not finding.suppressed:
                finding.fix = _fix_alone(ctx, finding, layout, source)
    ctx.close()
    if new_source != source:
        _check_rewrite(new_source, source, findings)
    else:
        check_syntax(source)
    findings.sort(key=lambda f: (f.line, f.col, f.code))
    return SourceResult(source, new_source, findings)


def _fix_alone(ctx: Context, finding: Finding, layout, source: str) -> Optional[Tuple[TextEdit, ...]]:
    """The finding's fix applied by itself, as text edits of `source`; None where it does not
    stand alone (its edits need another finding's, or do not compile without them)."""
    try:
        new_module = apply_edits(ctx.module, _normalise(ctx, finding.edits), ctx.parents, finding.imports, ctx.imports)
        new_source = regenerate(new_module, layout)
        check_syntax(new_source)
    except (InputError, ValueError, SyntaxError):
        return None
    return text_edits(source, new_source) or None


def _outside_self_test(ctx: Context, findings: List[Finding]) -> List[Finding]:
    """Findings of a module the program imports, less those in its own `__main__` block.

    `data.py` or `model.py` often ends with a self-test (`if __name__ == "__main__": print(
    model(x).shape)`) that never runs as part of the program: rewriting it, or filling the
    report with TODOs for it, buries the findings that matter."""
    if not findings or not ctx.program.followed or ctx.program.is_entry:
        return findings
    from torchmigrate.analysis import _is_main_guard

    # (from the module itself: the facts collector does not run where the rules are off, a module
    # a training framework manages, and a finding may still come from the engine)
    guard = next((s for s in ctx.module.body if isinstance(s, cst.If) and _is_main_guard(s.test)), None)
    if guard is None:
        return findings
    return [f for f in findings if f.node is not guard and not any(a is guard for a in ctx.ancestors(f.node))]


def _check_rewrite(new_source: str, source: str, findings: Sequence[Finding]) -> None:
    """Never hand back code that does not compile. If the input does not compile either (what
    only CPython's compiler refuses, e.g. `return` outside a function), that is the error;
    otherwise it is a rule bug: the file is left unchanged and the error names the rules that
    edited it."""
    try:
        check_syntax(new_source, "the rewritten code would not compile")
    except InputError as exc:
        check_syntax(source)
        codes = ", ".join(sorted({f.code for f in findings if f.applied})) or "none"
        raise RewriteError(
            f"internal error: {exc.message} at line {exc.line} of the rewritten file "
            f"(rules applied: {codes}); the file was left unchanged, please report this",
        ) from None


def _normalise(ctx: Context, edits: Sequence[Edit]) -> List[Edit]:
    """Insertions go before or after a whole statement line, except between the small statements
    of one line (`model = Net(); opt = SGD(model.parameters())`, a wrap between the two): there
    the inserted lines' statements join that line, in place, so that they run in between and
    every later line keeps its number."""
    out = []
    for edit in edits:
        if edit.kind in (EditKind.INSERT_BEFORE, EditKind.INSERT_AFTER) and isinstance(edit.target, cst.BaseSmallStatement):
            line = ctx.statement_of(edit.target)
            if _between(line, edit) and all(isinstance(s, cst.SimpleStatementLine) for s in edit.statements):
                small = tuple(s for statement in edit.statements for s in statement.body)
                edit = Edit(edit.kind, edit.target, statements=small)
            else:
                edit = Edit(edit.kind, line, statements=edit.statements)
        out.append(edit)
    return out


def _between(line: Optional[cst.CSTNode], edit: Edit) -> bool:
    """The insertion falls between two small statements of `line`."""
    if not isinstance(line, cst.SimpleStatementLine) or edit.target not in line.body:
        return False
    edge = line.body[0] if edit.kind is EditKind.INSERT_BEFORE else line.body[-1]
    return edit.target is not edge

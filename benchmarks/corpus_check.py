"""Run the migration over a folder of real training scripts and classify every file.

    python benchmarks/corpus_check.py /path/to/corpus              # ddp and amp, table + rates
    python benchmarks/corpus_check.py /path/to/corpus --mode ddp -v  # details of every failure
    python benchmarks/corpus_check.py DIR --select TM301,TM302       # bisect: only these rules
    python benchmarks/corpus_check.py DIR --out /tmp/migrated        # keep the migrated files
    python benchmarks/corpus_check.py DIR --cli                      # go through the CLI instead

The corpus itself is not part of the repository (public code stays out of our commits); point
this at any folder of `.py` files. Each file is copied to a temporary folder and migrated
in-process with `torchmigrate.engine.process.process_source` (all rules of the command, as
`torchmigrate ddp`/`amp` would), or with the CLI (`--cli`). Every file gets one status:

    parse      the original is not valid Python 3 (excluded from the rate)
    crash      the engine or a rule raised (traceback with -v)
    input      the engine refused a file that `compile()` accepts (InputError)
    compile    the migrated output does not compile
    idem       a second run changes the output again (diff with -v)
    crash2     the second run raised
    ok         migrated (or left alone) into compiling, idempotent output

Files that are `ok` may still carry warnings (not counted as failures; shown with -v):

    undef      names the output uses but never defines that the original did not (symtable)
    order      names the output reads before the first assignment in the same scope, which the
               original did not (a straight-line, source-order approximation), and new top-level
               statements after the `if __name__ == "__main__":` block (they run only at the end)
    todo       the number of `# TODO(torchmigrate)` comments added

Exit status: 0 when every mode reaches `--target` (default 0.9), else 1.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections
import difflib
import io
import json
import shutil
import subprocess
import symtable
import sys
import tempfile
import time
import tokenize
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Counter, Dict, List, Optional, Sequence, Set, Tuple

FAILURES = ("crash", "input", "compile", "idem", "crash2")
STATUSES = ("ok", "parse") + FAILURES
TODO_MARK = "# TODO(torchmigrate)"


@dataclass
class Result:
    name: str
    mode: str
    status: str = "ok"
    changed: bool = False
    detail: str = ""
    codes: Counter = field(default_factory=collections.Counter)  # applied findings
    manual: Counter = field(default_factory=collections.Counter)  # findings left as TODO / report
    todos: int = 0
    undef: List[str] = field(default_factory=list)
    order: List[str] = field(default_factory=list)
    seconds: float = 0.0
    output: Optional[str] = None


# --- reading ---------------------------------------------------------------------------------

def read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        text = data.decode("utf-8", errors="replace")
    return text[1:] if text.startswith("\ufeff") else text


def compiles(source: str, name: str) -> Optional[str]:
    """None when `source` compiles, else a one-line error with the offending line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile(source, name, "exec", dont_inherit=True)
        return None
    except (SyntaxError, ValueError) as exc:
        line = getattr(exc, "lineno", None)
        text = (getattr(exc, "text", "") or "").rstrip()
        return f"{type(exc).__name__}: {getattr(exc, 'msg', exc)} (line {line}: {text!r})"


# --- static warnings -------------------------------------------------------------------------

_BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__builtins__", "__spec__",
                                  "__loader__", "__package__", "__path__", "__annotations__"}


def undefined_names(source: str) -> Set[str]:
    """Global names read somewhere that the module never binds (empty with a star import)."""
    try:
        top = symtable.symtable(source, "<corpus>", "exec")
    except SyntaxError:
        return set()
    if any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(ast.parse(source))):
        return set()
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    # `global x` in a function that assigns x binds it at module level too
    used: Set[str] = set()
    stack = [top]
    while stack:
        table = stack.pop()
        for sym in table.get_symbols():
            name = sym.get_name()
            if table is top:
                if sym.is_referenced() and not (sym.is_assigned() or sym.is_imported() or sym.is_namespace()):
                    used.add(name)
            else:
                if sym.is_global() and sym.is_assigned():
                    bound.add(name)
                elif sym.is_global() and sym.is_referenced():
                    used.add(name)
        stack.extend(table.get_children())
    return {n for n in used - bound if n not in _BUILTINS}


class _Order:
    """Reads of a scope's own names before their first binding, in straight-line source order."""

    def __init__(self) -> None:
        self.found: List[Tuple[str, str]] = []  # (scope, name)

    def module(self, tree: ast.Module) -> None:
        self._scope("<module>", tree.body, set())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
                self._scope(node.name, node.body, params)

    def _scope(self, name: str, body: List[ast.stmt], params: Set[str]) -> None:
        own = self._bound_names(body)
        declared = set()
        for node in self._walk_scope(body):
            if isinstance(node, (ast.Global, ast.Nonlocal)):
                declared.update(node.names)
        self.scope, self.own, self.bound = name, own - declared, set(params)
        self._block(body)

    @staticmethod
    def _walk_scope(body):
        todo = list(body)
        while todo:
            node = todo.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    todo.append(child)
                elif not isinstance(child, ast.Lambda):
                    yield child  # the def binds its name; its body is another scope

    def _bound_names(self, body) -> Set[str]:
        names = set()
        for node in self._walk_scope(body):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    names.add((alias.asname or alias.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
        return names

    def _loads(self, expr: Optional[ast.AST]) -> None:
        if expr is None:
            return
        local: Set[str] = set()
        todo = [expr]
        while todo:
            node = todo.pop()
            if isinstance(node, ast.Lambda):
                continue
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                for gen in node.generators:
                    for t in ast.walk(gen.target):
                        if isinstance(t, ast.Name):
                            local.add(t.id)
            if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
                self.bound.add(node.target.id)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id in self.own and node.id not in self.bound and node.id not in local:
                    self.found.append((self.scope, node.id))
            todo.extend(ast.iter_child_nodes(node))

    def _bind(self, target: Optional[ast.AST]) -> None:
        if target is None:
            return
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, ast.Load):
                    self._loads(node)
                else:
                    self.bound.add(node.id)
            elif isinstance(node, (ast.Attribute, ast.Subscript)):
                self._loads(node.value)
                if isinstance(node, ast.Subscript):
                    self._loads(node.slice)

    def _block(self, body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            self._stmt(stmt)

    def _stmt(self, s: ast.stmt) -> None:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for d in s.decorator_list:
                self._loads(d)
            if isinstance(s, ast.ClassDef):
                for b in s.bases:
                    self._loads(b)
            else:
                for d in [*s.args.defaults, *[k for k in s.args.kw_defaults if k]]:
                    self._loads(d)
            self.bound.add(s.name)
        elif isinstance(s, ast.Assign):
            self._loads(s.value)
            for t in s.targets:
                self._bind(t)
        elif isinstance(s, ast.AugAssign):
            self._loads(s.value)
            if isinstance(s.target, ast.Name):
                self._loads(ast.Name(s.target.id, ast.Load()))
            self._bind(s.target)
        elif isinstance(s, ast.AnnAssign):
            self._loads(s.value)
            if s.value is not None:
                self._bind(s.target)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self._loads(s.iter)
            self._bind(s.target)
            self._block(s.body)
            self._block(s.orelse)
        elif isinstance(s, (ast.While, ast.If)):
            self._loads(s.test)
            self._block(s.body)
            self._block(s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self._loads(item.context_expr)
                self._bind(item.optional_vars)
            self._block(s.body)
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            self._block(s.body)
            for h in s.handlers:
                self._loads(h.type)
                if h.name:
                    self.bound.add(h.name)
                self._block(h.body)
            self._block(s.orelse)
            self._block(s.finalbody)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for alias in s.names:
                self.bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(s, ast.Delete):
            for t in s.targets:
                self._loads(t if not isinstance(t, ast.Name) else ast.Name(t.id, ast.Load()))
        elif type(s).__name__ == "Match":
            self._loads(s.subject)
            for case in s.cases:
                for n in ast.walk(case.pattern):
                    for attr in ("name", "rest"):
                        if isinstance(getattr(n, attr, None), str):
                            self.bound.add(getattr(n, attr))
                self._loads(case.guard)
                self._block(case.body)
        else:
            self._loads(s)


def order_warnings(source: str) -> Counter:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return collections.Counter()
    walker = _Order()
    walker.module(tree)
    return collections.Counter(walker.found)


def after_main_guard(source: str) -> Counter:
    """Top-level statements that follow the `if __name__ == "__main__":` block. Code put there runs
    only after the whole program has finished, so a name bound there (say a GradScaler that a
    training function reads as a global) is unbound while the program runs."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return collections.Counter()
    guard = None
    for i, node in enumerate(tree.body):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            guard = i
    if guard is None:
        return collections.Counter()
    return collections.Counter(ast.unparse(node).splitlines()[0] for node in tree.body[guard + 1:])


def static_warnings(before: str, after: str) -> Tuple[List[str], List[str]]:
    undef = sorted(undefined_names(after) - undefined_names(before))
    new_order = order_warnings(after) - order_warnings(before)
    order = sorted(f"{scope}: {name}" for (scope, name) in new_order)
    order += sorted(f"after main guard: {text}" for text in (after_main_guard(after) - after_main_guard(before)))
    return undef, order


# --- running ---------------------------------------------------------------------------------

def diff(a: str, b: str, name: str, context: int = 2) -> str:
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), f"{name} (1st run)",
                                        f"{name} (2nd run)", n=context))


class InProcess:
    def __init__(self, mode: str, select: Sequence[str], ignore: Sequence[str], amp: str, sync_bn: bool) -> None:
        from torchmigrate.engine.process import InputError, process_source
        from torchmigrate.rule import Options
        from torchmigrate.rules import select as select_rules

        self.InputError = InputError
        self.process_source = process_source
        self.options = Options(mode=mode, amp=amp, sync_bn=sync_bn)
        self.rules = select_rules(tuple(select), tuple(ignore), command=mode)

    def run(self, source: str, path: str):
        """(new_source, applied codes, open codes)."""
        result = self.process_source(source, path, self.options, self.rules)
        applied = collections.Counter(f.code for f in result.findings if f.applied)
        left = collections.Counter(f.code for f in result.findings if not f.applied and not f.suppressed)
        return result.new_source, applied, left


class ViaCLI:
    def __init__(self, mode: str, select: Sequence[str], ignore: Sequence[str], amp: str, sync_bn: bool) -> None:
        self.mode = mode
        self.extra = [f"--amp={amp}"] + (["--sync-bn"] if sync_bn else [])
        if select:
            self.extra += ["--select", ",".join(select)]
        if ignore:
            self.extra += ["--ignore", ",".join(ignore)]
        self.InputError = type("NeverRaised", (Exception,), {})

    def run(self, source: str, path: str):
        Path(path).write_text(source, encoding="utf-8")
        report = path + ".report.json"
        cmd = [sys.executable, "-m", "torchmigrate", self.mode, *self.extra, "--report", report, path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        applied, left = collections.Counter(), collections.Counter()
        try:
            data = json.loads(Path(report).read_text(encoding="utf-8"))
            for f in _records(data):
                (applied if f.get("applied") else left)[f.get("code", "?")] += 1
        except (OSError, ValueError):
            pass
        return Path(path).read_text(encoding="utf-8"), applied, left


def _records(data):
    if isinstance(data, dict):
        for key in ("findings", "records"):
            if isinstance(data.get(key), list):
                yield from (r for r in data[key] if isinstance(r, dict))
        for value in data.values():
            if isinstance(value, (list, dict)):
                yield from _records(value) if isinstance(value, dict) else (
                    x for v in value if isinstance(v, dict) for x in _records(v))


def check_file(path: Path, mode: str, engine, tmp: Path) -> Result:
    res = Result(path.name, mode)
    source = read_text(path)
    if compiles(source, path.name) is not None:
        res.status, res.detail = "parse", compiles(source, path.name)
        return res
    work = tmp / mode / path.name
    work.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, work)
    start = time.perf_counter()
    try:
        first, res.codes, res.manual = engine.run(source, str(work))
    except engine.InputError as exc:
        res.status, res.detail = "input", f"{getattr(exc, 'line', '?')}:{getattr(exc, 'col', '?')}: {exc}"
        return res
    except Exception:
        res.status, res.detail = "crash", traceback.format_exc()
        return res
    finally:
        res.seconds = time.perf_counter() - start
    res.output = first
    res.changed = first != source
    res.todos = first.count(TODO_MARK) - source.count(TODO_MARK)
    error = compiles(first, path.name)
    if error is not None:
        res.status, res.detail = "compile", error
        return res
    try:
        second, _, _ = engine.run(first, str(work))
    except Exception:
        res.status, res.detail = "crash2", traceback.format_exc()
        return res
    if second != first:
        res.status, res.detail = "idem", diff(first, second, path.name)
        return res
    res.undef, res.order = static_warnings(source, first)
    return res


# --- reporting -------------------------------------------------------------------------------

def table(results: List[Result]) -> str:
    rows = [("file", "mode", "status", "chg", "todo", "applied", "open (manual)", "warn")]
    for r in results:
        warn = []
        if r.undef:
            warn.append("undef:" + ",".join(r.undef))
        if r.order:
            warn.append("order:" + ",".join(sorted({o.split(": ", 1)[1] for o in r.order})))
        rows.append((r.name, r.mode, r.status, "y" if r.changed else "-", str(r.todos) if r.todos else "",
                     _codes(r.codes), _codes(r.manual), " ".join(warn)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths + [0])).rstrip())
    return "\n".join(out)


def _codes(counter: Counter) -> str:
    return ",".join(f"{c}" + (f"x{n}" if n > 1 else "") for c, n in sorted(counter.items()))


def summary(results: List[Result], modes: Sequence[str]) -> Tuple[str, Dict[str, float]]:
    lines, rates = [], {}
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        counts = collections.Counter(r.status for r in rs)
        denom = len(rs) - counts["parse"]
        ok = counts["ok"]
        rate = ok / denom if denom else 1.0
        rates[mode] = rate
        changed = sum(r.changed for r in rs if r.status == "ok")
        warned = sum(bool(r.undef or r.order) for r in rs if r.status == "ok")
        parts = ", ".join(f"{s} {counts[s]}" for s in STATUSES if counts[s])
        lines.append(f"{mode}: {ok}/{denom} ok ({rate:.1%}); {parts}; changed {changed}; "
                     f"with warnings {warned}; TODOs {sum(r.todos for r in rs)}; "
                     f"{sum(r.seconds for r in rs):.2f}s")
    return "\n".join(lines), rates


def details(results: List[Result]) -> str:
    out = []
    for r in results:
        if r.status in FAILURES or r.undef or r.order:
            out.append(f"=== {r.name} [{r.mode}] {r.status}")
            if r.detail:
                out.append(r.detail.rstrip())
            if r.undef:
                out.append(f"undefined in output only: {', '.join(r.undef)}")
            if r.order:
                out.append(f"read before assignment in output only: {', '.join(r.order)}")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="folders (searched for *.py) or files")
    parser.add_argument("--mode", choices=("ddp", "amp", "both"), default="both")
    parser.add_argument("--select", default="", help="only these rule codes/prefixes (comma-separated)")
    parser.add_argument("--ignore", default="", help="skip these rule codes/prefixes (comma-separated)")
    parser.add_argument("--amp", default="auto", choices=("auto", "bf16", "fp16", "off"))
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--cli", action="store_true", help="run `python -m torchmigrate` instead of in-process")
    parser.add_argument("--out", metavar="DIR", help="write each migrated file to DIR/<mode>/<name>")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--target", type=float, default=0.9, help="success rate to reach (default 0.9)")
    parser.add_argument("-v", "--verbose", action="store_true", help="details of failures and warnings")
    parser.add_argument("-q", "--quiet", action="store_true", help="summary only")
    args = parser.parse_args(argv)

    files: List[Path] = []
    for p in map(Path, args.paths):
        files.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    modes = ("ddp", "amp") if args.mode == "both" else (args.mode,)
    select = [c for c in args.select.split(",") if c]
    ignore = [c for c in args.ignore.split(",") if c]
    results: List[Result] = []
    with tempfile.TemporaryDirectory(prefix="tm-corpus-") as tmp:
        for mode in modes:
            engine = (ViaCLI if args.cli else InProcess)(mode, select, ignore, args.amp, args.sync_bn)
            for path in files:
                r = check_file(path, mode, engine, Path(tmp))
                results.append(r)
                if args.out and r.output is not None:
                    target = Path(args.out) / mode / path.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(r.output, encoding="utf-8")
    if not args.quiet:
        print(table(results))
        print()
    if args.verbose:
        text = details(results)
        if text:
            print(text)
            print()
    text, rates = summary(results, modes)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps([
            {k: (dict(v) if isinstance(v, collections.Counter) else v) for k, v in r.__dict__.items() if k != "output"}
            for r in results], indent=1), encoding="utf-8")
    return 0 if all(rate >= args.target for rate in rates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""TM504: files opened for writing, and folders created, by every rank."""

from __future__ import annotations

from typing import List

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import set_kwarg
from torchmigrate.program.checkpoints import follows_save
from torchmigrate.program.writes import is_pil_image
from torchmigrate.rule import Example, Rule
from torchmigrate.rules.checkpoint.plan import plan
from torchmigrate.program.collectives import runs_user_code
from torchmigrate.program.rank_guards import under_rank_guard
from torchmigrate.rules._active import active
from torchmigrate.rules._guards import guard_edit, sibling_runs

# Copies into the experiment folder (`create_exp_dir` copying the scripts); right after a
# checkpoint save they are TM501's.
_COPIES = frozenset({"shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.copytree", "shutil.move"})
# Removals: in a single-process program every removed file is shared, so under torchrun the
# second rank to remove it fails with FileNotFoundError (`ddp` only: distributed code may remove
# files of its own rank).
_REMOVALS = frozenset({"os.remove", "os.unlink", "shutil.rmtree"})

_FILE_HANDLERS = ("logging.FileHandler", "logging.handlers.RotatingFileHandler",
                  "logging.handlers.TimedRotatingFileHandler")
_MAKEDIRS = "os.makedirs"
_MKDIR = "os.mkdir"
_EXISTS = ("os.path.isdir", "os.path.exists")


class MainOnlyWrites(Rule):
    """
    ## What it does
    - `with open(path, "w") as f: ...` (any mode that writes: `w`, `a`, `x`, `+`) becomes
      `if tm.is_main(): with open(path, "w") as f: ...`, when the block runs no forward pass, no
      collective and no function of the file (those must run on every rank; they are left as
      they are).
    - A statement that writes a file by itself (`np.save(path, a)`, `plt.savefig(path)`,
      `fig.savefig(path)`, `df.to_csv(path)`, `Path(p).write_text(s)`, `cv2.imwrite(...)`,
      `pickle.dump(obj, f)`, a PIL image's `im.save(path)`, `shutil.copyfile(src, dst)`, and in
      `ddp` `os.remove(path)`, `logging.basicConfig(filename=...)`, ...) goes under
      `if tm.is_main():` (the other ranks' INFO records are off anyway, see `tm.setup`)
      on the same terms; adjacent ones share one guard.
    - `logging.FileHandler(path)` (and the rotating ones) becomes
      `(logging.FileHandler(path) if tm.is_main() else logging.NullHandler())`: one log file,
      written by the main process.
    - `os.makedirs(d)` and `pathlib`'s `path.mkdir(parents=True)` without `exist_ok=True`
      (missing, `False` or an expression) get `exist_ok=True`, and `os.mkdir(d)` under
      `if not os.path.isdir(d):` / `os.path.exists(d)` becomes `os.makedirs(d, exist_ok=True)`.

    ## Why is this bad?
    Under torchrun every rank runs the same code: eight processes truncate and write the same
    json history, csv log or sample file at once (interleaved or torn content), and the
    check-then-create of a folder races, so a rank fails with `FileExistsError` in some runs
    (seen in 2 of 5 two-rank runs of a public script). Checkpoints are TM501's; this rule is for
    the other files a training program writes, often in a `utils.py` the entry script imports.
    """

    code = "TM504"
    name = "main-only-writes"
    summary = "Write files on the main process only, and create folders without racing"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import json
            import os
            import torch
            def dump_history(history, out_dir):
                if not os.path.isdir(out_dir):
                    os.mkdir(out_dir)
                with open(os.path.join(out_dir, "history.json"), "w") as f:
                    json.dump(history, f)
            """,
            after="""
            import json
            import os
            import torch
            import torchmigrate.runtime as tm
            def dump_history(history, out_dir):
                if not os.path.isdir(out_dir):
                    os.makedirs(out_dir, exist_ok=True)
                if tm.is_main():
                    with open(os.path.join(out_dir, "history.json"), "w") as f:
                        json.dump(history, f)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        withs: List[cst.With] = []
        for call, name in analysis.facts(ctx).calls:
            if (name == _MAKEDIRS or _path_mkdir(call, name)) and not _exist_ok(call):
                self.report(call, "every rank creates this folder: a rank that comes second fails with "
                                  "FileExistsError; pass exist_ok=True",
                            edits=[replace(call, lambda c: set_kwarg(c, "exist_ok", cst.Name("True")))])
            elif name == _MKDIR and self._after_exists_test(call) and len(call.args) == 1:
                self.report(call, "every rank tests for this folder and then creates it: a rank that comes second "
                                  "fails with FileExistsError; use os.makedirs(..., exist_ok=True)",
                            edits=[replace(call, lambda c: set_kwarg(
                                c.with_changes(func=cst.parse_expression(
                                    (dotted(c.func) or "os.mkdir").rsplit(".", 1)[0] + ".makedirs")),
                                "exist_ok", cst.Name("True")))])
            elif (dotted(call.func) or "") == "open" and analysis.opens_for_writing(call):
                handle = ctx.parent(ctx.parent(call))
                if isinstance(handle, cst.With) and handle.items[0].item is call:
                    withs.append(handle)
            elif name in _FILE_HANDLERS:
                self._handler(call)
            elif self._writer(call, name):
                statement = ctx.parent(ctx.parent(call))
                expr_stmt = ctx.parent(call)
                if isinstance(expr_stmt, cst.Expr) and isinstance(statement, cst.SimpleStatementLine) \
                        and len(statement.body) == 1:
                    withs.append(statement)
        lines = []
        ordered = plan(ctx)
        chosen = set(withs)
        for handle in withs:
            if under_rank_guard(ctx, handle) or not isinstance(ctx.parent(handle), (cst.IndentedBlock, cst.Module)):
                continue
            if any(a in chosen for a in ctx.ancestors(handle)):
                continue  # `pickle.dump(x, f)` in a `with open(p, "wb") as f:` that gets the guard
            if ordered.orders(ctx, handle):
                continue  # a cache written under main_process_first: only the first rank finds it missing
            if runs_user_code(ctx, handle) or self._calls_a_parameter(handle):
                self.report(handle, f"every rank writes this file; the {'block' if isinstance(handle, cst.With) else 'call'}"
                                    f" also runs code that must run on every rank, so write the file under "
                                    f"`if {ctx.tm}.is_main():` yourself")
                continue
            lines.append(handle)
        for run in sibling_runs(ctx, lines):
            self.report(run[0], "every rank writes this file; write it on the main process only",
                        edits=[guard_edit(ctx, run)], imports=[ctx.runtime_import()])

    def _writer(self, call: cst.Call, name) -> bool:
        if name == "logging.basicConfig":  # with a log file: every rank would append to it
            return any(a.keyword is not None and a.keyword.value == "filename" for a in call.args)
        if name in _REMOVALS:
            return self.ctx.options.mode == "ddp" and not follows_save(self.ctx, call)
        if name in _COPIES:
            return not follows_save(self.ctx, call)
        if name in analysis.FILE_WRITERS:
            return True
        func = call.func
        if not isinstance(func, cst.Attribute) or not call.args:
            return False
        if func.attr.value in analysis.FILE_WRITER_METHODS:
            return True
        return func.attr.value == "save" and is_pil_image(self.ctx, func.value, call)

    def _handler(self, call: cst.Call) -> None:
        ctx = self.ctx
        parent = ctx.parent(call)
        if isinstance(parent, cst.IfExp) or under_rank_guard(ctx, call):
            return  # already chosen by rank
        tm = ctx.tm
        if not (dotted(call.func) or "").startswith("logging."):  # `from logging import FileHandler`
            self.report(call, f"every rank opens this log file and appends to it: create the handler on the main "
                              f"process only (`... if {tm}.is_main() else logging.NullHandler()`)")
            return
        self.report(call, "every rank opens this log file and appends to it: only the main process writes it, the "
                          "others get a logging.NullHandler",
                    edits=[replace(call, lambda c: cst.IfExp(
                        test=cst.parse_expression(f"{tm}.is_main()"), body=c,
                        orelse=cst.parse_expression("logging.NullHandler()"),
                        lpar=[cst.LeftParen()], rpar=[cst.RightParen()]))],
                    imports=[ctx.runtime_import()])

    def _calls_a_parameter(self, handle: cst.With) -> bool:
        """The block calls a parameter of its function (`model(batch)`): maybe a forward pass."""
        func = self.ctx.enclosing(handle, cst.FunctionDef)
        if func is None:
            return False
        positional, keyword_only = analysis._function_params(func)
        params = set(positional) | set(keyword_only)
        return any(isinstance(n, cst.Call) and isinstance(n.func, cst.Name) and n.func.value in params
                   for n in self.ctx.within(handle, cst.Call, skip_defs=True))

    def _after_exists_test(self, call: cst.Call) -> bool:
        """`os.mkdir(d)` as the body of `if not os.path.isdir(d):` (or `exists`)."""
        for anc in self.ctx.ancestors(call):
            if isinstance(anc, cst.If):
                test = anc.test
                if isinstance(test, cst.UnaryOperation) and isinstance(test.expression, cst.Call):
                    return self.ctx.resolve(test.expression.func) in _EXISTS
                return False
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                return False
        return False


def _exist_ok(call: cst.Call) -> bool:
    """`exist_ok=True` is passed: a folder that exists is fine."""
    return any(a.keyword is not None and a.keyword.value == "exist_ok" and isinstance(a.value, cst.Name)
               and a.value.value == "True" for a in call.args)


def _path_mkdir(call: cst.Call, name) -> bool:
    """`p.mkdir(...)` of a `pathlib.Path`: a method `mkdir` (not `os.mkdir`) given nothing but
    pathlib's keywords (`mode`, `parents`, `exist_ok`)."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "mkdir") or (name or "").startswith("os."):
        return False
    return all(a.keyword is not None and a.keyword.value in ("mode", "parents", "exist_ok") for a in call.args)

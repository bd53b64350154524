"""TM504: files opened for writing, and folders created, by every rank."""

from __future__ import annotations

import re
from typing import List, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, insert_after, insert_before, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, code, expr, set_kwarg, stmt
from torchmigrate.program.checkpoints import follows_save, saves_into
from torchmigrate.program.syntax import body_of, next_statement, unconditional
from torchmigrate.program import effects
from torchmigrate.program.classes import MODULE, OPTIMIZER, OTHER, TENSOR
from torchmigrate.program.types import kind_of, made_by
from torchmigrate.program.writes import (call_kinds, handle_uses_write_only, in_body, in_private_temp, is_pil_image,
                                         private_temp_source, scope_qual, writes_file)
from torchmigrate.rule import Example, Rule
from torchmigrate.rules.checkpoint.plan import plan
from torchmigrate.program.collectives import runs_user_code
from torchmigrate.program.rank_guards import collective_guard, under_rank_guard
from torchmigrate.rules._active import active
from torchmigrate.rules.launch.base import ends_process
from torchmigrate.rules._guards import claim_tests, guard_edit, main_only_call, orphaned, sibling_runs

# Copies into the experiment folder (`create_exp_dir` copying the scripts); right after a
# checkpoint save they are TM501's.
_COPIES = frozenset({"shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.copytree", "shutil.move"})
# Removals and renames: in a single-process program every removed or renamed file is shared, so
# under torchrun the second rank to remove or rename it fails with FileNotFoundError (`ddp` only: distributed code may remove
# files of its own rank).
_REMOVALS = frozenset({"os.remove", "os.unlink", "shutil.rmtree",
                       # renames too: the second rank finds the source gone
                       "os.rename", "os.replace", "os.renames"})
# Links made at a shared path (`os.symlink(src, dst)`, `Path(dst).symlink_to(src)`): the second
# rank to make one finds it there and fails with FileExistsError.
_LINKS = frozenset({"os.symlink", "os.link"})

# what reading an HDF5 file through its handle uses
_HDF5_READS = frozenset({"close", "keys", "values", "items", "get", "attrs", "filename", "name", "mode", "visit",
                         "visititems", "__contains__"})

# effects of program code that must run on every rank
_EVERY_RANK = frozenset({effects.COLLECTIVE, effects.TRAIN, effects.CALLS})

_FILE_HANDLERS = ("logging.FileHandler", "logging.handlers.RotatingFileHandler",
                  "logging.handlers.TimedRotatingFileHandler")
_MAKEDIRS = "os.makedirs"
_MKDIR = "os.mkdir"
_EXISTS = ("os.path.isdir", "os.path.exists")


# Calls that only format or show their arguments: `"epoch {}".format(epoch)` or `print(epoch)`
# names a value that is part of a written file's name (`f"img_{epoch}.png"`), but reads no file.
_SHOWING = frozenset({"print", "str", "repr", "int", "float", "len", "format", "join", "info", "debug", "warning",
                      "warn", "error", "log", "add_scalar", "add_scalars", "set_description", "set_postfix"})


# objects that write rows into the file they wrap, which TM504 treats as that file's handle
_WRITER_OBJECTS = frozenset({"csv.writer", "csv.DictWriter"})


def _path_method(call: cst.Call) -> Optional[str]:
    """"write" for a pathlib call that creates or removes the file its receiver names
    (`Path(flag).touch()`, `.unlink(missing_ok=True)`: no positional argument), "link" for one
    that makes the link it names (`Path(latest).symlink_to(ckpt)`), else None."""
    func = call.func
    if not isinstance(func, cst.Attribute):
        return None
    if func.attr.value in effects.PATH_WRITES and not any(a.keyword is None for a in call.args):
        return "write"
    if func.attr.value in effects.PATH_LINKS and call.args:
        return "link"
    return None


def _only_shows(call: cst.Call, name: Optional[str]) -> bool:
    func = call.func
    last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else ""
    return last in _SHOWING or (name or "").startswith("logging.")


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
      `ddp` `os.remove(path)`, `os.rename(src, dst)`, `logging.basicConfig(filename=...)`, ...) goes under
      `if tm.is_main():` (the other ranks' INFO records are off anyway, see `tm.setup`)
      on the same terms; adjacent ones share one guard.
    - A file kept open across statements, `f = open(path, "a")` ... `f.write(...)` ...
      `f.close()` (also `self.file = open(...)` in a logger class), becomes
      `f = tm.main_only(open, path, "a")` when every use of `f` writes into it (`f.write`,
      `print(..., file=f)`, `json.dump(obj, f)`, `csv.writer(f)`, `f.close()`, a test against
      None, or handing it to a function of the file that does only these with it, two calls
      deep): the file is opened on the main process, a null object absorbs the writes elsewhere,
      and no name is left unbound. Other uses (`f.name`, a `+` mode) are reported.
    - A `with open(...)` block is never guarded when names it binds are read after it
      (NameError on the other ranks) or when it runs a forward pass or a collective: its file is
      opened through `tm.main_only(open, ...)` instead when the block writes only through it,
      else the block is reported.
    - In `ddp`, a run's flag files (`Path(flag).touch()`, `Path(flag).unlink()`) are touched and
      removed by the main process only, and a test of whether such a file exists, earlier in the
      same function (`if os.path.isfile(running_flag): return`), takes the main process's answer,
      `tm.broadcast_object(...)`: each rank would otherwise look at its own moment, one returning
      while the others train (a hang), or remove a file twice.
    - A file every rank reads back after the main process alone wrote it (an evaluation json,
      also one written by a helper of any module, from the program's effects) gets
      `tm.barrier()` before the read, where every rank reaches it.
    - Files in a temporary file or folder a process made for itself (`TemporaryDirectory()`,
      `mkdtemp()`, and paths built from them) are left to every rank; not those in a run's
      output folder made with `mkdtemp(prefix=run_id, dir=experiment_dir)` and never removed,
      which the main process makes for every rank (TM107) and alone writes into. An atomic save, each
      process's own temporary file moved onto a shared path (`tmp = NamedTemporaryFile(dir=d,
      delete=False); torch.save(obj, tmp); os.replace(tmp.name, path)`), moves through
      `tm.move_into_place(tmp.name, path)`: the main process's file is moved into place, the other
      ranks' removed (a guard would leave theirs behind).
    - `h5py.File(path, "r+")` (or `"a"`) whose handle is only read (`f["data"][:]`, `f.keys()`,
      `f.close()`) is opened read-only (`"r"`): HDF5 locks a file opened for writing, so the
      second rank to open it would fail with BlockingIOError.
    - Writes inside a first-run builder (a function of the program called only when its output
      is missing, whose calls TM505 puts under `main_process_first` whole) are not guarded.
    - `logging.FileHandler(path)` (and the rotating ones) becomes
      `(logging.FileHandler(path) if tm.is_main() else logging.NullHandler())`: one log file,
      written by the main process.
    - `if os.path.exists(folder): raise FileExistsError(...)` (a run that refuses to overwrite)
      before the folder is made and written gets `tm.barrier()` after it, in `ddp`: every rank
      tests before any rank writes, so no rank finds the main process's new folder and stops.
    - `os.makedirs(d)` and `pathlib`'s `path.mkdir(parents=True)` without `exist_ok=True`
      (missing, `False` or an expression) get `exist_ok=True`, and `os.mkdir(d)` under
      `if not os.path.isdir(d):` / `os.path.exists(d)`, or on its own where every rank runs it,
      becomes `os.makedirs(d, exist_ok=True)`.
      Where the folder is created in `try:` and its `except FileExistsError:` is the program's
      own logic (refuse a non-empty folder, wipe it with `--fresh`), the whole statement runs
      on the main process, then `tm.barrier()` (a handler that does nothing is left alone).

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

    def _hydra_runs(self) -> None:
        """`@hydra.main(...)`: Hydra makes a run folder (`outputs/<date>/<time>`) and may move into
        it, on every rank; ranks that start in different seconds get different folders. Only the
        launch can choose one folder for all ranks, so it is named where the decorator is (its
        `.hydra/*.yaml` and `<job>.log` the runtime leaves to rank 0: `tm.setup()`)."""
        ctx = self.ctx
        for func in analysis.facts(ctx).functions.values():
            for decorator in func.decorators:
                target = decorator.decorator.func if isinstance(decorator.decorator, cst.Call) else decorator.decorator
                if ctx.resolve(target) == "hydra.main":
                    self.report(decorator, "Hydra makes a run folder named after the time on every rank, so ranks "
                                           "that start in different seconds get different folders (and working "
                                           "directories): give every rank the same folder on the launch line "
                                           "(`torchrun ... train.py hydra.run.dir=outputs/run1`). (tm.setup() leaves "
                                           "Hydra's config copies and log files to rank 0.)",
                                statement=ctx.statement_of(func))

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        withs: List[cst.CSTNode] = []  # `with open(...)` blocks and statements that write
        handles: List[Tuple[cst.Call, cst.Assign]] = []  # `f = open(path, "a")`
        self._waits: List[cst.CSTNode] = []  # statements given a `tm.barrier()` before them
        self._unordered: List[cst.CSTNode] = []  # helper calls writing files no argument names
        if ctx.options.mode == "ddp":
            self._refusals_before_writes()
        prepared = self._folder_tries()
        self._hydra_runs()
        for call, name in analysis.facts(ctx).calls:
            if any(t in prepared for t in ctx.ancestors(call)):
                continue  # a folder prepared on the main process only, as a whole (`_folder_tries`)
            if in_private_temp(ctx, call):
                continue  # a file in this process's own temporary folder: every rank has its own
            if ctx.options.mode == "ddp" and private_temp_source(ctx, call) and not under_rank_guard(ctx, call):
                self._move_into_place(call)
                continue
            if ctx.options.mode == "ddp" and name == "h5py.File":
                if not self._hdf5_read_only(call) and self._hdf5_created(call):
                    self._open(call, withs, handles)  # `with h5py.File(path, "w") as hf: hf.create_dataset(...)`
                continue
            if (name == _MAKEDIRS or _path_mkdir(call, name)) and not _exist_ok(call):
                self.report(call, "every rank creates this folder: a rank that comes second fails with "
                                  "FileExistsError; pass exist_ok=True",
                            edits=[replace(call, lambda c: set_kwarg(c, "exist_ok", cst.Name("True")))])
            elif name == _MKDIR and len(call.args) == 1 and (self._after_exists_test(call) or self._bare_mkdir(call)):
                # `os.mkdir(d)` keeps its module's spelling; a bare `mkdir(d)` (`from os import
                # mkdir`) has none, so it names `os` (imported where the file has no `import os`)
                spelled = dotted(call.func) or ""
                module = spelled.rsplit(".", 1)[0] if "." in spelled else "os"
                what = "tests for this folder and then creates it" if self._after_exists_test(call) else "creates this folder"
                self.report(call, f"every rank {what}: a rank that comes second fails with FileExistsError; use "
                                  "os.makedirs(..., exist_ok=True)",
                            edits=[replace(call, lambda c: set_kwarg(
                                c.with_changes(func=cst.parse_expression(module + ".makedirs")),
                                "exist_ok", cst.Name("True")))],
                            imports=[] if "." in spelled else [Import("os")])
            elif analysis.opens_file_for_writing(call, name, analysis.open_modes(self.ctx)):
                self._open(call, withs, handles)
            elif name in _FILE_HANDLERS:
                self._handler(call)
            elif self._writer(call, name):
                opened = self._opened_by_with(call)
                statement = ctx.parent(ctx.parent(call))
                expr_stmt = ctx.parent(call)
                if opened is not None:
                    if opened not in withs:
                        withs.append(opened)
                elif isinstance(expr_stmt, cst.Expr) and isinstance(statement, cst.SimpleStatementLine) \
                        and len(statement.body) == 1:
                    withs.append(statement)
        withs += self._reads_of_moved(withs)
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
                if self._null_handle(handle):
                    continue  # the block runs on every rank, writing into a stand-in on the others
                self.report(handle, f"every rank writes this file; the {'block' if isinstance(handle, cst.With) else 'call'}"
                                    f" also runs code that must run on every rank, so write the file under "
                                    f"`if {ctx.tm}.is_main():` yourself")
                continue
            lines.append(handle)
        for whole in sibling_runs(ctx, lines):
            for run, names in self._guardable(whole):
                if names:
                    if len(run) == 1 and self._null_handle(run[0]):
                        continue
                    self.report(run[0], f"every rank writes this file, but `if {ctx.tm}.is_main():` around it would "
                                        f"leave {', '.join(f'`{n}`' for n in names)} unbound on the other ranks (used "
                                        f"after it): write the file on the main process only yourself, keeping those "
                                        f"names on every rank")
                    continue
                self.report(run[0], "every rank writes this file; write it on the main process only",
                            edits=[guard_edit(ctx, run)], imports=[ctx.runtime_import()])
                self._wait_for_reread(run)
                self._agree_on_existence(run)
                self._wait_before_removal(run)
        for call, assign in handles:
            self._handle(call, assign)
        for call, name in analysis.facts(ctx).calls:
            self._helper_reread(call)
        for line in self._unordered:
            self._wait_for_any_read(line)

    def _reads_of_moved(self, statements: List[cst.CSTNode]) -> List[cst.CSTNode]:
        """The statement right after a rename that reads the renamed file (`os.rename(path, old);
        with open(old) as fin: <write path again from it>`, a repair of a broken file): the
        rename goes to the main process, so the read must go with it, in one guard; on the other
        ranks the renamed file may not exist yet (FileNotFoundError)."""
        ctx = self.ctx
        found = []
        for statement in statements:
            if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1 \
                    or not isinstance(statement.body[0], cst.Expr) or not isinstance(statement.body[0].value, cst.Call):
                continue
            call = statement.body[0].value
            if ctx.resolve(call.func) not in ("os.rename", "os.replace", "shutil.move") or len(call.args) < 2:
                continue
            moved = {code(a.value) for a in call.args[:2] if not a.star}
            after = next_statement(ctx, statement)
            if after is None or after in statements or runs_user_code(ctx, after) or collective_guard(ctx, after):
                continue
            reads = [c for c in ctx.within(after, cst.Call) if (ctx.resolve(c.func) or dotted(c.func)) == "open" and c.args
                     and code(c.args[0].value) in moved]
            if reads and ctx.within(after, cst.Return, cst.Yield, cst.Break, cst.Continue, skip_defs=True):
                self.report(reads[0], "this file was just renamed by the main process only, and every rank reads it "
                                      "here (the others may not find it yet), then leaves the block: rename and read "
                                      f"it under one `if {ctx.tm}.is_main():`, sharing what the others need")
            elif reads:
                found.append(after)
        return found

    def _refusals_before_writes(self) -> None:
        """`if os.path.exists(folder): raise FileExistsError(...)` (a run that refuses to
        overwrite), then the folder made and written by the main process: every rank runs the
        test, and a rank that reaches it after the main process made the folder stops the run.
        `tm.barrier()` after the test lets every rank test before any rank writes."""
        ctx = self.ctx
        for test_if in ctx.nodes(cst.If):
            if test_if.orelse is not None or under_rank_guard(ctx, test_if) or collective_guard(ctx, test_if) is not None:
                continue
            if any(isinstance(a, (cst.Try, cst.ExceptHandler, cst.For, cst.While)) for a in ctx.ancestors(test_if)):
                continue  # a folder prepared in a `try` (`_folder_tries`), or a test repeated in a loop
            tests = [c for c in ctx.within(test_if.test, cst.Call) if ctx.resolve(c.func) in effects.EXISTS_TESTS or (
                isinstance(c.func, cst.Attribute) and c.func.attr.value == "exists" and not c.args)]
            if not tests:
                continue
            # the names the tested paths are built from (`"model_files/" + folder`: `folder`)
            tested = {n.value for c in tests for n in ctx.within(c.args[0].value if c.args else c.func.value, cst.Name)
                      if ctx.resolve(n) is None}
            body = test_if.body.body
            last = body[-1] if body else None
            smalls = list(last.body) if isinstance(last, cst.SimpleStatementLine) else []
            if not (smalls and (isinstance(smalls[-1], cst.Raise) or (
                    isinstance(smalls[-1], cst.Expr) and isinstance(smalls[-1].value, cst.Call)
                    and ends_process(ctx, smalls[-1].value)))):
                continue
            home = ctx.enclosing(test_if, cst.FunctionDef) or ctx.module
            after = ctx.position(test_if) or 0
            writes = [c for c in ctx.within(home, cst.Call) if (ctx.position(c) or 0) > after
                      and (ctx.resolve(c.func) in (_MAKEDIRS, _MKDIR, "torch.save", "shutil.copytree")
                           or _path_mkdir(c, ctx.resolve(c.func)))
                      and (not tested or tested & {n.value for n in ctx.within(c, cst.Name)})]  # the path tested
            if not writes:
                continue
            chain = test_if  # an `elif` refusal: after the whole `if`/`elif` chain
            while isinstance(ctx.parent(chain), cst.If) and ctx.parent(chain).orelse is chain:
                chain = ctx.parent(chain)
            nxt = next_statement(ctx, chain)
            if nxt is not None and "barrier(" in code(nxt):
                continue  # a second run
            self.report(test_if, "every rank tests whether this path exists and stops if it does, while the main "
                                 "process creates it afterwards: a rank that tests late stops the run; every rank "
                                 "tests before any rank writes (`tm.barrier()` after the test)",
                        edits=[insert_after(chain, [stmt(f"{ctx.tm}.barrier()")])],
                        imports=[ctx.runtime_import()])

    def _folder_tries(self) -> List[cst.Try]:
        """`try: os.makedirs(out) except FileExistsError: <the program's own answer>` (refuse a
        non-empty folder, wipe it with `--fresh`): the handler is the program's logic, which
        `exist_ok=True` would silence, and ranks racing through it would each see the others'
        folder. The whole statement runs on the main process, then every rank waits for it
        (`tm.barrier()`; a failure there stops the job through torchrun). Where that cannot be
        done (a name it binds is read later, a rank guard around it) it is reported. Returns
        the statements handled, whose calls get no edit of their own."""
        ctx = self.ctx
        out: List[cst.Try] = []
        for call, name in analysis.facts(ctx).calls:
            if not ((name == _MAKEDIRS or name == _MKDIR or _path_mkdir(call, name)) and not _exist_ok(call)):
                continue
            statement = ctx.statement_of(call)
            owner = ctx.parent(ctx.parent(statement)) if statement is not None else None
            if not (isinstance(owner, cst.Try) and ctx.parent(statement) is owner.body and owner not in out
                    and any(_catches_exists(h) for h in owner.handlers)):
                continue
            out.append(owner)
            if under_rank_guard(ctx, owner) or all(_ignores(h) for h in owner.handlers if _catches_exists(h)):
                continue  # (`except FileExistsError: pass`: the race is harmless as it is)
            names = orphaned(ctx, [owner])
            if names or collective_guard(ctx, owner) is not None \
                    or not isinstance(ctx.parent(owner), (cst.IndentedBlock, cst.Module)):
                self.report(owner, "every rank would create this folder and handle the FileExistsError its own way, "
                                   "seeing the others' folder: run the whole statement on the main process only "
                                   f"(`if {ctx.tm}.is_main():`), then `{ctx.tm}.barrier()`")
                continue
            self.report(owner, "every rank would create this folder and handle the FileExistsError its own way, "
                               "seeing the others' folder: the whole statement runs on the main process, then every "
                               "rank waits for it",
                        edits=[guard_edit(ctx, [owner]), insert_after(owner, [stmt(f"{ctx.tm}.barrier()")])],
                        imports=[ctx.runtime_import()])
        return out

    def _hdf5_read_only(self, call: cst.Call) -> bool:
        """`f = h5py.File(path, "r+")` (or `"a"`) whose handle is only read (`f["data"][:]`,
        `f.keys()`, `f.close()`): HDF5 locks a file opened for writing, so the second rank to open
        it fails with BlockingIOError ("unable to lock file"); opened read-only, every rank can."""
        mode = arg(call, "mode", 1)
        if mode is None or not isinstance(mode.value, cst.SimpleString) \
                or mode.value.evaluated_value not in ("r+", "a") or not self._only_read(call):
            return False
        self.report(call, "every rank opens this HDF5 file for writing, which locks it (the second rank fails with "
                          "BlockingIOError: unable to lock file); it is only read here, so it is opened read-only",
                    edits=[replace(mode.value, lambda v: cst.SimpleString('"r"'))])
        return True

    @staticmethod
    def _hdf5_created(call: cst.Call) -> bool:
        """`h5py.File(path, "w")` (or "w-", "x"): the file is created, truncated if it was there;
        every rank doing it writes the same file."""
        mode = arg(call, "mode", 1)
        return mode is not None and isinstance(mode.value, cst.SimpleString) \
            and mode.value.evaluated_value in ("w", "w-", "x")

    def _only_read(self, call: cst.Call) -> bool:
        """The handle `call` opens (bound by `f = ...` or `with ... as f`) is only read."""
        ctx = self.ctx
        parent = ctx.parent(call)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
            name = parent.targets[0].target.value
        elif isinstance(parent, cst.WithItem) and parent.asname is not None and isinstance(parent.asname.name, cst.Name):
            name = parent.asname.name.value
        else:
            return False
        scope = ctx.enclosing(call, cst.FunctionDef) or ctx.module
        uses = [n for n in ctx.within(scope, cst.Name, skip_defs=True) if n.value == name]
        for use in uses:
            up = ctx.parent(use)
            if isinstance(up, (cst.AssignTarget, cst.AsName)):
                continue  # the binding
            if isinstance(up, cst.Attribute) and up.value is use:
                if up.attr.value not in _HDF5_READS:
                    return False
            elif isinstance(up, cst.Subscript) and up.value is use:
                holder = ctx.parent(up)
                if isinstance(holder, (cst.AssignTarget, cst.Del)) or (isinstance(holder, cst.AugAssign)
                                                                        and holder.target is up):
                    return False
            else:
                return False  # handed elsewhere: who knows what is written
        return True

    def _move_into_place(self, call: cst.Call) -> None:
        """`os.replace(tmp.name, path)` of a temporary file each rank wrote for itself (an atomic
        save): `tm.move_into_place(tmp.name, path)`, the main process's file moved into place, the
        other ranks' removed."""
        tm = self.ctx.tm
        self.report(call, f"every rank moves its own temporary file onto this path: `{tm}.move_into_place` moves "
                          "the main process's there and removes the other ranks' (one writer, no file left behind)",
                    edits=[replace(call, lambda c: c.with_changes(func=expr(f"{tm}.move_into_place"),
                                                                  args=[a.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
                                                                        for a in c.args[:2]]))],
                    imports=[self.ctx.runtime_import()])

    def _guardable(self, run: List[cst.CSTNode]) -> List[Tuple[List[cst.CSTNode], List[str]]]:
        """`run` split into the longest stretches that one guard can take without leaving a name
        unbound after it (names empty), and the single statements that cannot (with those names):
        a block that keeps `n = f.tell()` for later does not stop the json written beside it."""
        ctx = self.ctx
        names = orphaned(ctx, run)
        if not names:
            return [(run, [])]
        parts: List[Tuple[List[cst.CSTNode], List[str]]] = []
        i = 0
        while i < len(run):
            end = next((j for j in range(len(run), i, -1) if not orphaned(ctx, run[i:j])), None)
            if end is None:
                parts.append(([run[i]], orphaned(ctx, [run[i]])))
                i += 1
            else:
                parts.append((run[i:end], []))
                i = end
        return parts

    def _open(self, call: cst.Call, withs: List[cst.CSTNode], handles: List[Tuple[cst.Call, cst.Assign]]) -> None:
        """Where a file is opened for writing: a `with` block, a handle kept in a name
        (`f = open(p, "a")` ... `f.close()`), or inside a statement that writes through it at
        once (`json.dump(results, open(p, "w"))`, `open(p, "w").write(text)`)."""
        ctx = self.ctx
        parent = ctx.parent(call)
        handle = ctx.parent(parent)
        if isinstance(handle, cst.With):
            if handle.items[0].item is call and not ("TM501" in ctx.enabled and saves_into(ctx, handle)):
                withs.append(handle)  # (a checkpoint file, `torch.save(obj, f)` in the block: TM501's)
            return
        if isinstance(parent, cst.IfExp) and call in (parent.body, parent.orelse):
            # `self.log = open(path, "w") if path else None`: the handle, or nothing
            parent = ctx.parent(parent)
            if not (isinstance(parent, cst.Assign) and isinstance(parent.value, cst.IfExp)):
                return
        if isinstance(parent, cst.Arg) and isinstance(handle, cst.Call) and handle.args and handle.args[0] is parent \
                and (ctx.resolve(handle.func) or "") in _WRITER_OBJECTS:
            # `log = csv.writer(open(path, "a", 1))` ... `log.writerow(row)`: the writer is the handle
            parent = ctx.parent(handle)
            if not (isinstance(parent, cst.Assign) and parent.value is handle):
                return
        if isinstance(parent, cst.Assign) and (parent.value in (call, handle) or isinstance(parent.value, cst.IfExp)) \
                and len(parent.targets) == 1 and isinstance(parent.targets[0].target, (cst.Name, cst.Attribute)):
            handles.append((call, parent))
            return
        line = ctx.statement_of(call)
        if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(line.body[0], cst.Expr):
            withs.append(line)

    def _handle(self, call: cst.Call, assign: cst.Assign) -> None:
        """`f = open(path, "a")` kept open across statements (`f.write(...)` in a loop, then
        `f.close()`): guarding the statements one by one would leave `f` unbound on the other
        ranks, so the file is opened on the main process only and `f` is `tm.main_only`'s null
        object elsewhere, which absorbs every write. Only when every use of `f` writes into it."""
        ctx = self.ctx
        if under_rank_guard(ctx, call) or plan(ctx).orders(ctx, call):
            return
        name = dotted(assign.targets[0].target) or ""
        scope = (ctx.enclosing(assign, cst.ClassDef) if name.startswith("self.") else None) \
            or ctx.enclosing(assign, cst.FunctionDef) or ctx.module
        write_only = handle_uses_write_only(ctx, name, scope, assign)
        if "+" in (self._mode(call) or "+") and not write_only:
            # (`open(p, "a+")` whose handle is only written to, a log helper's habit, is a write)
            self.report(call, f"every rank opens this file to write and read it: write it on the main process only "
                              f"(`if {ctx.tm}.is_main():`), then `{ctx.tm}.barrier()` before any rank reads it")
            return
        if not write_only:
            self.report(call, f"every rank opens this file for writing, and `{name}` is used in ways a stand-in "
                              f"cannot take: open it on the main process only (`{ctx.tm}.main_only(open, ...)` "
                              f"or `if {ctx.tm}.is_main():`) and keep those uses off the other ranks")
            return
        self.report(call, f"every rank opens this file for writing and writes through `{name}`; open it on the "
                          f"main process only (`{name}` absorbs every write on the other ranks)",
                    edits=[replace(call, main_only_call(ctx.tm))], imports=[ctx.runtime_import()])

    def _null_handle(self, statement: cst.CSTNode) -> bool:
        """`with open(p, "w") as f:` whose block must run on every rank (it binds names used
        after it, or runs a forward or collective) but writes only through `f`: the file is
        opened on the main process only (`tm.main_only(open, ...)`) and the block runs
        everywhere, writing into a stand-in on the other ranks."""
        ctx = self.ctx
        if not isinstance(statement, cst.With) or len(statement.items) != 1 or statement.items[0].asname is None:
            return False
        call = statement.items[0].item
        name = dotted(statement.items[0].asname.name)
        if not isinstance(call, cst.Call) or name is None or "." in name or self._mode(call) is None:
            return False
        if not handle_uses_write_only(ctx, name, ctx.enclosing(statement, cst.FunctionDef) or ctx.module,
                                      statement.items[0]):
            return False  # (also `open(p, "a+")` read back through its handle)
        modes = analysis.open_modes(ctx)
        if any(writes_file(c, n, modes) and not analysis.opens_file_for_writing(c, n, modes) and not self._into(c, name)
               for c, n in self._calls_in(statement.body)):
            return False  # another file written in the block would still be written by every rank
        self.report(statement, "every rank writes this file, and the block must run on every rank: open the file "
                               "on the main process only (the other ranks write into a stand-in)",
                    edits=[replace(call, main_only_call(ctx.tm))], imports=[ctx.runtime_import()])
        return True

    def _opened_by_with(self, call: cst.Call) -> Optional[cst.With]:
        """The `with <opener> as f:` around `pickle.dump(obj, f)` that opened the file `call`
        writes into, whatever the opener (`gzip.open`, `fs.open`, a project helper): the file is
        created or truncated where it is opened, so a guard must take the whole `with`, never
        only the write inside it (the other ranks would still empty the file)."""
        ctx = self.ctx
        handles = {a.value.value for a in call.args if isinstance(a.value, cst.Name)}
        for anc in ctx.ancestors(call):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return None
            if isinstance(anc, cst.With) and any(
                    isinstance(item.item, cst.Call) and item.asname is not None
                    and isinstance(item.asname.name, cst.Name) and item.asname.name.value in handles
                    for item in anc.items):
                return anc
        return None

    def _calls_in(self, node: cst.CSTNode):
        for c in self.ctx.within(node, cst.Call, skip_defs=True):
            yield c, self.ctx.resolve(c.func)

    @staticmethod
    def _into(call: cst.Call, handle: str) -> bool:
        """`json.dump(obj, f)`: a write into the file `handle`."""
        return any(isinstance(a.value, cst.Name) and a.value.value == handle for a in call.args)

    def _mode(self, call: cst.Call) -> Optional[str]:
        return analysis.open_mode(call, analysis.open_modes(self.ctx))

    def _helper_reread(self, call: cst.Call) -> None:
        """`write_results(results, path)` (the program's own code, in any module, that writes
        files and guards them on the main process: see the effects) followed by every rank
        reading `path`: the same wait as for a write of this file. Also where the helper runs
        on every rank and guards only its write (`extract(path, net, loader)`: a forward over
        the model, then `savemat(path, ...)` on the main process), read back by another helper
        (`score(path)`)."""
        ctx = self.ctx
        kinds = call_kinds(ctx, call)
        line = ctx.statement_of(call)
        if not kinds or effects.WRITE not in kinds or under_rank_guard(ctx, call) \
                or not isinstance(line, cst.SimpleStatementLine) or not in_body(ctx, line) \
                or plan(ctx).orders(ctx, call):
            return
        positions, keywords = ctx.program.call_writes.get(f"{scope_qual(ctx, call)}|{dotted(call.func)}", ((), ()))
        paths = {code(a.value) for i, a in enumerate(call.args)
                 if (a.keyword is None and not a.star and i in positions) or (a.keyword is not None and a.keyword.value in keywords)}
        # the run's settings (`args.save_dir` inside the helper) name where it writes, but every
        # call handed the settings would read "that file": not a path to follow
        paths = {t for t in paths if not _SETTINGS.match(t)}
        waits = len(self._waits)
        self._wait_for_reread([line], paths)
        if len(self._waits) == waits:
            self._unordered.append(line)  # `_wait_for_any_read`, once every other wait is known
        self._wait_for_readers(line, paths)

    def _wait_for_any_read(self, line: cst.SimpleStatementLine) -> None:
        """`select_reliable(checkpoints, loader, args)` (a helper that writes files it names itself,
        `reliable_ids.txt` under a folder of the settings, now on the main process only), then
        `SemiDataset(..., cur_unlabeled_id_path)` reading one of them in another module: where no
        read of an argument the helper writes follows, the next statement of the same block that
        reads any file (the program's code that reads, or a library reader) waits at a
        `tm.barrier()`, where every rank reaches it. A barrier that was not needed costs one
        collective; a rank reading before the file is complete crashed, or read last run's."""
        ctx = self.ctx
        body = list(body_of(ctx.parent(line)) or ())
        if line not in body or collective_guard(ctx, line) is not None or under_rank_guard(ctx, line):
            return  # (an `if` on the settings is taken alike by every rank: the barrier is met there)
        for statement in body[body.index(line) + 1:]:
            if isinstance(statement, cst.FunctionDef) or isinstance(statement, cst.ClassDef):
                continue
            if any(statement is b for b in self._waits):
                return  # every rank already waits before it
            for call, name in self._calls_in(statement):
                if name and name.endswith(".barrier"):
                    return
                kinds = call_kinds(ctx, call)
                if kinds and effects.WRITE in kinds:
                    continue  # (another writer: its own reads are its business)
                if _reads_a_file(name, kinds) and not (name in ("open", "io.open")
                                                       and writes_file(call, name, analysis.open_modes(ctx))):
                    if under_rank_guard(ctx, call):
                        return
                    self._waits.append(statement)
                    self.report(call, f"`{code(line)[:60]}` writes files on the main process only now, and this "
                                      "reads a file: every rank waits until they are complete",
                                edits=[insert_before(statement, [stmt(f"{ctx.tm}.barrier()")])],
                                imports=[ctx.runtime_import()])
                    return

    def _wait_for_readers(self, line: cst.SimpleStatementLine, written: set) -> None:
        """A file every rank read earlier in the same function (`check = load_from_json(params_file)`
        to compare with the settings of a previous run) that the main process now writes alone
        (`write_to_json(params, params_file)`, guarded in the helper): it would truncate the file
        while a slower rank still reads it, so every rank waits at a `tm.barrier()` before the
        write, where every rank reaches it (reported otherwise)."""
        ctx = self.ctx
        if not written:
            return
        scope = ctx.enclosing(line, cst.FunctionDef) or ctx.module
        start = ctx.position(line) or 0
        read = None
        for call, name in analysis.facts(ctx).calls:
            position = ctx.position(call)
            if position is None or position >= start or (ctx.enclosing(call, cst.FunctionDef) or ctx.module) is not scope:
                continue
            if name and name.endswith(".barrier"):
                read = None  # the ranks meet after the reads before it
                continue
            first = call.args[0].value if call.args and call.args[0].keyword is None else None
            if first is None or code(first) not in written or under_rank_guard(ctx, call) or name in effects.EXISTS_TESTS \
                    or writes_file(call, name, analysis.open_modes(ctx)) or _only_shows(call, name):
                continue
            kinds = call_kinds(ctx, call)
            if _reads_a_file(name, kinds):
                read = call
        if read is None:
            return
        if collective_guard(ctx, line) is not None or not in_body(ctx, line):
            self.report(line, f"the main process writes this file while the other ranks may still read it "
                              f"(`{code(read)[:60]}`): call `{ctx.tm}.barrier()` on every rank before the write")
            return
        self.report(line, "the main process writes this file, which every rank read above: wait until every rank "
                          "has read it before it is rewritten",
                    edits=[insert_before(line, [stmt(f"{ctx.tm}.barrier()")])], imports=[ctx.runtime_import()])

    def _wait_before_removal(self, run) -> None:
        """A folder or file the main process now removes alone (`shutil.rmtree(path)` after the best
        checkpoint was reloaded from `path + '/checkpoint.pth'` by every rank): a slower rank may
        still be reading it, so every rank waits before the removal (files under the folder count:
        names built from its path)."""
        ctx = self.ctx
        removed = {code(call.args[0].value) for statement in run for call, name in self._calls_in(statement)
                   if name in _REMOVALS and call.args}
        if not removed:
            return
        scope = ctx.enclosing(run[0], cst.FunctionDef) or ctx.module
        for _ in range(2):  # `best = path + "/checkpoint.pth"`, then names built from that
            for assign in analysis.facts(ctx).assigns:
                if (ctx.enclosing(assign, cst.FunctionDef) or ctx.module) is not scope or len(assign.targets) != 1:
                    continue
                target = dotted(assign.targets[0].target)
                if target and any(isinstance(n, (cst.Name, cst.Attribute)) and code(n) in removed
                                  for n in ctx.within(assign.value, cst.Name, cst.Attribute)):
                    removed.add(target)
        self._wait_for_readers(run[0], removed)

    def _wait_for_reread(self, run, written: Optional[set] = None) -> None:
        """A file the main process now writes alone and every rank reads back later in the same
        function (an evaluation json, a results file): the others must wait until it is
        complete, so a `tm.barrier()` goes before the read, where every rank reaches it.
        `written`: the path texts the run may write (else its first `open` for writing)."""
        ctx = self.ctx
        if written is None:
            path = self._written_path(run)
            written = {path} if path is not None else set()
        if not written:
            return
        scope = ctx.enclosing(run[0], cst.FunctionDef) or ctx.module
        end = ctx.last_position(run[-1])
        for call, name in analysis.facts(ctx).calls:
            position = ctx.position(call)
            if position is None or position <= end or (ctx.enclosing(call, cst.FunctionDef) or ctx.module) is not scope:
                continue
            if name and name.endswith(".barrier"):
                return
            first = call.args[0].value if call.args and call.args[0].keyword is None else None
            reads = first is not None and code(first) in written and not writes_file(call, name, analysis.open_modes(ctx)) \
                and not _only_shows(call, name)
            kinds = call_kinds(ctx, call) if reads else None
            if kinds is not None and effects.READ not in kinds:
                continue  # the program's own code that is handed the path and never reads a file (it appends to it)
            if not (reads or self._shell_reads(call, name, written)):
                continue
            body = body_of(ctx.parent(run[0])) or ()
            reading = next((a for a in (call, *ctx.ancestors(call)) if any(a is b for b in body)), None)
            if reading is not None and any(reading is b for b in self._waits):
                return  # (a second helper of the same line writes it: one wait)
            if reading is None or collective_guard(ctx, run[0]) is not None \
                    or not unconditional(ctx, run[-1], scope) or under_rank_guard(ctx, call):
                self.report(call, f"every rank reads this file, which only the main process writes now: call "
                                  f"`{ctx.tm}.barrier()` on every rank between the write and this read")
                return
            self._waits.append(reading)
            self.report(call, "every rank reads back this file, which only the main process writes now: wait "
                              "until it is complete",
                        edits=[insert_before(reading, [stmt(f"{ctx.tm}.barrier()")])], imports=[ctx.runtime_import()])
            return

    def _shell_reads(self, call: cst.Call, name: Optional[str], written: set) -> bool:
        """A shell command that names the written file (`os.system("perl conlleval < %s > %s" %
        (pred_path, score_path))`): an evaluation script that reads it."""
        if name not in effects.SHELL_RUNNERS:
            return False
        return any(type(n) in (cst.Name, cst.Attribute) and code(n) in written
                   for a in call.args for n in self.ctx.within(a.value, cst.Name, cst.Attribute))

    def _agree_on_existence(self, run) -> None:
        """A test, earlier in the function, of whether a file exists that this run (now on the
        main process only) creates or removes: a run's flag file (`if os.path.isfile(running):
        return` ... `Path(running).touch()` ... `Path(running).unlink()`). Each rank would look at
        its own moment, after the main process touched it or not, and one would return while the
        others train (a hang); they take the main process's answer instead,
        `tm.broadcast_object(...)`, asked before it writes. Only a test every rank reaches (in
        the function's own body, outside rank guards) can be shared."""
        ctx = self.ctx
        func = ctx.enclosing(run[0], cst.FunctionDef)
        paths = {p for statement in run for call, name in self._calls_in(statement) for p in [self._touched(call, name)] if p}
        if func is None or not paths or not isinstance(func.body, cst.IndentedBlock):
            return
        start = ctx.position(run[0]) or 0
        agreed = ctx.facts.setdefault("tm504.agreed", set())
        for statement in func.body.body:
            if not isinstance(statement, cst.If) or (ctx.position(statement) or 0) > start or statement in agreed:
                continue
            test = statement.test
            if isinstance(test, cst.Call) and ctx.resolve(test.func) == "torchmigrate.runtime.broadcast_object":
                continue
            tests = [c for c in ctx.within(test, cst.Call, skip_defs=True)
                     if ctx.resolve(c.func) in effects.EXISTS_TESTS and c.args]
            asked = {code(c.args[0].value) for c in tests}
            if asked & paths and claim_tests(ctx, tests):
                agreed.add(statement)
                self.report(statement, f"every rank asks whether {', '.join(f'`{p}`' for p in sorted(asked & paths))} "
                                       "exists, which only the main process creates or removes now: the ranks take "
                                       "its answer, so all of them go the same way",
                            edits=[replace(test, lambda t: cst.parse_expression(
                                f"{ctx.tm}.broadcast_object({code(t)})"))], imports=[ctx.runtime_import()])

    def _touched(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """The path text of the file a write creates or removes: `open(p, "w")`, `os.remove(p)`,
        `Path(p).touch()`."""
        func = call.func
        if _path_method(call) == "write":
            receiver = func.value
            if isinstance(receiver, cst.Call) and receiver.args and (dotted(receiver.func) or "").endswith("Path"):
                return code(receiver.args[0].value)
            return code(receiver)
        if analysis.opens_file_for_writing(call, name, analysis.open_modes(self.ctx)):
            path = analysis.opened_path(call)
            return code(path) if path is not None else None
        if name in _REMOVALS and call.args:
            return code(call.args[0].value)
        if name in _LINKS and len(call.args) > 1:
            return code(call.args[1].value)
        if _path_method(call) == "link":
            return code(func.value)
        return None

    def _written_path(self, run) -> Optional[str]:
        """The path text of the file a guarded run writes (the first `open` for writing)."""
        for statement in run:
            for call, name in self._calls_in(statement):
                path = analysis.opened_path(call) if analysis.opens_file_for_writing(call, name, analysis.open_modes(self.ctx)) else None
                if path is not None:
                    return code(path)
        return None

    def _writer(self, call: cst.Call, name) -> bool:
        if name == "logging.basicConfig":  # with a log file: every rank would append to it
            return any(a.keyword is not None and a.keyword.value == "filename" for a in call.args)
        if name in _REMOVALS or name in _LINKS:
            return self.ctx.options.mode == "ddp" and not follows_save(self.ctx, call)
        if name in _COPIES:
            return not follows_save(self.ctx, call)
        if name in effects.SHELL_RUNNERS:  # `os.system("cp main.py " + out)`: every rank copies
            text = analysis.leading_text(call.args[0].value) if call.args else None
            # (a download or unpacking is TM505's: every rank reads what it fetched)
            return self.ctx.options.mode == "ddp" and effects.shell_command_writes(text) \
                and not effects.shell_command_fetches(text)
        if name in analysis.FILE_WRITERS:
            return True
        func = call.func
        if _path_method(call) == "write":
            return self.ctx.options.mode == "ddp"  # `Path(flag).touch()`, `.unlink()`
        if _path_method(call) == "link" and name is None:
            return self.ctx.options.mode == "ddp" and not follows_save(self.ctx, call)  # `Path(dst).symlink_to(src)`
        if not isinstance(func, cst.Attribute) or not call.args:
            return False
        if func.attr.value in analysis.FILE_WRITER_METHODS:
            return True
        return func.attr.value == "save" and (is_pil_image(self.ctx, func.value, call) or self._saves_itself(call))

    def _saves_itself(self, call: cst.Call) -> bool:
        """`img.save(path)` on a value the file does not type (`to_image(sr)` of a helper in
        another module, a tokenizer, a scripted model): a method `save` given where to write is a
        file write, as the program's effects count it, unless the receiver is `self` or an
        instance of the program's own classes (whose `save` the effects follow inside) or a tensor
        or optimizer, or the call hands it a model to save (a checkpointer object)."""
        ctx = self.ctx
        receiver = call.func.value
        if ctx.resolve(call.func) is not None or not isinstance(ctx.parent(call), cst.Expr):
            return False
        if dotted(receiver) in ("self", "cls") or made_by(ctx, receiver) is not None:
            return False
        first = call.args[0]
        if first.star or kind_of(ctx, first.value) in (MODULE, TENSOR, OPTIMIZER):
            return False  # `saver.save(model, optimizer, epoch)`: a checkpointer, whose inside decides
        # (a model of a library, `torch.jit.script(net).save(path)`, writes its file: not one of the
        # program's classes, whose own `save` the effects follow inside)
        return kind_of(ctx, receiver) not in (TENSOR, OPTIMIZER, OTHER)

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

    def _bare_mkdir(self, call: cst.Call) -> bool:
        """`os.mkdir(d)` that every rank runs, with no `try` around it that expects the folder to
        be there (`except FileExistsError:`/`OSError`): the rank that comes second fails
        (`mkdir(f"vaemodels-{rndstr()}")`, a name every rank draws alike)."""
        ctx = self.ctx
        if under_rank_guard(ctx, call):
            return False
        for anc in ctx.ancestors(call):
            if isinstance(anc, cst.Try) and any(h.type is None or any(
                    n.value in ("FileExistsError", "OSError", "IOError", "Exception", "BaseException")
                    for n in ctx.within(h.type, cst.Name)) for h in anc.handlers):
                return False
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
        return True

    def _after_exists_test(self, call: cst.Call) -> bool:
        """`os.mkdir(d)` as the body of `if not os.path.isdir(d):` (or `exists`), or anywhere under
        an `if` that tests whether `d` itself exists (`if os.path.exists(d): <ask>; shutil.rmtree(d);
        os.mkdir(d)  else: os.mkdir(d)`): the program decided to create the folder knowing it was
        there or not, which `exist_ok=True` keeps, while the ranks race to create it."""
        target = code(call.args[0].value) if call.args and not call.args[0].star else None
        first = True
        for anc in self.ctx.ancestors(call):
            if isinstance(anc, cst.If):
                test = anc.test
                if first and isinstance(test, cst.UnaryOperation) and isinstance(test.expression, cst.Call) \
                        and self.ctx.resolve(test.expression.func) in _EXISTS:
                    return True
                first = False
                if target is not None and any(self.ctx.resolve(c.func) in _EXISTS and c.args
                                              and code(c.args[0].value) == target
                                              for c in self.ctx.within(test, cst.Call)):
                    return True
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                return False
        return False


def _catches_exists(handler: cst.ExceptHandler) -> bool:
    """`except FileExistsError:` (also OSError, IOError, Exception, a tuple with one, or bare)."""
    if handler.type is None:
        return True
    kinds = [e.value for e in handler.type.elements] if isinstance(handler.type, cst.Tuple) else [handler.type]
    return any((dotted(k) or "").rsplit(".", 1)[-1] in ("FileExistsError", "OSError", "IOError", "Exception",
                                                        "BaseException") for k in kinds)


# library calls that read a file (the program's effects' list, and numpy's text reader)
_READERS = effects.READERS | {"numpy.genfromtxt"}


def _reads_a_file(name: Optional[str], kinds) -> bool:
    """A call (resolved as `name`, with the program's `kinds` of effects) that reads a file:
    `open`, a library reader, or the program's code that reads one."""
    return name in ("open", "io.open") or name in _READERS or (name or "").startswith(effects.READ_PREFIXES) \
        or (kinds is not None and effects.READ in kinds)


_SETTINGS = re.compile(r"^(self\.)?(args|opts?|options|cfg|config|conf|hparams|hps?|params|flags|FLAGS|settings)$")


def _ignores(handler: cst.ExceptHandler) -> bool:
    """`except FileExistsError: pass` (or `...`): the handler does nothing."""
    body = handler.body.body if isinstance(handler.body, cst.IndentedBlock) else [handler.body]
    if not all(isinstance(line, cst.SimpleStatementLine) for line in body):
        return False
    smalls = [x for line in body for x in line.body]
    return all(isinstance(x, cst.Pass) or (isinstance(x, cst.Expr) and isinstance(x.value, cst.Ellipsis))
               for x in smalls)


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

"""TM501 save-main-unwrapped: checkpoints written once, by the main process.

This rule edits the `torch.save` function, rank-guard tests and whole statements; a wrapped model
saved whole is TM302's (see the package docstring).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, code, keep_alignment
from torchmigrate.program.writes import in_private_temp, private_temp_source
from torchmigrate.program.checkpoints import (LOADS, SAVES, file_handle, is_buffer, is_open, load_events, path_text,
                                              save_through_handle,
                                              with_binding)
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules.checkpoint.plan import plan
from torchmigrate.syntax.nodes import expr as cached_expr, stmt as cached_stmt
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.collectives import runs_user_code
from torchmigrate.program.rank_guards import caller_guards, collective_guard, under_rank_guard
from torchmigrate.program.ranks import rank_word
from torchmigrate.program.scopes import scope_of
from torchmigrate.program.syntax import body_of, index_in, iter_nodes, unconditional
from torchmigrate.rules._active import active
from torchmigrate.rules._guards import guard_edit, guardable_line, orphaned, sibling_runs

_IMAGE_WRITERS = {"torchvision.utils.save_image"}
# File operations that, after `tm.save`, would run on ranks where the file was never written.
_FILE_OPS = {
    "shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.move", "os.rename", "os.replace",
    "os.remove", "os.unlink", "os.symlink", "os.link",
}


def _is_local_rank_expr(node: cst.BaseExpression) -> bool:
    """`args.local_rank`, `local_rank`, `int(os.environ["LOCAL_RANK"])`, `os.environ.get("LOCAL_RANK")`."""
    name = dotted(node)
    if name is not None:
        return name.rsplit(".", 1)[-1].lower() in ("local_rank", "localrank")
    for n in iter_nodes(node):
        if isinstance(n, cst.SimpleString) and "local_rank" in n.value.lower():
            return True
    return False


def _int_value(node: cst.BaseExpression) -> Optional[int]:
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus) and isinstance(node.expression, cst.Integer):
        return -int(node.expression.value)
    if isinstance(node, cst.SimpleString) and node.evaluated_value.strip().lstrip("-").isdigit():
        return int(node.evaluated_value)
    return None


def is_local_rank_test(node: cst.CSTNode) -> bool:
    """`local_rank == 0`, `args.local_rank in [-1, 0]`, `local_rank <= 0`: true on one process per
    *node*, so on a multi-node job these run several times."""
    if not isinstance(node, cst.Comparison) or len(node.comparisons) != 1:
        return False
    target = node.comparisons[0]
    op, left, right = target.operator, node.left, target.comparator
    if not _is_local_rank_expr(left):
        if _is_local_rank_expr(right) and isinstance(op, cst.Equal) and _int_value(left) == 0:
            return True
        return False
    if isinstance(op, cst.Equal):
        return _int_value(right) == 0
    if isinstance(op, cst.LessThanEqual):
        return _int_value(right) == 0
    if isinstance(op, cst.LessThan):
        return _int_value(right) == 1
    if isinstance(op, cst.In) and isinstance(right, (cst.List, cst.Tuple, cst.Set)):
        values = {_int_value(e.value) for e in right.elements}
        return values in ({0}, {-1, 0})
    return False


def _local_rank_parts(test: cst.BaseExpression) -> List[cst.CSTNode]:
    """The local-rank comparisons that decide `test` (alone, or as operands of `and`)."""
    if is_local_rank_test(test):
        return [test]
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _local_rank_parts(test.left) + _local_rank_parts(test.right)
    return []


def _guard_test(guard: cst.CSTNode) -> cst.CSTNode:
    """The test of a rank guard found by `rank_guard_of` (an `if`, a conditional expression,
    `test and ...`, or an early `if ...: return`)."""
    return guard.left if isinstance(guard, cst.BooleanOperation) else guard.test  # type: ignore[attr-defined]


def _per_node_test(guard: cst.CSTNode) -> Optional[cst.Comparison]:
    """The part of a guard that holds once per node, not once per job: `local_rank == 0`, or
    MoCo's and the ImageNet example's `args.rank % ngpus_per_node == 0`."""
    for n in iter_nodes(_guard_test(guard)):
        if not isinstance(n, cst.Comparison):
            continue
        left = n.left
        if is_local_rank_test(n) or (isinstance(left, cst.BinaryOperation) and isinstance(left.operator, cst.Modulo)
                                     and rank_word((dotted(left.left) or "").rsplit(".", 1)[-1])):
            return n
    return None


class SaveMainUnwrapped(Rule):
    """
    ## What it does
    Makes checkpoints be written by one process:

    - `torch.save(obj, path)` becomes `tm.save(obj, path)`: written on global rank 0 only,
      atomically (temp file + rename); no collective, so it is also safe inside rank guards.
      File operations on the checkpoint right after it (`shutil.copyfile(path, best)`, ...) go
      under `if tm.is_main():`.
    - A rank guard around a save that tests the *local* rank (`if args.local_rank == 0:`,
      `if local_rank in [-1, 0]:`) becomes `if tm.is_main():`; correct guards (`rank == 0`,
      `dist.get_rank() == 0`, `tm.is_main()`) are kept, and saves under them are left alone.
    - `model.save_pretrained(...)` / `tokenizer.save_pretrained(...)` and
      `torchvision.utils.save_image(...)` statements go under `if tm.is_main():` (not when
      their arguments run model or helper code, which must run on every rank: reported).

    `torch.save` into an in-memory buffer (`io.BytesIO`) is left alone: every rank reads it back;
    so is one into a temporary folder each process makes for itself (`with TemporaryDirectory() as
    tempdir:`, the best weights kept there and loaded back after training): every rank's own.
    Keys stay free of `module.` because TM302 saves `tm.unwrap(model).state_dict()`.

    ## Why is this bad?
    Every rank writing the same file races and can leave a corrupt checkpoint
    (pytorch/pytorch#12042); `local_rank == 0` is still true once per node, so a 4-node job
    writes 4 times to a shared filesystem (NVIDIA/apex#886). A file that is saved and then
    loaded again in the same run needs `tm.barrier()` between the two: added after an
    unconditional save, or before the load where only the load runs on every path (a save under
    `if args.train:` or a best-epoch test), reported otherwise (also when the file is written
    and read through `with open(path) as f`). A `torch.load` after the training loop of its function (the best
    checkpoint, saved during training by a helper elsewhere, reloaded for testing) gets
    `tm.barrier()` just before it, where every rank reaches it.

    In `lint` mode (distributed files) `torch.save` without a rank guard and local-rank guards
    around saves are reported.
    """

    code = "TM501"
    name = "save-main-unwrapped"
    summary = "Save checkpoints on the main process only (tm.save, global-rank guards)"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            torch.save({"model": model.state_dict(), "epoch": epoch}, path)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            tm.save({"model": model.state_dict(), "epoch": epoch}, path)
            """,
        ),
        Example(
            before="""
            import torch
            import torch.distributed as dist
            dist.init_process_group("nccl")
            if args.local_rank == 0:
                torch.save(model.module.state_dict(), path)
            """,
            after="""
            import torch
            import torch.distributed as dist
            import torchmigrate.runtime as tm
            dist.init_process_group("nccl")
            if tm.is_main():
                torch.save(model.module.state_dict(), path)
            """,
            mode="lint",
        ),
        Example(
            before="""
            import torch
            model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            if tm.is_main():
                model.save_pretrained(out_dir)
                tokenizer.save_pretrained(out_dir)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.local_guards: List[cst.If] = []

    def visit_If(self, node: cst.If) -> None:
        if _local_rank_parts(node.test):
            self.local_guards.append(node)

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        if ctx.options.migrating:
            self._reload_after_training()
        f = analysis.facts(ctx)
        tm = ctx.tm
        imports = [ctx.runtime_import()]
        saves = [(i, call) for i, (call, name) in enumerate(f.calls) if name in SAVES]
        torch_saves = [(i, call) for i, (call, name) in enumerate(f.calls) if name == "torch.save"]
        pretrained = [call for call, name in f.calls
                      if (isinstance(call.func, cst.Attribute) and call.func.attr.value == "save_pretrained")
                      or name in _IMAGE_WRITERS]
        if not saves and not pretrained:
            return

        # 1. local-rank guards around saves -> tm.is_main()
        save_functions: Set[str] = set()
        for _, call in saves:
            fn = ctx.enclosing(call, cst.FunctionDef)
            if fn is not None:
                save_functions.add(fn.name.value)
        guarded_targets = [call for _, call in saves] + pretrained
        if save_functions:
            for call, _ in f.calls:
                func = call.func
                if isinstance(func, cst.Name) and func.value in save_functions:
                    guarded_targets.append(call)
                elif isinstance(func, cst.Attribute) and func.attr.value in save_functions and dotted(func.value) in ("self", "cls"):
                    guarded_targets.append(call)
        fixed_guards: Set[cst.If] = set()
        if self.local_guards:
            guards = set(self.local_guards)
            for target in guarded_targets:
                child = target
                for anc in ctx.ancestors(target):
                    if isinstance(anc, cst.If) and anc in guards and child is anc.body and anc not in fixed_guards:
                        fixed_guards.add(anc)
                    if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                        break
                    child = anc
            for guard in self.local_guards:
                if guard not in fixed_guards:
                    continue
                edits = [replace(part, lambda _p: cached_expr(f"{tm}.is_main()")) for part in _local_rank_parts(guard.test)]
                self.report(guard.test, "`local_rank == 0` is true on one process per node, so a multi-node job "
                                        "saves several times; test the global rank with tm.is_main()",
                            edits=edits, imports=imports)

        # 2. torch.save -> tm.save (outside rank guards)
        file_op_blocks: Dict[cst.CSTNode, List[int]] = {}
        for index, call in torch_saves:
            if under_rank_guard(ctx, call):
                continue
            guards = caller_guards(ctx, call)
            per_node = [t for t in map(_per_node_test, guards or ()) if t is not None]
            if guards is not None and not per_node:
                continue  # a helper called only under global rank guards
            scope = scope_of(ctx, call)
            target = arg(call, "f", 1)
            if target is None or is_buffer(ctx, target.value, scope):
                continue
            if in_private_temp(ctx, call):
                continue  # a file in a TemporaryDirectory() each process made for itself: each rank's own
            is_handle, handle = file_handle(ctx, call, target.value)
            if is_handle and handle is not None and ctx.options.mode == "ddp" and save_through_handle(ctx, handle) \
                    and isinstance(ctx.parent(handle), (cst.IndentedBlock, cst.Module)):
                self._save_by_path(call, handle)
                self._reload_check(index, call, scope)
                continue
            if is_handle:
                self._guard_handle(call, handle)
                self._reload_check(index, call, scope, automatic=False)
                continue
            message = ("torch.save without a rank guard in a file that initialises a process group: every rank "
                       "writes the same file" if ctx.options.mode == "lint" else
                       "torch.save runs on every rank; tm.save writes once, on the main process, atomically")
            if per_node:
                message = (f"torch.save in a helper called under `{code(per_node[0])}`, which holds on one "
                           f"process per node: a multi-node job writes the file once per node; tm.save writes once, "
                           f"on global rank 0")
            edits = [replace(call.func, lambda _f: cached_expr(f"{tm}.save"))]
            align = keep_alignment(call, f"{tm}.save", 0 if isinstance(ctx.parent(call), cst.Expr) else None)
            if align is not None:
                edits.append(replace(call, align))
            self.report(call, message, edits=edits, imports=imports)
            stmt = ctx.statement_of(call)
            parent = ctx.parent(stmt) if stmt is not None else None
            if parent is not None and body_of(parent) is not None:
                file_op_blocks.setdefault(parent, []).append(index_in(body_of(parent), stmt))
            self._reload_check(index, call, scope)
        if file_op_blocks:
            self._guard_file_ops(file_op_blocks)

        # 3. save_pretrained -> if tm.is_main():
        lines = []
        for call in pretrained:
            if under_rank_guard(ctx, call) or not isinstance(ctx.parent(call), cst.Expr):
                continue
            line = guardable_line(ctx, call)
            what = code(call.func).rsplit(".", 1)[-1]
            if line is None:
                self.report(call, f"{what} runs on every rank: call it under `if {tm}.is_main():`")
                continue
            if runs_user_code(ctx, call):
                self.report(call, f"{what} runs on every rank, but its arguments run model or helper code that must "
                                  f"run on every rank: compute them first, then call it under `if {tm}.is_main():`")
                continue
            lines.append(line)
        for run in sibling_runs(ctx, lines):
            self.report(run[0], "every rank writes the same files; save on the main process only",
                        edits=[guard_edit(ctx, run)], imports=imports)

    def _save_by_path(self, call: cst.Call, handle: cst.With) -> None:
        """`with open(path, "wb") as f: torch.save(obj, f)` -> `tm.save(obj, path)`: written once,
        atomically, and a rank that then loads the path waits for that save (as for any path)."""
        ctx = self.ctx
        path = save_through_handle(ctx, handle)[1]
        tm = ctx.tm

        def by_path(updated: cst.With) -> cst.SimpleStatementLine:
            # from the updated block: the other rules' edits inside the save stay (`tm.unwrap(model)`)
            save = updated.body.body[0].body[0].value
            args = [save.args[0], save.args[1].with_changes(value=path.deep_clone()), *save.args[2:]]
            return cst.SimpleStatementLine([cst.Expr(save.with_changes(func=cached_expr(f"{tm}.save"), args=args))],
                                           leading_lines=updated.leading_lines)

        self.report(call, "the checkpoint file is opened and written by every rank; tm.save writes it once, on the "
                          "main process, atomically", edits=[replace(handle, by_path)], imports=[ctx.runtime_import()])

    def _guard_handle(self, call: cst.Call, handle: Optional[cst.With]) -> None:
        """`with open(p, "wb") as f: torch.save(obj, f)`: every rank would truncate the file."""
        ctx = self.ctx
        if handle is None or not isinstance(ctx.parent(handle), (cst.IndentedBlock, cst.Module)) \
                or runs_user_code(ctx, handle) or orphaned(ctx, [handle]):
            self.report(call, f"torch.save into a file opened on every rank: open and write it under "
                              f"`if {ctx.tm}.is_main():`")
            return
        self.report(call, "the checkpoint file is opened and written by every rank; write it on the main process only",
                    edits=[guard_edit(ctx, [handle])], imports=[ctx.runtime_import()])

    def _guard_file_ops(self, blocks: Dict[cst.CSTNode, List[int]]) -> None:
        """Guard statements after a `tm.save` in the same block that copy/move/remove files."""
        ctx = self.ctx
        lines = []
        for call, name in analysis.facts(ctx).calls:
            if name not in _FILE_OPS or under_rank_guard(ctx, call):
                continue
            if "TM504" in ctx.enabled and ctx.options.mode == "ddp" and private_temp_source(ctx, call):
                continue  # each rank's own temporary file moved into place: TM504's `tm.move_into_place`
            child = call
            for anc in ctx.ancestors(call):
                if anc in blocks:
                    body = body_of(anc)
                    i = index_in(body, child)
                    if any(i > s for s in blocks[anc]):
                        if runs_user_code(ctx, child):
                            self.report(call, f"only the main process writes the checkpoint now: run this file "
                                              f"operation under `if {ctx.tm}.is_main():`")
                        else:
                            lines.append(child)
                    break
                if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                    break
                child = anc
        for run in sibling_runs(ctx, lines):
            self.report(run[0], "file operation on a checkpoint that only the main process writes",
                        edits=[guard_edit(ctx, run)], imports=[ctx.runtime_import()])

    def _reload_after_training(self) -> None:
        """`torch.load(best_path)` after the training loop of the same function, the checkpoint
        having been saved during training by a helper (an `EarlyStopping`, a `save_checkpoint` of
        another module): only the main process writes it now, so every other rank may read it
        while it is still being written, or before it exists. A barrier before the load, where
        every rank reaches it (found on zhouhaoyi/Informer2020, kimiyoung/transformer-xl)."""
        ctx = self.ctx
        calls = analysis.facts(ctx).calls
        trained: Dict[cst.CSTNode, int] = {}  # scope -> index of its first training call
        for i, (call, name) in enumerate(calls):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "backward" and not call.args:
                trained.setdefault(scope_of(ctx, call), i)
        if not trained:
            return
        # A call of a function of this file that trains is training where it is called
        # (`for epoch in ...: train()` at module level, then the best model reloaded).
        for _ in range(2):
            training = {scope.name.value for scope in trained if isinstance(scope, cst.FunctionDef)}
            for i, (call, name) in enumerate(calls):
                func = call.func
                callee = func.value if isinstance(func, cst.Name) else (
                    func.attr.value if isinstance(func, cst.Attribute) and dotted(func.value) == "self" else None)
                if callee in training:
                    scope = scope_of(ctx, call)
                    trained[scope] = min(trained.get(scope, i), i)
        for i, (call, name) in enumerate(calls):
            if name not in LOADS and name != RUNTIME + ".load":
                continue
            scope = scope_of(ctx, call)
            start = trained.get(scope)
            if start is None and self._reload_in_callee(call, scope, calls, trained):
                continue
            if start is None or i < start:
                continue
            between = calls[start:i]
            if any(n and n.endswith(".barrier") and scope_of(ctx, c) is scope for c, n in between):
                continue  # already waited for
            first = arg(call, "f", 0)
            loaded = path_text(ctx, call, first.value) if first is not None else None
            if any(n in SAVES and scope_of(ctx, c) is scope and arg(c, "f", 1) is not None
                   and path_text(ctx, c, arg(c, "f", 1).value) == loaded for c, n in between):
                continue  # saved here under the same name: the save's own reload check waits for it
            line = ctx.statement_of(call)
            opened = with_binding(ctx, call, first.value.value) if first is not None and isinstance(
                first.value, cst.Name) else None
            if opened is not None and is_open(opened[1]):
                line = opened[0]  # `with open(best) as f: torch.load(f)`: wait before opening
            if collective_guard(ctx, call) is not None \
                    or not isinstance(line, (cst.SimpleStatementLine, cst.With)) \
                    or not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                    or not unconditional(ctx, line, scope):
                continue
            self.report(call, "every rank loads this file after training, but only the main process wrote it: "
                              "wait until it is complete",
                        edits=[insert_before(line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                        imports=[ctx.runtime_import()])

    def _save_line(self, save: cst.Call) -> cst.CSTNode:
        """The statement a barrier after `save` follows: its line, or the `with open(path, "wb")`
        that `_save_by_path` turns into one `tm.save(obj, path)` line."""
        ctx = self.ctx
        target = arg(save, "f", 1)
        bound = with_binding(ctx, save, target.value.value) if target is not None and isinstance(
            target.value, cst.Name) else None
        if bound is not None and ctx.options.mode == "ddp" and save_through_handle(ctx, bound[0]):
            return bound[0]
        return ctx.statement_of(save)

    def _load_line(self, call: cst.Call, first: cst.BaseExpression, scope: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement a barrier before the load `call` goes before: its own line, or the
        `with open(path) as f:` it reads through (a rank that opened the file before the barrier
        could read the previous save); None where not every rank reaches it."""
        ctx = self.ctx
        opened = with_binding(ctx, call, first.value) if isinstance(first, cst.Name) else None
        if opened is None or not is_open(opened[1]):
            return ctx.statement_of(call) if self._every_rank_reaches(call, scope) else None
        line = opened[0]
        if collective_guard(ctx, call) is None and isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                and unconditional(ctx, line, scope):
            return line
        return None

    def _every_rank_reaches(self, call: cst.Call, scope: cst.CSTNode) -> bool:
        """The line of `call` runs on every rank whenever its function runs (no `if`, `while`
        or `try` around it, no rank guard): a barrier right before it cannot hang."""
        ctx = self.ctx
        line = ctx.statement_of(call)
        return collective_guard(ctx, call) is None and isinstance(line, cst.SimpleStatementLine) \
            and isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) and unconditional(ctx, line, scope)

    def _reload_in_callee(self, load: cst.Call, scope: cst.CSTNode, calls, trained: Dict[cst.CSTNode, int]) -> bool:
        """The load sits in a function of this file that does not train (`test(config, model)`
        reloading the best checkpoint) and is called after the training of another function
        (`train()` ends with `test(...)`): the barrier goes before each such call, where every
        rank reaches it. True when the load was handled so."""
        ctx = self.ctx
        if not isinstance(scope, cst.FunctionDef) or ctx.enclosing(scope, cst.ClassDef) is not None:
            return False
        done = False
        for i, (call, _name) in enumerate(calls):
            if not (isinstance(call.func, cst.Name) and call.func.value == scope.name.value):
                continue
            caller = scope_of(ctx, call)
            start = trained.get(caller)
            line = ctx.statement_of(call)
            if start is None or i < start or not isinstance(line, cst.SimpleStatementLine) \
                    or not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                    or not unconditional(ctx, line, caller) or collective_guard(ctx, call) is not None:
                continue
            if any(n and n.endswith(".barrier") and scope_of(ctx, c) is caller for c, n in calls[start:i]):
                continue
            self.report(load, f"every rank loads this file in {scope.name.value}(), called after training, but only "
                              "the main process wrote it: wait until it is complete before the call",
                        edits=[insert_before(line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                        imports=[ctx.runtime_import()])
            done = True
        return done

    def _reload_check(self, index: int, save: cst.Call, scope: cst.CSTNode, automatic: bool = True) -> None:
        """A file saved and then loaded again in the same run: other ranks must wait for it. A
        path is matched by its text, also through `with open(path) as f` on either side; with
        `automatic` off (a save into an opened file, whose `with` gets a rank guard) the barrier
        is only reported."""
        ctx = self.ctx
        if plan(ctx).orders(ctx, save):
            return  # a cache built under main_process_first: complete before any rank reads it
        path = None  # the saved path's text, generated only once a load in this scope needs it
        for i, call, name in load_events(ctx):
            if i <= index:
                continue
            if name.endswith(".barrier"):
                return
            if scope_of(ctx, call) is scope:
                first = arg(call, "f", 0)
                if path is None and first is not None:
                    path = path_text(ctx, save, arg(save, "f", 1).value)
                if first is not None and path_text(ctx, call, first.value) == path:
                    line = self._save_line(save)
                    if automatic and collective_guard(ctx, save) is None \
                            and isinstance(line, (cst.SimpleStatementLine, cst.With)) \
                            and isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                            and unconditional(ctx, line, scope):
                        self.report(call, "this file is loaded again after the save, which only the main process "
                                          "does: wait for it on every rank",
                                    edits=[insert_after(line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                                    imports=[ctx.runtime_import()])
                    elif automatic and (load_line := self._load_line(call, first.value, scope)) is not None:
                        # the save is conditional (`if args.train:`, a best-epoch test): the
                        # barrier goes before the load (before the `with open(...)` it reads
                        # through), which every rank runs
                        self.report(call, "this file is loaded again after a save that only the main process does "
                                          "(on some paths): every rank waits for it before loading",
                                    edits=[insert_before(load_line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                                    imports=[ctx.runtime_import()])
                    else:
                        self.report(call, f"this file was just saved by the main process only: call "
                                          f"`{ctx.tm}.barrier()` after the save (on every rank) before loading it")
                    return

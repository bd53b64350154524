"""TM501 save-main-unwrapped, TM502 load-map-location: checkpoints written once, read anywhere.

Division of labour with TM302 (unwrap-attr): that rule rewrites `model.module` and the
`model.state_dict` / `model.load_state_dict` *functions* of wrapped models to `tm.unwrap(model)...`,
and a wrapped model saved whole (`torch.save(model, f)`, `{"net": net}`) to `tm.unwrap(model)`.
These rules never touch those nodes: TM501 edits the `torch.save` function, rank-guard tests
and whole statements; TM502 edits `torch.load` calls and the *argument* of `load_state_dict`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, replace
from torchmigrate.imports import dotted
from torchmigrate.nodes import arg, code, keep_alignment, set_kwarg
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules import downloads
from torchmigrate.rules.logging_rules import (
    RUNTIME, active, assignments, body_of, cached_expr, cached_stmt, caller_guards, collective_guard, guard_edit,
    guardable_line, index_in, iter_nodes, names_in, rank_word, runs_user_code, scope_of, sibling_runs, under_rank_guard,
)
from torchmigrate.rules.model.plan import wrapped_models

SAVES = {"torch.save", RUNTIME + ".save"}
_IMAGE_WRITERS = {"torchvision.utils.save_image"}
LOADS = {"torch.load"}
# File operations that, after `tm.save`, would run on ranks where the file was never written.
_FILE_OPS = {
    "shutil.copy", "shutil.copyfile", "shutil.copy2", "shutil.move", "os.rename", "os.replace",
    "os.remove", "os.unlink", "os.symlink", "os.link",
}
_BUFFER_FACTORIES = ("io.BytesIO", "io.StringIO", "tempfile.")
_BUFFER_NAMES = ("buf", "buffer", "bio", "stream", "bytes_io", "byte_io", "fobj")
_CONFIG_NAMES = {"args", "opt", "opts", "config", "cfg", "conf", "hparams", "hyperparams", "hp", "options",
                 "flags", "settings", "hyper_params", "train_args", "training_args", "params"}
_PLAIN_FACTORIES = ("dict", "vars", "asdict", "dataclasses.asdict", "OmegaConf.to_container", "copy.deepcopy")


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


def _dict_values(obj: cst.BaseExpression) -> List[cst.BaseExpression]:
    """The values of a `{...}` or `dict(k=v, ...)` expression; [] for anything else."""
    if isinstance(obj, cst.Dict):
        return [e.value for e in obj.elements if isinstance(e, cst.DictElement)]
    if isinstance(obj, cst.Call) and dotted(obj.func) == "dict":
        return [a.value for a in obj.args if a.keyword is not None]
    return []


def _bound_from(ctx: Context, name: str, scope: cst.CSTNode) -> List[cst.BaseExpression]:
    """Values assigned to a plain name in a scope."""
    return [a.value for a in assignments(ctx).get((scope, name), ())]


def _is_buffer(ctx: Context, target: cst.BaseExpression, scope: cst.CSTNode) -> bool:
    """`torch.save(obj, buf)` into an in-memory or temporary file object that the process reads back."""
    candidates = [target]
    if isinstance(target, cst.Name):
        if any(b in target.value.lower() for b in _BUFFER_NAMES):
            return True
        candidates += _bound_from(ctx, target.value, scope)
        for anc in ctx.ancestors(target):  # `with tempfile.TemporaryFile() as f:`
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
            for n in anc.items if isinstance(anc, cst.With) else ():
                if n.asname is not None and isinstance(n.asname.name, cst.Name) \
                        and n.asname.name.value == target.value and isinstance(n.item, cst.Call) \
                        and (dotted(n.item.func) or "").split(".")[-1] != "open":
                    return True
    for c in candidates:
        if isinstance(c, cst.Call):
            name = ctx.resolve(c.func) or dotted(c.func) or ""
            if name.startswith(_BUFFER_FACTORIES) or name.endswith(("BytesIO", "StringIO")):
                return True
    return False




def _file_handle(ctx: Context, call: cst.Call, target: cst.BaseExpression) -> Tuple[bool, Optional[cst.With]]:
    """For `torch.save(obj, f)` into a file object opened in this file: (True, the
    `with open(...) as f:` statement, or None when the file is opened elsewhere); (False, None)
    for a path."""
    if isinstance(target, cst.Call):
        name = ctx.resolve(target.func) or dotted(target.func) or ""
        return (name.split(".")[-1] == "open", None)
    if not isinstance(target, cst.Name):
        return False, None
    bound = _with_binding(ctx, call, target.value)
    if bound is not None:
        statement, value = bound
        return (True, statement) if _is_open(value) else (False, None)
    for value in _bound_from(ctx, target.value, scope_of(ctx, call)):
        if _is_open(value):
            return True, None
    return False, None


def _with_binding(ctx: Context, call: cst.Call, name: str) -> Optional[Tuple[cst.With, cst.BaseExpression]]:
    """The innermost `with <value> as name:` around `call` in its function: (statement, value)."""
    for anc in ctx.ancestors(call):
        if isinstance(anc, cst.With):
            for item in anc.items:
                if item.asname is not None and isinstance(item.asname.name, cst.Name) \
                        and item.asname.name.value == name:
                    return anc, item.item
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            break
    return None


def _is_open(node: cst.BaseExpression) -> bool:
    """`open(...)` (any spelling ending in `open`)."""
    return isinstance(node, cst.Call) and (dotted(node.func) or "").split(".")[-1] == "open"


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

    `torch.save` into an in-memory buffer (`io.BytesIO`) is left alone: every rank reads it back.
    Keys stay free of `module.` because TM302 saves `tm.unwrap(model).state_dict()`.

    ## Why is this bad?
    Every rank writing the same file races and can leave a corrupt checkpoint
    (pytorch/pytorch#12042); `local_rank == 0` is still true once per node, so a 4-node job
    writes 4 times to a shared filesystem (NVIDIA/apex#886). A file that is saved and then
    loaded again in the same run needs `tm.barrier()` between the two: added after an
    unconditional save, reported otherwise (also when the file is written and read through
    `with open(path) as f`). A `torch.load` after the training loop of its function (the best
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
            if target is None or _is_buffer(ctx, target.value, scope):
                continue
            is_handle, handle = _file_handle(ctx, call, target.value)
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

    def _guard_handle(self, call: cst.Call, handle: Optional[cst.With]) -> None:
        """`with open(p, "wb") as f: torch.save(obj, f)`: every rank would truncate the file."""
        ctx = self.ctx
        if handle is None or not isinstance(ctx.parent(handle), (cst.IndentedBlock, cst.Module)) \
                or runs_user_code(ctx, handle):
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
            loaded = _path_text(ctx, call, first.value) if first is not None else None
            if any(n in SAVES and scope_of(ctx, c) is scope and arg(c, "f", 1) is not None
                   and _path_text(ctx, c, arg(c, "f", 1).value) == loaded for c, n in between):
                continue  # saved here under the same name: the save's own reload check waits for it
            line = ctx.statement_of(call)
            opened = _with_binding(ctx, call, first.value.value) if first is not None and isinstance(
                first.value, cst.Name) else None
            if opened is not None and _is_open(opened[1]):
                line = opened[0]  # `with open(best) as f: torch.load(f)`: wait before opening
            if collective_guard(ctx, call) is not None \
                    or not isinstance(line, (cst.SimpleStatementLine, cst.With)) \
                    or not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                    or not _unconditional(ctx, line, scope):
                continue
            self.report(call, "every rank loads this file after training, but only the main process wrote it: "
                              "wait until it is complete",
                        edits=[insert_before(line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                        imports=[ctx.runtime_import()])

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
                    or not _unconditional(ctx, line, caller) or collective_guard(ctx, call) is not None:
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
        if downloads.plan(ctx).orders(ctx, save):
            return  # a cache built under main_process_first: complete before any rank reads it
        path = None  # the saved path's text, generated only once a load in this scope needs it
        events = ctx.facts.get("tm_load_events")
        if events is None:
            events = [(i, call, name) for i, (call, name) in enumerate(analysis.facts(ctx).calls)
                      if name and (name.endswith(".barrier") or name in LOADS or name == RUNTIME + ".load")]
            ctx.facts["tm_load_events"] = events
        for i, call, name in events:
            if i <= index:
                continue
            if name.endswith(".barrier"):
                return
            if scope_of(ctx, call) is scope:
                first = arg(call, "f", 0)
                if path is None and first is not None:
                    path = _path_text(ctx, save, arg(save, "f", 1).value)
                if first is not None and _path_text(ctx, call, first.value) == path:
                    line = ctx.statement_of(save)
                    if automatic and collective_guard(ctx, save) is None and isinstance(line, cst.SimpleStatementLine) \
                            and isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)) \
                            and _unconditional(ctx, line, scope):
                        self.report(call, "this file is loaded again after the save, which only the main process "
                                          "does: wait for it on every rank",
                                    edits=[insert_after(line, [cached_stmt(f"{ctx.tm}.barrier()")])],
                                    imports=[ctx.runtime_import()])
                    else:
                        self.report(call, f"this file was just saved by the main process only: call "
                                          f"`{ctx.tm}.barrier()` after the save (on every rank) before loading it")
                    return


def _path_text(ctx: Context, call: cst.Call, file: cst.BaseExpression) -> str:
    """The text of the path a save or load call writes or reads: `p` for a file object from
    `with open(p, ...) as f:` around the call or for `open(p, ...)` itself, else the argument."""
    bound = _with_binding(ctx, call, file.value) if isinstance(file, cst.Name) else None
    opened = bound[1] if bound is not None else file
    if _is_open(opened) and opened.args:
        return code(opened.args[0].value)
    return code(file)


def _unconditional(ctx: Context, line: cst.CSTNode, scope: cst.CSTNode) -> bool:
    """`line` runs whenever its function does (only `for`/`with` blocks around it): a barrier
    there is reached by every rank. Under `if acc > best:` ranks may disagree and hang."""
    for anc in ctx.ancestors(line):
        if anc is scope:
            return True
        if isinstance(anc, (cst.If, cst.While, cst.Try, cst.TryStar, cst.ExceptHandler, cst.Match)):
            return False
    return True


# --- TM502 ---------------------------------------------------------------------------------

_MOVES = ("to", "cuda", "cpu", "load_state_dict")


class LoadMapLocation(Rule):
    """
    ## What it does
    - `torch.load(path)` without `map_location` gets `map_location="cpu"` when what it loads
      goes into `load_state_dict(...)` or is moved with `.to(...)`/`.cuda()` (a positional or
      keyword `map_location` is kept). For other loads (tensors or whole objects used as
      loaded) the same fix is offered as unsafe: the tensors end up on the CPU.
    - `model.load_state_dict(sd)` for a trained (DDP-wrapped) model loads
      `tm.strip_prefix(sd)`, which drops `module.` / `_orig_mod.` key prefixes written by
      `nn.DataParallel`, DDP or `torch.compile` models (TM302 turns `model.load_state_dict`
      into `tm.unwrap(model).load_state_dict`).
    - `weights_only` is never changed. When this file saves non-tensor objects in its
      checkpoints (`args`, a config object, a whole model), a note says that `torch.load`
      defaults to `weights_only=True` since torch 2.6 and raises `UnpicklingError` on them.

    ## Why is this bad?
    Without `map_location`, tensors saved from `cuda:0` are loaded onto `cuda:0` by every rank:
    rank 0's GPU runs out of memory, the other ranks get tensors on the wrong device
    (pytorch/pytorch#23138). Checkpoints written from a wrapped model carry `module.` prefixes
    that a plain model refuses ("Missing key(s) in state_dict").

    In `lint` mode (distributed files) `torch.load` without `map_location` is reported.
    """

    code = "TM502"
    name = "load-map-location"
    summary = "Load checkpoints to the CPU and tolerate module./_orig_mod. prefixes"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt = torch.load(args.resume)
            model.load_state_dict(ckpt["model"])
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt = torch.load(args.resume, map_location="cpu")
            model.load_state_dict(tm.strip_prefix(ckpt["model"]))
            """,
        ),
        Example(
            before="""
            import torch
            state = torch.load(path, "cpu")
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        f = analysis.facts(ctx)
        loads = [call for call, name in f.calls if name in LOADS]
        lsd = [call for call, _ in f.calls
               if isinstance(call.func, cst.Attribute) and call.func.attr.value == "load_state_dict"]
        non_tensor = None
        for call in loads:
            if any(a.star == "**" for a in call.args):
                continue
            feeds = self._feeds_state_dict(call, lsd)
            if arg(call, "map_location", 1) is None and arg(call, "f", 0) is not None \
                    and not self._placed_in_other_branch(call, loads):
                fix = replace(call, lambda c: set_kwarg(c, "map_location", cached_expr('"cpu"')))
                if feeds:
                    self.report(call, "torch.load without map_location loads GPU-saved tensors onto the device "
                                      "they were saved from (cuda:0) on every rank; load to the CPU",
                                edits=[fix])
                else:
                    self.report(call, "torch.load without map_location: every rank loads GPU-saved tensors onto "
                                      "cuda:0. Add map_location=\"cpu\" (then move what you use to tm.device()) "
                                      "or map_location=tm.device()",
                                edits=[fix], safety=Safety.UNSAFE)
            if feeds and arg(call, "weights_only") is None:
                if non_tensor is None:
                    non_tensor = self._non_tensor_saved()
                if non_tensor:
                    names = ", ".join(f"`{n}`" for n in non_tensor)
                    self.report(call, f"this file's checkpoints hold non-tensor objects ({names}); torch.load "
                                      f"defaults to weights_only=True since torch 2.6 and then raises "
                                      f"UnpicklingError: pass weights_only=False for files you trust, or save "
                                      f"plain values (e.g. vars(args))")
        if ctx.options.mode == "ddp":
            self._strip_prefix(lsd)

    def _strip_prefix(self, lsd: List[cst.Call]) -> None:
        ctx = self.ctx
        models = set(analysis.trained_models(ctx))
        wrapped = ctx.facts.get("wrapped_models")
        if wrapped is None:
            try:  # computed by the model rules; optional
                wrapped = wrapped_models(ctx)
            except Exception:  # noqa: BLE001
                wrapped = ()
        wrapped = wrapped or ()
        if isinstance(wrapped, dict):
            wrapped = wrapped.keys()
        for w in wrapped:
            name = w if isinstance(w, str) else getattr(w, "name", None)
            if isinstance(name, str):
                models.add(analysis.model_root(name))
        if not models or self._own_module_attribute():
            return
        tm = ctx.tm
        for call in lsd:
            owner = call.func.value
            if isinstance(owner, cst.Call) and ctx.resolve(owner.func) == RUNTIME + ".unwrap" and owner.args:
                owner = owner.args[0].value
            name = dotted(owner)
            if name is None or analysis.model_root(name) not in models:
                continue
            a = arg(call, "state_dict", 0)
            if a is None or a.star:
                continue
            value = a.value
            if isinstance(value, cst.Call) and ctx.resolve(value.func) in (RUNTIME + ".strip_prefix",):
                continue

            def fix(node: cst.Arg) -> cst.Arg:
                return node.with_changes(value=cst.Call(func=cached_expr(f"{tm}.strip_prefix"), args=[cst.Arg(value=node.value)]))

            self.report(a.value, "checkpoints from DataParallel/DDP/compiled models carry `module.`/`_orig_mod.` "
                                 "key prefixes; tm.strip_prefix loads them into the plain model",
                        edits=[replace(a, fix)], imports=[ctx.runtime_import()])

    def _placed_in_other_branch(self, call: cst.Call, loads: List[cst.Call]) -> bool:
        """`if args.gpu is None: torch.load(p)` / `else: torch.load(p, map_location=loc)` (the
        ImageNet example, MoCo): the script places the load itself where it runs one process
        per GPU; the branch without map_location is its single-process (DataParallel) path.
        Only for code that is distributed already: a migration runs that branch under torchrun."""
        if self.ctx.options.mode != "lint":
            return False
        statement = self.ctx.statement_of(call)
        branch = self.ctx.parent(statement)
        test_if = self.ctx.parent(branch)
        if isinstance(test_if, cst.Else):
            branch, test_if = test_if, self.ctx.parent(test_if)
        if not isinstance(test_if, cst.If) or test_if.orelse is None:
            return False
        other = test_if.orelse if branch is test_if.body else test_if.body
        return any(arg(c, "map_location", 1) is not None and any(a is other for a in self.ctx.ancestors(c))
                   for c in loads)

    def _own_module_attribute(self) -> bool:
        """A class of this file sets `self.module = ...` (or `_orig_mod`): its parameters
        legitimately start with `module.`, so stripping prefixes could drop real key parts."""
        for assign in analysis.facts(self.ctx).assigns:
            for t in assign.targets:
                if dotted(t.target) in ("self.module", "self._orig_mod"):
                    return True
        return False

    def _feeds_state_dict(self, call: cst.Call, lsd: List[cst.Call]) -> bool:
        """The loaded object goes into `load_state_dict(...)` or is moved with `.to()`/`.cuda()`."""
        ctx = self.ctx
        target: Optional[str] = None
        for anc in ctx.ancestors(call):
            if isinstance(anc, cst.Call) and isinstance(anc.func, cst.Attribute) and anc.func.attr.value in _MOVES:
                return True
            if isinstance(anc, cst.Assign):
                if len(anc.targets) == 1 and isinstance(anc.targets[0].target, cst.Name):
                    target = anc.targets[0].target.value
                break
            if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
                break
        if target is None:
            return False
        scope = scope_of(ctx, call)
        tracked = {target}
        assigns = assignments(ctx).get((scope, None), ())
        for _ in range(2):
            for a in assigns:
                if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and names_in(ctx, a.value) & tracked:
                    tracked.add(a.targets[0].target.value)
        for other in lsd:
            if any(names_in(ctx, x.value) & tracked for x in other.args) and scope_of(ctx, other) is scope:
                return True
        for c in self._moves():
            if c.func.value.value in tracked and scope_of(ctx, c) is scope:
                return True
        return False

    def _moves(self) -> List[cst.Call]:
        """`name.to(...)` / `name.cuda()` calls of the file."""
        found = self.ctx.facts.get("tm_moves")
        if found is None:
            found = [c for c, _ in analysis.facts(self.ctx).calls
                     if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("to", "cuda")
                     and isinstance(c.func.value, cst.Name)]
            self.ctx.facts["tm_moves"] = found
        return found  # type: ignore[return-value]

    def _non_tensor_saved(self) -> List[str]:
        """Names of non-tensor objects (argparse/config objects, whole modules or optimizers) that
        this file puts into its checkpoints."""
        ctx = self.ctx
        f = analysis.facts(ctx)
        models = set(analysis.trained_models(ctx))
        optimizers = {o.target for o in analysis.optimizers(ctx) if o.target}
        found: List[str] = []

        def plain(name: str) -> bool:
            for a in (x for (_, n), xs in assignments(ctx).items() if n == name for x in xs):
                for t in a.targets:
                    if isinstance(t.target, cst.Name) and t.target.value == name:
                        v = a.value
                        if isinstance(v, (cst.Dict, cst.DictComp, cst.List, cst.Tuple, cst.SimpleString,
                                          cst.Integer, cst.Float)):
                            return True
                        if isinstance(v, cst.Call) and (dotted(v.func) or "").endswith(_PLAIN_FACTORIES):
                            return True
            return False

        def check(value: cst.BaseExpression) -> None:
            name = dotted(value)
            if name is None:
                return
            last = name.rsplit(".", 1)[-1]
            if last.lower() in _CONFIG_NAMES and not plain(name):
                label = name
            elif name in models or name in optimizers:
                label = name
            else:
                return
            if label not in found:
                found.append(label)

        def values_of(obj: cst.BaseExpression, scope: cst.CSTNode) -> List[cst.BaseExpression]:
            if not isinstance(obj, cst.Name):
                return _dict_values(obj)
            out: List[cst.BaseExpression] = []
            for v in _bound_from(ctx, obj.value, scope):
                out += _dict_values(v)
            for a in subscript_assigns.get(obj.value, ()):
                out.append(a.value)
            return out

        subscript_assigns: Dict[str, List[cst.Assign]] = {}
        for a in f.assigns:
            for t in a.targets:
                if isinstance(t.target, cst.Subscript):
                    key = dotted(t.target.value)
                    if key:
                        subscript_assigns.setdefault(key, []).append(a)
        for call, name in f.calls:
            if name not in SAVES or not call.args:
                continue
            obj = call.args[0].value
            if isinstance(obj, cst.Name) and (obj.value in models or obj.value in optimizers):
                check(obj)
                continue
            for v in values_of(obj, scope_of(ctx, call)):
                check(v)
        return found

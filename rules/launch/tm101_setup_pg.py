"""TM101 setup-pg: `tm.setup()`/`tm.cleanup()` at the program's entry point, legacy launch code
onto the runtime, and checks of the process group a script creates itself."""

from __future__ import annotations

from typing import List, Sequence

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, replace, replace_with, wrap
from torchmigrate.syntax.nodes import arg, code, expr, kwarg, stmt, with_args
from torchmigrate.program.loaders import DIST_SAMPLERS
from torchmigrate.program.rank_guards import rank_guard_of
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules._guards import guardable_line
from torchmigrate.rules.launch.base import DESTROY_PG, INIT_PG, SPAWN, ends_process
from torchmigrate.rules.launch.plan import behind_if, entry_plan, legacy_inits, legacy_launch, plain_init, setup_plan

BARRIERS = ("torch.distributed.barrier", "torchmigrate.runtime.barrier", "torchmigrate.runtime.cleanup")
# Calls that need a process group and have a runtime twin that also works without one.
_GROUP_QUERIES = {"torch.distributed.get_rank": "rank", "torch.distributed.get_world_size": "world_size",
                  "torch.distributed.barrier": "barrier", DESTROY_PG: "cleanup"}
# In-place collectives that change nothing on a single rank: a one-process run can skip them.
_ONE_RANK_NOOPS = tuple(f"torch.distributed.{n}" for n in ("all_reduce", "broadcast", "reduce"))


def _is_exit(ctx: Context, node: cst.CSTNode) -> bool:
    """`sys.exit(...)`, `exit()`, `quit()`, `os._exit(...)` or `raise SystemExit(...)` anywhere in node."""
    if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
        return False
    for n in ctx.within(node, cst.Call, cst.Raise, skip_defs=True):
        if isinstance(n, cst.Call):
            if ends_process(ctx, n):
                return True
        elif n.exc is not None:
            target = n.exc.func if isinstance(n.exc, cst.Call) else n.exc
            if isinstance(target, cst.Name) and target.value == "SystemExit":
                return True
    return False


def _is_barrier(ctx: Context, statement: cst.CSTNode) -> bool:
    """A statement line that is just a call to a barrier (`dist.barrier()`, `tm.barrier()`)."""
    if not (isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1):
        return False
    small = statement.body[0]
    return isinstance(small, cst.Expr) and isinstance(small.value, cst.Call) \
        and ctx.resolve(small.value.func) in BARRIERS


def _has_call(node: cst.CSTNode) -> bool:
    if isinstance(node, (cst.Call, cst.Await)):
        return True
    return any(_has_call(child) for child in node.children)


def _may_exit(ctx: Context, node: cst.CSTNode) -> bool:
    """`_is_exit`, also through the functions of this file that `node` calls, three calls deep
    (`if __name__ == "__main__": train()` where `train` ends the run with `sys.exit()`): the
    cleanup then goes in a `finally`, or it would never run."""
    return _is_exit(ctx, node) or _calls_exiting_function(ctx, node, 3)


def _calls_exiting_function(ctx: Context, node: cst.CSTNode, depth: int) -> bool:
    functions = analysis.facts(ctx).functions
    if not functions:
        return False
    memo = ctx.facts.setdefault("launch.exiting_functions", {})  # (id(function), depth) -> bool
    for call in ctx.within(node, cst.Call, skip_defs=True):
        fn = functions.get(call.func.value) if type(call.func) is cst.Name else None
        if fn is None or fn is node:
            continue
        key = (id(fn), depth)
        if key not in memo:
            memo[key] = False  # a recursive function asks for itself: not (yet) exiting
            memo[key] = _is_exit(ctx, fn.body) or (depth > 1 and _calls_exiting_function(ctx, fn.body, depth - 1))
        if memo[key]:
            return True
    return False


def _plain_exit(ctx: Context, stmt_: cst.CSTNode) -> bool:
    """`sys.exit(0)` / `raise SystemExit(code)`: an exit whose argument runs nothing, so cleanup
    can simply go before it."""
    if not (isinstance(stmt_, cst.SimpleStatementLine) and len(stmt_.body) == 1 and _is_exit(ctx, stmt_)):
        return False
    small = stmt_.body[0]
    if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
        return not any(_has_call(a.value) for a in small.value.args)
    if isinstance(small, cst.Raise) and small.exc is not None:
        exc = small.exc
        return not isinstance(exc, cst.Call) or not any(_has_call(a.value) for a in exc.args)
    return False


def _try_finally(body: Sequence[cst.BaseStatement], final: cst.BaseStatement) -> cst.Try:
    body = list(body)
    return cst.Try(body=cst.IndentedBlock(body=body),
                   finalbody=cst.Finally(body=cst.IndentedBlock(body=[final])))


def _lift_leading_lines(stmts: List[cst.BaseStatement], wrapper: cst.BaseStatement) -> cst.BaseStatement:
    """Comments above the first wrapped statement move above the wrapper."""
    lead = getattr(stmts[0], "leading_lines", ())
    if lead:
        stmts[0] = stmts[0].with_changes(leading_lines=[])
        wrapper = wrapper.with_changes(body=wrapper.body.with_changes(body=stmts), leading_lines=list(lead))
    return wrapper


class SetupProcessGroup(Rule):
    """
    ## What it does
    Inserts `tm.setup()` at the program's entry point and `tm.cleanup()` at its end: as the
    first and last statements of the `if __name__ == "__main__":` block or, in a top-level
    script, after the first block of top-level imports (next to the runtime import; later
    imports may follow code that already uses the runtime) and at the end of the module. When a
    script with a `__main__` block builds its model or optimizer (or moves tensors to the
    device) at module level, setup goes after that first import block instead, so it runs
    before that code, and cleanup
    stays at the end of the block. When the entry block leaves through `sys.exit(main())` /
    `raise SystemExit(main())`, or calls a function of the file that exits (`train()` ending in
    `sys.exit()`), it is wrapped in `try: ... finally: tm.cleanup()`; a plain `sys.exit(0)`
    simply gets the cleanup before it. A script that creates a process group itself (or wraps
    a model in DDP) gets no setup; a `DistributedSampler` alone does not count.

    `tm.setup()` reads torchrun's (or SLURM's) environment: with `LOCAL_RANK` set it pins the
    process to its GPU (`torch.cuda.set_device`) and, when the world size is above one, creates
    the process group (nccl with CUDA, else gloo). Run as `python train.py` it creates nothing,
    so the migrated script still runs as one process.

    Files that already call `init_process_group`/`tm.setup` (or use DDP/`DistributedSampler`,
    or call an `init_distributed_mode()`-style helper) get no setup of their own; library
    modules without a `__main__` block or top-level training code get nothing. `mp.spawn`
    launchers are reported: torchrun starts the processes itself.

    Legacy scripts are moved onto the runtime like single-GPU ones (`ddp` only): a script
    that creates its own group and was written for `torch.distributed.launch` (a
    `--local_rank` option) or creates it only behind an `if` (`if args.distributed:`,
    `if args.local_rank != -1:`). Its `init_process_group(...)` becomes `tm.setup()`,
    `destroy_process_group()` becomes `tm.cleanup()` (a script without one gets `tm.cleanup()`
    at the end of its entry point), `dist.get_rank()` / `get_world_size()` / `barrier()` become
    `tm.rank()` / `tm.world_size()` / `tm.barrier()`, a `DistributedSampler` gets
    `num_replicas=tm.world_size(), rank=tm.rank()` (so it and its `set_epoch` also work in one
    process), and an in-place `dist.all_reduce(t)` (`broadcast`, `reduce`) behind no `if` goes
    under `if tm.is_distributed():`. TM103 and TM301 move its devices and its DDP. The script
    then runs as `python train.py`, under torchrun on GPUs and on CPU ranks (gloo). An init
    given ranks, world sizes or a tcp:// address of the script's own is reported instead, and
    nothing else of the file is moved. `lint` treats such scripts as the distributed code they
    are.

    In `lint` (distributed files) it reports `mp.spawn` launchers and `init_process_group`
    calls with hard-coded `rank=`/`world_size=` numbers or a `tcp://`/`file://` `init_method`
    literal, which ignore the environment torchrun sets. An unconditional
    `init_process_group()` is not reported: scripts meant only for torchrun rightly call it.

    In files that manage their own process group, a `destroy_process_group()` with no barrier
    just before it gets `tm.barrier()` first (fixed by `ddp` and `lint --fix`), except in
    `except`/`finally` blocks and under rank-dependent `if`s, where not every rank arrives.

    ## Why is this bad?
    DistributedDataParallel, `DistributedSampler` and every collective need an initialised
    process group, and under torchrun each process must use its own GPU. A bare
    `init_process_group()` fails when the script runs without torchrun ("environment variable
    RANK expected, but not set"); `tm.setup()` works both ways. A rank that destroys the group
    while another is still saving can make gloo abort it at exit ("terminate called without
    an active exception"), and torchrun then reports the finished job as failed (3 of 16 runs
    of a two-rank CPU script without the barrier, 0 of 16 with it).

    ## Example
    ```python
    if __name__ == "__main__":
        args = parser.parse_args()
        main(args)
    ```
    becomes
    ```python
    import torchmigrate.runtime as tm
    if __name__ == "__main__":
        tm.setup()
        args = parser.parse_args()
        main(args)
        tm.cleanup()
    ```

    ## Limitations
    Only the first module-level `__main__` guard is used. A script whose entry point lives in
    another module (e.g. `from pkg import cli; cli.main()` in a library module) needs the call
    added by hand.
    A legacy script built for NCCL stops with "Torch not compiled with CUDA enabled" or
    "ProcessGroupNCCL is only supported with GPUs" on a CPU machine, and with "environment
    variable RANK expected" as `python train.py`: it cannot be smoke-tested in CI.
    """

    code = "TM101"
    name = "setup-pg"
    summary = "Set up (and tear down) the process group at the program's entry point"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch

            if __name__ == "__main__":
                args = parser.parse_args()
                main(args, device="cuda")
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm

            if __name__ == "__main__":
                tm.setup()
                args = parser.parse_args()
                main(args, device="cuda")
                tm.cleanup()
            """,
        ),
        Example(
            before="""
            import sys
            import torch

            if __name__ == "__main__":
                sys.exit(main(torch.device("cuda")))
            """,
            after="""
            import sys
            import torch
            import torchmigrate.runtime as tm

            if __name__ == "__main__":
                tm.setup()
                try:
                    sys.exit(main(torch.device("cuda")))
                finally:
                    tm.cleanup()
            """,
        ),
        Example(
            before="""
            import argparse
            import torch.distributed as dist

            def main(args):
                dist.init_process_group("nccl")
                if dist.get_rank() == 0:
                    print("processes:", dist.get_world_size())

            if __name__ == "__main__":
                parser = argparse.ArgumentParser()
                parser.add_argument("--local_rank", type=int, default=0)
                main(parser.parse_args())
            """,
            after="""
            import argparse
            import torch.distributed as dist
            import torchmigrate.runtime as tm

            def main(args):
                tm.setup()
                if tm.rank() == 0:
                    print("processes:", tm.world_size())

            if __name__ == "__main__":
                parser = argparse.ArgumentParser()
                parser.add_argument("--local_rank", type=int, default=0)
                main(parser.parse_args())
                tm.cleanup()
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        distributed = analysis.is_distributed(ctx)
        for call in analysis.calls_to(ctx, *SPAWN):
            if ctx.options.migrating or distributed:
                self.report(call, "mp.spawn launcher: torchrun starts one process per GPU itself; call the "
                                  "worker once per process (rank from the LOCAL_RANK/RANK environment, "
                                  "e.g. tm.local_rank()) and launch with `torchrun --nproc-per-node=N`")
        if legacy_launch(ctx):
            self._onto_runtime()
            return
        for call in legacy_inits(ctx):
            if not plain_init(ctx, call):
                self.report(call, "this script sets up its own process group with a rank, world size or address "
                                  "it computes: `ddp` leaves its launch code as it is, so it still needs CUDA and its "
                                  f"own launcher; to run it with torchrun, as `python train.py` and on CPU ranks, use "
                                  f"`{ctx.tm}.setup()` (rank and world size from torchrun's environment) and "
                                  f"`{ctx.tm}.wrap_model(model)` for its DDP")
        if distributed:
            for call in analysis.calls_to(ctx, INIT_PG):
                self._check_init(call)
            for call in analysis.calls_to(ctx, DESTROY_PG):
                self._check_destroy(call)
        if not ctx.options.migrating:
            return
        plan = setup_plan(ctx)
        if plan is None:
            return
        tm = ctx.tm
        message = f"insert {tm}.setup()/{tm}.cleanup() so the script runs under torchrun (process group, one GPU per process)"
        if not ctx.program.program_devices:
            message = (f"insert {tm}.setup(device=\"cpu\")/{tm}.cleanup() so the script runs under torchrun: the "
                       "program names no device anywhere, so it builds its model and every tensor on the CPU, and "
                       "each rank stays there (gloo), as its one process did; to train on GPUs, move the model and "
                       f"the batches to `{tm}.device()` and drop `device=\"cpu\"`")
        if plan.kind == "main-guard":
            guard = plan.guard
            edits = [replace(guard, lambda g: self._fix_guard(g, plan.setup_in_guard))]
            if plan.setup_after is not None:
                edits.append(insert_after(plan.setup_after, [self._setup()]))
            elif plan.setup_before is not None:
                edits.append(insert_before(plan.setup_before, [self._setup()]))
            self.report(guard, message, edits=edits, imports=[ctx.runtime_import()])
            return
        entry = plan.entry
        edits = []
        setup = self._setup()
        if entry.setup_after is not None:
            edits.append(insert_after(entry.setup_after, [setup]))
        else:
            edits.append(insert_before(entry.setup_before, [setup]))
        edits.append(self._cleanup_edit(entry))
        self.report(entry.setup_after or entry.setup_before, message, edits=edits, imports=[ctx.runtime_import()])

    def _setup(self) -> cst.SimpleStatementLine:
        """`tm.setup()`, or `tm.setup(device="cpu")` for a program that names no device anywhere
        (`program.devices`): its tensors are all made on the CPU, so its ranks must stay there
        even on a GPU host, where `tm.device()` would otherwise be the rank's GPU."""
        if self.ctx.program.program_devices:
            return stmt(f"{self.ctx.tm}.setup()")
        return stmt(f'{self.ctx.tm}.setup(device="cpu")')

    def _cleanup_edit(self, entry: analysis.Entry):
        """`tm.cleanup()` after the last statement of a top-level script (before its plain exit,
        or in a `finally` around an exit that runs code)."""
        ctx = self.ctx
        last = entry.cleanup_after
        cleanup = stmt(f"{ctx.tm}.cleanup()")
        if _plain_exit(ctx, last) and last is not entry.setup_before:
            return insert_before(last, [cleanup])
        if _may_exit(ctx, last) and last is not entry.setup_before:
            return wrap(last, last, lambda body: _lift_leading_lines(list(body), _try_finally(body, cleanup)))
        return insert_after(last, [cleanup])

    def _onto_runtime(self) -> None:
        """A legacy script (`legacy_launch`): the calls that need its process group become the
        runtime's, which also work in one process (no group) and on CPU ranks (gloo)."""
        ctx = self.ctx
        tm = ctx.tm
        imports = [ctx.runtime_import()]
        for call in analysis.calls_to(ctx, INIT_PG):
            self.report(call, f"the script creates its own process group, which fails without torchrun or without "
                              f"CUDA (nccl): `{tm}.setup()` creates it under torchrun (nccl with GPUs, gloo without) "
                              "and pins the process's GPU; in a one-process run it creates none",
                        edits=[replace_with(call, expr(f"{tm}.setup()"))], imports=imports)
        for call in analysis.calls_to(ctx, *_GROUP_QUERIES):
            helper = _GROUP_QUERIES[ctx.resolve(call.func)]
            if call.args and not (helper == "barrier" and all(
                    a.keyword is not None and a.keyword.value == "device_ids" for a in call.args)):
                continue  # another group (or a barrier that says more): the user's
            self.report(call, f"`{code(call.func)}()` needs the process group, which a one-process run does not "
                              f"have: `{tm}.{helper}()` works in both",
                        edits=[replace_with(call, expr(f"{tm}.{helper}()"))], imports=imports)
        for call in analysis.calls_to(ctx, *DIST_SAMPLERS):
            self._sampler_without_group(call)
        for call in analysis.calls_to(ctx, *_ONE_RANK_NOOPS):
            self._collective_without_group(call)
        if not analysis.calls_to(ctx, DESTROY_PG):
            self._legacy_cleanup()

    def _sampler_without_group(self, call: cst.Call) -> None:
        """`DistributedSampler(ds)` asks the process group for its replicas and rank, and raises
        without one; given both it also works in one process, and `set_epoch` stays valid."""
        if any(a.star for a in call.args):
            return
        tm = self.ctx.tm
        missing = [(name, f"{tm}.{helper}()") for name, position, helper in
                   (("num_replicas", 1, "world_size"), ("rank", 2, "rank")) if arg(call, name, position) is None]
        if not missing:
            return
        self.report(call, "DistributedSampler takes its replicas and rank from the process group and raises "
                          f"without one (a one-process run): pass `num_replicas={tm}.world_size(), rank={tm}.rank()`",
                    edits=[replace(call, lambda c: with_args(c, [*c.args, *(kwarg(n, expr(v)) for n, v in missing)]))],
                    imports=[self.ctx.runtime_import()])

    def _collective_without_group(self, call: cst.Call) -> None:
        """`dist.all_reduce(t)` on a line of its own and behind no `if`: it raises without a
        process group, and on one rank it would change nothing, so a one-process run skips it."""
        ctx = self.ctx
        line = guardable_line(ctx, call)
        if line is None or not isinstance(line.body[0], cst.Expr) or line.body[0].value is not call \
                or behind_if(ctx, call):
            return
        tm = ctx.tm
        header = cst.parse_statement(f"if {tm}.is_distributed():\n    pass\n")

        def guard(body: Sequence[cst.BaseStatement]) -> cst.BaseStatement:
            return _lift_leading_lines(list(body), header.with_changes(body=cst.IndentedBlock(body=list(body))))

        self.report(call, f"`{code(call.func)}` needs the process group, which a one-process run does not have; "
                          f"on a single rank it changes nothing: run it under `if {tm}.is_distributed():`",
                    edits=[wrap(line, line, guard)], imports=[ctx.runtime_import()])

    def _legacy_cleanup(self) -> None:
        """A legacy script that never destroys its group gets `tm.cleanup()` at the end of its
        entry point: a rank that exits while another still saves can abort gloo at exit."""
        plan = entry_plan(self.ctx)
        if plan is None:
            return
        message = f"`{self.ctx.tm}.cleanup()` at the end: the group `{self.ctx.tm}.setup()` creates is torn down after a barrier"
        if plan.kind == "main-guard":
            self.report(plan.guard, message, edits=[replace(plan.guard, lambda g: self._fix_guard(g, False))],
                        imports=[self.ctx.runtime_import()])
        else:
            self.report(plan.entry.cleanup_after, message, edits=[self._cleanup_edit(plan.entry)],
                        imports=[self.ctx.runtime_import()])

    def _fix_guard(self, guard: cst.If, with_setup: bool = True) -> cst.If:
        tm = self.ctx.tm
        body = guard.body
        if isinstance(body, cst.SimpleStatementSuite):
            stmts: List[cst.BaseStatement] = [cst.SimpleStatementLine(
                body=[s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT) if i == len(body.body) - 1 else s
                      for i, s in enumerate(body.body)],
                trailing_whitespace=body.trailing_whitespace)]
            block = cst.IndentedBlock(body=[])
        else:
            stmts = list(body.body)
            block = body
        setup, cleanup = self._setup(), stmt(f"{tm}.cleanup()")
        first_exit = next((i for i, s in enumerate(stmts) if _may_exit(self.ctx, s)), None)
        if first_exit is None:
            new = [*stmts, cleanup]
        elif first_exit == len(stmts) - 1 and _plain_exit(self.ctx, stmts[-1]):
            new = [*stmts[:-1], cleanup, stmts[-1]]
        else:
            run = stmts[first_exit:]
            new = [*stmts[:first_exit], _lift_leading_lines(run, _try_finally(run, cleanup))]
        if with_setup:
            new.insert(0, setup)
        return guard.with_changes(body=block.with_changes(body=new))

    def _check_destroy(self, call: cst.Call) -> None:
        """`destroy_process_group()` on its own line with no barrier just before it: a rank that
        tears the group down while another still saves or logs can make gloo abort that rank at
        exit ("terminate called without an active exception"; measured 3 of 16 runs of a
        two-rank script that saves on rank 0, 0 of 16 with the barrier). The barrier goes only
        where every rank arrives: not in an `except`/`finally` block (after a failure the
        others may never come) and not under a rank-dependent `if`."""
        ctx = self.ctx
        line = ctx.statement_of(call)
        if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1
                and isinstance(line.body[0], cst.Expr) and line.body[0].value is call):
            return
        if any(isinstance(anc, (cst.ExceptHandler, cst.ExceptStarHandler, cst.Finally)) for anc in ctx.ancestors(line)):
            return
        if rank_guard_of(ctx, line) is not None:
            return
        block = ctx.parent(line)
        body = list(getattr(block, "body", ()))
        index = next((i for i, s in enumerate(body) if s is line), 0)
        if index and _is_barrier(ctx, body[index - 1]):
            return
        tm = ctx.tm
        self.report(call, f"`destroy_process_group()` without a barrier: a rank may tear the group down while "
                          f"another is still saving, which can abort gloo at exit; call `{tm}.barrier()` first",
                    edits=[insert_before(line, [stmt(f"{tm}.barrier()")])], imports=[ctx.runtime_import()])

    def _check_init(self, call: cst.Call) -> None:
        problems = []
        for name in ("rank", "world_size"):
            a = arg(call, name)
            if a is not None and isinstance(a.value, cst.Integer):
                problems.append(f"`{name}={a.value.value}`")
        method = arg(call, "init_method")
        if method is not None and isinstance(method.value, cst.SimpleString):
            value = method.value.evaluated_value
            if isinstance(value, str) and value.startswith(("tcp://", "file://")):
                problems.append(f"`init_method={method.value.value}`")
        if problems:
            self.report(call, f"init_process_group with hard-coded {', '.join(problems)}: under torchrun every "
                              "process gets the same value; use the default env:// init (rank and world size "
                              "come from RANK/WORLD_SIZE) or tm.setup()")

"""Launch rules: process-group setup (TM101), `--local_rank` (TM102), symmetric collectives
(TM104) and per-rank seeds (TM105)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, insert_after, insert_before, remove, replace, replace_with, wrap
from torchmigrate.imports import dotted, leading_import_anchor
from torchmigrate.nodes import arg, code, expr, kwarg, stmt, string_value, with_args
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.loaders import DIST_SAMPLERS
from torchmigrate.program.rank_guards import rank_guard_of
from torchmigrate.program.ranks import opposite_polarity, rank_polarity
from torchmigrate.program.syntax import last_name
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules._guards import guardable_line

INIT_PG = "torch.distributed.init_process_group"
DESTROY_PG = "torch.distributed.destroy_process_group"
BARRIERS = ("torch.distributed.barrier", "torchmigrate.runtime.barrier", "torchmigrate.runtime.cleanup")
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
         "torch.multiprocessing.spawn.spawn", "torch.multiprocessing.spawn.start_processes")
EXIT_CALLS = ("sys.exit", "os._exit")
EXIT_BUILTINS = ("exit", "quit")
# A user helper that initialises the process group itself (often in another module).
_DIST_INIT_HELPER = re.compile(
    r"^(init|setup|initialize|initialise)_?(distributed|dist|ddp|process_group|pg)(_mode|_env|_training)?$"
    r"|^(distributed|dist|ddp)_?(init|setup)$", re.IGNORECASE)


# --- where setup goes ------------------------------------------------------------------------

@dataclass
class SetupPlan:
    kind: str  # "main-guard" or "top-level"
    guard: Optional[cst.If] = None
    entry: Optional[analysis.Entry] = None
    # main-guard scripts that build their model/optimizer at module level: setup goes after
    # the first import block (`setup_after`, or before `setup_before`), cleanup stays in the guard.
    setup_after: Optional[cst.CSTNode] = None
    setup_before: Optional[cst.CSTNode] = None

    @property
    def setup_in_guard(self) -> bool:
        return self.setup_after is None and self.setup_before is None


def _top_anchor(ctx: Context):
    """(after, before): after the module's first run of top-level imports (where the engine puts
    the runtime import), else after the docstring, else before the first statement. Not after
    the last import: module-level code between two import blocks may already use the runtime
    (`model = tm.wrap_model(model)`, `sampler=tm.sampler(...)`), and setup must come first."""
    anchor = leading_import_anchor(ctx.module)
    if anchor is not None:
        return anchor, None
    return None, ctx.module.body[0]


def _module_level_work(ctx: Context, guard: cst.If) -> bool:
    """Code outside functions, classes and the `__main__` guard that needs the process set up
    first: it builds an optimizer (the model TM301 wraps there), moves something to a device,
    or trains (`_trains_at_module_level`)."""
    def at_module_level(node: cst.CSTNode) -> bool:
        return _outside(ctx, node, guard) is None

    for opt in analysis.optimizers(ctx):
        if at_module_level(opt.call):
            return True
    for call, name in analysis.facts(ctx).calls:
        if name is None and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda") \
                and at_module_level(call):
            return True
    return _trains_at_module_level(ctx, guard)


def _outside(ctx: Context, node: cst.CSTNode, guard: Optional[cst.If]) -> Optional[cst.CSTNode]:
    """None for code at module level, else the innermost function, class or lambda holding
    `node`, or the top-level `guard` (an `if __name__ == "__main__":`) holding it."""
    scope = ctx.enclosing(node, cst.FunctionDef, cst.ClassDef, cst.Lambda)
    if scope is not None:
        return scope
    if guard is not None:
        where = ctx.position(node)
        if where is None:  # a node built by a rule: ask its ancestors
            return guard if any(anc is guard for anc in ctx.ancestors(node)) else None
        if ctx.position(guard) <= where <= ctx.last_position(guard):
            return guard
    return None


def _is_script(ctx: Context) -> bool:
    """A module without a `__main__` guard is a script (rather than a library module) when its
    module-level code trains (see `_trains_at_module_level`), or when it is the entry of a
    program whose training happens in the modules it imports (`exp = Exp(args); exp.train()`)."""
    program = ctx.program
    if program.followed and program.is_entry and program.program_trains:
        return True
    return _trains_at_module_level(ctx, None)


_ENTRY_NAMES = re.compile(r"^(main|train|run|fit|train_\w+|run_\w+|\w+_main)$")
_TRAINING_METHODS = ("backward", "step", "fit", "train_model")


def _trains_at_module_level(ctx: Context, guard: Optional[cst.If]) -> bool:
    """Module-level code (outside functions, classes and `guard`) calls `.backward()` /
    `.step()` / `.fit()`, builds an optimizer, or calls an entry function of this file
    (`main()`, `train()`, or one that runs `.backward()` or builds an optimizer)."""
    def outside(node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return _outside(ctx, node, guard)

    trainers = set()  # functions that train
    for opt in analysis.optimizers(ctx):
        where = outside(opt.call)
        if where is None:
            return True
        trainers.add(where)
    functions = analysis.facts(ctx).functions
    entry_calls = []
    for call, name in analysis.facts(ctx).calls:
        func = call.func
        if name is None and isinstance(func, cst.Attribute) and func.attr.value in _TRAINING_METHODS:
            where = outside(call)
            if where is None:
                return True
            trainers.add(where)
        elif name is None and isinstance(func, cst.Name) and func.value in functions:
            entry_calls.append(call)
    for call in entry_calls:
        if outside(call) is None:
            target = functions[call.func.value]
            if _ENTRY_NAMES.match(call.func.value) or target in trainers:
                return True
    # `meta = Meta(Learner())` at module level, Meta's methods building the optimizer or training
    classes = analysis.facts(ctx).classes
    training_classes = {name for name, klass in classes.items()
                        if any(ctx.enclosing(t, cst.ClassDef) is klass for t in trainers if t is not None)}
    for call, name in analysis.facts(ctx).calls:
        if name is None and isinstance(call.func, cst.Name) and call.func.value in training_classes \
                and outside(call) is None:
            return True
    return False


# What shows that a process group exists when the file runs: it creates one (or has a helper, or
# the runtime, create it) or wraps a model in DDP, which needs one. A DistributedSampler does not:
# scripts build one behind a flag (`DistributedSampler(ds) if distributed else None`) without
# ever initialising a group, and a migrated script must still get `tm.setup()`.
_SETS_UP = (INIT_PG, RUNTIME + ".setup", RUNTIME + ".wrap_model", *SPAWN,
            "torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel")


def user_sets_up_elsewhere(ctx: Context) -> bool:
    """The file (or a helper it calls) already initialises distributed training."""
    return bool(analysis.calls_to(ctx, *_SETS_UP)) or _calls_init_helper(ctx)


def creates_own_group(ctx: Context) -> bool:
    """The file creates its process group itself (`init_process_group`, an `init_distributed`
    helper), not through `tm.setup()`, and keeps doing so: a legacy script's init becomes
    `tm.setup()` (`legacy_launch`), so it is treated as the migrated file will be."""
    return (bool(analysis.calls_to(ctx, INIT_PG)) or _calls_init_helper(ctx)) \
        and not analysis.calls_to(ctx, RUNTIME + ".setup") and not legacy_launch(ctx)


def _calls_init_helper(ctx: Context) -> bool:
    """A call of an `init_distributed(...)`-style helper (asked by TM101 and TM301: kept)."""
    found = ctx.facts.get("launch.init_helper")
    if found is None:
        # Every call of the file is asked: test the last name of the callee (exact types,
        # cheap) first and build the dotted name only for the rare one that matches.
        found = False
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            tp = type(func)
            last = func.value if tp is cst.Name else func.attr.value if tp is cst.Attribute else None
            if last is not None and _DIST_INIT_HELPER.match(last) and dotted(func):
                found = True
                break
        ctx.facts["launch.init_helper"] = found
    return found


# Arguments of `init_process_group` that `tm.setup()` reproduces from torchrun's environment.
_PLAIN_INIT_ARGS = ("backend", "init_method", "timeout")
# Calls that need a process group and have a runtime twin that also works without one.
_GROUP_QUERIES = {"torch.distributed.get_rank": "rank", "torch.distributed.get_world_size": "world_size",
                  "torch.distributed.barrier": "barrier", DESTROY_PG: "cleanup"}
# In-place collectives that change nothing on a single rank: a one-process run can skip them.
_ONE_RANK_NOOPS = tuple(f"torch.distributed.{n}" for n in ("all_reduce", "broadcast", "reduce"))
def legacy_launch(ctx: Context) -> bool:
    """`ddp` on a script that creates its own process group the way `torch.distributed.launch`
    and switchable scripts did: it calls `init_process_group` itself (no `mp.spawn`) and either
    takes a `--local_rank` option (the launcher passes it) or creates the group only behind an
    `if` (`if args.distributed:`, `if args.local_rank != -1:`), so it was meant to run as one
    process too. Such a script is moved onto the runtime like a single-GPU one (TM101, TM103,
    TM301): as written it cannot run without CUDA (nccl, `set_device`, `device_ids`), so it
    cannot be smoke-tested on a CPU machine. A script written for torchrun only (an
    unconditional init, rank from the environment) stays as the user wrote it, and `lint` never
    asks: there such code is valid distributed code."""
    inits = _legacy_inits(ctx)
    return bool(inits) and all(_plain_init(ctx, c) for c in inits)


def _legacy_inits(ctx: Context) -> List[cst.Call]:
    """The `init_process_group` calls of a script launched the legacy way (see
    `legacy_launch`), whatever their arguments; none for other files and in `lint`/`amp`."""
    if ctx.options.mode != "ddp":
        return []
    key = "launch.legacy_inits"
    if key not in ctx.facts:
        inits = analysis.calls_to(ctx, INIT_PG)
        legacy = bool(inits) and not analysis.calls_to(ctx, *SPAWN) \
            and not analysis.calls_to(ctx, RUNTIME + ".setup") \
            and (any(_behind_if(ctx, c) for c in inits) or _has_local_rank_option(ctx))
        ctx.facts[key] = inits if legacy else []
    return ctx.facts[key]  # type: ignore[return-value]


def _plain_init(ctx: Context, call: cst.Call) -> bool:
    """`init_process_group(...)` alone on its line, with nothing `tm.setup()` would drop: a
    backend, an `init_method` that is not a tcp:// or file:// literal (`args.dist_url`, which
    is env:// when torchrun launches), a timeout. Ranks and world sizes passed by the script
    are its own launch scheme: kept, and reported."""
    line = ctx.statement_of(call)
    if not (isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1
            and isinstance(line.body[0], cst.Expr) and line.body[0].value is call):
        return False
    for position, a in enumerate(call.args):
        name = a.keyword.value if a.keyword is not None else (
            _PLAIN_INIT_ARGS[position] if position < 2 and not a.star else None)
        if name not in _PLAIN_INIT_ARGS:
            return False
        if name == "init_method" and isinstance(a.value, cst.BaseString) and string_value(a.value) != "env://":
            return False  # a literal tcp:// or file:// address (an `args.dist_url` is env:// under torchrun)
    return True


def _behind_if(ctx: Context, call: cst.Call) -> bool:
    """Under an `if` (other than the `__main__` guard) of its function or module."""
    guard = analysis.facts(ctx).main_guard
    for anc in ctx.ancestors(call):
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
        if isinstance(anc, cst.If) and anc is not guard:
            return True
    return False


def _has_local_rank_option(ctx: Context) -> bool:
    """An argparse `--local_rank` (or `--local-rank`) option: torch.distributed.launch's."""
    for call, _name in analysis.facts(ctx).calls:
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "add_argument" \
                and any(string_value(a.value) in _LOCAL_RANK_FLAGS for a in _option_strings(call)):
            return True
    return False


def _entry_plan(ctx: Context) -> Optional[SetupPlan]:
    """Where the entry point's setup and cleanup go (see `setup_plan`), asked also of scripts
    that set up their own group: a legacy script needs the cleanup it never had."""
    if not ctx.program.is_entry:
        return None  # a module the program's entry imports: the entry sets up
    guard = analysis.facts(ctx).main_guard
    if guard is not None:
        if _module_level_work(ctx, guard):
            after, before = _top_anchor(ctx)
            return SetupPlan("main-guard", guard=guard, setup_after=after, setup_before=before)
        return SetupPlan("main-guard", guard=guard)
    if not _is_script(ctx):
        return None
    entry = analysis.entry(ctx)
    if entry is None:
        return None
    return SetupPlan("top-level", entry=entry)


def setup_plan(ctx: Context) -> Optional[SetupPlan]:
    """Where TM101 puts `tm.setup()`/`tm.cleanup()`, or None when this file gets none (already
    distributed, an `mp.spawn` launcher, or a library module). TM103 uses it too: `set_device`
    calls are redundant only in files that get `tm.setup()`."""
    key = "launch.setup_plan"
    if key not in ctx.facts:
        ctx.facts[key] = None if user_sets_up_elsewhere(ctx) else _entry_plan(ctx)
    return ctx.facts[key]  # type: ignore[return-value]


def _is_exit(ctx: Context, node: cst.CSTNode) -> bool:
    """`sys.exit(...)`, `exit()`, `quit()`, `os._exit(...)` or `raise SystemExit(...)` anywhere in node."""
    if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
        return False
    for n in ctx.within(node, cst.Call, cst.Raise, skip_defs=True):
        if isinstance(n, cst.Call):
            name = ctx.resolve(n.func)
            if name in EXIT_CALLS or (isinstance(n.func, cst.Name) and n.func.value in EXIT_BUILTINS and name is None):
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
                main(args)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm

            if __name__ == "__main__":
                tm.setup()
                args = parser.parse_args()
                main(args)
                tm.cleanup()
            """,
        ),
        Example(
            before="""
            import sys
            import torch

            if __name__ == "__main__":
                sys.exit(main())
            """,
            after="""
            import sys
            import torch
            import torchmigrate.runtime as tm

            if __name__ == "__main__":
                tm.setup()
                try:
                    sys.exit(main())
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
        for call in _legacy_inits(ctx):
            if not _plain_init(ctx, call):
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
        if plan.kind == "main-guard":
            guard = plan.guard
            edits = [replace(guard, lambda g: self._fix_guard(g, plan.setup_in_guard))]
            if plan.setup_after is not None:
                edits.append(insert_after(plan.setup_after, [stmt(f"{tm}.setup()")]))
            elif plan.setup_before is not None:
                edits.append(insert_before(plan.setup_before, [stmt(f"{tm}.setup()")]))
            self.report(guard, message, edits=edits, imports=[ctx.runtime_import()])
            return
        entry = plan.entry
        edits = []
        setup = stmt(f"{tm}.setup()")
        if entry.setup_after is not None:
            edits.append(insert_after(entry.setup_after, [setup]))
        else:
            edits.append(insert_before(entry.setup_before, [setup]))
        edits.append(self._cleanup_edit(entry))
        self.report(entry.setup_after or entry.setup_before, message, edits=edits, imports=[ctx.runtime_import()])

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
                or _behind_if(ctx, call):
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
        plan = _entry_plan(self.ctx)
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
        setup, cleanup = stmt(f"{tm}.setup()"), stmt(f"{tm}.cleanup()")
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


# --- TM102 -------------------------------------------------------------------------------------

_LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")


def _option_strings(call: cst.Call) -> List[cst.Arg]:
    out = []
    for a in call.args:
        if a.keyword is not None or a.star:
            break
        if not isinstance(a.value, cst.SimpleString):
            break
        out.append(a)
    return out


def _mentions_local_rank(node: cst.CSTNode) -> bool:
    """The expression reads the LOCAL_RANK environment variable (a "LOCAL_RANK" literal)."""
    text = code(node)
    return '"LOCAL_RANK"' in text or "'LOCAL_RANK'" in text


class LocalRankArg(Rule):
    """
    ## What it does
    Rewrites a `--local_rank` argparse option written for `python -m torch.distributed.launch`
    so it accepts both spellings (`--local-rank`, `--local_rank`) and defaults to the
    `LOCAL_RANK` environment variable, keeping the old default as the fallback:
    `parser.add_argument("--local-rank", "--local_rank", type=int,
    default=int(os.environ.get("LOCAL_RANK", -1)))`. The destination stays `local_rank`
    (argparse derives it from the first long option), so `args.local_rank` keeps working.
    A missing default becomes `int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ
    else None`; `required=True` is dropped (torchrun never passes the flag).

    ## Why is this bad?
    torchrun passes no `--local_rank` argument at all: it only sets `LOCAL_RANK`, so
    `args.local_rank` silently keeps its default (every process thinks it is local rank 0 and
    uses GPU 0). Recent `torch.distributed.launch` passes `--local-rank=N`, which an option
    spelled only `--local_rank` rejects ("unrecognized arguments: --local-rank=0").

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=-1)
    ```
    becomes
    ```python
    parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
    ```
    """

    code = "TM102"
    name = "local-rank-arg"
    summary = "Accept --local-rank and --local_rank and default to the LOCAL_RANK environment variable"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import argparse
            import os
            import torch
            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)
            """,
            after="""
            import argparse
            import os
            import torch
            parser = argparse.ArgumentParser()
            parser.add_argument("--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        for call, _name in analysis.facts(self.ctx).calls:
            if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "add_argument"):
                continue
            options = _option_strings(call)
            values = [string_value(a.value) for a in options]
            if not any(v in _LOCAL_RANK_FLAGS for v in values):
                continue
            action = arg(call, "action")
            if action is not None and string_value(action.value) not in (None, "store"):
                continue
            self._check(call, values)

    def _check(self, call: cst.Call, values: List[Optional[str]]) -> None:
        default = arg(call, "default")
        env_default = default is not None and _mentions_local_rank(default.value)
        both = all(flag in values for flag in _LOCAL_RANK_FLAGS)
        required = arg(call, "required")
        if both and env_default and required is None:
            return
        os_name = self.ctx.imports.alias_for("os") or "os"
        imports = [] if os_name != "os" else [Import("os")]

        def fix(c: cst.Call) -> cst.Call:
            args = list(c.args)
            options = _option_strings(c)
            vals = [string_value(a.value) for a in options]
            if "--local-rank" not in vals or "--local_rank" not in vals:
                i = next(i for i, v in enumerate(vals) if v in _LOCAL_RANK_FLAGS)
                have = options[i]
                quote = have.value.quote
                prefix = have.value.prefix
                missing = "--local_rank" if vals[i] == "--local-rank" else "--local-rank"
                comma = have.comma if isinstance(have.comma, cst.Comma) else cst.Comma(
                    whitespace_after=cst.SimpleWhitespace(" "))
                new = cst.Arg(value=cst.SimpleString(f"{prefix}{quote}{missing}{quote}"), comma=comma)
                pos = args.index(have)
                if missing == "--local-rank":
                    args.insert(pos, new)
                else:
                    if have.comma is cst.MaybeSentinel.DEFAULT:
                        args[pos] = have.with_changes(comma=comma)
                    args.insert(pos + 1, new if pos + 1 < len(args) else new.with_changes(comma=cst.MaybeSentinel.DEFAULT))
            args = [a for a in args if not (a.keyword is not None and a.keyword.value == "required")]
            d = next((a for a in args if a.keyword is not None and a.keyword.value == "default"), None)
            if d is None or not _mentions_local_rank(d.value):
                if d is None or (isinstance(d.value, cst.Name) and d.value.value == "None"):
                    value = expr(f'int({os_name}.environ["LOCAL_RANK"]) if "LOCAL_RANK" in {os_name}.environ else None')
                else:
                    value = expr(f'int({os_name}.environ.get("LOCAL_RANK", {code(d.value)}))')
                if d is None:
                    kinds = [a.keyword.value if a.keyword is not None else None for a in args]
                    if "type" in kinds:
                        index = kinds.index("type") + 1
                    else:
                        index = len(_option_strings(c))
                    args.insert(index, kwarg("default", value))
                else:
                    args[args.index(d)] = d.with_changes(value=value)
            return with_args(c, args)

        what = []
        if not both:
            what.append("accept both --local-rank and --local_rank")
        if not env_default:
            what.append("default to the LOCAL_RANK environment variable (torchrun passes no argument)")
        if required is not None:
            what.append("drop required=")
        self.report(call, "--local_rank argument from torch.distributed.launch: " + "; ".join(what),
                    edits=[replace(call, fix)], imports=imports)


# --- TM104 -------------------------------------------------------------------------------------

COLLECTIVES = {
    f"torch.distributed.{n}" for n in (
        "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "_all_gather_base",
        "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list",
        "reduce", "barrier", "monitored_barrier", "gather", "gather_object", "scatter", "scatter_object_list",
        "all_to_all", "all_to_all_single", "new_group")
} | {f"{RUNTIME}.{n}" for n in ("all_reduce", "barrier", "gather_for_metrics", "wrap_model", "setup",
                                "main_process_first")} | {
    "torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
}
# Helpers from other modules (detectron2's comm, DETR's utils, ...) that communicate.
_COLLECTIVE_HELPERS = {"synchronize", "barrier", "all_reduce", "all_gather", "reduce_dict", "reduce_tensor",
                       "all_reduce_mean", "reduce_mean", "reduce_loss_dict", "wait_for_everyone",
                       "gather_for_metrics", "broadcast_object", "all_gather_object", "reduce_value"}
_DDP_CONSTRUCTORS = ("torch.nn.parallel.DistributedDataParallel",
                     "torch.nn.parallel.distributed.DistributedDataParallel", RUNTIME + ".wrap_model")
class SymmetricCollectives(Rule):
    """
    ## What it does
    Reports collectives (`dist.all_reduce`, `barrier`, `all_gather`, `broadcast`, `reduce`,
    `tm.all_reduce`, `tm.barrier`, `tm.gather_for_metrics`, DDP construction, and helpers such
    as `comm.synchronize()`) and forward passes through a DDP-wrapped model that run only on
    some ranks: inside `if rank == 0:`, `if args.local_rank in [-1, 0]:`,
    `if dist.get_rank() == 0:`, `if tm.is_main():`, `if is_main_process():` (and their `else`
    branches), or inside `except` blocks. Calls to functions of the same file that run a
    collective or a DDP forward are reported too (one level deep).

    The common "rank 0 first" pattern, a `barrier()` under `if rank != 0:` matched by one
    under `if rank == 0:` (or in both branches of one `if`), is recognised and not reported.

    ## Why is this bad?
    A collective completes only when every rank calls it. When rank 0 alone calls
    `all_reduce` or `barrier` (or runs a DDP forward, which may broadcast buffers), the job
    hangs until the process-group timeout (10 minutes with NCCL by default) and then dies.
    The same happens when an exception is caught on one rank only. Evaluate on rank 0 with
    `tm.unwrap(model)`, or run the collective on every rank.

    ## Example
    ```python
    if rank == 0:
        dist.all_reduce(t)      # ranks 1..N-1 never join: hang
    ```

    ## Limitations
    Whether a branch really differs between ranks depends on program semantics, so this rule
    only reports (it has no fix), and it looks through one level of same-file calls.
    """

    code = "TM104"
    name = "symmetric-collectives"
    summary = "Collectives and DDP forwards must run on every rank, not under rank guards or in except blocks"
    safety = Safety.MANUAL
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch.distributed as dist
            if dist.get_rank() == 0:
                dist.all_reduce(t)
            """,
            after="""
            import torch.distributed as dist
            if dist.get_rank() == 0:
                # TODO(torchmigrate): TM104 `dist.all_reduce` is a collective under a rank guard (`if dist.get_rank() == 0`): the other ranks never join it and the job hangs; call it on every rank
                dist.all_reduce(t)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.regions: Dict[cst.CSTNode, Tuple[str, str]] = {}  # block -> (polarity, description)

    def visit_If(self, node: cst.If) -> None:
        polarity = rank_polarity(node.test)
        if polarity is None:
            return
        text = f"if {code(node.test)}"
        if len(text) > 60:
            text = text[:57] + "..."
        self.regions[node.body] = (polarity, f"`{text}`")
        if node.orelse is not None:
            target = node.orelse.body if isinstance(node.orelse, cst.Else) else node.orelse
            self.regions[target] = (opposite_polarity(polarity), f"the else branch of `{text}`")

    def visit_ExceptHandler(self, node: cst.ExceptHandler) -> None:
        self.regions[node.body] = ("except", "an `except` block")

    def _region(self, node: cst.CSTNode, stop: Optional[cst.CSTNode] = None):
        """The innermost guarded region holding node (not crossing a def), and its scope."""
        found = None
        for anc in self.ctx.ancestors(node):
            if anc is stop:
                break
            if found is None and anc in self.regions:
                found = self.regions[anc]
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return found, anc
        return found, self.ctx.module

    def _collective_name(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        if name in COLLECTIVES:
            return name
        last = last_name(call.func)
        if last in _COLLECTIVE_HELPERS:
            if name is not None and not name.startswith("torch.") and not name.startswith(RUNTIME):
                return name  # imported helper (comm.synchronize, utils.reduce_dict)
            if isinstance(call.func, cst.Attribute) and last in ("wait_for_everyone", "gather_for_metrics"):
                return dotted(call.func) or last
        return None

    def leave_Module(self, node: cst.Module) -> None:
        if not self.regions:
            return
        ctx = self.ctx
        calls = analysis.facts(ctx).calls
        ddp = self._ddp_models()
        # Direct offenders, by enclosing function (for the one-level look through calls).
        by_function: Dict[cst.CSTNode, List[Tuple[str, str, Optional[str]]]] = {}
        candidates = []  # (call, what, region, scope, key)
        functions = analysis.facts(ctx).functions
        methods: Dict[Tuple[cst.CSTNode, str], cst.FunctionDef] = {}
        for cls in analysis.facts(ctx).classes.values():
            if isinstance(cls.body, cst.IndentedBlock):
                for s in cls.body.body:
                    if isinstance(s, cst.FunctionDef):
                        methods[(cls, s.name.value)] = s
        for call, name in calls:
            what = None
            coll = self._collective_name(call, name)
            if coll is not None:
                what = ("collective", dotted(call.func) or coll.rsplit(".", 1)[-1], coll.rsplit(".", 1)[-1])
            else:
                func = dotted(call.func)
                if func in ddp:
                    what = ("forward", func, None)
            if what is None:
                continue
            fn = ctx.enclosing(call, cst.FunctionDef)
            if fn is not None:
                by_function.setdefault(fn, []).append(what)
            region, scope = self._region(call)
            if region is not None:
                candidates.append((call, what, region, scope))
        # Calls to same-file functions that communicate, made under a guard.
        param_forwards = self._param_forwards(ddp, calls)
        for call, name in calls:
            if name is not None:
                continue
            target = None
            if isinstance(call.func, cst.Name):
                target = functions.get(call.func.value)
            elif isinstance(call.func, cst.Attribute) and isinstance(call.func.value, cst.Name) \
                    and call.func.value.value == "self":
                cls = ctx.enclosing(call, cst.ClassDef)
                if cls is not None:
                    target = methods.get((cls, call.func.attr.value))
            if target is None:
                continue
            region, scope = self._region(call)
            if region is None:
                continue
            inner = by_function.get(target, [])
            fname = dotted(call.func)
            if inner:
                kind, name, _ = inner[0]
                candidates.append((call, ("calls" if kind == "collective" else "calls-forward", fname, name),
                                   region, scope))
                continue
            forwarded = self._passes_model(call, target, ddp, param_forwards)
            if forwarded:
                candidates.append((call, ("calls-forward", fname, forwarded), region, scope))
        self._report(candidates)

    def _report(self, candidates) -> None:
        # "rank 0 first": the same collective under opposite guards of one scope is symmetric.
        polarities: Dict[Tuple[cst.CSTNode, str], Set[str]] = {}
        for call, what, region, scope in candidates:
            if what[0] == "collective":
                polarities.setdefault((scope, what[2]), set()).add(region[0])
        seen = set()
        for call, what, region, scope in candidates:
            if call in seen:
                continue
            seen.add(call)
            if what[0] == "collective" and {"main", "other"} <= polarities.get((scope, what[2]), set()):
                continue
            where = region[1]
            if region[0] == "except":
                consequence = "if only some ranks raise, the others wait for it forever; call it on every rank or re-raise"
            else:
                consequence = "the other ranks never join it and the job hangs; call it on every rank"
            if what[0] == "collective":
                msg = f"`{what[1]}` is a collective under a rank guard ({where}): {consequence}"
                if region[0] == "except":
                    msg = f"`{what[1]}` is a collective inside {where}: {consequence}"
            elif what[0] == "forward":
                msg = (f"forward through the DDP model `{what[1]}` only on some ranks ({where}) can hang (DDP syncs "
                       f"buffers/gradients); use `tm.unwrap({what[1]})` for rank-0-only evaluation, or run it on every rank")
            elif what[0] == "calls":
                msg = f"`{what[1]}()` runs the collective `{what[2]}` but is called under a rank guard ({where}): {consequence}"
            else:
                msg = (f"`{what[1]}()` runs a forward through the DDP model `{what[2]}` but is called under a rank guard "
                       f"({where}): it can hang; evaluate through `tm.unwrap({what[2]})` for rank-0-only work, or call it on every rank")
            self.report(call, msg)

    def _ddp_models(self) -> Set[str]:
        ctx = self.ctx
        names: Set[str] = set()
        for call in analysis.calls_to(ctx, *_DDP_CONSTRUCTORS):
            parent = ctx.parent(call)
            if isinstance(parent, cst.Assign):
                for t in parent.targets:
                    name = dotted(t.target)
                    if name:
                        names.add(name)
        if ctx.options.mode == "ddp":
            names.update(analysis.trained_models(ctx))
        return names

    def _param_forwards(self, ddp: Set[str], calls) -> Dict[cst.CSTNode, Set[str]]:
        """For each function, the parameter names it calls like a model (`model(x)`)."""
        if not ddp:
            return {}
        out: Dict[cst.CSTNode, Set[str]] = {}
        for call, name in calls:
            if name is None and isinstance(call.func, cst.Name):
                fn = self.ctx.enclosing(call, cst.FunctionDef)
                if fn is not None:
                    params = {p.name.value for p in fn.params.params} | {p.name.value for p in fn.params.kwonly_params}
                    if call.func.value in params:
                        out.setdefault(fn, set()).add(call.func.value)
        return out

    def _passes_model(self, call: cst.Call, target: cst.FunctionDef, ddp: Set[str],
                      param_forwards: Dict[cst.CSTNode, Set[str]]) -> Optional[str]:
        called = param_forwards.get(target)
        if not called:
            return None
        params = [p.name.value for p in target.params.params]
        if params and params[0] in ("self", "cls") and isinstance(call.func, cst.Attribute):
            params = params[1:]
        positional = [a for a in call.args if a.keyword is None and not a.star]
        for i, a in enumerate(call.args):
            name = dotted(a.value)
            if name not in ddp:
                continue
            if a.keyword is not None:
                param = a.keyword.value
            elif a.star:
                continue
            else:
                index = positional.index(a)
                param = params[index] if index < len(params) else None
            if param in called:
                return name
        return None


# --- TM105 -------------------------------------------------------------------------------------

SEEDERS = {
    "torch.manual_seed", "torch.random.manual_seed", "torch.cuda.manual_seed", "torch.cuda.manual_seed_all",
    "random.seed", "numpy.random.seed",
}


def _dotted_names(node: cst.CSTNode) -> List[str]:
    """`a`, `self.x`: the variables an expression reads (outermost dotted chains)."""
    name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
    if name is not None:
        return [name]
    out: List[str] = []
    for child in node.children:
        out += _dotted_names(child)
    return out


class PerRankSeed(Rule):
    """
    ## What it does
    Suggests replacing a group of global seeding statements (`torch.manual_seed(s)`,
    `torch.cuda.manual_seed_all(s)`, `random.seed(s)`, `np.random.seed(s)`, adjacent in one
    block, also across imports) with one `tm.seed_everything(s, per_rank=True)` call, which
    seeds `random`, numpy and torch with `s + rank`. The groups of one function (or of the
    module) that use the same seed, e.g. `torch.manual_seed(s)` and a later
    `if cuda: torch.cuda.manual_seed_all(s)`, are one finding with one TODO; the fix rewrites
    each of them. The fix is unsafe (it changes the random streams), so it is
    applied only by `lint --unsafe-fixes`; a migration reports it with a TODO. Seeds that
    already depend on the rank (`args.seed + rank`) are left alone. Fires in distributed
    files, and on every file in `ddp`.

    ## Why is this bad?
    With the same seed every rank draws the same random augmentations, dropout masks and
    noise, so N ranks see N copies of one random stream instead of N independent ones. Model
    weights do not need a shared seed: DDP broadcasts rank 0's parameters when it wraps the
    model, and `DistributedSampler` shuffles with its own seed.

    ## Example
    ```python
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    ```
    becomes (with `--unsafe-fixes`)
    ```python
    tm.seed_everything(args.seed, per_rank=True)
    ```

    ## Limitations
    Code that relies on identical global random draws on every rank (a `random_split` of the
    dataset, a randomly generated validation set, modules created after seeding but never
    wrapped in DDP) must use an explicit `torch.Generator` before taking the fix.
    """

    code = "TM105"
    name = "per-rank-seed"
    summary = "Seed each rank differently so ranks draw different random augmentations"
    safety = Safety.UNSAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import random
            import torch
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            """,
            after="""
            import random
            import torch
            # TODO(torchmigrate): TM105 every rank uses the same seed (identical augmentations/dropout on all ranks): use `tm.seed_everything(args.seed, per_rank=True)` (unsafe: changes the random streams; keep dataset splits on an explicit generator)
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._assign_index: Optional[Dict[str, List[cst.BaseExpression]]] = None
        self._rank_text: Dict[cst.CSTNode, bool] = {}

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not (ctx.options.mode == "ddp" or analysis.is_distributed(ctx)):
            return
        seeds = analysis.calls_to(ctx, *SEEDERS)
        seen: Set[cst.CSTNode] = set()
        # Groups of one scope that seed with the same value are one finding (one TODO): a
        # script often seeds torch/random first and CUDA a few lines later under `if cuda:`.
        clusters: Dict[Tuple[cst.CSTNode, Optional[str]], List[List[cst.SimpleStatementLine]]] = {}
        for call in seeds:
            line = self._line(call)
            if line is None or line in seen:
                continue
            group = self._group(line)
            seen.update(group)
            calls = [small.value for g in group for small in g.body]
            if any(self._rank_dependent(c) for c in calls):
                continue
            clusters.setdefault((ctx.scope_of(line), self._common_seed(calls)), []).append(group)
        for groups in clusters.values():
            self._report_groups(groups)
        for call in analysis.calls_to(ctx, RUNTIME + ".seed_everything"):
            if arg(call, "per_rank", 1) is None and not any(a.star for a in call.args):
                if self._rank_dependent(call):
                    continue
                self.report(call, "tm.seed_everything without per_rank: every rank draws the same random numbers; "
                                  "pass per_rank=True (unsafe: changes the random streams)",
                            edits=[replace(call, lambda c: with_args(c, [*c.args, kwarg("per_rank", expr("True"))]))])

    def _is_seed_line(self, line: cst.CSTNode) -> bool:
        if not isinstance(line, cst.SimpleStatementLine):
            return False
        for small in line.body:
            if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                    and self.ctx.resolve(small.value.func) in SEEDERS):
                return False
        return True

    def _line(self, call: cst.Call) -> Optional[cst.SimpleStatementLine]:
        parent = self.ctx.parent(call)
        if not isinstance(parent, cst.Expr):
            return None
        line = self.ctx.parent(parent)
        return line if self._is_seed_line(line) else None

    def _group(self, line: cst.SimpleStatementLine) -> List[cst.SimpleStatementLine]:
        """The seeding lines from `line` on in its block, also across import lines between
        them (`torch.manual_seed(s)` / `import random` / `random.seed(s)`)."""
        block = self.ctx.parent(line)
        body = list(getattr(block, "body", ()))
        if line not in body:
            return [line]
        i = body.index(line)
        group = [line]
        for nxt in body[i + 1:]:
            if self._is_seed_line(nxt):
                group.append(nxt)
            elif not (isinstance(nxt, cst.SimpleStatementLine)
                      and all(isinstance(x, (cst.Import, cst.ImportFrom)) for x in nxt.body)):
                break
        return group

    def _seed_value(self, call: cst.Call) -> Optional[cst.BaseExpression]:
        a = arg(call, "seed", 0)
        if a is None or len(call.args) != 1:
            return None
        return a.value

    def _rank_dependent(self, call: cst.Call) -> bool:
        """The seed already differs per rank: `seed + rank`, or a variable assigned from the rank
        (`seed = args.seed + utils.get_rank()`, `self.seed_offset = ddp_rank`)."""
        a = arg(call, "seed", 0)
        if a is None:
            return False
        if self._mentions_rank(a.value):
            return True
        index = self._assigned()
        for name in _dotted_names(a.value):
            if any(self._mentions_rank(value) for value in index.get(name, ())):
                return True
        return False

    def _mentions_rank(self, node: cst.CSTNode) -> bool:
        """Whether the source text of `node` contains "rank"; remembered per node, since the same
        assigned values are asked about for every seeding call and generating their code is the cost."""
        found = self._rank_text.get(node)
        if found is None:
            found = self._rank_text[node] = "rank" in code(node).lower()
        return found

    def _assigned(self) -> Dict[str, List[cst.BaseExpression]]:
        """Assigned values by dotted target name, built once."""
        if self._assign_index is None:
            self._assign_index = {}
            for assign in analysis.facts(self.ctx).assigns:
                for t in assign.targets:
                    name = dotted(t.target)
                    if name:
                        self._assign_index.setdefault(name, []).append(assign.value)
        return self._assign_index

    def _common_seed(self, calls: List[cst.Call]) -> Optional[str]:
        """The text of the one seed every call uses, or None (different or unknown seeds)."""
        values = [self._seed_value(c) for c in calls]
        texts = {code(v) for v in values if v is not None}
        if None in values or len(texts) != 1:
            return None
        return texts.pop()

    def _report_groups(self, groups: List[List[cst.SimpleStatementLine]]) -> None:
        """One finding for the seeding groups of one scope that share a seed (or all have mixed
        seeds): the TODO goes on the first group, the fix replaces every group."""
        group = groups[0]
        calls = [small.value for line in group for small in line.body]
        tm = self.ctx.tm
        first = calls[0]
        more = sum(len(g) for g in groups[1:])
        also = f" (also for the {more} later seeding line{'s' if more > 1 else ''} in this scope)" if more else ""
        if self._common_seed(calls) is None:
            self.report(first, f"every rank uses the same seed (identical augmentations/dropout on all ranks): "
                               f"seed with `{tm}.seed_everything(seed, per_rank=True)` (adds the rank){also}",
                        statement=group[0])
            return
        seed = self._seed_value(first)
        seed_text = code(seed)
        edits = []
        for g in groups:
            edits += self._group_edits(g, seed)
        self.report(first, f"every rank uses the same seed (identical augmentations/dropout on all ranks): use "
                           f"`{tm}.seed_everything({seed_text}, per_rank=True)` (unsafe: changes the random streams; "
                           f"keep dataset splits on an explicit generator){also}",
                    edits=edits, imports=[self.ctx.runtime_import()], statement=group[0])

    def _group_edits(self, group: List[cst.SimpleStatementLine], seed: cst.BaseExpression) -> list:
        """The first line becomes `tm.seed_everything(seed, per_rank=True)`, the others go."""
        tm = self.ctx.tm
        # Comments on the lines that go move above the one call that replaces them.
        moved: List[cst.EmptyLine] = []
        for line in group[1:]:
            moved += [ln for ln in line.leading_lines if ln.comment is not None]
            if line.trailing_whitespace.comment is not None:
                moved.append(cst.EmptyLine(comment=line.trailing_whitespace.comment))

        def fix(line: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
            call = expr(f"{tm}.seed_everything(__seed__, per_rank=True)")
            call = call.with_changes(args=[call.args[0].with_changes(value=seed), call.args[1]])
            return line.with_changes(body=[cst.Expr(call)], leading_lines=[*line.leading_lines, *moved])

        return [replace(group[0], fix)] + [remove(line) for line in group[1:]]

"""What the launch family decides for a file: where `tm.setup()`/`tm.cleanup()` go (the
`__main__` guard, after the first import block, or around a top-level script), whether the file
already creates its own process group, and whether it is a legacy `torch.distributed.launch`
script that `ddp` moves onto the runtime like a single-GPU one. TM101 acts on these decisions;
TM103 (`set_device` calls are redundant under `tm.setup()`) and the model rules (TM301: a file
that creates its own group keeps its own DDP) ask them too."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted, leading_import_anchor
from torchmigrate.syntax.nodes import string_value
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.rule import Context
from torchmigrate.rules.launch.base import INIT_PG, LOCAL_RANK_FLAGS, SPAWN, option_strings

# A user helper that initialises the process group itself (often in another module).
_DIST_INIT_HELPER = re.compile(
    r"^(init|setup|initialize|initialise)_?(distributed|dist|ddp|process_group|pg)(_mode|_env|_training)?$"
    r"|^(distributed|dist|ddp)_?(init|setup)$", re.IGNORECASE)


@dataclass
class SetupPlan:
    """Where TM101 puts `tm.setup()` and `tm.cleanup()` in an entry script."""

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


def _user_sets_up_elsewhere(ctx: Context) -> bool:
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
    inits = legacy_inits(ctx)
    return bool(inits) and all(plain_init(ctx, c) for c in inits)


def legacy_inits(ctx: Context) -> List[cst.Call]:
    """The `init_process_group` calls of a script launched the legacy way (see
    `legacy_launch`), whatever their arguments; none for other files and in `lint`/`amp`."""
    if ctx.options.mode != "ddp":
        return []
    key = "launch.legacy_inits"
    if key not in ctx.facts:
        inits = analysis.calls_to(ctx, INIT_PG)
        legacy = bool(inits) and not analysis.calls_to(ctx, *SPAWN) \
            and not analysis.calls_to(ctx, RUNTIME + ".setup") \
            and (any(behind_if(ctx, c) for c in inits) or _has_local_rank_option(ctx))
        ctx.facts[key] = inits if legacy else []
    return ctx.facts[key]  # type: ignore[return-value]


def plain_init(ctx: Context, call: cst.Call) -> bool:
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


def behind_if(ctx: Context, call: cst.Call) -> bool:
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
                and any(string_value(a.value) in LOCAL_RANK_FLAGS for a in option_strings(call)):
            return True
    return False


def entry_plan(ctx: Context) -> Optional[SetupPlan]:
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
        ctx.facts[key] = None if _user_sets_up_elsewhere(ctx) else entry_plan(ctx)
    return ctx.facts[key]  # type: ignore[return-value]

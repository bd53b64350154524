"""TM601 main-print, TM602 tqdm-main: console output, trackers and progress bars once, from rank 0.

Also home of the small helpers the checkpoint and metrics rules share: recognising rank guards
(`if rank == 0:`, `if tm.is_main():`, `if args.local_rank in [-1, 0]:`, ...), grouping sibling
statements under one `if tm.is_main():` and checking that guarded code runs no collective.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, Iterable, List, Optional, Sequence

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace, wrap
from torchmigrate.imports import dotted
from torchmigrate.nodes import expr, keep_alignment, kwarg, set_kwarg, stmt
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.walk import child_nodes

RUNTIME = "torchmigrate.runtime"


@lru_cache(maxsize=512)
def cached_expr(text: str) -> cst.BaseExpression:
    """`expr(text)`, parsed once per process: LibCST's parser costs ~10 ms per call even for a
    tiny expression, and nodes are immutable, so one parsed node can be reused anywhere."""
    return expr(text)


@lru_cache(maxsize=512)
def cached_stmt(text: str) -> cst.BaseStatement:
    return stmt(text)


# --- shared helpers ------------------------------------------------------------------------

_MAIN_WORDS = ("is_main", "is_master", "master_process", "main_process", "is_primary", "global_zero",
               "process_zero", "process_index", "master_ordinal", "ismaster", "ismain", "is_rank_zero",
               "rank_zero", "rank0")


# What may precede `rank` in a name that holds this process's rank (`local_rank`, `get_rank`,
# `global_rank`); a config flag such as BLIP's `negative_all_rank` (the same on every rank) is
# not one.
_RANK_OWNERS = {"local", "global", "world", "node", "get", "my", "cur", "current", "this", "own", "proc",
                "process", "dist", "gpu", "device", "machine", "is", "host", "worker", "trainer", "data", "dp",
                "tp", "pp", "group", "in", "task", "slurm", "ompi", "pmi", "mpi", "hvd", "env"}


def rank_word(word: str) -> bool:
    """`rank`, `local_rank`, `rank_id`, `get_global_rank`: a name with the word `rank` that
    holds (or gets) a process's rank, not a setting about ranks (`negative_all_rank`)."""
    parts = word.lower().split("_")
    i = parts.index("rank") if "rank" in parts else -1
    return i == 0 or (i > 0 and parts[i - 1] in _RANK_OWNERS)


def _rankish_word(word: str) -> bool:
    w = word.lower()
    if rank_word(w) or w in ("localrank", "globalrank", "master"):
        return True
    return any(s in w for s in _MAIN_WORDS)


def iter_nodes(node: cst.CSTNode, skip_defs: bool = False) -> Iterable[cst.CSTNode]:
    """Every node under `node` (itself included), in source order, reading fields directly."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if skip_defs and n is not node and isinstance(n, (cst.FunctionDef, cst.ClassDef)):
            continue
        stack.extend(reversed(child_nodes(n)))


def rank_dependent(ctx: Context, test: cst.CSTNode) -> bool:
    """Whether an expression depends on the process's rank (`rank == 0`, `tm.is_main()`,
    `args.local_rank in [-1, 0]`, `dist.get_rank() == 0`, `accelerator.is_main_process`,
    `master_process`, `os.environ["LOCAL_RANK"]`, ...)."""
    cache: Dict[cst.CSTNode, bool] = ctx.facts.setdefault("tm_rank_dependent", {})  # type: ignore[assignment]
    hit = cache.get(test)
    if hit is not None:
        return hit
    result = _mentions_rank(test)
    if not result:
        flags = _rank_flags(ctx)
        result = bool(flags) and any(type(n) in (cst.Name, cst.Attribute) and dotted(n) in flags
                                     for n in iter_nodes(test))
    cache[test] = result
    return result


def _mentions_rank(node: cst.CSTNode) -> bool:
    for n in iter_nodes(node):
        if isinstance(n, cst.Name) and _rankish_word(n.value):
            return True
        if isinstance(n, cst.SimpleString) and "rank" in n.value.lower():
            return True
    return False


def _rank_flags(ctx: Context) -> frozenset:
    """Names the file assigns a rank test to (`save_logs = dist.get_rank() == 0`, open_clip's
    `args.save_logs = args.logs and is_master(args)`): `if save_logs:` is a rank guard too.
    Only rank tests (`rank_polarity`), not any value computed from the rank (`device =
    torch.device(f"cuda:{local_rank}")`) nor nanoGPT's `ddp = int(os.environ.get("RANK", -1)) != -1`,
    which holds on every rank."""
    from torchmigrate.rules.launch import rank_polarity  # launch imports this module

    if not ctx.walked:  # the file's assignments are known once the walk is over
        return frozenset()
    found = ctx.facts.get("tm_rank_flags")
    if found is None:
        names = set()
        for a in analysis.facts(ctx).assigns:
            if rank_polarity(a.value) is not None:
                names.update(n for n in (dotted(t.target) for t in a.targets) if n)
        found = ctx.facts["tm_rank_flags"] = frozenset(names)
    return found  # type: ignore[return-value]


def _early_exit(stmt: cst.CSTNode) -> bool:
    """`if <rank test>: return` (or continue/break) before the node: the rest runs on some ranks
    only. (`raise` is not counted: it stops the whole job, so it is a check, not a guard.)"""
    if not isinstance(stmt, cst.If) or stmt.orelse is not None:
        return False
    body = stmt.body
    stmts = body.body if isinstance(body, (cst.IndentedBlock, cst.SimpleStatementSuite)) else ()
    if not stmts:
        return False
    last = stmts[-1]
    smalls = last.body if isinstance(last, cst.SimpleStatementLine) else [last]
    return any(isinstance(s, (cst.Return, cst.Continue, cst.Break)) for s in smalls)


def _rank_exits(ctx: Context, block: cst.CSTNode) -> List[tuple]:
    """(index, statement) of the `if <rank test>: return` statements of a block (cached)."""
    cache: Dict[cst.CSTNode, List[tuple]] = ctx.facts.setdefault("tm_rank_exits", {})  # type: ignore[assignment]
    hit = cache.get(block)
    if hit is None:
        hit = cache[block] = [(i, s) for i, s in enumerate(body_of(block) or ())
                              if _early_exit(s) and rank_dependent(ctx, s.test)]
    return hit


def body_of(parent: cst.CSTNode) -> Optional[Sequence[cst.CSTNode]]:
    if isinstance(parent, (cst.IndentedBlock, cst.Module, cst.SimpleStatementSuite)):
        return parent.body
    return None


def index_in(seq: Sequence[cst.CSTNode], node: cst.CSTNode) -> int:
    for i, s in enumerate(seq):
        if s is node:
            return i
    return -1


def rank_guard_of(ctx: Context, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The innermost `if`/conditional/early exit that makes `node` run on some ranks only, if any
    (within the enclosing function)."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.If) and child is not anc.test and rank_dependent(ctx, anc.test):
            return anc
        if isinstance(anc, cst.IfExp) and child is not anc.test and rank_dependent(ctx, anc.test):
            return anc
        if isinstance(anc, cst.BooleanOperation) and child is anc.right and rank_dependent(ctx, anc.left):
            return anc
        body = body_of(anc)
        if body is not None and isinstance(child, cst.BaseStatement):
            exits = _rank_exits(ctx, anc)
            if exits:
                position = index_in(body, child)
                for i, sibling in exits:
                    if i < position:
                        return sibling
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return None
        child = anc
    return None


def under_rank_guard(ctx: Context, node: cst.CSTNode) -> bool:
    return rank_guard_of(ctx, node) is not None


def collective_guard(ctx: Context, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """A rank guard around `node`, or around a call (in this file) of the function holding it:
    where a collective inserted at `node` would run on some ranks only and hang the others."""
    guard = rank_guard_of(ctx, node)
    if guard is not None:
        return guard
    fn = ctx.enclosing(node, cst.FunctionDef)
    if fn is None:
        return None
    for call in local_calls(ctx).get(fn.name.value, ()):
        guard = rank_guard_of(ctx, call)
        if guard is not None:
            return guard
    return None


def caller_guards(ctx: Context, node: cst.CSTNode, depth: int = 0) -> Optional[List[cst.CSTNode]]:
    """The rank guards under which `node` runs: its own, or, when it has none, those around
    every call (a few levels up) of the function holding it: the helper `save_checkpoint(state)`
    that `main` only calls under `if rank == 0:`, or the `__init__` of a class only built under
    one. Calls from other modules count through the program's facts (an empty list: guarded
    there only). None when some path reaches `node` unguarded, or nothing calls the function."""
    guard = rank_guard_of(ctx, node)
    if guard is not None:
        return [guard]
    fn = ctx.enclosing(node, cst.FunctionDef)
    if fn is None or depth >= 3:
        return None
    klass = ctx.enclosing(fn, cst.ClassDef)
    qual = f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value
    elsewhere = qual in ctx.program.called_elsewhere
    if elsewhere and qual not in ctx.program.guarded_elsewhere:
        return None
    name = klass.name.value if fn.name.value == "__init__" and klass is not None else fn.name.value
    calls = [c for c in local_calls(ctx).get(name, ()) if ctx.enclosing(c, cst.FunctionDef) is not fn]
    if not calls and not elsewhere:  # (a recursive call adds no path from outside)
        return None
    out: List[cst.CSTNode] = []
    for call in calls:
        found = caller_guards(ctx, call, depth + 1)
        if found is None:
            return None
        out.extend(found)
    return out


def local_calls(ctx: Context) -> Dict[str, List[cst.Call]]:
    """Calls of this file's functions and methods by name: `name(...)`, `self.name(...)`."""
    found = ctx.facts.get("tm_local_calls")
    if found is None:
        found = {}
        for call, _ in analysis.facts(ctx).calls:
            func = call.func
            if isinstance(func, cst.Name):
                found.setdefault(func.value, []).append(call)
            elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in ("self", "cls"):
                found.setdefault(func.attr.value, []).append(call)
        ctx.facts["tm_local_calls"] = found
    return found  # type: ignore[return-value]


def scope_of(ctx: Context, node: cst.CSTNode) -> cst.CSTNode:
    """`ctx.scope_of`, cached: the function, class, lambda or module whose body holds `node`."""
    cache: Dict[cst.CSTNode, cst.CSTNode] = ctx.facts.setdefault("tm_scope", {})  # type: ignore[assignment]
    hit = cache.get(node)
    if hit is None:
        hit = cache[node] = ctx.scope_of(node)
    return hit


def assignments(ctx: Context) -> Dict[tuple, List[cst.Assign]]:
    """`(scope, name)` -> the Assign statements binding the plain name `name` in `scope`, and
    `(scope, None)` -> every Assign of the scope; computed once per file."""
    index = ctx.facts.get("tm_assignments")
    if index is None:
        index = {}
        for assign in analysis.facts(ctx).assigns:
            scope = scope_of(ctx, assign)
            index.setdefault((scope, None), []).append(assign)
            for t in assign.targets:
                if isinstance(t.target, cst.Name):
                    index.setdefault((scope, t.target.value), []).append(assign)
        ctx.facts["tm_assignments"] = index
    return index  # type: ignore[return-value]


def names_in(ctx: Context, node: cst.CSTNode) -> frozenset:
    """Plain names read or written anywhere under `node` (cached per node; the names come from
    the context's node index rather than a walk of the subtree)."""
    cache: Dict[cst.CSTNode, frozenset] = ctx.facts.setdefault("tm_names_in", {})  # type: ignore[assignment]
    hit = cache.get(node)
    if hit is None:
        hit = cache[node] = frozenset(n.value for n in ctx.within(node, cst.Name))  # type: ignore[attr-defined]
    return hit


def active(ctx: Context) -> bool:
    """DDP-conversion rules rewrite in `ddp`; in `lint` they check files that are already
    distributed (torch.distributed / DDP / the runtime)."""
    mode = ctx.options.mode
    if mode == "ddp":
        return True
    if mode == "lint":
        return analysis.is_distributed(ctx)
    return False


_COLLECTIVE_SUFFIXES = ("all_reduce", "all_gather", "all_gather_object", "reduce", "gather", "gather_object",
                        "broadcast", "broadcast_object_list", "barrier", "reduce_scatter",
                        "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "gather_for_metrics",
                        "scatter", "monitored_barrier", "main_process_first")


def is_collective(name: Optional[str]) -> bool:
    """A resolved call name that communicates (torch.distributed or the runtime)."""
    if not name:
        return False
    if name.startswith("torch.distributed.") or name.startswith(RUNTIME + "."):
        return name.rsplit(".", 1)[1] in _COLLECTIVE_SUFFIXES
    return False


def runs_user_code(ctx: Context, node: cst.CSTNode) -> bool:
    """Whether evaluating `node` may run a forward pass, a collective or a function of this file
    (which might do either): such code must run on every rank, never under a rank guard."""
    f = analysis.facts(ctx)
    models = set(analysis.trained_models(ctx))
    for n in iter_nodes(node):
        if not isinstance(n, cst.Call):
            continue
        func = n.func
        if isinstance(func, cst.Name) and func.value in f.functions:
            if not pure_helper(ctx, f.functions[func.value]):
                return True
            continue
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in ("self", "cls") \
                and func.attr.value in f.functions:
            if not pure_helper(ctx, f.functions[func.attr.value]):
                return True
            continue
        name = ctx.resolve(func)
        if is_collective(name):
            return True
        d = dotted(func)
        if d and analysis.model_root(d) in models and d == analysis.model_root(d):
            return True  # model(x)
    return False


# Builtins and tensor/array methods that compute on values: no forward pass, no collective.
_PURE_BUILTINS = frozenset({"len", "min", "max", "abs", "sum", "range", "float", "int", "str", "round", "list",
                            "tuple", "dict", "zip", "enumerate", "sorted", "isinstance", "format"})
_PURE_METHODS = frozenset({"clamp", "clamp_", "cpu", "numpy", "detach", "float", "double", "half", "int", "long",
                           "mul", "mul_", "add", "add_", "div", "div_", "sub", "permute", "transpose", "view",
                           "reshape", "squeeze", "unsqueeze", "clone", "to", "item", "tolist", "max", "min", "sum",
                           "mean", "astype", "size", "contiguous", "flatten", "expand", "repeat", "type", "format",
                           "append", "join", "split", "cat", "stack", "zeros", "ones", "zeros_like", "ones_like",
                           "arange", "linspace", "tensor", "from_numpy", "clip", "round", "exp", "log", "sqrt", "pow"})


def pure_helper(ctx: Context, func: cst.FunctionDef) -> bool:
    """A function of this file that only computes on values (`denorm(x)`: `(x + 1) / 2`,
    clamped): builtins and tensor/array methods, no call of a model, of `self.<anything>`, of
    another function of the file, or of a collective. Its calls may go under a rank guard."""
    memo = ctx.facts.setdefault("tm_pure_helpers", {})
    if func in memo:
        return memo[func]
    pure = True
    for call in ctx.within(func, cst.Call):
        target = call.func
        if isinstance(target, cst.Name):
            pure = target.value in _PURE_BUILTINS
        elif isinstance(target, cst.Attribute):
            receiver = target.value
            pure = not (isinstance(receiver, cst.Name) and receiver.value in ("self", "cls")) \
                and target.attr.value in _PURE_METHODS and not is_collective(ctx.resolve(target))
        else:
            pure = False
        if not pure:
            break
    memo[func] = pure
    return pure


_IF_MAIN_CACHE: Dict[str, cst.If] = {}


def if_main(tm: str, body: Sequence[cst.BaseStatement]) -> cst.If:
    """`if tm.is_main():` around statements (indentation is relative, so any depth works)."""
    header = _IF_MAIN_CACHE.get(tm)
    if header is None:
        header = cst.parse_statement(f"if {tm}.is_main():\n    pass\n")  # type: ignore[assignment]
        _IF_MAIN_CACHE[tm] = header
    return header.with_changes(body=cst.IndentedBlock(body=list(body)))


def guardable_line(ctx: Context, node: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The statement line holding `node` when it is the line's only statement and the line sits
    in an indented block or the module (so it can be wrapped in `if tm.is_main():`)."""
    line = ctx.statement_of(node)
    if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
        return None
    if not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
        return None
    return line


def sibling_runs(ctx: Context, lines: Iterable[cst.CSTNode]) -> List[List[cst.CSTNode]]:
    """Group statements into runs of adjacent siblings (same block, consecutive), in order."""
    by_parent: Dict[cst.CSTNode, List[int]] = {}
    seen = set()
    for line in lines:
        if line in seen:
            continue
        seen.add(line)
        parent = ctx.parent(line)
        body = body_of(parent)
        if body is None:
            continue
        by_parent.setdefault(parent, []).append(index_in(body, line))
    runs: List[List[cst.CSTNode]] = []
    for parent, indices in by_parent.items():
        body = body_of(parent)
        indices.sort()
        run: List[int] = []
        for i in indices:
            if run and i != run[-1] + 1:
                runs.append([body[j] for j in run])
                run = []
            run.append(i)
        if run:
            runs.append([body[j] for j in run])
    return runs


def guard_edit(ctx: Context, run: Sequence[cst.CSTNode]):
    tm = ctx.tm
    return wrap(run[0], run[-1], lambda stmts: if_main(tm, stmts))


# --- TM601 ---------------------------------------------------------------------------------

SUMMARY_WRITERS = {
    "torch.utils.tensorboard.SummaryWriter",
    "torch.utils.tensorboard.writer.SummaryWriter",
    "tensorboardX.SummaryWriter",
    "tensorboardX.writer.SummaryWriter",
}
_TRACKER_ROOTS = ("wandb.", "mlflow.")
_TRACKER_FACTORIES = {"mlflow.start_run"}


def _print_shadowed(ctx: Context) -> bool:
    """`print` is not the builtin, or the program replaced the builtin with a rank-aware one
    (`builtins.print = ...`, here or in a module it runs: see ModuleView.print_override)."""
    f = analysis.facts(ctx)
    if "print" in ctx.imports.names or ctx.program.print_override:
        return True
    fn = f.functions.get("print")
    if fn is not None:
        return True
    for assign in f.assigns:
        for t in assign.targets:
            if isinstance(t.target, cst.Name) and t.target.value == "print":
                return True
            if dotted(t.target) in ("builtins.print", "__builtin__.print"):
                return True
    return False


def _is_main_only_arg(ctx: Context, node: cst.CSTNode) -> bool:
    parent = ctx.parent(node)
    if isinstance(parent, cst.Arg):
        call = ctx.parent(parent)
        return isinstance(call, cst.Call) and ctx.resolve(call.func) == RUNTIME + ".main_only"
    return False


def _attributes_read(ctx: Context, call: cst.Call) -> List[str]:
    """Attributes of the writer `call` creates (`writer = SummaryWriter(...)`, `self.writer = ...`)
    that the file reads as values (`writer.log_dir`), not calls (`writer.add_scalar(...)`)."""
    parent = ctx.parent(call)
    if not isinstance(parent, cst.Assign) or len(parent.targets) != 1:
        return []
    target = dotted(parent.targets[0].target)
    if target is None:
        return []
    read = []
    for name in ctx.named(target.rsplit(".", 1)[-1]):
        owner = name if "." not in target else ctx.parent(name)  # the `writer` / `self.writer` expression
        attribute = ctx.parent(owner)
        if not isinstance(attribute, cst.Attribute) or attribute.value is not owner or dotted(owner) != target:
            continue
        used = ctx.parent(attribute)
        if not (isinstance(used, cst.Call) and used.func is attribute) and attribute.attr.value not in read:
            read.append(attribute.attr.value)
    return read


def _main_only_fix(tm: str):
    def fix(call: cst.Call) -> cst.Call:
        if not call.args:
            return call.with_changes(func=cached_expr(f"{tm}.main_only"), args=[cst.Arg(value=call.func)])
        # `SummaryWriter(\n    log_dir=...)` -> `tm.main_only(SummaryWriter,\n    log_dir=...)`
        ws = call.whitespace_before_args
        after = ws if isinstance(ws, cst.ParenthesizedWhitespace) else cst.SimpleWhitespace(" ")
        first = cst.Arg(value=call.func, comma=cst.Comma(whitespace_after=after))
        return call.with_changes(func=cached_expr(f"{tm}.main_only"), whitespace_before_args=cst.SimpleWhitespace(""),
                                 args=[first, *call.args])
    return fix


def _base(target: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(target, cst.Subscript):
        target = target.value
    return target


def _tracker_target(ctx: Context, target: cst.BaseExpression) -> bool:
    """`wandb.run.summary["best"] = ...`, `wandb.config.lr = ...`."""
    while isinstance(target, cst.Subscript):
        target = target.value
    name = ctx.resolve(target)
    return bool(name) and name.startswith(_TRACKER_ROOTS)


class MainPrint(Rule):
    """
    ## What it does
    Makes console output and experiment trackers run once, on the main process (global rank 0):

    - `print(...)` becomes `tm.print(...)`, which prints on rank 0 only. The arguments are still
      evaluated on every rank, so a print that calls an evaluation helper (which may reduce
      metrics across ranks) stays safe. Continuation lines aligned under the call's arguments
      move with them.
    - `SummaryWriter(...)` (torch.utils.tensorboard, tensorboardX) becomes
      `tm.main_only(SummaryWriter, ...)`: the real writer on rank 0, a null object that absorbs
      every call elsewhere, so `writer.add_scalar(...)` / `writer.close()` need no guard. A
      writer whose attributes the file reads as values (`os.path.join(writer.log_dir, ...)`)
      is reported instead: the stand-in has no `log_dir` to give.
    - `wandb.init(...)` gets `mode=None if tm.is_main() else "disabled"` (an existing `mode=m`
      becomes `m if tm.is_main() else "disabled"`): on the other ranks every wandb call is then a
      no-op and `wandb.config` still holds the values given to init, so `wandb.log(...)` needs no
      guard. (Where this file logs to wandb without initialising it, the statements are guarded.)
    - `mlflow.*(...)` statements (`mlflow.log_metric`, `mlflow.log_params`, ...) go under
      `if tm.is_main():`; `with mlflow.start_run():` becomes `with tm.main_only(mlflow.start_run):`.

    `logging` needs nothing: `tm.setup()` disables INFO and DEBUG records on the other ranks, so
    `logger.info(...)` prints once while warnings and errors still show on every rank.

    Output already under a rank guard (`if tm.is_main():`, `if rank == 0:`,
    `if args.local_rank in [-1, 0]:`, ...) is left alone, and so is a `print` that the file
    redefines or imports from elsewhere.

    ## Why is this bad?
    Under `torchrun --nproc-per-node=8` every line is printed eight times, interleaved; every
    rank opens its own TensorBoard event file and its own wandb run. Logging calls whose
    arguments run a forward pass or a function of this file are not guarded automatically (a
    guard there could skip a collective on the other ranks and hang): they are reported.

    In `lint` mode (files that already use torch.distributed) unguarded `print` calls are reported.
    """

    code = "TM601"
    name = "main-print"
    summary = "Print, TensorBoard and wandb/mlflow logging on the main process only"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(log_dir)
            print(f"epoch {epoch} loss {loss.item():.3f}")
            """,
            after="""
            import torch
            from torch.utils.tensorboard import SummaryWriter
            import torchmigrate.runtime as tm
            writer = tm.main_only(SummaryWriter, log_dir)
            tm.print(f"epoch {epoch} loss {loss.item():.3f}")
            """,
        ),
        Example(
            before="""
            import mlflow
            import torch
            import wandb
            wandb.init(project="demo", config=vars(args))
            for epoch in range(10):
                wandb.log({"loss": loss})
                mlflow.log_metric("loss", loss)
            """,
            after="""
            import mlflow
            import torch
            import wandb
            import torchmigrate.runtime as tm
            wandb.init(project="demo", config=vars(args), mode=None if tm.is_main() else "disabled")
            for epoch in range(10):
                wandb.log({"loss": loss})
                if tm.is_main():
                    mlflow.log_metric("loss", loss)
            """,
        ),
        Example(
            before="""
            import torch
            if rank == 0:
                print("saved")
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        f = analysis.facts(ctx)
        tm = ctx.tm
        imports = [ctx.runtime_import()]
        shadowed = None
        guard_lines: List[cst.CSTNode] = []
        for call, name in f.calls:
            func = call.func
            if name is None and isinstance(func, cst.Name) and func.value == "print":
                if shadowed is None:
                    shadowed = _print_shadowed(ctx)
                if shadowed or caller_guards(ctx, call) is not None:
                    continue
                edits = [replace(func, lambda _f: cached_expr(f"{tm}.print"))]
                align = keep_alignment(call, f"{tm}.print", 0 if isinstance(ctx.parent(call), cst.Expr) else None)
                if align is not None:
                    edits.append(replace(call, align))
                self.report(call, "print runs on every rank; tm.print prints once, on the main process",
                            edits=edits, imports=imports)
            elif name in SUMMARY_WRITERS:
                if caller_guards(ctx, call) is not None or _is_main_only_arg(ctx, call):
                    continue
                read = _attributes_read(ctx, call)
                if read:
                    self.report(call, f"every rank would write its own TensorBoard event files, and the writer's "
                                      f"`{read[0]}` is read as a value, which tm.main_only's stand-in on the other "
                                      f"ranks cannot give: create the writer under `if {tm}.is_main():` and take "
                                      f"`{read[0]}` from the arguments")
                    continue
                self.report(call, "every rank would write its own TensorBoard event files; create the "
                                  "writer on the main process only (tm.main_only)",
                            edits=[replace(call, _main_only_fix(tm))], imports=imports)
            elif name == "wandb.init" and not any(a.star == "**" for a in call.args):
                self._wandb_init(call)
            elif name and name.startswith(_TRACKER_ROOTS) and not name.rsplit(".", 1)[1][:1].isupper():
                if name.startswith("wandb.") and self._wandb_disabled_elsewhere():
                    continue  # every wandb call is a no-op on the ranks where wandb.init got mode="disabled"
                self._tracker_call(call, name, guard_lines)
        # Assignment targets resolve to tracker names only through an import of the tracker:
        # a file that imports neither needs no resolving of every assignment's targets.
        tracked = ctx.imports.imports_module("wandb") or ctx.imports.imports_module("mlflow")
        for assign in f.assigns if tracked else ():
            if any(_tracker_target(ctx, t.target) for t in assign.targets):
                if self._wandb_disabled_elsewhere() and (ctx.resolve(_base(assign.targets[0].target)) or "").startswith("wandb."):
                    continue
                line = guardable_line(ctx, assign)
                if line is not None and not under_rank_guard(ctx, assign) and not runs_user_code(ctx, assign.value):
                    guard_lines.append(line)
        for run in sibling_runs(ctx, guard_lines):
            self.report(run[0], "experiment-tracker calls run on every rank; log from the main process only",
                        edits=[guard_edit(ctx, run)], imports=imports)

    def _wandb_disabled_elsewhere(self) -> bool:
        """The file calls `wandb.init(...)` in a form this rule gives a rank-dependent `mode=`."""
        found = self.ctx.facts.get("tm_wandb_init")
        if found is None:
            found = any(name == "wandb.init" and not any(a.star == "**" for a in call.args)
                        for call, name in analysis.facts(self.ctx).calls)
            self.ctx.facts["tm_wandb_init"] = found
        return bool(found)

    def _wandb_init(self, call: cst.Call) -> None:
        """`wandb.init(...)` -> `wandb.init(..., mode=None if tm.is_main() else "disabled")`: on the
        other ranks every wandb call (log, watch, config, Image, finish) becomes a no-op, and
        `wandb.config` still holds the values given to init, so nothing else needs a guard."""
        ctx = self.ctx
        current = next((a for a in call.args if a.keyword is not None and a.keyword.value == "mode"), None)
        if current is not None and rank_dependent(ctx, current.value):
            return
        if caller_guards(ctx, call) is not None:
            return
        tm = ctx.tm

        def fix(node: cst.Call) -> cst.Call:
            mode = next((a for a in node.args if a.keyword is not None and a.keyword.value == "mode"), None)
            value = cst.Name("None") if mode is None else mode.value
            if isinstance(value, _NEEDS_PARENS) and not value.lpar:
                value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            new = cst.IfExp(test=cached_expr(f"{tm}.is_main()"), body=value, orelse=cst.SimpleString('"disabled"'))
            return set_kwarg(node, "mode", new) if mode is not None else add_kwarg(node, "mode", new)

        self.report(call, "wandb.init starts a run on every rank; disable wandb on the other ranks "
                          "(mode=\"disabled\" turns every wandb call into a no-op there)",
                    edits=[replace(call, fix)], imports=[ctx.runtime_import()])

    def _tracker_call(self, call: cst.Call, name: str, guard_lines: List[cst.CSTNode]) -> None:
        ctx = self.ctx
        parent = ctx.parent(call)
        if not isinstance(parent, (cst.Expr, cst.Assign, cst.AnnAssign, cst.WithItem)):
            return  # nested in another expression (e.g. an argument of wandb.log)
        if parent is not None and not isinstance(parent, cst.Expr) and getattr(parent, "value", getattr(parent, "item", None)) is not call:
            return
        if caller_guards(ctx, call) is not None:
            return
        if isinstance(parent, cst.Expr):
            line = guardable_line(ctx, call)
            if line is None:
                self.report(call, f"{name}(...) runs on every rank: put it under `if {ctx.tm}.is_main():`")
                return
            if runs_user_code(ctx, call):
                self.report(call, f"{name}(...) runs on every rank, but its arguments run model or helper code that "
                                  f"must run on every rank: compute them first, then log under "
                                  f"`if {ctx.tm}.is_main():`")
                return
            guard_lines.append(line)
        elif name in _TRACKER_FACTORIES:
            self.report(call, f"{name}(...) starts a run on every rank; start it on the main process only "
                              f"(tm.main_only returns a null object elsewhere)",
                        edits=[replace(call, _main_only_fix(ctx.tm))], imports=[ctx.runtime_import()])


# --- TM602 ---------------------------------------------------------------------------------

TQDM_CALLS = {
    f"{module}.{fn}"
    for module in ("tqdm", "tqdm.auto", "tqdm.autonotebook", "tqdm.notebook", "tqdm.std", "tqdm.rich",
                   "tqdm.asyncio", "tqdm.tk", "tqdm.gui", "tqdm.cli")
    for fn in ("tqdm", "trange")
}

_NEEDS_PARENS = (cst.IfExp, cst.Lambda, cst.NamedExpr, cst.Yield)


def add_kwarg(call: cst.Call, name: str, value: cst.BaseExpression) -> cst.Call:
    """`set_kwarg` that keeps one-argument-per-line calls with a trailing comma in that layout."""
    args = list(call.args)
    if any(a.keyword is not None and a.keyword.value == name for a in args) or not args or args[-1].star:
        return set_kwarg(call, name, value)
    last = args[-1]
    comma = last.comma
    before = args[-2].comma.whitespace_after if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
        else call.whitespace_before_args
    if not isinstance(before, cst.ParenthesizedWhitespace):
        before = cst.SimpleWhitespace(" ")
    if isinstance(comma, cst.Comma) and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace):
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=before))
        args.append(kwarg(name, value).with_changes(comma=comma))
        return call.with_changes(args=args)
    if not isinstance(comma, cst.Comma) and isinstance(last.whitespace_after_arg, cst.ParenthesizedWhitespace):
        # closing parenthesis on its own line, no trailing comma
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=before),
                                     whitespace_after_arg=cst.SimpleWhitespace(""))
        args.append(kwarg(name, value).with_changes(whitespace_after_arg=last.whitespace_after_arg))
        return call.with_changes(args=args)
    return set_kwarg(call, name, value)


def _disable_fix(tm: str):
    def fix(call: cst.Call) -> cst.Call:
        for a in call.args:
            if a.keyword is not None and a.keyword.value == "disable":
                value = a.value
                if isinstance(value, _NEEDS_PARENS) and not value.lpar:
                    value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                if any(isinstance(n, cst.Name) and n.value == "None" for n in iter_nodes(value)):
                    # `disable=None` means "off when not a terminal": keep that value on rank 0
                    new = cst.IfExp(test=cached_expr(f"{tm}.is_main()"), body=value, orelse=cst.Name("True"))
                    return set_kwarg(call, "disable", new)
                new = cst.BooleanOperation(left=value, operator=cst.Or(), right=cached_expr(f"not {tm}.is_main()"))
                return set_kwarg(call, "disable", new)
        return add_kwarg(call, "disable", cached_expr(f"not {tm}.is_main()"))
    return fix


class TqdmMain(Rule):
    """
    ## What it does
    Adds `disable=not tm.is_main()` to `tqdm(...)` / `trange(...)` progress bars (any import
    spelling: `tqdm.tqdm`, `tqdm.auto`, `tqdm.notebook`, aliases). An existing `disable=expr`
    becomes `disable=expr or not tm.is_main()` (`disable=expr if tm.is_main() else True` when
    `expr` may be `None`, tqdm's "off when not a terminal"); a `disable=` that already depends
    on the rank is kept, and so are bars under a rank guard.

    ## Why is this bad?
    Every rank draws its own bar on the same terminal: with 8 processes the output is 8
    interleaved, constantly redrawn bars (tqdm/tqdm#1294). The bar object still exists on the
    other ranks (disabled bars accept `set_postfix`, `update`, `write`, ...), so nothing else
    changes. In `lint` mode (distributed files) bars shown on every rank are reported.
    """

    code = "TM602"
    name = "tqdm-main"
    summary = "Show tqdm progress bars on the main process only"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from tqdm import tqdm
            for x, y in tqdm(train_loader, desc="train"):
                pass
            """,
            after="""
            import torch
            from tqdm import tqdm
            import torchmigrate.runtime as tm
            for x, y in tqdm(train_loader, desc="train", disable=not tm.is_main()):
                pass
            """,
        ),
        Example(
            before="""
            import torch
            from tqdm.auto import trange
            for step in trange(n, disable=args.quiet):
                pass
            """,
            after="""
            import torch
            from tqdm.auto import trange
            import torchmigrate.runtime as tm
            for step in trange(n, disable=args.quiet or not tm.is_main()):
                pass
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        for call, name in analysis.facts(ctx).calls:
            if name not in TQDM_CALLS:
                continue
            if any(a.star == "**" for a in call.args):
                continue  # disable= may come from **kwargs
            if name.endswith(".tqdm") and len([a for a in call.args if a.keyword is None]) > 10:
                continue  # disable passed positionally
            disable = next((a for a in call.args if a.keyword is not None and a.keyword.value == "disable"), None)
            if disable is not None and rank_dependent(ctx, disable.value):
                continue
            if under_rank_guard(ctx, call):
                continue
            self.report(call, "progress bar drawn by every rank; show it on the main process only",
                        edits=[replace(call, _disable_fix(ctx.tm))], imports=[ctx.runtime_import()])

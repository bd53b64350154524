"""TM601 main-print: console output, TensorBoard writers and experiment trackers (wandb,
mlflow) once, from the main process."""

from __future__ import annotations

from typing import List

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import expr, keep_alignment, set_kwarg
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.collectives import runs_user_code
from torchmigrate.program.rank_guards import caller_guards, under_rank_guard
from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.effects import TRACKER_RUNS
from torchmigrate.program.loaders import TQDM_CALLS
from torchmigrate.program.writes import writer_class
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules._active import active
from torchmigrate.rules._guards import guard_edit, guardable_line, main_only_call, sibling_runs
from torchmigrate.rules.logging.base import NEEDS_PARENS, add_kwarg
from torchmigrate.rules.metrics.tm703_gather_list_mean import logged_step_values

SUMMARY_WRITERS = {
    "torch.utils.tensorboard.SummaryWriter",
    "torch.utils.tensorboard.writer.SummaryWriter",
    "tensorboardX.SummaryWriter",
    "tensorboardX.writer.SummaryWriter",
}
_TRACKER_ROOTS = ("wandb.", "mlflow.", "tensorboard_logger.", "nni.")
_TRACKER_FACTORIES = {"mlflow.start_run"}


_STREAM_WRITES = frozenset({"sys.stdout.write", "sys.stderr.write"})


_PPRINT = frozenset({"pprint.pprint", "pprint.pp"})


def _pretty_printers(ctx: Context) -> frozenset:
    """Names bound to a `pprint.PrettyPrinter(...)` in this file (`_pp = pprint.PrettyPrinter()`,
    then `_pp.pprint(args)` in a helper): their `pprint()` prints like `pprint.pprint`."""
    if not ctx.imports.imports_module("pprint"):
        return frozenset()
    return frozenset(dotted(t.target) for a in analysis.facts(ctx).assigns if isinstance(a.value, cst.Call)
                     and ctx.resolve(a.value.func) == "pprint.PrettyPrinter" for t in a.targets) - {None}


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
    that the file reads as values (`writer.log_dir`), not calls (`writer.add_scalar(...)`, nor a
    method of an attribute called as a statement, `writer.file_writer.flush()`)."""
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
        used, chain = ctx.parent(attribute), attribute
        while isinstance(used, cst.Attribute) and used.value is chain:  # `writer.file_writer.flush()`
            used, chain = ctx.parent(used), used
        called = isinstance(used, cst.Call) and used.func is chain
        if chain is not attribute and called and isinstance(ctx.parent(used), cst.Expr):
            continue  # a method of an attribute, called for its effect: the stand-in absorbs it
        if not called and attribute.attr.value not in read:
            read.append(attribute.attr.value)
    return read


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
    - `sys.stdout.write(line)` (a progress line written straight to the console) becomes
      `tm.print(line, end="")`, and `sys.stderr.write(line)` `tm.print(line, end="",
      file=sys.stderr)`: once, on rank 0. A write whose result is used is left alone.
    - `pprint.pprint(x)` (also `from pprint import pprint`, `pp`, and `.pprint(x)` of a
      `pprint.PrettyPrinter` made in the file) goes under `if tm.is_main():`.
    - `SummaryWriter(...)` (torch.utils.tensorboard, tensorboardX) becomes
      `tm.main_only(SummaryWriter, ...)`: the real writer on rank 0, a null object that absorbs
      every call elsewhere, so `writer.add_scalar(...)` / `writer.close()` need no guard. The
      same for a writer reached any other way: through any receiver
      (`importlib.import_module(m).SummaryWriter(...)`), tensorboard_logger's `Logger`, or a
      class of the program derived from one in any module (`class TBLogger(SummaryWriter)`,
      from the program's effects). A
      writer whose attributes the file reads as values (`os.path.join(writer.log_dir, ...)`)
      is reported instead: the stand-in has no `log_dir` to give. An experiment tracker's run
      object is made the same way (`visdom.Visdom(...)`, `comet_ml.Experiment(...)`,
      `neptune.init_run(...)`, `aim.Run(...)`, `clearml.Task.init(...)`): one run, on rank 0,
      and `vis.line(...)`, `experiment.log_metric(...)` absorbed elsewhere.
    - `wandb.init(...)` gets `mode=None if tm.is_main() else "disabled"` (an existing `mode=m`
      becomes `m if tm.is_main() else "disabled"`): on the other ranks every wandb call is then a
      no-op and `wandb.config` still holds the values given to init, so `wandb.log(...)` needs no
      guard. (Where this file logs to wandb without initialising it, the statements are guarded.)
    - `mlflow.*(...)`, `tensorboard_logger.*(...)` and `nni.*(...)` statements (`mlflow.log_metric`,
      `configure(logdir)`, `log_value(...)`, `nni.report_final_result(acc)`, ...) go under
      `if tm.is_main():` (NNI takes one result per trial); `with mlflow.start_run():` becomes `with tm.main_only(mlflow.start_run):`.

    `logging` needs nothing: `tm.setup()` disables INFO and DEBUG records on the other ranks, so
    `logger.info(...)` prints once while warnings and errors still show on every rank.

    `tqdm.write(...)` and a bar's `.write(...)` (which `disable=` does not silence) go under
    `if tm.is_main():`, and `builtins.print(...)` (the program's own `print` function over the
    builtin) becomes `tm.print(...)`.

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
        pretty_lines: List[cst.CSTNode] = []
        printers = _pretty_printers(ctx)
        for call, name in f.calls:
            func = call.func
            if isinstance(ctx.parent(call), cst.Expr) and (name in _PPRINT or (
                    printers and isinstance(func, cst.Attribute) and func.attr.value in ("pprint", "pp")
                    and dotted(func.value) in printers)):
                line = guardable_line(ctx, call)
                if line is not None and caller_guards(ctx, call) is None and not under_rank_guard(ctx, call):
                    pretty_lines.append(line)
                continue
            if isinstance(ctx.parent(call), cst.Expr) and self._tqdm_write(call, name):
                # `tqdm.write(msg)` / `pbar.write(msg)`: a print that keeps the bars intact, on every
                # rank (tqdm's `disable=` hides a bar, not what is written through it)
                line = guardable_line(ctx, call)
                if line is not None and caller_guards(ctx, call) is None and not under_rank_guard(ctx, call):
                    pretty_lines.append(line)
                continue
            if name == "builtins.print" and isinstance(func, cst.Attribute) and caller_guards(ctx, call) is None:
                # the program's own print (`def print(*args, **kwargs): builtins.print(*args, flush=True)`,
                # imported everywhere in place of the builtin): its one real print, once
                self.report(call, "print runs on every rank; tm.print prints once, on the main process",
                            edits=[replace(func, lambda _f: expr(f"{tm}.print"))], imports=imports)
                continue
            if name is None and isinstance(func, cst.Name) and func.value == "print":
                if shadowed is None:
                    shadowed = _print_shadowed(ctx)
                if shadowed or caller_guards(ctx, call) is not None:
                    continue
                edits = [replace(func, lambda _f: expr(f"{tm}.print"))]
                align = keep_alignment(call, f"{tm}.print", 0 if isinstance(ctx.parent(call), cst.Expr) else None)
                if align is not None:
                    edits.append(replace(call, align))
                self.report(call, "print runs on every rank; tm.print prints once, on the main process",
                            edits=edits, imports=imports)
            elif name in _STREAM_WRITES and dotted(func) == name and len(call.args) == 1 \
                    and call.args[0].keyword is None and not call.args[0].star and isinstance(ctx.parent(call), cst.Expr):
                # `sys.stdout.write(progress)`: the console line a print would be, without its newline
                if shadowed is None:
                    shadowed = _print_shadowed(ctx)
                if shadowed or caller_guards(ctx, call) is not None:
                    continue
                extra = cst.parse_expression('f(x, end=""' + (", file=sys.stderr" if name == "sys.stderr.write" else "")
                                             + ")").args[1:]
                self.report(call, f"`{name}` runs on every rank; {tm}.print writes it once, on the main process",
                            edits=[replace(call, lambda c, extra=extra: c.with_changes(
                                func=expr(f"{tm}.print"),
                                args=[c.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT), *extra]))],
                            imports=imports)
            elif name in SUMMARY_WRITERS or writer_class(ctx, call, name):
                if caller_guards(ctx, call) is not None or _is_main_only_arg(ctx, call):
                    continue
                read = _attributes_read(ctx, call)
                what = (f"start its own {name} run" if name in TRACKER_RUNS
                        else "write its own TensorBoard event files")
                if read:
                    self.report(call, f"every rank would {what}, and the writer's "
                                      f"`{read[0]}` is read as a value, which tm.main_only's stand-in on the other "
                                      f"ranks cannot give: create the writer under `if {tm}.is_main():` and take "
                                      f"`{read[0]}` from the arguments")
                    continue
                self.report(call, f"every rank would {what}; create the "
                                  "writer on the main process only (tm.main_only)",
                            edits=[replace(call, main_only_call(tm))], imports=imports)
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
        for run in sibling_runs(ctx, pretty_lines):
            self.report(run[0], "pprint and tqdm.write print on every rank; print from the main process only",
                        edits=[guard_edit(ctx, run)], imports=imports)

    def _tqdm_write(self, call: cst.Call, name) -> bool:
        """`tqdm.write(...)` (any of tqdm's modules), or `.write(...)` on a name bound to a
        `tqdm(...)` bar in this file (`pbar = tqdm(loader)`, `for x in (pbar := tqdm(...))`)."""
        func = call.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "write"):
            return False
        if name and name.rsplit(".", 1)[0] in TQDM_CALLS:
            return True
        bar = dotted(func.value)
        if bar is None:
            return False
        bars = self.ctx.facts.get("tm_tqdm_bars")
        if bars is None:
            bars = self.ctx.facts["tm_tqdm_bars"] = frozenset(
                dotted(t.target) for a in analysis.facts(self.ctx).assigns if isinstance(a.value, cst.Call)
                and self.ctx.resolve(a.value.func) in TQDM_CALLS for t in a.targets) - {None}
        return bar in bars

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
            if isinstance(value, NEEDS_PARENS) and not value.lpar:
                value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
            new = cst.IfExp(test=expr(f"{tm}.is_main()"), body=value, orelse=cst.SimpleString('"disabled"'))
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
            if "TM703" in ctx.enabled and logged_step_values(ctx, call, name):
                # TM703 makes the step's numbers the ranks' mean inside the arguments: a collective
                # every rank must reach, so the arguments run everywhere and the call on rank 0
                self.report(call, f"{name}(...) runs on every rank; log from the main process only (tm.main_only "
                                  f"evaluates the arguments, the ranks' means, on every rank)",
                            edits=[replace(call, main_only_call(ctx.tm))], imports=[ctx.runtime_import()])
                return
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
                        edits=[replace(call, main_only_call(ctx.tm))], imports=[ctx.runtime_import()])

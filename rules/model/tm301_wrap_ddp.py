"""TM301: wrap each trained model in DDP (`tm.wrap_model`) before its optimizer is built."""

from __future__ import annotations

import re

import libcst as cst

from torchmigrate.finding import Safety, insert_after, insert_before, replace, replace_with
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg as call_arg
from torchmigrate.syntax.nodes import expr, kwarg, with_args
from torchmigrate.program.loaders import loops_of
from torchmigrate.program.models import DDP_CLASSES
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule, wrap_call
from torchmigrate.rules.model.tm306_data_parallel_to_ddp import dotted_names, dp_condition, rebinds


# DistributedDataParallel's leading parameters, the same in every torch since 1.x.
_DDP_POSITIONS = ("module", "device_ids", "output_device", "dim", "broadcast_buffers")


class WrapDDP(ModelRule):
    """
    ## What it does
    Wraps every trained model in DistributedDataParallel: inserts `model = tm.wrap_model(model)`
    right before the statement that creates the model's optimizer (`self.model = ...` in trainer
    classes, one wrap per model for GANs). Only models whose parameters an optimizer trains are
    wrapped; a frozen teacher or an EMA copy is never passed to an optimizer and stays as it is.
    Models kept in a container and trained by one optimizer (`nets = {"rep": ..., "head": ...}`
    with `params += nets[k].parameters()`, `[p for m in self.members for p in m.parameters()]`)
    are wrapped as the container, `nets = tm.wrap_model(nets)`, which wraps each module of a
    dict or list in place; over a literal (`for m in (encoder, decoder)`) each model is wrapped.
    A model that builds its own optimizer over `self.parameters()` in its `__init__` is
    wrapped where the program makes it (`model = SessionGraph(opt, n)`, in any module): DDP keeps
    the Parameter objects that optimizer already holds. A model created on its optimizer's own
    line (`model = Net(); opt = SGD(model.parameters())`) is wrapped between the two, on that
    line. A model with no optimizer whose parameters the program steps by hand after a backward
    (`for p in model.parameters(): p.data.add_(p.grad, alpha=-lr)`) is wrapped right after it
    is made (where the loop's function is handed it: where its callers make it, in any module):
    DDP averages the gradients in `backward()`, whatever steps them. When a same-file helper builds the optimizer from a model it receives
    (`optimizer = build_optimizer(model, cfg)`), the wrap goes before that call. When the
    optimizer is built again on every pass of a loop (repeats, folds) while the model is wrapped
    once before it, `tm.share_params(model)` goes before each pass's optimizer: weights the pass
    sets again (`self._reset_params()`) would otherwise differ per rank, since DDP shares them
    only when it wraps.

    `tm.wrap_model` moves the model to the rank's device and wraps it in DDP when the script runs
    under torchrun; in a plain `python train.py` run it returns the model unchanged. Models that
    are already wrapped (`DistributedDataParallel`, `tm.wrap_model`, FSDP, Accelerate, DeepSpeed),
    also by a function of the file the model is passed to, are left alone. A script that creates
    its own process group but wraps no model (it averages gradients itself, or not at all) gets
    a report instead of a wrap. Optimizer classes of other libraries (`BertAdam`, `Lion`) count
    when they receive a model's parameters. When parameters are frozen after the wrap or `forward()` uses a submodule only
    in some branches, the wrap passes `find_unused_parameters=True` (see TM303).

    When every backward pass of the file takes a loss summed over its batch (`reduction="sum"`,
    `size_average=False`, `x.sum()`, the VAE tutorial's `BCE + KLD`; `program.losses`) in a loop
    over a training loader the migration shards, with the original's global batch kept, the wrap
    passes `loss_reduction="sum"`: the ranks' gradients are summed, which is the original's
    step over the whole batch (averaged, it would be 1/world_size of it). A loss divided by the
    batch size is a mean and keeps DDP's averaging.

    In a legacy `torch.distributed.launch` script that `ddp` moves onto the runtime (see
    TM101), the script's own `DDP(model, device_ids=[args.local_rank], output_device=...)`
    becomes `tm.wrap_model(model, ...)`, keeping its other options (`find_unused_parameters=`,
    `broadcast_buffers=`): device ids fail on CPU ranks, and an unconditional DDP fails in a
    one-process run.

    In `lint`, for files that already use torch.distributed: reports trained models that are
    never wrapped, and DDP built with a hard-coded `device_ids=[0]` (every rank on GPU 0),
    replaced by `[tm.local_rank()]`.

    ## Why is this bad?
    Without DDP every rank trains its own copy on its own shard and the copies drift apart: no
    gradient is averaged. Wrapping after the optimizer's model is final (moved, loaded) and before
    the first forward is what the DDP documentation requires.

    ## Example
    ```python
    model = Net().to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    ```
    becomes
    ```python
    model = Net().to(device)
    model = tm.wrap_model(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Limitations
    A model created at module level whose optimizer is built inside a function, an optimizer
    whose model cannot be traced, a module that builds its own optimizer from `self.parameters()`
    but is never bound to a name where it is made, and a training script with no optimizer at
    all (parameters updated by hand) are reported for a manual wrap.
    """

    code = "TM301"
    name = "wrap-ddp"
    summary = "Wrap each trained model in DDP (tm.wrap_model) before its optimizer is built"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            import torch
            model = Net().to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            model = Net().to(device)
            model = tm.wrap_model(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            """,
        ),
        Example(
            before="""
            import torch
            class Trainer:
                def __init__(self, cfg):
                    self.model = build_model(cfg)
                    self.teacher = build_teacher(cfg).eval()
                    self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            class Trainer:
                def __init__(self, cfg):
                    self.model = build_model(cfg)
                    self.teacher = build_teacher(cfg).eval()
                    self.model = tm.wrap_model(self.model)
                    self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.lr)
            """,
        ),
    )

    def _moved_under_tests(self, nw) -> bool:
        """Before the wrap, the program moves the model to a device only inside an `if` (`if not
        args.no_cuda: model = model.cuda()`): every move of `nw.name` (`.cuda()`, `.to(device)`, on
        the name or in a value bound to it) in its scope is conditional, so a run that skips them
        keeps the model on the CPU, with its batches (`tm.wrap_model(..., move=False)`)."""
        ctx = self.ctx
        end = ctx.position(nw.anchor) or 0
        moves = []
        for call in ctx.within(nw.scope, cst.Call, skip_defs=True):
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in ("cuda", "to")):
                continue
            if (ctx.position(call) or 0) >= end or (func.attr.value == "to" and not _device_arg(call)):
                continue
            assign = ctx.enclosing(call, cst.Assign)
            bound = assign is not None and any(dotted(t.target) == nw.name for t in assign.targets)
            if dotted(func.value) == nw.name or bound:
                moves.append(call)
        around = {id(a) for a in ctx.ancestors(nw.anchor)}
        return bool(moves) and all(self._under_test(c, around, moves) for c in moves)

    def _under_test(self, node: cst.CSTNode, around: set, moves: list) -> bool:
        """`node` runs only under a test the wrap does not share (`around`: the wrap's
        ancestors, so the `if __name__ == "__main__":` both sit in is none): inside an `if` (or a
        conditional expression) whose other branch has none of `moves` (`if n > 1: m =
        DP(m).cuda() else: m = m.cuda()` moves on both)."""
        ids = {id(m) for m in moves}
        child = node
        for anc in self.ctx.ancestors(node):
            if id(anc) in around:
                return False
            if isinstance(anc, (cst.If, cst.IfExp)) and child is not anc.test:
                other = anc.orelse if child is anc.body else anc.body
                if other is None or not any(id(c) in ids for c in self.ctx.within(other, cst.Call)):
                    return True
            child = anc
        return False

    def _dp_when(self, nw) -> "bool | cst.BaseExpression":
        """`data_parallel=` of a wrap that replaces a DataParallel the plan deferred to the
        optimizer: the test the original used it under (`if args.mGPUs:`), where no statement
        between that `if` and the wrap rebinds what the test reads; else True (none: False)."""
        if nw.dp is None:
            return False
        when = dp_condition(nw.dp)
        if isinstance(when, cst.BaseExpression):
            block = self.ctx.parent(nw.dp.target)
            body = list(getattr(block, "body", ()))
            if nw.dp.target not in body or nw.anchor not in body:
                return True
            read = dotted_names(when)
            for statement in body[body.index(nw.dp.target) + 1:body.index(nw.anchor) + (1 if nw.after else 0)]:
                if any(rebinds(dotted(t.target), read)
                       for t in self.ctx.within(statement, cst.AssignTarget, cst.AugAssign)):
                    return True
        return when

    def leave_Module(self, node: cst.Module) -> None:
        p = self.plan()
        if not p.active[self.code]:
            return
        tm = self.ctx.tm
        summed = p.sums_losses()
        for nw in p.new:
            call = wrap_call(tm, expr(nw.name), bool(nw.find_unused), nw.sync_bn, data_parallel=self._dp_when(nw),
                             summed=summed, move=not self._moved_under_tests(nw))
            statement = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(expr(nw.name))], call)])
            edit = (insert_after if nw.after else insert_before)(nw.anchor, [statement])
            extra = f" (find_unused_parameters=True: {nw.find_unused})" if nw.find_unused else ""
            if summed:
                extra += ("; loss_reduction=\"sum\": the training loss sums over its batch, so the ranks' "
                          "gradients summed make the original's step over the whole global batch")
            if nw.reloaded:
                self.report(nw.bound, f"`{nw.name}` is loaded again as a whole model after its wrap (a resume): "
                                      f"wrapped again, `{nw.name} = {tm}.wrap_model({nw.name})`, or it would train "
                                      f"outside DDP{extra}", edits=[edit], imports=[self.ctx.runtime_import()])
                continue
            if nw.bound is not None:
                self.report(nw.bound, f"`{nw.name}` is also bound in this branch, which does not build its "
                                      f"optimizer: wrap it at the end of the branch too: `{nw.name} = "
                                      f"{tm}.wrap_model({nw.name})`{extra}",
                            edits=[edit], imports=[self.ctx.runtime_import()])
                continue
            if nw.dp is not None:
                extra += "; replaces nn.DataParallel"
            self.report(nw.opt.call, f"wrap `{nw.name}` in DistributedDataParallel before building its optimizer: "
                                     f"`{nw.name} = {tm}.wrap_model({nw.name})`{extra}",
                        edits=[edit], imports=[self.ctx.runtime_import()])
            self._share_per_pass(nw)

        for n, message, statement in p.manual301:
            self.report(n, message, statement=statement)
        for w in p.wraps:
            if w.kind == "ddp" and w.call is not None:
                self._device_ids(w.call)
            elif w.kind == "tm" and w.call is not None and self.ctx.resolve(w.call.func) in DDP_CLASSES:
                self._to_wrap_model(w.call)

    def _share_per_pass(self, nw) -> None:
        """The optimizer is built again on each pass of a loop (repeats, folds) while the model was
        wrapped once before it: a pass that re-initialises the weights (`self._reset_params()`)
        draws them from each rank's own random stream once the streams have parted, and DDP
        shares the weights only when it wraps. Rank 0's weights are shared before each pass's
        optimizer (`tm.share_params(model)`), as at the wrap."""
        ctx = self.ctx
        statement = nw.opt.statement
        loops = loops_of(statement, ctx, None)
        if nw.opt.by_hand or not loops or not isinstance(statement, cst.SimpleStatementLine) or any(
                a is loops[-1] for a in ctx.ancestors(nw.anchor)):
            return
        share = cst.parse_statement(f"{ctx.tm}.share_params({nw.name})")
        self.report(nw.opt.call, f"`{nw.name}` is wrapped once, before this loop, but its optimizer is built on every "
                                 "pass (repeats, folds): weights set again in a pass would differ per rank, so rank "
                                 f"0's are shared before each pass's optimizer (`{ctx.tm}.share_params({nw.name})`)",
                    edits=[insert_before(statement, [share])], imports=[self.ctx.runtime_import()])

    def _to_wrap_model(self, call: cst.Call) -> None:
        """A legacy script's own `DDP(model, device_ids=[args.local_rank], output_device=...)`
        (see `legacy_launch`) becomes `tm.wrap_model(model, ...)`: it picks the device ids
        itself (none on CPU ranks, where DDP refuses them) and returns the model unwrapped in a
        one-process run. Other options (`find_unused_parameters=`, `broadcast_buffers=`) stay,
        positional ones as keywords (only the first five positions are the same in every torch)."""
        tm = self.ctx.tm
        positional = [a for a in call.args if a.keyword is None]
        if len(positional) > len(_DDP_POSITIONS) or any(a.star for a in call.args) \
                or not positional and call_arg(call, "module") is None:
            self.report(call, f"DDP built by hand for torch.distributed.launch: replace it with `{tm}.wrap_model("
                              "model, ...)` (device ids from the local rank, none on CPU, no wrap in one process)")
            return

        def fix(c: cst.Call) -> cst.Call:
            named = [a if a.keyword is not None else kwarg(_DDP_POSITIONS[i], a.value)
                     for i, a in enumerate(c.args)]
            module = next(a for a in named if a.keyword.value == "module")
            kept = [a for a in named if a.keyword.value not in ("module", "device_ids", "output_device")]
            module = module.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
            return with_args(c.with_changes(func=expr(f"{tm}.wrap_model")), [module, *kept])

        self.report(call, f"DDP with `device_ids` fails on CPU ranks and in a one-process run: `{tm}.wrap_model` "
                          "picks the device itself (cuda:LOCAL_RANK, none on CPU) and wraps only under torchrun",
                    edits=[replace(call, fix)], imports=[self.ctx.runtime_import()])

    def _device_ids(self, call: cst.Call) -> None:
        tm = self.ctx.tm
        edits = []
        dev = call_arg(call, "device_ids", 1)
        if dev is not None and _hardcoded(dev.value, many=True):
            edits.append(replace_with(dev.value, expr(f"[{tm}.local_rank()]")))
        out = call_arg(call, "output_device", 2)
        if out is not None and _hardcoded(out.value, many=False):
            edits.append(replace_with(out.value, expr(f"{tm}.local_rank()")))
        if edits:
            self.report(call, "DDP with a hard-coded GPU puts every rank on the same device: use the local rank "
                              f"(`device_ids=[{tm}.local_rank()]`)", edits=edits, imports=[self.ctx.runtime_import()])


def _hardcoded(node: cst.BaseExpression, many: bool) -> bool:
    if many:
        if isinstance(node, (cst.List, cst.Tuple)):
            return len(node.elements) >= 1 and all(_hardcoded(e.value, False) for e in node.elements)
        return False
    if isinstance(node, cst.Integer):
        return True
    if isinstance(node, cst.SimpleString):
        return bool(re.fullmatch(r"cuda(:\d+)?", node.evaluated_value))
    if isinstance(node, cst.Call) and dotted(node.func) in ("torch.device", "device"):
        return bool(node.args) and all(_hardcoded(a.value, False) for a in node.args)
    return False


def _device_arg(call: cst.Call) -> bool:
    """`.to(device)`, `.to("cuda")`: a move, not a cast (`.to(torch.float16)`)."""
    first = call.args[0].value if call.args else None
    name = dotted(first) if first is not None else None
    return first is not None and not (name and name.startswith("torch.") and name != "torch.device")

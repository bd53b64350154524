"""TM305: the global batch and the learning rate once the program runs on N ranks."""

from __future__ import annotations

import builtins
import re
import sys
from typing import Dict, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.analysis import Optimizer
from torchmigrate.finding import Safety, replace
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule
from torchmigrate.rules.model.batch import shape_of_batch, batch_sites, divide_fix, loaders_carry_batch, per_rank
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code

# Schedulers that set the learning rate from arguments of their own, not from the optimizer's.
# the keywords a helper takes the batch size by, and the helpers that build loaders (`get_loader(...)`)
_BATCH_KEYWORDS = frozenset({"batch_size", "batchsize", "bs", "batch"})
_BUILTIN_NAMES = frozenset(dir(builtins))
_LIBRARIES = frozenset({"torch", "torchvision", "torchaudio", "torchtext", "numpy", "np", "scipy", "sklearn", "PIL",
                        "cv2", "pandas", "transformers", "datasets", "timm", "albumentations", "skimage", "matplotlib",
                        "einops", "torchmigrate", "lightning", "pytorch_lightning", "tensorflow", "jax", "dgl",
                        "torch_geometric", "monai", "kornia", "librosa", "soundfile", "h5py", "tqdm", "wandb"})
_LOADERISH = re.compile(r"(?i)(loader|dataset|iterator|sampler|batches)")
_OWN_LR_SCHEDULERS = ("torch.optim.lr_scheduler.OneCycleLR", "torch.optim.lr_scheduler.CyclicLR")
# Expressions that `x * y` may take as its left operand without parentheses.
_TIGHT = (cst.Name, cst.Attribute, cst.Integer, cst.Float, cst.Call, cst.Subscript)


def _batch_count(value: cst.BaseExpression) -> bool:
    """`x.size(0)`, `x.shape[0]`, `len(x)`: the number of samples in a batch tensor (not the
    configured batch size, which stays the global one)."""
    if isinstance(value, cst.Call):
        func = value.func
        if isinstance(func, cst.Attribute) and func.attr.value == "size" and len(value.args) == 1 \
                and isinstance(value.args[0].value, cst.Integer) and value.args[0].value.value == "0":
            return True
        return isinstance(func, cst.Name) and func.value == "len" and len(value.args) == 1 \
            and isinstance(value.args[0].value, (cst.Name, cst.Attribute, cst.Subscript))
    if isinstance(value, cst.Subscript) and isinstance(value.value, cst.Attribute) and value.value.attr.value == "shape":
        index = value.slice[0].slice if value.slice else None
        return isinstance(index, cst.Index) and isinstance(index.value, cst.Integer) and index.value.value == "0"
    return False


def _batch_size_name(node: cst.CSTNode) -> bool:
    """`batch_size`, `args.batch_size`, `self.batch`, `cfg.train_batch_size`, `bs`,
    `config["batch_size"]`: a name, attribute or string-keyed entry that holds a configured batch
    size (not an evaluation's, not a count of batches)."""
    if isinstance(node, cst.Subscript):
        key = node.slice[0].slice.value if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
            else None
        if not isinstance(key, cst.SimpleString) or not isinstance(key.evaluated_value, str):
            return False
        leaf = key.evaluated_value.lower()
    else:
        leaf = (node.attr.value if isinstance(node, cst.Attribute) else node.value).lower()
    if any(word in leaf for word in ("eval", "test", "val", "valid", "num", "n_batches", "batches")):
        return False
    return "batch_size" in leaf or "batchsize" in leaf or leaf in ("batch", "bs", "batch_sz", "mb_size", "mbsize")


def _follows_batch(ctx, step: cst.CSTNode, node: cst.CSTNode) -> bool:
    """`node` is a plain name assigned inside the training step (`batch_size = real.size(0)`):
    it follows the batches themselves, which are already the rank's."""
    if not isinstance(node, cst.Name):
        return False
    return any(isinstance(t.target, cst.Name) and t.target.value == node.value
               for a in ctx.within(step, cst.Assign) for t in a.targets)


def _divides_a_sum(ctx, loop: cst.For, counter: str) -> bool:
    """`counter` is the denominator of a running sum of the same loop (`record_loss_sum /
    record_batch_size`): it counts what the sum adds up, on this rank, and the mean of the two
    is TM703's (the ranks' mean of the rank's mean), not a count of the samples trained on."""
    sums = {code(a.target) for a in ctx.within(loop.body, cst.AugAssign) if isinstance(a.operator, cst.AddAssign)}
    sums.discard(counter)
    function = ctx.enclosing(loop, cst.FunctionDef) or ctx.module
    for op in ctx.within(function, cst.BinaryOperation):
        if isinstance(op.operator, (cst.Divide, cst.FloorDivide)) and code(op.right).strip("() ") == counter \
                and any(code(n) in sums for n in ctx.within(op.left, cst.Name, cst.Attribute)):
            return True
    return False


def _factors(value: cst.BaseExpression) -> List[str]:
    """The factors of a product, as code without spaces: `3 * len(d)` -> ["3", "len(d)"]."""
    if isinstance(value, cst.BinaryOperation) and isinstance(value.operator, cst.Multiply) and not value.lpar:
        return _factors(value.left) + _factors(value.right)
    return [code(value).replace(" ", "")]


def _count_factor(ctx, value: cst.BaseExpression, loop: cst.For) -> Optional[cst.BaseExpression]:
    """The batch count that `value` grows in proportion to: `x.size(0)` itself, a name the loop
    assigns from one (`cur_batch_size = real.shape[0]`), or such a count as a factor of a product
    or the numerator of a quotient (`cur_batch_size / (epochs * len(dataset))`)."""
    if _batch_count(value):
        return value
    if isinstance(value, cst.Name):
        bound = [a.value for a in analysis.facts(ctx).assigns
                 if ctx.enclosing(a, cst.For, cst.While, cst.FunctionDef) is loop
                 and any(isinstance(t.target, cst.Name) and t.target.value == value.value for t in a.targets)]
        return value if len(bound) == 1 and _batch_count(bound[0]) else None
    if isinstance(value, cst.BinaryOperation):
        if isinstance(value.operator, cst.Multiply):
            if any(isinstance(side, cst.Call) and (dotted(side.func) or "").endswith("world_size")
                   for side in (value.left, value.right)):
                return None  # counted for every rank already (a migrated program)
            return _count_factor(ctx, value.left, loop) or _count_factor(ctx, value.right, loop)
        if isinstance(value.operator, cst.Divide):
            return _count_factor(ctx, value.left, loop)
    return None


class LrWorldSize(ModelRule):
    """
    ## What it does
    Keeps the optimisation of the original program when it runs on N ranks. DDP averages the
    gradients of the ranks, so a step trains on the batches of all ranks together. By default
    (`ddp --batch-policy global`, or `batch-policy = "global"` in the settings) every training
    `DataLoader` that TM201 shards loads `batch_size / world_size` samples per rank,
    `batch_size=tm.per_rank_batch(args.batch_size)`: a step still sees the original's global
    batch, so the number of steps per epoch, step-based schedules, warm-up and the learning rate
    keep their meaning. The report says so at each loader, in one line. Gradient accumulation
    still sums the same number of samples per optimizer step. A `nn.DataParallel` program's
    batch was already the global batch (DataParallel split it across the GPUs); it is now split
    across the ranks the same way. Where the batch size does not divide by the number of
    processes, `tm.per_rank_batch` gives every rank the next size up and warns once, naming the
    nearest sizes that keep the global batch exactly.

    `--batch-policy per-gpu` keeps each rank's batch instead (a global batch N times larger,
    for users who want to use more GPUs to train faster) and scales the learning rate of the
    optimizers of the wrapped models linearly, `lr=args.lr * tm.world_size()` (Goyal et al.,
    2017); the report adds a note that large world sizes usually want a gradual warm-up, and a
    TODO where a scheduler sets the learning rate itself (`OneCycleLR(max_lr=...)`).

    Where the batch size cannot be found or divided safely, the loader keeps its batch and gets
    a TODO: a `batch_sampler=`, a batch size in `**kwargs` (a dict literal bound once in the
    loader's function has its `"batch_size"` entry divided instead) or left at one sample, a
    training loop that reads the batch size as a count (`seen += args.batch_size`), a program
    whose loss compares the samples of a batch with each other (a contrastive loss: over a rank's
    share each sample would see fewer negatives; `program.batch_coupling`), a loop that reads one
    sample of a batch at a fixed position past the first (`img[2]` of a visualisation: a rank's
    share may be shorter). A loop that reads it
    only as a tensor's shape (GAN noise `torch.randn(args.batch_size, nz)`, labels
    `torch.ones(args.batch_size, 1)`, `out.view(args.batch_size, -1)`) gets
    `tm.per_rank_batch(args.batch_size)` there too: those tensors are this rank's batch. A
    training step whose loader is built where this module cannot see it (a trainer class handed
    the loader, a step function) sizes them `tm.batch_rows(self.batch_size)`: the runtime divides
    them where a training loader's batch of that size was divided. A program whose
    training batches come from no DataLoader (a hand-made iterator, a loader a library builds)
    gets the TODO at its optimizer. Evaluation loaders keep their batch size.

    A counter of the samples trained on that outlives the training loop (`global_step +=
    x.size(0)` before `scheduler.step(global_step)`, `self.samples_seen += len(x)`) counts every
    rank's share of the step, `x.size(0) * tm.world_size()`: warm-ups, schedules, stopping rules
    and dashboards that read it keep their meaning. So does a value that grows in proportion to
    the step's samples (`alpha += cur_batch_size / (epochs * len(dataset))`, a progressive GAN's
    fade-in). The batches per epoch written as `len(loader.dataset) / loader.batch_size` (a mean's
    denominator, a scheduler's total steps) divide by the global batch,
    `loader.batch_size * tm.world_size()`, since the loader's own is the rank's share.

    In `lint`, the rule reports the optimizers of user-written DDP models whose learning rate
    and batch size do not involve the world size.

    ## Why is this bad?
    Without a decision, every rank loads a full `batch_size`, so N ranks train with a global
    batch of N × `batch_size` at the old learning rate, in N times fewer steps per epoch: the
    migrated program trains a different model, and schedules counted in steps end early.
    Whether to keep the batch or to scale the learning rate is a modelling choice
    (Lightning-AI/pytorch-lightning#3706, facebookresearch/detectron2#934); keeping the
    original's is the one that changes nothing, so it is the default.

    ## Example
    ```python
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    model = tm.wrap_model(model)
    optimizer = SGD(model.parameters(), lr=args.lr)
    ```
    becomes
    ```python
    train_loader = DataLoader(train_set, batch_size=tm.per_rank_batch(args.batch_size),
                              sampler=tm.sampler(train_set, shuffle=True))
    ```
    or, with `--batch-policy per-gpu`, `SGD(model.parameters(), lr=args.lr * tm.world_size())`.
    """

    code = "TM305"
    name = "lr-world-size"
    summary = "Keep the original's global batch (batch_size / world_size per rank), or scale the learning rate"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """,
            mode="lint",  # reported: an existing DDP program whose learning rate ignores the world size
        ),
        Example(
            before="""
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("nccl")
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size())
            """,
            mode="lint",  # not reported: the learning rate already scales with the world size
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = self.plan()
        if not p.active[self.code]:
            return
        ctx = self.ctx
        for site in batch_sites(ctx):
            self._batch(site)
        if loaders_carry_batch(ctx):
            self._shapes_sized_elsewhere()
        self._batches_per_epoch()
        if ctx.options.mode == "ddp" and ctx.options.shard_training:
            self._sample_counters()
        if ctx.options.mode == "ddp" and ctx.options.batch_policy == "per-gpu":
            for optimizer, lr in p.lr_sites:
                self._scale(optimizer, lr)
            self._own_lr_schedulers()
        elif not (ctx.options.mode == "ddp" and loaders_carry_batch(ctx)):
            tm = ctx.tm
            for optimizer, _lr in p.lr_sites:
                self.report(optimizer.call, f"each rank now loads a full batch (global batch = {tm}.world_size() x "
                                            f"batch_size) but the learning rate is unchanged: scale it (e.g. "
                                            f"`lr * {tm}.world_size()`) or divide the per-rank batch size",
                            statement=optimizer.statement)

    def _batch(self, site) -> None:
        """A training loader TM201 shards: its batch divided among the ranks, or a TODO."""
        tm = self.ctx.tm
        loader = site.loader
        what = f"`{loader.target}`" if loader.target else "this DataLoader"
        if site.kept:
            self.report(loader.call, f"{what} keeps its batch size on every rank ({site.kept}), so the global batch "
                                     f"is {tm}.world_size() times the original's while the learning rate is "
                                     f"unchanged: divide the batch (`{tm}.per_rank_batch(batch_size)`) or scale the "
                                     f"learning rate (`lr * {tm}.world_size()`)", statement=loader.statement)
            return
        edits = [replace(site.size.value, divide_fix(self.ctx, site))]
        shapes = ""
        if site.shapes:
            edits += [replace(use, lambda v: per_rank(tm, v)) for use in site.shapes]
            shapes = (f"; the loop's shapes made from `{code(site.shapes[0])}` (noise, labels, views) are this "
                      f"rank's batch too")
        self.report(site.size.value, f"{what} loads batch_size / world_size samples on each rank "
                                     f"(`{tm}.per_rank_batch`): every step still averages the gradients of the "
                                     "original's global batch, so steps per epoch, schedules and the learning rate "
                                     "keep their meaning (batch policy `global`; `--batch-policy per-gpu` keeps each "
                                     f"rank's batch and scales the learning rate instead){shapes}",
                    edits=edits, imports=[self.ctx.runtime_import()])

    def _shapes_sized_elsewhere(self) -> None:
        """A training step of this module (or the `__init__` of its class, which makes buffers for
        it) that makes tensors sized by a configured batch size
        (`torch.randn(self.batch_size, nz)` noise, `torch.ones(self.batch_size)` labels) while
        no loader of this module feeds it: the loader is built in another module or a factory,
        where TM305 divides its batch. The rows become `tm.batch_rows(size)`, which the runtime
        divides only where a training loader divided a batch of that size, so the made tensors
        match the rank's real batches, and stay whole where they did not (one process, a loader
        that kept its batch)."""
        ctx = self.ctx
        sites = batch_sites(ctx)
        handled = {id(use) for site in sites for use in site.shapes}
        kept = {code(site.size.value) for site in sites if site.size is not None}
        steps = {id(s): s for call in ctx.nodes(cst.Call) if analysis.is_backward(call)
                 and (s := ctx.enclosing(call, cst.For, cst.While, cst.FunctionDef)) is not None}
        # the `__init__` of a class whose method trains: buffers made there for its steps
        # (`self.real_label = torch.ones(size=(opt.batchsize,))`, GANomaly's), those a training
        # step reads (not fixed noise for sample images)
        inits: Dict[int, Set[str]] = {}
        for step in list(steps.values()):
            klass = ctx.enclosing(step, cst.ClassDef)
            init = next((f for f in klass.body.body if isinstance(f, cst.FunctionDef) and f.name.value == "__init__"),
                        None) if klass is not None and isinstance(klass.body, cst.IndentedBlock) else None
            if init is not None and init is not step:
                steps.setdefault(id(init), init)
                inits.setdefault(id(init), set()).update(
                    code(a) for a in ctx.within(step, cst.Attribute) if isinstance(a.value, cst.Name)
                    and a.value.value == "self")
        # the statements of a training loop's function before it, which make tensors for it
        # (`real_gt = torch.ones((config["batch_size"], 1, 1, 1))` once, then used every step)
        for step in list(steps.values()):
            fn = (ctx.enclosing(step, cst.FunctionDef) or ctx.module) if isinstance(step, (cst.For, cst.While)) else None
            if fn is not None and id(fn) not in steps:
                steps[id(fn)] = fn
                inits.setdefault(id(fn), set()).update(code(n) for n in ctx.within(step, cst.Name))
        for step in steps.values():
            uses = [n for n in ctx.within(step, cst.Name, cst.Attribute, cst.Subscript)
                    if id(n) not in handled and code(n) not in kept and _batch_size_name(n)
                    and not (isinstance(n, cst.Name) and isinstance(ctx.parent(n), cst.Attribute))
                    and not _follows_batch(ctx, step, n)
                    and (shape_of_batch(ctx, n) and (id(step) not in inits or self._bound_for(n, inits[id(step)]))
                         or isinstance(step, (cst.FunctionDef, cst.Module)) and self._sizes_helper_tensor(step, n))]
            if not uses:
                continue
            tm = ctx.tm
            self.report(uses[0], f"this training step makes tensors sized by `{code(uses[0])}` (noise, labels, "
                                 f"views) from batches loaded elsewhere: `{tm}.batch_rows` gives them this rank's "
                                 "share wherever a training loader's batch of that size is divided among the ranks "
                                 "(batch policy `global`), so they match the rank's real batches",
                        edits=[replace(use, lambda v: cst.Call(func=cst.parse_expression(f"{tm}.batch_rows"),
                                                               args=[cst.Arg(v.with_changes(lpar=[], rpar=[]))]))
                               for use in uses],
                        imports=[ctx.runtime_import()])

    def _sizes_helper_tensor(self, fn: cst.CSTNode, use: cst.CSTNode) -> bool:
        """`style_img = utils.prepare_img(path, batch_size=config["batch_size"])` before the
        training loop of `fn`: a helper of the program's other modules makes a batch-sized tensor
        (an image repeated to the batch, whose Gram matrices the style loss compares with each
        step's batch). Only a keyword `batch_size=` of a call to the program's own code whose
        result is bound to a name that nothing iterates or hands to a DataLoader (a helper
        building the training loader divides its batch itself)."""
        ctx = self.ctx
        arg = ctx.parent(use)
        if not (isinstance(arg, cst.Arg) and arg.value is use and arg.keyword is not None
                and arg.keyword.value in _BATCH_KEYWORDS):
            return False
        call = ctx.parent(arg)
        spelled = dotted(call.func) if isinstance(call, cst.Call) else None
        if spelled is None or _LOADERISH.search(spelled) or spelled in _BUILTIN_NAMES:
            return False  # (`dict(batch_size=..., shuffle=True)`: the loader's settings, not a tensor)
        root = (ctx.resolve(call.func) or spelled).split(".")[0]
        if spelled not in ctx.program.own_functions and (root in _LIBRARIES or root in sys.stdlib_module_names
                                                         or root == "self"):
            return False  # a library's (or a method whose class this rule does not see)
        assign = ctx.parent(call)
        if not (isinstance(assign, cst.Assign) and assign.value is call and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)):
            return False
        name = assign.targets[0].target.value
        loops = [l for l in ctx.within(fn, cst.For, cst.CompFor)]
        if any(name in {n.value for n in ctx.within(l.iter, cst.Name)} for l in loops):
            return False
        # (handed to a loader also inside an expression: `**{**kwargs, "shuffle": False}`, TM201's)
        return not any(isinstance(c.func, (cst.Name, cst.Attribute)) and _LOADERISH.search(code(c.func))
                       and any(isinstance(n, cst.Name) and n.value == name
                               for a in c.args for n in (a.value, *ctx.within(a.value, cst.Name)))
                       for c in ctx.within(fn, cst.Call))

    def _bound_for(self, use: cst.CSTNode, read: Set[str]) -> bool:
        """`use` sizes the value of an assignment to an attribute or name a training step reads
        (`self.real_label = torch.ones(size=(batchsize,))`, `real_gt = torch.ones((bs, 1))`)."""
        assign = self.ctx.enclosing(use, cst.Assign)
        return assign is not None and any(code(t.target) in read for t in assign.targets)

    def _batches_per_epoch(self) -> None:
        """`len(loader.dataset) / loader.batch_size` of a loader whose batch is divided: the
        original's batches per epoch (a mean's denominator, a scheduler's total steps), now
        world_size times too many, since `loader.batch_size` is the rank's share. Each rank still
        takes that many steps on its own shard, so the global batch restores the count:
        `len(loader.dataset) / (loader.batch_size * tm.world_size())`."""
        ctx = self.ctx
        divided = {r.text for site in batch_sites(ctx) if not site.kept for r in site.loader.refs}
        divided |= {site.loader.target for site in batch_sites(ctx) if not site.kept and site.loader.target}
        if not divided:
            return
        for node in ctx.nodes(cst.BinaryOperation):
            if not isinstance(node.operator, (cst.Divide, cst.FloorDivide)):
                continue
            right, left = node.right, node.left
            if not (isinstance(right, cst.Attribute) and right.attr.value == "batch_size"):
                continue
            owner = code(right.value)
            if owner not in divided or f"len({owner}.dataset)" not in _factors(left):
                continue
            whole = f"({code(right)} * {ctx.tm}.world_size())"
            self.report(node, f"`{code(node)}` counts the original's batches per epoch, but `{code(right)}` is now this "
                              f"rank's share of the batch: divide by the global batch, `{whole}`",
                        edits=[replace(right, lambda _: cst.parse_expression(whole))], imports=[ctx.runtime_import()])

    def _sample_counters(self) -> None:
        """`global_step += x.size(0)` in a training loop over sharded data, on a counter that
        outlives the loop (set before the epoch loop, or an attribute): it counts the samples
        trained on, which a schedule, a warm-up, a stopping rule or a dashboard's x-axis reads.
        Each rank now sees its share of every step's samples, so the counter adds the step's
        samples on every rank (`x.size(0) * tm.world_size()`: the shares are equal). A countdown
        (`steps_till_eval -= batch_size`, the samples until the next evaluation) subtracts every
        rank's samples the same way, and the counter read as a number of updates (`step //
        batch_size`: an EMA's warm-up, a scheduler's step) divides by the global batch. A count
        reset for the loop (`total += y.size(0)` beside `correct`) is a metric, TM701's."""
        ctx = self.ctx
        from torchmigrate.program.metrics import initial_value
        from torchmigrate.rules.metrics.plan import loop_sharding

        counted_in: Dict[cst.For, Dict[str, str]] = {}  # loop -> counter -> the per-rank count it grows by
        for aug in ctx.nodes(cst.AugAssign):
            if not isinstance(aug.operator, (cst.AddAssign, cst.SubtractAssign)):
                continue
            loop = ctx.enclosing(aug, cst.For, cst.While, cst.FunctionDef)
            if not isinstance(loop, cst.For):
                continue
            count = _count_factor(ctx, aug.value, loop)
            if count is None or not analysis.trains_itself(ctx, loop) or loop_sharding(ctx, loop) != "sharded":
                continue
            target = aug.target
            if isinstance(target, cst.Name) and initial_value(ctx, loop, target.value)[0]:
                continue  # reset for this loop: a metric's count
            if not isinstance(target, (cst.Name, cst.Attribute)):
                continue
            if _divides_a_sum(ctx, loop, code(target)):
                continue  # the count of a running mean (`loss_sum / n_seen`): the mean's, kept per rank
            counted = code(count)
            counted_in.setdefault(loop, {})[code(target)] = counted
            what = ("counts down the samples until something happens (an evaluation, a checkpoint)"
                    if isinstance(aug.operator, cst.SubtractAssign) else "counts the samples trained on"
                    ) if count is aug.value else "grows with the samples trained on (a fade-in, a warm-up fraction)"
            self.report(aug, f"`{code(target)}` {what}, but `{counted}` is now this rank's share of "
                             f"the step: count every rank's (`{counted} * {ctx.tm}.world_size()`), so schedules and "
                             "limits that read it keep their meaning",
                        edits=[replace(count, lambda v: cst.BinaryOperation(
                            left=v, operator=cst.Multiply(), right=cst.parse_expression(f"{ctx.tm}.world_size()")))],
                        imports=[ctx.runtime_import()])
        for loop, counters in counted_in.items():
            for op in ctx.within(loop, cst.BinaryOperation):
                if isinstance(op.operator, (cst.FloorDivide, cst.Divide)) and code(op.left) in counters \
                        and code(op.right) == counters[code(op.left)] and counters[code(op.left)] != code(op.left):
                    self.report(op, f"`{code(op)}` reads the samples counted on every rank as a number of updates, but "
                                    f"`{code(op.right)}` is this rank's share of the batch: divide by every rank's "
                                    f"(`{code(op.right)} * {ctx.tm}.world_size()`)",
                                edits=[replace(op.right, lambda v: _times_world(v, ctx.tm).with_changes(
                                    lpar=[cst.LeftParen()], rpar=[cst.RightParen()]))],
                                imports=[ctx.runtime_import()])

    def _scale(self, optimizer: Optimizer, lr: Optional[cst.Arg]) -> None:
        """Batch policy per-gpu: the learning rate grows with the global batch (linear scaling)."""
        tm = self.ctx.tm
        if lr is None:
            self.report(optimizer.call, f"batch policy `per-gpu`: each rank loads a full batch, so the global batch is "
                                        f"{tm}.world_size() x batch_size, but this optimizer uses its default learning "
                                        f"rate: pass `lr=<default> * {tm}.world_size()`",
                        statement=optimizer.statement)
            return
        groups = " (the parameter groups' own `lr` values are not scaled: scale them too)" \
            if _groups_with_lr(optimizer.call) else ""
        self.report(lr.value, f"batch policy `per-gpu`: each rank loads a full batch, so the global batch is "
                              f"{tm}.world_size() x batch_size and the learning rate is scaled with it "
                              f"(`lr * {tm}.world_size()`, the linear scaling rule){groups}",
                    edits=[replace(lr.value, lambda v: _times_world(v, tm))], imports=[self.ctx.runtime_import()])
        self.report(lr.value, "the learning rate is now world_size times larger from the first step: large world sizes "
                              "usually train better with a gradual warm-up over the first epochs (Goyal et al., 2017)",
                    advice=True)

    def _own_lr_schedulers(self) -> None:
        tm = self.ctx.tm
        for call in analysis.calls_to(self.ctx, *_OWN_LR_SCHEDULERS):
            self.report(call, f"batch policy `per-gpu`: this scheduler sets the learning rate from its own arguments "
                              f"(`max_lr`, `base_lr`), which are not scaled: multiply them by `{tm}.world_size()` too")


def _groups_with_lr(call: cst.Call) -> bool:
    """`SGD([{"params": ..., "lr": 0.01}, ...], lr=0.1)`: groups that set their own rate."""
    first = call.args[0].value if call.args and call.args[0].keyword is None else None
    return isinstance(first, (cst.List, cst.Tuple)) and any(
        isinstance(e.value, cst.Dict) and any(isinstance(el, cst.DictElement) and isinstance(el.key, cst.SimpleString)
                                              and el.key.raw_value == "lr" for el in e.value.elements)
        for e in first.elements)


def _times_world(value: cst.BaseExpression, tm: str) -> cst.BaseExpression:
    left = value if isinstance(value, _TIGHT) or value.lpar or (
        isinstance(value, cst.BinaryOperation) and isinstance(value.operator, (cst.Multiply, cst.Divide))) \
        else value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return cst.BinaryOperation(left=left, operator=cst.Multiply(), right=cst.parse_expression(f"{tm}.world_size()"))

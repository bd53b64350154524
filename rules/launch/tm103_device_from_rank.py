"""TM103: device placement from the process's local rank instead of hard-coded CUDA devices."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, insert_before, remove, replace, replace_with
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, code, expr, kwarg, stmt, with_args
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.ranks import rank_dependent
from torchmigrate.program.syntax import ranged_loop
from torchmigrate.program.types import MODULE, TENSOR, kind_of, result_kind
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules.launch.base import INIT_PG
from torchmigrate.rules.launch.plan import legacy_launch, setup_plan
from torchmigrate.rules.logging.base import add_kwarg

SET_DEVICE = "torch.cuda.set_device"
DEVICE_CTX = "torch.cuda.device"
IS_AVAILABLE = "torch.cuda.is_available"
# torch.* calls whose `device=` keyword is a device (tensor factories, Generator, ...), minus
# the ones where a string is required or the keyword means something else.
_NOT_DEVICE_KW = ("torch.autocast", "torch.amp.", "torch.cuda.amp.", "torch.cpu.amp.", "torch.load",
                  "torch.jit.load", "torch.device", "torch.cuda.set_device", "torch.cuda.device")
_NOT_DEVICE_PREFIXES = tuple(p for p in _NOT_DEVICE_KW if p.endswith("."))  # ... and what is under these
_INDEX = re.compile(r"cuda:\d+")
# Name uses that are fine whether the value is a string or a torch.device.
_DEVICE_ATTRS = ("type", "index")

BARE = "bare"  # "cuda", .cuda(): the current device (right once set_device ran)
LITERAL = "literal"  # "cuda:0", .cuda(0): a fixed GPU, the same on every rank
EXPR = "expr"  # f"cuda:{args.gpu}", .cuda(args.gpu): an index computed by the script


def cuda_string(node: cst.CSTNode) -> Optional[str]:
    """BARE / LITERAL / EXPR when node is a string expression naming a CUDA device, else None."""
    tp = type(node)  # exact type tests: asked of most expressions, isinstance on LibCST's ABCs is slow
    if tp is cst.SimpleString:
        try:
            value = node.evaluated_value
        except Exception:  # pragma: no cover
            return None
        if not isinstance(value, str):
            return None
        if value == "cuda":
            return BARE
        return LITERAL if _INDEX.fullmatch(value) else None
    if tp is cst.FormattedString:
        parts = node.parts
        if (len(parts) == 2 and isinstance(parts[0], cst.FormattedStringText) and parts[0].value == "cuda:"
                and isinstance(parts[1], cst.FormattedStringExpression)):
            return EXPR
        return None
    if tp is cst.BinaryOperation and isinstance(node.left, cst.SimpleString):
        text = node.left.evaluated_value
        if isinstance(node.operator, cst.Add) and text == "cuda:":
            return EXPR
        if isinstance(node.operator, cst.Modulo) and text in ("cuda:%d", "cuda:%s", "cuda:%i"):
            return EXPR
        return None
    if (tp is cst.Call and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format"
            and isinstance(node.func.value, cst.SimpleString) and node.func.value.evaluated_value == "cuda:{}"):
        return EXPR
    return None


def _int(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Integer)


# Names that hold a GPU index (`args.gpu`, `gpu_id`, `opt.device_id`); never rank-derived ones.
_GPU_NAME = re.compile(r"^(gpu|gpu_?id|gpu_?idx|gpu_?index|gpu_?num|gpu_?no|cuda_?id|cuda_?idx|cuda_?index|cuda_?device"
                       r"|device_?id|device_?idx|device_?index|device_?num|dev_?id)$", re.IGNORECASE)


def gpu_index(node: cst.CSTNode) -> Optional[str]:
    """LITERAL for an int literal (`0`), EXPR for a variable named like a GPU index
    (`args.gpu`, `gpu_id`), else None: both mean a CUDA device where a device is expected."""
    if isinstance(node, cst.Integer):
        return LITERAL
    name = dotted(node) if isinstance(node, (cst.Name, cst.Attribute)) else None
    if name and _GPU_NAME.match(name.rsplit(".", 1)[-1]):
        return EXPR
    # `gpu_ids[0]`, `opt.gpu_ids[0]`, `self.device_ids[0]`: the first of a list of GPU indices
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
            and isinstance(node.slice[0].slice.value, cst.Integer):
        listed = dotted(node.value) if isinstance(node.value, (cst.Name, cst.Attribute)) else None
        if listed and _GPU_LIST.match(listed.rsplit(".", 1)[-1]):
            return EXPR
    return None


_GPU_LIST = re.compile(r"^(gpu_?ids|gpus|gpu_?list|device_?ids|devices|cuda_?ids)$", re.IGNORECASE)


class DeviceFromRank(Rule):
    """
    ## What it does
    Replaces hard-coded CUDA devices with `tm.device()`, the process's own device
    (`cuda:LOCAL_RANK`, or `cpu` without CUDA):

    - `torch.device("cuda" if torch.cuda.is_available() else "cpu")`, `torch.device("cuda")`,
      `torch.device("cuda:0")`, `torch.device("cuda", 0)`, `torch.device(f"cuda:{args.gpu}")`
      become `tm.device()`; with another condition (`use_cuda`, `not args.no_cuda and ...`) the
      condition is kept: `tm.device() if use_cuda else torch.device("cpu")`.
    - `x.cuda()`, `x.cuda(0)`, `x.cuda(args.gpu)`, `x.cuda(non_blocking=True)` become
      `x.to(tm.device())` (keeping `non_blocking=`/`memory_format=`) where `x` is known to be a
      tensor or a module (`program.types`: made by torch or `nn`, a model class of the program,
      a batch of a data loader, ...). Anything else keeps its own `cuda()` (a loss object of the
      program with a `cuda()` but no `.to()`, a container, an unannotated parameter): after
      `tm.setup()` the current GPU is the process's own, and a GPU index becomes
      `tm.local_rank()`. `.to("cuda:0")`, `.to(gpu_ids[0])` (the first of a list of GPU indices)
      and `device="cuda"` keywords of torch factories become `tm.device()`.
    - In `ddp`, `list(range(torch.cuda.device_count()))` (a program's list of its GPUs, read as
      `f"cuda:{ids[0]}"` or DataParallel's `device_ids`) becomes `tm.gpu_ids()`: the rank's own
      GPU under torchrun, every visible GPU in one process.
    - `device = "cuda"` / `"cuda:0"` string variables become `tm.device()` when every use
      treats them as a device (`.to(device)`, `device=device`); when the script also compares
      or formats the string (`device == "cuda"`, `autocast(device_type=device)`), a
      `"cuda"` string is kept (after `tm.setup()` it already means the process's own GPU) and a
      `"cuda:N"` string becomes `str(tm.device())`.
    - In `ddp`, a `"cuda:N"` (or `f"cuda:{i}"`) string in a slot no assignment shows: a
      parameter's default (`def sample(model, device="cuda:1")`), a config entry
      (`{"device": "cuda:0"}`, `dict(device="cuda:0")`) or a keyword of the program's own or a
      library's call becomes `str(tm.device())` (the wrap moved the model to this process's GPU).
    - `torch.cuda.set_device(...)` is removed in files that get `tm.setup()` (which pins the
      GPU before anything is allocated) and otherwise gets `tm.device()` as its argument.
    - In `ddp`, `os.environ["CUDA_VISIBLE_DEVICES"] = v` and its `setdefault` become
      `tm.visible_devices(v)`: the program's GPUs as one process, and under a launcher only where
      they give each process on the node a GPU of its own (else the launcher's, with a warning).
      Writes whose value is used again (`a = os.environ[...] = v`), `os.putenv` and
      `torch.cuda.device(N)` blocks are reported for a manual change.
    - In `ddp`, `torch.device(x)` of a value this file cannot see (a loop over the program's
      device list, a parameter) becomes `tm.as_device(x)`: any GPU it names is the rank's own.
    - GPU indices where a device is expected: `.to(0)`, `.to(args.gpu)`, `torch.device(args.gpu)`
      and `device=args.gpu` / `device=0` keywords of any call (`BucketIterator(...,
      device=args.gpu)`; `device=-1`, the old "cpu", is kept) become `tm.device()`. A variable
      assigned a GPU index (`device = 0`, `gpu = args.gpu`, `dev = int(...)`) is followed through
      assignments (`self.gpu_id = gpu_id`) and calls of this file's functions and classes; when
      every use is a device (`.to(x)`, `.cuda(x)`, `device=x`, `torch.device(x)`; printing is
      fine) its value becomes `tm.device()`, otherwise (`gpu == 0`, arithmetic) it is reported.
      `storage.cuda(args.gpu)` in a `map_location=` lambda is reported, not edited.
    - In a file that never moves anything to a device (no `.to(device)`, `.cuda()`, `device=`)
      but whose model `tm.wrap_model` (TM301) moves to `tm.device()`, the loops that feed the
      model move their batch first: `inputs, labels = tm.to_device(inputs, labels)` (tensors
      moved, a count or a list of lengths kept as it is) for `for inputs, labels in loader:`, `for i, (inputs, labels) in
      enumerate(loader):` and `for data in loader: inputs, labels = data`. Moved are the names
      the model reads and those used with its outputs (`criterion(outputs, labels)`,
      `predicted == labels`); other loop shapes, batches that may not be tensors (custom
      `collate_fn`, `batch.text`, `model(**batch)`) and forwards outside such loops are
      reported.

    `device="cpu"`, `map_location=` (TM502) and `autocast`/`GradScaler` device types are never
    touched. In `lint`, and on files that already set up distributed training, only what is
    wrong under torchrun is reported: a literal GPU index (`"cuda:0"`, `.cuda(0)`,
    `set_device(0)`), and a bare `"cuda"`/`.cuda()` in a file that calls
    `init_process_group` but never `torch.cuda.set_device`. Indices computed from the rank
    (`torch.device("cuda", args.local_rank)`) are left alone, except in a legacy
    `torch.distributed.launch` script that `ddp` moves onto the runtime (see TM101): it is
    converted like a single-GPU one, so `torch.device("cuda", args.local_rank)` and
    `.cuda(args.local_rank)` become `tm.device()` and its `set_device` goes (they fail on a CPU
    machine).

    ## Why is this bad?
    Under torchrun every process runs the same code: a fixed `cuda:0` (or a `.cuda()` before
    `set_device`) puts all ranks on GPU 0, which then runs out of memory or fails with
    "Duplicate GPU detected". DDP expects exactly one device per process.

    ## Example
    ```python
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net().cuda()  # class Net(nn.Module) of the program
    criterion = DiceLoss().cuda()  # a plain class of the program with its own cuda()
    ```
    becomes
    ```python
    device = tm.device()
    model = Net().to(tm.device())
    criterion = DiceLoss().cuda()
    ```
    """

    code = "TM103"
    name = "device-from-rank"
    summary = "Use the process's own device (tm.device()) instead of hard-coded CUDA devices"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            from torch import nn
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = nn.Linear(4, 2).cuda()
            x = torch.randn(8, 4).cuda(non_blocking=True)
            criterion = MyLoss().cuda()
            """,
            after="""
            import torch
            from torch import nn
            import torchmigrate.runtime as tm
            device = tm.device()
            model = nn.Linear(4, 2).to(tm.device())
            x = torch.randn(8, 4).to(tm.device(), non_blocking=True)
            criterion = MyLoss().cuda()
            """,
        ),
        Example(
            before="""
            import torch
            device = torch.device("cuda" if use_cuda else "cpu")
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            device = tm.device() if use_cuda else torch.device("cpu")
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._occurrences: Dict[str, List[cst.CSTNode]] = {}
        self.ifexps: List[cst.IfExp] = []
        self.env_writes: List[cst.CSTNode] = []  # filled by leave_Module
        self.map_location_reported: Set[cst.CSTNode] = set()
        self.int_device_uses: Set[cst.CSTNode] = set()  # uses whose origin gets tm.device()

    # --- collection ---------------------------------------------------------------------
    def occurrences(self, key: str) -> List[cst.CSTNode]:
        """Where `x` (a Name, not an attribute's name) or `x.y` (an Attribute of a Name) occurs,
        in source order. Found from the Name nodes spelling `x` (or `y`), not by a look at
        every attribute of the file; asked repeatedly for the same keys, so remembered."""
        found = self._occurrences.get(key)
        if found is None:
            found = self._occurrences[key] = self._find_occurrences(key)
        return found

    def _find_occurrences(self, key: str) -> List[cst.CSTNode]:
        parent = self.ctx.parent
        if "." not in key:
            return [n for n in self.ctx.named(key) if not (
                type(parent(n)) is cst.Attribute and parent(n).attr is n)]  # type: ignore[union-attr]
        # `x.y`: the Attributes whose name is a `y` and whose value is a Name `x` (such an
        # Attribute holds no other, so their order is that of their `y`s)
        owner, attr = key.split(".", 1)
        found = []
        for n in self.ctx.named(attr):
            up = parent(n)
            if type(up) is cst.Attribute and up.attr is n and type(up.value) is cst.Name \
                    and up.value.value == owner:  # type: ignore[union-attr, attr-defined]
                found.append(up)
        return found

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.ifexps.append(node)

    def _env_assigns(self) -> List[cst.CSTNode]:
        """`os.environ["CUDA_VISIBLE_DEVICES"] = ...` statements, in source order (once per
        matching target). Read from the file's recorded assignments at the end rather than a
        callback for every assignment; `Subscript` has no subclasses, so an exact type test."""
        found: List[cst.CSTNode] = []
        for assign in analysis.facts(self.ctx).assigns:
            for t in assign.targets:
                if type(t.target) is cst.Subscript and self._is_cvd(t.target):
                    found.append(assign)
        return found

    def _per_rank_or_none(self, write: cst.CSTNode) -> bool:
        """A write that gives each rank its own GPU (guided-diffusion's `f"{MPI.COMM_WORLD.Get_rank()
        % GPUS_PER_NODE}"`) or hides them all for a CPU run (yolov5's `"-1"`): not "every rank
        sees the same GPUs"."""
        value = write.value if isinstance(write, cst.Assign) else (
            write.args[1].value if isinstance(write, cst.Call) and len(write.args) > 1 else None)
        if value is None:
            return False
        if isinstance(value, cst.SimpleString) and value.evaluated_value.strip() in ("", "-1"):
            return True
        return rank_dependent(self.ctx, value)

    def _is_cvd(self, sub: cst.Subscript) -> bool:
        if self.ctx.resolve(sub.value) != "os.environ" or len(sub.slice) != 1:
            return False
        index = sub.slice[0].slice
        return isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString) \
            and index.value.evaluated_value == "CUDA_VISIBLE_DEVICES"

    # --- policy ---------------------------------------------------------------------------
    def _setup(self) -> None:
        ctx = self.ctx
        self.distributed = analysis.is_distributed(ctx)
        # a legacy script (see `legacy_launch`) moves onto the runtime like a single-GPU one
        self.converting = ctx.options.migrating and (not self.distributed or legacy_launch(ctx))
        self.active = self.converting or self.distributed
        # A distributed file that creates its own process group but never pins a GPU: a bare
        # "cuda"/.cuda() is GPU 0 on every rank there.
        self.unpinned = bool(analysis.calls_to(ctx, INIT_PG)) and not analysis.calls_to(
            ctx, SET_DEVICE, DEVICE_CTX, RUNTIME + ".setup")

    def _wrong(self, kind: Optional[str]) -> bool:
        if kind is None:
            return False
        if self.converting:
            return True
        if kind == LITERAL:
            return True
        return kind == BARE and self.unpinned

    def _is_tm_device(self, node: cst.CSTNode) -> bool:
        return type(node) is cst.Call and not node.args and self.ctx.resolve(node.func) == RUNTIME + ".device"

    def _tm_device(self) -> cst.BaseExpression:
        return expr(f"{self.ctx.tm}.device()")

    def _fix(self, node: cst.CSTNode, message: str, edit) -> None:
        self.report(node, message, edits=[edit], imports=[self.ctx.runtime_import()])

    def _fix_string(self, value: cst.BaseExpression, split, new: cst.BaseExpression, message: str) -> None:
        """`value` (a CUDA device string, or the CUDA branch of a conditional, `split` as
        `_split` gives it) becomes `new`."""
        if split:
            self._fix(value, message, replace(value, lambda v: self._conditional(v, split[1], new)))
        else:
            self._fix(value, message, replace_with(value, new))

    def _is_available(self, test: cst.BaseExpression) -> bool:
        return isinstance(test, cst.Call) and not test.args and self.ctx.resolve(test.func) == IS_AVAILABLE

    def _is_cpu(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.SimpleString):
            return node.evaluated_value == "cpu"
        if isinstance(node, cst.Call) and self.ctx.resolve(node.func) == "torch.device" and len(node.args) == 1:
            return isinstance(node.args[0].value, cst.SimpleString) and node.args[0].value.evaluated_value == "cpu"
        return False

    def _device_call_kind(self, call: cst.Call) -> Optional[str]:
        """Kind of a `torch.device(...)` call naming CUDA (None for cpu/variables)."""
        first = arg(call, "type", 0)
        if first is None:
            return None
        kind = cuda_string(first.value)
        index = arg(call, "index", 1)
        if kind is None and index is None and len(call.args) == 1:
            return gpu_index(first.value)  # torch.device(0), torch.device(args.gpu)
        if kind == BARE and index is not None:
            return LITERAL if _int(index.value) else EXPR
        return kind

    def _split(self, node: cst.IfExp, string: bool, index: bool = False):
        """(cuda branch kind, cuda branch is body) for `cuda-ish if C else cpu-ish`, else None;
        with `index`, a GPU index is cuda-ish too (`torch.device(args.gpu if cuda else "cpu")`)."""
        for cuda_branch, other, is_body in ((node.body, node.orelse, True), (node.orelse, node.body, False)):
            if not self._is_cpu(other):
                continue
            if string:
                kind = cuda_string(cuda_branch) or (gpu_index(cuda_branch) if index else None)
            elif isinstance(cuda_branch, cst.Call) and self.ctx.resolve(cuda_branch.func) == "torch.device":
                kind = self._device_call_kind(cuda_branch)
            else:
                kind = None
            if kind is not None:
                return kind, is_body
        return None

    def _exact(self, node: cst.IfExp, is_body: bool) -> bool:
        """The condition is exactly "CUDA is available" (tm.device() falls back to cpu itself)."""
        test = node.test
        if not is_body:
            if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
                return self._is_available(test.expression)
            return False
        return self._is_available(test)

    def _conditional(self, node: cst.IfExp, is_body: bool, new_cuda: cst.BaseExpression,
                     cpu: Optional[cst.BaseExpression] = None) -> cst.BaseExpression:
        """`new_cuda` when the test is is_available(), else the IfExp with its cuda branch replaced."""
        if self._exact(node, is_body):
            return new_cuda
        changes = {"body": new_cuda} if is_body else {"orelse": new_cuda}
        if cpu is not None:
            changes["orelse" if is_body else "body"] = cpu
        if "\n" in code(node) and not node.lpar:
            # an expression over several lines that stood inside `torch.device(...)`'s
            # parentheses, which the rewrite drops: its own keep it one expression
            changes.update(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return node.with_changes(**changes)

    # --- main -----------------------------------------------------------------------------
    def leave_Module(self, node: cst.Module) -> None:
        self._setup()
        if not self.active:
            return
        self.env_writes = self._env_assigns()
        handled: Set[cst.CSTNode] = set()
        self._ifexp_devices(handled)
        if self.converting:
            self._int_devices()
        for call, name in analysis.facts(self.ctx).calls:
            if call in handled:
                continue
            if name == "torch.device":
                self._torch_device(call)
            elif name == SET_DEVICE:
                self._set_device(call)
            elif name == DEVICE_CTX:
                self._device_ctx(call)
            elif name == "torch.set_default_tensor_type" and self.converting:
                self._default_tensor_type(call)
            elif name is None and isinstance(call.func, cst.Name) and call.func.value == "list" \
                    and self.converting and self.ctx.options.mode == "ddp":
                self._gpu_list(call)
            elif name is None and isinstance(call.func, cst.Attribute):
                attr = call.func.attr.value
                if attr == "cuda":
                    self._dot_cuda(call)
                elif attr == "to":
                    self._dot_to(call)
                elif attr == "add_argument":
                    self._argparse_default(call)
            elif name in ("os.environ.setdefault", "os.putenv") and call.args \
                    and isinstance(call.args[0].value, cst.SimpleString) \
                    and call.args[0].value.evaluated_value == "CUDA_VISIBLE_DEVICES":
                self.env_writes.append(call)
            if name is not None and name.startswith("torch.") and name != "torch.device":
                self._device_kwarg(call, name)
            elif name is None or not name.startswith(("torch.", RUNTIME)):
                self._other_device_kwarg(call)
        for assign in analysis.facts(self.ctx).assigns:
            self._string_assign(assign)
        if self.converting:
            self._string_slots()
        if self.converting and self.ctx.options.mode == "ddp":
            self._batch_moves()
        for write in self.env_writes:
            if self._per_rank_or_none(write):
                continue
            kept = self._visible_devices(write) if self.converting and self.ctx.options.mode == "ddp" else None
            if kept is not None:
                self._fix(write, "CUDA_VISIBLE_DEVICES set in the script would show every rank the same GPUs: "
                                 "tm.visible_devices keeps the program's choice as one process (and where it lists a "
                                 "GPU for each process on the node), else the launcher's GPUs, so that each process "
                                 "uses its own tm.device() = cuda:LOCAL_RANK", replace_with(write, kept))
                continue
            self.report(write, "CUDA_VISIBLE_DEVICES set in the script: every rank sees the same GPUs (with one "
                               "visible GPU all ranks share it); let torchrun/the scheduler choose, each process "
                               "uses tm.device() = cuda:LOCAL_RANK")

    def _visible_devices(self, write: cst.CSTNode) -> Optional[cst.CSTNode]:
        """`tm.visible_devices(value)` for `os.environ["CUDA_VISIBLE_DEVICES"] = value` (one
        target) and `os.environ.setdefault("CUDA_VISIBLE_DEVICES", value)` used as a statement;
        None for the forms whose value or result the program goes on to use (`a = os.environ[...]
        = v`, `os.putenv`)."""
        tm = self.ctx.tm
        if isinstance(write, cst.Assign):
            if len(write.targets) != 1:
                return None
            return cst.Expr(cst.Call(cst.parse_expression(f"{tm}.visible_devices"), [cst.Arg(write.value)]))
        if isinstance(write, cst.Call) and self.ctx.resolve(write.func) == "os.environ.setdefault" \
                and len(write.args) == 2 and isinstance(self.ctx.parent(write), cst.Expr):
            call = cst.parse_expression(f"{tm}.visible_devices(_, if_unset=True)")
            return call.with_changes(args=[cst.Arg(write.args[1].value), call.args[1]])
        return None

    def _ifexp_devices(self, handled: Set[cst.CSTNode]) -> None:
        """`torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")` as a whole."""
        for node in self.ifexps:
            split = self._split(node, string=False)
            if split is None:
                continue
            kind, is_body = split
            if not self._exact(node, is_body) or not self._wrong(kind):
                continue
            handled.add(node.body if is_body else node.orelse)
            self._fix(node, "hard-coded CUDA device: every rank would use the same GPU; use tm.device() "
                            "(cuda:LOCAL_RANK, or cpu without CUDA)", replace_with(node, self._tm_device()))

    def _torch_device(self, call: cst.Call) -> None:
        first = arg(call, "type", 0)
        if first is None:
            return
        message = ("hard-coded CUDA device: every rank would use the same GPU; use tm.device() "
                   "(cuda:LOCAL_RANK, or cpu without CUDA)")
        if isinstance(first.value, cst.IfExp):
            ifexp = first.value
            split = self._split(ifexp, string=True, index=True)
            if split is None or not self._wrong(split[0]) or arg(call, "index", 1) is not None:
                return
            kind, is_body = split
            cpu_branch = ifexp.orelse if is_body else ifexp.body

            def fix(c: cst.Call) -> cst.BaseExpression:
                cpu = c.with_changes(args=[cst.Arg(value=cpu_branch)])
                return self._conditional(ifexp, is_body, self._tm_device(), cpu)

            self._fix(call, message, replace(call, fix))
            return
        kind = self._device_call_kind(call)
        compared = self._compared(call) if self._wrong(kind) else None
        if compared is not None:
            self._gpu_test(call, compared)
        elif self._wrong(kind):
            self._fix(call, message, replace_with(call, self._tm_device()))
        elif kind is None and len(call.args) == 1 and not call.args[0].keyword and not call.args[0].star \
                and self.converting and self.ctx.options.mode == "ddp" and not _constant(first.value) \
                and not self._in_map_location(call):
            # a device made from a value this file cannot see (`torch.device(t)` for `t` in the
            # program's list of devices, a parameter): any GPU it names is this rank's
            self._fix(call, "a device made from a value the analysis cannot see: any GPU it names must be this "
                            f"rank's (`{self.ctx.tm}.as_device`, cuda:LOCAL_RANK for any GPU, else as given)",
                      replace(call, lambda c: c.with_changes(func=cst.parse_expression(f"{self.ctx.tm}.as_device"))))

    def _compared(self, call: cst.Call) -> Optional[cst.Comparison]:
        """The `device == torch.device("cuda")` (or `!=`, either side) that `call` is one side of."""
        parent = self.ctx.parent(call)
        comparison = self.ctx.parent(parent) if isinstance(parent, cst.ComparisonTarget) else parent
        if isinstance(comparison, cst.Comparison) and len(comparison.comparisons) == 1 \
                and isinstance(comparison.comparisons[0].operator, (cst.Equal, cst.NotEqual)) \
                and call in (comparison.left, comparison.comparisons[0].comparator):
            return comparison
        return None

    def _gpu_test(self, call: cst.Call, comparison: cst.Comparison) -> None:
        """`device == torch.device("cuda")` asks whether the program runs on a GPU: compared with
        `tm.device()` it would be true on CPU ranks too (the device is `tm.device()` there as
        well). It becomes `tm.as_device(device).type == "cuda"`: true on the rank's GPU, false
        on the CPU, whatever GPU number `device` names."""
        other = comparison.comparisons[0].comparator if comparison.left is call else comparison.left
        tm = self.ctx.tm

        def fix(c: cst.Comparison) -> cst.Comparison:
            probe = cst.Attribute(value=cst.Call(func=cst.parse_expression(f"{tm}.as_device"), args=[cst.Arg(other)]),
                                  attr=cst.Name("type"))
            return c.with_changes(left=probe, comparisons=[c.comparisons[0].with_changes(
                comparator=cst.SimpleString('"cuda"'))])

        self._fix(call, "a test of whether the program runs on the GPU: compared with this rank's device it would "
                        "be true on CPU ranks too; it compares the device's type with \"cuda\"", replace(comparison, fix))

    def _in_map_location(self, node: cst.CSTNode) -> bool:
        """Inside a `map_location=` argument (TM502 owns checkpoint loading)."""
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, cst.Arg) and anc.keyword is not None and anc.keyword.value == "map_location":
                return True
            if isinstance(anc, cst.BaseStatement):
                return False
        return False

    def _dot_cuda(self, call: cst.Call) -> None:
        if self.ctx.resolve(call.func) is not None or any(a.star for a in call.args):
            return
        device = arg(call, "device", 0)
        if self._in_map_location(call):
            if device is not None and self.converting and gpu_index(device.value) is not None:
                self._map_location_index(device.value)
            return
        if device is None:
            kind = BARE
        elif _int(device.value):
            kind = LITERAL
        elif isinstance(device.value, cst.Name) and device.value.value == "None":
            kind = BARE
        else:
            kind = EXPR
        if not self._wrong(kind):
            return
        if (kind_of(self.ctx, call.func.value) or result_kind(self.ctx, call)) not in (TENSOR, MODULE):
            self._foreign_cuda(call, kind, device)
            return

        def fix(c: cst.Call) -> cst.Call:
            positional = [a for a in c.args if a.keyword is None]
            keywords = [a for a in c.args if a.keyword is not None and a.keyword.value != "device"]
            extra = [kwarg("non_blocking", positional[1].value)] if len(positional) > 1 else []
            to = c.with_changes(func=c.func.with_changes(attr=cst.Name("to")))
            return with_args(to, [cst.Arg(value=self._tm_device()), *extra, *keywords])

        what = "`.cuda()` uses the current GPU" if kind == BARE else f"`.cuda({code(device.value)})` uses a fixed GPU"
        self._fix(call, f"{what}, the same on every rank unless set per process; use .to(tm.device())",
                  replace(call, fix))

    def _foreign_cuda(self, call: cst.Call, kind: str, device: Optional[cst.Arg]) -> None:
        """`x.cuda()` on what is not known to be a tensor or a module (a loss object of the
        program with a `cuda()` of its own, a container, a parameter): the call stays, it may
        have no `.to()`. After tm.setup() the current GPU is the process's own, so a bare
        `.cuda()` is right as it is; a GPU index becomes the process's own, `tm.local_rank()`."""
        receiver = code(call.func.value)
        if kind == BARE:
            if not self.converting:  # lint: a file that never pins its GPU
                self.report(call, f"`{receiver}.cuda()` uses the current GPU, which this file never sets per process "
                                  "(torch.cuda.set_device(local_rank)): every rank would use GPU 0")
            return
        if device is None or self._is_local_rank(device.value):
            return
        if isinstance(device.value, cst.Call):
            return  # `.cuda(torch.device(device))`: a device, which the rule makes the process's own where it is made
        self._fix(device.value, f"`.cuda({code(device.value)})` names a fixed GPU, the same on every rank; "
                                f"`{receiver}` is not known to be a tensor or a module, so its own cuda() is kept "
                                f"with the process's own GPU index, tm.local_rank()",
                  replace_with(device.value, expr(f"{self.ctx.tm}.local_rank()")))

    def _is_local_rank(self, node: cst.BaseExpression) -> bool:
        return isinstance(node, cst.Call) and not node.args and self.ctx.resolve(node.func) == RUNTIME + ".local_rank"

    def _dot_to(self, call: cst.Call) -> None:
        if self.ctx.resolve(call.func) is not None:
            return
        target = arg(call, "device", 0)
        if target is None:
            return
        if self._gpu_index_value(target.value, "`.to(...)`"):
            return
        self._device_value(target.value, "`.to(...)` with a hard-coded CUDA device: every rank would use the same GPU")

    def _gpu_index_value(self, value: cst.BaseExpression, where: str) -> bool:
        """`.to(0)`, `device=args.gpu`: a GPU index where a device is expected becomes
        tm.device(); inside a `map_location=` (TM502's) it is only reported. True when handled."""
        kind = gpu_index(value)
        if kind == EXPR and self._string_named(code(value)):
            return False  # `gpu = "cuda:0"`: a string device, see _string_assign
        if value in self.int_device_uses:
            return True  # its origin (`device = 0`) becomes tm.device()
        if kind is None or not self._wrong(kind):
            return kind is not None
        if self._in_map_location(value):
            self._map_location_index(value)
            return True
        if self._parameter(value):
            # `def init_net(net, gpu_id="cuda:0"): net.to(gpu_id)`: the caller may pass the CPU
            # (`init_net(net, gpu_id=device)` with `--cuda` off); any GPU it names is the rank's
            self._fix(value, f"{where} takes the device `{code(value)}` its caller passes: any GPU it names is now "
                             "this process's own (tm.as_device), the CPU stays the CPU",
                      replace_with(value, cst.parse_expression(f"{self.ctx.tm}.as_device({code(value)})")))
            return True
        self._fix(value, f"{where} names GPU `{code(value)}`, the same on every rank (after tm.setup() each process "
                         "has its own GPU); use tm.device()", replace_with(value, self._tm_device()))
        return True

    def _parameter(self, value: cst.BaseExpression) -> bool:
        """`value` is a parameter of its function, not rebound there: its caller chooses it."""
        func = self.ctx.enclosing(value, cst.FunctionDef)
        if not isinstance(value, cst.Name) or func is None:
            return False
        p = func.params
        if value.value not in {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}:
            return False
        return value.value not in _assigned_in(self.ctx, func)

    def _string_named(self, name: str) -> bool:
        """Some assignment of this name in the file is a string (or a choice of strings)."""
        for assign in analysis.facts(self.ctx).assigns:
            if any(dotted(t.target) == name for t in assign.targets):
                value = assign.value
                branches = (value.body, value.orelse) if isinstance(value, cst.IfExp) else (value,)
                if any(isinstance(b, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString))
                       or isinstance(b, cst.Call) and dotted(b.func) == "str" for b in branches):
                    return True
        return False

    def _map_location_index(self, node: cst.CSTNode) -> None:
        if node in self.map_location_reported:
            return
        self.map_location_reported.add(node)
        self.report(node, f"map_location puts the loaded tensors on GPU `{code(node)}` on every rank, which is "
                          "the wrong GPU on ranks other than 0 now that each process has its own: use "
                          "map_location=tm.device() (or \"cpu\" and move what you use)")

    def _device_kwarg(self, call: cst.Call, name: str) -> None:
        if name in _NOT_DEVICE_KW or name.startswith(_NOT_DEVICE_PREFIXES):
            return
        target = arg(call, "device")
        if target is not None:
            if self._gpu_index_value(target.value, f"`device=` of {name.split('.', 1)[1]}(...)"):
                return
            self._device_value(target.value, f"`device=` of {name.split('.', 1)[1]}(...) is a hard-coded CUDA device")

    def _other_device_kwarg(self, call: cst.Call) -> None:
        """`BucketIterator(..., device=args.gpu)`, `pipeline(..., device=0)`: a library call
        given a GPU index (`device=-1`, the old "cpu", is left alone)."""
        target = arg(call, "device")
        if target is None:
            return
        func = call.func
        f = analysis.facts(self.ctx)
        if isinstance(func, cst.Name) and (func.value in f.functions or func.value in f.classes) \
                or isinstance(func, cst.Attribute) and dotted(func.value) == "self":
            return  # this file's own code: what it does with an index is followed by _int_devices
        name = dotted(func) or "call"
        self._gpu_index_value(target.value, f"`device=` of {name.rsplit('.', 1)[-1]}(...)")

    def _device_value(self, value: cst.BaseExpression, message: str) -> None:
        """A string device in a place that accepts a torch.device (`.to(...)`, `device=`)."""
        if isinstance(value, cst.IfExp):
            split = self._split(value, string=True)
            if split is None or not self._wrong(split[0]):
                return
            kind, is_body = split
            self._fix(value, message + "; use tm.device()",
                      replace(value, lambda v: self._conditional(v, is_body, self._tm_device())))
            return
        if self._wrong(cuda_string(value)):
            self._fix(value, message + "; use tm.device()", replace_with(value, self._tm_device()))

    def _gpu_list(self, call: cst.Call) -> None:
        """`device = list(range(torch.cuda.device_count()))`, the program's list of its GPUs (then
        `f"cuda:{device[0]}"`, `DataParallel(model, device_ids=device)`): every rank would name
        GPU 0 first while its model sits on its own GPU. `tm.gpu_ids()`: the rank's own GPU
        under torchrun, every visible GPU in one process."""
        if len(call.args) != 1 or not isinstance(call.args[0].value, cst.Call):
            return
        inner = call.args[0].value
        if self.ctx.resolve(inner.func) is not None or dotted(inner.func) != "range" or len(inner.args) != 1 \
                or not isinstance(inner.args[0].value, cst.Call) \
                or self.ctx.resolve(inner.args[0].value.func) != "torch.cuda.device_count":
            return
        self._fix(call, "a list of every visible GPU names GPU 0 first on every rank, while the rank's model is on its "
                        "own GPU: tm.gpu_ids() lists the rank's own GPU under torchrun, every GPU in one process",
                  replace_with(call, expr(f"{self.ctx.tm}.gpu_ids()")))

    def _default_tensor_type(self, call: cst.Call) -> None:
        """`torch.set_default_tensor_type("torch.cuda.FloatTensor")`: new tensors on the current
        GPU (the rank's own after `tm.setup()`), where there is one; the CPU type on CPU ranks
        (`torchmigrate verify`, gloo), where the CUDA type raises."""
        if len(call.args) != 1 or call.args[0].keyword is not None:
            return
        value = call.args[0].value
        if not isinstance(value, (cst.SimpleString, cst.Attribute)):
            return  # (a choice already: migrated, or the program's own)
        text = value.evaluated_value if isinstance(value, cst.SimpleString) else code(value)
        if not isinstance(text, str) or not text.startswith("torch.cuda.") or not text.endswith("Tensor"):
            return
        cpu = "torch." + text[len("torch.cuda."):]
        new = cst.parse_expression(f"{code(value)} if {self.ctx.tm}.device().type == \"cuda\" else "
                                   + (repr(cpu).replace("'", '"') if isinstance(value, cst.SimpleString) else cpu))
        self._fix(value, "the default tensor type is a CUDA one, which the CPU ranks cannot make: the CPU type "
                         "where this process has no GPU", replace_with(value, new))

    def _argparse_default(self, call: cst.Call) -> None:
        """`add_argument("--device", default="cuda:0")`: a string option. With no `type=` (or
        `type=str`) it gets `type=tm.device_arg`, which reads any GPU named by the default or on
        the command line (`-d cuda:0`, as the README says to start it) as the rank's own; with
        another `type=`, only its default becomes `str(tm.device())`."""
        default = arg(call, "default")
        if default is None:
            return
        value = default.value
        split = self._split(value, string=True) if isinstance(value, cst.IfExp) else None
        kind = split[0] if split else cuda_string(value)
        if kind != LITERAL or not self._wrong(kind):
            return
        given = arg(call, "type")
        if given is not None and self.ctx.resolve(given.value) == f"{RUNTIME}.device_arg":
            return  # migrated already: the type reads the default
        if given is None or code(given.value) == "str":
            new_type = expr(f"{self.ctx.tm}.device_arg")
            self._fix(call, "device option naming a fixed GPU: every rank would use it, also when given on the command "
                            f"line; `type={self.ctx.tm}.device_arg` makes any GPU it names the rank's own",
                      replace(call, lambda c: add_kwarg(c, "type", new_type)))
            return
        new = expr(f"str({self.ctx.tm}.device())")
        message = "command-line default names a fixed GPU: every rank would use it; default to str(tm.device())"
        self._fix_string(value, split, new, message)

    def _string_slots(self) -> None:
        """A GPU named by a string where no assignment or torch call shows it: a parameter's
        default (`def train(model, device="cuda:1")`), a config entry (`{"device": "cuda:0"}`),
        a keyword of the program's own or a library's call (`Trainer(device="cuda:0")`). The
        wrap moved the model to cuda:LOCAL_RANK, so every rank but one would compute across two
        GPUs: the slot becomes `str(tm.device())` (a string still, for code that formats or
        compares it). Keywords of torch's own calls are `_device_kwarg`'s."""
        for _, node in self.ctx.positioned(cst.Param, cst.DictElement, cst.Arg):
            if isinstance(node, cst.Param):
                value = node.default
                where = f"the default of `{node.name.value}`"
            elif isinstance(node, cst.DictElement):
                value = node.value
                where = f"the entry {code(node.key)}"
            else:
                call = self.ctx.parent(node)
                if node.keyword is None or not isinstance(call, cst.Call):
                    continue
                name = self.ctx.resolve(call.func) or ""
                if name.startswith(("torch.", RUNTIME)) or name == "str" or (
                        isinstance(call.func, cst.Attribute) and call.func.attr.value == "add_argument"):
                    continue  # torch's: _device_kwarg; add_argument: _argparse_default
                value = node.value
                where = f"`{node.keyword.value}=` of {(dotted(call.func) or 'a call').rsplit('.', 1)[-1]}(...)"
            if value is None:
                continue
            split = self._split(value, string=True) if type(value) is cst.IfExp else None
            kind = split[0] if split else cuda_string(value)
            if kind not in (LITERAL, EXPR):
                continue
            new = expr(f"str({self.ctx.tm}.device())")
            message = (f"{where} names a fixed GPU ({code(value)}) while the model is moved to this process's: "
                       f"every rank would use that GPU; use {code(new)}")
            self._fix_string(value, split, new, message)

    # --- batches --------------------------------------------------------------------------------
    def _batch_moves(self) -> None:
        if moves_to_devices(self.ctx) or not self.ctx.program.program_devices:
            return  # (a program that names no device stays on the CPU: `tm.setup(device="cpu")`, TM101)
        from torchmigrate.rules.model.plan import plan as model_plan

        models = {w.name for w in model_plan(self.ctx).new}
        if models:
            _BatchMoves(self, models).run()

    # --- integer device variables -------------------------------------------------------------
    def _int_devices(self) -> None:
        """`device = 0` (or `args.gpu`, `int(...)`) that ends up in `.to(...)`: the process's own
        device instead, when every use treats it as a device; a TODO when it is also a number."""
        tracer = _IntDevices(self)
        for assign in tracer.origins():
            device, other = tracer.follow(assign)
            if not device:
                continue
            if self._is_tm_device(assign.value):
                self.int_device_uses.update(device)
                continue
            target = assign.targets[0].target.value
            uses = ", ".join(sorted({code(self.ctx.statement_of(u).body[0]) if isinstance(
                self.ctx.statement_of(u), cst.SimpleStatementLine) else code(u) for u in device[:1]}))
            if other:
                self.report(assign, f"`{target} = {code(assign.value)}` is used as a device (`{uses}`) but also as a "
                                    f"number: every rank would use that GPU; pass `{self.ctx.tm}.device()` where it "
                                    f"is a device (or use `{self.ctx.tm}.local_rank()` as the index)")
                continue
            self.int_device_uses.update(device)
            self._fix(assign.value, f"`{target} = {code(assign.value)}` is used as a device (`{uses}`): every rank "
                                    f"would use that GPU; use {self.ctx.tm}.device() (cuda:LOCAL_RANK, or cpu "
                                    "without CUDA)", replace_with(assign.value, self._tm_device()))

    # --- string variables ------------------------------------------------------------------
    def _string_assign(self, assign: cst.Assign) -> None:
        if len(assign.targets) != 1:
            return
        # Asked of every assignment: the cheap test of the value first, the target's name only
        # for the few that hold a CUDA device.
        value = assign.value
        split = self._split(value, string=True) if type(value) is cst.IfExp else None
        kind = split[0] if split else cuda_string(value)
        if not self._wrong(kind):
            return
        target = dotted(assign.targets[0].target)
        if target is None or target.count(".") > 1 or self._enum_member(assign):
            return
        as_device = self._device_uses_only(target, assign)
        if as_device:
            new = self._tm_device()
        elif kind == BARE:
            if not self.converting:
                self.report(value, f"`{target}` is the current GPU, which this file never sets per process "
                                   "(torch.cuda.set_device(local_rank)): every rank would use GPU 0")
            return  # after tm.setup() a bare "cuda" already is this process's GPU
        else:
            new = expr(f"str({self.ctx.tm}.device())")
        message = (f"`{target}` names a hard-coded CUDA device: every rank would use the same GPU; use "
                   f"{code(new)}")
        self._fix_string(value, split, new, message)

    def _enum_member(self, assign: cst.Assign) -> bool:
        """`CUDA = "cuda"` in the body of an Enum (`class TorchDevice(str, Enum)`): a member's value,
        which names the member (`TorchDevice("cuda")` looks it up by it), not a device to move to."""
        klass = self.ctx.enclosing(assign, cst.ClassDef, cst.FunctionDef)
        return isinstance(klass, cst.ClassDef) and any(
            (dotted(b.value) or "").rsplit(".", 1)[-1] in ("Enum", "IntEnum", "StrEnum", "Flag", "IntFlag")
            for b in klass.bases)

    def _device_uses_only(self, target: str, assign: cst.Assign) -> bool:
        """Every use of the variable (anywhere in the module, by name) accepts a torch.device."""
        for use in self.occurrences(target):
            parent = self.ctx.parent(use)
            if isinstance(parent, cst.AssignTarget) or isinstance(parent, (cst.Param, cst.ImportAlias)):
                continue
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.AugAssign, cst.For, cst.AnnAssign)) \
                    and getattr(parent, "value", None) is not use and getattr(parent, "iter", None) is not use:
                continue  # a definition, not a use
            if isinstance(parent, cst.Arg):
                if parent.keyword is use:
                    continue
                if parent.keyword is not None and parent.keyword.value == "device_type":
                    return False
                call = self.ctx.parent(parent)
                name = self.ctx.resolve(call.func) if isinstance(call, cst.Call) else None
                func = dotted(call.func) if isinstance(call, cst.Call) else None
                if func in ("str", "repr", "len") or any(
                        w in (name or func or "") for w in ("autocast", "GradScaler", "torch.amp.")):
                    return False
                continue
            if isinstance(parent, cst.Attribute) and parent.value is use:
                if parent.attr.value in _DEVICE_ATTRS:
                    continue
                return False
            if isinstance(parent, cst.FormattedStringExpression):
                continue
            return False  # comparisons, arithmetic, containers, returns: keep the string
        return True

    # --- set_device / torch.cuda.device ------------------------------------------------------
    def _set_device(self, call: cst.Call) -> None:
        index = arg(call, "device", 0)
        if index is None:
            return
        if not self.converting:
            if _int(index.value):
                self._fix(call, f"torch.cuda.set_device({index.value.value}) pins every rank to the same GPU; "
                                "use the local rank (tm.device())",
                          replace(call, lambda c: with_args(c, [cst.Arg(value=self._tm_device())])))
            return
        expr_stmt = self.ctx.parent(call)
        line = self.ctx.parent(expr_stmt) if isinstance(expr_stmt, cst.Expr) else None
        if (setup_plan(self.ctx) is not None or legacy_launch(self.ctx)) and isinstance(line, cst.SimpleStatementLine):
            target = self._removable_if(line) or expr_stmt
            self.report(call, "torch.cuda.set_device is done by tm.setup() (cuda:LOCAL_RANK) before anything "
                              "is allocated; a fixed index here would move every rank back to one GPU",
                        edits=[remove(target)])
            return
        if isinstance(index.value, cst.Call) and code(index.value) == f"{self.ctx.tm}.device()":
            return
        tm = self.ctx.tm
        self._fix(call, f"torch.cuda.set_device with a fixed index pins every rank to the same GPU; "
                        f"{tm}.set_device() sets this process's own (nothing on the CPU, where the index was -1)",
                  replace(call, lambda c: cst.Call(func=expr(f"{tm}.set_device"))))

    def _removable_if(self, line: cst.SimpleStatementLine) -> Optional[cst.If]:
        """`if cond: torch.cuda.set_device(...)` with nothing else: the whole `if` goes."""
        if len(line.body) != 1:
            return None
        block = self.ctx.parent(line)
        stmt_if = self.ctx.parent(block)
        if not (isinstance(block, cst.IndentedBlock) and isinstance(stmt_if, cst.If) and stmt_if.orelse is None
                and stmt_if.body is block and len(block.body) == 1):
            return None
        if isinstance(self.ctx.parent(stmt_if), cst.If):  # an elif
            return None
        if not self._pure(stmt_if.test):
            return None
        return stmt_if

    def _pure(self, test: cst.BaseExpression) -> bool:
        """No side effects beyond torch.cuda.is_available()/device_count()."""
        if isinstance(test, cst.Call):
            return self.ctx.resolve(test.func) in (IS_AVAILABLE, "torch.cuda.device_count") and not test.args
        if isinstance(test, (cst.Name, cst.Attribute, cst.Integer, cst.SimpleString)):
            return True
        if isinstance(test, cst.UnaryOperation):
            return self._pure(test.expression)
        if isinstance(test, cst.BooleanOperation):
            return self._pure(test.left) and self._pure(test.right)
        if isinstance(test, cst.Comparison):
            return self._pure(test.left) and all(self._pure(c.comparator) for c in test.comparisons)
        return False

    def _device_ctx(self, call: cst.Call) -> None:
        index = arg(call, "device", 0)
        if index is None:
            return
        if self.converting or _int(index.value):
            self.report(call, "torch.cuda.device(...) selects a fixed GPU for this block: under torchrun each "
                              "process must use its own GPU (tm.device()); drop the block or pass tm.device()")


# --- integer device variables (`device = 0` ... `.to(device)`) --------------------------------------

_PRINTERS = ("print", "tm.print", "logger.info", "logging.info", "log.info")
_MAX_HOPS = 6


def _assigned_in(ctx: Context, func: cst.CSTNode) -> Set[str]:
    """Names that assignments directly in `func` (a function, or the module) bind: grouped for
    all functions in one pass over the file's assignments, not one pass per function."""
    grouped = ctx.facts.get("tm103.assigned")
    if grouped is None:
        grouped = ctx.facts["tm103.assigned"] = {}
        for assign in analysis.facts(ctx).assigns:
            names = grouped.setdefault(ctx.enclosing(assign, cst.FunctionDef) or ctx.module, set())
            for t in assign.targets:
                names.update(n.value for n in _target_names(t.target))
    return grouped.get(func, set())


class _IntDevices:
    """Follows a variable assigned a GPU index (`device = 0`, `gpu = args.gpu`, `dev =
    int(...)`) through assignments (`self.gpu_id = gpu_id`) and calls of this file's functions
    and classes (`main(device)`, `Trainer(model, device)`) to what it is used for: as a device
    (`.to(x)`, `.cuda(x)`, `device=x`, `torch.device(x)`, `set_device(x)`), only printed, or
    anything else (arithmetic, comparisons, unknown calls)."""

    def __init__(self, rule: "DeviceFromRank") -> None:
        self.rule = rule
        self.ctx = rule.ctx
        self.facts = analysis.facts(rule.ctx)
        self._locals: Dict[cst.CSTNode, Set[str]] = {}

    # scopes
    def _function(self, node: cst.CSTNode) -> cst.CSTNode:
        return self.ctx.enclosing(node, cst.FunctionDef) or self.ctx.module

    def _local_names(self, func: cst.FunctionDef) -> Set[str]:
        names = self._locals.get(func)
        if names is None:
            p = func.params
            names = {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}
            for star in (p.star_arg, p.star_kwarg):
                if isinstance(star, cst.Param):
                    names.add(star.name.value)
            names |= _assigned_in(self.ctx, func)
            self._locals[func] = names
        return names


    def _binds(self, use: cst.Name, scope: cst.CSTNode) -> bool:
        """`use` reads the variable of `scope` (not a same-named local of an inner function)."""
        node = use
        while True:
            func = self.ctx.enclosing(node, cst.FunctionDef)
            if func is None:
                return scope is self.ctx.module
            if func is scope:
                return True
            if use.value in self._local_names(func):
                return False
            node = func

    def _uses(self, binding) -> List[cst.CSTNode]:
        kind, scope, name = binding
        if kind == "attr":
            return [u for u in self.rule.occurrences(name) if isinstance(u, cst.Attribute)
                    and self.ctx.enclosing(u, cst.ClassDef) is scope]
        return [u for u in self.rule.occurrences(name) if isinstance(u, cst.Name) and self._binds(u, scope)]

    # origins
    def origins(self) -> List[cst.Assign]:
        counts: Dict[Tuple[cst.CSTNode, str], int] = {}
        found = []
        for assign in self.facts.assigns:
            if len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
                continue
            key = (self._function(assign), assign.targets[0].target.value)
            counts[key] = counts.get(key, 0) + 1
            if self._index_value(assign.value):
                found.append(assign)
        return [a for a in found if counts[(self._function(a), a.targets[0].target.value)] == 1]

    def _index_value(self, value: cst.BaseExpression) -> bool:
        if self.rule._is_tm_device(value):
            return True  # already migrated: its uses are not GPU indices any more
        if isinstance(value, cst.Integer):
            return True
        if isinstance(value, cst.Call) and dotted(value.func) == "int" and len(value.args) == 1:
            return "rank" not in code(value).lower()
        return isinstance(value, cst.Attribute) and gpu_index(value) == EXPR

    def follow(self, assign: cst.Assign):
        """(device uses, other uses) of the variable `assign` binds, through the file."""
        start = ("name", self._function(assign), assign.targets[0].target.value)
        todo, seen = [(start, 0)], {start}
        device: List[cst.CSTNode] = []
        other: List[cst.CSTNode] = []
        while todo:
            binding, hops = todo.pop()
            for use in self._uses(binding):
                verdict, nxt = self._classify(use)
                if verdict == "device":
                    device.append(use)
                elif verdict == "other":
                    other.append(use)
                elif verdict == "pass" and nxt is not None:
                    if nxt not in seen:
                        if hops >= _MAX_HOPS:
                            other.append(use)
                            continue
                        seen.add(nxt)
                        todo.append((nxt, hops + 1))
        return device, other

    def _classify(self, use: cst.CSTNode):
        ctx = self.ctx
        parent = ctx.parent(use)
        if isinstance(parent, (cst.AssignTarget, cst.Param, cst.NameItem, cst.ImportAlias, cst.FunctionDef,
                               cst.ClassDef)):
            return "def", None
        if isinstance(parent, cst.AnnAssign) and parent.target is use:
            return "def", None
        if isinstance(parent, cst.FormattedStringExpression):
            return "benign", None
        if isinstance(parent, cst.Assign) and parent.value is use and len(parent.targets) == 1:
            target = parent.targets[0].target
            if isinstance(target, cst.Name):
                return "pass", ("name", self._function(parent), target.value)
            name = dotted(target)
            klass = ctx.enclosing(parent, cst.ClassDef)
            if name and name.count(".") == 1 and name.startswith("self.") and klass is not None:
                return "pass", ("attr", klass, name)
            return "other", None
        if not isinstance(parent, cst.Arg) or parent.value is not use or parent.star:
            return "other", None
        call = ctx.parent(parent)
        if not isinstance(call, cst.Call):
            return "other", None
        keyword = parent.keyword.value if parent.keyword is not None else None
        resolved = ctx.resolve(call.func)
        target = self._callee(call)
        if target is not None:
            param = self._param_for(call, parent, target)
            return ("other", None) if param is None else ("pass", ("name", target, param))
        if keyword in ("device", "output_device") and not self.rule._in_map_location(call):
            return "device", None
        func = call.func
        if resolved is None and isinstance(func, cst.Attribute) and func.attr.value in ("to", "cuda"):
            first = arg(call, "device", 0)
            if first is parent and not self.rule._in_map_location(call):
                return "device", None
            return "other", None
        if resolved == "torch.device":
            if arg(call, "type", 0) is parent and len(call.args) == 1:
                return "device", None
            first = arg(call, "type", 0)
            if arg(call, "index", 1) is parent and first is not None and cuda_string(first.value) == BARE:
                return "device", None  # the whole torch.device("cuda", x) becomes tm.device()
            return "other", None
        if resolved in (SET_DEVICE,):
            return "device", None
        if (dotted(func) or "") in _PRINTERS or resolved == RUNTIME + ".print":
            return "benign", None
        return "other", None

    def _callee(self, call: cst.Call) -> Optional[cst.FunctionDef]:
        func = call.func
        if isinstance(func, cst.Name) and self.ctx.resolve(func) is None:
            if func.value in self.facts.functions:
                return self.facts.functions[func.value]
            klass = self.facts.classes.get(func.value)
            if klass is not None and isinstance(klass.body, cst.IndentedBlock):
                for s in klass.body.body:
                    if isinstance(s, cst.FunctionDef) and s.name.value == "__init__":
                        return s
        if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
            klass = self.ctx.enclosing(call, cst.ClassDef)
            if klass is not None and isinstance(klass.body, cst.IndentedBlock):
                for s in klass.body.body:
                    if isinstance(s, cst.FunctionDef) and s.name.value == func.attr.value:
                        return s
        return None

    def _param_for(self, call: cst.Call, a: cst.Arg, func: cst.FunctionDef) -> Optional[str]:
        p = func.params
        positional = [x.name.value for x in (*p.posonly_params, *p.params)]
        if isinstance(self.ctx.parent(self.ctx.parent(func)), cst.ClassDef) and positional:
            positional = positional[1:]  # self
        if a.keyword is not None:
            names = set(positional) | {x.name.value for x in p.kwonly_params}
            return a.keyword.value if a.keyword.value in names else None
        plain = []
        for x in call.args:
            if x.star:
                return None
            if x.keyword is None:
                plain.append(x)
        index = plain.index(a)
        return positional[index] if index < len(positional) else None


def _target_names(node: cst.CSTNode) -> List[cst.Name]:
    if isinstance(node, cst.Name):
        return [node]
    if isinstance(node, (cst.Tuple, cst.List)):
        return [n for el in node.elements for n in _target_names(el.value)]
    if isinstance(node, cst.StarredElement):
        return _target_names(node.value)
    return []


# --- batches for a model that tm.wrap_model moved (`for x, y in loader: net(x)`) ------------------

_LOOP_OR_SCOPE = (cst.For, cst.While, cst.FunctionDef, cst.ClassDef, cst.Lambda)
_DATALOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
# What a script does with a tensor batch (anything else, `batch.label`, suggests another type).
_TENSOR_ATTRS = frozenset("""
    size shape view view_as reshape reshape_as float double half bfloat16 long int bool byte char short
    to numel dim ndim ndimension squeeze unsqueeze permute transpose t T flatten contiguous detach cpu
    type type_as dtype device data sum mean max min argmax argmin eq ne gt lt ge le item tolist expand
    expand_as repeat clone new_zeros new_ones new_full new_empty new_tensor requires_grad_ unbind split chunk
    narrow masked_fill fill_ zero_ is_cuda element_size nelement std var abs norm softmax log_softmax
    """.split())
_DTYPE_ONLY = ("torch.float", "torch.double", "torch.half", "torch.bfloat16", "torch.long", "torch.int",
               "torch.bool", "torch.uint8", "torch.int8", "torch.int16", "torch.int32", "torch.int64",
               "torch.float16", "torch.float32", "torch.float64", "torch.complex64", "torch.channels_last",
               "torch.contiguous_format", "torch.preserve_format")


def _base(node: cst.BaseExpression) -> Optional[str]:
    """The variable an expression is computed from: `x` for `x`, `x.view(-1)`, `x[0]`, `x.data`."""
    while True:
        if isinstance(node, cst.Name):
            return node.value
        if isinstance(node, cst.Attribute):
            node = node.value
        elif isinstance(node, cst.Subscript):
            node = node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            node = node.func.value
        else:
            return None


def _elementwise_bases(node: cst.BaseExpression) -> List[str]:
    """The variables an operand is computed from elementwise: `y` for `y`, `y.view(-1)`, and for
    `(y == c)`, `y * w`, `~mask` the operands' own (a tensor met with the model's outputs through
    `(pred == c) & (y == c)` must be on their device too)."""
    if isinstance(node, cst.Comparison):
        parts = [node.left, *(c.comparator for c in node.comparisons)]
    elif isinstance(node, cst.BinaryOperation):
        parts = [node.left, node.right]
    elif isinstance(node, cst.UnaryOperation):
        parts = [node.expression]
    else:
        base = _base(node)
        return [base] if base is not None else []
    return [b for part in parts for b in _elementwise_bases(part)]


_LOSS_NAME = re.compile(r"loss|crit|objective|distance", re.IGNORECASE)


def _constant(node: cst.BaseExpression) -> bool:
    if isinstance(node, (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString, cst.FormattedString)):
        return True
    return isinstance(node, cst.Name) and node.value in ("None", "True", "False")


def _names(node: cst.CSTNode) -> Set[str]:
    out: Set[str] = set()

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            out.add(n.value)
        elif isinstance(n, cst.Attribute):
            go(n.value)
        elif not isinstance(n, cst.Lambda):
            for child in n.children:
                go(child)

    go(node)
    return out


class _BatchMoves:
    """In a file that never moves anything to a device, `tm.wrap_model` (TM301) puts the model
    on `tm.device()` while the batches stay on the CPU. Loops that feed the model get the
    batch moved as their first statement: `inputs, labels = tm.to_device(inputs, labels)` (tensors
    moved, anything else such as a count or a list of lengths kept), for `for a, b in loader`, `for i, (a, b) in enumerate(loader)`
    and `for batch in loader:` (optionally unpacked by the first statement, `a, b = batch`).
    Moved are the names the model reads and those used together with its outputs (`labels` in
    `criterion(outputs, labels)` or `predicted == labels`). Other shapes, batches that may not
    be tensors (a custom `collate_fn`, `batch.text`, `model(**batch)`) and forwards outside such
    loops get a TODO."""

    def __init__(self, rule: "DeviceFromRank", models: Set[str]) -> None:
        self.rule = rule
        self.ctx = rule.ctx
        self.models = models
        self.facts = analysis.facts(rule.ctx)
        self.tm = rule.ctx.tm
        self.maybe: Set[str] = set()  # batch names used with the outputs in unknown calls
        self.tainted: Set[str] = set()  # names computed from the model's outputs (current loop)

    def _in_loop(self, node: cst.CSTNode, loop: cst.For) -> bool:
        return self.ctx.enclosing(node, *_LOOP_OR_SCOPE) is loop

    def _model_of(self, call: cst.Call) -> Optional[str]:
        """The model a call runs: `model(x)`, or a member of a wrapped container
        (`heads["a"](x)`, `models[i](x)`, `m(x)` in `for m in models`)."""
        func = call.func
        if isinstance(func, cst.Subscript):
            func = func.value
        name = dotted(func)
        if isinstance(func, cst.Name) and name not in self.models:
            over = analysis.loop_binding(self.ctx, call, func.value)
            return dotted(over) if over is not None else name
        return name

    def run(self) -> None:
        model_calls = [c for c, name in self.facts.calls if name is None and self._model_of(c) in self.models]
        if not model_calls:
            return
        covered: Set[cst.Call] = set()
        by_loop: Dict[cst.CSTNode, List[cst.Call]] = {}
        for call in model_calls:
            loop = self.ctx.enclosing(call, *_LOOP_OR_SCOPE)
            if isinstance(loop, cst.For):
                by_loop.setdefault(loop, []).append(call)
        for loop, calls in by_loop.items():
            if self._loop(loop, calls):
                covered.update(calls)
        reported: Set[cst.CSTNode] = set()
        for call in model_calls:
            if call in covered:
                continue
            inputs = [a.value for a in call.args if not a.star and not _constant(a.value)
                      and _base(a.value) not in ("self", "args", "cfg", "config")]
            line = self.ctx.statement_of(call)
            if not inputs or line in reported:
                continue
            reported.add(line)
            model = self._model_of(call)
            self.rule.report(call, f"`{model}` now lives on {self.tm}.device() ({self.tm}.wrap_model moves it) but this "
                                   f"file never moves its inputs: move `{code(inputs[0])}` (and any tensor its output is "
                                   f"compared with) with `.to({self.tm}.device())` before the forward")

    def _loop(self, loop: cst.For, calls: List[cst.Call]) -> bool:
        """Handles one loop (edit or TODO); True when its forwards need nothing more."""
        shape = self._shape(loop)
        loop_names = _names(loop.target)
        fed = any(_base(a.value) in loop_names or (a.star and _names(a.value) & loop_names)
                  for c in calls for a in c.args)
        if shape is None:
            if fed:
                self._todo(loop, "this loop's batch")
                return True
            return False
        names, anchor, whole = shape
        derived = self._derived(loop, names)
        inputs = {derived[_base(a.value)] for c in calls for a in c.args
                  if not a.star and _base(a.value) in derived}
        starred = any(a.star and _names(a.value) & set(derived) for c in calls for a in c.args)
        if not inputs and not starred:
            return False
        if starred or not isinstance(loop.body, cst.IndentedBlock) or self._custom_collate(loop):
            self._todo(loop, "this loop's batch")
            return True
        with_outputs = self._with_outputs(loop, calls, derived)
        move = [n for n in names if n in inputs or n in with_outputs]
        if any(not self._tensor_like(loop, n, whole) for n in move):
            self._todo(loop, f"this loop's batch (`{', '.join(move)}`)")
            return True
        tm = self.tm
        line = stmt(f"{', '.join(move)} = {tm}.to_device({', '.join(move)})")
        edit = insert_after(anchor, [line]) if anchor is not None else insert_before(loop.body.body[0], [line])
        self.rule.report(loop, f"the model now lives on {tm}.device() ({tm}.wrap_model moves it) but the batches of "
                               f"this loop stay on the CPU: move them first (`{code(line.body[0])}`)",
                         edits=[edit], imports=[self.ctx.runtime_import()])
        unsure = [n for n in names if n in self.maybe and n not in move]
        if unsure:
            self.rule.report(loop, f"`{', '.join(unsure)}` of this loop's batch stays on the CPU while the model's "
                                   f"outputs are on {tm}.device(): if it is a tensor used with them, move it too "
                                   f"(`.to({tm}.device())`)")
        return True

    def _todo(self, loop: cst.For, what: str) -> None:
        tm = self.tm
        self.rule.report(loop, f"the model now lives on {tm}.device() ({tm}.wrap_model moves it) but {what} stays on "
                               f"the CPU: move the tensors the model and the loss use with `.to({tm}.device())` at the "
                               "start of the loop body (not done automatically: the batch may not be all tensors, or "
                               "code after the forward may expect it on the CPU)")

    def _shape(self, loop: cst.For):
        """(batch names, statement to insert after or None for the top of the body, whole batch)."""
        target, source = loop.target, loop.iter
        if isinstance(source, cst.Call) and dotted(source.func) == "enumerate" and self.ctx.resolve(source.func) is None:
            if not (isinstance(target, cst.Tuple) and len(target.elements) == 2):
                return None
            target = target.elements[1].value
        if isinstance(target, (cst.Tuple, cst.List)):
            if all(isinstance(el.value, cst.Name) and not isinstance(el, cst.StarredElement) for el in target.elements):
                return [el.value.value for el in target.elements], None, False
            return None
        if not isinstance(target, cst.Name):
            return None
        body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else ()
        first = body[0] if body else None
        if isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1 and isinstance(first.body[0], cst.Assign):
            assign = first.body[0]
            t = assign.targets[0].target if len(assign.targets) == 1 else None
            if isinstance(t, (cst.Tuple, cst.List)) and isinstance(assign.value, cst.Name) \
                    and assign.value.value == target.value \
                    and all(isinstance(el.value, cst.Name) and not isinstance(el, cst.StarredElement)
                            for el in t.elements):
                return [el.value.value for el in t.elements], first, False
        return [target.value], None, True

    def _loop_assigns(self, loop: cst.For) -> List[cst.Assign]:
        return [a for a in self.facts.assigns if self._in_loop(a, loop)]

    def _derived(self, loop: cst.For, names: List[str]) -> Dict[str, str]:
        """Names computed from a batch name in the loop (`x = x.view(-1, 784)`) -> that name."""
        derived = {n: n for n in names}
        assigns = self._loop_assigns(loop)
        for _ in range(3):
            before = len(derived)
            for a in assigns:
                base = _base(a.value)
                if base in derived:
                    for t in a.targets:
                        for n in _target_names(t.target):
                            derived.setdefault(n.value, derived[base])
            if len(derived) == before:
                break
        return derived

    def _with_outputs(self, loop: cst.For, calls: List[cst.Call], derived: Dict[str, str]) -> Set[str]:
        """Batch names used together with the model's outputs: `criterion(outputs, labels)`,
        `predicted == labels`, `pred.eq(target.view_as(pred))`."""
        tainted: Set[str] = set()
        assigns = self._loop_assigns(loop)
        call_set = set(calls)
        for _ in range(4):
            before = len(tainted)
            for a in assigns:
                value_names = _names(a.value)
                if value_names & tainted or any(c in call_set for c in self._calls_in(a.value)):
                    for t in a.targets:
                        tainted.update(n.value for n in _target_names(t.target))
            if len(tainted) == before:
                break
        out: Set[str] = set()
        self.maybe: Set[str] = set()
        self.tainted = tainted

        def note(operands: List[cst.BaseExpression], into: Set[str] = out) -> None:
            hot = [_base(o) not in derived and (bool(_names(o) & tainted)
                                                or any(c in call_set for c in self._calls_in(o)))
                   for o in operands]
            if any(hot):
                for o, h in zip(operands, hot):
                    for base in _elementwise_bases(o) if not h else ():
                        if base in derived:
                            into.add(derived[base])

        for node in self._nodes_in(loop):
            if isinstance(node, cst.Call):
                operands = [a.value for a in node.args if not a.star]
                if isinstance(node.func, cst.Attribute) and self.ctx.resolve(node.func) is None:
                    if _names(node.func.value) & tainted or node.func.value in call_set:
                        note([node.func.value, *operands])  # outputs.eq(labels)
                elif self._tensor_function(node.func):
                    note(operands)  # criterion(outputs, labels), F.nll_loss(output, target)
                else:
                    note(operands, self.maybe)  # save(outputs, paths): a tensor or not?
            elif isinstance(node, cst.Comparison):
                note([node.left, *(c.comparator for c in node.comparisons)])
            elif isinstance(node, cst.BinaryOperation):
                note([node.left, node.right])
        return out

    def _tensor_function(self, func: cst.BaseExpression) -> bool:
        """A torch function, or a loss: `criterion`/`loss_fn` or a variable holding a `torch.nn`
        module (`crit = nn.CrossEntropyLoss()`). Not an arbitrary function (`save(out, paths)`)."""
        resolved = self.ctx.resolve(func)
        if resolved is not None:
            return resolved.startswith("torch.")
        name = dotted(func)
        if name is None:
            return False
        if _LOSS_NAME.search(name.rsplit(".", 1)[-1]):
            return True
        for a in self.facts.assigns:
            if isinstance(a.value, cst.Call) and any(dotted(t.target) == name for t in a.targets):
                made = self.ctx.resolve(a.value.func) or ""
                if made.startswith("torch.nn."):
                    return True
        return False

    def _calls_in(self, node: cst.CSTNode) -> List[cst.Call]:
        out: List[cst.Call] = []

        def go(n: cst.CSTNode) -> None:
            if isinstance(n, cst.Call):
                out.append(n)
            if not isinstance(n, cst.Lambda):
                for child in n.children:
                    go(child)

        go(node)
        return out

    def _nodes_in(self, loop: cst.For) -> List[cst.CSTNode]:
        out: List[cst.CSTNode] = []

        def go(n: cst.CSTNode) -> None:
            out.append(n)
            for child in n.children:
                if not isinstance(child, _LOOP_OR_SCOPE) or ranged_loop(child):  # per-class counts
                    go(child)

        go(loop.body)
        return out

    def _tensor_like(self, loop: cst.For, name: str, whole: bool) -> bool:
        """Nothing in the loop treats `name` as something other than a tensor, or hands it to
        code that might need it on the CPU (`imshow(images)`, `all_labels.append(labels)`)."""
        for node in self._nodes_in(loop):
            if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == name:
                if node.attr.value not in _TENSOR_ATTRS:
                    return False
            elif whole and isinstance(node, cst.Subscript) and isinstance(node.value, cst.Name) \
                    and node.value.value == name:
                return False
            elif isinstance(node, cst.Call) and any(_base(a.value) == name and not _size_of(a.value)
                                                    for a in node.args) \
                    and not self._takes_device_tensors(node):
                return False
        return True

    def _takes_device_tensors(self, call: cst.Call) -> bool:
        """The model, a torch/torchvision function, a loss, a method of the model's outputs, or
        a builtin that accepts any tensor."""
        func = call.func
        if self._model_of(call) in self.models or self._tensor_function(func):
            return True
        resolved = self.ctx.resolve(func) or ""
        if resolved.startswith(("torchvision.", RUNTIME)):
            return True
        if isinstance(func, cst.Name) and func.value in ("len", "print", "isinstance", "type", "zip", "enumerate"):
            return True
        if isinstance(func, cst.Attribute) and resolved == "":
            receiver = _base(func.value)
            return receiver is not None and receiver in self.tainted
        return False

    def _custom_collate(self, loop: cst.For) -> bool:
        """The loop iterates a DataLoader of this file built with its own `collate_fn`."""
        source = loop.iter
        if isinstance(source, cst.Call) and dotted(source.func) == "enumerate" and source.args:
            source = source.args[0].value
        name = dotted(source)
        if name is None:
            return False
        for a in self.facts.assigns:
            if any(dotted(t.target) == name for t in a.targets) and isinstance(a.value, cst.Call) \
                    and self.ctx.resolve(a.value.func) in _DATALOADERS and arg(a.value, "collate_fn") is not None:
                return True
        return False


def moves_to_devices(ctx: Context) -> bool:
    """The file moves something to a device itself: `.to(device)`/`.cuda()` (a dtype-only
    `.to(torch.float16)` does not count), a `device=` argument, `set_default_device`."""
    for call, name in analysis.facts(ctx).calls:
        if name is None and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda"):
            if call.func.attr.value == "cuda":
                return True
            first = arg(call, "device", 0)
            if first is not None and ctx.resolve(first.value) not in _DTYPE_ONLY:
                return True
            if arg(call, "device") is not None or arg(call, "other") is not None:
                return True
            continue
        if name == "torch.set_default_device":
            return True
        device = arg(call, "device")
        if device is not None and not (isinstance(device.value, cst.SimpleString)
                                       and device.value.evaluated_value == "cpu"):
            return True
    return False


_SIZES = frozenset({"size", "dim", "numel", "nelement", "shape", "ndim", "dtype", "device"})


def _size_of(node: cst.BaseExpression) -> bool:
    """`x.size(0)`, `x.shape[0]`, `x.numel()`: a number read from a tensor, the same on any device
    (`meter.update(loss.item(), x.size(0))` hands over no tensor)."""
    while isinstance(node, (cst.Subscript, cst.Call)):
        node = node.value if isinstance(node, cst.Subscript) else node.func
    return isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.attr.value in _SIZES

"""TM103: device placement from the process's local rank instead of hard-coded CUDA devices."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, remove, replace, replace_with
from torchmigrate.imports import dotted
from torchmigrate.nodes import arg, code, expr, kwarg, with_args
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules.launch import INIT_PG, RUNTIME, setup_plan

SET_DEVICE = "torch.cuda.set_device"
DEVICE_CTX = "torch.cuda.device"
IS_AVAILABLE = "torch.cuda.is_available"
# torch.* calls whose `device=` keyword is a device (tensor factories, Generator, ...), minus
# the ones where a string is required or the keyword means something else.
_NOT_DEVICE_KW = ("torch.autocast", "torch.amp.", "torch.cuda.amp.", "torch.cpu.amp.", "torch.load",
                  "torch.jit.load", "torch.device", "torch.cuda.set_device", "torch.cuda.device")
_INDEX = re.compile(r"cuda:\d+")
# Name uses that are fine whether the value is a string or a torch.device.
_DEVICE_ATTRS = ("type", "index")

BARE = "bare"  # "cuda", .cuda(): the current device (right once set_device ran)
LITERAL = "literal"  # "cuda:0", .cuda(0): a fixed GPU, the same on every rank
EXPR = "expr"  # f"cuda:{args.gpu}", .cuda(args.gpu): an index computed by the script


def cuda_string(node: cst.CSTNode) -> Optional[str]:
    """BARE / LITERAL / EXPR when node is a string expression naming a CUDA device, else None."""
    if isinstance(node, cst.SimpleString):
        try:
            value = node.evaluated_value
        except Exception:  # pragma: no cover
            return None
        if not isinstance(value, str):
            return None
        if value == "cuda":
            return BARE
        return LITERAL if _INDEX.fullmatch(value) else None
    if isinstance(node, cst.FormattedString):
        parts = node.parts
        if (len(parts) == 2 and isinstance(parts[0], cst.FormattedStringText) and parts[0].value == "cuda:"
                and isinstance(parts[1], cst.FormattedStringExpression)):
            return EXPR
        return None
    if isinstance(node, cst.BinaryOperation) and isinstance(node.left, cst.SimpleString):
        text = node.left.evaluated_value
        if isinstance(node.operator, cst.Add) and text == "cuda:":
            return EXPR
        if isinstance(node.operator, cst.Modulo) and text in ("cuda:%d", "cuda:%s", "cuda:%i"):
            return EXPR
        return None
    if (isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format"
            and isinstance(node.func.value, cst.SimpleString) and node.func.value.evaluated_value == "cuda:{}"):
        return EXPR
    return None


def _int(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Integer)


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
      `x.to(tm.device())` (keeping `non_blocking=`/`memory_format=`); `.to("cuda:0")` and
      `device="cuda"` keywords of torch factories become `tm.device()`.
    - `device = "cuda"` / `"cuda:0"` string variables become `tm.device()` when every use
      treats them as a device (`.to(device)`, `device=device`); when the script also compares
      or formats the string (`device == "cuda"`, `autocast(device_type=device)`), a
      `"cuda"` string is kept (after `tm.setup()` it already means the process's own GPU) and a
      `"cuda:N"` string becomes `str(tm.device())`.
    - `torch.cuda.set_device(...)` is removed in files that get `tm.setup()` (which pins the
      GPU before anything is allocated) and otherwise gets `tm.device()` as its argument.
    - `os.environ["CUDA_VISIBLE_DEVICES"] = ...` writes and `torch.cuda.device(N)` blocks are
      reported for a manual change.

    `device="cpu"`, `map_location=` (TM502) and `autocast`/`GradScaler` device types are never
    touched. In `lint`, and on files that already set up distributed training, only what is
    wrong under torchrun is reported: a literal GPU index (`"cuda:0"`, `.cuda(0)`,
    `set_device(0)`), and a bare `"cuda"`/`.cuda()` in a file that calls
    `init_process_group` but never `torch.cuda.set_device`. Indices computed from the rank
    (`torch.device("cuda", args.local_rank)`) are left alone.

    ## Why is this bad?
    Under torchrun every process runs the same code: a fixed `cuda:0` (or a `.cuda()` before
    `set_device`) puts all ranks on GPU 0, which then runs out of memory or fails with
    "Duplicate GPU detected". DDP expects exactly one device per process.

    ## Example
    ```python
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net().cuda()
    ```
    becomes
    ```python
    device = tm.device()
    model = Net().to(tm.device())
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
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = Net().cuda()
            x = x.cuda(non_blocking=True)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            device = tm.device()
            model = Net().to(tm.device())
            x = x.to(tm.device(), non_blocking=True)
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
        self.names: Dict[str, List[cst.CSTNode]] = {}
        self.ifexps: List[cst.IfExp] = []
        self.env_writes: List[cst.CSTNode] = []

    # --- collection ---------------------------------------------------------------------
    def visit_Name(self, node: cst.Name) -> None:
        parent = self.ctx.parent(node)
        if isinstance(parent, cst.Attribute) and parent.attr is node:
            return
        self.names.setdefault(node.value, []).append(node)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if isinstance(node.value, cst.Name):
            self.names.setdefault(f"{node.value.value}.{node.attr.value}", []).append(node)

    def visit_IfExp(self, node: cst.IfExp) -> None:
        self.ifexps.append(node)

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            if isinstance(t.target, cst.Subscript) and self._is_cvd(t.target):
                self.env_writes.append(node)

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
        self.converting = ctx.options.migrating and not self.distributed
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

    def _tm_device(self) -> cst.BaseExpression:
        return expr(f"{self.ctx.tm}.device()")

    def _fix(self, node: cst.CSTNode, message: str, edit) -> None:
        self.report(node, message, edits=[edit], imports=[self.ctx.runtime_import()])

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
        if kind == BARE and index is not None:
            return LITERAL if _int(index.value) else EXPR
        return kind

    def _split(self, node: cst.IfExp, string: bool):
        """(cuda branch kind, cuda branch is body) for `cuda-ish if C else cpu-ish`, else None."""
        for cuda_branch, other, is_body in ((node.body, node.orelse, True), (node.orelse, node.body, False)):
            if not self._is_cpu(other):
                continue
            if string:
                kind = cuda_string(cuda_branch)
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
        return node.with_changes(**changes)

    # --- main -----------------------------------------------------------------------------
    def leave_Module(self, node: cst.Module) -> None:
        self._setup()
        if not self.active:
            return
        handled: Set[cst.CSTNode] = set()
        self._ifexp_devices(handled)
        for call, name in analysis.facts(self.ctx).calls:
            if call in handled:
                continue
            if name == "torch.device":
                self._torch_device(call)
            elif name == SET_DEVICE:
                self._set_device(call)
            elif name == DEVICE_CTX:
                self._device_ctx(call)
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
        for assign in analysis.facts(self.ctx).assigns:
            self._string_assign(assign)
        for write in self.env_writes:
            self.report(write, "CUDA_VISIBLE_DEVICES set in the script: every rank sees the same GPUs (with one "
                               "visible GPU all ranks share it); let torchrun/the scheduler choose, each process "
                               "uses tm.device() = cuda:LOCAL_RANK")

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
            split = self._split(ifexp, string=True)
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
        if self._wrong(kind):
            self._fix(call, message, replace_with(call, self._tm_device()))

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
        if self._in_map_location(call):
            return
        device = arg(call, "device", 0)
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

        def fix(c: cst.Call) -> cst.Call:
            positional = [a for a in c.args if a.keyword is None]
            keywords = [a for a in c.args if a.keyword is not None and a.keyword.value != "device"]
            extra = [kwarg("non_blocking", positional[1].value)] if len(positional) > 1 else []
            to = c.with_changes(func=c.func.with_changes(attr=cst.Name("to")))
            return with_args(to, [cst.Arg(value=self._tm_device()), *extra, *keywords])

        what = "`.cuda()` uses the current GPU" if kind == BARE else f"`.cuda({code(device.value)})` uses a fixed GPU"
        self._fix(call, f"{what}, the same on every rank unless set per process; use .to(tm.device())",
                  replace(call, fix))

    def _dot_to(self, call: cst.Call) -> None:
        if self.ctx.resolve(call.func) is not None:
            return
        target = arg(call, "device", 0)
        if target is None:
            return
        self._device_value(target.value, "`.to(...)` with a hard-coded CUDA device: every rank would use the same GPU")

    def _device_kwarg(self, call: cst.Call, name: str) -> None:
        if any(name == p or (p.endswith(".") and name.startswith(p)) for p in _NOT_DEVICE_KW):
            return
        target = arg(call, "device")
        if target is not None:
            self._device_value(target.value, f"`device=` of {name.split('.', 1)[1]}(...) is a hard-coded CUDA device")

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

    def _argparse_default(self, call: cst.Call) -> None:
        """`add_argument("--device", default="cuda:0")`: a string option, so `str(tm.device())`."""
        default = arg(call, "default")
        if default is None:
            return
        value = default.value
        split = self._split(value, string=True) if isinstance(value, cst.IfExp) else None
        kind = split[0] if split else cuda_string(value)
        if kind != LITERAL or not self._wrong(kind):
            return
        new = expr(f"str({self.ctx.tm}.device())")
        message = "command-line default names a fixed GPU: every rank would use it; default to str(tm.device())"
        if split:
            self._fix(value, message, replace(value, lambda v: self._conditional(v, split[1], new)))
        else:
            self._fix(value, message, replace_with(value, new))

    # --- string variables ------------------------------------------------------------------
    def _string_assign(self, assign: cst.Assign) -> None:
        if len(assign.targets) != 1:
            return
        target = dotted(assign.targets[0].target)
        if target is None or target.count(".") > 1:
            return
        value = assign.value
        split = self._split(value, string=True) if isinstance(value, cst.IfExp) else None
        kind = split[0] if split else cuda_string(value)
        if not self._wrong(kind):
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
        if split:
            self._fix(value, message, replace(value, lambda v: self._conditional(v, split[1], new)))
        else:
            self._fix(value, message, replace_with(value, new))

    def _device_uses_only(self, target: str, assign: cst.Assign) -> bool:
        """Every use of the variable (anywhere in the module, by name) accepts a torch.device."""
        for use in self.names.get(target, ()):
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
        if setup_plan(self.ctx) is not None and isinstance(line, cst.SimpleStatementLine):
            target = self._removable_if(line) or expr_stmt
            self.report(call, "torch.cuda.set_device is done by tm.setup() (cuda:LOCAL_RANK) before anything "
                              "is allocated; a fixed index here would move every rank back to one GPU",
                        edits=[remove(target)])
            return
        if isinstance(index.value, cst.Call) and code(index.value) == f"{self.ctx.tm}.device()":
            return
        self._fix(call, "torch.cuda.set_device with a fixed index pins every rank to the same GPU; use tm.device()",
                  replace(call, lambda c: with_args(c, [cst.Arg(value=self._tm_device())])))

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

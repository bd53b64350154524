"""Model facts of one module: where each model is created and what it is made of.

Built once per module on first use (`model_facts(ctx)`, kept in ``ctx.facts["models"]``), whatever
rules are enabled or options given: the model family's plan (`rules/model/plan.py`) decides from
them where each wrap goes, which accesses go through `tm.unwrap`, and when a wrap needs
`find_unused_parameters=True` or SyncBatchNorm. Nothing here formats a message or plans an edit.

- the order of the statements (`idx`, `last_idx`), each node's function (`scope`) and class;
- the assignments of each name (`assignments`), and those that create a model rather than wrap
  one (`definitions`); where a model comes from (`origin`: a class or function of this module,
  or a library's qualified name) and its class (`model_class`);
- what a model is made of: BatchNorm layers (`has_bn`), submodules `forward()` uses only in some
  branches (`conditional_submodules`) or always all of them (`uses_every_submodule`), heads whose
  outputs every training call throws away (`discarded_heads`);
- what changes a model: calls and assignments that may change `requires_grad`
  (`requires_grad_changes`, `touches_requires_grad`), statements that change its parameters in
  place (`modified_in_place`: weights loaded, initialised, assigned);
- the wrappers already there: what kind a call is (`wrapper_kind`: DDP, apex, `tm.wrap_model`,
  DataParallel, another library's), the expression it makes (`wrapper_site`), the module it
  wraps (`wrapped_arg`); a module driven by a framework that wraps models itself (`framework`);
- what a function returns (`returns`), the statement of `__init__` storing an attribute
  (`self_store`), the calls of a top-level function (`calls_of`);
- models differentiated by hand over their own parameters (`functional_model`), which DDP cannot
  wrap.

Name resolution uses the import table (`ctx.resolve`), never across modules; the forward outputs
of a model class of another module come from the program (`ctx.program.forward_outputs`).
"""

from __future__ import annotations

import ast
import re
import textwrap
from bisect import bisect_left
from typing import Dict, List, NamedTuple, Optional, Set, Tuple, Union

import libcst as cst

from torchmigrate.analysis import calls_to, facts, runs_backward, under_no_grad
from torchmigrate.program.facts import forward_outputs
from torchmigrate.rule import RUNTIME_MODULE, Context
from torchmigrate.syntax.imports import dotted, iter_statements
from torchmigrate.syntax.nodes import arg as call_arg
from torchmigrate.syntax.nodes import code
from torchmigrate.syntax.positions import code_for

DDP_CLASSES = {"torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel"}
_APEX_DDP = {"apex.parallel.DistributedDataParallel", "apex.parallel.distributed.DistributedDataParallel"}
DP_CLASSES = {"torch.nn.DataParallel", "torch.nn.parallel.DataParallel", "torch.nn.parallel.data_parallel.DataParallel"}
_TM_WRAP = "torchmigrate.runtime.wrap_model"
# Wrappers of other libraries (FSDP, DeepSpeed, ...): the model they take is not DDP's to wrap.
_OTHER_WRAPS = (
    "torch.distributed.fsdp.", "torch.distributed._composable.", "torch.distributed.tensor.parallel.",
    "deepspeed.initialize", "fairscale.", "horovod.", "torch_xla.",
)
# Frameworks that wrap models themselves, and the methods they do it with (`accelerator.prepare`).
_FRAMEWORKS = ("accelerate", "lightning", "pytorch_lightning", "deepspeed", "horovod", "colossalai",
               "torch_xla", "fairscale", "ignite.distributed", "composer")
_FRAMEWORK_WRAPS = ("prepare", "prepare_model", "setup", "setup_module", "initialize", "wrap")
# Methods that return the module itself (`model.cuda()`, `Net().to(device)`).
_MOVES = {"to", "cuda", "cpu", "float", "half", "double", "bfloat16", "train", "eval", "requires_grad_",
          "share_memory", "xpu", "type", "to_empty"}
# Layers without parameters: using them conditionally in forward() is harmless for DDP.
_PARAMLESS = re.compile(
    r"(Loss|ReLU\d*|GELU|SiLU|Mish|Tanh|Sigmoid|Softmax\d*d?|LogSoftmax|Softplus|Softsign|Hardswish|"
    r"Hardsigmoid|Hardtanh|ELU|SELU|CELU|GLU|LeakyReLU|Threshold|Identity|Dropout\d*d?|AlphaDropout|"
    r"\w*Pool\d*d|Flatten|Unflatten|Upsample\w*|PixelShuffle|PixelUnshuffle|\w*Pad\d*d|ChannelShuffle|"
    r"CosineSimilarity|PairwiseDistance)$")
_BN_TORCHVISION = re.compile(r"resne|wide_resnet|densenet|mobilenet|efficientnet|regnet|inception|googlenet|"
                             r"shufflenet|mnasnet|_bn$|deeplab|fcn_|lraspp|__dict__")
_SEQUENCES = (cst.Tuple, cst.List)  # exact type tests: isinstance against LibCST's ABCs is slow
_WORD = re.compile(r"\w+")
_WORD_START = re.compile(r"(?<![\w.])\w+")  # a whole word, not after a dot: what `mentions` matches


# Calls that change a module's parameters in place (wrap only after them).
_INPLACE = {"load_state_dict", "apply", "load_weights", "load_pretrained", "load_pretrained_weights",
            "init_weights", "reset_parameters", "load_param", "load_params", "load_parameters"}


def _root_name(node: cst.CSTNode) -> Optional[str]:
    """`base` for `base.vgg[0].weight`, `base.fc.load_state_dict`, `base(...)...`."""
    while True:
        if type(node) in (cst.Attribute, cst.Subscript):
            node = node.value
        elif type(node) is cst.Call:
            node = node.func
        else:
            break
    return node.value if type(node) is cst.Name else None


def strip_moves(node: cst.BaseExpression) -> cst.BaseExpression:
    """`Net().to(device).cuda()` -> `Net()`; `model.cuda()` -> `model`."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in _MOVES:
        node = node.func.value
    return node


def assign_targets(node: cst.BaseAssignTargetExpression, value: Optional[cst.BaseExpression]):
    """(dotted target, value expression or None) pairs, unpacking `a, b = A(), B()`."""
    if type(node) in _SEQUENCES:
        values = None
        if type(value) in _SEQUENCES and len(value.elements) == len(node.elements):
            values = [e.value for e in value.elements]
        for i, element in enumerate(node.elements):
            yield from assign_targets(element.value, values[i] if values else None)
    else:
        name = dotted(node)
        if name:
            yield name, value


def mentions(text: str, name: str) -> bool:
    """`name` appears in `text` as a whole name (`model` in `model.fc`, not in `self.model`)."""
    return re.search(r"(?<![\w.])" + re.escape(name) + r"\b", text) is not None


def _used_outputs(ctx: Context, call: cst.Call, n: int) -> Optional[Set[int]]:
    """Which of the `n` outputs of the model call `call` the code keeps: `out = model(x)[0]`
    keeps {0}, `logits, _ = model(x)` keeps {0}; None when it keeps the whole result."""
    parent = ctx.parent(call)
    if isinstance(parent, cst.Subscript) and len(parent.slice) == 1:
        index = parent.slice[0].slice
        if isinstance(index, cst.Index) and isinstance(index.value, cst.Integer):
            return {int(index.value.value) % n}
        return None
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        target = parent.targets[0].target
        if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == n and not any(
                isinstance(e, cst.StarredElement) for e in target.elements):
            return {i for i, e in enumerate(target.elements)
                    if not (isinstance(e.value, cst.Name) and e.value.value.startswith("_"))}
    return None


def functional_model(ctx: Context, m: str) -> bool:
    """`torch.autograd.grad(loss, m.parameters())` in this file: gradients taken by hand over
    the model's own parameters (MAML's inner loop), which DDP does not support."""
    for call in calls_to(ctx, "torch.autograd.grad", RUNTIME_MODULE + ".grad"):  # tm.grad: TM411's
        inputs = call_arg(call, "inputs", 1)
        if inputs is not None and code(inputs.value).replace(" ", "") == f"{m}.parameters()":
            return True
    return False


class Origin(NamedTuple):
    """The expression that creates a model: `kind` "class" (`node` is a ClassDef of this module),
    "function" (a FunctionDef of this module) or "library" (`node` is a qualified name); `call`
    is the creating call."""

    kind: str
    node: Union[cst.ClassDef, cst.FunctionDef, str]
    call: cst.Call


class ModelFacts:
    """The model facts of one module (see the module docstring); caches kept per node."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.f = facts(ctx)
        self._order: Dict[int, int] = {}  # id(statement) -> index: ids skip LibCST's Python-level __hash__
        self._last: Dict[cst.CSTNode, int] = {}
        self._assigns: Dict[str, List[Tuple[cst.CSTNode, Optional[cst.BaseExpression]]]] = {}
        self._scope: Dict[cst.CSTNode, cst.CSTNode] = {}
        self._assigned: Optional[Dict[cst.CSTNode, Set[str]]] = None
        self._text_cache: Dict[cst.CSTNode, str] = {}
        self._words_cache: Dict[cst.CSTNode, str] = {}
        self._mentioned: Dict[str, Set[str]] = {}
        self._bn_cache: Dict[cst.CSTNode, bool] = {}
        self._requires_grad_spots: Optional[List[int]] = None  # see `touches_requires_grad`
        self._conditional: Dict[cst.ClassDef, List[Tuple[str, cst.CSTNode]]] = {}
        self._requires_grad_changes: Optional[Tuple[List[Tuple[cst.Call, str]], List[cst.Assign]]] = None
        # the module is driven by a framework that wraps models itself
        self.framework = any(ctx.imports.imports_module(name) for name in _FRAMEWORKS)
        # every statement line, one-line suite and compound statement, in source order
        for i, s in enumerate(ctx.nodes(cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.BaseCompoundStatement)):
            self._order[id(s)] = i
        for a in self.f.assigns:
            for t in a.targets:
                for name, value in assign_targets(t.target, a.value):
                    self._assigns.setdefault(name, []).append((a, value))

    def idx(self, statement: Optional[cst.CSTNode]) -> int:
        """The statement's position in source order (-1 for none, or a node built by a rule); a
        small statement of a line (`a = 1; b = 2`) has its line's."""
        if isinstance(statement, cst.BaseSmallStatement):
            statement = self.ctx.statement_of(statement)
        return self._order.get(id(statement), -1) if statement is not None else -1

    def last_idx(self, statement: cst.CSTNode) -> int:
        """Index of the last statement inside `statement` (itself for a simple line)."""
        if statement not in self._last:
            count = sum(1 for _ in iter_statements([statement])) if isinstance(
                statement, cst.BaseCompoundStatement) else 1
            self._last[statement] = self.idx(statement) + count - 1
        return self._last[statement]

    def scope(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function that holds `node`, or the module."""
        found = self._scope.get(node)
        if found is None:
            found = self._scope[node] = self.ctx.enclosing(node, cst.FunctionDef) or self.ctx.module
        return found

    def class_of(self, node: cst.CSTNode) -> Optional[cst.ClassDef]:
        return self.ctx.enclosing(node, cst.ClassDef)

    def text(self, node: cst.CSTNode) -> str:
        """The source code of `node`, as written."""
        if node not in self._text_cache:
            self._text_cache[node] = code_for(node, self.ctx.module)
        return self._text_cache[node]

    def words(self, node: cst.CSTNode) -> str:
        """The names and string literals under `node`, space-separated, attribute names with
        their dot (`.BatchNorm2d`): what the text searches below look for, without generating
        the code of whole classes (comments are left out, which only removes false hits)."""
        found = self._words_cache.get(node)
        if found is None:
            parent = self.ctx.parent
            out = []
            for n in self.ctx.within(node, cst.Name, cst.SimpleString):
                up = parent(n)
                out.append("." + n.value if type(up) is cst.Attribute and up.attr is n else n.value)
            found = self._words_cache[node] = " ".join(out)
        return found

    @staticmethod
    def params(func: cst.FunctionDef) -> Set[str]:
        """The names of a function's parameters, `*args` and `**kwargs` included."""
        p = func.params
        names = {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}
        for star in (p.star_arg, p.star_kwarg):
            if isinstance(star, cst.Param):
                names.add(star.name.value)
        return names

    def assignments(self, name: str) -> List[Tuple[cst.CSTNode, Optional[cst.BaseExpression]]]:
        """Every assignment of `name` (dotted, `self.x` included) in the module, with the value
        it assigns to it (None when unpacked from something else), in source order."""
        return self._assigns.get(name, [])

    def assigned_in(self, scope: cst.CSTNode, name: str) -> bool:
        """`name` is assigned somewhere in the function `scope` (or the module)."""
        if self._assigned is None:
            self._assigned = {}
            for n, pairs in self._assigns.items():
                for a, _ in pairs:
                    self._assigned.setdefault(self.scope(a), set()).add(n)
        return name in self._assigned.get(scope, ())

    def definitions(self, name: str, scope: cst.CSTNode, klass: Optional[cst.ClassDef],
                    before: Optional[int] = None) -> List[Tuple[cst.CSTNode, Optional[cst.BaseExpression]]]:
        """Assignments of `name` that create the model (not wrap calls), in order."""
        out = []
        for a, value in self._assigns.get(name, ()):
            if name.startswith(("self.", "cls.")):
                if self.class_of(a) is not klass:
                    continue
            elif self.scope(a) is not scope:
                continue
            statement = self.ctx.statement_of(a)
            if before is not None and self.idx(statement) >= before:
                continue
            if value is not None and self.is_wrap_value(value):
                continue
            out.append((a, value))
        return out

    def is_wrap_value(self, value: cst.BaseExpression) -> bool:
        """`value` wraps a model (DDP, apex DDP, DataParallel, `tm.wrap_model`), moved or not."""
        inner = strip_moves(value)
        if not isinstance(inner, cst.Call):
            return False
        name = self.ctx.resolve(inner.func)
        return bool(name and (name in DDP_CLASSES or name in _APEX_DDP or name in DP_CLASSES or name == _TM_WRAP))

    def origin(self, name: str, scope: cst.CSTNode, klass: Optional[cst.ClassDef], before: Optional[int],
               value: Optional[cst.BaseExpression] = None) -> Optional[Origin]:
        """The expression that created the model `name`; None when unknown. `value` is that
        expression when already known (`DDP(Net())`), else the last assignment of `name` before
        the statement index `before`."""
        if value is None or not isinstance(strip_moves(value), cst.Call):
            defs = self.definitions(name, scope, klass, before)
            value = defs[-1][1] if defs else None
        if value is None:
            return None
        value = strip_moves(value)
        if not isinstance(value, cst.Call):
            return None
        func = value.func
        if isinstance(func, cst.Subscript):
            resolved = self.ctx.resolve(func.value)
            return Origin("library", resolved + ".__dict__", value) if resolved else None
        fname = dotted(func)
        if fname in self.f.classes:
            return Origin("class", self.f.classes[fname], value)
        if fname in self.f.functions:
            return Origin("function", self.f.functions[fname], value)
        resolved = self.ctx.resolve(func) or fname
        return Origin("library", resolved, value) if resolved else None

    def model_class(self, origin: Optional[Origin]) -> Optional[cst.ClassDef]:
        """The class of this module the model is an instance of: the class called, or the one a
        function of this module returns."""
        if origin is None:
            return None
        kind, node, _ = origin
        if kind == "class":
            return node
        if kind == "function":
            for s in iter_statements(node.body.body if isinstance(node.body, cst.IndentedBlock) else [node.body]):
                if isinstance(s, cst.SimpleStatementLine):
                    for small in s.body:
                        if isinstance(small, cst.Return) and isinstance(small.value, cst.Call):
                            inner = strip_moves(small.value)
                            name = dotted(inner.func) if isinstance(inner, cst.Call) else None
                            if name in self.f.classes:
                                return self.f.classes[name]
        return None

    def has_bn(self, origin: Optional[Origin]) -> bool:
        """The model (probably) contains BatchNorm layers."""
        if origin is None:
            return False
        kind, node, call = origin
        if kind == "library":
            if node.startswith("torchvision.models") and _BN_TORCHVISION.search(node.rsplit(".", 1)[-1]):
                return True
            # `nn.Sequential(nn.Conv2d(...), nn.BatchNorm2d(...))`, `Wrapper(conv_bn(3, 8))`
            return self._text_has_bn(self.text(call), set())
        return self._def_has_bn(node, set()) or self._text_has_bn(self.text(call), set())

    def _text_has_bn(self, text: str, seen: set) -> bool:
        if re.search(r"(?<!Frozen)BatchNorm", text):
            return True
        for name, other in (*self.f.classes.items(), *self.f.functions.items()):
            if other not in seen and self.ctx.parent(other) is self.ctx.module and self._text_mentions(text, name):
                if self._def_has_bn(other, seen):
                    return True
        return False

    def _text_mentions(self, text: str, name: str) -> bool:
        """`mentions(text, name)`, from the set of words of `text`: one scan of a (long) text
        for all the names of the file's classes and functions instead of one scan per name."""
        if not _WORD.fullmatch(name):
            return mentions(text, name)
        found = self._mentioned.get(text)
        if found is None:
            found = self._mentioned[text] = set(_WORD_START.findall(text))
        return name in found

    def _def_has_bn(self, node: cst.CSTNode, seen: set) -> bool:
        if node in self._bn_cache:
            return self._bn_cache[node]
        seen.add(node)
        found = self._text_has_bn(self.words(node), seen)
        self._bn_cache[node] = found
        return found

    def self_store(self, init: cst.FunctionDef, attr: str) -> Optional[cst.CSTNode]:
        """The statement of `__init__` that assigns `self.<attr>`."""
        for a in self.f.assigns:
            if self.ctx.enclosing(a, cst.FunctionDef) is not init:
                continue
            for t in a.targets:
                if any(n == f"self.{attr}" for n, _ in assign_targets(t.target, None)):
                    return self.ctx.statement_of(a)
        return None

    def returns(self, func: cst.FunctionDef, name: str) -> bool:
        """`func` returns `name` (alone or in a tuple)."""
        for s in iter_statements(func.body.body if isinstance(func.body, cst.IndentedBlock) else [func.body]):
            if isinstance(s, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
                for small in s.body:
                    if isinstance(small, cst.Return) and small.value is not None:
                        values = ([e.value for e in small.value.elements] if isinstance(small.value, cst.Tuple)
                                  else [small.value])
                        if any(dotted(v) == name for v in values):
                            return True
        return False

    def calls_of(self, func: cst.FunctionDef) -> Optional[List[cst.Call]]:
        """The calls of a top-level function in this file; None when it is a method, a nested
        function, or used other than by calling it (passed as a callback)."""
        if self.ctx.parent(func) is not self.ctx.module:
            return None
        calls = []
        for n in self.ctx.named(func.name.value):
            up = self.ctx.parent(n)
            if up is func or (type(up) is cst.Attribute and up.attr is n):
                continue  # the def itself, or another object's attribute of that name
            if type(up) is cst.Call and up.func is n:
                calls.append(up)
            else:
                return None
        return calls

    def modified_in_place(self, names: Set[str], scope: cst.CSTNode, start: int, end: int) -> bool:
        """A statement of `scope` strictly between the indexes `start` and `end` changes the
        parameters of one of the modules `names` in place."""
        def inside(node: cst.CSTNode) -> bool:
            return self.scope(node) is scope and start < self.idx(self.ctx.statement_of(node)) < end

        for call, name in self.f.calls:
            f = call.func
            if isinstance(f, cst.Attribute) and (f.attr.value in _INPLACE or (
                    f.attr.value.endswith("_") and f.attr.value not in ("requires_grad_", "share_memory_"))):
                if _root_name(f.value) in names and inside(call):
                    return True
            if name and name.startswith("torch.nn.init.") and call.args and _root_name(call.args[0].value) in names \
                    and inside(call):
                return True
        for a in self.f.assigns:
            for t in a.targets:
                if type(t.target) in (cst.Attribute, cst.Subscript) and _root_name(t.target) in names and inside(a):
                    if not (type(t.target) is cst.Attribute and t.target.attr.value == "requires_grad"):
                        return True
        return False

    def wrapper_kind(self, call: cst.Call, name: Optional[str]) -> Optional[str]:
        """What `call` (resolved to `name`) wraps a model in: "ddp" (DistributedDataParallel),
        "apex" (apex's DDP), "tm" (`tm.wrap_model`), "dp" (DataParallel, or the program's own
        subclass of it), "other" (FSDP, DeepSpeed, a framework's `prepare`...); None when it is
        no wrapper."""
        if (dotted(call.func) or "") in self.ctx.program.dp_classes:
            return "dp"  # the program's own DataParallel subclass
        if name:
            if name in DDP_CLASSES:
                return "ddp"
            if name in _APEX_DDP:
                return "apex"
            if name == _TM_WRAP:
                return "tm"
            if name in DP_CLASSES:
                return "dp"
            if name.startswith(_OTHER_WRAPS):
                return "other"
        elif dotted(call.func) == f"{self.ctx.tm}.wrap_model":
            return "tm"  # the runtime import went missing: still our wrap
        if self.framework and isinstance(call.func, cst.Attribute) and call.func.attr.value in _FRAMEWORK_WRAPS:
            return "other"
        return None

    def wrapper_site(self, call: cst.Call) -> Tuple[cst.CSTNode, Optional[cst.CSTNode]]:
        """The wrapper call with the moves chained on it (`DataParallel(m).cuda()`), and the node
        holding that expression (the assignment, a return...)."""
        node: cst.CSTNode = call
        while True:
            parent = self.ctx.parent(node)
            if isinstance(parent, cst.Attribute) and parent.value is node and parent.attr.value in _MOVES:
                grand = self.ctx.parent(parent)
                if isinstance(grand, cst.Call) and grand.func is parent:
                    node = grand
                    continue
            break
        return node, self.ctx.parent(node)

    def wrapped_arg(self, call: cst.Call) -> Optional[cst.Arg]:
        """The argument of a wrapper call that holds the module it wraps, also for a program's
        DataParallel subclass whose own arguments come first (`ModuleView.dp_classes`)."""
        position = self.ctx.program.dp_classes.get(dotted(call.func) or "", 0)
        return call_arg(call, "module", position) or call_arg(call, "model")

    def requires_grad_changes(self) -> Tuple[List[Tuple[cst.Call, str]], List[cst.Assign]]:
        """The calls that may change `requires_grad`, with their method name
        (`x.requires_grad_(...)`, or a method of a class of this module whose body sets
        requires_grad), and the assignments to a `.requires_grad`."""
        if self._requires_grad_changes is None:
            names = {"requires_grad_"}
            for k in self.f.classes.values():
                if isinstance(k.body, cst.IndentedBlock):
                    for f in k.body.body:
                        if isinstance(f, cst.FunctionDef) and self.touches_requires_grad(f):
                            names.add(f.name.value)
            # (exact type tests over every call and assignment: isinstance on LibCST's ABCs is slow)
            method_calls = [(c, c.func.attr.value) for c, _ in self.f.calls
                            if type(c.func) is cst.Attribute and c.func.attr.value in names]
            assigns = [a for a in self.f.assigns if any(
                type(t.target) is cst.Attribute and t.target.attr.value == "requires_grad" for t in a.targets)]
            self._requires_grad_changes = (method_calls, assigns)
        return self._requires_grad_changes

    def touches_requires_grad(self, node: cst.CSTNode) -> bool:
        """`"requires_grad" in self.words(node)`, asked of every method of every class: found by
        bisecting the positions of the few names and strings that contain it, not by listing
        all the words of each method."""
        start = self.ctx.position(node)
        if start is None:  # a node built by a rule: not indexed
            return "requires_grad" in self.words(node)
        if self._requires_grad_spots is None:
            hits = [n for tp in (cst.Name, cst.SimpleString) for n in self.ctx.nodes(tp)
                    if "requires_grad" in n.value]  # type: ignore[attr-defined]
            self._requires_grad_spots = sorted(self.ctx.position(n) for n in hits)  # type: ignore[type-var]
        spots = self._requires_grad_spots
        first = bisect_left(spots, start)  # the first one at or after `node`: is it inside?
        return first < len(spots) and spots[first] <= self.ctx.last_position(node)

    def conditional_submodules(self, klass: Optional[cst.ClassDef]) -> List[Tuple[str, cst.CSTNode]]:
        """Submodules with parameters that forward() uses only in some branches of an `if`."""
        if klass is None or not isinstance(klass.body, cst.IndentedBlock):
            return []
        if klass not in self._conditional:
            self._conditional[klass] = self._conditional_submodules(klass)
        return self._conditional[klass]

    def _conditional_submodules(self, klass: cst.ClassDef) -> List[Tuple[str, cst.CSTNode]]:
        methods = {f.name.value: f for f in klass.body.body if isinstance(f, cst.FunctionDef)}
        forward, init = methods.get("forward"), methods.get("__init__")
        if forward is None or init is None or not isinstance(init.body, cst.IndentedBlock):
            return []
        subs: Set[str] = set()
        for s in iter_statements(init.body.body):
            if not isinstance(s, cst.SimpleStatementLine):
                continue
            for small in s.body:
                if not (isinstance(small, cst.Assign) and isinstance(small.value, cst.Call)):
                    continue
                for t in small.targets:
                    name = dotted(t.target)
                    if not (name and name.startswith("self.")) or name.count(".") != 1:
                        continue
                    func = self.ctx.resolve(small.value.func) or dotted(small.value.func) or ""
                    if _PARAMLESS.search(func.rsplit(".", 1)[-1]):
                        continue
                    if self.ctx.enclosing(small, cst.If, cst.FunctionDef) is not init:
                        continue  # created conditionally: the same flag usually guards its use
                    subs.add(name[5:])
        if not subs:
            return []
        uses: Dict[str, List[Tuple[Optional[cst.CSTNode], str]]] = {}
        for node in self.ctx.within(forward.body, cst.Attribute):
            if isinstance(node.value, cst.Name) and node.value.value == "self" and node.attr.value in subs:
                uses.setdefault(node.attr.value, []).append(self._branch(node, forward))
        out = []
        for name, found in uses.items():
            if any(cond is None for cond, _ in found):
                continue
            conds = {}
            for cond, branch in found:
                conds.setdefault(cond, set()).add(branch)
            if any(branches >= {"body", "orelse"} for branches in conds.values()):
                continue
            cond = found[0][0]
            test = getattr(cond, "test", None)
            test_text = self.text(test) if test is not None else ""
            if test_text.strip() in ("self.training", "not self.training") or mentions(test_text, "self." + name):
                continue
            out.append((name, cond))
        return out

    def _branch(self, node: cst.CSTNode, stop: cst.CSTNode) -> Tuple[Optional[cst.CSTNode], str]:
        """The innermost `if` (statement or expression) whose branch holds `node`, and which branch."""
        child = node
        for anc in self.ctx.ancestors(node):
            if anc is stop:
                break
            if isinstance(anc, (cst.If, cst.IfExp)):
                if child is anc.body:
                    return anc, "body"
                if child is anc.orelse:
                    return anc, "orelse"
            child = anc
        return None, ""

    def uses_every_submodule(self, klass: cst.ClassDef) -> bool:
        """forward() has no branches or loops and uses every submodule assigned in __init__."""
        if not isinstance(klass.body, cst.IndentedBlock):
            return False
        methods = {f.name.value: f for f in klass.body.body if isinstance(f, cst.FunctionDef)}
        forward, init = methods.get("forward"), methods.get("__init__")
        if forward is None or init is None or not isinstance(forward.body, cst.IndentedBlock):
            return False
        for s in iter_statements(forward.body.body):
            if isinstance(s, (cst.If, cst.For, cst.While, cst.Try, cst.With)):
                return False
        text = self.text(forward)
        if " if " in text:
            return False
        for s in iter_statements(init.body.body if isinstance(init.body, cst.IndentedBlock) else []):
            if isinstance(s, cst.SimpleStatementLine):
                for small in s.body:
                    if isinstance(small, cst.Assign) and isinstance(small.value, cst.Call):
                        for t in small.targets:
                            name = dotted(t.target)
                            if name and name.startswith("self.") and name.count(".") == 1:
                                func = self.ctx.resolve(small.value.func) or dotted(small.value.func) or ""
                                if not _PARAMLESS.search(func.rsplit(".", 1)[-1]) and not mentions(text, name):
                                    return False
        return True

    def method_leaves_out(self, klass: cst.ClassDef, method: str) -> List[str]:
        """The submodules assigned in `klass.__init__` that its method `method` (and the methods
        of the class it calls on `self`) never mentions: TD3's `Critic.Q1` runs `l1`, `l2` but not
        `l4`, `l5`. Empty where the method calls the model itself (`self(x)`, `self.forward(x)`)."""
        if not isinstance(klass.body, cst.IndentedBlock):
            return []
        methods = {f.name.value: f for f in klass.body.body if isinstance(f, cst.FunctionDef)}
        init, first = methods.get("__init__"), methods.get(method)
        if init is None or first is None or not isinstance(init.body, cst.IndentedBlock):
            return []
        texts, todo, seen = [], [first], set()
        while todo:
            fn = todo.pop()
            if fn.name.value in seen:
                continue
            seen.add(fn.name.value)
            text = self.text(fn)
            if "self(" in text or "self.forward(" in text:
                return []
            texts.append(text)
            todo += [methods[n] for n in methods if n not in seen and f"self.{n}(" in text]
        text = "\n".join(texts)
        left = []
        for s in iter_statements(init.body.body):
            for small in s.body if isinstance(s, cst.SimpleStatementLine) else ():
                if not isinstance(small, cst.Assign):
                    continue
                pairs = [(t.target, small.value) for t in small.targets]
                pairs += [(a.value, b.value) for t in small.targets if isinstance(t.target, cst.Tuple)
                          and isinstance(small.value, cst.Tuple) and len(t.target.elements) == len(small.value.elements)
                          for a, b in zip(t.target.elements, small.value.elements)]
                for target, value in pairs:
                    name = dotted(target)
                    if not (isinstance(value, cst.Call) and name and name.startswith("self.") and name.count(".") == 1):
                        continue
                    func = (self.ctx.resolve(value.func) or dotted(value.func) or "").rsplit(".", 1)[-1]
                    if func[:1].isupper() and not _PARAMLESS.search(func) and not mentions(text, name):
                        left.append(name)
        return left

    def discarded_heads(self, origin: Optional[Origin], name: str) -> Tuple[str, List[str]]:
        """(class, submodules) where the submodules feed only outputs of the model class's
        `forward()` (of any module of the program) which every training call of the model `name`
        throws away (`logits, _ = model(x)`, `model(x)[0]`): their parameters get no gradient,
        and DDP fails at the second step ("Expected to have finished reduction") unless the
        wrap passes find_unused_parameters=True."""
        if origin is None or not name:
            return "", []
        spelled = dotted(origin.call.func) or ""
        outputs = self.ctx.program.forward_outputs.get(spelled, ())
        if not outputs and origin.kind == "class":  # a class of this file, processed on its own
            outputs = forward_outputs(ast.parse(textwrap.dedent(self.text(origin.node))).body[0])
        if len(outputs) < 2:
            return "", []
        kept: Set[int] = set()
        training_calls = 0
        for call, _ in self.f.calls:
            if dotted(call.func) != name:
                continue
            scope = self.ctx.enclosing(call, cst.FunctionDef) or self.ctx.module
            if under_no_grad(self.ctx, call) or not runs_backward(self.ctx, scope):
                continue  # evaluation: no gradient, nothing for DDP to reduce
            training_calls += 1
            used = _used_outputs(self.ctx, call, len(outputs))
            if used is None:
                return "", []
            kept |= used
        if not training_calls or len(kept) == len(outputs):
            return "", []
        needed = set().union(*(outputs[i] for i in kept))
        dropped = set().union(*(outputs[i] for i in range(len(outputs)) if i not in kept))
        return spelled.rsplit(".", 1)[-1], sorted(dropped - needed)


def model_facts(ctx: Context) -> ModelFacts:
    """The model facts of the module, built on first use and kept on the context."""
    found = ctx.facts.get("models")
    if found is None:
        found = ctx.facts["models"] = ModelFacts(ctx)
    return found  # type: ignore[return-value]

"""TM502 load-map-location: checkpoints read anywhere, onto the CPU, into plain models.

This rule edits `torch.load` calls and the *argument* of `load_state_dict`; the
`model.load_state_dict` function of a wrapped model is TM302's (see the package docstring).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import arg, set_kwarg
from torchmigrate.syntax.nodes import expr as cached_expr
from torchmigrate.options import RUNTIME_MODULE as RUNTIME
from torchmigrate.program.checkpoints import LOADS, feeds_state_dict, holds_objects, non_tensor_saved
from torchmigrate.rule import Example, Rule
from torchmigrate.rules._active import active
from torchmigrate.rules.launch.tm103_device_from_rank import cuda_string
from torchmigrate.rules.model.plan import wrapped_models
from torchmigrate.program.models import DDP_CLASSES, DP_CLASSES
from torchmigrate.syntax.nodes import code


def _seven(node) -> bool:
    """`7` or `len("module.")`: the length of DataParallel's key prefix."""
    if isinstance(node, cst.Integer):
        return node.value == "7"
    return isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "len" \
        and len(node.args) == 1 and isinstance(node.args[0].value, cst.SimpleString) \
        and node.args[0].value.evaluated_value == "module."


def _key_of_items(ctx, node: cst.CSTNode, name: str) -> bool:
    """`name` is the key a comprehension or `for` around `node` takes from `X.items()` /
    `X.keys()` / `X` (a state dict's entries)."""
    for anc in ctx.ancestors(node):
        fors = [anc] if isinstance(anc, cst.For) else list(ctx.within(anc, cst.CompFor)) if isinstance(
            anc, (cst.DictComp, cst.ListComp, cst.SetComp, cst.GeneratorExp)) else []
        for f in fors:
            target = f.target
            first = target.elements[0].value if isinstance(target, (cst.Tuple, cst.List)) and target.elements \
                else target
            it = f.iter
            if isinstance(first, cst.Name) and first.value == name and isinstance(it, cst.Call) \
                    and isinstance(it.func, cst.Attribute) and it.func.attr.value in ("items", "keys"):
                return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False


class LoadMapLocation(Rule):
    """
    ## What it does
    - `torch.load(path)` without `map_location` gets `map_location="cpu"` when what it loads
      goes into `load_state_dict(...)` or is moved with `.to(...)`/`.cuda()` (a positional or
      keyword `map_location` is kept). A checkpoint that holds whole objects used as loaded
      (`optimizer = ckpt["optimizer"]`, `model = torch.load(path)` then `model.eval()`; keys
      the program saves a model or optimizer object under) gets `map_location=tm.device()`:
      an optimizer's state must be on the device of its parameters. For other loads (tensors
      used as loaded) the `"cpu"` fix is offered as unsafe: the tensors end up on the CPU.
    - `model.load_state_dict(sd)` for a trained (DDP-wrapped) model loads
      `tm.strip_prefix(sd)`, which drops `module.` / `_orig_mod.` key prefixes written by
      `nn.DataParallel`, DDP or `torch.compile` models (TM302 turns `model.load_state_dict`
      into `tm.unwrap(model).load_state_dict`).
    - `{k[7:]: v for k, v in sd.items()}` (or `k[len("module."):]` in a loop over a state
      dict's items), DataParallel's prefix cut by position, becomes `k.removeprefix("module.")`
      in a file that speaks of `module.` keys or wraps a model: the migrated program saves the
      plain model's keys, which the cut would maim.
    - `weights_only` is never changed. When this file saves non-tensor objects in its
      checkpoints (`args`, a config object, a whole model), a note says that `torch.load`
      defaults to `weights_only=True` since torch 2.6 and raises `UnpicklingError` on them.

    ## Why is this bad?
    Without `map_location`, tensors saved from `cuda:0` are loaded onto `cuda:0` by every rank:
    rank 0's GPU runs out of memory, the other ranks get tensors on the wrong device
    (pytorch/pytorch#23138). Checkpoints written from a wrapped model carry `module.` prefixes
    that a plain model refuses ("Missing key(s) in state_dict").

    In a migration, a `map_location` that names one GPU (`"cuda:0"`, `f"cuda:{args.gpu}"`,
    `torch.device("cuda")`) becomes `tm.device()`: every rank would load onto that GPU, and a value
    kept from the checkpoint (a best accuracy saved as a tensor) would meet the rank's own tensors
    on another device.

    In `lint` mode (distributed files) `torch.load` without `map_location` is reported.
    """

    code = "TM502"
    name = "load-map-location"
    summary = "Load checkpoints to the CPU and tolerate module./_orig_mod. prefixes"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torch
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt = torch.load(args.resume)
            model.load_state_dict(ckpt["model"])
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            ckpt = torch.load(args.resume, map_location="cpu")
            model.load_state_dict(tm.strip_prefix(ckpt["model"]))
            """,
        ),
        Example(
            before="""
            import torch
            state = torch.load(path, "cpu")
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx):
            return
        f = analysis.facts(ctx)
        loads = [call for call, name in f.calls if name in LOADS]
        lsd = [call for call, _ in f.calls
               if isinstance(call.func, cst.Attribute) and call.func.attr.value == "load_state_dict"]
        non_tensor = None
        for call in loads:
            if any(a.star == "**" for a in call.args):
                continue
            feeds = feeds_state_dict(ctx, call, lsd)
            objects = ctx.options.migrating and holds_objects(ctx, call)
            if arg(call, "map_location", 1) is None and arg(call, "f", 0) is not None \
                    and not self._placed_in_other_branch(call, loads):
                fix = replace(call, lambda c: set_kwarg(c, "map_location", cached_expr('"cpu"')))
                if objects:
                    self.report(call, "this checkpoint holds whole objects used as loaded (a pickled optimizer or "
                                      "model), whose tensors stay where they are loaded: onto this rank's own device, "
                                      "where the model is (map_location=tm.device()); \"cpu\" would leave an "
                                      "optimizer's state on the CPU and fail at its first step",
                                edits=[replace(call, lambda c: set_kwarg(c, "map_location",
                                                                         cached_expr(f"{ctx.tm}.device()")))],
                                imports=[ctx.runtime_import()])
                elif feeds:
                    self.report(call, "torch.load without map_location loads GPU-saved tensors onto the device "
                                      "they were saved from (cuda:0) on every rank; load to the CPU",
                                edits=[fix])
                else:
                    self.report(call, "torch.load without map_location: every rank loads GPU-saved tensors onto "
                                      "cuda:0. Add map_location=\"cpu\" (then move what you use to tm.device()) "
                                      "or map_location=tm.device()",
                                edits=[fix], safety=Safety.UNSAFE)
            location = arg(call, "map_location", 1)
            if location is not None and ctx.options.mode == "ddp" and _one_gpu(ctx, location.value):
                self.report(location.value, "map_location names one GPU: every rank would load onto it (rank 1 then "
                                            "compares or trains tensors of another GPU); load onto this rank's own "
                                            "device, tm.device()",
                            edits=[replace(location.value, lambda v: cached_expr(f"{ctx.tm}.device()"))],
                            imports=[ctx.runtime_import()])
            if (feeds or objects) and arg(call, "weights_only") is None:
                if non_tensor is None:
                    non_tensor = non_tensor_saved(ctx)
                if non_tensor:
                    names = ", ".join(f"`{n}`" for n in non_tensor)
                    self.report(call, f"this file's checkpoints hold non-tensor objects ({names}); torch.load "
                                      f"defaults to weights_only=True since torch 2.6 and then raises "
                                      f"UnpicklingError: pass weights_only=False for files you trust, or save "
                                      f"plain values (e.g. vars(args))")
        if ctx.options.mode == "ddp":
            self._strip_prefix(lsd)
            self._prefix_slices()

    def _prefix_slices(self) -> None:
        """`{k[7:]: v for k, v in ckpt["state_dict"].items()}` (or `name = k[7:]` in a loop over a
        state dict's items): the program cuts DataParallel's `module.` off every key it loads.
        The migrated program saves the plain model's keys, so the cut would eat the first seven
        characters of each: `k.removeprefix("module.")` cuts it only where it is there (old
        checkpoints load as before). Only in a file that speaks of `module.` keys or wraps a
        model in DataParallel/DDP, whose saves the migration changes."""
        ctx = self.ctx
        text_has_prefix = any(isinstance(n.evaluated_value, str) and n.evaluated_value.startswith("module")
                              for n in ctx.nodes(cst.SimpleString))
        if not text_has_prefix and not any(name in DP_CLASSES or name in DDP_CLASSES for _, name in analysis.facts(ctx).calls):
            return
        for sub in ctx.nodes(cst.Subscript):
            key = sub.value
            if not (isinstance(key, cst.Name) and len(sub.slice) == 1 and isinstance(sub.slice[0].slice, cst.Slice)):
                continue
            cut = sub.slice[0].slice
            if cut.upper is not None or cut.step is not None or not _seven(cut.lower):
                continue
            if not _key_of_items(ctx, sub, key.value):
                continue
            self.report(sub, f"`{code(sub)}` cuts DataParallel's `module.` off each key, but the migrated program "
                             "saves the plain model's keys: cut the prefix only where it is there",
                        edits=[replace(sub, lambda s: cst.parse_expression(
                            f'{code(s.value)}.removeprefix("module.")'))])

    def _strip_prefix(self, lsd: List[cst.Call]) -> None:
        ctx = self.ctx
        models = set(analysis.trained_models(ctx))
        wrapped = ctx.facts.get("wrapped_models")
        if wrapped is None:
            try:  # computed by the model rules; optional
                wrapped = wrapped_models(ctx)
            except Exception:  # noqa: BLE001
                wrapped = ()
        wrapped = wrapped or ()
        if isinstance(wrapped, dict):
            wrapped = wrapped.keys()
        for w in wrapped:
            name = w if isinstance(w, str) else getattr(w, "name", None)
            if isinstance(name, str):
                models.add(analysis.model_root(name))
        if not models or self._own_module_attribute():
            return
        tm = ctx.tm
        for call in lsd:
            owner = call.func.value
            if isinstance(owner, cst.Call) and ctx.resolve(owner.func) == RUNTIME + ".unwrap" and owner.args:
                owner = owner.args[0].value
            name = dotted(owner)
            if name is None or analysis.model_root(name) not in models:
                continue
            a = arg(call, "state_dict", 0)
            if a is None or a.star:
                continue
            value = a.value
            if isinstance(value, cst.Call) and ctx.resolve(value.func) in (RUNTIME + ".strip_prefix",):
                continue
            merged, source = self._merged_source(call, value)
            if merged and source is None:
                continue  # its source is stripped already
            if source is not None:
                # `model_dict = model.state_dict(); ...; model_dict.update(sd)`: the loaded keys are
                # compared and merged with the plain model's before the load: strip them where loaded
                self.report(source, "the checkpoint's keys are compared and merged with the plain model's keys "
                                    "(`module.` prefixes of a DataParallel/DDP checkpoint would match none): "
                                    "tm.strip_prefix where it is loaded",
                            edits=[replace(source, lambda v: cst.Call(func=cached_expr(f"{tm}.strip_prefix"),
                                                                      args=[cst.Arg(value=v)]))],
                            imports=[ctx.runtime_import()])
                continue

            def fix(node: cst.Arg) -> cst.Arg:
                return node.with_changes(value=cst.Call(func=cached_expr(f"{tm}.strip_prefix"), args=[cst.Arg(value=node.value)]))

            self.report(a.value, "checkpoints from DataParallel/DDP/compiled models carry `module.`/`_orig_mod.` "
                                 "key prefixes; tm.strip_prefix loads them into the plain model",
                        edits=[replace(a, fix)], imports=[ctx.runtime_import()])

    def _merged_source(self, call: cst.Call, value: cst.BaseExpression) -> Tuple[bool, Optional[cst.BaseExpression]]:
        """`model.load_state_dict(model_dict)` where `model_dict = model.state_dict()` took in a
        loaded dict (`model_dict.update(sd)`, TSM's fine-tuning with its `.net` key remapping):
        the value of `sd`'s last assignment from the checkpoint before the function first reads it
        (`sd = sd["state_dict"]`, `sd = torch.load(path)`), where a strip makes its keys the
        model's. (whether the load is of such a merged dict, that value or None: not found or
        stripped already)."""
        ctx = self.ctx
        scope = ctx.enclosing(call, cst.FunctionDef) or ctx.module
        if not isinstance(value, cst.Name):
            return False, None
        assigns = [a for a in ctx.within(scope, cst.Assign, skip_defs=True) if len(a.targets) == 1]
        own = [a for a in assigns if dotted(a.targets[0].target) == value.value]
        if not own or not all(isinstance(a.value, cst.Call) and isinstance(a.value.func, cst.Attribute)
                              and a.value.func.attr.value == "state_dict" for a in own):
            return False, None
        merged = [c.args[0].value for c in ctx.within(scope, cst.Call, skip_defs=True)
                  if isinstance(c.func, cst.Attribute) and c.func.attr.value == "update" and dotted(c.func.value) == value.value
                  and len(c.args) == 1 and isinstance(c.args[0].value, cst.Name)]
        if len({m.value for m in merged}) != 1:
            return False, None
        name = merged[0].value
        loads = ("torch.load", RUNTIME + ".load")
        bound = [a for a in assigns if dotted(a.targets[0].target) == name]
        if any(isinstance(a.value, cst.Call) and ctx.resolve(a.value.func) == RUNTIME + ".strip_prefix" for a in bound):
            return True, None  # stripped already (a second run)
        chosen = None
        for a in sorted(bound, key=lambda a: ctx.position(a) or 0):
            v = a.value
            inner = v.value if isinstance(v, cst.Subscript) else v
            from_load = isinstance(inner, cst.Call) and ctx.resolve(inner.func) in loads or (
                isinstance(inner, cst.Name) and inner.value == name and chosen is not None)
            if not from_load:
                break
            chosen = v
        return True, chosen

    def _placed_in_other_branch(self, call: cst.Call, loads: List[cst.Call]) -> bool:
        """`if args.gpu is None: torch.load(p)` / `else: torch.load(p, map_location=loc)` (the
        ImageNet example, MoCo): the script places the load itself where it runs one process
        per GPU; the branch without map_location is its single-process (DataParallel) path.
        Only for code that is distributed already: a migration runs that branch under torchrun."""
        if self.ctx.options.mode != "lint":
            return False
        statement = self.ctx.statement_of(call)
        branch = self.ctx.parent(statement)
        test_if = self.ctx.parent(branch)
        if isinstance(test_if, cst.Else):
            branch, test_if = test_if, self.ctx.parent(test_if)
        if not isinstance(test_if, cst.If) or test_if.orelse is None:
            return False
        other = test_if.orelse if branch is test_if.body else test_if.body
        return any(arg(c, "map_location", 1) is not None and any(a is other for a in self.ctx.ancestors(c))
                   for c in loads)

    def _own_module_attribute(self) -> bool:
        """A class of this file sets `self.module = ...` (or `_orig_mod`): its parameters
        legitimately start with `module.`, so stripping prefixes could drop real key parts."""
        for assign in analysis.facts(self.ctx).assigns:
            for t in assign.targets:
                if dotted(t.target) in ("self.module", "self._orig_mod"):
                    return True
        return False


def _one_gpu(ctx, value: cst.BaseExpression) -> bool:
    """A fixed CUDA device (TM103's `cuda_string`: `"cuda"`, `"cuda:0"`, `f"cuda:{args.gpu}"`,
    `"cuda:{}".format(gpu)`, `"cuda:%d" % gpu`), also as `torch.device(...)` (not a dict that maps
    devices, nor a function)."""
    if isinstance(value, cst.Call) and ctx.resolve(value.func) == "torch.device" and value.args:
        value = value.args[0].value
    return cuda_string(value) is not None

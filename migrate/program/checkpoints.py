"""Checkpoint facts of one module: its saves and loads, the file each one names, and what its
checkpoints hold.

No rule code and no option reads these: the checkpoint family (`rules/checkpoint/`) decides from
them where a save goes under the main process, where other ranks wait for a file before reading
it, and what a load needs (TM501, TM502, TM504, TM505).

- ``SAVES`` / ``LOADS``: the calls that write and read a checkpoint (resolved names);
- the file a call names: its path's text, also through `with open(path) as f` (`path_text`,
  `with_binding`, `is_open`), whether it is an opened file object (`file_handle`) or an
  in-memory or temporary buffer that the process reads back (`is_buffer`);
- the loads and barriers in call order (`load_events`), a statement that follows a save in its
  block (`follows_save`);
- what a load feeds (`feeds_state_dict`: a `load_state_dict(...)` or a `.to()`/`.cuda()` move)
  and which non-tensor objects the module saves (`non_tensor_saved`).

Name resolution uses the import table (`ctx.resolve`), never across modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program.loaders import RUNTIME
from torchmigrate.program.scopes import assignments, names_in, scope_of
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code

if TYPE_CHECKING:
    from torchmigrate.rule import Context

SAVES = {"torch.save", RUNTIME + ".save"}
LOADS = {"torch.load"}
_BUFFER_FACTORIES = ("io.BytesIO", "io.StringIO", "tempfile.")
_BUFFER_NAMES = ("buf", "buffer", "bio", "stream", "bytes_io", "byte_io", "fobj")
_CONFIG_NAMES = {"args", "opt", "opts", "config", "cfg", "conf", "hparams", "hyperparams", "hp", "options",
                 "flags", "settings", "hyper_params", "train_args", "training_args", "params"}
_PLAIN_FACTORIES = ("dict", "vars", "asdict", "dataclasses.asdict", "OmegaConf.to_container", "copy.deepcopy")
_MOVES = ("to", "cuda", "cpu", "load_state_dict")


def _dict_values(obj: cst.BaseExpression) -> List[cst.BaseExpression]:
    """The values of a `{...}` or `dict(k=v, ...)` expression; [] for anything else."""
    if isinstance(obj, cst.Dict):
        return [e.value for e in obj.elements if isinstance(e, cst.DictElement)]
    if isinstance(obj, cst.Call) and dotted(obj.func) == "dict":
        return [a.value for a in obj.args if a.keyword is not None]
    return []


def _bound_from(ctx: Context, name: str, scope: cst.CSTNode) -> List[cst.BaseExpression]:
    """Values assigned to a plain name in a scope."""
    return [a.value for a in assignments(ctx).get((scope, name), ())]


def is_buffer(ctx: Context, target: cst.BaseExpression, scope: cst.CSTNode) -> bool:
    """`torch.save(obj, buf)` into an in-memory or temporary file object that the process reads back."""
    candidates = [target]
    if isinstance(target, cst.Name):
        if any(b in target.value.lower() for b in _BUFFER_NAMES):
            return True
        candidates += _bound_from(ctx, target.value, scope)
        for anc in ctx.ancestors(target):  # `with tempfile.TemporaryFile() as f:`
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
            for n in anc.items if isinstance(anc, cst.With) else ():
                if n.asname is not None and isinstance(n.asname.name, cst.Name) \
                        and n.asname.name.value == target.value and isinstance(n.item, cst.Call) \
                        and (dotted(n.item.func) or "").split(".")[-1] != "open":
                    return True
    for c in candidates:
        if isinstance(c, cst.Call):
            name = ctx.resolve(c.func) or dotted(c.func) or ""
            if name.startswith(_BUFFER_FACTORIES) or name.endswith(("BytesIO", "StringIO")):
                return True
    return False


def file_handle(ctx: Context, call: cst.Call, target: cst.BaseExpression) -> Tuple[bool, Optional[cst.With]]:
    """For `torch.save(obj, f)` into a file object opened in this file: (True, the
    `with open(...) as f:` statement, or None when the file is opened elsewhere); (False, None)
    for a path."""
    if isinstance(target, cst.Call):
        name = ctx.resolve(target.func) or dotted(target.func) or ""
        return (name.split(".")[-1] == "open", None)
    if not isinstance(target, cst.Name):
        return False, None
    bound = with_binding(ctx, call, target.value)
    if bound is not None:
        statement, value = bound
        return (True, statement) if is_open(value) else (False, None)
    for value in _bound_from(ctx, target.value, scope_of(ctx, call)):
        if is_open(value):
            return True, None
    return False, None


def with_binding(ctx: Context, call: cst.Call, name: str) -> Optional[Tuple[cst.With, cst.BaseExpression]]:
    """The innermost `with <value> as name:` around `call` in its function: (statement, value)."""
    for anc in ctx.ancestors(call):
        if isinstance(anc, cst.With):
            for item in anc.items:
                if item.asname is not None and isinstance(item.asname.name, cst.Name) \
                        and item.asname.name.value == name:
                    return anc, item.item
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            break
    return None


def is_open(node: cst.BaseExpression) -> bool:
    """`open(...)` (any spelling ending in `open`)."""
    return isinstance(node, cst.Call) and (dotted(node.func) or "").split(".")[-1] == "open"


def save_through_handle(ctx: Context, with_: cst.CSTNode) -> Optional[Tuple[cst.Call, cst.BaseExpression]]:
    """`with open(path, "wb") as f: torch.save(obj, f)`, the file opened only to be saved into:
    (the save, the path), which `tm.save(obj, path)` writes the same way (TM501 rewrites it; TM504
    leaves it to TM501). None for anything else: several items, another mode, more statements,
    or the handle used otherwise."""
    if not isinstance(with_, cst.With) or len(with_.items) != 1 or with_.asynchronous is not None:
        return None
    item = with_.items[0]
    opened = item.item
    if not (is_open(opened) and item.asname is not None and isinstance(item.asname.name, cst.Name)
            and len(opened.args) == 2 and all(a.keyword is None and not a.star for a in opened.args)
            and isinstance(opened.args[1].value, cst.SimpleString)
            and opened.args[1].value.evaluated_value in ("wb", "bw")):
        return None
    body = with_.body.body if isinstance(with_.body, cst.IndentedBlock) else with_.body.body
    lines = [b for b in body if isinstance(b, cst.SimpleStatementLine)]
    if len(body) != 1 or len(lines) != 1 or len(lines[0].body) != 1 or not isinstance(lines[0].body[0], cst.Expr):
        return None
    call = lines[0].body[0].value
    handle = item.asname.name.value
    if not (isinstance(call, cst.Call) and ctx.resolve(call.func) == "torch.save" and len(call.args) >= 2
            and isinstance(call.args[1].value, cst.Name) and call.args[1].value.value == handle
            and call.args[1].keyword is None and call.args[0].keyword is None):
        return None
    if sum(1 for n in ctx.within(call, cst.Name) if n.value == handle) != 1:
        return None
    return call, opened.args[0].value


def saves_into(ctx: Context, with_: cst.With) -> bool:
    """`with open(...) as f:` whose block calls `torch.save(obj, f)`: a checkpoint file, which
    TM501 writes on the main process (the whole block); other writers leave it alone."""
    names = {i.asname.name.value for i in with_.items if i.asname is not None and isinstance(i.asname.name, cst.Name)}
    return any(ctx.resolve(c.func) == "torch.save" and len(c.args) >= 2 and isinstance(c.args[1].value, cst.Name)
               and c.args[1].value.value in names for c in ctx.within(with_.body, cst.Call))


def path_text(ctx: Context, call: cst.Call, file: cst.BaseExpression) -> str:
    """The text of the path a save or load call writes or reads: `p` for a file object from
    `with open(p, ...) as f:` around the call or for `open(p, ...)` itself, else the argument."""
    bound = with_binding(ctx, call, file.value) if isinstance(file, cst.Name) else None
    opened = bound[1] if bound is not None else file
    if is_open(opened) and opened.args:
        return code(opened.args[0].value)
    return code(file)


def load_events(ctx: Context) -> List[Tuple[int, cst.Call, str]]:
    """(index in the module's calls, call, resolved name) of every barrier and checkpoint load
    (`torch.load`, `tm.load`), in call order; computed once per module."""
    events = ctx.facts.get("tm_load_events")
    if events is None:
        events = [(i, call, name) for i, (call, name) in enumerate(analysis.facts(ctx).calls)
                  if name and (name.endswith(".barrier") or name in LOADS or name == RUNTIME + ".load")]
        ctx.facts["tm_load_events"] = events
    return events  # type: ignore[return-value]


def follows_save(ctx: Context, call: cst.Call) -> bool:
    """`call` is in a statement after a checkpoint save line of the same block."""
    child: cst.CSTNode = call
    for anc in ctx.ancestors(call):
        body = getattr(anc, "body", None)
        if isinstance(body, (list, tuple)) and child in body:
            for before in body[:list(body).index(child)]:
                if any(ctx.resolve(c.func) in SAVES and ctx.statement_of(c) is before
                       for c in ctx.within(before, cst.Call)):
                    return True
        if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
            return False
        child = anc
    return False


def feeds_state_dict(ctx: Context, call: cst.Call, lsd: List[cst.Call]) -> bool:
    """The object `call` loads goes into `load_state_dict(...)` (one of `lsd`) or is moved with
    `.to()`/`.cuda()`."""
    target: Optional[str] = None
    for anc in ctx.ancestors(call):
        if isinstance(anc, cst.Call) and isinstance(anc.func, cst.Attribute) and anc.func.attr.value in _MOVES:
            return True
        if isinstance(anc, cst.Assign):
            if len(anc.targets) == 1 and isinstance(anc.targets[0].target, cst.Name):
                target = anc.targets[0].target.value
            break
        if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            break
    if target is None:
        return False
    scope = scope_of(ctx, call)
    tracked = {target}
    assigns = assignments(ctx).get((scope, None), ())
    for _ in range(2):
        for a in assigns:
            if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name) and names_in(ctx, a.value) & tracked:
                tracked.add(a.targets[0].target.value)
    for other in lsd:
        if any(names_in(ctx, x.value) & tracked for x in other.args) and scope_of(ctx, other) is scope:
            return True
    for c in _moves(ctx):
        if c.func.value.value in tracked and scope_of(ctx, c) is scope:
            return True
    return False


def _moves(ctx: Context) -> List[cst.Call]:
    """`name.to(...)` / `name.cuda()` calls of the file."""
    found = ctx.facts.get("tm_moves")
    if found is None:
        found = [c for c, _ in analysis.facts(ctx).calls
                 if isinstance(c.func, cst.Attribute) and c.func.attr.value in ("to", "cuda")
                 and isinstance(c.func.value, cst.Name)]
        ctx.facts["tm_moves"] = found
    return found  # type: ignore[return-value]


def non_tensor_saved(ctx: Context) -> List[str]:
    """Names of non-tensor objects (argparse/config objects, whole modules or optimizers) that
    this file puts into its checkpoints."""
    f = analysis.facts(ctx)
    models = set(analysis.trained_models(ctx))
    optimizers = {o.target for o in analysis.optimizers(ctx) if o.target}
    found: List[str] = []

    def plain(name: str) -> bool:
        for a in (x for (_, n), xs in assignments(ctx).items() if n == name for x in xs):
            for t in a.targets:
                if isinstance(t.target, cst.Name) and t.target.value == name:
                    v = a.value
                    if isinstance(v, (cst.Dict, cst.DictComp, cst.List, cst.Tuple, cst.SimpleString,
                                      cst.Integer, cst.Float)):
                        return True
                    if isinstance(v, cst.Call) and (dotted(v.func) or "").endswith(_PLAIN_FACTORIES):
                        return True
        return False

    def check(value: cst.BaseExpression) -> None:
        name = dotted(value)
        if name is None:
            return
        last = name.rsplit(".", 1)[-1]
        if last.lower() in _CONFIG_NAMES and not plain(name):
            label = name
        elif name in models or name in optimizers:
            label = name
        else:
            return
        if label not in found:
            found.append(label)

    def values_of(obj: cst.BaseExpression, scope: cst.CSTNode) -> List[cst.BaseExpression]:
        if not isinstance(obj, cst.Name):
            return _dict_values(obj)
        out: List[cst.BaseExpression] = []
        for v in _bound_from(ctx, obj.value, scope):
            out += _dict_values(v)
        for a in subscript_assigns.get(obj.value, ()):
            out.append(a.value)
        return out

    subscript_assigns: Dict[str, List[cst.Assign]] = {}
    for a in f.assigns:
        for t in a.targets:
            if isinstance(t.target, cst.Subscript):
                key = dotted(t.target.value)
                if key:
                    subscript_assigns.setdefault(key, []).append(a)
    for call, name in f.calls:
        if name not in SAVES or not call.args:
            continue
        obj = call.args[0].value
        if isinstance(obj, cst.Name) and (obj.value in models or obj.value in optimizers):
            check(obj)
            continue
        for v in values_of(obj, scope_of(ctx, call)):
            check(v)
    return found


# what a dict checkpoint is used with; any other method or attribute is an object's
_DICT_USES = frozenset({"get", "keys", "items", "values", "pop", "setdefault", "update", "copy", "__getitem__",
                        "__contains__"})


def holds_objects(ctx: Context, call: cst.Call) -> bool:
    """The load `call` returns pickled objects that are used as they are: a whole model or
    optimizer (`model = torch.load(path)`, then `model.eval()`), or a checkpoint entry that is
    one (`optimizer = ckpt["optimizer"]`, a key the program saves a whole object under, or one
    whose value gets its methods called). Their tensors stay where `map_location` puts them,
    unlike a state dict's, which `load_state_dict` copies onto the model's device. A loaded
    object moved with `.to()`/`.cuda()` does not count."""
    target: Optional[cst.Name] = None
    for anc in ctx.ancestors(call):
        if isinstance(anc, cst.Call) and isinstance(anc.func, cst.Attribute) and anc.func.attr.value in _MOVES:
            return False
        if isinstance(anc, cst.Assign):
            if len(anc.targets) == 1 and isinstance(anc.targets[0].target, cst.Name):
                target = anc.targets[0].target
            break
        if isinstance(anc, (cst.BaseSmallStatement, cst.BaseCompoundStatement)):
            break
    if target is None:
        return False
    scope = scope_of(ctx, call)
    for use in _uses_of_binding(ctx, target, scope):
        parent = ctx.parent(use)
        if isinstance(parent, cst.Attribute) and parent.value is use:
            if parent.attr.value not in _DICT_USES:
                return True  # `model.eval()`, `optimizer.step()`: the loaded value is an object
            entry = ctx.parent(parent)
            if parent.attr.value in ("get", "pop") and isinstance(entry, cst.Call) and entry.args \
                    and _object_entry(ctx, entry, entry.args[0].value, scope):
                return True
        elif isinstance(parent, cst.SubscriptElement) or isinstance(parent, cst.Subscript) and parent.value is use:
            sub = parent if isinstance(parent, cst.Subscript) else None
            if sub is not None and len(sub.slice) == 1 and isinstance(sub.slice[0].slice, cst.Index) \
                    and _object_entry(ctx, sub, sub.slice[0].slice.value, scope):
                return True
    return False


def _uses_of_binding(ctx: Context, target: cst.Name, scope: cst.CSTNode) -> List[cst.Name]:
    """The reads of `target`'s name that see this binding: after it, and not after a later
    assignment of the same name (`data = torch.load(p)`, then `data = Dataset(data)`: the
    `data.y.numpy()` after that reads the dataset object, not what was loaded)."""
    start = ctx.position(target) or 0
    rebinds = [(ctx.position(t) or 0, ctx.statement_of(t)) for t in ctx.named(target.value)
               if isinstance(ctx.parent(t), cst.AssignTarget) and t is not target and scope_of(ctx, t) is scope
               and (ctx.position(t) or 0) > start]
    out = []
    for use in _uses(ctx, target.value, scope):
        where = ctx.position(use) or 0
        if where <= start:
            continue
        if any(where > at and ctx.statement_of(use) is not statement for at, statement in rebinds):
            continue
        out.append(use)
    return out


def _uses(ctx: Context, name: str, scope: cst.CSTNode) -> List[cst.Name]:
    return [n for n in ctx.named(name) if scope_of(ctx, n) is scope
            and not isinstance(ctx.parent(n), (cst.AssignTarget, cst.Param))]


def _object_entry(ctx: Context, entry: cst.BaseExpression, key: cst.BaseExpression, scope: cst.CSTNode) -> bool:
    """`ckpt["optimizer"]` is a whole object: the program saves one under that key, or what it
    is bound to gets methods called other than a dict's (`optimizer = ckpt["optimizer"]`,
    then `optimizer.step()`)."""
    if isinstance(key, cst.SimpleString) and key.evaluated_value in ctx.program.pickled_keys:
        return True
    parent = ctx.parent(entry)
    if isinstance(parent, cst.Attribute) and parent.value is entry:
        return parent.attr.value not in _DICT_USES and parent.attr.value not in _MOVES
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        for use in _uses(ctx, parent.targets[0].target.value, scope):
            up = ctx.parent(use)
            if isinstance(up, cst.Attribute) and up.value is use:
                if up.attr.value in _MOVES:
                    return False
                if up.attr.value not in _DICT_USES:
                    return True
    return False

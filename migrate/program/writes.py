"""File-write and download facts of one module: which calls fetch files from the network, which
write a file, which test whether a file exists, and which already run under
`main_process_first`.

No rule code and no option reads these: the checkpoint family's plan (`rules/checkpoint/plan.py`)
decides from them which statements go under `tm.main_process_first()` (TM505), and TM504 which
writes go under `tm.is_main()`. Checkpoint saves and loads are in `program.checkpoints`.

- `fetches`: a download (`urlretrieve`, `hf_hub_download`, a torchvision dataset given
  `download=`, torchtext datasets, `load_dataset` and the `.map`/`.filter` calls on what it
  returned, which write cache files: `hf_datasets`);
- `writes_file`: a call that writes a file (known writers, `torch.save`, `open` for writing, a
  writer method, `.save(...)`); `is_pil_image`: the receiver of `.save(path)` is a PIL image;
- `existence_if` / `early_return_check`: the `if` that asks whether a file exists around a
  statement, or returns early before it; `asks_exists`;
- `under_main_process_first`: inside `with <anything>.main_process_first():` already;
- `inside_def`, `in_loop`, `in_body`: where a statement runs;
- `call_kinds`: the effects (`program.effects`) of the program's code a call reaches;
  `writer_class`: a call that builds a TensorBoard-style writer (a `SummaryWriter` through any
  receiver, a subclass of the program's); `handle_uses_write_only`: every use of a file handle
  writes into it (so the handle may be a null object on the other ranks).

Name resolution uses the import table (`ctx.resolve`), never across modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program import effects
from torchmigrate.program.effects import MODULE_SCOPE
from torchmigrate.program.syntax import body_of, index_in, iter_nodes, local_callee
from torchmigrate.syntax.imports import dotted

if TYPE_CHECKING:
    from torchmigrate.rule import Context

# Calls that fetch files from the network (resolved names).
_DOWNLOADS = frozenset({
    "urllib.request.urlretrieve", "torch.hub.download_url_to_file",
    "torchvision.datasets.utils.download_url", "torchvision.datasets.utils.download_and_extract_archive",
    "torchvision.datasets.utils.download_file_from_google_drive",
    "huggingface_hub.snapshot_download", "huggingface_hub.hf_hub_download", "datasets.load_dataset",
    "gdown.download", "wget.download", "nltk.download",
})
# Dataset classes that download when given `download=` (anything but a literal False).
_DATASET_PACKAGES = ("torchvision.datasets.", "torchaudio.datasets.")
# torchtext's datasets fetch their files whenever they are built.
_ALWAYS_FETCH = ("torchtext.datasets.",)
_HF_LOAD = "datasets.load_dataset"
# Methods of a Hugging Face dataset that write cache files next to it.
_HF_CACHING = frozenset({"map", "filter"})
_EXISTS_METHODS = frozenset({"exists", "is_file", "is_dir"})
_FIRST = frozenset({"main_process_first", "local_main_process_first"})
_DEFS = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def fetches(ctx: Context, call: cst.Call, name: Optional[str]) -> bool:
    """`call` (resolved as `name`) fetches files from the network, or writes a Hugging Face
    dataset's cache files."""
    if name is not None and (name in _DOWNLOADS or name.startswith(_ALWAYS_FETCH)
                             or name.startswith(_DATASET_PACKAGES) and _asks_download(call)):
        return True
    if _asks_download(call) and (_library_dataset_class(ctx, call.func)
                                 or (dotted(call.func) or "") in ctx.program.library_datasets):
        return True  # `UnsupervisedCIFAR10(root, download=download)`: the program's subclass of one
    if name in effects.SHELL_RUNNERS and call.args \
            and effects.shell_command_fetches(analysis.leading_text(call.args[0].value)):
        return True  # `os.system("wget %s; unzip %s" % (url, name))`
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value in _HF_CACHING \
        and _root_name(func.value) in hf_datasets(ctx, call)


def writes_file(call: cst.Call, name: Optional[str], names: Optional[Dict[str, str]] = None) -> bool:
    """`call` (resolved as `name`) writes a file: a known writer, `torch.save`, `open(...)` for
    writing (`names`: the module's mode variables, `analysis.open_modes`), a writer method
    (`df.to_csv(p)`) or `.save(...)` / `.save_to_disk(...)` with arguments."""
    func = call.func
    return name in analysis.FILE_WRITERS or name == "torch.save" or (
        analysis.opens_file_for_writing(call, name, names)) or (
        isinstance(func, cst.Attribute) and bool(call.args)
        and (func.attr.value in analysis.FILE_WRITER_METHODS or func.attr.value in ("save", "save_to_disk")))


def hf_datasets(ctx: Context, at: cst.CSTNode) -> Set[str]:
    """Names the function holding `at` binds to what `load_dataset` returned (or its `.map`);
    computed once per function."""
    scope = ctx.scope_of(at)
    cache = ctx.facts.setdefault("hf_datasets", {})
    found = cache.get(scope)
    if found is None:
        found = cache[scope] = set()
        for assign in analysis.facts(ctx).assigns:
            value = assign.value
            if ctx.scope_of(assign) is not scope or not isinstance(value, cst.Call):
                continue
            if ctx.resolve(value.func) == _HF_LOAD or (
                    isinstance(value.func, cst.Attribute) and value.func.attr.value in _HF_CACHING
                    and _root_name(value.func.value) in found):
                found |= {t.target.value for t in assign.targets if isinstance(t.target, cst.Name)}
    return found


# torchvision's conversions to a PIL image (`ToPILImage()(grid)`, `to_pil_image(x)`)
_TO_PIL = frozenset({"torchvision.transforms.ToPILImage", "torchvision.transforms.transforms.ToPILImage",
                     "torchvision.transforms.functional.to_pil_image", "torchvision.transforms.v2.ToPILImage",
                     "torchvision.transforms.v2.functional.to_pil_image"})


def is_pil_image(ctx: Context, node: cst.BaseExpression, at: cst.CSTNode,
                 seen: Optional[Set[cst.CSTNode]] = None) -> bool:
    """A PIL image: `Image.fromarray(a)` (also `.convert(...)` of one), torchvision's
    `ToPILImage()(grid)` / `to_pil_image(x)`, or a name the
    enclosing function binds to one (`im = Image.fromarray(a); im.save(path)`). `seen`: the
    assignments followed so far (`img = f(img)` binds a name to a call of itself)."""
    seen = set() if seen is None else seen
    while isinstance(node, cst.Call):
        made_by = node.func.func if isinstance(node.func, cst.Call) else node.func  # `ToPILImage()(grid)`
        resolved = ctx.resolve(made_by) or ""
        if resolved.startswith("PIL.Image.") or resolved in _TO_PIL:
            return True
        node = node.func.value if isinstance(node.func, cst.Attribute) else None
    if not isinstance(node, cst.Name):
        return False
    scope = ctx.enclosing(at, cst.FunctionDef)
    for a in analysis.facts(ctx).assigns:
        if ctx.enclosing(a, cst.FunctionDef) is scope and any(
                isinstance(t.target, cst.Name) and t.target.value == node.value for t in a.targets) \
                and isinstance(a.value, cst.Call) and a not in seen:
            seen.add(a)
            if is_pil_image(ctx, a.value, a, seen):
                return True
    return False


def existence_if(ctx: Context, node: cst.CSTNode) -> Optional[cst.If]:
    """The innermost `if` around `node` (in its function) that asks whether a file exists;
    of an `elif`, the whole chain."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, _DEFS):
            return None
        if isinstance(anc, cst.If) and asks_exists(ctx, anc.test):
            while isinstance(ctx.parent(anc), cst.If):
                anc = ctx.parent(anc)
            return anc
    return None


def early_return_check(ctx: Context, node: cst.CSTNode) -> Optional[cst.If]:
    """`if os.path.exists(p): return load(p)` before the statement holding `node`, in its block."""
    line = ctx.statement_of(node)
    while line is not None and not isinstance(ctx.parent(line), (cst.IndentedBlock, cst.Module)):
        line = ctx.statement_of(ctx.parent(line))
    if line is None:
        return None
    body = body_of(ctx.parent(line)) or ()
    for sibling in reversed(body[:max(index_in(body, line), 0)]):
        if isinstance(sibling, cst.If) and asks_exists(ctx, sibling.test) and sibling.orelse is None \
                and isinstance(sibling.body, cst.IndentedBlock) and sibling.body.body \
                and any(isinstance(n, cst.Return) for n in iter_nodes(sibling.body.body[-1])):
            return sibling
    return None


def under_main_process_first(ctx: Context, node: cst.CSTNode) -> bool:
    """Inside `with <anything>.main_process_first(...)` already."""
    return any(isinstance(anc, cst.With) and any(
        isinstance(item.item, cst.Call) and (dotted(item.item.func) or "").rsplit(".", 1)[-1] in _FIRST
        for item in anc.items) for anc in ctx.ancestors(node))


def inside_def(ctx: Context, node: cst.CSTNode, statement: Optional[cst.CSTNode]) -> bool:
    """`node` runs later than its statement: in a lambda (or a def) within it."""
    for anc in ctx.ancestors(node):
        if anc is statement:
            return False
        if isinstance(anc, _DEFS):
            return True
    return False


def in_body(ctx: Context, statement: cst.CSTNode) -> bool:
    """`statement` is a statement of a block (not a compound statement's header)."""
    return isinstance(ctx.parent(statement), (cst.IndentedBlock, cst.Module))


def in_loop(ctx: Context, node: cst.CSTNode) -> bool:
    """`node` runs in a loop of its function."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.For, cst.While)):
            return True
        if isinstance(anc, _DEFS):
            return False
    return False


def _library_dataset_class(ctx: Context, func: cst.BaseExpression, depth: int = 0) -> bool:
    """`func` names a class of this module deriving (through its classes) from a torchvision or
    torchaudio dataset, which downloads when it is built with `download=`."""
    if type(func) is not cst.Name or depth > 4:
        return False
    klass = analysis.facts(ctx).classes.get(func.value)
    if klass is None:
        return False
    for base in klass.bases:
        resolved = ctx.resolve(base.value) or ""
        if resolved.startswith(_DATASET_PACKAGES) or _library_dataset_class(ctx, base.value, depth + 1):
            return True
    return False


def _asks_download(call: cst.Call) -> bool:
    """`download=` given and not a literal False."""
    return any(a.keyword is not None and a.keyword.value == "download"
               and not (isinstance(a.value, cst.Name) and a.value.value == "False") for a in call.args)


def asks_exists(ctx: Context, test: cst.BaseExpression) -> bool:
    """The test calls `os.path.exists`/`isfile`/`isdir` or a path's `.exists()`/`.is_file()`/`.is_dir()`."""
    for n in iter_nodes(test):
        if isinstance(n, cst.Call) and (ctx.resolve(n.func) in effects.EXISTS_TESTS or (
                isinstance(n.func, cst.Attribute) and n.func.attr.value in _EXISTS_METHODS and not n.args)):
            return True
    return False


def _root_name(node: cst.BaseExpression) -> Optional[str]:
    """`ds` of `ds`, `ds["train"]`, `ds.train`."""
    while isinstance(node, (cst.Subscript, cst.Attribute)):
        node = node.value
    return node.value if isinstance(node, cst.Name) else None


def scope_qual(ctx: Context, node: cst.CSTNode) -> str:
    """How `program.effects` names the scope of `node`: "f", "Cls.m" or "<module>" (a nested
    function belongs to the top-level function or method around it)."""
    outer = None
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.FunctionDef):
            outer = anc
    if outer is None:
        return MODULE_SCOPE
    klass = ctx.parent(ctx.parent(outer))
    if isinstance(klass, cst.ClassDef) and isinstance(ctx.parent(klass), cst.Module):
        return f"{klass.name.value}.{outer.name.value}"
    return outer.name.value


def call_kinds(ctx: Context, call: cst.Call) -> Optional[frozenset]:
    """The effects of the program's own code that `call` reaches (a function, a method, a class
    built, in any module), or None when it reaches none (a library call, an unknown receiver)."""
    spelled = dotted(call.func)
    if spelled is None:
        return None
    return ctx.program.call_effects.get(f"{scope_qual(ctx, call)}|{spelled}")


_WRITER_NAMES = frozenset({"SummaryWriter", "FileWriter"})
_WRITER_CLASSES = frozenset({"tensorboard_logger.Logger", "tensorboard_logger.logger.Logger"})


def writer_class(ctx: Context, call: cst.Call, name: Optional[str]) -> bool:
    """`call` builds an object that writes event or log files wherever it is used: a
    `SummaryWriter` however reached (`importlib.import_module(m).SummaryWriter(...)`,
    `tbx.SummaryWriter`), tensorboard_logger's `Logger`, or a class of the program derived from
    one (`class Logger(SummaryWriter)` in another module), or an experiment tracker's run
    (`visdom.Visdom()`, `comet_ml.Experiment(...)`: `effects.TRACKER_RUNS`)."""
    func = call.func
    last = func.attr.value if isinstance(func, cst.Attribute) else func.value if isinstance(func, cst.Name) else None
    return (last in _WRITER_NAMES and (isinstance(func, cst.Attribute) or "." in (name or ""))) \
        or name in _WRITER_CLASSES or name in effects.TRACKER_RUNS or (dotted(func) or "") in ctx.program.writer_classes


# What may be done with a file opened for writing when it is a null object on the other ranks:
# methods that write into it, and library calls that only write into a file they are given.
_HANDLE_METHODS = frozenset({"write", "writelines", "flush", "close", "writerow", "writerows", "writeheader"})
_HANDLE_SINKS = frozenset({"print", "json.dump", "pickle.dump", "yaml.dump", "yaml.safe_dump", "csv.writer",
                           "csv.DictWriter", "numpy.savetxt", "joblib.dump", "pprint.pprint"})


def handle_uses_write_only(ctx: Context, name: str, scope: cst.CSTNode, skip: cst.CSTNode, depth: int = 0) -> bool:
    """Every use of the file handle `name` (a plain name, or `self.x` across the class) in
    `scope` writes into it: `f.write(...)`, `f.close()`, `print(..., file=f)`, `json.dump(obj, f)`,
    `csv.writer(f)`, `with f:`, a test against None (`if f is not None:`), or hands it to a function
    of this file whose parameter is used only so (`train(loader, model, log)` with
    `log.write(...)`; two calls deep). Then on the other ranks it may be `tm.main_only`'s null
    object, which absorbs all of these. `skip`: the binding itself."""
    last = name.rsplit(".", 1)[-1]
    for n in ctx.within(scope, cst.Name):
        if n.value != last or any(a is skip for a in ctx.ancestors(n)):
            continue
        use: cst.CSTNode = n
        if "." in name:
            use = ctx.parent(n)
            if not (isinstance(use, cst.Attribute) and use.attr is n and dotted(use) == name):
                continue
        elif isinstance(ctx.parent(n), cst.Attribute) and ctx.parent(n).attr is n:
            continue  # `x.f`: another name
        parent = ctx.parent(use)
        if isinstance(parent, cst.Attribute) and parent.value is use:
            call = ctx.parent(parent)
            if parent.attr.value in _HANDLE_METHODS and isinstance(call, cst.Call) and call.func is parent \
                    and isinstance(ctx.parent(call), cst.Expr):
                continue
            return False
        if isinstance(parent, cst.Arg):
            call = ctx.parent(parent)
            if isinstance(call, cst.Call) and (ctx.resolve(call.func) or dotted(call.func)) in _HANDLE_SINKS:
                continue
            if isinstance(call, cst.Call) and depth < 2 and _passed_write_only(ctx, call, parent, depth):
                continue
            return False
        if isinstance(parent, cst.WithItem) and parent.item is use:
            continue
        if isinstance(parent, cst.Comparison) and parent.left is use and all(
                isinstance(c.operator, (cst.Is, cst.IsNot)) and isinstance(c.comparator, cst.Name)
                and c.comparator.value == "None" for c in parent.comparisons):
            continue  # `if log is not None:` (the null object is not None: every rank runs the block)
        if isinstance(parent, cst.If) and parent.test is use and parent.orelse is None \
                and _only_writes_into(parent.body, name):
            continue  # `if self.record_file:` (the null object is falsy: the other ranks skip a block that only writes)
        if isinstance(parent, (cst.Assign, cst.AssignTarget)) and (
                isinstance(parent, cst.AssignTarget) or parent.value is not use):
            continue  # the binding (or another one)
        return False
    return True


def _only_writes_into(body: cst.BaseSuite, name: str) -> bool:
    """Every statement of `body` is a call that names the handle `name` (`f.write(line)`,
    `print(x, file=f)`), whose use the caller checks: skipping the block skips writes only."""
    statements = body.body if isinstance(body, cst.IndentedBlock) else [body]
    for statement in statements:
        if not isinstance(statement, cst.SimpleStatementLine):
            return False
        for small in statement.body:
            if not (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                    and any(dotted(n) == name for n in iter_nodes(small.value) if isinstance(n, (cst.Name, cst.Attribute)))):
                return False
    return True


def _passed_write_only(ctx: Context, call: cst.Call, arg: cst.Arg, depth: int) -> bool:
    """`arg` hands the handle to a module-level function of this file whose matching parameter
    is only written into (`handle_uses_write_only` on its body)."""
    from torchmigrate.program.loaders import bind_params  # (loaders reads this module's call kinds)

    func = local_callee(ctx, call) if isinstance(call.func, cst.Name) else None
    if func is None or arg.star:
        return False
    param = next((name for name, value in bind_params(func, call, False) if value is arg.value), None)
    return param is not None and handle_uses_write_only(ctx, param, func.body, func.params, depth + 1)


def in_private_temp(ctx: Context, call: cst.Call) -> bool:
    """`call` names a path inside a temporary file or folder this process made for itself
    (`with tempfile.TemporaryDirectory() as tmp: ... open(os.path.join(tmp, "task.xml"), "w")`,
    also through local names built from it, `config = os.path.join(tmp, "task.xml")`): each
    rank writes its own, and none must be kept from writing it (ROUGE's config file). A move
    (`os.replace(src, dst)`) counts by its destination."""
    args = call.args[1:2] if ctx.resolve(call.func) in MOVES else call.args
    return any(_names_temp(ctx, call, a) for a in args)


def private_temp_source(ctx: Context, call: cst.Call) -> bool:
    """`os.replace(tmp.name, path)`: a move of this process's own temporary file (its first
    argument) to a path that is not one (an atomic save into a shared folder)."""
    return ctx.resolve(call.func) in MOVES and len(call.args) >= 2 and not in_private_temp(ctx, call) \
        and _names_temp(ctx, call, call.args[0])


def _names_temp(ctx: Context, call: cst.Call, arg: cst.Arg) -> bool:
    """`arg` reads a name of `call`'s scope bound to a private temporary file or folder."""
    scope = ctx.enclosing(call, cst.FunctionDef) or ctx.module
    cache: Dict[cst.CSTNode, Set[str]] = ctx.facts.setdefault("tm_private_temps", {})  # type: ignore[assignment]
    names = cache.get(scope)
    if names is None:
        names = cache[scope] = _private_temp_names(ctx, scope)
    return bool(names) and any(isinstance(n, cst.Name) and n.value in names for n in iter_nodes(arg.value))


def _bound_names(target: cst.BaseExpression) -> List[cst.Name]:
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in _bound_names(el.value)]
    return []


# moves and renames: they write their destination (the second argument)
MOVES = frozenset({"os.replace", "os.rename", "os.renames", "shutil.move"})


def _private_temp_names(ctx: Context, scope: cst.CSTNode) -> Set[str]:
    """Names of `scope` bound to a private temporary file or folder, or to a value built from one."""
    seeds = {item.asname.name.value for w in ctx.within(scope, cst.With, skip_defs=True) for item in w.items
             if isinstance(item.item, cst.Call) and ctx.resolve(item.item.func) in effects.PRIVATE_TEMPS
             and item.asname is not None and isinstance(item.asname.name, cst.Name)}
    bindings = [({n.value for t in a.targets for n in _bound_names(t.target)},  # `fd, path = mkstemp()`
                 isinstance(a.value, cst.Call) and ctx.resolve(a.value.func) in effects.PRIVATE_TEMPS
                 and not kept_run_folder(ctx, a),
                 {n.value for n in iter_nodes(a.value) if isinstance(n, cst.Name)})
                for a in ctx.within(scope, cst.Assign, skip_defs=True)]
    return effects.temp_names(seeds, bindings)


def kept_run_folder(ctx: Context, assign: cst.Assign) -> bool:
    """`run_path = tempfile.mkdtemp(prefix=run_id, dir=experiment_dir)` whose names its scope never
    removes (`shutil.rmtree(run_path)`): the run's output folder (`effects.kept_run_folder`)."""
    call = assign.value
    if not isinstance(call, cst.Call):
        return False
    targets = {n.value for t in assign.targets for n in _bound_names(t.target)}
    scope = ctx.enclosing(assign, cst.FunctionDef) or ctx.module
    removed = any(ctx.resolve(c.func) == "shutil.rmtree" and c.args and isinstance(c.args[0].value, cst.Name)
                  and c.args[0].value.value in targets for c in ctx.within(scope, cst.Call, skip_defs=True))
    dir_given = len([a for a in call.args if a.keyword is None]) >= 3 or any(
        a.keyword is not None and a.keyword.value == "dir" for a in call.args)
    return effects.kept_run_folder(ctx.resolve(call.func), dir_given, removed)


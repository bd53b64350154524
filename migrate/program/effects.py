"""What each function, method and class of a program does that matters under torchrun, computed
once per program from CPython's `ast` of every module (cheap, picklable): its effects.

Kinds of effect (`WRITE` ... `STATE`):
- `WRITE`: writes a file (the sites keep the path expression where it is written out): `open`
  for writing, `json`/`pickle`/`yaml`/`numpy`/`torch` savers, image writers (imageio, cv2, PIL's
  `.save`, `plt.savefig`, `save_image`), `df.to_csv`, `shutil` copies and removals,
  `logging.FileHandler`, TensorBoard writers (`SummaryWriter` reached through any receiver,
  `importlib.import_module(m).SummaryWriter`, a subclass of the program's), tensorboardX,
  tensorboard_logger, `wandb.init`;
- `MKDIR`: creates a folder (harmless on every rank with `exist_ok`, TM504's);
- `OUTPUT`: prints or logs to the console (`print`, `logging`, tqdm, visdom);
- `COLLECTIVE`: communicates with the other ranks (torch.distributed, the runtime's collectives);
- `TRAIN`: a backward pass or an optimizer step;
- `CALLS`: calls code it was handed (a parameter, `self.<attr>` of unknown type, a local value):
  maybe a forward pass through DDP, so it must run on every rank;
- `READ`: reads a file; `RANDOM`: draws random numbers; `CLOCK`: reads the clock;
- `STATE`: changes state that outlives the call (`self.x = ...`, a parameter's items, `global`);
- `PROBE`: looks for a free name by testing, in a loop, whether paths exist (`for i in range(1,
  100): d = f"{name}-{i:02d}"; if not os.path.exists(d): ...; return d`, `while exists(p): n += 1`):
  every rank probes on its own, and once one has created its folder the next finds another, so
  its result must be rank 0's (a loop that only skips missing files is no probe);
- `NUMPY`: converts a tensor with `.numpy()` (no effect outside the call, but under autocast a
  bf16 tensor has no numpy dtype: the AMP plan keeps such calls out of its blocks).

Effects flow through calls: a function has the effects of everything it calls among the
program's own functions, methods (`self.m()`, `obj.m()` of an instance of the program's
classes, through their base classes) and classes (a constructor runs `__init__`; a class derived
from a library writer writes when it is built), to a fixpoint.

The same per-module summary (`summarize`) is read off the original sources, for the rules
(through `ModuleView.call_effects` and `ModuleView.writer_classes`), and off the migrated
sources, for the report: `unguarded_writes` lists the write sites that still run on every rank
(not under a rank guard, `tm.main_only`, `tm.save`, nor under `main_process_first`, in a function
some path reaches without a guard), so the summary never claims "rank 0 only" where it is not.
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from torchmigrate.program import collates, inherited
from torchmigrate.program.astwalk import walk
from torchmigrate.program.generators import endless_generators
from torchmigrate.program.open_modes import mode_names_ast, mode_of_ast, writes

WRITE, MKDIR, OUTPUT, COLLECTIVE, TRAIN, CALLS, READ, RANDOM, CLOCK, STATE, PROBE, NUMPY = (
    "write", "mkdir", "output", "collective", "train", "calls", "read", "random", "clock", "state", "probe", "numpy")
# effects that leave nothing behind on a rank that skips them: a call whose effects are these
# alone may run on the main process only
OUTPUT_ONLY = frozenset({WRITE, MKDIR, OUTPUT, READ, NUMPY})

RUNTIME = "torchmigrate.runtime"
_RUNTIMES = (RUNTIME, "torchmigrate_runtime")

# Library calls that write a file (resolved names); methods of any receiver in `_WRITE_METHODS`.
_WRITERS = frozenset({
    "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.savetxt", "numpy.ndarray.tofile",
    "matplotlib.pyplot.savefig", "matplotlib.pyplot.imsave", "imageio.imwrite", "imageio.imsave",
    "imageio.mimsave", "imageio.mimwrite", "imageio.v2.imwrite", "imageio.v2.mimsave", "imageio.v3.imwrite",
    "cv2.imwrite", "scipy.misc.imsave", "scipy.misc.toimage", "scipy.io.savemat", "scipy.io.wavfile.write",
    "scipy.sparse.save_npz", "skimage.io.imsave", "matplotlib.image.imsave", "imageio.v2.imsave", "tifffile.imwrite",
    "tifffile.imsave", "nibabel.save", "SimpleITK.WriteImage",
    "soundfile.write", "torchaudio.save", "pickle.dump", "joblib.dump", "json.dump", "yaml.dump",
    "yaml.safe_dump", "torch.save", "torchvision.utils.save_image", "shutil.copy", "shutil.copyfile",
    "shutil.copy2", "shutil.copytree", "shutil.move", "shutil.rmtree", "os.remove", "os.unlink",
    "os.rename", "os.replace", "os.symlink", "os.link", "logging.FileHandler", "logging.handlers.RotatingFileHandler",
    "logging.handlers.TimedRotatingFileHandler", "tensorboard_logger.configure", "tensorboard_logger.log_value",
    "tensorboard_logger.log_histogram", "tensorboard_logger.log_images", "wandb.init",
    "tensorflow.summary.create_file_writer", "tensorflow.summary.FileWriter",
})
_WRITE_METHODS = frozenset({"savefig", "to_csv", "to_parquet", "to_pickle", "to_excel", "to_feather", "to_json",
                            "write_text", "write_bytes", "tofile", "save_to_disk", "save_pretrained", "save"})
# pathlib methods that create or remove the file their receiver names (a run's flag file)
PATH_WRITES = frozenset({"touch", "unlink"})
# pathlib methods that make the link their receiver names (`Path(latest).symlink_to(ckpt)`)
PATH_LINKS = frozenset({"symlink_to", "hardlink_to"})
# Library classes whose instances write files (a TensorBoard event file, a log): the write
# happens where one is built; a receiver spelled any way (`importlib.import_module(m).SummaryWriter`)
# counts by the class's last name.
_WRITER_CLASS_NAMES = frozenset({"SummaryWriter", "FileWriter"})
# Experiment trackers' run objects: each one built starts a run (a visdom session, a comet or
# neptune experiment, an aim run, a ClearML task) that every later call on it logs into.
TRACKER_RUNS = frozenset({"visdom.Visdom", "comet_ml.Experiment", "comet_ml.OfflineExperiment", "neptune.init_run",
                          "neptune.init", "neptune.new.init_run", "aim.Run", "clearml.Task.init"})
_WRITER_CLASSES = frozenset({"tensorboard_logger.Logger", "logging.FileHandler",
                             "logging.handlers.RotatingFileHandler", "logging.handlers.TimedRotatingFileHandler",
                             *TRACKER_RUNS})
_MKDIRS = frozenset({"os.makedirs", "os.mkdir", "pathlib.Path.mkdir"})
# what makes a file or folder of this process's own (tempfile's; `gettempdir()` is shared): each
# rank writes its own, none waits for another; an in-memory buffer (`buf = io.BytesIO();
# plt.savefig(buf)`) is one too
PRIVATE_TEMPS = frozenset({"tempfile.TemporaryDirectory", "tempfile.mkdtemp", "tempfile.mkstemp",
                           "tempfile.NamedTemporaryFile", "tempfile.TemporaryFile", "tempfile.SpooledTemporaryFile",
                           "io.BytesIO", "io.StringIO"})
EXISTS_TESTS = frozenset({"os.path.exists", "os.path.isdir", "os.path.isfile"})  # calls that ask whether a path exists
# calls that read files (a name; `READ_PREFIXES`: every call under these)
READERS = frozenset({"json.load", "pickle.load", "numpy.load", "numpy.loadtxt", "torch.load", "yaml.load",
                     "yaml.safe_load", "PIL.Image.open", "cv2.imread", "imageio.imread", "imageio.v2.imread",
                     "scipy.io.loadmat", "joblib.load", "h5py.File", "os.listdir", "glob.glob"})
READ_PREFIXES = ("pandas.read_",)
_OUTPUTS = frozenset({"print", "sys.stdout.write", "sys.stderr.write", "pprint.pprint"})
_OUTPUT_PREFIXES = ("logging.", "tqdm.", "visdom.")
_LOG_METHODS = frozenset({"info", "debug", "warning", "warn", "error", "critical", "exception", "log"})
_RANDOM_PREFIXES = ("random.", "numpy.random.")
_TORCH_RANDOM = frozenset({"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
                           "normal", "bernoulli", "multinomial", "poisson"})
_CLOCK = frozenset({"time.time", "time.perf_counter", "time.strftime", "time.localtime", "time.monotonic",
                    "datetime.datetime.now", "datetime.now", "datetime.datetime.today", "datetime.date.today"})
_COLLECTIVE_NAMES = frozenset({"all_reduce", "all_gather", "all_gather_object", "reduce", "gather", "gather_object",
                               "broadcast", "broadcast_object", "broadcast_object_list", "barrier", "reduce_scatter",
                               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "scatter",
                               "gather_for_metrics", "gather_list", "main_process_first", "reduce_meter",
                               "any_rank", "all_ranks", "sync_grads", "share_params", "monitored_barrier",
                               "reduce_batch_total"})
_TRAIN_METHODS = frozenset({"backward", "zero_grad"})
_MUTATORS = frozenset({"append", "extend", "update", "add", "insert", "pop", "clear", "setdefault", "remove",
                       "add_", "copy_", "fill_", "zero_", "load_state_dict"})
# methods of plain containers and strings that only read them (`self.w2i.get(w, unk)`): no
# forward of a model hides behind them
_QUERIES = frozenset({"get", "keys", "values", "items", "copy", "index", "count", "split", "strip", "lower",
                      "upper", "join", "format", "startswith", "endswith", "replace", "encode", "decode", "tolist"})
# nn.Module's own methods, called on `self` in a module of the program: no forward of another model
_MODULE_API = frozenset({"train", "eval", "parameters", "named_parameters", "modules", "named_modules", "children",
                         "named_children", "buffers", "named_buffers", "state_dict", "to", "cuda", "cpu", "half",
                         "float", "double", "zero_grad", "register_buffer", "register_parameter", "add_module",
                         "apply", "requires_grad_", "type", "extra_repr", "get_submodule", "get_parameter"})
# runtime helpers that run their write on the main process only (the site is guarded)
_MAIN_ONLY = frozenset({"main_only", "save", "print"})
_FIRST = frozenset({"main_process_first", "local_main_process_first"})
_BUILTINS = frozenset(dir(builtins))
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)

MODULE_SCOPE = "<module>"


@dataclass(frozen=True)
class Write:
    """One place that writes a file: `path:line`, how (`open`, `json.dump`, `SummaryWriter`...),
    the path expression where the call spells it, and whether it runs on the main process only
    (`guarded`), under `main_process_first` (`ordered`), or on every rank."""

    path: str
    line: int
    how: str
    target: Optional[str] = None
    guarded: bool = False
    ordered: bool = False

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}"


# A call as one module sees it, resolved at `combine` time:
# ("symbol", module path, name)           a function or class of another (or this) module
# ("member", module path, name, attr)     `mod.attr` of a module of the program
# ("method", module path, class, method)  `self.m()` in a class of this module
# ("instance", module path, class, method) `obj.m()` of an instance of a program class
Target = Tuple[str, ...]


@dataclass
class Scope:
    """A module body, function or method (nested functions belong to theirs)."""

    kinds: Set[str] = field(default_factory=set)
    writes: List[Write] = field(default_factory=list)
    calls: List["Call"] = field(default_factory=list)
    params: List[str] = field(default_factory=list)  # positional parameters, in order (`self` too)
    written: Set[str] = field(default_factory=set)  # parameters that name a file it writes


@dataclass(frozen=True)
class Call:
    """A call of the program's code: what it names, whether it runs on the main process only
    (under a rank guard, or of an object `tm.main_only` built), the callee as spelled, its line,
    whether it runs under `main_process_first`, and whether under a file-existence test."""

    target: Target
    guarded: bool
    spelled: str
    line: int
    ordered: bool = False
    first_run: bool = False  # under an `if` that asks whether a file or folder exists


@dataclass
class ModuleSummary:
    """What one module does, before following its calls into the rest of the program."""

    path: str
    scopes: Dict[str, Scope] = field(default_factory=dict)  # "f", "Cls.m", "<module>"
    functions: Set[str] = field(default_factory=set)  # top-level functions
    # class -> its bases: ("class", path, name) for the program's, ("library", dotted) otherwise
    classes: Dict[str, List[Tuple[str, ...]]] = field(default_factory=dict)
    methods: Dict[str, Set[str]] = field(default_factory=dict)


Bindings = Dict[str, Tuple[str, Optional[str]]]  # local name -> (module path, symbol or None)


# --- one module ---------------------------------------------------------------------------

def summarize(tree: ast.Module, path: str, bindings: Bindings, entry: bool = True) -> ModuleSummary:
    """The direct effects of every scope of `tree` (a module at `path`) and the calls it makes,
    with `bindings` naming the program's modules and symbols its imports bind. A module the
    program imports (`entry` false) runs no `if __name__ == "__main__":` block (its self-test or
    preprocessing script): what that block writes is not the program's."""
    out = ModuleSummary(path)
    aliases = _aliases(tree)
    for node in tree.body:
        if isinstance(node, _FUNCS):
            out.functions.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out.classes[node.name] = [_base(b, aliases, bindings, path, tree) for b in node.bases]
            out.methods[node.name] = {n.name for n in node.body if isinstance(n, _FUNCS)}
    own = out.functions | set(out.classes)

    modes = mode_names_ast(tree)

    def reader(node: ast.AST, klass: Optional[str], names: Optional[_Names] = None) -> _Reader:
        made = _Reader(path, aliases, bindings, own, set(out.classes), node, klass, names)
        made.modes = modes
        return made

    # what module-level names and `self.` attributes hold, for every function and method to use
    module_names = reader(tree, None).bind_only()
    for node in tree.body:
        if isinstance(node, _FUNCS):
            out.scopes[node.name] = reader(node, None, module_names).read()
        elif isinstance(node, ast.ClassDef):
            methods = [item for item in node.body if isinstance(item, _FUNCS)]
            attrs = module_names.copy()
            for item in methods:
                attrs.merge(reader(item, node.name, module_names).bind_only(), only_self=True)
            for item in methods:
                out.scopes[f"{node.name}.{item.name}"] = reader(item, node.name, attrs).read()
    body = tree if entry else ast.Module(body=[s for s in tree.body if not _main_guard(s)], type_ignores=[])
    out.scopes[MODULE_SCOPE] = reader(body, None).read()
    return out


def _main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either side)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
        isinstance(x, ast.Constant) and x.value == "__main__" for x in sides)


@dataclass
class _Names:
    """What names (and `self.` attributes) of a scope hold."""

    instances: Dict[str, Tuple[str, str]] = field(default_factory=dict)  # -> (module path, program class)
    handles: Set[str] = field(default_factory=set)  # a file opened for writing
    writers: Set[str] = field(default_factory=set)  # a library writer object
    nulls: Set[str] = field(default_factory=set)  # built by `tm.main_only`: a null object on the other ranks

    def copy(self) -> "_Names":
        return _Names(dict(self.instances), set(self.handles), set(self.writers), set(self.nulls))

    def merge(self, other: "_Names", only_self: bool = False) -> None:
        keep = (lambda n: n.startswith("self.")) if only_self else (lambda n: True)
        self.instances.update({k: v for k, v in other.instances.items() if keep(k)})
        self.handles |= {n for n in other.handles if keep(n)}
        self.writers |= {n for n in other.writers if keep(n)}
        self.nulls |= {n for n in other.nulls if keep(n)}


def _aliases(tree: ast.Module) -> Dict[str, str]:
    """Local name -> dotted library name, from every import of the module."""
    found: Dict[str, str] = {}
    for node in walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    found[a.asname] = a.name
                else:
                    found.setdefault(a.name.split(".")[0], a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                if a.name != "*":
                    found[a.asname or a.name] = f"{node.module}.{a.name}"
    return found


# Shell commands that write or move files, run through `os.system("cp main.py out/backup")` and the
# like: every rank would run them (the first word of the command decides).
SHELL_RUNNERS = frozenset({"os.system", "os.popen", "subprocess.run", "subprocess.call", "subprocess.check_call",
                           "subprocess.check_output", "subprocess.Popen"})
SHELL_WRITERS = frozenset({"cp", "mv", "mkdir", "rm", "touch", "ln", "rsync", "echo", "zip", "gzip", "tar"})
# ... and shell commands that fetch or unpack what every rank then reads (a dataset): those go
# under `main_process_first` (TM505), never under a guard that leaves the other ranks without it.
SHELL_FETCHERS = frozenset({"wget", "curl", "unzip", "gunzip", "7z"})
_SHELL_COMMANDS = SHELL_WRITERS | SHELL_FETCHERS


def shell_command_writes(text: Optional[str]) -> bool:
    """The start of a shell command (`"cp main.py "`, `["mv", ...]`'s first word) is a command
    that writes, moves or removes files (`echo` only with a redirection), or fetches them."""
    words = (text or "").split()
    if not words or words[0] not in _SHELL_COMMANDS:
        return False
    return words[0] != "echo" or ">" in (text or "")


def shell_command_fetches(text: Optional[str]) -> bool:
    """The start of a shell command downloads or unpacks files (`wget`, `curl`, `unzip`,
    `tar xf`)."""
    words = (text or "").split()
    if not words:
        return False
    return words[0] in SHELL_FETCHERS or words[0] == "tar" and len(words) > 1 and "x" in words[1]


def _leading_text(node: ast.AST) -> Optional[str]:
    """The literal text a string expression starts with (see `analysis.leading_text`)."""
    while True:
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, str) else None
        if isinstance(node, ast.JoinedStr):
            first = node.values[0] if node.values else None
            return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
            node = node.left
        elif isinstance(node, (ast.List, ast.Tuple)) and node.elts:
            node = node.elts[0]
        else:
            return None


def _dotted(node: ast.AST) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _base(node: ast.AST, aliases: Dict[str, str], bindings: Bindings, path: str, tree: ast.Module) -> Tuple[str, ...]:
    name = _dotted(node) or ""
    head, _, rest = name.partition(".")
    if head in bindings:
        module, symbol = bindings[head]
        if symbol is not None and not rest:
            return ("class", module, symbol)
        if symbol is None and rest and "." not in rest:
            return ("class", module, rest)
    if not rest and any(isinstance(n, ast.ClassDef) and n.name == head for n in tree.body):
        return ("class", path, head)
    return ("library", f"{aliases[head]}.{rest}" if head in aliases and rest else aliases.get(head, name))


def rank_test(test: ast.AST) -> bool:
    """A test that holds on some ranks only (see `facts._rank_test`)."""
    from torchmigrate.program.facts import _rank_test

    return _rank_test(test)


class _Reader:
    """Reads one scope: its direct effects, its write sites (guarded or not) and its calls."""

    def __init__(self, path: str, aliases: Dict[str, str], bindings: Bindings, own: Set[str], classes: Set[str],
                 node: ast.AST, klass: Optional[str], names: Optional[_Names] = None) -> None:
        self.path, self.aliases, self.bindings, self.own, self.classes = path, aliases, bindings, own, classes
        self.node, self.klass = node, klass
        self.scope = Scope()
        self.params: Set[str] = set()
        if isinstance(node, _FUNCS):
            a = node.args
            self.params = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
            self.scope.params = [p.arg for p in (*a.posonlyargs, *a.args)]
            self.params |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
        self.locals: Set[str] = set()  # names assigned here (values, not the program's)
        self.names = names.copy() if names is not None else _Names()
        self._exists = 0  # inside `if <a file exists test>:` blocks
        self.modes: Dict[str, str] = {}  # the module's open-mode variables (`open_modes`)
        self.temps: Set[str] = set()  # names of this process's own temporary files and folders

    def _body(self) -> List[ast.stmt]:
        return self.node.body if isinstance(self.node, _FUNCS) else [
            s for s in self.node.body if not isinstance(s, _DEFS)]  # type: ignore[attr-defined]

    def bind_only(self) -> _Names:
        """What the scope's names hold, without reading its effects."""
        self._bind(self._body())
        return self.names

    def read(self) -> Scope:
        body = self._body()
        self._bind(body)
        self.temps = self._private_temps(body)
        self._block(body, False, False)
        if isinstance(self.node, ast.Module):
            for d in self.node.body:  # a class body's statements run at import
                if isinstance(d, ast.ClassDef):
                    self._block([s for s in d.body if not isinstance(s, _DEFS)], False, False)
        return self.scope

    # names first, so a use before its binding in source order still resolves
    def _bind(self, body: List[ast.stmt]) -> None:
        for node in (n for s in body for n in walk(s)):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [_dotted(t) for t in targets]
                kind = self._value_kind(node.value)
                null = isinstance(node.value, ast.Call) and self._runtime(node.value.func) == "main_only"
                for name in filter(None, names):
                    if "." not in name:
                        self.locals.add(name)
                    if isinstance(kind, tuple):
                        self.names.instances[name] = kind
                    elif kind == "handle":
                        self.names.handles.add(name)
                    elif kind == "writer":
                        self.names.writers.add(name)
                    if null:
                        self.names.nulls.add(name)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None and (name := _dotted(item.optional_vars)):
                        self.locals.add(name)
                        if self._value_kind(item.context_expr) == "handle":
                            self.names.handles.add(name)
            elif isinstance(node, (ast.For, ast.comprehension)):
                self.locals |= {n.id for n in walk(node.target) if isinstance(n, ast.Name)}
            elif isinstance(node, _FUNCS):
                self.locals.add(node.name)

    def _value_kind(self, value: ast.AST):
        """What an assigned value is: an instance of a program class ((path, class)), a file
        opened for writing ("handle"), a library writer ("writer"), or None."""
        if not isinstance(value, ast.Call):
            return None
        func = value.func
        if self._runtime(func) == "main_only" and value.args:
            func = value.args[0]
            if self._resolve(func) == "open":
                return "handle"
        target = self._class_of(func)
        if target is not None:
            return target
        name = self._resolve(func) or ""
        if (name == "open" or name.endswith(".open")) and _opens_for_writing(value, self.modes):
            return "handle"
        if self._writer_class(func, name):
            return "writer"
        return None

    def _class_of(self, func: ast.AST) -> Optional[Tuple[str, str]]:
        """`Cls` of this module or of another module of the program: (path, class) (resolved
        as a class at combine time; a function of that name is no instance)."""
        name = _dotted(func)
        if name is None:
            return None
        if name in self.classes:
            return self.path, name
        head, _, rest = name.partition(".")
        bound = self.bindings.get(head)
        if bound is None:
            return None
        module, symbol = bound
        if symbol is not None and not rest and symbol[:1].isupper():
            return module, symbol
        if symbol is None and rest and "." not in rest and rest[:1].isupper():
            return module, rest
        return None

    def _resolve(self, func: ast.AST) -> Optional[str]:
        name = _dotted(func)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head in self.aliases and head not in self.locals and head not in self.params:
            return f"{self.aliases[head]}.{rest}" if rest else self.aliases[head]
        return name

    def _runtime(self, func: ast.AST) -> Optional[str]:
        """The runtime helper a call names (`tm.main_only` -> "main_only")."""
        name = self._resolve(func) or ""
        for runtime in _RUNTIMES:
            if name.startswith(runtime + "."):
                return name[len(runtime) + 1:]
        return None

    @staticmethod
    def _writer_class(func: ast.AST, name: str) -> bool:
        last = func.attr if isinstance(func, ast.Attribute) else name.rsplit(".", 1)[-1]
        return last in _WRITER_CLASS_NAMES or name in _WRITER_CLASSES

    # --- statements ----------------------------------------------------------------------

    def _block(self, body: List[ast.stmt], guarded: bool, ordered: bool) -> None:
        for stmt in body:
            if isinstance(stmt, _DEFS):
                if isinstance(stmt, _FUNCS):  # a nested function: its effects are the scope's
                    self._block(stmt.body, guarded, ordered)
                continue
            if isinstance(stmt, ast.If):
                rank = rank_test(stmt.test)
                exists = self._chain_asks_exists(stmt)
                self._expr(stmt.test, guarded, ordered)
                self._exists += exists
                self._block(stmt.body, guarded or rank, ordered)
                self._block(stmt.orelse, guarded or rank, ordered)
                self._exists -= exists
                if rank and not stmt.orelse and isinstance(stmt.body[-1], (ast.Return, ast.Continue, ast.Break)):
                    guarded = True  # `if not is_main(): return`: the rest runs on the main process
                continue
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                first = any(isinstance(i.context_expr, ast.Call)
                            and (_dotted(i.context_expr.func) or "").rsplit(".", 1)[-1] in _FIRST for i in stmt.items)
                for item in stmt.items:
                    self._expr(item.context_expr, guarded, ordered)
                self._block(stmt.body, guarded, ordered or first)
                continue
            if isinstance(stmt, ast.Global) or isinstance(stmt, ast.Nonlocal):
                self.scope.kinds.add(STATE)
            if isinstance(stmt, (ast.For, ast.While)) and self._probes(stmt):
                self.scope.kinds.add(PROBE)
            if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(self._outliving(t) for t in targets):
                    self.scope.kinds.add(STATE)
            blocks = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
            blocks += [h.body for h in getattr(stmt, "handlers", ())]
            if blocks:
                for head in ("test", "iter", "target"):
                    if getattr(stmt, head, None) is not None:
                        self._expr(getattr(stmt, head), guarded, ordered)
                for block in blocks:
                    self._block(block, guarded, ordered)
            else:
                self._expr(stmt, guarded, ordered)

    def _chain_asks_exists(self, stmt: ast.If) -> bool:
        """Some test of the `if`/`elif` chain `stmt` starts asks whether a file exists: `if
        args.create_data: build() elif not os.path.exists(out): build() else: load()` builds on
        the first run, or again when asked to (every branch then writes what the others read)."""
        while True:
            if self._asks_exists(stmt.test):
                return True
            if len(stmt.orelse) != 1 or not isinstance(stmt.orelse[0], ast.If):
                return False
            stmt = stmt.orelse[0]

    def _probes(self, loop: ast.stmt) -> bool:
        """The loop looks for a name that is free: `while os.path.exists(p): n += 1`, a test that
        leaves the loop where a path does not exist (`if not os.path.exists(d): ...; return d`),
        or one that skips the taken ones in a loop that leaves when it finds one (`if exists(p):
        continue` ... `break`). A loop that only skips missing files (`if not isfile(f): continue`,
        a dataset's listing) is no probe."""
        if isinstance(loop, ast.While) and self._asks_exists(loop.test):
            return True
        leaves = any(isinstance(n, (ast.Return, ast.Break)) for n in walk(loop))
        for node in walk(loop):
            if not isinstance(node, ast.If) or not self._asks_exists(node.test):
                continue
            negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
            exits = any(isinstance(n, (ast.Return, ast.Break)) for b in node.body for n in walk(b))
            skips = any(isinstance(n, ast.Continue) for b in node.body for n in walk(b))
            if (negated and exits) or (not negated and skips and leaves):
                return True
        return False

    def _asks_exists(self, test: ast.AST) -> bool:
        """The test asks whether a file or folder exists (`os.path.isdir(out)`, `p.exists()`)."""
        return any(isinstance(n, ast.Call) and (self._resolve(n.func) in EXISTS_TESTS or (
            isinstance(n.func, ast.Attribute) and n.func.attr in ("exists", "is_file", "is_dir") and not n.args))
            for n in walk(test))

    def _outliving(self, target: ast.AST) -> bool:
        """An assignment target that outlives the call: `self.x`, `param.x`, `param[i]`, a
        global's item."""
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
            if isinstance(target, ast.Name):
                return target.id == "self" or target.id in self.params or target.id not in self.locals
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(self._outliving(e) for e in target.elts)
        return False

    # --- expressions ---------------------------------------------------------------------

    def _expr(self, node: ast.AST, guarded: bool, ordered: bool) -> None:
        if isinstance(node, ast.IfExp):
            rank = rank_test(node.test)
            self._expr(node.test, guarded, ordered)
            self._expr(node.body, guarded or rank, ordered)
            self._expr(node.orelse, guarded or rank, ordered)
            return
        if isinstance(node, ast.BoolOp) and node.values and rank_test(node.values[0]):
            self._expr(node.values[0], guarded, ordered)
            for v in node.values[1:]:
                self._expr(v, True, ordered)
            return
        if isinstance(node, ast.Lambda):
            self._expr(node.body, guarded, ordered)
            return
        if isinstance(node, ast.Call):
            if self._call(node, guarded, ordered):
                return  # its arguments were read as part of it
        for child in ast.iter_child_nodes(node):
            self._expr(child, guarded, ordered)

    def _private_temps(self, body: List[ast.stmt]) -> Set[str]:
        """Names bound to a temporary file or folder this process made for itself
        (`with tempfile.TemporaryDirectory() as tmp`, `tmp = tempfile.mkdtemp()`) or to a value
        built from one (`config = os.path.join(tmp, "task.xml")`): each rank writes its own."""
        nodes = [n for s in body for n in walk(s)]
        seeds = {n.optional_vars.id for n in nodes if isinstance(n, ast.withitem)
                 and isinstance(n.context_expr, ast.Call) and self._resolve(n.context_expr.func) in PRIVATE_TEMPS
                 and isinstance(n.optional_vars, ast.Name)}
        removed = {n.args[0].id for n in nodes if isinstance(n, ast.Call) and self._resolve(n.func) == "shutil.rmtree"
                   and n.args and isinstance(n.args[0], ast.Name)}
        bindings = [(targets, isinstance(a.value, ast.Call) and self._resolve(a.value.func) in PRIVATE_TEMPS
                     and not kept_run_folder(self._resolve(a.value.func), _dir_given(a.value), bool(targets & removed)),
                     {n.id for n in walk(a.value) if isinstance(n, ast.Name)})
                    for a in nodes if isinstance(a, ast.Assign)
                    for targets in [{t.id for t in a.targets if isinstance(t, ast.Name)}]]
        return temp_names(seeds, bindings)

    def _write(self, call: ast.Call, how: str, guarded: bool, ordered: bool, target: Optional[ast.AST] = None) -> None:
        if target is not None and self.temps and any(
                isinstance(n, ast.Name) and n.id in self.temps for n in walk(target)):
            return  # in this process's own temporary folder: not a file the ranks share
        self.scope.kinds.add(WRITE)
        if isinstance(target, ast.Name) and target.id in self.names.handles or (
                isinstance(target, ast.Call) and self._resolve(target.func) == "open"):
            return  # `json.dump(x, f)`, `json.dump(x, open(p, "w"))`: the site is where the file is opened
        if target is not None:
            self.scope.written |= {n.id for n in walk(target) if isinstance(n, ast.Name) and n.id in self.params}
        text = None
        if target is not None:
            try:
                text = ast.unparse(target)
            except Exception:  # pragma: no cover - ast.unparse handles every parsed node
                text = None
        self.scope.writes.append(Write(self.path, call.lineno, how, text, guarded, ordered))

    def _call(self, call: ast.Call, guarded: bool, ordered: bool) -> bool:
        """Records what `call` does; True when its arguments need no further reading."""
        kinds = self.scope.kinds
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "numpy" and not call.args:
            kinds.add(NUMPY)  # (a tensor's `.numpy()`: no effect outside, but bf16 has no numpy dtype)
        runtime = self._runtime(func)
        if runtime is not None:
            if runtime == "main_only" and call.args:
                inner = ast.Call(func=call.args[0], args=call.args[1:], keywords=call.keywords)
                ast.copy_location(inner, call)
                self._call(inner, True, ordered)
                for a in call.args[1:]:
                    self._expr(a, guarded, ordered)
                for k in call.keywords:
                    self._expr(k.value, guarded, ordered)
                return True
            if runtime in _MAIN_ONLY:
                if runtime == "save":
                    self._write(call, "tm.save", True, ordered, _arg(call, 1, "f"))
                else:
                    kinds.add(OUTPUT)
                return False
            if runtime in _COLLECTIVE_NAMES:
                kinds.add(COLLECTIVE)
            return False
        name = self._resolve(func) or ""
        last = func.attr if isinstance(func, ast.Attribute) else name
        # a program function, class or method first
        target = self._target(func)
        if target is not None:
            owner = (_dotted(func) or "").rpartition(".")[0]
            self.scope.calls.append(Call(target, guarded or owner in self.names.nulls, _dotted(func) or "",
                                         call.lineno, ordered, self._exists > 0))
            return False
        if name == "open" or (name.endswith(".open") and isinstance(func, ast.Attribute) and name != "PIL.Image.open"):
            if _opens_for_writing(call, self.modes):
                # `codecs.open(p, "w")`, `gzip.open(p, "wb")`: a module's open takes the path first;
                # `Path(p).open("w")` is the path's own
                module = name != "open" and isinstance(func.value, ast.Name) and func.value.id in self.aliases \
                    and func.value.id not in self.locals and func.value.id not in self.params
                self._write(call, "open", guarded, ordered,
                            _arg(call, 0, "filename" if module else "file") if name == "open" or module else func.value)
            else:
                kinds.add(READ)
            return False
        if name in _WRITERS or (name == "logging.basicConfig" and any(k.arg == "filename" for k in call.keywords)):
            where = {"json.dump": 1, "pickle.dump": 1, "yaml.dump": 1, "yaml.safe_dump": 1, "torch.save": 1,
                     "joblib.dump": 1, "torchvision.utils.save_image": 1, "shutil.copy": 1, "shutil.copyfile": 1,
                     "shutil.copy2": 1, "shutil.copytree": 1, "shutil.move": 1, "os.symlink": 1,
                     "os.link": 1}.get(name, 0)
            if name == "wandb.init" and any(k.arg == "mode" and rank_test(k.value) for k in call.keywords):
                guarded = True  # `mode=None if tm.is_main() else "disabled"`: a run on the main process only
            self._write(call, name, guarded, ordered, _arg(call, where, "filename" if name == "logging.basicConfig" else None))
            if name == "logging.basicConfig":
                kinds.add(OUTPUT)
            return False
        if name in SHELL_RUNNERS and call.args and shell_command_writes(_leading_text(call.args[0])):
            self._write(call, name, guarded, ordered, None)  # `os.system("cp main.py " + out)`
            return False
        if self._writer_class(func, name):
            self._write(call, last, guarded, ordered, _arg(call, 0, "log_dir"))
            return False
        if name in _MKDIRS or (isinstance(func, ast.Attribute) and func.attr == "mkdir"):
            kinds.add(MKDIR)
            return False
        if isinstance(func, ast.Attribute):
            receiver = _dotted(func.value)
            if receiver in self.names.handles or receiver in self.names.writers:
                kinds.add(WRITE)  # a write into a file whose site is where it was opened
                return False
            if func.attr in _WRITE_METHODS and call.args and receiver not in self.names.instances:
                self._write(call, f".{func.attr}", guarded, ordered, _arg(call, 0, "path"))
                return False
            if (func.attr in PATH_WRITES and not call.args or func.attr in PATH_LINKS and call.args) \
                    and receiver not in self.names.instances:
                # `Path(flag).touch()`, `Path(flag).unlink()`, `Path(latest).symlink_to(ckpt)`:
                # the file is the receiver's
                self._write(call, f".{func.attr}", guarded, ordered, func.value)
                return False
        if name in _OUTPUTS or name.startswith(_OUTPUT_PREFIXES) or (
                isinstance(func, ast.Attribute) and func.attr in _LOG_METHODS and "log" in (_dotted(func.value) or "").lower()):
            kinds.add(OUTPUT)
            return False
        if name in READERS or name.startswith(READ_PREFIXES):
            kinds.add(READ)
            return False
        if name.startswith(_RANDOM_PREFIXES) or (name.startswith("torch.") and name.rsplit(".", 1)[-1] in _TORCH_RANDOM):
            kinds.add(RANDOM)
            return False
        if name in _CLOCK:
            kinds.add(CLOCK)
            return False
        if name.startswith("torch.distributed.") and last in _COLLECTIVE_NAMES:
            kinds.add(COLLECTIVE)
            return False
        if name in ("torch.autograd.backward", "torch.autograd.grad") or (
                isinstance(func, ast.Attribute) and (func.attr in _TRAIN_METHODS
                                                     or func.attr == "step" and "sched" not in (_dotted(func.value) or ""))):
            kinds.add(TRAIN)
            return False
        if isinstance(func, ast.Name):
            if func.id in self.params or (func.id in self.locals and func.id not in _BUILTINS):
                kinds.add(CALLS)  # `model(x)`, `fn()`: code handed in
            return False
        if isinstance(func, ast.Attribute):
            root = func.value
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(root, ast.Name):
                if func.attr in _MUTATORS and (root.id == "self" or root.id in self.params):
                    kinds.add(STATE)
                elif (root.id == "self" and isinstance(func.value, ast.Attribute) and func.attr not in _QUERIES) or (
                        root.id in self.params and func.value is root and func.attr in ("forward", "__call__")):
                    kinds.add(CALLS)  # `self.model(x)`, `self.net.encode(x)`: maybe a forward
            if isinstance(func.value, ast.Attribute) and _dotted(func.value) and _dotted(func.value).startswith("self.") \
                    and func.attr not in _MUTATORS and func.attr not in _QUERIES:
                kinds.add(CALLS)
        return False

    def _target(self, func: ast.AST) -> Optional[Target]:
        """The program's function, class or method a call names, if any."""
        name = _dotted(func)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if not rest:
            if head in self.locals or head in self.params:
                return None
            if head in self.bindings and self.bindings[head][1] is not None:
                module, symbol = self.bindings[head]
                return ("symbol", module, symbol)
            return ("symbol", self.path, head) if head in self.own else None
        if head == "self" and self.klass is not None and "." not in rest:
            return ("method", self.path, self.klass, rest)
        owner, _, method = name.rpartition(".")
        if owner in self.names.instances:
            module, klass = self.names.instances[owner]
            return ("instance", module, klass, method)
        if head in self.bindings and self.bindings[head][1] is None and "." not in rest \
                and head not in self.locals and head not in self.params:
            return ("symbol", self.bindings[head][0], rest)
        return None


def _opens_for_writing(call: ast.Call, modes: Optional[Dict[str, str]] = None) -> bool:
    """`open(p, "w")`, `Path(p).open("w")`, `gzip.open(p, "wb")`, `open(p, open_type)` with a mode
    variable of `modes` (`open_modes`)."""
    mode = call.args[1] if len(call.args) >= 2 else None
    if isinstance(call.func, ast.Attribute) and call.func.attr == "open":  # `Path(p).open("w")`, `gzip.open(p, "wb")`
        mode = call.args[0] if call.args and isinstance(call.args[0], ast.Constant) and isinstance(
            call.args[0].value, str) and len(call.args[0].value) <= 3 else mode
    for k in call.keywords:
        if k.arg == "mode":
            mode = k.value
    return writes(mode_of_ast(mode, modes))


def _arg(call: ast.Call, position: int, keyword: Optional[str]) -> Optional[ast.AST]:
    for k in call.keywords:
        if keyword is not None and k.arg == keyword:
            return k.value
    plain = [a for a in call.args if not isinstance(a, ast.Starred)]
    return plain[position] if position < len(plain) else None


# --- the program ----------------------------------------------------------------------------

Key = Tuple[str, str]  # (module path, "f" / "Cls.m" / "<module>")


@dataclass
class ProgramEffects:
    """Effects of every scope of the program, through its calls."""

    summaries: Dict[str, ModuleSummary]
    kinds: Dict[Key, FrozenSet[str]] = field(default_factory=dict)
    # program classes built from a library writer (a `SummaryWriter` subclass), through their bases
    writer_classes: Set[Tuple[str, str]] = field(default_factory=set)
    # each call of each scope, in order: (the keys it reaches, whether it runs on the main
    # process only or under `main_process_first`, the callee as spelled)
    edges: Dict[Key, List[Tuple[List[Key], bool, str]]] = field(default_factory=dict)

    def of(self, path: str, qual: str) -> FrozenSet[str]:
        return self.kinds.get((path, qual), frozenset())


def combine(summaries: Iterable[ModuleSummary]) -> ProgramEffects:
    """Follows every call into the program's functions, methods and classes, to a fixpoint."""
    found = ProgramEffects({s.path: s for s in summaries})
    mods = found.summaries
    found.writer_classes = {(p, c) for p, s in mods.items() for c in s.classes if _writer_base(mods, p, c, set())}
    direct: Dict[Key, Set[str]] = {}
    for p, s in mods.items():
        for qual, scope in s.scopes.items():
            key = (p, qual)
            direct[key] = set(scope.kinds)
            found.edges[key] = []
            for call in scope.calls:
                reached, writes = _resolve(mods, found.writer_classes, call.target)
                if writes:
                    direct[key].add(WRITE)
                if not reached and _attribute_call(mods, call.target):
                    direct[key].add(CALLS)
                found.edges[key].append((reached, call.guarded or call.ordered, call.spelled))
    kinds = {k: set(v) for k, v in direct.items()}
    changed = True
    while changed:
        changed = False
        for key, calls in found.edges.items():
            for reached, _, _ in calls:
                for r in reached:
                    extra = kinds.get(r, set()) - kinds[key]
                    if extra:
                        kinds[key] |= extra
                        changed = True
    found.kinds = {k: frozenset(v) for k, v in kinds.items()}
    return found


def _mro(mods: Dict[str, ModuleSummary], path: str, klass: str, seen: Set[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """The class and its program bases, depth first (Python's order for single inheritance)."""
    if (path, klass) in seen or path not in mods or klass not in mods[path].classes:
        return []
    seen.add((path, klass))
    out = [(path, klass)]
    for base in mods[path].classes[klass]:
        if base[0] == "class":
            out += _mro(mods, base[1], base[2], seen)
    return out


def _writer_base(mods: Dict[str, ModuleSummary], path: str, klass: str, seen: Set[Tuple[str, str]]) -> bool:
    if (path, klass) in seen or path not in mods or klass not in mods[path].classes:
        return False
    seen.add((path, klass))
    for base in mods[path].classes[klass]:
        if base[0] == "library" and (base[1].rsplit(".", 1)[-1] in _WRITER_CLASS_NAMES or base[1] in _WRITER_CLASSES):
            return True
        if base[0] == "class" and _writer_base(mods, base[1], base[2], seen):
            return True
    return False


def _attribute_call(mods: Dict[str, ModuleSummary], target: Target) -> bool:
    """`self.G(x)` in a class of the program (deriving from nothing but `nn.Module` and the
    program's classes) that defines no method `G`: a call of what an attribute holds, a model
    most likely (a forward, which must run on every rank)."""
    if target[0] != "method" or target[3] in _MODULE_API:
        return False
    for p, c in _mro(mods, target[1], target[2], set()):
        if any(base[0] == "library" and base[1].rsplit(".", 1)[-1] not in ("Module", "object")
               for base in mods[p].classes[c]):
            return False  # a method the library base may define (`self.log(...)`)
    return True


def _method(mods: Dict[str, ModuleSummary], path: str, klass: str, method: str) -> List[Key]:
    for p, c in _mro(mods, path, klass, set()):
        if method in mods[p].methods.get(c, ()):
            return [(p, f"{c}.{method}")]
    return []


def _resolve(mods: Dict[str, ModuleSummary], writers: Set[Tuple[str, str]], target: Target) -> Tuple[List[Key], bool]:
    """The scopes a call reaches, and whether it writes by itself (it builds, or calls a method
    of, a class derived from a library writer)."""
    kind, path = target[0], target[1]
    s = mods.get(path)
    if s is None:
        return [], False
    if kind == "symbol":
        name = target[2]
        if name in s.functions:
            return [(path, name)], False
        if name in s.classes:
            return _method(mods, path, name, "__init__"), (path, name) in writers
        return [], False
    klass, method = target[2], target[3]
    if klass not in s.classes:
        return [], False
    reached = _method(mods, path, klass, method)
    return reached, not reached and (path, klass) in writers  # `self.add_scalar(...)` of a SummaryWriter


# --- questions ------------------------------------------------------------------------------

def first_run_builders(effects: ProgramEffects) -> Set[Key]:
    """Functions that write files and that the program calls only when a file or folder is
    missing (`if not os.path.isdir(out): build_features(raw, out)`): first-run builders. TM505
    puts each such call, with its test, under `main_process_first`; their writes are not
    guarded one by one (a rank could see a half-written folder)."""
    calls: Dict[Key, List[bool]] = {}
    for key, scope_calls in ((k, effects.summaries[k[0]].scopes[k[1]].calls) for k in effects.edges):
        for (reached, _, _), call in zip(effects.edges[key], scope_calls):
            for r in reached:
                calls.setdefault(r, []).append(call.first_run and not call.guarded)
    return {k for k, firsts in calls.items() if firsts and all(firsts) and WRITE in effects.kinds.get(k, ())
            and not effects.kinds.get(k, frozenset()) & {COLLECTIVE, TRAIN, CALLS}}


def reached_unguarded(effects: ProgramEffects) -> Set[Key]:
    """The scopes that some path runs on every rank at once: every module body (imports run
    everywhere), functions nothing in the program calls (a launcher, a callback: assume every
    rank), and what they call outside rank guards and `main_process_first` blocks."""
    called: Set[Key] = {r for calls in effects.edges.values() for reached, _, _ in calls for r in reached}
    todo = [k for k in effects.edges if k[1] == MODULE_SCOPE or k not in called]
    seen = set(todo)
    while todo:
        key = todo.pop()
        for reached, guarded, _ in effects.edges.get(key, ()):
            if guarded:
                continue
            for r in reached:
                if r not in seen:
                    seen.add(r)
                    todo.append(r)
    return seen


def unguarded_writes(effects: ProgramEffects) -> List[Write]:
    """The write sites that run on every rank: not guarded where they are, not ordered under
    `main_process_first`, in a scope some path reaches on every rank. A file name that holds the
    rank (`f"log_{rank}.txt"`) is each rank's own and is left out."""
    reached = reached_unguarded(effects)
    out = []
    for path, s in effects.summaries.items():
        for qual, scope in s.scopes.items():
            if (path, qual) not in reached:
                continue
            out += [w for w in scope.writes if not w.guarded and not w.ordered and not _per_rank(w.target)]
            out += [Write(path, c.line, c.spelled) for c in scope.calls if not c.guarded and not c.ordered
                    and c.target[0] == "symbol" and (c.target[1], c.target[2]) in effects.writer_classes]
    return sorted(set(out), key=lambda w: (w.path, w.line, w.how))


def _per_rank(target: Optional[str]) -> bool:
    return bool(target) and "rank" in target.lower()


# --- from the build ------------------------------------------------------------------------

def bindings_of(imports: Dict[str, Tuple[Path, Optional[str]]]) -> Bindings:
    """`facts._Module.imports` as plain strings (picklable, for the workers)."""
    return {local: (str(path), symbol) for local, (path, symbol) in imports.items()}


def written_arguments(effects: ProgramEffects, path: str) -> Dict[str, Tuple[FrozenSet[int], FrozenSet[str]]]:
    """For `ModuleView.call_writes`: "<scope>|<callee as spelled>" -> the positions and keywords
    of the call's arguments that name a file the function it reaches writes
    (`write_results(results, path)`: position 1, keyword "path")."""
    out: Dict[str, Tuple[FrozenSet[int], FrozenSet[str]]] = {}
    s = effects.summaries.get(path)
    if s is None:
        return out
    for qual, scope in s.scopes.items():
        for (reached, _, spelled), call in zip(effects.edges.get((path, qual), ()), scope.calls):
            for r in reached:
                callee = effects.summaries[r[0]].scopes.get(r[1])
                if callee is None or not callee.written:
                    continue
                params = callee.params[1:] if call.target[0] != "symbol" or r[1].endswith(".__init__") \
                    else callee.params
                out[f"{qual}|{spelled}"] = (frozenset(i for i, p in enumerate(params) if p in callee.written),
                                            frozenset(callee.written))
    return out


def spelled_effects(effects: ProgramEffects, path: str) -> Dict[str, FrozenSet[str]]:
    """For `ModuleView.call_effects`: "<scope>|<callee as spelled>" -> the effects of the
    program code that call reaches (with the write of a library writer it builds)."""
    out: Dict[str, FrozenSet[str]] = {}
    s = effects.summaries.get(path)
    if s is None:
        return out
    for qual, scope in s.scopes.items():
        for (reached, _, spelled), call in zip(effects.edges.get((path, qual), ()), scope.calls):
            kinds: Set[str] = set()
            for r in reached:
                kinds |= effects.kinds.get(r, frozenset())
            if _resolve(effects.summaries, effects.writer_classes, call.target)[1]:
                kinds.add(WRITE)
            if reached or kinds:
                key = f"{qual}|{spelled}"
                out[key] = frozenset(kinds | out.get(key, frozenset()))
    return out


def kept_run_folder(func: Optional[str], dir_given: bool, removed: bool) -> bool:
    """`run_path = tempfile.mkdtemp(prefix=run_id, dir=experiment_dir)`: a folder with a fresh
    name made inside the program's own output folder and never removed is the run's output
    folder, not a private scratch folder: the ranks must share one (rank 0's), and only the main
    process writes into it. A `mkdtemp()` in the system's temporary folder, or one removed again
    (`shutil.rmtree(tmp)`), is each process's own."""
    return func == "tempfile.mkdtemp" and dir_given and not removed


def _dir_given(call: ast.Call) -> bool:
    """`mkdtemp(suffix, prefix, dir)`: the folder is named (keyword or third positional)."""
    return len(call.args) >= 3 or any(k.arg == "dir" for k in call.keywords)


def temp_names(seeds: Set[str], bindings: List[Tuple[Set[str], bool, Set[str]]]) -> Set[str]:
    """The names of a scope bound to a temporary file or folder its process made for itself:
    `seeds` (`with tempfile.TemporaryDirectory() as tmp`), then, to a fixpoint, the targets of each
    binding (targets, whether its value makes one, the names its value reads) that makes one
    (`tmp = tempfile.mkdtemp()`) or reads a name already found (`config = os.path.join(tmp,
    "task.xml")`). Shared by the program's effects (`ast`) and the rules' `writes` (LibCST)."""
    found = set(seeds)
    changed = True
    while changed:
        changed = False
        for targets, made, reads in bindings:
            if targets and not targets <= found and (made or reads & found):
                found |= targets
                changed = True
    return found


# the `ModuleView` fields that `of_module` fills in: from the module's classes alone (cheap), and
# from the effects of its code (a whole reading of it)
CLASS_FIELDS = frozenset({"base_wraps", "wrapped_attrs", "self_trained", "wrapped_where_made"})
EFFECT_FIELDS = frozenset({"rebatching_collates", "endless_generators", "call_effects", "writer_classes",
                           "call_writes", "first_run_builders"})
OWN_FIELDS = CLASS_FIELDS | EFFECT_FIELDS


def of_module(source: str, path: str):
    """The `ModuleView` fields from `program.effects` of a module processed without its
    program (stdin, a fixture, `--no-follow`): its own functions, methods and classes only."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}
    return {**class_fields(tree, path), **effect_fields(tree, path)}


def class_fields(tree: ast.Module, path: str) -> Dict[str, object]:
    """`CLASS_FIELDS` of a module alone."""
    return inherited.of_tree(tree, Path(path))


def effect_fields(tree: ast.Module, path: str) -> Dict[str, object]:
    """`EFFECT_FIELDS` of a module alone."""
    found = combine([summarize(tree, path, {})])
    return {"rebatching_collates": collates.rebatching(n for n in walk(tree) if isinstance(n, _FUNCS)),
            "endless_generators": endless_generators(tree),
            "call_effects": spelled_effects(found, path),
            "writer_classes": frozenset(c for _, c in found.writer_classes),
            "call_writes": written_arguments(found, path),
            "first_run_builders": frozenset(q for _, q in first_run_builders(found))}


def summarize_source(source: str, path: str, bindings: Bindings, entry: bool = True) -> Optional[ModuleSummary]:
    """`summarize` of a source text (a migrated module), None where it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return summarize(tree, path, bindings, entry)

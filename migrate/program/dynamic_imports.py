"""Modules a program loads by name at run time: `importlib.import_module(...)`, `__import__(...)`,
`pydoc.locate(...)`, Hydra's `instantiate(cfg.model)`, a file loaded with
`importlib.util.spec_from_file_location(name, path)`.

Config-driven programs ("pytorch-template" style) name their trainer, model and data modules in
JSON/YAML/TOML files and load them with `importlib.import_module(cfg["trainer"]["module"])` and
`getattr(module, cfg["type"])`; those modules are as much the program as an imported one. Each
call site is one of:

- `literal`: the name is written in the code (`import_module("models.resnet")`, also through a
  name assigned once, or each name of a `for name in ("a.b", "c.d")` loop);
- `prefix`: the name is a literal package plus a run-time part (`import_module("models." +
  args.arch)`, `f"models.{cfg.arch}"`): the modules of that package;
- `runtime`: nothing of the name is in the code: the project's configuration files say which
  modules the program may load (their dotted string values that name the project's modules).

What cannot be resolved is said in the report ("Not followed", with `file:line`), never silently
passed over.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set

from torchmigrate.program.fs import FileSystem
from torchmigrate.program.project import MAX_CONFIG_BYTES, Project
from torchmigrate.program.search_path import Paths, dotted_name
from torchmigrate.program.astwalk import walk

# qualified callees whose first argument names a module (or `module.attribute`) to load
BY_NAME = frozenset({"importlib.import_module", "__import__", "pydoc.locate", "importlib.__import__"})
# qualified callees that load what a configuration object names (`_target_: models.net.Net`)
BY_CONFIG = frozenset({"hydra.utils.instantiate", "hydra.utils.call", "hydra.utils.get_class",
                       "hydra.utils.get_method", "hydra.utils.get_object"})
BY_FILE = frozenset({"importlib.util.spec_from_file_location"})
# what a dotted string in a configuration file never ends in when it names a module or a class
FILE_SUFFIXES = frozenset({
    "json", "yaml", "yml", "toml", "cfg", "ini", "txt", "csv", "tsv", "py", "pt", "pth", "ckpt", "bin", "npy",
    "npz", "pkl", "pickle", "h5", "hdf5", "png", "jpg", "jpeg", "gif", "bmp", "tif", "tiff", "wav", "mp3", "flac",
    "mp4", "log", "md", "tar", "gz", "zip", "tgz", "onnx", "safetensors", "xml", "html", "sh", "jsonl", "parquet",
    "lmdb", "mat", "svg", "pdf", "bz2", "xz",
})
MAX_CONFIG_FILES = 500  # the nearest to the project root (the walk is breadth first)
_DOTTED = re.compile(r"(?<![\w./\\-])[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?![\w/\\-])")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Site:
    """One call that loads a module by name."""

    line: int
    kind: str  # "literal", "prefix", "runtime" or "file"
    names: tuple = ()  # literal: the module names; prefix: the package's dotted name
    text: str = ""  # the call as written (for the report)
    path: Optional[Path] = None  # kind "file": the file it loads


@dataclass
class Loads:
    """What one module says about the modules its program loads by name."""

    sites: List[Site]
    # dotted names written as texts anywhere in it (`parser.add_argument("--trainer",
    # default="engines.sgd")`, a Python config's `dict(module="models.net")`): like the
    # configuration files' texts, candidates for what a run-time name loads
    names: Set[str]


def scan(tree: ast.Module, module: Path, cwd: Path) -> Loads:
    """The module's calls that load a module by name, and the dotted texts it writes."""
    aliases = _aliases(tree)
    out: List[Site] = []
    names: Set[str] = set()
    literals: Optional[_Literals] = None
    for node in walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _names_a_module(node.value):
            names.add(node.value)
        if not isinstance(node, ast.Call):
            continue
        callee = _qualified(node.func, aliases)
        if callee not in BY_NAME and callee not in BY_CONFIG and callee not in BY_FILE:
            continue
        text = _shorten(ast.unparse(node))
        if callee in BY_FILE:
            where = Paths(tree, module, cwd).of(node.args[1]) if len(node.args) > 1 else None
            out.append(Site(node.lineno, "file", text=text, path=where))
            continue
        arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg in ("name", "path")), None)
        if callee in BY_CONFIG or arg is None:
            out.append(Site(node.lineno, "runtime", text=text))
            continue
        literals = literals or _Literals(tree)
        written = literals.of(arg)
        if written:
            package = _package_argument(node)
            loaded = (_absolute(n, package) for n in written)
            out.append(Site(node.lineno, "literal", tuple(n for n in loaded if n), text))
            continue
        prefix = _literal_prefix(_assigned_once(tree, arg))
        if prefix and prefix.endswith(".") and _DOTTED.fullmatch(prefix[:-1] + ".x"):
            out.append(Site(node.lineno, "prefix", (prefix[:-1],), text))
        else:
            out.append(Site(node.lineno, "runtime", text=text))
    return Loads(out, names)


def _names_a_module(text: str) -> bool:
    """`trainer.trainer`, `models.net.Net`: a dotted name, not a file name (`data.csv`)."""
    return bool(_DOTTED.fullmatch(text)) and text.rsplit(".", 1)[-1].lower() not in FILE_SUFFIXES


def _shorten(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _aliases(tree: ast.Module) -> Dict[str, str]:
    """Local name -> qualified name, for the modules this file imports."""
    out: Dict[str, str] = {}
    for node in walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _qualified(func: ast.AST, aliases: Dict[str, str]) -> str:
    name = dotted_name(func) or ""
    head, _, rest = name.partition(".")
    if head in aliases:
        return aliases[head] + ("." + rest if rest else "")
    return name


def _package_argument(call: ast.Call) -> Optional[str]:
    """`import_module(".resnet", package="models")`: the package a relative name is taken from
    (`__package__`/`__name__` as written: the importing module's own)."""
    arg = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "package"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name) and arg.id in ("__package__", "__name__"):
        return "__package__"
    return None


def _absolute(name: str, package: Optional[str]) -> str:
    """`..x` taken from the package named in the call, as `importlib` does; a relative name
    taken from the importing module's own package stays relative (the graph resolves it)."""
    if not name.startswith(".") or not package or package == "__package__":
        return name
    level = len(name) - len(name.lstrip("."))
    parts = package.split(".")
    if level > len(parts):
        return ""
    return ".".join([*parts[: len(parts) - level + 1], name.lstrip(".")]).strip(".")


def _assigned_once(tree: ast.Module, node: ast.AST) -> ast.AST:
    """What a name passed to the loader holds where the module assigns it exactly once
    (`spec_path = ".".join(["model", tdir, recommender])`), else `node` itself."""
    if not isinstance(node, ast.Name):
        return node
    values = [n.value for n in walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1
              and isinstance(n.targets[0], ast.Name) and n.targets[0].id == node.id]
    return values[0] if len(values) == 1 else node


def _literal_prefix(node: ast.AST) -> Optional[str]:
    """`"models." + arch`, `f"models.{arch}"` or `".".join(["models", kind, arch])`: the literal
    text before the run-time part."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = node.left
        while isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add):
            left = left.left
        return left.value if isinstance(left, ast.Constant) and isinstance(left.value, str) else None
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str) \
            and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple)) and node.args[0].elts \
            and isinstance(node.args[0].elts[0], ast.Constant) and isinstance(node.args[0].elts[0].value, str):
        return node.args[0].elts[0].value + node.func.value.value  # `".".join(["model", tdir, name])`
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format" \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str):
        return node.func.value.value.split("{", 1)[0]
    return None


class _Literals:
    """The texts an expression can only be: a literal, a name assigned once from literals in
    the module, or the target of a `for` loop over a literal list or tuple of texts."""

    def __init__(self, tree: ast.Module) -> None:
        self.values: Dict[str, List[Optional[tuple]]] = {}
        for node in walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.values.setdefault(target.id, []).append(_texts(node.value))
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                items = node.iter
                texts = tuple(t for e in items.elts for t in (_texts(e) or (None,))) \
                    if isinstance(items, (ast.List, ast.Tuple)) else None
                self.values.setdefault(node.target.id, []).append(texts if texts and None not in texts else None)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and isinstance(node.target, ast.Name):
                self.values.setdefault(node.target.id, []).append(None)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                    self.values.setdefault(arg.arg, []).append(None)  # a parameter: the caller decides

    def of(self, node: ast.AST) -> Optional[tuple]:
        direct = _texts(node)
        if direct:
            return direct
        if isinstance(node, ast.Name):
            bound = self.values.get(node.id, [])
            if len(bound) == 1 and bound[0]:
                return bound[0]
        return None


def _texts(node: ast.AST) -> Optional[tuple]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value,)
    return None


# --- what the configuration names --------------------------------------------------------------

def config_strings(project: Project, fs: FileSystem) -> "ConfigStrings":
    """The dotted names and plain words written in the project's configuration files."""
    dotted: Dict[str, Path] = {}
    words: Set[str] = set()
    for path in project.config_files()[:MAX_CONFIG_FILES]:
        data = fs.read(path)
        if not data or len(data) > MAX_CONFIG_BYTES:
            continue
        text = data.decode("utf-8", "replace")
        for match in _DOTTED.finditer(text):
            if _names_a_module(match.group(0)):
                dotted.setdefault(match.group(0), path)
        words.update(_WORD.findall(text))
    return ConfigStrings(dotted, words)


@dataclass
class ConfigStrings:
    dotted: Dict[str, Path]  # `trainer.trainer`, `models.net.Net` -> the file that names it first
    words: Set[str]  # every identifier-like word (`resnet18` for `"arch": "resnet18"`)

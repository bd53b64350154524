"""Where a program finds its modules besides the entry script's folder and the project root.

Python finds a module through `sys.path`; a project puts its own folders there in a few ways,
and a program build must follow each, or the solver, trainer or checkpoint helpers in those
folders are never migrated while the report says the program is done:

- the code edits `sys.path` (`sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))`,
  `sys.path.append(str(Path(__file__).resolve().parents[1] / "lib"))`, `site.addsitedir(...)`),
  in the entry or in a module it imports (`code_dirs`);
- the code imports the entry's own folder by name (`from src.models import Net` in
  `src/train.py`): it is run from the folder above (`python -m src.train`: `run_from_dirs`);
- a launch file sets `PYTHONPATH` (`PYTHONPATH=src python train.py` in a shell script or a
  Makefile recipe, `export PYTHONPATH=$PWD/src` in the README or an sbatch file: `launch_dirs`);
- the project keeps its packages under `src/` (`src_layout`) or is installed in place
  (`pip install -e .`) from a setup.py, setup.cfg or pyproject.toml that says where its packages
  are (`installed_packages`: a base folder such as `src`, or a package name mapped to a folder).

Only folders inside the project count: the standard library and installed packages are not
part of the program.
"""

from __future__ import annotations

import ast
import configparser
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from torchmigrate.program.fs import FileSystem
from torchmigrate.program.project import Project
from torchmigrate.program.astwalk import walk


def dotted_name(node: ast.AST) -> Optional[str]:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


# --- sys.path edits in the code ---------------------------------------------------------------

def code_dirs(tree: ast.Module, module: Path, cwd: Path) -> List[Path]:
    """Folders the module adds with `sys.path.append(...)`/`insert(i, ...)`/`extend([...])`,
    `sys.path += [...]` or `site.addsitedir(...)`, where the path is a literal or built from
    `__file__` (`os.path.dirname/abspath/join`, `Path(...).parent`, `.parents[n]`, `/`, f-strings,
    module-level names assigned once). A relative literal is taken from `cwd`, the folder the
    program runs from (the entry script's)."""
    own = {f.name for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: List[Tuple[Optional[ast.Call], List[ast.AST]]] = []  # in walk order: (a call of `own`, or the paths added)
    for node in walk(tree):
        args: List[ast.AST] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in own:
            found.append((node, []))  # (`add_path(lib_path)`, where the function adds its argument)
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            owner = dotted_name(node.func.value)
            if owner == "sys.path" and node.func.attr in ("append", "insert"):
                args = [node.args[-1]]
            elif owner == "sys.path" and node.func.attr == "extend":
                args = _elements(node.args[0])
            elif owner == "site" and node.func.attr == "addsitedir":
                args = [node.args[0]]
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and dotted_name(node.target) == "sys.path":
            args = _elements(node.value)
        if args:
            found.append((None, args))
    # the functions that add a parameter: read only where some edit adds a bare name (`path`)
    adders = _path_adders(tree) if any(isinstance(a[-1], ast.Name) for call, a in found if call is None) else {}
    values: Optional[Paths] = None  # built only for a module that edits the path
    out: List[Path] = []
    for call, args in found:
        if call is not None:
            index = adders.get(getattr(call.func, "id", ""))
            args = [call.args[index]] if index is not None and index < len(call.args) else []
        for arg in args:
            values = values or Paths(tree, module, cwd)
            folder = values.of(arg)
            if folder is not None:
                out.append(Path(os.path.normpath(folder)))
    return out


def _path_adders(tree: ast.Module) -> Dict[str, int]:
    """The module's functions that add a parameter to `sys.path` (`_init_paths.py`'s `def
    add_path(path): if path not in sys.path: sys.path.insert(0, path)`), with its position:
    their calls (`add_path(osp.join(this_dir, '..', 'lib'))`) add that folder."""
    out: Dict[str, int] = {}
    for func in tree.body:
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in func.args.args]
        for node in walk(func):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                    and dotted_name(node.func.value) == "sys.path" and node.func.attr in ("append", "insert") \
                    and isinstance(node.args[-1], ast.Name) and node.args[-1].id in params:
                out[func.name] = params.index(node.args[-1].id)
    return out


def run_from_dirs(statements: List[ast.stmt], cwd: Path, levels: int) -> List[Path]:
    """The folder above the entry's own folder (or one of its `levels` parents) where the code
    imports that folder by name: `src/train.py` with `from src.models import Net` runs only as
    `python -m src.train` (or with PYTHONPATH) from the folder that holds `src`, so that folder
    is on its path as surely as a `sys.path` edit would put it there."""
    folders = {f.name: f.parent for f in (cwd, *list(cwd.parents)[:levels]) if f.name}
    tops = set()
    for node in statements:
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return [folders[top] for top in sorted(tops) if top in folders]


def _elements(node: ast.AST) -> List[ast.AST]:
    return list(node.elts) if isinstance(node, (ast.List, ast.Tuple)) else []


class Paths:
    """The file-system path an expression of a module stands for, where it is known statically."""

    def __init__(self, tree: ast.Module, module: Path, cwd: Path) -> None:
        self.module = module
        self.cwd = cwd
        self.names: Dict[str, ast.AST] = {}  # module-level names assigned exactly once
        counts: Dict[str, int] = {}
        for node in walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        counts[target.id] = counts.get(target.id, 0) + 1
                        if node.value is not None and not isinstance(node, ast.AugAssign):
                            self.names[target.id] = node.value
        self.names = {k: v for k, v in self.names.items() if counts.get(k) == 1}
        self._busy: set = set()

    def of(self, node: ast.AST) -> Optional[Path]:
        """The folder, absolute: a relative text (`".."`) is taken from the folder the program runs in."""
        value = self._value(node)
        return self._path(value) if isinstance(value, Path) or (isinstance(value, str) and value) else None

    def _value(self, node: ast.AST):
        """A Path for paths, a str for other text, None when unknown."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return self.module
            if node.id in self.names and node.id not in self._busy:
                self._busy.add(node.id)
                try:
                    return self._value(self.names[node.id])
                finally:
                    self._busy.discard(node.id)
            return None
        if isinstance(node, ast.JoinedStr):
            parts = [self._value(v.value) if isinstance(v, ast.FormattedValue) else self._value(v) for v in node.values]
            return "".join(str(p) for p in parts) if all(p is not None for p in parts) else None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Add)):
            left, right = self._value(node.left), self._value(node.right)
            if left is None or right is None:
                return None
            if isinstance(node.op, ast.Div):
                return self._path(left) / str(right)
            return str(left) + str(right) if isinstance(left, str) and isinstance(right, str) else None
        if isinstance(node, ast.Attribute) and node.attr == "parent":
            inner = self._value(node.value)
            return self._path(inner).parent if inner is not None else None
        if isinstance(node, ast.Subscript) and dotted_name(node.value) == "sys.path" and isinstance(
                node.slice, ast.Constant) and node.slice.value == 0:
            return self.cwd  # `sys.path[0]`: the folder of the script Python runs
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            inner, index = self._value(node.value.value), node.slice
            if inner is not None and isinstance(index, ast.Constant) and isinstance(index.value, int):
                parents = self._path(inner).parents
                return parents[index.value] if 0 <= index.value < len(parents) else None
            return None
        if isinstance(node, ast.Call):
            return self._call(node)
        return None

    def _path(self, value) -> Path:
        """A value as a path: a relative text is taken from the folder the program runs in."""
        path = value if isinstance(value, Path) else Path(value)
        return path if path.is_absolute() else self.cwd / path

    def _call(self, node: ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and not node.args and func.attr in ("resolve", "absolute", "expanduser"):
            inner = self._value(func.value)
            return self._path(inner) if inner is not None else None
        name = (dotted_name(func) or "").rsplit(".", 1)[-1]
        if name in ("getcwd", "cwd") and not node.args:
            return self.cwd
        if not node.args:
            return None
        values = [self._value(a) for a in node.args]
        if any(v is None for v in values):
            return None
        if name == "dirname":
            return self._path(values[0]).parent
        if name in ("abspath", "realpath", "normpath", "Path", "PurePath", "resolve", "expanduser"):
            return self._path(values[0])
        if name in ("str", "fspath"):
            return values[0]
        if name == "join" and dotted_name(func) != "str.join":
            first, *rest = values
            return self._path(first).joinpath(*[str(v) for v in rest])
        return None


# --- PYTHONPATH in launch files ----------------------------------------------------------------

_OLD_PATH = re.compile(r"\$\{PYTHONPATH[^}]*\}|\$\(PYTHONPATH\)|\$PYTHONPATH\b")
_HERE = re.compile(r"\$\{PWD\}|\$PWD\b|\$\(pwd\)|`pwd`|\$\(CURDIR\)|\$\(shell pwd\)|\$\(PWD\)")
_SCRIPT_DIR = re.compile(r"\$\(dirname\s+[\"']?\$(?:0|\{BASH_SOURCE(?:\[0\])?\})[\"']?\)")
_MAKE_ASSIGN = {"=", ":=", "::=", "?=", "+="}
_HERE_MARK, _SCRIPT_MARK = "\0here\0", "\0script\0"


def launch_dirs(project: Project, scope: Path, fs: FileSystem) -> List[Path]:
    """Folders inside `scope` that the project's launch files (shell scripts, sbatch files,
    Makefiles, the shell blocks of READMEs) put on `PYTHONPATH`, in the order found. A relative
    folder is taken from the folder the command runs in: after a `cd`, that folder; otherwise
    the launch file's own folder or the project root (the two ways such a file is run)."""
    from torchmigrate.launchers import kind_of
    from torchmigrate.launchers.shell import commands

    out: List[Path] = []
    for path in project.launch_files():
        data = fs.read(path)
        if not data or b"PYTHONPATH" not in data:
            continue
        cwd: Optional[Path] = None
        for command in commands(data.decode("utf-8", "surrogateescape"), kind_of(path) or "sh"):
            words = [w.value for w in command.words]
            if words[0] in ("cd", "pushd") and len(words) > 1 and "$" not in words[1]:
                cwd = Path(os.path.normpath((cwd or path.parent) / words[1]))
                continue
            bases = [cwd] if cwd else [path.parent, project.root]
            for value in pythonpath_values(words):
                for folder in _folders(value, bases, path.parent):
                    if _within(folder, scope) and folder not in out and fs.exists(folder):
                        out.append(folder)
    return out


def pythonpath_values(words: List[str]) -> List[str]:
    """What one command assigns to PYTHONPATH: `PYTHONPATH=src python ...`, `export
    PYTHONPATH=...`, `srun env PYTHONPATH=... python`, and a Makefile's `export PYTHONPATH := src`."""
    out = [w.split("=", 1)[1] for w in words if w.startswith(("PYTHONPATH=", "PYTHONPATH+="))]
    head = words[1:] if words[0] in ("export", "override") else words
    if len(head) > 2 and head[0] == "PYTHONPATH" and head[1] in _MAKE_ASSIGN:
        out.append(" ".join(head[2:]))
    return out


def _folders(value: str, bases: List[Path], script_dir: Path) -> List[Path]:
    value = _OLD_PATH.sub("", value)
    value = _SCRIPT_DIR.sub(_SCRIPT_MARK, _HERE.sub(_HERE_MARK, value))
    out = []
    for part in value.split(":"):
        part = part.strip()
        if not part or "$" in part or "`" in part:
            continue  # a variable only the shell knows
        if part.startswith(_SCRIPT_MARK):
            out.append(script_dir / part[len(_SCRIPT_MARK):].lstrip("/"))
            continue
        here = part.startswith(_HERE_MARK)
        part = part[len(_HERE_MARK):].lstrip("/") if here else part
        if os.path.isabs(part):
            out.append(Path(part))
        else:
            out += [base / part for base in bases]
    return [Path(os.path.normpath(p)) for p in out]


def _within(folder: Path, scope: Path) -> bool:
    return folder == scope or scope in folder.parents


# --- src/ layouts and packages installed in place ---------------------------------------------

def src_layout(project: Project) -> List[Path]:
    """`src/` at the root that is not itself a package: the project's packages live in it."""
    src = project.root / "src"
    if "src" in project.folders.get(project.root, ()) and "__init__.py" not in project.files.get(src, ()):
        return [src]
    return []


def installed_packages(root: Path, fs: FileSystem) -> Tuple[List[Path], Dict[str, Path]]:
    """Where `pip install -e .` makes the project's packages importable from, as the root's
    setup.py, setup.cfg and pyproject.toml say: base folders (`package_dir={"": "src"}`,
    `find_packages(where="src")`, `[tool.setuptools.packages.find] where = ["src"]`, poetry's
    `from = "src"`) and packages mapped to a folder of another name (`package-dir =
    {"mypkg" = "lib"}`, hatch's `packages = ["src/mypkg"]`)."""
    bases: List[str] = []
    named: Dict[str, str] = {}
    data = fs.read(root / "setup.py")
    if data:
        _from_setup_py(data, bases, named)
    data = fs.read(root / "setup.cfg")
    if data:
        _from_setup_cfg(data, bases, named)
    data = fs.read(root / "pyproject.toml")
    if data:
        _from_pyproject(data, bases, named)
    for name, folder in list(named.items()):
        if name == "":
            bases.append(folder)
            del named[name]
    folders = [Path(os.path.normpath(root / b)) for b in dict.fromkeys(bases) if b not in ("", ".")]
    return folders, {n: Path(os.path.normpath(root / f)) for n, f in named.items()}


def _from_setup_py(data: bytes, bases: List[str], named: Dict[str, str]) -> None:
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    for node in walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
        if name in ("find_packages", "find_namespace_packages"):
            where = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "where"), None)
            if isinstance(where, ast.Constant) and isinstance(where.value, str):
                bases.append(where.value)
        elif name == "setup":
            for keyword in node.keywords:
                if keyword.arg == "package_dir" and isinstance(keyword.value, ast.Dict):
                    for key, value in zip(keyword.value.keys, keyword.value.values):
                        if isinstance(key, ast.Constant) and isinstance(value, ast.Constant) \
                                and isinstance(key.value, str) and isinstance(value.value, str):
                            named[key.value] = value.value


def _from_setup_cfg(data: bytes, bases: List[str], named: Dict[str, str]) -> None:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(data.decode("utf-8", "replace"))
    except configparser.Error:
        return
    if parser.has_option("options", "package_dir"):
        for line in parser.get("options", "package_dir").splitlines():
            if "=" in line:
                key, value = (s.strip() for s in line.split("=", 1))
                named[key] = value
    if parser.has_option("options.packages.find", "where"):
        bases += parser.get("options.packages.find", "where").split()


def _from_pyproject(data: bytes, bases: List[str], named: Dict[str, str]) -> None:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    try:
        doc = tomllib.loads(data.decode("utf-8", "replace"))
    except (tomllib.TOMLDecodeError, ValueError):
        return
    setuptools = _table(doc, "tool", "setuptools")
    package_dir = setuptools.get("package-dir")
    if isinstance(package_dir, dict):
        named.update({k: v for k, v in package_dir.items() if isinstance(k, str) and isinstance(v, str)})
    packages = setuptools.get("packages")
    find = packages.get("find") if isinstance(packages, dict) else None
    where = find.get("where") if isinstance(find, dict) else None
    bases += [where] if isinstance(where, str) else [w for w in where or () if isinstance(w, str)]
    for item in _list(_table(doc, "tool", "poetry").get("packages")):
        if isinstance(item, dict) and isinstance(item.get("from"), str):
            bases.append(item["from"])
    for item in _list(_table(doc, "tool", "hatch", "build", "targets", "wheel").get("packages")):
        if isinstance(item, str) and "/" in item.strip("/"):
            folder = item.strip("/")
            named[folder.rsplit("/", 1)[-1]] = folder


def _table(doc: dict, *keys: str) -> dict:
    for key in keys:
        doc = doc.get(key) if isinstance(doc.get(key), dict) else {}
    return doc


def _list(value) -> list:
    return value if isinstance(value, list) else []

"""Entry scripts -> the project's own modules they import, transitively.

Resolution follows what Python does for a script run as `python train.py`: `sys.path[0]` is the
script's folder, so `import data` finds a sibling `data.py` (or a package `data/`), and packages
under the project root resolve from there too. Relative imports resolve against the importing
module's package. Anything that does not resolve to a file inside the project root (the standard
library, installed packages, a virtualenv inside the project) is not part of the program.
"""

from __future__ import annotations

import ast
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from torchmigrate.program.fs import SKIP_DIRS
from torchmigrate.program.fs import PLAIN, FileSystem

_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"__future__"}  # Python >= 3.10

ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")


def project_root(script: Path, fs: FileSystem = PLAIN) -> Path:
    """The nearest folder above `script` with a project marker, else the script's own folder."""
    folder = fs.resolve(script).parent
    for candidate in (folder, *folder.parents):
        if any(fs.exists(candidate / marker) for marker in ROOT_MARKERS):
            return candidate
    return folder


@dataclass
class Graph:
    """The modules of a program: every file, and for each the project files it imports."""

    modules: List[Path] = field(default_factory=list)
    imports: Dict[Path, List[Path]] = field(default_factory=dict)
    # every import statement of each module (one walk of its tree, shared with `facts`)
    statements: Dict[Path, List[ast.stmt]] = field(default_factory=dict)
    # imports that look like the project's own but resolve nowhere: module -> (line, name)
    unresolved: Dict[Path, List[Tuple[int, str]]] = field(default_factory=dict)


def _parse(path: Path, fs: FileSystem) -> Optional[ast.Module]:
    data = fs.read(path)
    if data is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(data, str(path))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None  # the engine reports it when the file is processed


def _inside(path: Path, root: Path) -> bool:
    try:
        rel = path.relative_to(root)
    except ValueError:
        return False
    return not any(part in SKIP_DIRS or part.startswith(".") for part in rel.parts[:-1])


class _Resolver:
    def __init__(self, root: Path, fs: FileSystem = PLAIN, extra: Sequence[Path] = ()) -> None:
        self.root = root
        self.fs = fs
        self.extra = tuple(extra)  # PYTHONPATH and `sys.path` folders inside the project

    def module_file(self, base: Path, dotted: str) -> Optional[Path]:
        """`a.b.c` under folder `base`: `a/b/c.py` or `a/b/c/__init__.py`."""
        parts = dotted.split(".") if dotted else []
        target = base.joinpath(*parts)
        for candidate in (target.with_name(target.name + ".py") if parts else None, target / "__init__.py"):
            if candidate is not None and self.fs.is_file(candidate):
                return self.fs.resolve(candidate)
        return None

    def absolute(self, importer: Path, dotted: str, entry_dir: Path) -> List[Path]:
        """The file for `dotted` and every package `__init__` on the way (Python runs them),
        looked up beside the importer, in the entry script's folder (`sys.path[0]`) and at the
        project root."""
        for base in dict.fromkeys((importer.parent, entry_dir, self.root, *self.extra)):
            found = self.module_file(base, dotted)
            if found is not None:
                parts = dotted.split(".")
                inits = [self.module_file(base, ".".join(parts[:i])) for i in range(1, len(parts))]
                return [p for p in inits if p is not None] + [found]
        return []

    def package_of(self, importer: Path, level: int) -> Path:
        folder = importer.parent
        for _ in range(level - 1):
            folder = folder.parent
        return folder


def import_statements(tree: ast.Module) -> List[ast.stmt]:
    """Every `import`/`from ... import` of the module, also inside functions and blocks."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imported_files(statements: List[ast.stmt], importer: Path, resolver: _Resolver, entry_dir: Path,
                   misses: Optional[List[Tuple[int, str]]] = None) -> List[Path]:
    """Project files that these import statements of `importer` import. Imports found nowhere
    (relative ones, and absolute ones outside the standard library) go to `misses`."""
    out: List[Path] = []
    misses = [] if misses is None else misses
    for node in statements:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found = resolver.absolute(importer, alias.name, entry_dir)
                if not found and alias.name.split(".")[0] not in _STDLIB:
                    misses.append((node.lineno, alias.name))
                out += found
        elif isinstance(node, ast.ImportFrom) and node.level:
            package = resolver.package_of(importer, node.level)
            if node.module:
                found = resolver.module_file(package, node.module)
                if found is None:
                    misses.append((node.lineno, "." * node.level + node.module))
                    continue
                out.append(found)
                if found.name != "__init__.py":
                    continue
                package = found.parent
            out += _submodules(resolver, package, node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found = resolver.absolute(importer, node.module, entry_dir)
            if not found and node.module.split(".")[0] not in _STDLIB:
                misses.append((node.lineno, node.module))
            out += found
            if found and found[-1].name == "__init__.py":
                out += _submodules(resolver, found[-1].parent, node.names)
    return out


def _submodules(resolver: _Resolver, package: Path, names: List[ast.alias]) -> List[Path]:
    """`from package import x, y`: those of `x`, `y` that are modules of the package."""
    found = (resolver.module_file(package, alias.name) for alias in names if alias.name != "*")
    return [f for f in found if f is not None]


def build(entries: Iterable[Path], trees: Optional[Dict[Path, ast.Module]] = None, fs: FileSystem = PLAIN) -> Graph:
    """Follow the entries' imports into their project; `trees` caches parses by resolved path.
    Every file-system question goes through `fs` (see `fs.Recorder`)."""
    entries = [fs.resolve(Path(e)) for e in entries]
    graph = Graph()
    trees = {} if trees is None else trees
    seen: Set[Path] = set()
    roots: Dict[Path, Path] = {}  # folder -> its project root, looked up once per folder
    queue: List[Tuple[Path, Path, Path]] = []
    for e in entries:
        if e.parent not in roots:
            try:
                roots[e.parent] = project_root(e, fs)
            except OSError:  # a path the system refuses: the engine reports it
                roots[e.parent] = e.parent
        queue.append((e, roots[e.parent], e.parent))
    names_of: Dict[Path, Set[str]] = {}  # project root -> the module names found under it
    search_dirs: Dict[Path, List[Path]] = {}  # entry folder -> folders its entry adds to sys.path
    for e in entries:
        tree = trees.get(e) or _parse(e, fs)
        if tree is not None:
            trees[e] = tree
            search_dirs.setdefault(e.parent, []).extend(sys_path_dirs(tree, e))
    while queue:
        path, root, entry_dir = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        graph.modules.append(path)
        tree = trees.get(path)
        if tree is None:
            tree = _parse(path, fs)
            if tree is None:
                graph.imports[path] = []
                continue
            trees[path] = tree
        scope = _path_scope(root, entry_dir)
        resolver = _Resolver(root, fs, [d for d in (*_pythonpath(), *search_dirs.get(entry_dir, ()))
                                        if _inside(d, scope)])
        found = []
        statements = graph.statements[path] = import_statements(tree)
        misses: List[Tuple[int, str]] = []
        try:
            imported = imported_files(statements, path, resolver, entry_dir, misses)
        except OSError:  # an import name the file system refuses (too long): not followed
            imported = []
        local = [(line, name) for line, name in misses if name.startswith(".") or
                 name.split(".")[0] in _project_names(scope, names_of)]
        if local:
            graph.unresolved[path] = local
        for f in imported:
            if f != path and f not in found and (_inside(f, scope) or f.parent == entry_dir):
                found.append(f)
        graph.imports[path] = found
        queue.extend((f, root, entry_dir) for f in found if f not in seen)
    return graph


def _path_scope(root: Path, entry_dir: Path) -> Path:
    """Where PYTHONPATH and `sys.path` folders may lead: the project root; for a script with no
    project marker above it (a copy of a repository without its `.git`), the working directory
    when the script lies inside it, as in `PYTHONPATH=src/data torchmigrate ddp src/bin/train.py`
    run from the repository's top (a recipe's `path.sh`)."""
    if root != entry_dir:
        return root
    cwd = Path.cwd().resolve()
    return cwd if _inside(entry_dir / "x.py", cwd) else root


def _project_names(root: Path, cache: Dict[Path, Set[str]], depth: int = 4) -> Set[str]:
    """Names of the modules and packages anywhere in the project (`models` for `src/models/`
    or `lib/models.py`, up to `depth` folders deep): an import of one of these that resolves
    nowhere is the project's own module reached through a path the program sets up at run
    time, not an installed package. Walked once per root, only when some import missed. For
    the report only (not through `fs`: the lint cache does not keep these lines)."""
    if root not in cache:
        names: Set[str] = set()
        for folder, dirs, files in os.walk(root):
            level = len(Path(folder).relative_to(root).parts)
            dirs[:] = [] if level >= depth else [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
            names.update(d for d in dirs if d.isidentifier())
            names.update(f[:-3] for f in files if f.endswith(".py"))
        cache[root] = names
    return cache[root]


def _pythonpath() -> List[Path]:
    """The folders of `PYTHONPATH` (a recipe's `path.sh` puts the project's `src/` there)."""
    return [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def sys_path_dirs(tree: ast.Module, entry: Path) -> List[Path]:
    """Folders the entry script adds with `sys.path.append(...)`/`insert(i, ...)`, where the path
    is a literal or built from `__file__` with `os.path.dirname/abspath/join` or `Path(...).parent`
    (a relative literal is taken from the script's folder)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("append", "insert") and dotted_name(node.func.value) == "sys.path" \
                and node.args:
            folder = _path_value(node.args[-1], entry)
            if folder is not None:
                out.append(folder.resolve())
    return out


def dotted_name(node: ast.AST) -> Optional[str]:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _path_value(node: ast.AST, entry: Path) -> Optional[Path]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return entry.parent / node.value
    if isinstance(node, ast.Name) and node.id == "__file__":
        return entry
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _path_value(node.value, entry)
        return inner.parent if inner is not None else None
    if not isinstance(node, ast.Call) or not node.args:
        return None
    name = (dotted_name(node.func) or "").rsplit(".", 1)[-1]
    values = [_path_value(a, entry) for a in node.args]
    if any(v is None for v in values):
        return None
    if name == "dirname":
        return values[0].parent
    if name in ("abspath", "realpath", "normpath", "Path", "str", "resolve"):
        return values[0]
    if name == "join":
        first, *rest = values
        return first.joinpath(*[Path(os.path.relpath(v, entry.parent)) if v.is_absolute() else v for v in rest]) \
            if rest else first
    return None


def has_main_guard(tree: ast.Module) -> bool:
    """`if __name__ == "__main__":` at module level: the file is meant to be run."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = [node.test.left, *node.test.comparators]
            if any(isinstance(n, ast.Name) and n.id == "__name__" for n in names) and any(
                    isinstance(n, ast.Constant) and n.value == "__main__" for n in names):
                return True
    return False


def relpath(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)

"""Entry scripts -> the project's own modules they import, transitively.

Resolution follows what Python does for a script run as `python train.py`: `sys.path[0]` is the
script's folder, so `import data` finds a sibling `data.py` (or a package `data/`), and packages
under the project root resolve from there too. Relative imports resolve against the importing
module's package. The folders the program itself puts on its path (`sys.path` edits, PYTHONPATH
in its launch files, a `src/` layout, its packages installed in place: `search_path`) are
searched too, and modules it loads by name (`importlib.import_module`, names in its
configuration files: `dynamic_imports`) are followed like imports. Anything that does not
resolve to a file inside the project root (the standard library, installed packages, a
virtualenv inside the project) is not part of the program.
"""

from __future__ import annotations

import ast
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

from torchmigrate.program import dynamic_imports, search_path
from torchmigrate.program.fs import SKIP_DIRS
from torchmigrate.program.fs import PLAIN, FileSystem, digest
from torchmigrate.program.project import Project, walk as project_walk
from torchmigrate.program.astwalk import walk

_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"__future__"}  # Python >= 3.10

ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git")
# how far above a script with no project marker its own `sys.path` edits may widen the project
# (`".."`, `"../.."`); further up is the user's home or a shared folder, not this program,
# unless that folder is the top of a repository copied without its `.git` (`REPOSITORY_FILES`)
MAX_LEVELS_UP = 2
# files at the top of a repository's copy (an archive, a download): with one of them, a folder
# far above the script that the program puts on its `sys.path` (`'../../../../'` from
# `experiments/<dataset>/<method>/<backbone>/train.py`) is the program's own code
REPOSITORY_FILES = ("README.md", "README.rst", "README.txt", "README", "LICENSE", "LICENSE.md", "LICENSE.txt",
                    "requirements.txt", "environment.yml", ".gitignore")


def project_root(script: Path, fs: FileSystem = PLAIN) -> Path:
    """The nearest folder above `script` with a project marker; else, for a script inside a
    package (`experiments/forecast.py` beside `experiments/__init__.py`, run as `python -m
    experiments.forecast`), the folder that holds the outermost package, where `python -m`
    runs it and its `from experiments.base import ...` resolves; else the script's own folder."""
    folder = fs.resolve(script).parent
    for candidate in (folder, *folder.parents):
        if any(fs.exists(candidate / marker) for marker in ROOT_MARKERS):
            return candidate
    top = folder
    while fs.exists(top / "__init__.py") and top.parent != top:
        top = top.parent
    return top


@dataclass
class Graph:
    """The modules of a program: every file, and for each the project files it imports."""

    modules: List[Path] = field(default_factory=list)
    imports: Dict[Path, List[Path]] = field(default_factory=dict)
    # every import statement of each module (one walk of its tree, shared with `facts`)
    statements: Dict[Path, List[ast.stmt]] = field(default_factory=dict)
    # imports that look like the project's own but resolve nowhere, and modules loaded by a name
    # that no text of the project gives: module -> (line, name or the call written out)
    unresolved: Dict[Path, List[Tuple[int, str]]] = field(default_factory=dict)
    # modules with an `if __name__ == "__main__":` block (scripts), for the entry points
    main_guards: Set[Path] = field(default_factory=set)


def parse(path: Path, fs: FileSystem) -> Optional[ast.Module]:
    data = fs.read(path)
    return None if data is None else _parse_bytes(data, path)


def _parse_bytes(data: bytes, path: Path) -> Optional[ast.Module]:
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
    def __init__(self, root: Path, fs: FileSystem = PLAIN, extra: Sequence[Path] = (),
                 mapped: Optional[Dict[str, Path]] = None) -> None:
        self.root = root
        self.fs = fs
        self.extra = tuple(extra)  # PYTHONPATH and `sys.path` folders inside the project
        self.mapped = mapped or {}  # packages installed in place from a folder of another name

    def module_file(self, base: Path, dotted: str) -> Optional[Path]:
        """`a.b.c` under folder `base`: `a/b/c.py` or `a/b/c/__init__.py`."""
        parts = dotted.split(".") if dotted else []
        target = base.joinpath(*parts)
        for candidate in (target.with_name(target.name + ".py") if parts else None, target / "__init__.py"):
            if candidate is not None and self.fs.is_file(candidate):
                return self.fs.resolve(candidate)
        return None

    def absolute(self, importer: Optional[Path], dotted: str, entry_dir: Path) -> List[Path]:
        """The file for `dotted` and every package `__init__` on the way (Python runs them),
        looked up beside the importer, in the entry script's folder (`sys.path[0]`), at the
        project root and in the folders the program puts on its path; `importer` None: a name
        that `importlib` looks up, never beside the module that asks."""
        parts = dotted.split(".")
        beside = () if importer is None else (importer.parent,)
        for base in dict.fromkeys((*beside, entry_dir, self.root, *self.extra)):
            found = self.module_file(base, dotted)
            if found is not None:
                inits = [self.module_file(base, ".".join(parts[:i])) for i in range(1, len(parts))]
                return [p for p in inits if p is not None] + [found]
        folder = self.mapped.get(parts[0])
        if folder is not None:  # `package-dir = {"mypkg" = "lib"}`: mypkg.x is lib/x.py
            found = self.module_file(folder, ".".join(parts[1:]))
            if found is not None:
                inits = [self.module_file(folder, ".".join(parts[1:i])) for i in range(1, len(parts))]
                return [p for p in inits if p is not None] + [found]
        return []

    def namespace(self, importer: Optional[Path], dotted: str, entry_dir: Path) -> Optional[Path]:
        """The folder of `dotted` where it is a package without `__init__.py` (a namespace
        package: `from pkg import helper` with `pkg/helper.py` and no `pkg/__init__.py`), looked
        up where `absolute` looks."""
        parts = dotted.split(".")
        beside = () if importer is None else (importer.parent,)
        for base in dict.fromkeys((*beside, entry_dir, self.root, *self.extra)):
            folder = base.joinpath(*parts)
            if self.fs.exists(folder) and not self.fs.is_file(folder):
                return folder
        return None

    def package_of(self, importer: Path, level: int) -> Path:
        folder = importer.parent
        for _ in range(level - 1):
            folder = folder.parent
        return folder


def import_statements(tree: ast.Module) -> List[ast.stmt]:
    """Every `import`/`from ... import` of the module, also inside functions and blocks."""
    return [node for node in walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


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
                folder = package.joinpath(*node.module.split(".")) if found is None else None
                if folder is not None and resolver.fs.exists(folder) and not resolver.fs.is_file(folder):
                    # `from .functions import *`, functions/ a folder without `__init__.py` (a
                    # namespace package): found; its named modules are followed (`*` names none)
                    out += _submodules(resolver, folder, node.names)
                    continue
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
                folder = resolver.namespace(importer, node.module, entry_dir)
                if folder is not None:  # `from pkg import helper`, pkg a folder without `__init__.py`
                    out += _submodules(resolver, folder, node.names)
                    continue
                misses.append((node.lineno, node.module))
            out += found
            if found and found[-1].name == "__init__.py":
                out += _submodules(resolver, found[-1].parent, node.names)
    return out


def _submodules(resolver: _Resolver, package: Path, names: List[ast.alias]) -> List[Path]:
    """`from package import x, y`: those of `x`, `y` that are modules of the package."""
    found = (resolver.module_file(package, alias.name) for alias in names if alias.name != "*")
    return [f for f in found if f is not None]


MAX_ROUNDS = 4  # a build that learns of new search folders follows the imports again


def build(entries: Iterable[Path], trees: Optional[Dict[Path, ast.Module]] = None, fs: FileSystem = PLAIN,
          scans: Optional[Scans] = None) -> Graph:
    """Follow the entries' imports into their project; `trees` caches parses by resolved path.
    Every file-system question goes through `fs` (see `fs.Recorder`).

    The search path grows as the build learns it (a module that edits `sys.path`, a launch file
    that sets PYTHONPATH once an import of the project's code resolves nowhere): the imports are
    then followed again with it, each module parsed once."""
    entries = [fs.resolve(Path(e)) for e in entries]
    trees = {} if trees is None else trees
    roots: Dict[Path, Path] = {}  # folder -> its project root, looked up once per folder
    for e in entries:
        if e.parent not in roots:
            try:
                roots[e.parent] = project_root(e, fs)
            except OSError:  # a path the system refuses: the engine reports it
                roots[e.parent] = e.parent
    search = _Search(fs)
    graph = Graph()
    for _ in range(MAX_ROUNDS):
        search.grew = False
        graph = _follow(entries, roots, trees, fs, search, scans)
        search.grew = search.grew or search.stale()
        if not search.grew:
            break
    return graph


@dataclass
class ModuleScan:
    """What following a module's imports needs of its text: the folders it adds to `sys.path`,
    its import statements, the modules it loads by name, and whether it is a script. Computed
    from the module's parse once per content (`Scans` keeps them across runs: a re-lint after
    one file is edited parses that file only)."""

    code_dirs: List[Path]
    statements: List[ast.stmt]
    loads: dynamic_imports.Loads
    main_guard: bool


class Scans(Protocol):
    """Where the lint cache keeps `ModuleScan`s, by a module's path, bytes and folder run from."""

    def get(self, key: str) -> Optional[ModuleScan]: ...

    def put(self, key: str, scan: ModuleScan) -> None: ...


def _scan(path: Path, entry_dir: Path, trees: Dict[Path, ast.Module], fs: FileSystem,
          scans: Optional[Scans]) -> Optional[ModuleScan]:
    """The module's scan: kept (`scans`, by the hash of its bytes) or from its parse (then kept
    in `trees` for the program's facts). None when it cannot be read or parsed."""
    key = None
    tree = trees.get(path)
    if tree is None and scans is not None:
        data = fs.read(path)
        if data is None:
            return None
        key = digest(b"\0".join([str(path).encode("utf-8", "surrogateescape"),
                                  str(entry_dir).encode("utf-8", "surrogateescape"), data]))
        kept = scans.get(key)
        if kept is not None:
            return kept
        tree = _parse_bytes(data, path)
        if tree is None:
            return None
        trees[path] = tree
    elif tree is None:
        tree = parse(path, fs)
        if tree is None:
            return None
        trees[path] = tree
    statements = import_statements(tree)
    code_dirs = search_path.code_dirs(tree, path, entry_dir) + search_path.run_from_dirs(
        statements, entry_dir, MAX_LEVELS_UP)
    found = ModuleScan(code_dirs, statements, dynamic_imports.scan(tree, path, entry_dir), has_main_guard(tree))
    if key is not None:
        scans.put(key, found)
    return found


def _follow(entries: List[Path], roots: Dict[Path, Path], trees: Dict[Path, ast.Module], fs: FileSystem,
            search: "_Search", scans: Optional[Scans] = None) -> Graph:
    graph = Graph()
    seen: Set[Path] = set()
    queue: List[Tuple[Path, Path, Path]] = [(e, roots[e.parent], e.parent) for e in entries]
    while queue:
        path, root, entry_dir = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        graph.modules.append(path)
        scanned = _scan(path, entry_dir, trees, fs, scans)
        if scanned is None:
            graph.imports[path] = []
            continue
        if scanned.main_guard:
            graph.main_guards.add(path)
        search.add_code(entry_dir, scanned.code_dirs)
        scope = _path_scope(root, entry_dir, search.code.get(entry_dir, ()), fs)
        resolver = _Resolver(root, fs, [d for d in search.folders(entry_dir, scope) if _inside(d, scope)],
                             search.mapped.get(scope))
        statements = graph.statements[path] = scanned.statements
        misses: List[Tuple[int, str]] = []
        unknown: List[Tuple[int, str]] = []  # modules loaded by a name no text of the project gives
        try:
            imported = imported_files(statements, path, resolver, entry_dir, misses)
            imported += _loaded_by_name(scanned.loads, path, resolver, entry_dir, scope, search, misses, unknown)
        except OSError:  # an import name the file system refuses (too long): not followed
            imported = []
        local = [(line, name) for line, name in misses
                 if name.startswith(".") or name.split(".")[0] in search.names(scope)]
        local += _beyond_scope(misses, local, search.code.get(entry_dir, ()), scope, root, fs, path, entry_dir)
        if any(not name.startswith(".") for _, name in local):
            search.look_further(scope)  # the project's own code, found nowhere yet
        if local or unknown:
            graph.unresolved[path] = sorted(local + unknown)
        found = []
        for f in imported:
            if f != path and f not in found and (_inside(f, scope) or f.parent == entry_dir):
                found.append(f)
        graph.imports[path] = found
        queue.extend((f, root, entry_dir) for f in found if f not in seen)
    return graph


def _loaded_by_name(loads: "dynamic_imports.Loads", importer: Path, resolver: _Resolver, entry_dir: Path, scope: Path,
                    search: "_Search", misses: List[Tuple[int, str]], unknown: List[Tuple[int, str]]) -> List[Path]:
    """Project files the module loads by name at run time (see `dynamic_imports`). A name
    written in the code but found nowhere goes to `misses`, as an import's would; a call whose
    module no text of the project names goes to `unknown`, written out."""
    out: List[Path] = []
    search.add_names(entry_dir, loads.names)
    for site in loads.sites:
        found: List[Path] = []
        if site.kind == "literal":
            for name in site.names:
                hit = _by_name(resolver, importer, name, entry_dir)
                if not hit and name.split(".")[0] not in _STDLIB:
                    misses.append((site.line, name))
                found += hit
            out += found
            continue
        if site.kind == "file":
            if site.path is not None and resolver.fs.is_file(site.path):
                found = [resolver.fs.resolve(site.path)]
        elif site.kind == "prefix":
            if site.names[0].split(".")[0] not in search.names(scope):
                continue  # a module of an installed package (`torchvision.models.` + name)
            found = _package_modules(resolver, site.names[0], entry_dir, search.config(scope))
        else:
            found = search.configured(scope, entry_dir, resolver)
        if found:
            out += found
        else:
            unknown.append((site.line, f"{site.text} (loads a module named at run time)"))
    return out


def _by_name(resolver: _Resolver, importer: Path, name: str, entry_dir: Path) -> List[Path]:
    """The files of a module `importlib` loads by `name` (`a.b`, `a.b.Attribute` as
    `pydoc.locate` takes it, `.b` relative to the importer's package)."""
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        found = resolver.module_file(resolver.package_of(importer, level), name.lstrip("."))
        return [found] if found is not None else []
    for candidate in (name, name.rsplit(".", 1)[0]) if "." in name else (name,):
        found = resolver.absolute(None, candidate, entry_dir)
        if found:
            return found
    return []


def _package_modules(resolver: _Resolver, package: str, entry_dir: Path, config) -> List[Path]:
    """`import_module("models." + arch)`: the modules of package `models` that the project's
    configuration names (`"arch": "resnet"`), else every module of it (the call can load only
    these). A folder without `__init__.py` is a package too (a namespace package)."""
    init = resolver.absolute(None, package, entry_dir)
    if init and init[-1].name == "__init__.py":
        folders = [init[-1].parent]
    else:
        init = []
        bases = dict.fromkeys((entry_dir, resolver.root, *resolver.extra))
        folders = [b.joinpath(*package.split(".")) for b in bases]
    for folder in folders:
        names = _modules_in(resolver, folder)
        if names:
            chosen = [n for n in names if n in config.words] or names
            return init + [resolver.fs.resolve(folder / f"{n}.py") for n in sorted(chosen)]
        # `".".join(["model", kind, name])`: the modules of its subpackages, one level down
        nested = [(folder / sub[:-1], n) for sub in resolver.fs.listing(folder).split("\n")
                  if sub.endswith("/") and sub[:-1].isidentifier() for n in _modules_in(resolver, folder / sub[:-1])]
        if nested:
            chosen = [(f, n) for f, n in nested if n in config.words] or nested
            return init + [resolver.fs.resolve(f / f"{n}.py") for f, n in sorted(chosen)]
    return []


def _modules_in(resolver: _Resolver, folder: Path) -> List[str]:
    return [n[:-3] for n in resolver.fs.listing(folder).split("\n")
            if n.endswith(".py") and n != "__init__.py" and n[:-3].isidentifier()]


class _Search:
    """Where the imports of each entry's program are looked for, learnt during one build."""

    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self.code: Dict[Path, List[Path]] = {}  # entry folder -> folders its modules add to sys.path
        self.further: Dict[Path, List[Path]] = {}  # scope -> launch files' PYTHONPATH, src/, installed
        self.mapped: Dict[Path, Dict[str, Path]] = {}  # scope -> package installed from another folder
        self._projects: Dict[Path, Project] = {}
        self._names: Dict[Path, Set[str]] = {}
        self._packaging: Dict[Path, Tuple[List[Path], Dict[str, Path]]] = {}
        self._configs: Dict[Path, dynamic_imports.ConfigStrings] = {}
        # (scope, entry folder) -> (texts of the code read, search folders, what they name)
        self._configured: Dict[Tuple[Path, Path], Tuple[int, tuple, List[Path]]] = {}
        self.code_names: Dict[Path, Set[str]] = {}  # entry folder -> dotted texts in its modules' code
        self.grew = False  # a round learnt a folder: follow the imports again

    def folders(self, entry_dir: Path, scope: Path) -> List[Path]:
        return list(dict.fromkeys((*_pythonpath(), *self.code.get(entry_dir, ()), *self.further.get(scope, ()))))

    def add_code(self, entry_dir: Path, folders: Sequence[Path]) -> None:
        known = self.code.setdefault(entry_dir, [])
        for folder in folders:
            if folder not in known:
                known.append(folder)
                self.grew = True

    def project(self, scope: Path) -> Project:
        if scope not in self._projects:
            self._projects[scope] = project_walk(scope, self.fs)
        return self._projects[scope]

    def names(self, scope: Path) -> Set[str]:
        """Names of the modules and packages anywhere in the project (`models` for
        `src/models/` or `lib/models.py`): an import of one of these that resolves nowhere is
        the project's own module reached through a path the program sets up at run time, not
        an installed package."""
        if scope not in self._names:
            self._names[scope] = self.project(scope).module_names() | set(self._installed(scope)[1])
        return self._names[scope]

    def _installed(self, scope: Path) -> Tuple[List[Path], Dict[str, Path]]:
        if scope not in self._packaging:
            self._packaging[scope] = search_path.installed_packages(self.project(scope).root, self.fs)
        return self._packaging[scope]

    def look_further(self, scope: Path) -> None:
        """The folders the project's launch files, layout and packaging put on the path."""
        if scope in self.further:
            return
        project = self.project(scope)
        bases, mapped = self._installed(scope)
        folders = [*search_path.launch_dirs(project, scope, self.fs), *search_path.src_layout(project), *bases]
        self.further[scope] = [f for f in dict.fromkeys(folders) if _inside(f / "x.py", scope)]
        self.mapped[scope] = {n: f for n, f in mapped.items() if _inside(f / "x.py", scope)}
        self.grew = self.grew or bool(self.further[scope] or self.mapped[scope])

    def config(self, scope: Path) -> "dynamic_imports.ConfigStrings":
        if scope not in self._configs:
            self._configs[scope] = dynamic_imports.config_strings(self.project(scope), self.fs)
        return self._configs[scope]

    def add_names(self, entry_dir: Path, names: Set[str]) -> None:
        self.code_names.setdefault(entry_dir, set()).update(names)

    def stale(self) -> bool:
        """Whether a run-time name was resolved before the round had read every dotted text of
        the program's code (one more round resolves it with all of them)."""
        return any(used != len(self.code_names.get(entry_dir, ()))
                   for (_, entry_dir), (used, _, _) in self._configured.items())

    def configured(self, scope: Path, entry_dir: Path, resolver: _Resolver) -> List[Path]:
        """The project's modules that its configuration files or its code's texts name
        (`"module": "trainer.trainer"`, `_target_: models.net.Net`, `default="engines.sgd"`):
        what a program that loads modules by run-time names may load."""
        key = (scope, entry_dir)
        texts = self.code_names.get(entry_dir, set())
        if self._configured.get(key, (None, None))[:2] != (len(texts), resolver.extra):
            names = self.names(scope)
            found: List[Path] = []
            for text in [*self.config(scope).dotted, *sorted(texts)]:
                if text.split(".")[0] not in names:
                    continue  # not the project's (torch.optim.Adam)
                for candidate in (text, text.rsplit(".", 1)[0]):
                    hit = resolver.absolute(None, candidate, entry_dir)
                    if hit:
                        found += [f for f in hit if f not in found]
                        break
            self._configured[key] = (len(texts), resolver.extra, found)
        return self._configured[key][2]


def _beyond_scope(misses: List[Tuple[int, str]], local: List[Tuple[int, str]], added: Sequence[Path],
                  scope: Path, root: Path, fs: FileSystem, path: Path, entry_dir: Path) -> List[Tuple[int, str]]:
    """Missed imports found in a folder the program puts on `sys.path` outside what the tool
    takes for the project (a home or shared folder far above the script): not followed, and
    named with that folder, so the report never says the program is done without them."""
    outside = [d for d in added if not _inside(d / "x.py", scope)]
    if not outside:
        return []
    resolver = _Resolver(root, fs, outside)
    out = []
    for line, name in misses:
        if (line, name) in local or name.startswith("."):
            continue
        for folder in outside:
            if resolver.module_file(folder, name) is not None or fs.exists(folder.joinpath(*name.split("."))):
                out.append((line, f"{name} (in {folder}, which the program puts on sys.path outside the project "
                                  f"the tool found: run it from that folder to migrate them together)"))
                break
    return out


def _path_scope(root: Path, entry_dir: Path, added: Sequence[Path] = (), fs: FileSystem = PLAIN) -> Path:
    """Where PYTHONPATH and `sys.path` folders may lead: the project root; for a script with no
    project marker above it (a copy of a repository without its `.git`), the working directory
    when the script lies inside it, as in `PYTHONPATH=src/data torchmigrate ddp src/bin/train.py`
    run from the repository's top (a recipe's `path.sh`), widened to the folder above that a
    module of the program puts on `sys.path` itself (`sys.path.append("..")` in
    `main_training/main.py` beside `utils/`): the program says that folder is its own code."""
    if root != entry_dir or any(fs.exists(root / marker) for marker in ROOT_MARKERS):
        return root  # a repository's top: a folder above it is another project
    cwd = Path.cwd().resolve()
    scope = cwd if _inside(entry_dir / "x.py", cwd) else root
    for folder in added:
        try:
            common = Path(os.path.commonpath([entry_dir, folder]))
        except ValueError:  # another drive
            continue
        if _inside(scope / "x.py", common) and (
                len(entry_dir.relative_to(common).parts) <= MAX_LEVELS_UP or _repository_top(common, fs)):
            scope = common
    return scope


def _repository_top(folder: Path, fs: FileSystem = PLAIN) -> bool:
    """The folder holds what a repository's top holds (`REPOSITORY_FILES`) and is not the
    user's home, the file system's root or a folder above the home."""
    home = Path.home().resolve()
    if folder.parent == folder or folder == home or _inside(home / "x.py", folder):
        return False
    return any(fs.exists(folder / name) for name in REPOSITORY_FILES)


def _pythonpath() -> List[Path]:
    """The folders of `PYTHONPATH` (a recipe's `path.sh` puts the project's `src/` there)."""
    return [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


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

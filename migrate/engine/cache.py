"""The lint cache: a file's findings are computed once per content, tool and configuration.

`torchmigrate lint` in pre-commit and CI sees the same files again and again. A result is
reused only when everything it was computed from is the same:

- the file's bytes (BLAKE2b of the content; `stat` only spares hashing it again);
- the tool: a hash of the sources of the `torchmigrate` package (rules included) with the
  LibCST and Python versions, not the version string, which stays the same while the code
  changes under development (`fingerprint`);
- the effective configuration: the rules selected, every option (`--fix`, `amp`), the path as
  it is printed;
- what the rest of the program says about the file: its `ModuleView`, computed from every
  module of the run (a dependency that now wraps the model changes it). The view comes from
  the program build, which is itself reused only when a replay of every file-system question
  it asked gets the same answers and every module it read has the same hash (`program.fs`); a
  warm run therefore parses nothing and does not import LibCST.

Layout: `<cache dir>/hashes.json` (content hashes by `stat`, see `Hashes`), and per tool
version `<fingerprint>/files/<key>.json` per file result, `programs/<key>.json` per program
build, `runs/<key>.json` all results of one set of files (one read for a whole warm run),
`catalogue.json` for the rule descriptions (`catalogue`). The first run of
a new fingerprint removes the folders of all but the last few versions. Every write goes to a
temporary file renamed into place, so concurrent runs (pytest-xdist, parallel pre-commit
hooks) only ever see whole entries; an entry that cannot be read or does not match its key is
a miss, never an error. Results with an input error are not stored (a permission problem is
not a property of the content).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torchmigrate.engine.outcome import Outcome, Record
from torchmigrate.program.fs import CACHE_TAG, Realpaths, digest

FORMAT = "3"  # the layout of entries; bump when it changes
DIRNAME = ".torchmigrate_cache"
ENV = "TORCHMIGRATE_CACHE_DIR"
GITIGNORE = "# Created by torchmigrate: the lint cache, safe to delete.\n*\n"
CACHEDIR_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
                "# This file is a cache directory tag created by torchmigrate (the lint cache).\n"
                "# For information about cache directory tags, see https://bford.info/cachedir/\n")
KEEP = 4  # tool versions whose entries are kept

_fingerprint: Optional[str] = None


def fingerprint(hash_file: Optional[Callable[[str], Optional[str]]] = None) -> str:
    """A hash of the tool's own sources (the `torchmigrate` package, its rules and its runtime,
    each file named by its module so a checkout and an installed copy of the same code agree),
    the LibCST version and the Python version: any change to what computes a result changes
    it. `hash_file(path)` gives a file's content hash (`Hashes.of`: no read when unchanged)."""
    global _fingerprint
    if _fingerprint is None:
        hash_file = hash_file or _read_digest
        parts = {"": f"{FORMAT} {sys.version}"}
        for package in ("torchmigrate", "torchmigrate.rules", "torchmigrate.runtime"):
            spec = importlib.util.find_spec(package)  # finds, does not import (nor LibCST, nor torch)
            if spec is None or not spec.origin:
                continue
            folder = os.path.dirname(spec.origin)
            for d, dirs, names in os.walk(folder):
                dirs[:] = [x for x in dirs if x != "__pycache__"]
                for f in names:
                    if f.endswith(".py"):
                        rel = os.path.relpath(os.path.join(d, f), folder)[:-3].replace(os.sep, ".")
                        module = package + ("" if rel == "__init__" else "." + rel.replace(".__init__", ""))
                        parts[module] = hash_file(os.path.join(d, f)) or "?"
        libcst = importlib.util.find_spec("libcst")
        if libcst is not None and libcst.origin:
            version = os.path.join(os.path.dirname(libcst.origin), "_version.py")
            parts["libcst"] = hash_file(version) or libcst.origin
        _fingerprint = digest("\n".join(f"{k}:{v}" for k, v in sorted(parts.items())).encode())
    return _fingerprint


def _read_digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as handle:
            return digest(handle.read())
    except OSError:
        return None


class Hashes:
    """Content hashes of files, computed again only for files whose `stat` changed.

    As git's index does: the same inode, size, modification and change times mean the same
    bytes (the change time is set by the kernel on every write and cannot be set back). A file
    changed less than `RACY_NS` before it was hashed is not remembered, so a write within the
    same timestamp tick as the hash can never go unseen. Kept in `hashes.json` at the cache
    root (hashes do not depend on the tool); concurrent runs may overwrite each other's copy,
    every copy is right."""

    RACY_NS = 2_000_000_000
    MAX_FILES = 20_000  # beyond it, only the files of the last run are kept

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        data = _read_json(path) if path is not None else None
        known = data.get("files") if data is not None else None
        self.known: Dict[str, list] = known if isinstance(known, dict) else {}
        self.seen: set = set()
        self.changed = False

    def of(self, real: str) -> Optional[str]:
        try:
            st = os.stat(real)
        except OSError:
            return None
        signature = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        self.seen.add(real)
        known = self.known.get(real)
        if isinstance(known, list) and known[:4] == signature and len(known) == 5:
            return known[4]
        try:
            with open(real, "rb") as handle:
                data = handle.read()
            after = os.stat(real)
        except OSError:
            return None
        content = digest(data)
        stable = [after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns] == signature
        if stable and time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > self.RACY_NS:
            self.known[real] = signature + [content]
            self.changed = True
        return content

    def save(self, store: "Store") -> None:
        if self.changed and self.path is not None:
            if len(self.known) > self.MAX_FILES:
                self.known = {k: v for k, v in self.known.items() if k in self.seen}
            store.write_at(self.path, {"files": self.known})
            self.changed = False


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as handle:
            data = json.loads(handle.read())
    except (OSError, ValueError):  # missing, truncated, not JSON
        return None
    return data if isinstance(data, dict) else None


def location(option: Optional[str], paths: Sequence[str]) -> Path:
    """`--cache-dir`, else $TORCHMIGRATE_CACHE_DIR, else `.torchmigrate_cache` in the project:
    beside the pyproject.toml nearest to the first path (the working directory without one)."""
    if option:
        return Path(option)
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    try:
        pyproject = find_pyproject(Path(paths[0]) if paths else Path.cwd())
    except OSError:  # a path the system refuses: discovery reports it
        pyproject = None
    return (pyproject.parent if pyproject else Path.cwd()) / DIRNAME


def find_pyproject(start: Path) -> Optional[Path]:
    """The nearest pyproject.toml (or torchmigrate.toml) at or above `start`."""
    start = start.resolve()
    for folder in [start, *start.parents] if start.is_dir() else [start.parent, *start.parent.parents]:
        for name in ("pyproject.toml", "torchmigrate.toml"):
            if (folder / name).is_file():
                return folder / name
    return None


def open_for_lint(option: Optional[str], paths: Sequence[str]) -> Optional["LintCache"]:
    """The cache of a lint run (`option`: `--cache-dir`, "" for the default, None for
    `--no-cache`); the CLI keeps its rule catalogue in its store too (`catalogue.use`)."""
    return None if option is None else LintCache(location(option, paths))


class Store:
    """JSON entries under one folder, written atomically, read forgivingly."""

    def __init__(self, root: Path, tool: str) -> None:
        self.root = root
        self.folder = root / tool
        self._made: set = set()

    def read(self, name: str) -> Optional[dict]:
        return _read_json(self.folder / name)

    def write(self, name: str, data: dict) -> None:
        self.write_at(self.folder / name, data)

    def write_at(self, path: Path, data: dict) -> None:
        """Write an entry whole or not at all; a cache that cannot be written is no cache."""
        try:
            import tempfile  # only when writing: a warm run writes nothing

            self._prepare(path.parent)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    # `dumps` (one string) uses json's C encoder; `dump` to a file encodes in Python,
                    # several times slower on the program's facts (0.3 s of a one-file re-lint)
                    handle.write(json.dumps(data, separators=(",", ":")))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError:
            pass

    def _prepare(self, folder: Path) -> None:
        if folder in self._made:
            return
        fresh = not self.folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        ignore = self.root / ".gitignore"
        if not ignore.exists():
            _atomic_text(ignore, GITIGNORE)
        tag = self.root / CACHE_TAG
        if not tag.exists():  # backup tools, and the walk of a program build, skip the folder
            _atomic_text(tag, CACHEDIR_TAG)
        if fresh and _read_text(ignore) == GITIGNORE:
            self._prune()
        self._made.add(folder)

    def _prune(self) -> None:
        """On the first run of a tool version, in a folder that is ours (never a --cache-dir
        that holds other things): keep the entries of the `KEEP` versions used last (a
        pre-commit environment and a development one may alternate), remove the others."""
        others = []
        for other in self.root.iterdir():
            if other.is_dir() and other.name != self.folder.name and _FINGERPRINT.match(other.name):
                with contextlib.suppress(OSError):
                    others.append((other.stat().st_mtime, other))
        import shutil  # only here: a warm run prunes nothing

        for _, other in sorted(others, reverse=True)[KEEP - 1:]:
            shutil.rmtree(other, ignore_errors=True)


_FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")


def _read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


def _atomic_text(path: Path, text: str) -> None:
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


# --- results -------------------------------------------------------------------------------------

def _outcome_json(outcome: Outcome) -> dict:
    return {"records": [list(dataclasses.astuple(r)) for r in outcome.records], "changed": outcome.changed,
            "uses_runtime": outcome.uses_runtime, "signals": list(outcome.signals), "diff": outcome.diff,
            "warnings": list(outcome.warnings)}


def _outcome(path: str, data: dict, file_digest: str) -> Outcome:
    return Outcome(path, records=[Record(*r) for r in data["records"]], changed=bool(data["changed"]),
                   uses_runtime=bool(data["uses_runtime"]), signals=tuple(data["signals"]), digest=file_digest,
                   diff=str(data["diff"]), warnings=tuple(data["warnings"]))


def _view_json(view) -> dict:
    """A ModuleView as JSON with a fixed order (sets sorted), for keys and storage."""
    return {f.name: _encode(getattr(view, f.name)) for f in dataclasses.fields(view)}


def _encode(value):
    """A ModuleView value as JSON, whatever it nests: sets (sorted) and tuples (named ones by
    their class) are tagged so they come back as they went in; dicts in key order."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, (set, frozenset)):
        return {"set": sorted((_encode(v) for v in value), key=repr)}
    if isinstance(value, tuple):
        named = type(value).__name__ if hasattr(value, "_fields") else None
        return {"tuple": [_encode(v) for v in value], "named": named}
    if isinstance(value, dict):
        return {"dict": [[k, _encode(v)] for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))]}
    raise TypeError(f"{type(value).__name__} is not stored by the lint cache")


def _decode(value):
    if not isinstance(value, dict):
        return value
    if "set" in value:
        return frozenset(_decode(v) for v in value["set"])
    if "tuple" in value:
        items = tuple(_decode(v) for v in value["tuple"])
        return _named_tuple(value["named"])(*items) if value.get("named") else items
    return {k: _decode(v) for k, v in value["dict"]}


def _named_tuple(name: str) -> type:
    """The NamedTuple class a ModuleView holds under `name` (imported only when a view is read)."""
    from torchmigrate.program.classes import OptimizerWrapper

    return {"OptimizerWrapper": OptimizerWrapper}[name]


class _Views(dict):
    """The views of a recalled build, made into ModuleViews only when a file is processed
    (a warm run that processes nothing needs none of them)."""

    def __init__(self, stored: Dict[str, dict]) -> None:
        super().__init__()
        self.stored = stored

    def get(self, path, default=None):
        if path not in self and path in self.stored:
            self[path] = _view(self.stored[path])
        return super().get(path, default)

    def __len__(self) -> int:
        return len(self.stored)


def _view(data: dict):
    from torchmigrate.program.view import ModuleView

    return ModuleView(**{f.name: _decode(data[f.name]) for f in dataclasses.fields(ModuleView)})


class _PartViews:
    """The facts of each program of a run (`program.build.PartViews`), as `parts/<key>.json`:
    after one file of a folder of scripts is edited, only its own program's facts are computed
    again (the run's build as a whole is not reused: a module's hash changed)."""

    def __init__(self, store: "Store") -> None:
        self.store = store

    def get(self, key: str):
        data = self.store.read(f"parts/{key}.json")
        try:
            return {path: _view(view) for path, view in data["views"].items()} if data and data.get("key") == key else None
        except (KeyError, TypeError, ValueError):
            return None  # an entry of another shape: computed again

    def put(self, key: str, views) -> None:
        self.store.write(f"parts/{key}.json", {"key": key, "views": {p: _view_json(v) for p, v in views.items()}})


class _ModuleScans:
    """What following each module's imports needs of its text (`program.graph.ModuleScan`), as
    `scans/<key>.json` (the key hashes the module's path, bytes and the folder it runs from):
    a build after one edit parses the edited file only."""

    def __init__(self, store: "Store") -> None:
        self.store = store

    def get(self, key: str):
        data = self.store.read(f"scans/{key}.json")
        if not data or data.get("key") != key:
            return None
        try:
            return _scan(data)
        except (KeyError, TypeError, ValueError, IndexError):
            return None  # an entry of another shape: scanned again

    def put(self, key: str, scan) -> None:
        self.store.write(f"scans/{key}.json", dict(_scan_json(scan), key=key))


def _scan_json(scan) -> dict:
    statements = []
    for node in scan.statements:
        names = [[a.name, a.asname] for a in node.names]
        if node.__class__.__name__ == "Import":
            statements.append(["import", node.lineno, names])
        else:
            statements.append(["from", node.lineno, names, node.module, node.level])
    sites = [[s.line, s.kind, list(s.names), s.text, None if s.path is None else str(s.path)]
             for s in scan.loads.sites]
    return {"code_dirs": [str(d) for d in scan.code_dirs], "statements": statements,
            "sites": sites, "names": sorted(scan.loads.names), "main_guard": scan.main_guard}


def _scan(data: dict):
    import ast

    from torchmigrate.program.dynamic_imports import Loads, Site
    from torchmigrate.program.graph import ModuleScan

    statements = []
    for entry in data["statements"]:
        aliases = [ast.alias(name=n, asname=a) for n, a in entry[2]]
        node = ast.Import(names=aliases) if entry[0] == "import" else \
            ast.ImportFrom(module=entry[3], names=aliases, level=entry[4])
        node.lineno, node.col_offset = entry[1], 0
        statements.append(node)
    sites = [Site(line, kind, tuple(names), text, None if path is None else Path(path))
             for line, kind, names, text, path in data["sites"]]
    return ModuleScan([Path(d) for d in data["code_dirs"]], statements, Loads(sites, set(data["names"])),
                      bool(data["main_guard"]))


class LintCache:
    """What `lint` asks of the cache: the program build, and each file's outcome."""

    def __init__(self, root: Path) -> None:
        self.hashes = Hashes(root / "hashes.json")
        self.store = Store(root, fingerprint(self.hashes.of))
        self.digests: Dict[str, str] = {}  # resolved path -> content hash, this run
        self._resolve = Realpaths()
        self._real: Dict[str, str] = {}
        # the views of the program this cache built or recalled, as JSON (for keys)
        self._views: Dict[str, str] = {}
        self._program_key = ""
        self.hits = 0

    def realpath(self, path) -> str:
        """`os.path.realpath`, once per path a run."""
        key = str(path)
        real = self._real.get(key)
        if real is None:
            real = self._real[key] = self._resolve(key)
        return real

    def _digest(self, path) -> Optional[str]:
        real = self.realpath(path)
        found = self.digests.get(real)
        if found is None:
            found = self.hashes.of(real)
            if found is not None:
                self.digests[real] = found
        return found

    # --- the program build --------------------------------------------------------------------
    def program(self, found: Sequence[Path], named: Sequence[Path], follow: bool, exclude: Sequence[str],
                build: Callable):
        """The program of these files: the recorded build when nothing it depended on changed,
        else `build(fs)` with a recording file system (then recorded)."""
        from torchmigrate.program.fs import Recorder, unchanged
        from torchmigrate.program.program import Program

        # PYTHONPATH says where imports are looked for (program/graph.py)
        key = self._program_key = digest(json.dumps([os.getcwd(), [str(p) for p in found],
                                                     [str(p) for p in named], follow, list(exclude),
                                                     os.environ.get("PYTHONPATH", "")]).encode())
        name = f"programs/{key}.json"
        data = self.store.read(name)
        try:
            if data is not None and data.get("key") == key and unchanged(
                    [tuple(a) for a in data["answers"]], data["reads"], self._digest, self.realpath):
                p = data["program"]
                self._views = {k: json.dumps(v) for k, v in p["views"].items()}
                return Program(files=[Path(f) for f in p["files"]], entries=[Path(f) for f in p["entries"]],
                               followed=[Path(f) for f in p["followed"]],
                               views=_Views(p["views"]), groups=p["groups"])
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another shape: build again
        recorder = Recorder()
        program = build(recorder, _PartViews(self.store), _ModuleScans(self.store))
        views = {k: _view_json(v) for k, v in program.views.items()}
        self._views = {k: json.dumps(v) for k, v in views.items()}
        record = {"key": key, "answers": [[k, p, a] for (k, p), a in recorder.answers.items()],
                  "reads": recorder.reads,
                  "program": {"files": [str(f) for f in program.files], "entries": [str(f) for f in program.entries],
                              "followed": [str(f) for f in program.followed],
                              "views": views,
                              "groups": program.groups}}
        if all(self._digest(p) == d for p, d in recorder.reads.items()):
            self.store.write(name, record)  # (a file edited during the build: not recorded)
        return program

    # --- file results -------------------------------------------------------------------------
    def _key(self, path: Path, file_digest: str, job) -> str:
        """The key of a file's result: its path as printed, its bytes, the rules and options,
        and what the program says about it (its ModuleView)."""
        view = self._views.get(self.realpath(path), "null") if job.program else "null"
        own = repr(job.per_file.get(str(path))) if job.per_file else ""  # the file's own settings
        return digest("\0".join((str(path), file_digest, self._settings(job), view, own)).encode())

    def _settings(self, job) -> str:
        if getattr(self, "_job", None) is not job:
            self._job, self._job_key = job, json.dumps([dataclasses.astuple(job.options), list(job.rule_codes)])
        return self._job_key

    def run(self, files: Sequence[Path], job, compute: Callable[[List[Path]], List[Outcome]]) -> List[Outcome]:
        """The outcome of each file, from the cache where it holds one, else from
        `compute(missing files)` (then stored). Output order is the input order.

        Besides an entry per file, a run leaves a summary of all its files' entries (one read
        instead of one per file the next time the same files are linted the same way)."""
        summary_name = f"runs/{digest((self._program_key + self._settings(job)).encode())}.json"
        summary = self.store.read(summary_name) or {}
        recalled = summary.get("files") if isinstance(summary.get("files"), dict) else {}
        found: Dict[int, Outcome] = {}
        keys: Dict[int, str] = {}
        missing: List[Tuple[int, Path]] = []
        from_summary = 0
        for i, path in enumerate(files):
            file_digest = self._digest(path)
            if not file_digest:
                missing.append((i, path))
                continue
            key = keys[i] = self._key(path, file_digest, job)
            entry = recalled.get(str(path))
            data = entry[1] if isinstance(entry, list) and len(entry) == 2 and entry[0] == key else None
            from_summary += data is not None
            if data is None:
                data = self.store.read(f"files/{key}.json")
                data = data if data is not None and data.get("key") == key else None
            hit = None
            if data is not None:
                try:
                    hit = _outcome(str(path), data, file_digest)
                except (KeyError, TypeError, ValueError):
                    hit = None
            # --fix: a change must be made; --diff: a result kept without its diff cannot show it
            if hit is not None and not (job.write and hit.changed) and not (job.want_diff and hit.changed
                                                                            and not hit.diff):
                found[i] = hit
                self.hits += 1
            else:
                missing.append((i, path))
        if missing:
            for (i, path), outcome in zip(missing, compute([p for _, p in missing])):
                found[i] = outcome
                keys[i] = self._store(path, outcome, job) or ""
        outcomes = [found[i] for i in range(len(files))]
        if from_summary != len(files) or len(recalled) != len(files):
            stored = {str(path): [keys[i], _outcome_json(outcomes[i])] for i, path in enumerate(files)
                      if keys.get(i) and _storable(outcomes[i])}
            if stored != recalled:
                self.store.write(summary_name, {"files": stored})
        self.hashes.save(self.store)
        return outcomes

    def _store(self, path: Path, outcome: Outcome, job) -> Optional[str]:
        if not _storable(outcome):
            return None
        key = self._key(path, outcome.digest, job)
        self.store.write(f"files/{key}.json", {"key": key, **_outcome_json(outcome)})
        return key


def _storable(outcome: Outcome) -> bool:
    """A result that depends on the file's content alone: no input error (a permission is not
    content), nothing written (`--fix` changed the file)."""
    return outcome.error is None and not outcome.written and bool(outcome.digest)

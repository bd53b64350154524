"""The probe `torchmigrate verify` runs each torchrun worker through:
`python -m torchmigrate.cli.verify_probe SCRIPT ARGS...` (only ever in the child processes; this
module imports torch, the CLI never imports it).

It patches torch and `open` before the script runs, then runs the script as `__main__` (like
`python SCRIPT`), so nothing is written into the user's files. It records what the checks in
`torchmigrate.cli.verify_checks` judge, and writes `rank<R>.json` into `$TM_VERIFY_DIR` when the
script ends, however it ends:
- the indices every DataLoader iteration draws (its whole epoch, read from the sampler before the
  first batch) and how many optimizer steps ran while it was the loader being read; a loader read
  while optimizers step is a training loader (in a program with no optimizer, whose parameters
  are stepped by hand, each backward counts as a step);
- a hash of the parameters and the learning rates of every optimizer, and of every DDP module;
- every file opened for writing and every `torch.save` (with any `module.`/`_orig_mod.` keys);
- every `torch.load` path, and `ReduceLROnPlateau.step` arguments (the usual per-rank metric);
- how the script ended, with the user's `file:line` where it stopped.

It also keeps the run short, symmetrically on every rank (so collectives stay matched): a
training loader ends after `$TM_VERIFY_STEPS` optimizer steps for the first `$TM_VERIFY_EPOCHS`
training epochs; later epochs are shortened to one optimizer step (and one batch of every other
loader), so the program runs on to its end (its final save) quickly; a program still training
at epoch `LAST_EPOCH` is stopped there (`SystemExit(0)` at the next read of its training loader).

While the script runs, `rank<R>.progress.json` says how far the rank is (the CLI prints it). The
probe's own failures are recorded as such (`probe_errors`, or status `probe_failed`), never raised
into the user's program and never reported as the script's fault.
"""

from __future__ import annotations

import builtins
import ctypes
import hashlib
import importlib.util
import io
import itertools
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import dataloader as _dl

PREFIXES = ("module.", "_orig_mod.")
OUT = os.environ.get("TM_VERIFY_DIR", ".")
STEPS = int(os.environ.get("TM_VERIFY_STEPS", "0"))
EPOCHS = int(os.environ.get("TM_VERIFY_EPOCHS", "0"))
LAST_EPOCH = max(EPOCHS, int(os.environ.get("TM_VERIFY_LAST_EPOCH", "20")))  # then stopped (with EPOCHS)
ROOT = os.path.abspath(os.environ.get("TM_VERIFY_ROOT", "."))
_OWN = tuple(os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin)) + os.sep
             for name in ("torchmigrate", "torchmigrate.runtime"))  # the runtime is not user code
_open, _save, _load, _replace, _rename = builtins.open, torch.save, torch.load, os.replace, os.rename

record: dict = {"rank": int(os.environ.get("RANK", "0")), "status": None, "exit_code": None,
                "error": None, "steps": 0, "process_group": False, "loaders": {}, "optimizers": [], "ddp": [],
                "writes": {}, "saves": [], "loads": [], "plateau": [], "epochs": 0, "short_epochs": 0,
                "probe_errors": [], "synced": False}
_optimizers: list = []
_ddp: list = []
_active: dict = {}  # the loader iteration that yielded the latest batch
_renamed: dict = {}  # temp file -> the path it was renamed to (an atomic save)
_THIS_FILE = os.path.abspath(__file__)
_shown = {"at": 0.0, "what": None}  # the last progress written


def _probe_failed(what: str) -> None:
    """One of the probe's own steps failed (a torchmigrate bug): kept for the report, and the
    user's program goes on as if the probe were not there."""
    if len(record["probe_errors"]) < 5:
        record["probe_errors"].append(f"{what}: {traceback.format_exc(limit=-2).strip()}")


def _progress(phase: str, force: bool = False) -> None:
    """How far this rank is, for the CLI's progress lines: written at each change of phase or
    epoch, and at most twice a second otherwise."""
    what = (phase, record["epochs"])
    now = time.monotonic()
    if not force and what == _shown["what"] and now - _shown["at"] < 0.5:
        return
    _shown.update(at=now, what=what)
    path = os.path.join(OUT, f"rank{record['rank']}.progress.json")
    try:
        with _open(path + ".tmp", "w") as handle:
            json.dump({"phase": phase, "epoch": record["epochs"], "steps": record["steps"],
                       "short": record["short_epochs"]}, handle)
        _replace(path + ".tmp", path)
    except Exception:
        _probe_failed("writing the progress file")


class Stopped(SystemExit):
    """Raised by the probe (not the script) once the requested epochs have run."""

    def __init__(self) -> None:
        super().__init__(0)


def _is_user(filename: str) -> bool:
    path = os.path.abspath(filename)
    return (path.startswith(ROOT + os.sep) and not path.startswith(_OWN)
            and "site-packages" not in path and os.path.basename(path) != "torchmigrate_runtime.py")


def _where(frame=None, tb=None) -> str | None:
    """The innermost frame in the user's own files, as `path:line` relative to the script's folder."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack(frame or sys._getframe(1))
    for f in reversed(frames):
        if _is_user(f.filename):
            return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"
    return None


def _sampler(loader):
    """The sampler that decides the order: the batch sampler's own one when the loader got a
    custom batch sampler, else the loader's sampler."""
    bs = loader.batch_sampler
    if bs is not None and getattr(bs, "sampler", None) is not loader.sampler:
        return getattr(bs, "sampler", bs)
    return loader.sampler


def _index(i):
    try:
        return int(i)
    except (TypeError, ValueError):  # a sampler of keys, not positions: compared as text
        return repr(i)


def _flat(items) -> list:
    return [_index(i) for item in items for i in (item if isinstance(item, (list, tuple)) else [item])]


def _loader(loader) -> dict:
    """The record of a DataLoader, keyed by where it was created and its dataset (a script that
    builds a new loader every epoch still has one training loader; a helper that builds the train
    and the val loader on one line has two)."""
    site = getattr(loader, "_tm_verify_site", None) or "a DataLoader outside your files"
    sampler = _sampler(loader)
    return record["loaders"].setdefault(f"{site} {id(loader.dataset)}", {
        "site": site, "sampler": type(sampler).__name__,
        "shuffle": getattr(sampler, "shuffle", isinstance(sampler, torch.utils.data.RandomSampler)),
        "replacement": bool(getattr(sampler, "replacement", False)),  # draws repeat samples by design
        "dataset_len": _len(loader.dataset),
        "sampler_len": _len(sampler),  # this rank's draws per epoch (fewer than the dataset: a budget)
        "drop_last": bool(loader.drop_last or getattr(sampler, "drop_last", False)),
        "iterations": []})


def _len(dataset):
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset without __len__
        return None


def _batches(loader, source):
    """Stand-in for a DataLoader iterator's sampler iterator: records the epoch's indices; in the
    first EPOCHS training epochs a training read ends after STEPS optimizer steps, later every
    read is shortened to one step (a loader that never trained: one batch), and the program is
    stopped before a training read beyond LAST_EPOCH."""
    entry = _loader(loader)
    trained = sum(1 for it in entry["iterations"] if it["steps"])
    if EPOCHS and trained >= LAST_EPOCH:
        raise Stopped()
    short = bool(EPOCHS) and record["epochs"] >= EPOCHS
    steps_limit = 1 if short else STEPS
    mapped = loader._dataset_kind == _dl._DatasetKind.Map
    items, endless = _epoch_of(source, loader) if mapped else (None, False)
    it = {"indices": _flat(items) if mapped and not endless else None, "steps": 0, "batches": 0,
          "epoch": getattr(_sampler(loader), "epoch", None), "short": short}
    if endless:  # the indices of the first pass, as this rank draws them (later passes reshuffle)
        it["indices"], first_pass = [], _len(loader.sampler)
    entry["iterations"].append(it)
    _active["cut"] = False
    for batch in (itertools.chain(items, source) if endless else items if mapped else source):
        if steps_limit and it["steps"] >= steps_limit or short and not trained and it["batches"] >= 1:
            _active["cut"] = True  # (a short read of an evaluation loader: one batch)
            return
        _active["it"] = it
        it["batches"] += 1
        if endless and (first_pass is None or len(it["indices"]) < first_pass):
            it["indices"].extend(_flat([batch]))
        yield batch


def _epoch_of(source, loader):
    """The batches of indices one read of the loader's sampler yields, and whether it never ends:
    a sampler that repeats forever (an "infinite" DataLoader's `_RepeatSampler`) draws more
    than twice the dataset (and the sampler's own length) before it would end, and is then read
    on lazily instead of listed whole."""
    sizes = [n for n in (_len(loader.dataset), _len(_sampler(loader)), _len(loader.sampler)) if n is not None]
    bound = 2 * max(sizes) + 1 if sizes else None
    items, drawn = [], 0
    for item in source:
        items.append(item)
        drawn += len(item) if isinstance(item, (list, tuple)) else 1
        if bound is not None and drawn > bound:
            return items, True
    return items, False


def _patch_loaders() -> None:
    init, base_init, reset = _dl.DataLoader.__init__, _dl._BaseDataLoaderIter.__init__, _dl._BaseDataLoaderIter._reset

    def loader_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._tm_verify_site = _where()

    def iter_init(self, loader, *args, **kwargs):
        base_init(self, loader, *args, **kwargs)
        self._sampler_iter = _batches(loader, self._sampler_iter)

    def iter_reset(self, loader, *args, **kwargs):  # worker loaders read the sampler again here
        reset(self, loader, *args, **kwargs)
        self._sampler_iter = _batches(loader, self._sampler_iter)

    _dl.DataLoader.__init__, _dl._BaseDataLoaderIter.__init__ = loader_init, iter_init
    _dl._BaseDataLoaderIter._reset = iter_reset


def _patch_training() -> None:
    opt_init, ddp_init, plateau_step = torch.optim.Optimizer.__init__, DistributedDataParallel.__init__, ReduceLROnPlateau.step

    def optimizer_init(self, *args, **kwargs):
        opt_init(self, *args, **kwargs)
        _optimizers.append((self, _where()))

    def ddp_module_init(self, module, *args, **kwargs):
        ddp_init(self, module, *args, **kwargs)
        _ddp.append((module, _where()))

    def stepped(optimizer, args, kwargs):
        record["steps"] += 1
        it = _active.get("it")
        if it is not None:
            it["steps"] += 1
            if it["steps"] == 1:  # the first step of this read: a training epoch begins
                record["epochs"] += 1
                record["short_epochs"] += it["short"]
        record["process_group"] = record["process_group"] or (dist.is_available() and dist.is_initialized())
        _progress("training")

    def plateau(self, metrics, *args, **kwargs):
        try:
            record["plateau"].append({"where": _where(), "value": float(metrics)})
        except Exception:
            _probe_failed("recording ReduceLROnPlateau.step")
        return plateau_step(self, metrics, *args, **kwargs)

    real_backward = torch.autograd.backward

    def backward(*args, **kwargs):  # what `loss.backward()` calls, looked up at each call
        out = real_backward(*args, **kwargs)
        if not _optimizers:  # parameters stepped by hand (no optimizer at all): each backward is a step
            stepped(None, args, kwargs)
        return out

    torch.optim.Optimizer.__init__, DistributedDataParallel.__init__ = optimizer_init, ddp_module_init
    ReduceLROnPlateau.step = plateau
    register_optimizer_step_post_hook(stepped)
    torch.autograd.backward = backward
    _patch_sync_grads()


def _patch_sync_grads() -> None:
    """`tm.sync_grads(model)` averages a model's gradients without DDP (a functional,
    meta-learning model): noted, so its equal parameters are not read as ranks that merely
    repeat each other's work."""
    try:
        import torchmigrate.runtime as runtime
    except Exception:
        return
    real = runtime.sync_grads

    def sync_grads(model, *args, **kwargs):
        record["synced"] = True
        return real(model, *args, **kwargs)

    runtime.sync_grads = sync_grads


def _note_write(path, how: str) -> None:
    try:
        path = os.path.abspath(os.fsdecode(path))
        # (a library that imports lazily writes its bytecode cache on first use: no file of the program)
        if not path.startswith((os.path.abspath(OUT), "/dev/", "/proc/")) and "__pycache__" not in path \
                and not path.endswith(".pyc") and "site-packages" not in path and "dist-packages" not in path:
            record["writes"].setdefault(path, {"path": path, "how": how, "where": _where()})
    except Exception:
        _probe_failed(f"recording a write ({how})")


def _prefixed(obj, depth: int = 0) -> list:
    """Keys of tensors that start with a wrapper's prefix, in dicts however nested in dicts,
    lists, tuples (a named tuple, a list of state dicts) or sets."""
    if depth > 8:
        return []
    if isinstance(obj, dict):
        found = [k for k, v in obj.items() if isinstance(k, str) and k.startswith(PREFIXES) and torch.is_tensor(v)]
        children = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        found, children = [], obj
    else:
        return []
    for v in children:
        found += _prefixed(v, depth + 1)
        if len(found) >= 5:
            break
    return found


def _patch_files() -> None:
    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            _note_write(file, "open")
        return _open(file, mode, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        try:
            path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
            record["saves"].append({"path": path if isinstance(path, str) else repr(f), "where": _where(),
                                    "prefixed": _prefixed(obj)[:5]})
            if isinstance(f, (str, os.PathLike)):
                _note_write(f, "torch.save")
        except Exception:
            _probe_failed("recording a torch.save")
        return _save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            record["loads"].append(os.path.abspath(os.fsdecode(f)))
        return _load(f, *args, **kwargs)

    def moved(move):
        def rename(src, dst, *args, **kwargs):  # a temp file renamed into place writes dst
            if isinstance(src, (str, bytes, os.PathLike)) and isinstance(dst, (str, bytes, os.PathLike)):
                _note_write(dst, "rename")
                _renamed[os.path.abspath(os.fsdecode(src))] = os.path.abspath(os.fsdecode(dst))
            return move(src, dst, *args, **kwargs)
        return rename

    builtins.open = io.open = open_
    os.replace, os.rename = moved(_replace), moved(_rename)
    torch.save = torch.serialization.save = save
    torch.load = torch.serialization.load = load


def _digest(params) -> str:
    """A hash of the tensors' values, with torch alone (numpy is not a dependency)."""
    digest = hashlib.sha256()
    for p in params:
        t = p.detach().cpu().float().contiguous()
        digest.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b"")
    return digest.hexdigest()


def _summarise() -> None:
    in_ddp = {id(p) for module, _ in _ddp for p in module.parameters()}
    for optimizer, where in _optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        record["optimizers"].append({
            "name": type(optimizer).__name__, "where": where, "hash": _digest(params),
            "lrs": [float(group["lr"]) for group in optimizer.param_groups],
            "in_ddp": bool(params) and all(id(p) in in_ddp for p in params)})
    record["ddp"] = [{"where": where, "hash": _digest(module.parameters())} for module, where in _ddp]


def _dump() -> None:
    """Write the record, whatever happened: a failure to summarise is the probe's, recorded."""
    try:
        _summarise()
    except Exception:
        _probe_failed("hashing the parameters")
    if isinstance(record["writes"], dict):
        record["writes"] = [w for path, w in record["writes"].items() if path not in _renamed]
    for save in record["saves"]:
        save["path"] = _renamed.get(save["path"], save["path"])
    path = os.path.join(OUT, f"rank{record['rank']}.json")
    with _open(path + ".tmp", "w") as handle:
        json.dump(record, handle, default=str)
    _replace(path + ".tmp", path)


def _user_traceback(exc: BaseException) -> list:
    """The last frames of the traceback that lie in the user's files, as `path:line in function`."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user(f.filename)][-4:]
    return [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames]


def _terminated(signum, frame) -> None:
    """torchrun (another rank failed) or verify's --timeout stops this rank: say where it was."""
    record.update(status="terminated", exit_code=128 + signum, error={"where": _where(frame)})
    _dump()
    os._exit(128 + signum)


_PASS_THROUGH = frozenset({"open_", "save", "load", "rename"})  # `_patch_files`'s wrappers


def _raised_here(exc: BaseException) -> bool:
    """The exception was raised by the probe's own code (its innermost frame is in this file),
    not by the script, torch or a library the script called."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or os.path.abspath(frames[-1].filename) != _THIS_FILE or isinstance(exc, Stopped):
        return False
    # the script's own `open(path)` (`torch.save`, `torch.load`, `os.rename`) passes through the
    # probe's wrapper, which calls the real one last: what that raises (FileNotFoundError of a
    # file another rank has not written yet) is the script's
    innermost = frames[-1]
    return not (innermost.name in _PASS_THROUGH and (innermost.line or "").startswith("return "))


def _prepare(script: str, args: list) -> None:
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    _patch_loaders()
    _patch_training()
    _patch_files()
    signal.signal(signal.SIGTERM, _terminated)
    _progress("started", force=True)


def _ended_by_cut(exc: BaseException) -> bool:
    """The script ran out of batches because the probe shortened the read it was in: it reads a
    loader with `next()` a fixed number of times (`for _ in range(len(loader)): next(it)`), and
    the shortened epoch ended first. A stop of the probe's making, like `Stopped`."""
    stop = isinstance(exc, StopIteration) or (isinstance(exc, RuntimeError) and "StopIteration" in str(exc))
    return stop and bool(_active.get("cut"))


def _crashed(exc: BaseException) -> None:
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        record.update(status="exited", exit_code=code or 0)
        return
    record.update(status="probe_failed" if _raised_here(exc) else "crashed", exit_code=1, error={
        "where": _where(tb=exc.__traceback__), "message": f"{type(exc).__name__}: {exc}",
        "traceback": _user_traceback(exc)})
    if record["status"] == "probe_failed":
        record["probe_errors"].append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]).strip())


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    try:
        _prepare(script, args)
    except Exception as exc:
        _probe_failed("setting up")
        record.update(status="probe_failed", exit_code=1, error={"where": None, "message": f"{type(exc).__name__}: {exc}",
                                                                  "traceback": []})
        _dump()
        raise
    try:
        runpy.run_path(script, run_name="__main__")
        record.update(status="finished", exit_code=0)
    except BaseException as exc:
        if not (isinstance(exc, Stopped) or _ended_by_cut(exc)):
            _crashed(exc)
            raise
        record.update(status="stopped", exit_code=0)
        _progress("stopped", force=True)
        if dist.is_available() and dist.is_initialized():  # every rank stops at the same point
            dist.barrier()
            dist.destroy_process_group()
    finally:
        _progress(record["status"] or "ended", force=True)
        _dump()


if __name__ == "__main__":
    main()

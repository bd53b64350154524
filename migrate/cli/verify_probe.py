"""The probe `torchmigrate verify` runs each torchrun worker through:
`python -m torchmigrate.cli.verify_probe SCRIPT ARGS...` (only ever in the child processes; this
module imports torch, the CLI never imports it).

It patches torch and `open` before the script runs, then runs the script as `__main__` (like
`python SCRIPT`), so nothing is written into the user's files. It records what the checks in
`torchmigrate.cli.verify_checks` judge, and writes `rank<R>.json` into `$TM_VERIFY_DIR` when the
script ends, however it ends:
- the indices every DataLoader iteration draws (its whole epoch, read from the sampler before the
  first batch) and how many optimizer steps ran while it was the loader being read; a loader read
  while optimizers step is a training loader;
- a hash of the parameters and the learning rates of every optimizer, and of every DDP module;
- every file opened for writing and every `torch.save` (with any `module.`/`_orig_mod.` keys);
- every `torch.load` path, and `ReduceLROnPlateau.step` arguments (the usual per-rank metric);
- how the script ended, with the user's `file:line` where it stopped.

It also stops the run symmetrically: a training loader ends after `$TM_VERIFY_STEPS` optimizer
steps, and the `$TM_VERIFY_EPOCHS`+1-th read of a training loader raises `SystemExit(0)` on every
rank at the same point of the program, so collectives stay matched.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import io
import json
import os
import runpy
import signal
import sys
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
ROOT = os.path.abspath(os.environ.get("TM_VERIFY_ROOT", "."))
_OWN = tuple(os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin)) + os.sep
             for name in ("torchmigrate", "torchmigrate.runtime"))  # the runtime is not user code
_open, _save, _load, _replace, _rename = builtins.open, torch.save, torch.load, os.replace, os.rename

record: dict = {"rank": int(os.environ.get("RANK", "0")), "status": None, "exit_code": None,
                "error": None, "steps": 0, "process_group": False, "loaders": {}, "optimizers": [], "ddp": [],
                "writes": {}, "saves": [], "loads": [], "plateau": []}
_optimizers: list = []
_ddp: list = []
_active: dict = {}  # the loader iteration that yielded the latest batch
_renamed: dict = {}  # temp file -> the path it was renamed to (an atomic save)


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
        "dataset_len": _len(loader.dataset),
        "drop_last": bool(loader.drop_last or getattr(sampler, "drop_last", False)),
        "iterations": []})


def _len(dataset):
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset without __len__
        return None


def _batches(loader, source):
    """Stand-in for a DataLoader iterator's sampler iterator: records the epoch's indices, ends a
    training read after STEPS optimizer steps, and stops the program before a read beyond EPOCHS."""
    entry = _loader(loader)
    trained = sum(1 for it in entry["iterations"] if it["steps"])
    if EPOCHS and trained >= EPOCHS:
        raise Stopped()
    mapped = loader._dataset_kind == _dl._DatasetKind.Map
    items = list(source) if mapped else None
    it = {"indices": _flat(items) if mapped else None, "steps": 0, "batches": 0,
          "epoch": getattr(_sampler(loader), "epoch", None)}
    entry["iterations"].append(it)
    for batch in (items if mapped else source):
        if STEPS and it["steps"] >= STEPS:
            return
        _active["it"] = it
        it["batches"] += 1
        yield batch


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
        if "it" in _active:
            _active["it"]["steps"] += 1
        record["process_group"] = record["process_group"] or (dist.is_available() and dist.is_initialized())

    def plateau(self, metrics, *args, **kwargs):
        record["plateau"].append({"where": _where(), "value": float(metrics)})
        return plateau_step(self, metrics, *args, **kwargs)

    torch.optim.Optimizer.__init__, DistributedDataParallel.__init__ = optimizer_init, ddp_module_init
    ReduceLROnPlateau.step = plateau
    register_optimizer_step_post_hook(stepped)


def _note_write(path, how: str) -> None:
    path = os.path.abspath(os.fsdecode(path))
    if not path.startswith((os.path.abspath(OUT), "/dev/", "/proc/")):
        record["writes"].setdefault(path, {"path": path, "how": how, "where": _where()})


def _prefixed(obj, depth: int = 0) -> list:
    """Keys of tensors in (nested) dicts that start with a wrapper's prefix."""
    if depth > 4 or not isinstance(obj, dict):
        return []
    found = [k for k, v in obj.items() if isinstance(k, str) and k.startswith(PREFIXES) and torch.is_tensor(v)]
    for v in obj.values():
        found += _prefixed(v, depth + 1)
    return found


def _patch_files() -> None:
    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            _note_write(file, "open")
        return _open(file, mode, *args, **kwargs)

    def save(obj, f, *args, **kwargs):
        path = os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        record["saves"].append({"path": path if isinstance(path, str) else repr(f), "where": _where(),
                                "prefixed": _prefixed(obj)[:5]})
        if isinstance(f, (str, os.PathLike)):
            _note_write(f, "torch.save")
        return _save(obj, f, *args, **kwargs)

    def load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            record["loads"].append(os.path.abspath(os.fspath(f)))
        return _load(f, *args, **kwargs)

    def moved(move):
        def rename(src, dst, *args, **kwargs):  # a temp file renamed into place writes dst
            _note_write(dst, "rename")
            _renamed[os.path.abspath(os.fsdecode(src))] = os.path.abspath(os.fsdecode(dst))
            return move(src, dst, *args, **kwargs)
        return rename

    builtins.open = io.open = open_
    os.replace, os.rename = moved(_replace), moved(_rename)
    torch.save = torch.serialization.save = save
    torch.load = torch.serialization.load = load


def _digest(params) -> str:
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.detach().cpu().contiguous().float().numpy().tobytes())
    return digest.hexdigest()


def _dump() -> None:
    in_ddp = {id(p) for module, _ in _ddp for p in module.parameters()}
    for optimizer, where in _optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        record["optimizers"].append({
            "name": type(optimizer).__name__, "where": where, "hash": _digest(params),
            "lrs": [float(group["lr"]) for group in optimizer.param_groups],
            "in_ddp": bool(params) and all(id(p) in in_ddp for p in params)})
    record["ddp"] = [{"where": where, "hash": _digest(module.parameters())} for module, where in _ddp]
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


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would have it
    _patch_loaders()
    _patch_training()
    _patch_files()
    signal.signal(signal.SIGTERM, _terminated)
    try:
        runpy.run_path(script, run_name="__main__")
        record.update(status="finished", exit_code=0)
    except Stopped:
        record.update(status="stopped", exit_code=0)
        if dist.is_available() and dist.is_initialized():  # every rank stops at the same point
            dist.barrier()
            dist.destroy_process_group()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        record.update(status="exited", exit_code=code or 0)
        raise
    except BaseException as exc:
        record.update(status="crashed", exit_code=1, error={
            "where": _where(tb=exc.__traceback__), "message": f"{type(exc).__name__}: {exc}",
            "traceback": _user_traceback(exc)})
        raise
    finally:
        _dump()


if __name__ == "__main__":
    main()

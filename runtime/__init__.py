"""torchmigrate runtime shim: the few helpers a script migrated to torchrun + DDP + AMP calls.

Migrated scripts do ``import torchmigrate.runtime as tm`` (or, after ``--vendor-runtime``,
``import torchmigrate_runtime as tm``: this file is self-contained and needs only torch).
Importing it initialises nothing: no process group, no CUDA context.

Environment contract, read in this order:

1. torchrun / torch.distributed.launch: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
   ``MASTER_PORT`` (``RANK`` or ``LOCAL_RANK`` present means "launched by torchrun").
2. SLURM (``srun python train.py``), only when the torchrun variables are absent and both
   ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set: rank = ``SLURM_PROCID``, local rank =
   ``SLURM_LOCALID``, world size = ``SLURM_NTASKS``; master address = ``MASTER_ADDR`` or the first
   host of ``SLURM_JOB_NODELIST`` (else 127.0.0.1); master port = ``MASTER_PORT`` or
   ``15000 + SLURM_JOB_ID % 20000`` (else 29500). ``setup()`` exports them as the torchrun names.
   Running ``python train.py`` directly inside a multi-task allocation (no ``srun``) would make
   the process wait for peers that never start: launch with ``srun`` or torchrun.
3. Neither: one process, rank 0, world size 1, no process group.

``TORCHMIGRATE_BACKEND`` overrides the process-group backend (default nccl with CUDA, else gloo).
``TORCHMIGRATE_AMP`` in {auto, bf16, fp16, off} picks the autocast dtype (see ``amp_dtype``).

A process group is created only when world size > 1 (as Accelerate): ``torchrun
--nproc-per-node=1`` behaves like ``python train.py``. Only ``setup``, ``wrap_model``, ``cleanup``,
``barrier``, ``main_process_first``, ``all_reduce``, ``gather_for_metrics``, ``gather_list``, ``reduce_meter``,
``shard_mean`` and (on its first pass over an iterator) ``shard_batches`` communicate; every other
helper is collective-free and safe inside ``if tm.is_main():`` blocks.
"""
from __future__ import annotations

import atexit
import collections
import builtins
import contextlib
import copy
import datetime
import functools
import gc
import hashlib
import importlib
import io
import itertools
import logging
import numbers
import operator
import os
import pickle
import random
import re
import sys
import threading
import types
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, RandomSampler, Sampler, SequentialSampler

__all__ = [
    "Ctx", "setup", "cleanup", "device", "rank", "local_rank", "world_size", "is_main",
    "is_distributed", "wrap_model", "unwrap", "sampler", "eval_sampler", "sharded", "set_epoch", "no_sync",
    "amp_dtype", "autocast", "GradScaler", "print", "input", "bar_stream", "barrier", "all_reduce", "gather_for_metrics", "gather_list", "broadcast_object", "shared_generator", "grad", "any_rank", "all_ranks", "share_params", "sync_grads", "shard_stream",
    "shard_sampler", "reduce_meter", "reduce_batch_total", "per_rank_batch", "batch_rows", "sync_batchnorm", "synced", "to_float32",
    "save", "load", "strip_prefix", "load_state_dict", "seed_everything", "seed_per_rank", "main_only", "main_process_first", "goes_first",
    "shard_range", "rank_part", "shard_indices", "shard_mean", "shard_batches", "agreed", "on_main", "move_into_place", "to_device", "as_device", "device_arg", "all_rows",
    "set_device", "data_parallel", "same_draws", "visible_devices", "gpu_ids", "parallel_part", "ParallelPart", "unsharded",
    "fill_value", "replicas", "gather_rows",
]


@dataclass(frozen=True)
class Ctx:
    """What ``setup()`` found: global rank, rank on this node, process count, device, rank 0?"""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    is_main: bool


_CTX: Ctx | None = None
_OWN_PG = False  # True when setup() created the process group (so cleanup() destroys it)
_GROUPS_MADE = 0  # process groups setup() has created in this process (see _restart_store)
_FAILED = False  # an uncaught exception is ending this process (set by the failure hook)
_AT_EXIT = False  # cleanup() is registered to run at interpreter exit
_LOG_DISABLED = False
_ON_CPU = False  # setup(device="cpu"): this process computes on the CPU even where CUDA is available
_DDP_WRAPPERS: list = []  # weak references to wrap_model's DDPs, oldest first; released by cleanup()


def _first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: ``node[01-04],b7`` -> ``node01``; ``a[3,5]-ib`` -> ``a3-ib``.
    """
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    host = nodelist[:end].strip()
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], host)


def _env() -> dict:
    """Rank/world/master info from the torchrun variables, else SLURM's, else one process."""
    e = os.environ
    if "RANK" in e or "LOCAL_RANK" in e:
        return {"RANK": int(e.get("RANK", e.get("LOCAL_RANK", "0"))), "slurm": False,
                "LOCAL_RANK": int(e.get("LOCAL_RANK", "0")),
                "WORLD_SIZE": int(e.get("WORLD_SIZE", "1"))}
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e:
        job = e.get("SLURM_JOB_ID", "")
        port = e.get("MASTER_PORT") or str(15000 + int(job) % 20000 if job.isdigit() else 29500)
        addr = e.get("MASTER_ADDR") or _first_host(e.get("SLURM_JOB_NODELIST", "")) or "127.0.0.1"
        return {"RANK": int(e["SLURM_PROCID"]), "LOCAL_RANK": int(e.get("SLURM_LOCALID", "0")),
                "WORLD_SIZE": int(e["SLURM_NTASKS"]), "MASTER_ADDR": addr, "MASTER_PORT": port,
                "slurm": True}
    return {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "slurm": False}


def _pg() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank: from the process group if one exists, else from the environment (0 alone)."""
    return dist.get_rank() if _pg() else _env()["RANK"]


def local_rank() -> int:
    """Rank on this node (``LOCAL_RANK`` / ``SLURM_LOCALID``); 0 for one process. Picks the GPU."""
    return _CTX.local_rank if _CTX else _env()["LOCAL_RANK"]


def world_size() -> int:
    """Number of processes: from the process group if one exists, else the environment (1 alone)."""
    return dist.get_world_size() if _pg() else _env()["WORLD_SIZE"]


def is_main() -> bool:
    """True on global rank 0 (always true for one process). Collective-free, safe under guards."""
    return rank() == 0


def is_distributed() -> bool:
    """True when world size > 1, i.e. when DDP wrapping and collectives are really needed."""
    return world_size() > 1


def device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (modulo the visible GPU count, for SLURM jobs
    that give each task one GPU), else ``cpu``; ``cpu`` too after ``setup(device="cpu")`` or
    with ``TORCHMIGRATE_DEVICE=cpu``. Does not create a CUDA context."""
    return _CTX.device if _CTX is not None else _rank_device()


def gpu_ids() -> list:
    """The GPU indices this process may use: ``[LOCAL_RANK's GPU]`` when distributed (one GPU per
    rank), every visible GPU in one process (``list(range(torch.cuda.device_count()))``, what a
    single-GPU program's DataParallel ``device_ids`` or ``f"cuda:{ids[0]}"`` reads), ``[]`` on
    CPU ranks. For a program that keeps a list of its GPUs instead of one device."""
    dev = device()
    if dev.type != "cuda":
        return []
    if is_distributed():
        return [dev.index]
    return list(range(torch.cuda.device_count()))


def _rank_device() -> torch.device:
    """The device ``setup()`` gives this process (see ``device``)."""
    if _ON_CPU or os.environ.get("TORCHMIGRATE_DEVICE", "").strip().lower() == "cpu" \
            or torch.cuda.device_count() == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))


def _require_pg() -> None:
    """Make sure a process group exists where one is needed: ``setup()`` on first use, so a
    helper called before the program's own ``tm.setup()`` (or after a ``tm.cleanup()`` that ran
    too early, such as one at module level of an imported module) still works."""
    if not _pg():
        setup()


def _check_gpu_per_process() -> None:
    """NCCL refuses two processes on one GPU, but only inside ``init_process_group``, with
    "Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60" (seen on an H100 with NCCL
    2.28). torchrun's ``LOCAL_WORLD_SIZE`` says how many processes share this node, so say what to
    change before that. SLURM tasks usually see one GPU each and have no such variable."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    gpus = torch.cuda.device_count()
    if local > gpus:
        raise RuntimeError(
            f"torchmigrate.runtime: {local} processes on this node share {gpus} visible GPU(s), "
            f"and NCCL needs one GPU per process: launch with --nproc-per-node={gpus} (or fewer), "
            "or set TORCHMIGRATE_BACKEND=gloo to share the GPU(s), e.g. for a test run")


def _restart_store(env: dict, timeout) -> dict:
    """``init_process_group`` arguments that keep a torchrun restart from reading the previous
    attempt's rendezvous.

    Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) the workers' store is the agent's,
    which outlives a failed attempt. Measured with torch 2.13 and ``--max-restarts=1`` after a
    rank was killed: the restarted rank 0 read the dead rank's gloo address left in that store
    and failed with "Gloo connectFullMesh failed ... Connection refused", so the restart never
    trained. Keys under a prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) cannot collide.
    Elsewhere: no arguments (torch's own ``env://`` rendezvous).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    wait = timeout or datetime.timedelta(minutes=30)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=wait)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    # A group set up again after cleanup() (lazily, by a helper that needs one) gets keys of its
    # own too: every rank counts its set-ups alike, so the ranks agree on the prefix.
    return {"store": dist.PrefixStore(f"torchmigrate/attempt_{attempt}/group_{_GROUPS_MADE}", store),
            "rank": env["RANK"], "world_size": env["WORLD_SIZE"]}


def _same_hash_seed(env: dict, caller) -> None:
    """Every rank hashes strings alike. Each Python process salts ``hash(str)`` at random, so
    under torchrun each rank iterates a set of strings in its own order: a vocabulary or a label
    map built from ``list(set(words))`` gives each rank other ids for the same words (DDP then
    averages rows that mean different words), and a split by ``hash(name) % 10`` gives each rank
    other data. Only the start of a process can choose the salt, so the first ``setup()``, called
    by the program itself (the line the migration puts at its top), starts the process again in
    place (same PID, same command line) with ``PYTHONHASHSEED`` set alike on every rank: from
    torchrun's run id (SLURM's job id, else the rendezvous address), so it still differs from
    run to run. Not where the program sets ``PYTHONHASHSEED`` itself, for ``python -c`` or an
    interactive session, on Windows, or with ``TORCHMIGRATE_SAME_HASH=0``."""
    if os.environ.get("PYTHONHASHSEED", "random") != "random" or os.environ.get("TORCHMIGRATE_SAME_HASH") == "0":
        return
    argv = getattr(sys, "orig_argv", None)  # Python >= 3.10: the command line as given, `-m` included
    main = sys.modules.get("__main__")
    if os.name == "nt" or not argv or not getattr(main, "__file__", None) or _in_worker_process() \
            or caller is None or os.path.normcase(os.path.abspath(caller.f_code.co_filename)) == _RUNTIME_FILE:
        return  # (a helper of this runtime setting the group up on first use, mid-program: no restart)
    key = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or \
        f"{env.get('MASTER_ADDR', os.environ.get('MASTER_ADDR'))}:{env.get('MASTER_PORT', os.environ.get('MASTER_PORT'))}"
    os.environ["PYTHONHASHSEED"] = str(int(hashlib.sha256(str(key).encode()).hexdigest()[:8], 16) % 4294967295 + 1)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.execv(sys.executable, argv)


def setup(backend: str | None = None, timeout=None, device: str | None = None) -> Ctx:
    """Initialise distributed training once and return a ``Ctx``; later calls return the same Ctx.

    1 process: no process group (also for torchrun with WORLD_SIZE=1), and CUDA is not started
    (GPUs are counted through NVML where it can), so a ``CUDA_VISIBLE_DEVICES`` the program sets
    after ``setup()`` still chooses its GPU, as in the original. gloo (CPU): ``init_process_group("gloo")``. nccl (CUDA): ``torch.cuda.set_device(
    local_rank)`` *before* ``init_process_group("nccl", device_id=device)``, so every rank owns its
    GPU and NCCL initialises eagerly; more processes on the node than visible GPUs is an error
    that says what to change. ``backend`` (or ``TORCHMIGRATE_BACKEND``) overrides the
    choice; ``timeout`` is seconds or a ``timedelta``. A process group created by the user's own
    code is reused. On ranks other than 0, ``logging.disable(logging.INFO)`` silences INFO and
    DEBUG records so ``logging.info`` prints once; warnings and errors still show on every rank.
    With a process group, an uncaught exception on one rank is named on every rank (see
    ``_install_failure_hook``), and a torchrun restart gets a rendezvous of its own (see
    ``_restart_store``); a ``MASTER_PORT`` already in use is an error that says so. The first
    process group it creates gives every rank rank 0's random streams (``_share_random_streams``),
    so what the program draws before training starts agrees across ranks, as in the original.

    ``device="cpu"`` (what ``torchmigrate ddp`` passes to a program that names no device
    anywhere, so every tensor it makes stays on the CPU): ``device()`` is the CPU for the rest of
    the process, also on a GPU host, and the group is gloo, so ``wrap_model`` keeps the model
    beside the program's tensors. ``TORCHMIGRATE_DEVICE=cpu`` does the same for any program.
    """
    global _CTX, _OWN_PG, _LOG_DISABLED, _GROUPS_MADE, _AT_EXIT, _ON_CPU
    choice = device if device is not None else os.environ.get("TORCHMIGRATE_DEVICE")
    if choice is not None:
        if str(choice).strip().lower() != "cpu":
            raise ValueError(f"torchmigrate.runtime: setup(device={choice!r}): only 'cpu' can be chosen "
                             "(by default each rank takes its own GPU, cuda:LOCAL_RANK, where CUDA is available)")
        if not _ON_CPU and _CTX is not None and _CTX.device.type != "cpu":
            raise RuntimeError("torchmigrate.runtime: setup(device='cpu') after the process was set up on "
                               f"{_CTX.device}: call it first, before any other torchmigrate helper")
        _ON_CPU = True
    if _CTX is not None and (_pg() or not _CTX.world_size > 1):
        return _CTX
    env = _env()
    if _CTX is None and env["WORLD_SIZE"] > 1 and not _pg():
        _same_hash_seed(env, sys._getframe(1))
    if env["slurm"]:
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ[k] = str(env[k])
    dev = _rank_device()
    if dev.type == "cuda" and env["WORLD_SIZE"] > 1:
        torch.cuda.set_device(dev)
    if env["WORLD_SIZE"] > 1 and not _pg():
        backend = backend or os.environ.get("TORCHMIGRATE_BACKEND") or (
            "nccl" if dev.type == "cuda" else "gloo")
        if "nccl" in backend and dev.type == "cuda":
            _check_gpu_per_process()
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        try:
            dist.init_process_group(backend, timeout=timeout, **_restart_store(env, timeout),
                                    device_id=dev if dev.type == "cuda" and "nccl" in backend else None)
        except RuntimeError as exc:  # DistNetworkError is a RuntimeError
            if "EADDRINUSE" not in str(exc) and "address already in use" not in str(exc).lower():
                raise
            raise RuntimeError(
                f"torchmigrate.runtime: MASTER_PORT {os.environ.get('MASTER_PORT')} on "
                f"{os.environ.get('MASTER_ADDR')} is already in use (another job, or a previous run "
                "still alive): pick a free port (torchrun --master-port=N, or export MASTER_PORT=N "
                "before srun)") from exc
        _OWN_PG = True
        _GROUPS_MADE += 1
        _install_failure_hook(rank())
        if _GROUPS_MADE == 1:
            _share_random_streams()
        if not _AT_EXIT:
            atexit.register(_cleanup_at_exit)
            _AT_EXIT = True
    _CTX = Ctx(rank(), env["LOCAL_RANK"], world_size(), dev, rank() == 0)
    if _CTX.world_size > 1 and not _CTX.is_main:
        _hydra_quiet_on_other_ranks()
    if not _CTX.is_main and not _LOG_DISABLED:
        logging.disable(logging.INFO)
        _LOG_DISABLED = True
    if _CTX.world_size > 1:
        _watch_writes()
        _wait_for_saves()
    return _CTX


_HYDRA_QUIET = ("hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled")


def _hydra_quiet_on_other_ranks() -> None:
    """On ranks other than 0 of a Hydra program (a ``@hydra.main`` function in ``__main__``, which
    ``setup()`` runs before): Hydra's copies of the config (``.hydra/*.yaml``) and its log files
    are left to rank 0, by the overrides ``hydra.output_subdir=null hydra/job_logging=disabled
    hydra/hydra_logging=disabled`` added to ``sys.argv`` (those the command line sets itself are
    kept). The run folder itself is the launch line's to fix (``hydra.run.dir=...``)."""
    main = sys.modules.get("__main__")
    marker = os.path.join("hydra", "main.py")
    if main is None or not any(getattr(getattr(f, "__code__", None), "co_filename", "").endswith(marker)
                               for f in list(vars(main).values()) if callable(f)):
        return
    given = {a.split("=", 1)[0].lstrip("+~") for a in sys.argv[1:]}
    sys.argv.extend(a for a in _HYDRA_QUIET if a.split("=", 1)[0] not in given)


_PER_RANK_STREAMS = False  # seed_per_rank() or seed_everything(per_rank=True) set the ranks apart


def _share_random_streams() -> None:
    """At the first set-up, every rank takes rank 0's random streams (``random``, numpy, torch's
    CPU generator and, where CUDA is up, its GPU's): whatever the program draws before training
    starts (a dataset generated at random, an unseeded shuffle or split, a noise batch drawn
    once, weights) is then the same on every rank, as in the one process of the original,
    seeded or not. ``tm.seed_per_rank()`` sets the ranks apart once training starts. Not after
    per-rank seeding, and not in a process group the program made itself."""
    if _PER_RANK_STREAMS or not _pg():
        return
    try:
        import numpy as np
    except ImportError:
        np = None
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    # torch's states as lists of bytes: a pickled tensor would go through torch.save
    mine = (random.getstate(), np.random.get_state() if np else None,
            torch.random.default_generator.get_state().tolist(), torch.cuda.get_rng_state().tolist() if cuda else None)
    shared = _broadcast_small(mine)
    if rank() == 0:
        return
    py, numpy_state, cpu, gpu = shared
    random.setstate(py)
    if np is not None and numpy_state is not None:
        np.random.set_state(numpy_state)
    torch.random.default_generator.set_state(torch.tensor(cpu, dtype=torch.uint8))
    if cuda and gpu is not None:
        torch.cuda.set_rng_state(torch.tensor(gpu, dtype=torch.uint8))


def _broadcast_small(value):
    """Rank 0's ``value`` (a few KiB, picklable) on every rank, through tensors: unlike
    ``broadcast_object_list``, which reads its bytes back through numpy, it works on the
    runtime's minimal install (torch only)."""
    dev = device() if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    data = pickle.dumps(value) if rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=dev)
    dist.broadcast(size, 0)
    if rank() == 0:
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev), 0)
        return value
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(buf, 0)
    return pickle.loads(bytes(buf.cpu().tolist()))


_FAILED_KEY = "torchmigrate/failed_rank"
_PREVIOUS_HOOK = None  # sys.excepthook before setup() installed its own


def _install_failure_hook(me: int) -> None:
    """Make an uncaught exception on one rank name that rank on every rank.

    Without it, the rank that failed prints its traceback and exits, and the others stop in
    their next collective with gloo's "Connection closed by peer" (or NCCL's timeout), which
    names no rank; torchrun's agent terminates them (SIGTERM) within a few seconds, and without
    torchrun (srun) each fails at its next collective. The hook chains to the previous
    ``sys.excepthook`` (the traceback is printed as before), then records the first failure in
    the process group's store and prints ``torchmigrate.runtime: rank N failed (...)`` on the
    failing rank and ``rank M stopped because rank N failed (...)`` on a rank whose collective
    broke because of it. It never blocks for long: the store is asked with a 5 s timeout.
    ``cleanup()`` puts the previous hook back.
    """
    global _PREVIOUS_HOOK
    previous = _PREVIOUS_HOOK = sys.excepthook

    def hook(exc_type, exc, tb):
        global _FAILED
        _FAILED = True
        previous(exc_type, exc, tb)
        what = f"{exc_type.__name__}: {exc}".splitlines()[0][:300]
        first = f"{me}\t{what}"
        with contextlib.suppress(Exception):
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=5))
            first = store.compare_set(_FAILED_KEY, "", first).decode("utf-8", "replace")
        who, _, why = first.partition("\t")
        line = (f"rank {me} failed ({why})" if who == str(me)
                else f"rank {me} stopped because rank {who} failed ({why})")
        with contextlib.suppress(Exception):
            sys.stderr.write(f"torchmigrate.runtime: {line}\n")
            sys.stderr.flush()

    sys.excepthook = hook


def _plain_forward(self, *inputs, **kwargs):
    return self.module(*inputs, **kwargs)


def _release_ddp(ddp: DistributedDataParallel) -> None:
    """Drop what ties a DDP wrapper to the process group, leaving a plain pass-through wrapper.

    DDP's C++ ``reducer`` (also held by its ``logger``) owns references to the process group and
    to gradient hooks on every parameter. While the user's script still holds the wrapper (a
    module-level ``model``), that Reducer lives on past ``destroy_process_group()`` and is only
    freed during interpreter shutdown, and gloo then sometimes aborts a rank at exit ("terminate
    called without an active exception"; measured: freeing the wrapper before the teardown
    avoids it). Dropping the Reducer also removes its autograd hooks. Afterwards the wrapper's
    ``forward`` calls ``self.module`` directly (no gradient all-reduce, no buffer broadcast), so
    ``model(x)``, ``model.module``, ``state_dict()`` and even local backward passes keep working
    in this one process; DDP-specific methods (``join``, comm hooks) do not.
    """
    ddp.require_backward_grad_sync = False  # also turns off the python reducer's grad hooks
    for handle in ddp.__dict__.get("_tm_hooks", ()):
        handle.remove()
    for handle in getattr(ddp, "_accum_grad_hooks", ()):
        handle.remove()
    for name in ("_accum_grad_hooks", "_comm_hooks"):
        if isinstance(getattr(ddp, name, None), list):
            setattr(ddp, name, [])
    ddp.__dict__.pop("buffer_hook", None)  # a buffer comm hook's state may hold the group
    ddp.forward = types.MethodType(_plain_forward, ddp)
    ddp.reducer = ddp.logger = ddp.process_group = None


def cleanup() -> None:
    """Destroy the process group ``setup()`` created (no-op without one; safe to call twice) and
    re-enable logging on non-main ranks. A later ``setup()`` starts afresh.

    On a normal exit the ranks first meet at a barrier: a rank that tears the group down while
    another is still saving can abort gloo ("terminate called without an active exception").
    Then the DDP wrappers made by ``wrap_model`` are released (see ``_release_ddp``: their C++
    Reducer, kept alive by the script's own ``model`` variable, is what otherwise outlives the
    group and can abort gloo at interpreter exit) and ``gc.collect()`` runs before the group is
    destroyed. The wrappers stay usable for plain forward passes in this process.
    While an exception is propagating there is no barrier and no release (the other ranks may
    never come, and a Reducer may be mid-backward): the group is just destroyed.

    Misplaced calls cannot end training early: a ``cleanup()`` at module level of a module that
    is imported (not run as ``__main__``) runs at import time, before the program trains; it is
    deferred to the interpreter's exit, where ``setup()`` registered a cleanup anyway. Before the
    group goes, the runtime's checks compare the wrapped models' parameters across ranks once
    more (see ``_check_drift``).
    """
    global _CTX, _OWN_PG, _LOG_DISABLED, _PREVIOUS_HOOK
    if _OWN_PG and _pg() and _called_at_import(sys._getframe(1)):
        return
    _finish(clean=sys.exc_info()[0] is None and not _FAILED)


def _called_at_import(frame) -> bool:
    """The caller is the top level of a module being imported (not the ``__main__`` script)."""
    return frame is not None and frame.f_code.co_name == "<module>" \
        and frame.f_globals.get("__name__") not in ("__main__", None)


def _cleanup_at_exit() -> None:
    """``cleanup()`` at interpreter exit, for a program whose own cleanup never ran (or was
    deferred). After an uncaught exception there is no barrier: the other ranks may never come."""
    if _OWN_PG and _pg():
        _finish(clean=not _FAILED)


def _finish(clean: bool) -> None:
    global _CTX, _OWN_PG, _LOG_DISABLED, _PREVIOUS_HOOK
    if _PREVIOUS_HOOK is not None and clean:
        sys.excepthook, _PREVIOUS_HOOK = _PREVIOUS_HOOK, None
    if _OWN_PG and _pg():
        if clean:
            for ddp in _wrappers_alive_everywhere():
                _check_drift(ddp, "at the end of the run")
            try:
                barrier()
            except Exception:  # a peer already gone: tear down anyway
                pass
            for ddp in _live_wrappers():
                with contextlib.suppress(Exception):
                    _release_ddp(ddp)
            _DDP_WRAPPERS.clear()
            _BUFFER_MODELS.clear()
            gc.collect()
        dist.destroy_process_group()
    if _LOG_DISABLED:
        logging.disable(logging.NOTSET)
    _CTX, _OWN_PG, _LOG_DISABLED = None, False, False


def wrap_model(model: nn.Module, *, find_unused_parameters: bool = False, sync_bn: bool = False,
               data_parallel: bool = False, loss_reduction: str = "mean", move: bool = True,
               **ddp_kwargs) -> nn.Module:
    """Move ``model`` to ``device()`` and wrap it in DistributedDataParallel when distributed.

    ``move=False`` (what ``torchmigrate ddp`` passes where the program moves its model to the GPU
    only under a test, ``if not args.no_cuda: model.cuda()``): the model stays on the device the
    program put it on, so ``python train.py --no_cuda`` on a GPU machine still runs on the CPU (a
    model on another rank's GPU still moves to this rank's).
    Distributed with NCCL, a model left on the CPU cannot be wrapped: the error says to use
    ``TORCHMIGRATE_BACKEND=gloo``.

    1 process, or a model without trainable parameters (frozen teacher, EMA copy): returned
    unwrapped on the device (DDP refuses models with nothing to reduce). gloo:
    ``DDP(model, device_ids=None)`` (CPU modules must not pass device ids). nccl: with
    ``sync_bn`` the BatchNorms are converted to SyncBatchNorm first (CUDA only; ignored on CPU,
    where SyncBatchNorm does not run), then ``DDP(model, device_ids=[local_rank])``. A model
    that is already DDP is returned as is, so wrapping twice is harmless; a model that holds an
    already wrapped one (``WithLoss(net)`` after ``net = tm.wrap_model(net)``) holds its module
    instead, so no gradient is reduced twice (the inner wrapper still works when called alone).
    The module of a live wrapper (wrapped by a caller, then wrapped again in the training method it
    was handed to as the bare module) gets that wrapper back: one module, one reducer.

    ``data_parallel=True`` (what ``torchmigrate ddp`` passes where the program used
    ``nn.DataParallel``): in one process the model stays in ``nn.DataParallel``, as the original
    ran, so code anywhere that reads ``model.module`` keeps working and ``python train.py`` still
    uses every visible GPU (on the CPU DataParallel just calls the module).

    A model the program trains around the wrapper (``tm.unwrap(model).fit(loader, optimizer)``,
    a method of the model whose own loop calls ``self(x)``, so DDP's forward never runs) has its
    gradients averaged across ranks before each optimizer step instead, with one warning naming
    the backward's line: every rank still trains the same model.

    The wrapper never lets a parameter without a gradient stop training (see ``_DDP``): the
    first training step finds out whether every parameter gets one, and where some do not
    (a head the loss never reads, a layer behind a flag that is off) gradients are averaged
    after each backward instead of by DDP's reducer, with one warning naming them.

    ``loss_reduction="sum"`` (what ``torchmigrate ddp`` passes where the program's loss sums over
    its batch, ``reduction="sum"``, and each rank loads its share of the original batch): the
    ranks' gradients are summed instead of averaged, so a step is the original's sum over the
    whole global batch (averaged, it would be 1/world_size of it: a smaller learning rate).

    A dict, list or tuple of models (``nets = {"rep": rep, "left": head}``, trained by one
    optimizer and called by key) has each module wrapped and moved in place (a tuple is
    rebuilt); the container is returned.

    Anything else that is not a module (``None`` on a path where the program builds no such model,
    a project object with its own ``.parameters()``) is returned unchanged: the migration wraps
    names where the analysis cannot prove which value they hold, and the program's own checks
    (``if generator is not None``) must keep seeing what they saw. Distributed, a project object
    that holds the trained module as an attribute (``edm.model``, trained through
    ``edm.train_step(batch)`` calling ``self.model(x)``) gets that attribute wrapped in place
    (each attribute module with trainable parameters that no other one contains), so its forward
    goes through DDP and its gradients are averaged.
    """
    global _DATA_PARALLEL_KEPT
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"wrap_model: loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if isinstance(model, DistributedDataParallel):
        return model
    if isinstance(model, (dict, list, tuple)):
        return _wrap_items(model, lambda m: wrap_model(m, find_unused_parameters=find_unused_parameters,
                                                       sync_bn=sync_bn, data_parallel=data_parallel,
                                                       loss_reduction=loss_reduction, move=move, **ddp_kwargs))
    if not isinstance(model, nn.Module):
        if model is not None and is_distributed():
            _wrap_members(model, lambda m: wrap_model(m, find_unused_parameters=find_unused_parameters, sync_bn=sync_bn,
                                                      data_parallel=data_parallel, loss_reduction=loss_reduction,
                                                      move=move, **ddp_kwargs))
        return model
    if isinstance(model, nn.DataParallel) and is_distributed():
        model = model.module  # a model the program wrapped itself: DDP replaces it
    wrapped = next((d for d in _live_wrappers() if d.module is model), None)
    if wrapped is not None:
        return wrapped
    _unnest(model)
    if move:
        dev = device()
        model = model.to(dev)
    else:
        dev = next((p.device for p in model.parameters()), device())
        if dev.type == "cuda" and dev != device():  # a GPU, but another rank's (`.cuda()` left as it was)
            dev = device()
            model = model.to(dev)
    if not is_distributed():
        if data_parallel and not isinstance(model, nn.DataParallel):
            _DATA_PARALLEL_KEPT = True
            return _ready(_wrapper_class(type(model), _DataParallel, _shadowed(model))(model))
        return model
    if not any(p.requires_grad for p in model.parameters()):
        _watch_buffer_weights(model)
        return model
    _require_pg()
    if dev.type != "cuda" and _nccl():
        raise RuntimeError(
            f"torchmigrate.runtime: {type(model).__name__} stays on {dev}, where the program put it (its move to the "
            "GPU is conditional, e.g. --no_cuda), but the process group uses NCCL, which reduces GPU tensors only: "
            "set TORCHMIGRATE_BACKEND=gloo to train on CPU ranks")
    if sync_bn and dev.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = _wrapper_class(type(model), _DDP, _shadowed(model))(
        model, device_ids=[dev.index] if dev.type == "cuda" else None, find_unused_parameters=find_unused_parameters,
        **ddp_kwargs)
    _ready(ddp)
    _DDP_WRAPPERS.append(weakref.ref(ddp))  # cleanup() releases it before destroying the group
    _watch_steps()  # frozen parameters (`_unfrozen`), parameters trained beside it (`_average_stray`)
    if loss_reduction == "sum" and isinstance(ddp, _DDP):
        ddp._tm_op = "sum"
        ddp.register_comm_hook(None, _sum_hook)
    return ddp


def _wrap_items(items, wrap):
    """A dict, list or tuple of models (``nets = {"rep": rep, "left": head}`` trained by one
    optimizer, each called by its key): each module in it wrapped (and moved) in place, so
    every reference to the dict or list sees the wrapped ones; a tuple is rebuilt. Anything
    else in it stays as it is. Each wrapper's ``state_dict()`` has the plain module's keys."""
    made: dict = {}  # id of a module -> its wrapper: one module kept under two keys is wrapped once

    def once(value):
        if not isinstance(value, nn.Module):
            return value
        if id(value) not in made:
            made[id(value)] = (value, wrap(value))
        return made[id(value)][1]

    if isinstance(items, tuple):
        return type(items)(*map(once, items)) if hasattr(items, "_fields") else tuple(map(once, items))
    for key in list(items) if isinstance(items, dict) else range(len(items)):
        items[key] = once(items[key])
    return items


def _wrap_members(holder, wrap) -> None:
    """``wrap`` each module attribute of a project object that has trainable parameters (not
    a frozen EMA copy), unless another such attribute contains it (wrapping both would reduce
    its gradients twice); nothing where two share parameters only in part."""
    try:
        members = [(name, value) for name, value in vars(holder).items()
                   if isinstance(value, nn.Module) and not isinstance(value, DistributedDataParallel)]
    except TypeError:  # no __dict__ (slots, a builtin): nothing to wrap
        return
    trained = [(name, value, {id(p) for p in value.parameters() if p.requires_grad}) for name, value in members]
    trained = [t for t in trained if t[2]]
    for name, value, params in trained:
        others = [o for n, _, o in trained if n != name]
        if any(params <= o and params != o for o in others) or any(params == o for n, _, o in trained if n < name):
            continue  # inside another one (or the same as one named before): that one is wrapped
        if any(params & o and not (params >= o) for o in others):
            return  # partly shared: which to wrap is not clear, leave them all
        setattr(holder, name, wrap(value))


def _sum_hook(_state, bucket):
    """DDP communication hook: the bucket's gradients summed across ranks (DDP's own divides)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


class _ModuleFace:
    """What both of ``wrap_model``'s wrappers share with the plain model they wrap: ``state_dict()``,
    ``named_parameters()`` and ``named_buffers()`` without the ``module.`` prefix (as the submodule
    of another module, the usual prefixed keys are kept, so the parent's own checkpoints stay
    consistent), an attribute the wrapper lacks looked
    up on the module (``_tm_from_module``), and pickling as the module, through a function of the
    standard library (``operator.getitem((module,), 0)``), so the file loads where torchmigrate is
    not installed. Comes before the torch wrapper class in the bases."""

    def state_dict(self, *args, **kwargs):
        if args or kwargs.get("prefix") or kwargs.get("destination") is not None:
            return super().state_dict(*args, **kwargs)
        return self.module.state_dict(**kwargs)

    def __setattr__(self, name, value):
        """An attribute the module has as plain data (``model.batch_size = n``,
        ``model.hidden_state = h``), or through a property of its class, is set on the module,
        whose forward reads it, as in one process; the wrapper's own attributes (all set while it
        is built, before ``_tm_ready``) stay its own."""
        inner = self.__dict__.get("_modules", {}).get("module") if self.__dict__.get("_tm_ready") else None
        if inner is not None and name not in self.__dict__ and not name.startswith("_") \
                and not hasattr(type(self), name) and (
                name in vars(inner) or isinstance(getattr(type(inner), name, None), property)):
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name.startswith("__"):
                raise
        return self._tm_from_module(inner, name)

    def _tm_from_module(self, inner: nn.Module, name: str):
        return getattr(inner, name)

    def _tm_seen_through(self, name: str) -> bool:
        """`name` is found on the wrapper only through its module (`__getattr__`), not as its own."""
        d = self.__dict__
        return name not in d and not hasattr(type(self), name) and not any(
            name in d.get(k, ()) for k in ("_parameters", "_buffers", "_modules"))

    def register_buffer(self, name, tensor, persistent: bool = True):
        """A buffer of the wrapper's own even where the module has one of that name: a profiler
        that counts per module (thop's `model.apply(lambda m: m.register_buffer("total_ops",
        ...))` reaches the wrapper after its children) would otherwise be told the name exists."""
        if isinstance(name, str) and self._tm_seen_through(name):
            self._buffers[name] = tensor
            (self._non_persistent_buffers_set.discard if persistent else self._non_persistent_buffers_set.add)(name)
            return
        super().register_buffer(name, tensor, persistent)

    def register_parameter(self, name, param):
        """As `register_buffer`, for a parameter."""
        if isinstance(name, str) and param is not None and self._tm_seen_through(name):
            self._parameters[name] = param
            return
        super().register_parameter(name, param)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The module's own names (`layers.0.weight`, not `module.layers.0.weight`), as in one
        process: code that matches parameters by name across models (an EMA copy made from
        `tm.unwrap(model)`, weight decay by name) sees what it saw. DDP itself reads its module's."""
        if prefix or not recurse:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The module's own buffer names, as `named_parameters`."""
        if prefix or not recurse:
            return super().named_buffers(prefix, recurse, remove_duplicate)
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def __reduce_ex__(self, protocol):
        return operator.getitem, ((self.module,), 0)


class _DataParallel(_ModuleFace, nn.DataParallel):
    """The ``nn.DataParallel`` that ``wrap_model(..., data_parallel=True)`` keeps in one process:
    ``model.module`` works as in the original (every visible GPU is used; on the CPU it calls the
    module), and the rest behaves like the plain model, as the DDP wrapper does (``_ModuleFace``):
    its ``state_dict()`` has no ``module.`` prefix, ``load_state_dict`` takes both forms, an
    attribute of the user's class (``model.n_classes``) is found on the module, pickling it
    pickles the module. A program that used DataParallel only behind a flag then loads the same
    checkpoints whether the flag was on or off."""

    def load_state_dict(self, state_dict, strict: bool = True, *args, **kwargs):
        return self.module.load_state_dict(strip_prefix(state_dict), strict, *args, **kwargs)


def _live_wrappers() -> list:
    """wrap_model's DDPs still alive on this rank, oldest first."""
    return [d for d in (ref() for ref in _DDP_WRAPPERS) if d is not None]


def _wrappers_alive_everywhere() -> list:
    """wrap_model's DDPs alive on every rank, oldest first: the ones a collective may be run
    for. A wrapper the program dropped lives on until the garbage collector frees it, which
    happens at different moments on different ranks (a reference cycle, allocations that
    differ): a check run for every wrapper alive here would then wait forever on a rank where
    it is gone. Nothing when the ranks wrapped different numbers of models. A collective."""
    held = [ref() for ref in _DDP_WRAPPERS]  # strong references while the ranks agree
    counts = all_reduce(torch.tensor([len(held), -len(held)], dtype=torch.int64), op="max")
    if int(counts[0]) != -int(counts[1]) or not held:
        return []
    alive = all_reduce(torch.tensor([d is not None for d in held], dtype=torch.int32), op="min")
    return [d for d, ok in zip(held, alive.tolist()) if ok]


def sync_batchnorm(model: nn.Module) -> nn.Module:
    """``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` where it can run: distributed on CUDA.
    On the CPU (gloo ranks, one process) SyncBatchNorm cannot run its forward, so the model is
    returned as is. For programs that asked for synchronised BatchNorm (apex's
    ``convert_syncbn_model``, a ``--sync-bn`` flag)."""
    if is_distributed() and device().type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def _unnest(model: nn.Module) -> None:
    """Replace the DistributedDataParallel submodules of `model` by their modules: the outer
    wrapper about to be built reduces every gradient once, and the same parameters. The inner
    wrapper (still held by the program: `fwd` in `net = Trainer(fwd, loss)`) is released to a
    pass-through (`_release_ddp`), so its gradient hooks no longer expect forwards of their own."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, DistributedDataParallel):
                setattr(parent, name, child.module)
                _release_ddp(child)


# nn.Module's own API, reached on the wrapper as DDP's (never resolved from the inner module).
_MODULE_API = frozenset(dir(nn.Module))


_EVAL_SYNC = threading.Lock()  # see _DDP.forward


class _DDP(_ModuleFace, DistributedDataParallel):
    """The ``DistributedDataParallel`` that ``wrap_model`` returns: a program that worked as one
    process keeps working, and its gradients are averaged whatever shape its training step has.

    **Gradients.** DDP's reducer needs every parameter to get a gradient in every step, from
    parameters used inside ``forward`` (else "Expected to have finished reduction in the prior
    iteration" at the next step), and averages nothing in a step that never calls the wrapper
    (a step written as ``model.encoder(x)``, ``model.head(f)``). So:

    - the first training step ("probe") runs the module without the reducer and notes, on every
      rank, which parameters got a gradient; that step's gradients are averaged after its
      backward. If every parameter got one on every rank, DDP's own overlapped reduction takes
      over from the next step. If not (a head the loss never reads, a layer behind a flag that
      is off), the wrapper stays in "manual" mode: each backward ends by averaging the gradients
      that exist on any rank (a missing one counts as zero), and rank 0 warns once, naming the
      parameters. Correct for any step; slower than DDP's overlap on large models.
    - a backward that reaches the parameters in a step where the wrapper's ``forward`` was not
      called, but its submodules or methods were reached through it (``model.encoder(x)``,
      ``model.compute_loss(batch)``), is averaged the same way. A backward through
      ``tm.unwrap(model)`` alone is left alone, as DDP would (it may run on one rank only).
    - a forward that runs backwards itself (a model whose ``forward(x, mode)`` performs the
      generator's or the discriminator's update) is never served by DDP's reducer, which is
      armed only when the forward returns: from the first such backward, each backward's
      gradients are averaged when it ends, and rank 0 says once where it runs.
    - a module with no ``forward`` of its own (an ``nn.ModuleList``/``nn.ModuleDict`` of what
      the optimizer trains, a holder class) is never called: the program calls its members
      through other references (``module_list[0](x)`` where ``trainable_list`` was wrapped).
      Every backward that reaches its parameters is averaged by hand, from the first.
    Averaging is skipped under ``no_sync()`` (gradient accumulation) and, like DDP's, needs every
    rank to run the backward. An explicit ``find_unused_parameters=True`` or ``static_graph``
    keeps DDP's own handling from the start. ``TORCHMIGRATE_DDP=plain`` turns all of this off.

    **Attributes.** Code in another module often reads what the user's class defines
    (``model.n_classes``, ``model.init_hidden(bsz)``, ``model.config``): on a plain DDP that is
    an ``AttributeError`` on every rank. Here an attribute DDP does not have is looked up on the
    wrapped module (a method reached that way runs outside DDP's ``forward``; its gradients
    are still averaged, as above).

    **Checkpoints.** ``state_dict()`` has the plain module's keys (no ``module.`` prefix): a
    checkpoint saved from the wrapper anywhere loads into the plain model, in one process and for
    inference. ``load_state_dict`` takes both forms. (As the submodule of another module, the
    usual prefixed keys are kept, so the parent's own checkpoints stay consistent.) Pickling the
    wrapper (``torch.save(model, path)``, ``copy.deepcopy(model)``) pickles the plain module, which
    loads in one process, as the original program's did.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        plain = os.environ.get("TORCHMIGRATE_DDP", "").lower() == "plain"
        self._tm_container = _no_forward(self.module)
        self._tm_op = "mean"  # how gradients averaged by hand are combined ("sum": see wrap_model)
        self._tm_bypassed = False  # warned that a backward went around the wrapper
        self._tm_mode = "ddp" if plain or self.find_unused_parameters or self.static_graph else (
            "manual" if self._tm_container else "probe")
        self._tm_armed = False  # the wrapper's forward ran (with gradients) since the last backward
        self._tm_outside = False  # a submodule or method was reached through the wrapper since then
        self._tm_forwarding = 0  # forwards of this wrapper under way (a backward inside one: `_tm_inner`)
        self._tm_inner = False  # a backward ran inside the last forward: the next forward starts a step
        self._tm_queued = False  # the end-of-backward callback is queued
        self._tm_touched: set = set()
        self._tm_steps = 0
        self._tm_same_inputs = 0  # drift checks at which every rank had the same inputs
        # gradients no backward has reduced yet: accumulated under no_sync(), or from a backward
        # that went around the wrapper (`_tm_bypassed`); `_before_step` averages them
        self._tm_unsynced = False
        self._tm_params = [p for p in self.module.parameters() if p.requires_grad]
        self._tm_registered = {id(p) for p in self._tm_params}  # what DDP reduces: see `_unfrozen`
        self._tm_late: set = set()  # parameters `_unfrozen` has made equal across ranks
        self._tm_count = sum(1 for _ in self.module.parameters())
        ref = weakref.ref(self)
        self._tm_hooks = [] if plain else [
            p.register_post_accumulate_grad_hook(functools.partial(_on_grad, ref, i))
            for i, p in enumerate(self._tm_params)]

    def forward(self, *inputs, **kwargs):
        if not (torch.is_grad_enabled() and self.require_backward_grad_sync and self._tm_hooks):
            if self.require_forward_param_sync and threading.current_thread() is not threading.main_thread():
                # an evaluation run from a thread pool (each image's forward a task): the first
                # forward takes rank 0's buffers (a collective), the next ones do not; threads
                # racing into it would each broadcast, in a different order on each rank
                with _EVAL_SYNC:
                    return super().forward(*inputs, **kwargs)
            return super().forward(*inputs, **kwargs)
        # Only the first forward of a step takes rank 0's buffers: a model called twice before one
        # backward (a GAN's discriminator on real and fake batches) would otherwise have its
        # BatchNorm statistics overwritten in place while the first call's graph still needs them
        # ("modified by an inplace operation" at the backward, with DDP's own broadcast).
        first = not self._tm_armed or self._tm_inner
        self._tm_inner = False
        self._tm_forwarding += 1
        try:
            out = self._tm_step_forward(first, *inputs, **kwargs)
        finally:
            self._tm_forwarding -= 1
        if first and self._tm_steps == 1 and sum(1 for _ in self.module.parameters()) > self._tm_count:
            _watch_steps()  # parameters registered by the first forward, which DDP never saw: see `_unfrozen`
        return out

    def _tm_step_forward(self, first: bool, *inputs, **kwargs):
        self._tm_armed = True
        if first:
            self._tm_steps += 1
            if self._tm_steps in _DRIFT_CHECKS or self._tm_steps % 1000 == 0:
                _check_drift(self, f"after {self._tm_steps - 1} training steps", (inputs, kwargs))
        if self._tm_mode == "ddp":
            return super().forward(*inputs, **kwargs) if first else self._tm_forward_keeping_buffers(*inputs, **kwargs)
        if first:
            if self._tm_steps == 1:
                # weights (re)initialised after the wrap, on ranks seeded apart: rank 0's, as DDP
                # copied them when it was built (no optimizer has stepped yet). Only where they
                # differ: an in-place copy would invalidate a graph that already used some of
                # them this step (embeddings computed before the wrapper's forward is called)
                params = [p for p in self.module.parameters()]
                if _differ_across_ranks(params):
                    _broadcast_tensors(params)
            _sync_buffers(self)
        return self.module(*inputs, **kwargs)

    def _tm_forward_keeping_buffers(self, *inputs, **kwargs):
        """DDP's forward without its broadcast of rank 0's buffers (``forward_sync_buffers``, or
        ``broadcast_buffers`` on older torch)."""
        flag = "forward_sync_buffers" if "forward_sync_buffers" in self.__dict__ else "broadcast_buffers"
        kept = self.__dict__.get(flag)
        if not kept:
            return super().forward(*inputs, **kwargs)
        self.__dict__[flag] = False
        try:
            return super().forward(*inputs, **kwargs)
        finally:
            self.__dict__[flag] = kept

    def _tm_after_backward(self) -> None:
        """End of a backward that reached this model's parameters (queued by ``_on_grad``)."""
        touched, self._tm_touched, self._tm_queued = self._tm_touched, set(), False
        inside = self._tm_forwarding > 0 and self._tm_armed
        # a backward inside the forward (the model runs its own update) leaves the forward armed:
        # more may follow in it, and a loss it returns may be backpropagated after it
        armed, outside, self._tm_armed, self._tm_outside = self._tm_armed, self._tm_outside, inside, False
        if inside:
            self._tm_inner = True
            if self._tm_mode != "manual":
                self._tm_backward_inside_forward()
            _average_grads(self._tm_params, op=self._tm_op)
            return
        if not (armed or outside or self._tm_container):
            if self._tm_steps == 0 or self._tm_bypassed:
                # (and once it has, for good: a forward through the wrapper for evaluation does
                # not make the training backwards that keep going around it averaged by DDP)
                # the program trains around the wrapper (a training loop in a method of the model
                # calling self(x)): averaged before the optimizer's step instead (`_before_step`)
                self._tm_unsynced = True
                _watch_steps()
                if not self._tm_bypassed:
                    self._tm_bypassed = True
                    self._tm_warn_bypass()
            return  # the wrapper took no part (``tm.unwrap(model)(x)``): nothing is averaged now
        if self._tm_mode == "ddp" and armed:
            return  # DDP's reducer averaged this backward
        if self._tm_mode == "probe":
            self._tm_decide(touched)
        _average_grads(self._tm_params, op=self._tm_op)

    def _tm_backward_inside_forward(self) -> None:
        """A backward ran inside the wrapper's forward: the model's forward runs its own update
        (``loss.backward()`` per mode, a GAN's generator and discriminator steps). DDP's reducer
        is armed only when its forward returns, so it averages none of these, or the wrong step's.
        The wrapper averages every such backward by hand from now on ("manual"), weights taken
        from rank 0 first where they differ (the first step: no optimizer has stepped), and rank 0
        says once where."""
        if self._tm_steps <= 1:
            params = list(self.module.parameters())
            if _differ_across_ranks(params):
                _broadcast_tensors(params)
        self._tm_mode = "manual"
        if is_main():
            frame = _user_frame(sys._getframe(2))
            where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
            _warn(f"a backward{where} runs inside the forward of {type(self.module).__name__}, which DDP's reducer "
                  "cannot average (it is armed when the forward returns): each such backward's gradients are "
                  "averaged across ranks when it ends instead (correct, without DDP's overlap of communication "
                  "and backward)")

    def _tm_warn_bypass(self) -> None:
        """The first backward to reach the parameters came before any training forward through
        the wrapper: the program trains the model through another reference (a list that holds
        the plain module, an alias the wrap did not rebind, a method calling ``self(x)``), which
        DDP never sees. Said once, on rank 0, where it happens; nothing collective (the backward
        may run on one rank only, as a saliency map or an attack on ``tm.unwrap(model)`` does)."""
        if not is_main():
            return
        frame = _user_frame(sys._getframe(2))
        where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
        _warn(f"a backward{where} gave gradients to {type(self.module).__name__}'s parameters before any training "
              "forward through its DDP wrapper (the program calls the model through another reference: a list "
              "or attribute holding the plain module, a method calling self(...)); DDP averages none of them, so "
              "they are averaged across ranks before each optimizer step instead (correct while every rank takes "
              "the same steps, without DDP's overlap of communication and backward). Calling the object "
              "tm.wrap_model returned in the training step (or tm.synced(model) for a method of the model) lets "
              "DDP do it.")

    def _tm_decide(self, touched: set) -> None:
        """After the first training backward: DDP's reducer if every parameter got a gradient
        on every rank, else averaging after each backward (with one warning on rank 0). First,
        parameters that the first forward set from each rank's own batch (a data-dependent
        init: Glow's ActNorm, weight-norm or codebook initialisation, `param.data.copy_(...)` on
        the first call) take rank 0's values, as one process took its first batch's; the
        averaged gradients then keep them equal. No optimizer has stepped yet."""
        params = list(self.module.parameters())
        if _differ_across_ranks(params):
            _broadcast_tensors(params)
        mine = torch.zeros(len(self._tm_params), dtype=torch.int32)
        mine[sorted(touched)] = 1
        everywhere = all_reduce(mine, op="min")
        if bool(everywhere.all()):
            self._tm_mode = "ddp"
            return
        self._tm_mode = "manual"
        if is_main():
            names = {id(p): n for n, p in self.module.named_parameters()}
            missing = [names.get(id(p), "?") for p, got in zip(self._tm_params, everywhere.tolist()) if not got]
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            _warn(f"{len(missing)} parameter(s) of {type(self.module).__name__} got no gradient in the first "
                  f"training step on some rank ({shown}); DistributedDataParallel would stop at the next step. "
                  "Their gradients are averaged after each backward instead (correct, without DDP's "
                  "overlap of communication and backward). If they are used only in some steps, "
                  "tm.wrap_model(model, find_unused_parameters=True) uses DDP's own handling.")

    def _tm_from_module(self, inner: nn.Module, name: str):
        value = getattr(inner, name)
        if torch.is_grad_enabled() and (isinstance(value, nn.Module) or getattr(value, "__self__", None) is inner) \
                and name not in _MODULE_API:
            self.__dict__["_tm_outside"] = True  # a step through model.encoder(x): averaged after backward
        return value

    def load_state_dict(self, state_dict, strict: bool = True, *args, **kwargs):
        keys = [k for k in state_dict.keys() if isinstance(k, str)]
        if keys and not any(k.startswith("module.") for k in keys):
            return self.module.load_state_dict(strip_prefix(state_dict), strict, *args, **kwargs)
        return super().load_state_dict(state_dict, strict, *args, **kwargs)


def _no_forward(module: nn.Module) -> bool:
    """No class of the module's defines ``forward`` (an ``nn.ModuleList``, a holder class).
    Read from the classes' own dictionaries: a scripted module's ``forward`` is a descriptor
    that fails when asked for on the class (``torch.jit.script(model)``)."""
    return not any("forward" in vars(c) for c in type(module).__mro__ if c is not nn.Module and c is not object)


_WRAPPER_CLASSES: dict = {}


def _wrapper_class(cls: type, base: type = None, shadowed: frozenset = frozenset()) -> type:
    """A ``_DDP`` subclass named after the wrapped module's class: code that names things after
    the model (``type(model).__name__`` in a checkpoint's "arch", a file name) reads what it read
    in one process (a ``base`` of ``_DataParallel`` keeps the name DataParallel, as the original
    had it). A container module (``nn.Sequential``, ``nn.ModuleList``) keeps its indexing, length
    and iteration (``model[-1]``, ``len(model)``, ``for loss in losses``), which DDP and
    DataParallel themselves do not forward. ``shadowed`` (``_shadowed``): attributes of the
    model that hide a method of ``nn.Module`` (``self.type = "binary"``), read and written on
    the module, as in one process (on the wrapper, ``model.type`` would be ``Module.type``)."""
    base = base or _DDP
    made = _WRAPPER_CLASSES.get((cls, base, shadowed))
    if made is None:
        name, qualname = (cls.__name__, cls.__qualname__) if base is _DDP else ("DataParallel", "DataParallel")
        namespace = {"__qualname__": qualname, "__module__": __name__, "__doc__": base.__doc__}
        for dunder in ("__getitem__", "__len__", "__iter__"):
            if hasattr(cls, dunder):
                namespace[dunder] = _delegate(dunder)
        for attr in shadowed:
            namespace[attr] = _module_property(attr)
        namespace["__new__"] = _new_model_or_wrapper(cls, base)
        made = _WRAPPER_CLASSES[(cls, base, shadowed)] = type(name, (base,), namespace)
    return made


def _new_model_or_wrapper(cls: type, base: type):
    """``type(model)(**params)`` on a wrapped model (a fresh copy for early stopping, a model
    rebuilt with the same settings) makes what it made in one process, a new plain ``cls``;
    only a call given a module first builds a wrapper (the runtime's own)."""
    def __new__(wrapper_cls, *args, **kwargs):
        first = args[0] if args else kwargs.get("module")
        if not isinstance(first, nn.Module):
            return cls(*args, **kwargs)  # (not an instance of the wrapper: no wrapper __init__ runs)
        return base.__new__(wrapper_cls)
    return __new__


def _ready(wrapper):
    """Mark a built wrapper: from now on, attributes of its module are set on the module."""
    wrapper.__dict__["_tm_ready"] = True
    return wrapper


def _shadowed(model: nn.Module) -> frozenset:
    """The model's own data attributes (set on the instance, not callables: a scripted module's
    ``forward`` is its own) named like a method or attribute of ``nn.Module`` (``type``,
    ``half``), other than the ones ``nn.Module`` sets itself."""
    return frozenset(n for n, v in vars(model).items()
                     if n in _MODULE_API and not n.startswith("_") and n != "training" and not callable(v))


def _module_property(attr: str) -> property:
    return property(lambda self: getattr(self.module, attr), lambda self, value: setattr(self.module, attr, value))


def _delegate(dunder: str):
    def method(self, *args):
        return getattr(self.module, dunder)(*args)
    method.__name__ = dunder
    return method


# Training steps (counted per wrapper) before which parameters are compared across ranks; then
# every 1000th. Each check is one all-reduce of two numbers per wrapper.
_DRIFT_CHECKS = frozenset({2, 11, 101})


def _on_grad(ref, index: int, _param) -> None:
    """Post-accumulate-grad hook on each parameter of a ``_DDP``: note the parameter, and queue
    the wrapper's end-of-backward step once per backward."""
    ddp = ref()
    if ddp is None:
        return
    ddp._tm_unsynced = not ddp.require_backward_grad_sync
    if not ddp.require_backward_grad_sync:
        _watch_steps()
        return  # inside no_sync(): gradients accumulate locally, reduced by the next synced backward
    if ddp._tm_mode == "probe":
        ddp._tm_touched.add(index)
    if not ddp._tm_queued:
        ddp._tm_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._tm_after_backward)


_STEP_HOOK: list = []  # the optimizer step pre-hook, installed once


def _watch_steps() -> None:
    """Installs (once) a hook that runs before every optimizer step: see `_before_step`."""
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_before_step))


_BUFFER_MODELS: list = []  # weak references to models whose weights are trainable buffers


def _watch_buffer_weights(model: nn.Module) -> None:
    """A model with no trainable parameter whose weights are buffers that train (a MetaModule:
    `register_buffer(name, weight.requires_grad_())`, stepped by an optimizer over
    `model.params()`, for second-order meta-learning): DDP cannot wrap it (it syncs parameters
    only), so the ranks start from rank 0's weights and the gradients of those buffers are
    averaged across ranks before each optimizer step that steps them. Rank 0 says so once."""
    trained = [b for b in model.buffers() if b.requires_grad]
    if not trained or not is_distributed():
        return
    if _differ_across_ranks(trained):
        with torch.no_grad():
            _broadcast_tensors([b.data for b in trained])
    _BUFFER_MODELS.append(weakref.ref(model))
    _watch_steps()
    if is_main():
        _warn(f"{type(model).__name__} keeps its {len(trained)} trainable weights as buffers (a MetaModule?), which "
              "DistributedDataParallel does not average: they start from rank 0's values and their gradients are "
              "averaged across ranks before each optimizer step instead")


def _trained_buffers(mine: set) -> list:
    """The trainable buffers of `_BUFFER_MODELS` that an optimizer stepping `mine` steps."""
    out = []
    for ref in list(_BUFFER_MODELS):
        model = ref()
        if model is None:
            _BUFFER_MODELS.remove(ref)
            continue
        out += [b for b in model.buffers() if b.requires_grad and id(b) in mine]
    return out


def _before_step(optimizer, _args, _kwargs) -> None:
    """An optimizer about to step on gradients no backward reduced: accumulated under
    ``no_sync()`` (gradient accumulation whose epoch ends inside a window, then a step to use
    the leftover), or from backwards that went around the wrapper (a training loop in a method
    of the model). Each rank would apply its own gradients and the models drift apart. They are
    averaged across ranks first (every rank takes this step), and rank 0 says so once."""
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if _BUFFER_MODELS:
        weights = _trained_buffers(mine)
        if weights:
            _average_grads(weights)
    wrappers = _live_wrappers()
    if not wrappers:
        return
    _average_stray(optimizer, mine, wrappers)
    optimizer.__dict__.pop("_tm_stray_synced", None)  # the next step's gradients are new
    for ddp in wrappers:
        late = _unfrozen(ddp, mine)
        if late:
            _average_grads(late, op=ddp._tm_op)
        if getattr(ddp, "_tm_unsynced", False) and any(id(p) in mine for p in ddp._tm_params):
            ddp._tm_unsynced = False
            _average_grads(ddp._tm_params, op=ddp._tm_op)
            if ddp._tm_bypassed:
                continue  # said where the backward went around the wrapper
            if is_main() and not _STEP_WARNED:
                _STEP_WARNED.append(True)
                frame = _user_frame(sys._getframe(2))
                where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
                _warn(f"an optimizer step{where} used gradients accumulated under no_sync() that no backward had "
                      "averaged (the last, partial accumulation window?): they were averaged across ranks first")


_STEP_WARNED: list = []
_UNFROZEN_WARNED: list = []
_STRAY_WARNED: list = []


def _stray_params(optimizer, mine: set, wrappers: list) -> list:
    """Parameters this optimizer steps together with a wrapped model's that belong to no wrapper:
    a loss module's own parameters (proxies, class centres, a learnable temperature) built by a
    helper and added to the model's optimizer, which DDP never saw. Kept per optimizer until its
    parameter groups or the wrappers change. An optimizer of such parameters alone (a SAC
    temperature, a per-task copy adapted on each rank) is left to the program."""
    key = (len(wrappers), len(mine))
    kept = optimizer.__dict__.get("_tm_stray")
    if kept is not None and kept[0] == key:
        return kept[1]
    owned = {id(p) for ddp in wrappers for p in ddp.module.parameters()}
    stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned] if owned & mine else []
    optimizer.__dict__["_tm_stray"] = (key, stray)
    return stray


def _average_stray(optimizer, mine: set | None = None, wrappers: list | None = None) -> None:
    """Average the gradients of the optimizer's stray parameters (`_stray_params`) across ranks,
    once per step (a GradScaler does it before its inf check, so every rank sees the same
    overflow and skips the same steps): each rank computed them from its own shard, and left
    alone each rank's copy would drift apart while the model's stay equal. Rank 0's values are
    taken first where they differ (made after the ranks' streams parted). Every rank steps a
    wrapped model's optimizer together, so this collective is met on every rank."""
    if optimizer.__dict__.get("_tm_stray_synced"):
        return
    wrappers = _live_wrappers() if wrappers is None else wrappers
    if not wrappers:
        return
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]} if mine is None else mine
    stray = [p for p in _stray_params(optimizer, mine, wrappers) if p.requires_grad]
    if not stray:
        return
    optimizer.__dict__["_tm_stray_synced"] = True
    if not optimizer.__dict__.get("_tm_stray_seen"):
        optimizer.__dict__["_tm_stray_seen"] = True
        if _differ_across_ranks([p.detach() for p in stray]):
            with torch.no_grad():
                _broadcast_tensors([p.data for p in stray])
        if is_main() and not _STRAY_WARNED:
            _STRAY_WARNED.append(True)
            shapes = ", ".join(str(tuple(p.shape)) for p in stray[:4]) + (", ..." if len(stray) > 4 else "")
            _warn(f"{len(stray)} parameter(s) stepped by {type(optimizer).__name__} together with a wrapped model's "
                  f"belong to no DDP wrapper (a head or a loss module outside the wrapped model? shapes {shapes}): "
                  "their gradients are averaged across ranks before each step (wrap the module that holds them with "
                  "tm.wrap_model to let DDP overlap that work)")
    _average_grads(stray, op=wrappers[0]._tm_op)


def _unfrozen(ddp, stepped: set) -> list:
    """Parameters of the wrapped module that this optimizer steps, that train now but were frozen
    when the wrapper was built (a backbone unfrozen after some epochs): DDP never registered them,
    so no backward averages their gradients. `_before_step` averages them by hand (every rank
    unfreezes the same parameters at the same step), and rank 0 says once that re-wrapping after
    the unfreeze would let DDP overlap that work."""
    late = [p for p in ddp.module.parameters()
            if p.requires_grad and id(p) not in ddp._tm_registered and id(p) in stepped]
    new = [p for p in late if id(p) not in ddp._tm_late]
    if new:
        # first seen: a parameter created after the wrap (registered in the first forward, as
        # lazily built cells do) holds each rank's own random start; rank 0's, as DDP would have
        # copied it. A parameter that was only frozen is equal everywhere and is left as it is.
        ddp._tm_late.update(id(p) for p in new)
        if _differ_across_ranks(new):
            _broadcast_tensors(new)
    if late and is_main() and not _UNFROZEN_WARNED:
        _UNFROZEN_WARNED.append(True)
        frame = _user_frame(sys._getframe(1))
        where = f" (optimizer step at {frame.f_code.co_filename}:{frame.f_lineno})" if frame is not None else ""
        _warn(f"{len(late)} parameter(s) of {type(ddp.module).__name__} were frozen or not yet created when it was "
              f"wrapped and train now{where}: DDP does not reduce them, so they start from rank 0's values and "
              "their gradients are averaged across ranks before each optimizer step (wrap the model again after "
              "unfreezing, or after the forward that creates them, for DDP's own overlapped reduction)")
    return late


def _average_grads(params, op: str = "mean") -> None:
    """Average ``.grad`` across ranks in place for the parameters that have one on any rank (a
    missing one counts as zero there); one collective for the flags, one per dtype. A sparse
    gradient (``nn.Embedding(sparse=True)``, trained by SparseAdam) is averaged densely and
    stays sparse, as its optimizer requires."""
    kinds = [0 if p.grad is None else 2 if p.grad.is_sparse else 1 for p in params]
    have = all_reduce(torch.tensor(kinds, dtype=torch.int32), op="max").tolist()
    chosen = [(p, h == 2) for p, h in zip(params, have) if h]
    if not chosen:
        return
    values = []
    for p, sparse in chosen:
        if p.grad is None:
            values.append(torch.zeros_like(p))
        else:
            values.append(p.grad.to_dense() if sparse else p.grad)
    averaged = all_reduce(*values, op=op)
    for (p, sparse), g in zip(chosen, averaged if len(chosen) > 1 else (averaged,)):
        if sparse:
            p.grad = g.to_sparse(p.grad.sparse_dim() if p.grad is not None else 1)
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def _sync_buffers(ddp: DistributedDataParallel) -> None:
    """Rank 0's buffers (BatchNorm statistics) on every rank before a forward, as DDP does."""
    if not getattr(ddp, "broadcast_buffers", True):
        return
    buffers = [b for b in ddp.module.buffers() if b.numel()]
    if buffers:
        _broadcast_tensors(buffers)


def _weights_fingerprint(tensors) -> torch.Tensor:
    """Two float64 numbers that change with any of the tensors' values (their sum, and a sum of
    magnitudes weighted by position): what the ranks compare to tell whether they agree."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i, t in enumerate(tensors):
            v = t.detach().double()
            total[0] += v.sum().cpu()
            total[1] += (v.abs().sum() * (1 + (i % 7))).cpu()
    return total


def _differ_across_ranks(tensors) -> bool:
    """The tensors are not the same on every rank (their fingerprints compared; collectives)."""
    total = _weights_fingerprint(tensors)
    return not torch.equal(all_reduce(total, op="max"), all_reduce(total, op="min"))


def _broadcast_tensors(tensors) -> None:
    comm = device() if _nccl() else torch.device("cpu")
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for items in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in items]).to(comm)
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, part in zip(items, flat.split([t.numel() for t in items])):
                t.copy_(part.reshape(t.shape).to(t.device))


_DRIFT_WARNED: set = set()


def _checks_on() -> bool:
    """The runtime's checks (``_check_drift``, ``_watch_writes``) run unless
    ``TORCHMIGRATE_CHECKS`` is 0/off/false/no."""
    return os.environ.get("TORCHMIGRATE_CHECKS", "1").strip().lower() not in ("0", "off", "false", "no")


_LOCATED = re.compile(r"\.py:\d+")


def _warn(message: str) -> None:
    """One line on stderr, whatever the program's warning filters say (research code often
    silences ``warnings``). A message that names no place of the program gets the line of the
    program's own code that led to it (`[train.py:57]`: the loader built with that batch, the
    step or forward where it was seen), so the user can act on it."""
    with contextlib.suppress(Exception):
        if not _LOCATED.search(message):
            frame = _user_frame(sys._getframe(1))
            if frame is not None:
                message += f" [{frame.f_code.co_filename}:{frame.f_lineno}]"
        sys.stderr.write(f"torchmigrate.runtime: {message}\n")
        sys.stderr.flush()


_RUNTIME_FILE = os.path.normcase(os.path.abspath(__file__))
_LIBRARY_DIRS: tuple = ()  # the standard library and site-packages: frames there are not the user's
_WRITES_WARNED: set = set()
_WRITE_WARNINGS_MAX = 10
_WATCHING = False


def _library_dirs() -> tuple:
    import sysconfig
    dirs = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= {os.path.dirname(os.path.dirname(torch.__file__))}
    return tuple(os.path.normcase(os.path.abspath(d)) + os.sep for d in dirs if d)


_NOT_THE_PROGRAMS = ("tempfile.py", "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")


def _user_frame(frame):
    """The innermost frame in the program's own code (not the standard library, an installed
    package or this runtime); None for a temporary file or a write made while importing (a
    library's cache), which are nobody's defect."""
    global _LIBRARY_DIRS
    if not _LIBRARY_DIRS:
        _LIBRARY_DIRS = _library_dirs()
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith(_NOT_THE_PROGRAMS):
            return None
        if not name.startswith("<"):
            full = os.path.normcase(os.path.abspath(name))
            if full != _RUNTIME_FILE and not full.startswith(_LIBRARY_DIRS):
                return frame
        frame = frame.f_back
    return None


def _per_rank_path(path: str) -> bool:
    """A path that names this rank (``log_rank1.txt``, ``worker-1/``): written per rank on purpose."""
    return re.search(rf"(rank|proc|process|gpu|worker|node|device)[-_ ]?{rank()}(?!\d)", path, re.I) is not None


_IGNORED_PREFIXES = ("/dev/", "/proc/", "/sys/")
_TEMP_NAME = re.compile(r"^tmp[a-z0-9_]{8}$")  # tempfile's random names (mkdtemp, TemporaryDirectory)


_TEMP_ROOT = ""  # tempfile's directory, found before the audit hook is on (see _watch_writes)


def _temp_root() -> str:
    """The temporary directory, with a trailing separator. Asked outside the audit hook only:
    tempfile finds it by opening test files under a lock, and a hook asking again deadlocks."""
    import tempfile

    return os.path.join(os.path.abspath(tempfile.gettempdir()), "")


def _private_temp(path: str, root: str = "") -> bool:
    """`path` lies in a temporary file or folder tempfile made for this process (a random
    `tmpXXXXXXXX` name under the temporary directory `root`, `_TEMP_ROOT` by default): each rank
    writes its own."""
    root = root or _TEMP_ROOT
    if not root:
        return False
    full = os.path.abspath(path)
    return full.startswith(root) and _TEMP_NAME.match(full[len(root):].split(os.sep, 1)[0]) is not None


def _note_write(path) -> None:
    """A file opened for writing on a rank other than 0: warn once per place in the program."""
    if not _WATCHING or len(_WRITES_WARNED) >= _WRITE_WARNINGS_MAX:
        return
    try:
        path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    except Exception:
        return
    if not path or path.startswith(_IGNORED_PREFIXES) or path.endswith((".pyc", ".lock")) \
            or "__pycache__" in path or _per_rank_path(path) or _private_temp(path):
        return
    frame = _user_frame(sys._getframe(2))
    if frame is None:
        return
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    if where in _WRITES_WARNED:
        return
    _WRITES_WARNED.add(where)
    _warn(f"rank {rank()} writes {path!r} ({frame.f_code.co_filename}:{frame.f_lineno}): every rank "
          "writes this file, which rank 0 alone should write (put the write under "
          "`if tm.is_main():`, or open it with a name of its own per rank). Shown once per place; "
          "TORCHMIGRATE_CHECKS=0 turns the runtime's checks off.")


def _audit(event: str, args) -> None:
    if event != "open" or not _WATCHING:
        return
    path, mode, flags = (tuple(args) + (None, None, None))[:3]
    if isinstance(mode, str):
        writing = any(c in mode for c in "wax+")
    else:
        writing = isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT))
    if writing:
        _note_write(path)


def _watch_writes() -> None:
    """On ranks other than 0, notice files opened for writing (an audit hook, plus
    ``torch.save``, which writes from C++) and warn once per place in the program: the usual
    silent defect of a migrated program is a file written by every rank through a helper that
    the migration did not guard. Cheap: the hook returns at once for every event but "open"."""
    global _WATCHING, _LIBRARY_DIRS, _TEMP_ROOT
    if _WATCHING or is_main() or not _checks_on():
        return
    _LIBRARY_DIRS = _library_dirs()  # now, not inside the hook (where asking would open files)
    _TEMP_ROOT = _temp_root()
    _WATCHING = True
    if not getattr(sys, "_torchmigrate_audit", False):
        sys.addaudithook(_audit)  # cannot be removed: _WATCHING switches it off
        sys._torchmigrate_audit = True
        original = torch.save

        @functools.wraps(original)
        def save(obj, f, *args, **kwargs):
            _note_write(f)
            return original(obj, f, *args, **kwargs)

        torch.save = save


def _fingerprint(value, depth: int = 0):
    """A number that tells two batches apart: a weighted sum of up to 256 evenly spaced elements
    of the first tensor in `value` (through tuples, lists and dicts), plus its size; of a sparse
    tensor, of its stored values; None where a tensor cannot be read that way."""
    if isinstance(value, torch.Tensor):
        try:  # a check must never break the step it looks at
            if value.layout != torch.strided or value.is_nested:  # a sparse adjacency or features matrix
                value = value.coalesce().values() if value.layout == torch.sparse_coo else value.values()
            if not value.numel():
                return None
            flat = value.detach().reshape(-1)
            sample = flat[::max(1, flat.numel() // 256)][:256].double()
            weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
            return float((sample * weights).sum()) + flat.numel()
        except (RuntimeError, TypeError, NotImplementedError):
            return None
    if depth < 3 and isinstance(value, (list, tuple)):
        items = value
    elif depth < 3 and isinstance(value, dict):
        items = list(value.values())
    else:
        return None
    for item in items:
        found = _fingerprint(item, depth + 1)
        if found is not None:
            return found
    return None


_SHARED_INPUTS = False  # tm.shard_indices/shard_mean: ranks share the inputs and split the loss


def _check_drift(ddp: DistributedDataParallel, when: str, inputs=None) -> None:
    """Warn once (rank 0) when the wrapped model's parameters differ across ranks: two sums
    over every parameter, compared with one all-reduce of max and one of min. DDP keeps the
    parameters identical, so a difference means something trained outside it (an optimizer
    over another copy, a learning rate that differs per rank, a step only some ranks take).
    The same all-reduce compares the step's inputs (`_fingerprint`): identical on every rank at
    two checks, every rank trains on the same batches (data not shared out by rank), which is
    said once too. Off with ``TORCHMIGRATE_CHECKS=0``. A collective: called at points every rank
    reaches (the wrapper's training forwards, and cleanup)."""
    if not _checks_on() or getattr(ddp, "_tm_drifted", False):
        return
    with torch.no_grad():
        total = torch.zeros(4, dtype=torch.float64)
        total[:2] = _weights_fingerprint(ddp.module.parameters())
        total[2] = _SAMPLERS_MADE
        seen = _fingerprint(inputs) if inputs is not None else None
        total[3] = float("nan") if seen is None else seen
    high, low = all_reduce(total, op="max"), all_reduce(total, op="min")
    if inputs is not None and not _SHARED_INPUTS and bool(high[3] == low[3]):
        ddp._tm_same_inputs += 1
        if ddp._tm_same_inputs == 2 and is_main():
            _warn(f"{type(ddp.module).__name__} got the same inputs on every rank at two training steps ({when}): "
                  "if they come from the training data, every rank trains on the same samples (the data is not "
                  "shared out by rank: give its loader `sampler=tm.sampler(dataset)`, or see the TM201 "
                  "findings); if they are random draws, every rank draws the same ones (seed the ranks apart "
                  "where training starts with `tm.seed_per_rank()`).")
    if high[2] != low[2] and "samplers" not in _DRIFT_WARNED:
        _DRIFT_WARNED.add("samplers")
        if is_main():
            _warn("the ranks built different numbers of shuffling samplers (a loader built on some ranks only): "
                  "the seeds of the samplers built after it differ across ranks, so their shards overlap. "
                  "Build every training loader on every rank.")
    if torch.equal(high[:2], low[:2]):
        return
    ddp._tm_drifted = True  # (on the object: an id can be reused by another wrapper on one rank only)
    if is_main():  # (`_warn` names the line of the program where it was checked)
        _warn(f"the parameters of {type(ddp.module).__name__} differ across ranks {when}: something "
              "updates them outside DistributedDataParallel (an optimizer over another copy of the "
              "model, a learning rate or a step that differs between ranks, a per-rank metric "
              "steering training). Every rank now trains a different model.")


def synced(model):
    """``model``, whose methods and submodules run through DistributedDataParallel's ``forward``:
    ``tm.synced(model).bpr_loss(users, pos, neg)`` or ``tm.synced(model).backbone(x)`` computes
    with something other than ``forward`` and still arms DDP's overlapped gradient averaging for
    that step (through ``tm.unwrap(model)`` such a call runs outside DDP, which then averages
    nothing: every rank trains its own copy).
    The method runs as the wrapped module's ``forward`` for that one call, with DDP's hooks
    around it; calls it makes to ``self(...)``/``self.forward`` reach the real ``forward``.
    Like any DDP forward it must run on every rank and its parameters must all get gradients
    (else wrap with ``find_unused_parameters=True``). Not distributed (not a DDP): the module
    itself, so the call is the plain method call."""
    if isinstance(model, DistributedDataParallel):
        return _Synced(model)
    return unwrap(model)


class _Synced:
    """See ``synced``."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._ddp = ddp

    def __getattr__(self, name):
        module = self._ddp.module
        method = getattr(module, name)
        if isinstance(method, nn.Module):
            method = method.__call__  # a submodule: `tm.synced(model).backbone(x)` runs it as the forward
        elif not callable(method) or getattr(method, "__self__", None) is not module:
            return method

        def call(*args, **kwargs):
            def once(*a, **k):  # the method in place of forward, for this one call only
                _restore()
                return method(*a, **k)

            def _restore():
                if module.__dict__.get("forward") is once:
                    del module.__dict__["forward"]

            module.__dict__["forward"] = once
            try:
                return self._ddp(*args, **kwargs)
            finally:
                _restore()

        call.__name__ = name
        call.__doc__ = method.__doc__
        return call


def unwrap(model):
    """The user's own module under any DDP, ``nn.DataParallel`` (or the ``ParallelPart`` that
    stands for it under torchrun) and ``torch.compile`` wrappers (``_orig_mod``), nested in any
    order. Same in every mode; non-modules are returned as is."""
    while isinstance(model, nn.Module):
        if isinstance(model, (DistributedDataParallel, nn.DataParallel, ParallelPart)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            break
    return model


_SAMPLERS_MADE = 0  # shuffling samplers made by this process, in order (see _own_seed)


def _own_seed(seed) -> int:
    """The seed of the next shuffling sampler: ``seed`` (default 0) plus a number for each sampler
    made before it. Two loaders that shuffled independently in the original (unpaired A and B
    images zipped together, a source and a reference loader) must not draw the same order on
    every rank; the ranks still agree on each sampler's seed, since every rank builds its loaders
    in the same order (the runtime's drift check compares them across ranks)."""
    global _SAMPLERS_MADE
    _SAMPLERS_MADE += 1
    return int(seed or 0) + 7919 * (_SAMPLERS_MADE - 1)


def sampler(dataset, shuffle=True, seed: int | None = None, drop_last: bool = False) -> Sampler:
    """Training sampler. Distributed: ``DistributedSampler`` (each rank a disjoint shard, padded to
    equal length unless ``drop_last``; reshuffled by ``set_epoch``, or on every pass where nothing
    calls it, see ``_EpochSampler``; each sampler its own seed, see ``_own_seed``, the same on
    every rank). 1 process: ``RandomSampler`` (global torch RNG, like ``shuffle=True``) if
    ``shuffle`` is truthy, else ``SequentialSampler``."""
    if is_distributed() and _WHOLE_DATA:
        # built for evaluation through a factory that also builds the training loader
        # (`tm.unsharded(get_loader, ...)`): the whole set on every rank, in the same order
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(_own_seed(seed))) if shuffle \
            else SequentialSampler(dataset)
    if is_distributed():
        return _EpochSampler(dataset, num_replicas=world_size(), rank=rank(),
                             shuffle=bool(shuffle), seed=_own_seed(seed) if shuffle else int(seed or 0),
                             drop_last=drop_last)
    return RandomSampler(dataset) if shuffle else SequentialSampler(dataset)


_WHOLE_DATA = 0  # depth of `unsharded` calls in progress


def unsharded(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` with the training sampler and batch of the migrated program
    left whole: inside it, ``sampler(...)`` draws every sample of the dataset (shuffled alike on
    every rank where it shuffles) and ``per_rank_batch(n)`` is ``n``. For a program's one loader
    factory that builds both its training loader (sharded) and its evaluation loaders
    (``dev_loader = tm.unsharded(get_loader, dev_file, batch_size, shuffle=True)``): every rank
    evaluates the whole set, so the numbers computed from it agree across ranks and choose the
    same best model or early stop. 1 process: the plain call."""
    global _WHOLE_DATA
    _WHOLE_DATA += 1
    try:
        return factory(*args, **kwargs)
    finally:
        _WHOLE_DATA -= 1


class _StridedSampler(Sampler):
    """Rank r of W gets indices r, r+W, r+2W, ...: every sample exactly once, no padding."""

    def __init__(self, dataset, rank_: int, world: int, shuffle: bool = False, seed: int = 0):
        self.n, self.rank, self.world = len(dataset), rank_, world
        self.shuffle, self.seed, self._pass = shuffle, seed, 0

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.rank, self.n, self.world))
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self._pass))
        self._pass += 1  # the same on every rank: each pass draws a new shared permutation
        return iter(order[self.rank::self.world].tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world))

    def set_epoch(self, epoch: int) -> None:
        """No-op, so ``sampler.set_epoch(epoch)`` code works on eval loaders too."""


class _EpochSampler(DistributedSampler):
    """A ``DistributedSampler`` that reshuffles every epoch even where nobody calls ``set_epoch``.

    A loader built in one module (``data.get_loaders()``) and iterated in another
    (``engine.train_one_epoch(loader)``) often has no place where the epoch is known, and a plain
    ``DistributedSampler`` then yields the same order every epoch. Until ``set_epoch`` is called,
    each pass over the sampler uses the next epoch number (0, 1, 2, ...): every rank iterates
    its loader the same number of times (DDP needs that anyway), so the ranks agree on the
    permutation and their shards stay disjoint. Once ``set_epoch`` is called, the sampler
    behaves exactly like ``DistributedSampler``.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._explicit = False
        self._passes = 0

    def set_epoch(self, epoch: int) -> None:
        self._explicit = True
        super().set_epoch(epoch)

    def __iter__(self):
        if not self._explicit:
            self.epoch = self._passes
            self._passes += 1
        return super().__iter__()


_training_sampler = sampler  # (`shard_sampler`'s parameter hides the name)


def shard_sampler(sampler, seed: int | None = None, dataset=None, shuffle=False, batch_size: int | None = None,
                  split_batches: bool = False):
    """Any sampler or batch sampler (``WeightedRandomSampler``, ``RandomSampler(replacement=True)``,
    a bucketing batch sampler of the project), shared out by rank. 1 process: ``sampler`` itself.

    ``sampler`` may be None where the program chooses one only sometimes (``sampler=train_sampler,
    shuffle=(train_sampler is None)``): then ``sampler(dataset, shuffle=shuffle)``, the loader's own
    order shared out by rank (``torchmigrate ddp`` passes the loader's dataset and its ``shuffle``,
    and gives the loader ``shuffle=False``, as a loader with a sampler needs). A sampler that
    already takes the rank (``DistributedSampler(ds) if args.distributed else None`` where the
    flag is on) is kept as it is.

    Distributed: each pass draws the sampler's whole sequence under the same seed on every rank
    (``seed + epoch``: its ``generator`` if it has one, and torch's, Python's and numpy's global
    streams, private to the pass and carried through it, so draws made as it goes agree too; the
    program's own streams are restored after each draw), so the ranks agree on it, and rank r keeps items r, r+W, r+2W, ... of
    it, padded from its start to a multiple of W so every rank runs the same number of steps.
    The epoch advances on each pass, or follows ``set_epoch`` once called (forwarded to the
    sampler too). Like Accelerate's sharded samplers, it works whatever the sampler does.

    ``batch_size`` (the loader's, as the original program wrote it) deals the sequence in blocks
    of that many items instead of one at a time: rank r keeps blocks r, r+W, ... A sampler that
    yields groups meant to share a batch (K images of one identity after another, for a triplet
    or binomial loss; a bucket of similar lengths) keeps its groups whole on one rank, where
    dealing single items would give each rank one image per identity and no positive pair.

    ``split_batches`` (a batch sampler, where the migration keeps the original's global batch):
    every batch the sampler yields is split among the ranks, rank r taking its contiguous part
    (a batch of fewer items than ranks lends its first items to the ranks it cannot fill). The
    loader keeps its number of batches, so a loop that draws a fixed number of them with
    ``next()`` (FixMatch's ``n_iters`` over a sampler sized for them) does not run out halfway,
    and each step still trains on the original's batch."""
    if sampler is None:
        if dataset is None:
            raise TypeError("shard_sampler: no sampler and no dataset to sample")
        return _training_sampler(dataset, shuffle=bool(shuffle), seed=seed)
    if not is_distributed():
        return sampler
    if sharded(sampler):
        return sampler  # a DistributedSampler the program's own flag built: already this rank's share
    return _ShardedSampler(sampler, _own_seed(seed), block=batch_size, split=split_batches)


class _ShardedSampler(Sampler):
    """See ``shard_sampler``."""

    def __init__(self, inner, seed: int, block: int | None = None, split: bool = False) -> None:
        self.inner, self.seed, self.split = inner, int(seed), bool(split)
        self.block = max(1, int(block)) if isinstance(block, int) and not isinstance(block, bool) else 1
        self.epoch, self._explicit, self._passes = 0, False, 0

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a copy being unpickled): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # `loader.sampler.indices`, `.weights`, `.num_samples`

    def set_epoch(self, epoch: int) -> None:
        self._explicit, self.epoch = True, epoch
        inner_set = getattr(self.inner, "set_epoch", None)
        if callable(inner_set):
            inner_set(epoch)

    def __len__(self) -> int:
        if self.split:
            return len(self.inner)
        return -(-len(self.inner) // (world_size() * self.block)) * self.block

    def _start(self, streams: "_Streams"):
        """The sampler's iterator, and its first item, drawn under ``seed + epoch``: its own
        ``generator`` if it has one, and the pass's own random streams (``_Streams``). Samplers
        fix their order when they start (torch's draw a seed, bucketing samplers shuffle first),
        so the ranks agree on the whole sequence."""
        seed = self.seed + self.epoch
        with streams:
            if hasattr(self.inner, "generator"):
                kept = self.inner.generator
                self.inner.generator = torch.Generator().manual_seed(seed)
                try:
                    it = iter(self.inner)
                    return it, next(it, _END)
                finally:
                    self.inner.generator = kept
            it = iter(self.inner)
            return it, next(it, _END)

    def __iter__(self):
        """Streams (a sampler may be huge: ``RandomSampler(num_samples=10**10)``, or endless): rank
        r keeps its items (``_deal``). Items are drawn a chunk at a time under the pass's own
        random streams, so a sampler that draws as it goes (a new permutation after each round of
        an endless sampler) draws alike on every rank."""
        if not self._explicit:
            self.epoch = self._passes
            self._passes += 1
        try:
            share = len(self)
        except TypeError:  # an endless sampler without a length (DomainBed's _InfiniteSampler)
            share = None
        streams = _Streams(self.seed + self.epoch)
        it, first = self._start(streams)
        if first is _END:
            return
        items = itertools.chain((first,), _chunked(it, streams, world_size() * 64 * self.block))
        if self.split:
            yield from (_part_of_batch(batch) for batch in items)
            return
        yield from _deal(items, share, self.block)


def _part_of_batch(batch):
    """This rank's contiguous part of one batch of indices (sizes differ by at most one; a batch
    of fewer items than ranks lends its first items to the ranks it cannot fill, as
    ``DistributedSampler`` pads)."""
    batch = list(batch)
    world, me = world_size(), rank()
    if len(batch) < world:
        batch = [batch[i % len(batch)] for i in range(world)] if batch else batch
    size, extra = divmod(len(batch), world)
    start = me * size + min(me, extra)
    return batch[start:start + size + (1 if me < extra else 0)]


def _deal(items, share: int | None = None, block: int = 1):
    """This rank's part of ``items``, dealt in blocks of ``block`` items: rank r keeps blocks r,
    r+W, r+2W, ... (at most ``share`` items); where they do not fill W equal shares (``share``
    each, else as many whole blocks as the items need), the first items pad the last round, as
    ``DistributedSampler`` pads, so every rank runs the same number of steps."""
    world, me = world_size(), rank()
    span = world * block
    head, kept, total = [], 0, 0
    for item in items:
        if total < span:
            head.append(item)
        if (total // block) % world == me:
            yield item
            kept += 1
            if kept == share:
                return
        total += 1
    if not head:
        return
    share = -(-total // span) * block if share is None else share
    j = total
    while kept < share:  # padding
        if (j // block) % world == me:
            yield head[(j - total) % len(head)]
            kept += 1
        j += 1


def _chunked(it, streams: "_Streams", size: int):
    """The items of `it`, drawn `size` at a time inside `streams`."""
    while True:
        with streams:
            chunk = list(itertools.islice(it, size))
        yield from chunk
        if len(chunk) < size:
            return


_END = object()


_STREAM_WARNED: set = set()


def _names_a_file(data) -> bool:
    """A path (`os.PathLike`), or a string that reads as one (an existing path, or one line with a
    folder separator or a file suffix: `"dataset/tacred/train.json"`), not the text of a corpus,
    which a character-level model's stream is."""
    if isinstance(data, os.PathLike):
        return True
    if not isinstance(data, str) or "\n" in data or len(data) > 4096:
        return False
    return os.path.exists(data) or bool(re.search(r"[/\\]|\.[A-Za-z0-9]{2,5}$", data))


def shard_stream(data):
    """This rank's part of the data a hand-made training iterator reads, cut on its first
    dimension, equal in length on every rank (DDP's backward is a collective: every rank must run
    the same number of steps). 1 process: ``data`` itself.

    - a tensor, an array or a list of numbers or characters (a token stream that language-model
      code ``batchify``s into columns, the arrays of a hand-made minibatch function): a contiguous
      part, the remainder dropped, so the text of each rank's part stays continuous;
    - a Python list or tuple of samples (graphs, sentences, (x, y) pairs): dealt out at random,
      the same deal on every rank (seeded by the length), rank r taking every W-th sample of the
      deal and the last round padded with the deal's first samples, so a list saved in class or
      length order does not give each rank one kind of sample, and no sample is left out. The
      deal is made once per run: the program's own iterator reshuffles within each rank's part.

    Data of one length are always cut the same way (the first call for a length decides), so the
    lists and arrays handed to one iterator (``minibatch(users, pos, neg)``, ``GraphData(graphs,
    labels)``) stay aligned."""
    world = world_size()
    if world <= 1:
        return data
    if _names_a_file(data) or isinstance(data, torch.utils.data.DataLoader) or not (
            hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        # a loader (sharded by its sampler, or not: the runtime's checks say so) or an iterator
        # cannot be cut by offsets: left as it is; nor can a file name (the iterator reads the file)
        if _names_a_file(data) or (
                not isinstance(data, torch.utils.data.DataLoader) and not hasattr(data, "__iter__")):
            # not data at all (the options handed to a `batchify(args, data, bsz)`): say where
            frame = _user_frame(sys._getframe(1))
            where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "the program"
            if where not in _STREAM_WARNED and is_main():
                _STREAM_WARNED.add(where)
                _warn(f"{where}: shard_stream was handed a {type(data).__name__}, which is no data it can cut: "
                      "every rank reads the whole stream there. Hand it the stream itself (the tensor or list "
                      "of samples the iterator reads).")
        return data
    n, me = len(data), rank()
    if not _sliceable(data):
        # a dataset object of the program (`__getitem__` of one index): a view of this rank's
        # dealt samples, which the program's iterator indexes as it indexed the whole
        return _StreamPart(data, tuple(shard_range(_dealt(n))))
    part = _STREAM_PARTS.get((n, world, me))
    if part is None:
        samples = isinstance(data, (list, tuple)) and n > 0 and not isinstance(data[0], (numbers.Number, str, bytes))
        part = _STREAM_PARTS[(n, world, me)] = tuple(shard_range(_dealt(n))) if samples else ()
    if not part:
        share = n // world
        return data[me * share:(me + 1) * share]
    if type(data) is tuple:
        return tuple(data[i] for i in part)
    if isinstance(data, torch.Tensor):
        return data[torch.as_tensor(part, device=data.device)]
    if type(data).__module__.startswith("numpy"):
        return data[list(part)]
    return [data[i] for i in part]


_STREAM_PARTS: dict = {}  # (length, world, rank) -> this rank's indices (empty: a contiguous part), see shard_stream


def _sliceable(data) -> bool:
    """Data that `shard_stream` may cut with a slice or an index list: a list, tuple, string,
    tensor, or an array or frame of numpy/pandas."""
    return isinstance(data, (list, tuple, str, bytes, torch.Tensor)) or type(data).__module__.split(".")[0] in (
        "numpy", "pandas")


class _StreamPart:
    """This rank's samples of a dataset object (see `shard_stream`): `part[i]` is
    `data[indices[i]]`, its length the number of indices; any other attribute is the dataset's
    (its vocabulary, its `collate`)."""

    def __init__(self, data, indices) -> None:
        self._tm_data, self._tm_indices = data, indices

    def __len__(self) -> int:
        return len(self._tm_indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._tm_data[j] for j in self._tm_indices[i]]
        return self._tm_data[self._tm_indices[i]]

    def __iter__(self):
        return (self._tm_data[j] for j in self._tm_indices)

    def __getattr__(self, name):
        if name.startswith("_tm_"):
            raise AttributeError(name)
        return getattr(self._tm_data, name)


def _dealt(n: int) -> list:
    """`range(n)` in a random order that is the same on every rank (seeded by `n`): the deal
    `shard_stream` shares out like `shard_range` (every W-th item, the last round padded)."""
    order = list(range(n))
    random.Random(n).shuffle(order)
    return order


def shard_range(batches):
    """This rank's share of the batches of a hand-made training loop:
    ``for i in tm.shard_range(range(0, len(X), batch_size)): xb = X[i:i + batch_size]``. ``batches``
    is a ``range`` or any sequence (batch starts, batch numbers, lists of batches); rank r takes
    items r, r+W, r+2W, ... and, when the count does not divide by W, the last round is padded
    with the first items (as ``DistributedSampler`` pads), so every rank runs the same number of
    steps: DDP's backward is a collective, and a rank with one step more would wait forever.
    A ``range`` that divides stays a ``range``. With a per-rank batch of ``batch_size / W``
    (``tm.per_rank_batch``) consecutive ranks take consecutive slices, so the W slices of one step
    are exactly the original program's batch. 1 process: ``batches`` itself."""
    world = world_size()
    if world <= 1:
        return batches
    me, n = rank(), len(batches)
    mine = batches[me::world]
    share = -(-n // world)
    if share * world == n or n == 0:
        return mine
    return list(mine) + [batches[j % n] for j in range(me + len(mine) * world, share * world, world)]


def rank_part(batch):
    """This rank's part of a batch every rank reads alike: rows ``r*n//W`` to ``(r+1)*n//W`` of its
    ``n`` (a tensor, a numpy array, a list), so the ranks' parts make up the batch, each row once,
    and parts differ in size by at most one. What ``torchmigrate ddp`` wraps around a batch read at
    a cursor the loop moves itself (``rays[i_batch:i_batch + N_rand]``): every rank reads the same
    batch (its order drawn alike on every rank), trains on its part, and the averaged gradient is
    the original's step over the whole batch. A batch of fewer rows than ranks gives each rank
    one row (some twice), never none (an empty part's mean loss would be NaN on every rank once
    averaged). 1 process: ``batch`` itself."""
    world = world_size()
    if world <= 1:
        return batch
    n, me = len(batch), rank()
    if n == 0:
        return batch
    if n < world:
        return batch[me % n:me % n + 1]
    return batch[me * n // world:(me + 1) * n // world]


def shard_indices(idx):
    """This rank's part of a set of training indices: an index tensor, a numpy array, a list or a
    ``range`` (rank r keeps entries r, r+W, ...), or a boolean mask (the same shape, true only at
    this rank's share of the true positions, taken the same way). For full-batch training
    (``loss = F.nll_loss(out[idx_train], labels[idx_train])`` on a whole graph): each rank scores
    its part of the training nodes, and ``shard_mean`` weights the parts so that DDP's averaged
    gradient is the one-process gradient. Parts differ in size by at most one. 1 process: ``idx``."""
    global _SHARED_INPUTS
    world = world_size()
    if world <= 1:
        return idx
    _SHARED_INPUTS = True  # every rank runs the forward on the same inputs and scores its part
    me = rank()
    if _is_mask(idx):
        positions = idx.reshape(-1).nonzero()
        positions = positions[0] if isinstance(positions, tuple) else positions.reshape(-1)
        part = idx.reshape(-1) & False
        part[positions[me::world]] = True
        return part.reshape(idx.shape)
    return idx[me::world]


def _is_mask(idx) -> bool:
    """A boolean mask (torch or numpy), as opposed to a list of indices."""
    dtype = getattr(idx, "dtype", None)
    return dtype is not None and (dtype == torch.bool or str(dtype) == "bool")


def _index_count(idx) -> int:
    """How many samples ``idx`` selects: the true entries of a mask, else its length."""
    return int(idx.sum()) if _is_mask(idx) else len(idx)


def shard_mean(loss, idx):
    """A mean loss computed over this rank's part of ``idx`` (``tm.shard_indices(idx)``), made
    this rank's share of the mean over all of ``idx``. Its gradient is the part's mean scaled by
    ``n_r * W / N`` (n_r samples in this rank's part, N in all of ``idx``): DDP averages the W
    gradients, which then add up to exactly the one-process gradient, even when N does not divide
    by W. Its value is the mean over every rank's part, which is what one process computes, so
    a printed or compared loss agrees across ranks and with the original. A collective (one
    scalar): call it on every rank. 1 process: ``loss``."""
    world = world_size()
    if world <= 1:
        return loss
    total = _index_count(idx)
    mine = len(range(rank(), total, world))
    if total == 0:
        return loss
    share = loss * (mine * world / total) if mine else loss.nan_to_num() * 0
    summed = all_reduce(loss.detach().float() * mine if mine else torch.zeros((), device=loss.device))
    value = (summed / total).to(loss.dtype)
    return share + (value - share.detach())


def shard_batches(batches, seed: int | None = None):
    """This rank's share of an iterable of batches that no sampler can shard: a generator of the
    program (``def batches(X, y, bs): ... yield``), a project ``BatchIterator``, a bucket
    iterator, a list of batches. Rank r keeps batches r, r+W, r+2W, ...; the last round is padded
    with the first batches, so every rank runs the same number of steps (DDP waits otherwise).

    - A list, tuple or ``range``: its items, as ``shard_range``.
    - A ``DataLoader``: one with a distributed sampler (``tm.sampler``, ``tm.shard_sampler``,
      ``DistributedSampler``) is already sharded and comes back as it is; another over a
      map-style dataset gets its (batch) sampler wrapped in ``tm.shard_sampler`` in place, so
      each rank loads only its own batches.
    - Anything else is read whole on every rank, under a random stream of its own that is seeded
      alike on every rank for each pass (``seed``, else rank 0's ``torch.initial_seed()``, plus the
      pass number; torch's CPU, Python's and numpy's global generators, restored around each
      batch): an iterator that shuffles as it goes then yields the same sequence on every rank, so
      the ranks' batches are disjoint, and the program's own draws (dropout) are not disturbed.
      Each rank still builds every batch (W times the loading work of its share).

    1 process: ``batches`` itself."""
    if world_size() <= 1:
        return batches
    from torch.utils.data import DataLoader
    if isinstance(batches, DataLoader):
        return _shard_loader(batches)
    if isinstance(batches, (list, tuple, range)):
        return shard_range(batches)
    return _ShardedBatches(batches, seed)


def _shard_loader(loader):
    """A DataLoader given to ``shard_batches``: see there. The sampler is replaced through
    ``object.__setattr__`` because DataLoader forbids setting it after construction; its
    iterators are built from it afresh on each pass, so the next pass reads only this rank's share."""
    samplers = (loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
    if any(isinstance(s, (DistributedSampler, _ShardedSampler, _StridedSampler)) for s in samplers):
        return loader
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return _ShardedBatches(loader, None)
    if loader.batch_sampler is not None:
        object.__setattr__(loader, "batch_sampler", _ShardedSampler(loader.batch_sampler, _own_seed(None)))
    else:
        object.__setattr__(loader, "sampler", _ShardedSampler(loader.sampler, _own_seed(None)))
    return loader


class _ShardedBatches:
    """See ``shard_batches``. Programs build a new iterator each epoch (``tm.shard_batches(
    batches(X, y, bs))``), so the pass number that makes each epoch's order new is counted over
    every wrapper of the process (``_PASSES``): the ranks iterate in step, so they count alike."""

    def __init__(self, inner, seed) -> None:
        self.inner, self.seed = inner, seed

    def __len__(self) -> int:
        return -(-len(self.inner) // world_size())

    def __getattr__(self, name):
        return getattr(self.inner, name)  # `train_iter.dataset`, `init_epoch()`

    def __iter__(self):
        if self.seed is None:
            self.seed = _shared_seed()
        streams = _Streams(self.seed + _PASSES["count"])
        _PASSES["count"] += 1
        with streams:
            it = iter(self.inner)
        yield from _deal(_chunked(it, streams, 1))


_PASSES = {"seed": None, "count": 0, "agreed": 0, "same": 0}  # rank 0's initial seed, shared once; passes so far; `agreed` draws


def _shared_seed() -> int:
    """Rank 0's ``torch.initial_seed()``, shared with every rank on first use (a collective then)."""
    if _PASSES["seed"] is None:
        _PASSES["seed"] = int(broadcast_object(torch.initial_seed()))
    return _PASSES["seed"]


class _Streams:
    """Global random generators of their own (torch's CPU one, Python's, numpy's), seeded with
    ``seed``, so alike on every rank given the same seed: inside ``with streams:`` the program's
    draws come from them, the state they reach carries on to the next ``with``, and the
    program's own generators are put back after. A ``np.random.seed()`` without a seed inside
    (as the widely copied endless samplers call after each round, to reseed from the OS) takes
    its seed from these streams, so it stays alike on every rank too."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            self.torch_state = torch.get_rng_state()
        self.random_state = random.Random(self.seed).getstate()
        self.numpy_state = None  # made at the first `with` that finds numpy loaded
        self.kept = None

    def __enter__(self) -> "_Streams":
        numpy = sys.modules.get("numpy")
        self.kept = (torch.get_rng_state(), random.getstate(),
                     numpy.random.get_state() if numpy is not None else None,
                     numpy.random.seed if numpy is not None else None)
        torch.set_rng_state(self.torch_state)
        random.setstate(self.random_state)
        if numpy is not None:
            if self.numpy_state is None:
                self.numpy_state = numpy.random.RandomState(self.seed % 2 ** 32).get_state()
            numpy.random.set_state(self.numpy_state)
            reseed = self.kept[3]
            numpy.random.seed = lambda seed=None: reseed(random.getrandbits(32) if seed is None else seed)
        return self

    def __exit__(self, *exc) -> None:
        self.torch_state, self.random_state = torch.get_rng_state(), random.getstate()
        torch.set_rng_state(self.kept[0])
        random.setstate(self.kept[1])
        if self.kept[2] is not None:
            numpy = sys.modules["numpy"]
            self.numpy_state = numpy.random.get_state()
            numpy.random.set_state(self.kept[2])
            numpy.random.seed = self.kept[3]


_BATCH_WARNED: set = set()
_DIVIDED_BATCHES: set = set()  # batch sizes per_rank_batch divided in this process (see batch_rows)


def per_rank_batch(batch_size: int) -> int:
    """This rank's share of a global batch of ``batch_size`` samples: ``batch_size // world_size()``,
    so the migrated program keeps the original's batch, steps per epoch, schedules and learning
    rate (each optimizer step still averages the gradients of ``batch_size`` samples). 1 process:
    ``batch_size``. A size that does not divide by the number of processes (a batch of 1 on 2
    ranks, 50 on 8) gets the next size up, ``ceil(batch_size / world_size())`` on every rank (each
    rank must run as many steps as the others), and rank 0 warns once, naming the nearest sizes
    that keep the original's global batch exactly. A batch of several samples is never divided
    down to one per rank: BatchNorm cannot train on a single sample (a BatchNorm1d head, or one
    after a global pooling, raises "Expected more than 1 value per channel"), so each rank then
    loads 2, and rank 0 says so; unless the program's models are built already and none holds a
    BatchNorm (a model without one trains on one sample per rank, and the global batch is kept)."""
    world = world_size()
    if batch_size is None or world <= 1 or _WHOLE_DATA:
        return batch_size
    size = int(batch_size)
    _DIVIDED_BATCHES.add(size)
    if 2 <= size <= world and _batchnorm_possible():
        if size not in _BATCH_WARNED and is_main():
            _BATCH_WARNED.add(size)
            _warn(f"a batch of {size} divided among {world} processes would leave one sample per rank, on which "
                  f"BatchNorm cannot train: each rank loads 2 samples, a global batch of {2 * world} instead of "
                  f"{size} (scale the learning rate, or run on {size // 2} process(es) to keep it)")
        return 2
    if size % world:
        low, high = size - size % world, size + world - size % world
        nearest = f"{low} or {high}" if low else f"{high}"
        if size not in _BATCH_WARNED and is_main():
            _BATCH_WARNED.add(size)
            advice = (f"A batch size of {nearest} keeps the original's global batch exactly." if size >= world else
                      f"A batch of {size} cannot be split: where each item is itself a batch (a dataset of buckets "
                      f"loaded with batch_size=1), divide the bucket size by {world} instead, or scale the learning "
                      "rate with the world size.")
            _warn(f"the batch size {size} does not divide among {world} processes: each rank loads "
                  f"{-(-size // world)} samples, a global batch of {-(-size // world) * world} instead of {size}. "
                  + advice)
        return -(-size // world)
    return size // world


def _batchnorm_possible() -> bool:
    """A BatchNorm may train on this process's batches: one of the modules alive holds one, or
    no module is built yet (the loader comes first: it cannot be told)."""
    modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    return not modules or any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules)


def batch_rows(batch_size: int) -> int:
    """The rows of a tensor that a training step sizes by the configured ``batch_size`` while its
    loader is built elsewhere: this rank's share once a loader's batch of that size was divided,
    else ``batch_size``. GAN noise ``torch.randn(batch_size, nz)`` and labels
    ``torch.ones(batch_size)`` in a trainer module whose loader another module builds: the
    migration cannot see the loader from there, so the runtime matches them to it:
    ``per_rank_batch(batch_size)`` where ``per_rank_batch`` divided a batch of that size in this
    process, the size itself where nothing did (one process, a loader that kept its batch)."""
    if batch_size is None or world_size() <= 1:
        return batch_size
    return per_rank_batch(batch_size) if int(batch_size) in _DIVIDED_BATCHES else batch_size


def reduce_batch_total(total, over):
    """A total of per-batch means (``epoch_loss += loss.item()`` shown or plotted as it is) over
    the training loader ``over``, made the original's: the ranks' mean where each rank ran as
    many batches as one process did (a DataLoader whose batch ``per_rank_batch`` divided), their
    sum where each ran its share of the batches (whole batches dealt out: a sampler alone, an
    iterable of batches ``tm.shard_batches`` shares out); the ranks' mean, which is every rank's
    own total, where a DataLoader was not sharded. A collective: call it on every rank."""
    if not is_distributed():
        return total
    over = _under_progress_bar(over)
    size = getattr(over, "batch_size", None)
    if size is not None and hasattr(over, "sampler"):  # a DataLoader
        divided = any(per_rank_batch(d) == size for d in _DIVIDED_BATCHES)
        return all_reduce(total, op="mean" if divided or not sharded(over) else "sum")
    return all_reduce(total, op="sum")


def _under_progress_bar(obj):
    """The loader a progress bar iterates (``tqdm(loader)``'s ``.iterable``, nested bars too), or
    ``obj`` itself: a loop over the bar runs the loader's batches."""
    for _ in range(4):
        inner = getattr(obj, "iterable", None)
        if inner is None or inner is obj or hasattr(obj, "sampler"):
            return obj
        obj = inner
    return obj


def eval_sampler(dataset, shuffle: bool = False, seed: int = 0) -> Sampler:
    """Evaluation sampler. Distributed: rank r gets indices r, r+W, r+2W, ... with no padding, so
    metrics count every sample exactly once (ranks may get one sample fewer; don't use it where
    every rank must run the same number of DDP forward/backward steps). 1 process:
    ``SequentialSampler``. ``gather_for_metrics`` undoes this interleaving. ``shuffle`` keeps an
    evaluation loader's own ``shuffle=True`` (a loop that scores only its first batches sees new
    ones each pass): a ``RandomSampler`` in one process; distributed, a permutation shared by the
    ranks (``seed`` plus the pass number) is split the same way."""
    if is_distributed():
        return _StridedSampler(dataset, rank(), world_size(), shuffle=shuffle, seed=seed)
    return RandomSampler(dataset) if shuffle else SequentialSampler(dataset)


def sharded(loader) -> bool:
    """Whether iterating ``loader`` gives this rank only its own part of the data: a DataLoader
    (or sampler) whose sampler or batch sampler is ``tm.sampler``/``tm.eval_sampler``/
    ``tm.shard_sampler``, a ``DistributedSampler``, or any sampler with ``num_replicas`` > 1.
    False in one process, and for a loader that every rank iterates in full (no sampler, the
    default samplers, a sampler of the program's own that knows no rank), or for an object with
    no sampler at all (a list, a hand-made iterator): ``all_reduce(..., over=loader)`` then leaves
    numbers computed over it as they are, since every rank computed them over the whole data."""
    if world_size() <= 1:
        return False
    seen = 0
    todo = [_under_progress_bar(loader)]
    while todo and seen < 8:
        obj = todo.pop()
        seen += 1
        if isinstance(obj, (DistributedSampler, _StridedSampler, _ShardedSampler)):
            return True
        replicas = getattr(obj, "num_replicas", None)
        if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas > 1:
            return True
        todo += [inner for name in ("sampler", "batch_sampler") if (inner := getattr(obj, name, None)) is not None
                 and inner is not obj]
    return False


def set_epoch(loader_or_sampler, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on a DataLoader's sampler (or its batch sampler's sampler), or on
    the object itself; no-op when none has one (e.g. RandomSampler in one process)."""
    bs = getattr(loader_or_sampler, "batch_sampler", None)
    for obj in (getattr(loader_or_sampler, "sampler", None), getattr(bs, "sampler", None), bs,
                loader_or_sampler):
        fn = getattr(obj, "set_epoch", None)
        if callable(fn):
            fn(epoch)
            return


def no_sync(model, sync: bool = True):
    """Context manager for gradient accumulation: when distributed and ``not sync``, enters
    ``model.no_sync()`` so backward skips DDP's gradient all-reduce (grads stay local and
    accumulate); the next backward with ``sync=True`` reduces the sum. Otherwise (1 process,
    unwrapped model, or ``sync``) a ``nullcontext``."""
    if is_distributed() and not sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


_AMP_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
              "float16": torch.float16, "half": torch.float16, "off": None, "none": None,
              "no": None, "fp32": None, "false": None, "0": None}


def amp_dtype(dtype=None):
    """The autocast dtype, or None for no autocast. ``dtype`` (a torch.dtype or "bf16"/"fp16"/
    "off"/"auto") wins over ``TORCHMIGRATE_AMP`` (default "auto"). auto: CUDA -> bf16 when
    ``torch.cuda.is_bf16_supported()`` (Ampere+) else fp16; CPU -> None (no autocast).

    auto never slows a program down: on a CPU without bf16 units (most CI machines) bf16
    autocast made a small conv net's step 16.7x slower (8.2 s vs 0.49 s) and a CIFAR trainer's
    step take 81 s, so migrated programs timed out exactly where users smoke-test them. Ask for
    bf16 on the CPU explicitly (``TORCHMIGRATE_AMP=bf16``) where the CPU has the units for it."""
    choice = dtype if dtype is not None else os.environ.get("TORCHMIGRATE_AMP", "auto")
    if isinstance(choice, torch.dtype):
        return choice
    choice = str(choice).strip().lower()
    if choice in _AMP_NAMES:
        return _AMP_NAMES[choice]
    if choice != "auto":
        raise ValueError(f"torchmigrate.runtime: unknown AMP setting {choice!r} "
                         "(expected auto, bf16, fp16 or off)")
    if device().type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return None


def autocast(dtype=None, enabled: bool = True) -> torch.autocast:
    """``torch.autocast`` for ``device()``'s type with ``amp_dtype(dtype)``; disabled when the
    policy says off or ``enabled`` is false. A context manager or decorator, in every mode."""
    dt = amp_dtype(dtype)
    return torch.autocast(device().type, dtype=dt, enabled=bool(enabled) and dt is not None)


def fill_value(value, like=None):
    """A fill constant beyond half precision's range (``scores.masked_fill(mask, -1e9)``, the
    attention mask of most transformer code), made to fit the tensor it fills: under fp16
    autocast the attention scores are fp16, whose largest finite value is 65504, and
    ``masked_fill`` raises "value cannot be converted to type c10::Half without overflow" at the
    first step. The value is clamped to the finite range of ``like``'s dtype (the tensor filled),
    or, without it, of the autocast dtype while autocast runs. ``exp(-65504)`` is 0 as
    ``exp(-1e9)`` is, so a softmax mask keeps its meaning. Anywhere else (float32, AMP off, the
    CPU) the value comes back unchanged."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return value
    if isinstance(like, torch.Tensor):
        dtype = like.dtype
    else:
        kind = device().type
        if not torch.is_autocast_enabled(kind):
            return value
        dtype = torch.get_autocast_dtype(kind)
    if not dtype.is_floating_point:
        return value
    limit = torch.finfo(dtype).max
    return max(-limit, min(limit, value)) if abs(value) != float("inf") else value


_DATA_PARALLEL_KEPT = False  # wrap_model kept a DataParallel in this process (data_parallel=True)


def replicas(n: int) -> int:
    """How many copies of an input the program makes for DataParallel to scatter, one per GPU
    (``x.unsqueeze(0).repeat(n_gpu, 1, 1)``, ``lengths.max().repeat(torch.cuda.device_count())``):
    ``n`` where ``wrap_model`` kept the DataParallel (one process, as the original ran), else 1.
    Under torchrun each rank's model runs whole on its own GPU (DDP scatters nothing), and where
    the migration dropped the DataParallel the model is called once, so one copy is what the
    forward expects; ``n`` copies would reach it as a batch of ``n``."""
    return n if _DATA_PARALLEL_KEPT and not is_distributed() else 1


def data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    """``nn.parallel.data_parallel``'s one call across the GPUs, as a plain forward under torchrun.

    Under torchrun each rank owns one GPU and the model (wrapped by ``wrap_model``) averages its
    gradients itself, so the module is called on this rank's inputs (a tensor or a tuple of
    them, as ``data_parallel`` takes). In one process the original call runs unchanged. A
    program's own replicate/scatter/parallel_apply helper (a Tacotron-style
    ``data_parallel_workaround``) goes through it too: it would otherwise spread every rank's
    batch over all the node's GPUs, where the other ranks' models live."""
    if is_distributed():
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        return module(*args, **(module_kwargs or {}))
    return nn.parallel.data_parallel(module, inputs, device_ids=device_ids, output_device=output_device, dim=dim,
                                     module_kwargs=module_kwargs)


class ParallelPart(nn.Module):
    """What ``parallel_part`` returns under torchrun: the submodule under a ``module`` attribute,
    called as it is, like the ``nn.DataParallel`` it replaces (no scattering)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def parallel_part(module: nn.Module, *args, **kwargs) -> nn.Module:
    """``nn.DataParallel(module, ...)`` for a part of a model (``model.features =
    nn.DataParallel(model.features)``, pytorch/examples' AlexNet and VGG) in one process, as the
    original wrote it. Under torchrun each rank has one GPU and the whole model is wrapped in DDP,
    so the part is held by a ``ParallelPart`` instead: the forward runs on this rank's GPU, and
    the ``.module`` level stays, so ``state_dict`` keys (``features.module.0.weight``), code that
    reads ``model.features.module`` and checkpoints written by the original all still match."""
    if is_distributed():
        return ParallelPart(module)
    return nn.DataParallel(module, *args, **kwargs)


def to_float32(value):
    """``value`` with its bf16/fp16 tensors as float32 (also inside a tuple, list, namedtuple or
    dict such as a model's output dict); anything else is returned as is. Migrated code applies
    it to forward outputs read after the ``autocast`` block, so the metrics computed from them
    (a test loss, softmax probabilities) are computed in float32. Differentiable, so a loss
    computed from the result still trains the model."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = to_float32(item)
        return out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_float32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_float32(v) for v in value)
    return value


def set_device() -> torch.device:
    """``torch.cuda.set_device(device())`` where this process's device is a GPU; nothing on the
    CPU. What a program's own ``torch.cuda.set_device(i)`` becomes where it may run before
    ``setup()`` (the top of an imported module): later ``.cuda()`` calls go to this process's GPU,
    and a CPU run (gloo ranks, ``torchmigrate verify``) goes on, as the original's
    ``set_device(-1)`` did. Returns ``device()``."""
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def as_device(spec) -> torch.device:
    """The device ``spec`` names, with a GPU of any number (``0``, ``"cuda"``, ``"cuda:1"``, a CUDA
    ``torch.device``) read as this process's own, ``device()``: what a single-GPU program means
    by "the GPU" is the rank's GPU under torchrun. Anything else (``"cpu"``, ``"mps"``) is
    ``torch.device(spec)``. Migrated code uses it where a device is made from a value the
    analysis cannot see (``torch.device(t)`` for ``t`` in the program's device list)."""
    kind = spec.type if isinstance(spec, torch.device) else (
        "cuda" if isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0 else
        spec.split(":", 1)[0] if isinstance(spec, str) else None)
    return device() if kind == "cuda" else torch.device(spec)


def device_arg(spec: str) -> str:
    """``argparse``'s ``type=`` for a device option (``add_argument("--device", default="cuda:0",
    type=tm.device_arg)``, what ``torchmigrate ddp`` makes of a string device option): any GPU the
    command line or the default names (``-d cuda:0``, ``--device cuda``) is this process's own,
    as a string (``"cuda:1"`` on local rank 1; the CPU where there is no GPU); ``cpu`` and other
    devices stay as given. Every rank may then be started with the same ``-d cuda:0``. A value
    that names no device is argparse's "invalid device_arg value" error."""
    try:
        return str(as_device(spec))
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {spec!r}") from exc


def _processes_on_node() -> int:
    """How many of the job's processes share this node: torchrun's ``LOCAL_WORLD_SIZE``, else
    SLURM's tasks per node (``8`` or ``8(x2)``), else the world size (1 alone)."""
    e = os.environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        match = re.match(r"\s*(\d+)", e.get(key, ""))
        if match:
            return int(match.group(1))
    return _env()["WORLD_SIZE"]


_VISIBLE_WARNED: set = set()


def visible_devices(value, *, if_unset: bool = False) -> None:
    """``os.environ["CUDA_VISIBLE_DEVICES"] = str(value)``, as the program wrote it, where that
    still gives every process on this node a GPU of its own; ``if_unset=True`` is
    ``os.environ.setdefault``'s form.

    A single-GPU program picks its GPU this way (``"0"``, ``args.gpu``), and as one process it
    still does. Under torchrun or SLURM with N processes on the node, the same line would show
    all N processes that one GPU: NCCL refuses two ranks on one device, and gloo would train
    them all there. Each process uses ``device()`` = ``cuda:LOCAL_RANK`` of what is visible, so
    the program's list is kept when it names at least N GPUs (``"0,1,2,3"`` for 4 processes) or
    none (``""``, ``"-1"``: a CPU run on every rank), and otherwise the launcher's GPUs stay
    visible and rank 0 warns once for the line. Set before CUDA starts, as the original's
    assignment has to be."""
    text = str(value)
    if if_unset and "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    listed = [v for v in text.split(",") if v.strip()]
    hidden = not listed or listed[0].strip() == "-1"
    local = _processes_on_node()
    if local <= 1 or hidden or len(listed) >= local:
        os.environ["CUDA_VISIBLE_DEVICES"] = text
        return
    frame = _user_frame(sys._getframe(1))
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame else "the program"
    if where not in _VISIBLE_WARNED and is_main():
        _VISIBLE_WARNED.add(where)
        _warn(f"{where} sets CUDA_VISIBLE_DEVICES={text!r} ({len(listed)} GPU(s)) for {local} processes on this "
              "node; kept the launcher's GPUs instead, so that each process has its own (device() = "
              "cuda:LOCAL_RANK). Choose GPUs for a distributed run with CUDA_VISIBLE_DEVICES on the launch line.")


def to_device(*values):
    """The items of a training loop's batch on ``device()``: tensors, and objects with their own
    ``.to(device)`` (a graph batch, a model), are moved; anything else (a count, a list of
    lengths, strings, ids) is returned as it is. Migrated code moves a batch with it
    (``inputs, labels = tm.to_device(inputs, labels)``) where it cannot know that every item is a
    tensor (``for n, x, y in batches`` with ``loss * n``). One value: that value; several: a tuple."""
    target = device()
    moved = tuple(v.to(target) if isinstance(v, torch.Tensor) or (
        not isinstance(v, (str, bytes, type)) and callable(getattr(v, "to", None))) else v for v in values)
    return moved[0] if len(moved) == 1 else moved


def GradScaler(enabled=None, dtype=None, **kwargs) -> torch.amp.GradScaler:
    """``torch.amp.GradScaler`` for ``device()``'s type. By default enabled only for fp16 on CUDA
    (fp16 gradients underflow without loss scaling); with bf16, off or on CPU it is disabled, so
    ``scale(loss)`` returns ``loss`` and ``step(opt)`` is ``opt.step()``. ``dtype`` mirrors
    ``autocast``'s (a script forced to fp16 gets a scaler); an explicit ``enabled`` wins. Its
    ``step``/``unscale_`` also take a project's optimizer wrapper (no ``param_groups``, a torch
    optimizer held inside, its own ``step()``): the held optimizer's gradients are unscaled and
    the wrapper's ``step()`` runs, or is skipped on an overflow."""
    dev_type = device().type
    if enabled is None:
        enabled = dev_type == "cuda" and amp_dtype(dtype) == torch.float16
    scaler = _Scaler(dev_type, enabled=bool(enabled), **kwargs)
    _SCALERS.append(weakref.ref(scaler))
    return scaler


_SCALERS: list = []  # weak references to the GradScalers made by GradScaler(), oldest first


class _Scaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that, like a plain ``optimizer.step()``, lets a step without
    gradients pass: an optimizer whose parameters got no gradient this step (a GAN's other model,
    a head the loss skipped) has nothing to step, where torch's scaler asserts "No inf checks were
    recorded for this optimizer" (and ``update()`` after only such steps, "No inf checks were
    recorded prior to update")."""

    def step(self, optimizer, *args, **kwargs):
        optimizer = self._view(optimizer)
        if self.is_enabled() and not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            return None
        if self.is_enabled() and is_distributed():
            _average_stray(optimizer)  # before the inf check: every rank skips the same steps
            self.__dict__.setdefault("_tm_averaged", []).append(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def unscale_(self, optimizer):
        optimizer = self._view(optimizer)
        if self.is_enabled() and is_distributed():
            _average_stray(optimizer)
            self.__dict__.setdefault("_tm_averaged", []).append(optimizer)
        return super().unscale_(optimizer)

    def _view(self, optimizer):
        """A project's optimizer wrapper (`TransformerOptimizer(Adam(...))`: a `step()` that sets
        the learning rate and steps the torch optimizer it holds, but no `param_groups`) as the
        scaler sees it: the held optimizer's parameters, the wrapper's own `step()`. One view
        per wrapper, so `unscale_` and `step` of one iteration meet the same object."""
        if not self.is_enabled() or hasattr(optimizer, "param_groups"):
            return optimizer
        views = self.__dict__.setdefault("_tm_views", {})
        if id(optimizer) not in views:
            inner = next((v for v in vars(optimizer).values() if isinstance(v, torch.optim.Optimizer)), None) \
                if hasattr(optimizer, "__dict__") else None
            if inner is None:
                raise TypeError(f"GradScaler: {type(optimizer).__name__} has no param_groups and holds no torch "
                                "optimizer: step the optimizer it wraps through the scaler")
            views[id(optimizer)] = (optimizer, _WrapperView(optimizer, inner))
        return views[id(optimizer)][1]

    def update(self, new_scale=None):
        for optimizer in self.__dict__.pop("_tm_averaged", ()):  # a step skipped on an overflow keeps its mark
            optimizer.__dict__.pop("_tm_stray_synced", None)
        if self.is_enabled() and new_scale is None and self._scale is not None and not any(
                state["found_inf_per_device"] for state in self._per_optimizer_states.values()):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)
            return  # nothing was stepped through the scaler: its scale stays
        return super().update(new_scale)


class _WrapperView:
    """An optimizer wrapper as ``GradScaler`` sees it (see ``_Scaler._view``)."""

    def __init__(self, wrapper, inner) -> None:
        self._wrapper, self._inner = wrapper, inner

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def step(self, *args, **kwargs):
        return self._wrapper.step(*args, **kwargs)


def grad(outputs, inputs, grad_outputs=None, scaler=None, **kwargs):
    """``torch.autograd.grad`` for a gradient penalty (``create_graph=True``) in a program with
    mixed precision, by the AMP recipe: with an enabled (fp16) GradScaler the outputs are scaled
    before differentiating and the gradients unscaled after, so small gradients do not flush to
    zero in fp16 (an overflow gives inf, which reaches the loss, and the scaler skips that
    step). ``scaler`` defaults to the newest enabled ``tm.GradScaler``: any scale protects the
    gradients, as they are divided by the same scale. Without one (bf16, CPU, AMP off) it is
    ``torch.autograd.grad`` unchanged."""
    if scaler is None:
        live = [s for s in (ref() for ref in _SCALERS) if s is not None and s.is_enabled()]
        scaler = live[-1] if live else None
    if scaler is None or not scaler.is_enabled():
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, **kwargs)
    else:
        scale = scaler.get_scale()
        grads = torch.autograd.grad(scaler.scale(outputs), inputs, grad_outputs=grad_outputs, **kwargs)
        grads = tuple(None if g is None else g * (1.0 / scale) for g in grads)
    if kwargs.get("create_graph") and _DDP_WRAPPERS:
        grads = _reaching_every_parameter(outputs, grads)
    return grads


def _reaching_every_parameter(outputs, grads):
    """Gradients of a penalty that give every parameter of the DDP models in ``outputs``' graph
    a gradient when the penalty is backpropagated. The second derivative of a parameter that acts
    linearly on the output (the last layer's bias) is zero and autograd gives it no gradient at
    all, so a backward of the penalty alone (``gp.backward()``) would leave DDP waiting for it:
    "Expected to have finished reduction in the prior iteration" at the next forward. A zero
    term over those parameters (``0 * p.sum()``) changes no value and lets every gradient be
    averaged across the ranks."""
    seen, params, stack = set(), set(), []
    stack.extend(t.grad_fn for t in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            params.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    touched = []
    for ref in _DDP_WRAPPERS:
        wrapper = ref()
        if wrapper is None:
            continue
        own = [p for p in wrapper.module.parameters() if p.requires_grad]
        if any(id(p) in params for p in own):
            touched += own
    first = next((i for i, g in enumerate(grads) if g is not None), None)
    if not touched or first is None:
        return grads
    zero = sum(p.sum() for p in touched) * 0.0
    return tuple(g + zero.to(g.dtype) if i == first else g for i, g in enumerate(grads))


def print(*args, sep=" ", end="\n", file=None, flush=True) -> None:  # noqa: A001 - mirrors builtins.print
    """``print`` on global rank 0 only (flushes by default); silent on other ranks.

    The line reaches the stream in one write: ``builtins.print`` writes the text and then the
    newline, and on the console every rank shares, another rank's warning can land between the
    two and leave rank 0's line glued to it."""
    if not is_main():
        return
    file = sys.stdout if file is None else file
    if file is None:  # pythonw: no console
        return
    line = io.StringIO()
    builtins.print(*args, sep=sep, end=end, file=line)
    file.write(line.getvalue())
    if flush:
        file.flush()


def _nccl() -> bool:
    return "nccl" in str(dist.get_backend())


def barrier() -> None:
    """Wait for every rank. 1 process: no-op. gloo: ``dist.barrier()``. nccl:
    ``dist.barrier(device_ids=[local_rank])`` so the barrier runs on this rank's GPU."""
    if not is_distributed():
        return
    _require_pg()
    if _nccl():
        dist.barrier(device_ids=[device().index])
    else:
        dist.barrier()


_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def all_reduce(*xs, op: str = "sum", over=None):
    """Reduce values across ranks and return the results (inputs are not modified).

    ``over``: the loader the values were computed over. Where it is not sharded (``sharded``:
    every rank iterated all of it, e.g. an evaluation loader kept whole) the values are already
    those of the whole data, identical on every rank, and are returned as they are, as in one
    process (a sum reduced again would count every sample once per rank). A collective when the
    loader is sharded: call it on every rank.

    ``op``: "sum", "mean", "max" or "min". Python numbers in, numbers out (ints stay ints for
    sum/max/min; mean gives floats); tensors in, new tensors out on the input's device (moved to
    the GPU for nccl and back; fp16/bf16 are reduced in float32; integer/bool mean gives float,
    bool sum gives int64); a list or tuple of numbers or tensors (per-class counts, one running
    loss per head) in, a new one of the same type out, reduced element by element (the lengths
    must agree across ranks); a dict in, a copy with its values reduced (its keys alike on every
    rank); a numpy array in, a numpy array out. Values are packed into one flat
    buffer per dtype, so one collective runs per dtype (ints travel as int64, exactly; floats as float64). One argument returns one
    value, several a tuple.
    1 process: identity (except mean's float conversion). For metrics, not autograd.
    """
    if op not in _OPS:
        raise ValueError(f"all_reduce: op must be one of {sorted(_OPS)}, got {op!r}")
    if any(isinstance(x, dict) for x in xs):
        return _all_reduce_dicts(xs, op, over)
    if any(isinstance(x, (list, tuple)) for x in xs):
        return _all_reduce_sequences(xs, op, over)
    if any(_ndarray(x) for x in xs):  # `loss.detach().cpu().numpy()` and sums of them: numpy back
        got = all_reduce(*(torch.as_tensor(x) if _ndarray(x) else x for x in xs), op=op, over=over)
        got = list(got) if len(xs) > 1 else [got]
        back = [g.cpu().numpy() if _ndarray(x) else g for x, g in zip(xs, got)]
        return back[0] if len(back) == 1 else tuple(back)
    world = world_size() if over is None or sharded(over) else 1
    out = list(xs)
    if world > 1:
        _require_pg()
        comm = device() if _nccl() else torch.device("cpu")
        groups: dict = {}  # keyed by dtype only, so every rank packs the same buffers
        for i, x in enumerate(xs):
            if isinstance(x, torch.Tensor):
                t = x.detach()
                work = (torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else
                        torch.int64 if x.dtype == torch.bool else x.dtype)
            elif isinstance(x, numbers.Real):
                work = torch.int64 if isinstance(x, numbers.Integral) else torch.float64
                t = torch.tensor(int(x) if work == torch.int64 else float(x), dtype=work)
            else:
                raise TypeError(f"all_reduce: expected numbers or tensors, got {type(x).__name__}")
            groups.setdefault(work, []).append((i, t.to(comm, work).reshape(-1)))
        for items in groups.values():
            buf = torch.cat([t for _, t in items])
            dist.all_reduce(buf, op=getattr(dist.ReduceOp, _OPS[op]))
            for (i, _), part in zip(items, buf.split([t.numel() for _, t in items])):
                x = xs[i]
                out[i] = part.reshape(x.shape) if isinstance(x, torch.Tensor) else part.item()
    for i, (x, y) in enumerate(zip(xs, out)):
        if isinstance(x, torch.Tensor):
            if op == "mean":
                y = y / world
                y = y.to(x.dtype) if x.is_floating_point() else y
            else:
                y = y.to(torch.int64 if x.dtype == torch.bool and op == "sum" else x.dtype)
            out[i] = y.to(x.device)
        elif op == "mean":
            out[i] = float(y) / world
        elif isinstance(x, numbers.Integral):
            out[i] = int(y)
    return out[0] if len(out) == 1 else tuple(out)


def _ndarray(x) -> bool:
    """A numpy array (without importing numpy: a program that never imports it has none)."""
    kind = type(x)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"


def _all_reduce_dicts(xs, op: str, over):
    """A dict of numbers or tensors by key (per-timestep loss bins, `{i: 0 for i in range(10)}`)
    in, a copy of it out with every value reduced; the keys, in their order, must agree across
    ranks (every rank builds the dict alike). Other arguments are reduced as usual."""
    out = []
    for x in xs:
        if isinstance(x, dict):
            keys = list(x)
            # Python numbers travel as floats: an entry may still be the int it started as on one
            # rank (a bin no sample reached) and a float on another, and the ranks must pack the
            # same buffers; an int entry whose total is whole comes back an int
            local = list(x.values())
            sent = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in local]
            values = all_reduce(sent, op=op, over=over) if keys else []
            values = [int(r) if isinstance(v, int) and not isinstance(v, bool) and isinstance(r, float)
                      and r.is_integer() else r for v, r in zip(local, values)]
            new = x.copy()
            new.update(zip(keys, values))
            out.append(new)
        else:
            out.append(all_reduce(x, op=op, over=over))
    return out[0] if len(out) == 1 else tuple(out)


def _all_reduce_sequences(xs, op: str, over):
    """``all_reduce`` of arguments some of which are lists or tuples: their elements are reduced
    with the other values in one call, then put back into a sequence of the input's type."""
    flat: list = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            if any(isinstance(e, (list, tuple)) for e in x):
                raise TypeError("all_reduce: expected numbers, tensors or flat lists of them, got a nested list")
            flat.extend(x)
        else:
            flat.append(x)
    got = all_reduce(*flat, op=op, over=over) if flat else ()
    got = list(got) if len(flat) > 1 else [got] if flat else []
    out, at = [], 0
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.append(type(x)(got[at:at + len(x)]) if type(x) in (list, tuple) else list(got[at:at + len(x)]))
            at += len(x)
        else:
            out.append(got[at])
            at += 1
    return out[0] if len(out) == 1 else tuple(out)


def gather_for_metrics(x, total_len: int | None = None, over=None):
    """All-gather per-rank results along dim 0 and return them in dataset order.

    ``over``: the loader the results were computed over; where it is not sharded (``sharded``),
    every rank holds the whole set's results already and gets ``x[:total_len]``, as in one
    process.

    Ordering: the result interleaves ranks element by element (rank 0's first, rank 1's first,
    ..., rank 0's second, ...), which is dataset order for ``eval_sampler`` and for
    ``DistributedSampler(shuffle=False)``; so ``result[i]`` belongs to dataset index ``i``.
    Per-rank lengths may differ (padded for the collective, then unpadded); ``total_len``
    truncates (drops DistributedSampler's padding duplicates). nccl moves data to the GPU and
    back. Lists/tuples/dicts of tensors are gathered item by item. 1 process: ``x[:total_len]``.
    """
    if isinstance(x, (list, tuple)):
        return type(x)(gather_for_metrics(v, total_len, over) for v in x)
    if isinstance(x, dict):
        return {k: gather_for_metrics(v, total_len, over) for k, v in x.items()}
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gather_for_metrics: expected a tensor, got {type(x).__name__}")
    x = x.reshape(1) if x.dim() == 0 else x
    if is_distributed() and (over is None or sharded(over)):
        _require_pg()
        comm = device() if _nccl() else torch.device("cpu")
        t = x.detach().to(comm)
        n = torch.tensor([t.shape[0]], device=comm)
        sizes = [torch.empty_like(n) for _ in range(world_size())]
        dist.all_gather(sizes, n)
        sizes = torch.cat(sizes).cpu()
        longest = int(sizes.max())
        if t.shape[0] < longest:
            t = torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        parts = [torch.empty_like(t) for _ in sizes]
        dist.all_gather(parts, t)
        keep = torch.arange(longest)[:, None] < sizes[None, :]  # (position, rank)
        x = torch.stack(parts, dim=1)[keep.to(comm)].to(x.device)
    return x if total_len is None else x[:total_len]


def all_rows(x):
    """Every rank's rows of ``x`` (a tensor or numpy array: a batch's sample indices, or the rows
    computed for them), in the same order on every rank, for a state tensor written at a batch's
    indices: ``state[tm.all_rows(index)] = tm.all_rows(rows)`` applies every rank's update on
    every rank, so the ranks' copies of the state stay identical as the shards change (what
    ``torchmigrate ddp`` writes for a per-sample target of a loss, a memory bank, class centers).
    Indices and rows gathered by two calls pair up (same per-rank lengths, same order). Rows are
    detached. A collective while gradients are enabled (a training step); under
    ``torch.no_grad()`` (an evaluation, whose loops may differ in length between ranks) and in
    one process, ``x`` itself."""
    if not is_distributed() or not torch.is_grad_enabled():
        return x
    if not isinstance(x, torch.Tensor):
        np = _numpy()
        if np is not None and isinstance(x, np.ndarray):
            return all_rows(torch.from_numpy(x)).numpy()
        raise TypeError(f"all_rows: expected a tensor or a numpy array, got {type(x).__name__}")
    return gather_for_metrics(x)


def gather_rows(x):
    """Every rank's rows of ``x`` (a tensor computed from this training step's batch: the keys a
    MoCo-style queue takes in, the features a fixed-size memory bank enqueues), on every rank,
    detached: a queue kept across steps then takes in the whole global batch at each step, as in
    one process, and stays the same on every rank (what the reference MoCo's
    ``concat_all_gather`` does). Unlike ``all_rows`` it gathers under ``torch.no_grad()`` too (an
    enqueue usually runs there): a collective at every call, so call it once per training step on
    every rank. Rows come rank by rank, interleaved (``gather_for_metrics``'s order); per-rank
    lengths may differ. 1 process: ``x``."""
    if not is_distributed():
        return x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gather_rows: expected a tensor, got {type(x).__name__}")
    return gather_for_metrics(x.detach())


def gather_list(values, over=None) -> list:
    """Every rank's ``values`` (a list of numbers, small tensors or dicts of them), concatenated in rank order,
    on every rank; 1 process: ``values`` itself. For means of per-batch values (``sum(l) / len(l)``),
    which then cover every batch of every rank and agree across ranks, and for the predictions and
    targets a loop collected for a metric that needs every sample (F1, AUC: gather every list the
    metric reads, so each prediction stays beside its target). ``over``: the loader they were
    collected over; where it is not sharded (``sharded``) every rank holds them all already and
    ``values`` comes back as it is. Tensors travel on the CPU (detached) and come back on the
    device this rank's own were on. A collective: call it on every rank."""
    if not is_distributed() or (over is not None and not sharded(over)):
        return values
    _require_pg()
    mine = [_to_cpu(v) for v in values]
    parts = [None] * world_size()
    dist.all_gather_object(parts, mine)
    gathered = [v for part in parts for v in part]
    here = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    if here is not None and here.type != "cpu":
        gathered = [v.to(here) if isinstance(v, torch.Tensor) else v for v in gathered]
    return gathered


def broadcast_object(value, src: int = 0):
    """Rank ``src``'s ``value`` (any picklable object) on every rank; 1 process: ``value``. For
    values drawn at random that every rank must agree on: a learning rate or epoch count picked
    at random, a shuffled file list or a permutation that splits train from validation. Sets up
    the process group first if the program has not yet (the draw may come before the code that
    does). Tensors come back on the device they were on. Inside ``on_main`` (a helper the main
    process runs alone) it is ``value``: the others are not there to receive. A collective: call
    it on every rank."""
    if world_size() <= 1 or _ON_MAIN[0] or (not _pg() and _in_worker_process()):
        return value
    if not _pg():
        setup()
    box = [_to_cpu(value) if rank() == src else None]
    if _numpy() is not None:
        dist.broadcast_object_list(box, src=src)
    else:  # (torch's object broadcast reads the bytes back through numpy)
        box = [pickle.loads(_broadcast_bytes(pickle.dumps(box[0]) if rank() == src else b"", src))]
    if isinstance(value, torch.Tensor):
        return box[0].to(value.device)
    return box[0]


def _numpy():
    """The numpy module, imported if it is installed, else None (the runtime runs without it)."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _broadcast_bytes(data: bytes, src: int) -> bytes:
    """Rank ``src``'s ``data`` on every rank, with two tensor broadcasts (its length, then its
    bytes): an object broadcast that needs no numpy."""
    comm = device() if _nccl() else torch.device("cpu")
    size = torch.tensor([len(data)], dtype=torch.int64, device=comm)
    dist.broadcast(size, src=src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=comm)
    if rank() == src and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    return bytes(buf.cpu().tolist())


_ON_MAIN = [0]  # depth of `on_main` calls running on this process


def on_main(func, *args, **kwargs):
    """``func(*args, **kwargs)`` run by the main process alone, its result returned on every rank.
    For a helper that picks a free name by probing the file system (``for i in range(1, 100): d =
    f"{name}-{i:02d}"; if not os.path.exists(d): os.makedirs(d); return d``): run on every rank,
    the first rank makes ``run-01`` and the next finds it taken and makes ``run-02``, so the ranks
    save into different folders. If ``func`` raises on the main process, every rank raises the
    same error. A result that cannot be pickled (a writer, a logger with open files) cannot be
    sent: the other ranks then call ``func`` themselves, as the original program did, with a
    warning. Inside another ``on_main`` it just calls ``func`` (the others are not there to
    receive). A collective: call it on every rank. 1 process: ``func(*args, **kwargs)``."""
    if world_size() <= 1 or _ON_MAIN[0] or _in_worker_process():
        return func(*args, **kwargs)
    if not _pg():
        setup()
    name = getattr(func, "__qualname__", repr(func))
    box = [None]
    if rank() == 0:
        _ON_MAIN[0] += 1
        try:
            result = func(*args, **kwargs)
            box = [("ok", _to_cpu(result))]
        except Exception as exc:  # noqa: BLE001 - raised again on every rank below
            box = [("error", exc)]
        finally:
            _ON_MAIN[0] -= 1
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception:  # noqa: BLE001 - a result or an error that does not pickle (nothing was sent)
            dist.broadcast_object_list([("local", None) if box[0][0] == "ok" else ("error", RuntimeError(
                f"{name} raised on the main process: {box[0][1]!r}"))], src=0)
        if box[0][0] == "error":
            raise box[0][1]
        return result
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    if kind == "local":
        _warn(f"rank {rank()} calls {name} itself: what it returned on the main process cannot be sent to the "
              "other ranks (it does not pickle), so each rank picks its own result, as the original did")
        return func(*args, **kwargs)
    return value


_NULL_STREAM = None


def bar_stream(file=None):
    """Where a progress bar draws: ``file`` (``None``: tqdm's default) on the main process, a
    stream that discards everything on the other ranks. For ``tqdm(..., file=tm.bar_stream())``
    where the program reads the bar's count (``-loss / pbar.n``): a bar disabled on the other
    ranks would stop counting there (``pbar.n`` stays 0), this one counts on every rank and is
    drawn once."""
    global _NULL_STREAM
    if is_main():
        return file
    if _NULL_STREAM is None:
        _NULL_STREAM = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    return _NULL_STREAM


_INPUTS = 0  # tm.input calls on this rank: the n-th answer is the store's key n


def input(prompt: str = "") -> str:  # noqa: A001 - the builtin's stand-in, called as tm.input
    """The builtin ``input(prompt)``, asked once: the main process reads the answer (the
    terminal and stdin are its) and every rank gets the same string. Under torchrun every rank
    inherits stdin, so plain ``input()`` makes the ranks compete for lines (different answers
    per rank, or EOFError on all but one). The answer goes through the process group's store,
    not a collective: rank 0 never waits for the others, and a rank asking a question rank 0
    did not ask (one that depends on a folder rank 0 just made) stops after
    ``TORCHMIGRATE_INPUT_WAIT`` seconds (600) with an error that says so, instead of hanging.
    An EOFError or Ctrl-C on the main process is raised on every rank that asks. Sets up the
    process group first if needed. 1 process: ``input(prompt)``."""
    global _INPUTS
    if world_size() <= 1 or (not _pg() and _in_worker_process()):
        return builtins.input(prompt)
    _require_pg()
    _INPUTS += 1
    key = f"torchmigrate/input/{_INPUTS}"
    store = dist.distributed_c10d._get_default_store()
    if rank() == 0:
        try:
            answer = builtins.input(prompt)
        except BaseException as exc:
            store.set(key, "e" + type(exc).__name__ + "\t" + str(exc))
            raise
        store.set(key, "a" + answer)
        return answer
    wait = float(os.environ.get("TORCHMIGRATE_INPUT_WAIT", "600"))
    try:
        store.wait([key], datetime.timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - the store's timeout
        raise RuntimeError(
            f"torchmigrate.runtime: rank {rank()} asks {prompt!r}, which rank 0 did not ask within {wait:.0f} s: "
            "the question depends on something that differs by rank (a folder rank 0 just created, a value of "
            "this rank's own); ask it on every rank alike, or give the answer as an option") from None
    value = store.get(key).decode("utf-8")
    if value.startswith("a"):
        return value[1:]
    name, _, message = value[1:].partition("\t")
    if name == "EOFError":
        raise EOFError(message)
    if name == "KeyboardInterrupt":
        raise KeyboardInterrupt(message)
    raise RuntimeError(f"torchmigrate.runtime: rank 0 could not read the answer to {prompt!r} ({name}: {message})")


def _in_worker_process() -> bool:
    """A process that ``multiprocessing`` started (a DataLoader worker that imports the program's
    modules again under the spawn or forkserver start methods): it is no rank, so module-level
    code that shares a value across ranks keeps its own there instead of waiting for peers."""
    import multiprocessing
    return multiprocessing.parent_process() is not None


def shared_generator(seed: int | None = None) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded alike on every rank, for ``random_split(...,
    generator=tm.shared_generator())``: every rank makes the same split. The seed is ``seed``, or
    rank 0's ``torch.initial_seed()``: fixed when the program seeds torch, new each run when it
    does not, as the split was before. One process without ``seed``: torch's default generator,
    so the split (and every draw after it) is exactly the original program's. A collective: call
    it on every rank."""
    if seed is None and world_size() <= 1:
        return torch.default_generator
    generator = torch.Generator()
    generator.manual_seed(int(broadcast_object(torch.initial_seed() if seed is None else seed)))
    return generator


def move_into_place(src, dst) -> None:
    """``os.replace(src, dst)`` for a temporary file each process wrote for itself (an atomic
    save: ``tmp = NamedTemporaryFile(dir=folder, delete=False); torch.save(obj, tmp);
    os.replace(tmp.name, path)``): the main process moves its file into place, every other rank
    removes its own, so ``dst`` is written once and no temporary file is left behind. 1 process:
    ``os.replace(src, dst)``."""
    if is_main() or world_size() <= 1:
        os.replace(src, dst)
    else:
        try:
            os.remove(src)
        except FileNotFoundError:
            pass


def same_draws(loader):
    """``loader`` (a DataLoader every rank reads whole: an evaluation set) drawing the same random
    numbers on every rank while it is iterated: a random crop, a random subset of points or
    frames, a dataset that samples, workers' seeds. Once training starts each rank draws its own
    numbers (``seed_per_rank``), and without this every rank would compute a different
    validation loss from the same set and choose its own best model, learning rate or early
    stop. Each pass draws anew from streams seeded alike (rank 0's ``torch.initial_seed()``,
    shared when ``seed_per_rank`` runs, plus a pass count), the program's own generators put
    back after; no collective. The same object is returned (its class a subclass of its own,
    so ``isinstance`` and every attribute hold). 1 process: ``loader`` as it is."""
    if world_size() <= 1 or getattr(type(loader), "_tm_same_draws", False):
        return loader
    loader.__class__ = _same_draws_class(type(loader))
    return loader


_SAME_DRAWS_CLASSES: dict = {}


def _same_draws_class(cls):
    if cls not in _SAME_DRAWS_CLASSES:
        def __iter__(self):
            if not _PER_RANK_STREAMS or _PASSES["seed"] is None or _in_worker_process():
                return cls.__iter__(self)  # every rank draws alike already (or one process)
            _PASSES["same"] += 1
            return _SameDrawsIterator(cls.__iter__, self, _Streams(_PASSES["seed"] + 7_919 * _PASSES["same"]))

        _SAME_DRAWS_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__iter__": __iter__, "_tm_same_draws": True, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return _SAME_DRAWS_CLASSES[cls]


class _SameDrawsIterator:
    """The loader's own iterator, started and advanced under streams seeded alike on every rank
    (the workers' seeds are drawn when it starts; a dataset in the main process draws in
    ``__next__``); between batches the program draws from its own. Anything else (``len``)
    goes to the loader's iterator."""

    def __init__(self, start, loader, streams: "_Streams") -> None:
        self._tm_streams = streams
        with streams:
            self._tm_it = start(loader)

    def __iter__(self):
        return self

    def __next__(self):
        with self._tm_streams:
            return next(self._tm_it)

    def __len__(self) -> int:
        return len(self._tm_it)

    def __getattr__(self, name):
        return getattr(self.__dict__["_tm_it"], name)


def agreed(draw, *args, **kwargs):
    """``draw(*args, **kwargs)`` with Python's, numpy's and torch's global generators seeded alike
    on every rank, for a reordering that a hand-made batch iterator makes before it is read
    (``tm.agreed(train_loader.shuffle)`` before ``tm.shard_batches(train_loader.get_iterator())``):
    every rank makes the same permutation, so the every-W-th batches the ranks keep are disjoint.
    Where the generators the draw uses are alike on every rank (before ``seed_per_rank``, as
    ``setup()`` leaves them, or seeded again by the program after it: ``random.seed(seed)`` just
    before ``random.shuffle``), the draw comes from the program's own generators: the same numbers
    as in one process (a split drawn under ``random.seed(args.seed)``). Otherwise
    each call draws anew (rank 0's ``torch.initial_seed()``, shared once, plus a call count, so it
    is new each epoch and fixed when the program seeds torch); the program's own generators
    are put back after, untouched. 1 process: ``draw(*args, **kwargs)`` itself. A collective on
    its first call: call it on every rank."""
    if world_size() <= 1 or _in_worker_process():  # (a data-loader worker is no rank: its own draw)
        return draw(*args, **kwargs)
    if _own_streams_agree(_streams_of(draw)):
        # the generators the draw uses are alike on every rank (a split drawn once before training
        # under `random.seed(args.seed)`, or seeded again just before it after the streams
        # parted): drawing from them gives the very numbers `python train.py` draws
        return draw(*args, **kwargs)
    _PASSES["agreed"] += 1
    with _Streams(_shared_seed() + 1_000_003 * _PASSES["agreed"]):
        return draw(*args, **kwargs)


_STREAMS = ("random", "numpy", "torch")


def _streams_of(draw) -> tuple:
    """The global generators ``draw`` uses where it says: ``random.shuffle`` (a method of
    Python's global generator) Python's, ``np.random.permutation`` numpy's, ``torch.randperm``
    torch's; anything else (a project's ``loader.shuffle``) may use any of them."""
    owner = getattr(draw, "__self__", None)
    numpy = sys.modules.get("numpy")
    if owner is not None and owner is getattr(random, "_inst", None):
        return ("random",)
    if numpy is not None and owner is not None and owner is getattr(numpy.random.mtrand, "_rand", None):
        return ("numpy",)
    if owner is None and getattr(draw, "__module__", None) == "torch":
        return ("torch",)
    return _STREAMS


def _own_streams_agree(streams: tuple = _STREAMS) -> bool:
    """The program's own generators among ``streams`` (Python's, numpy's if loaded, torch's CPU
    one) are in the same state on every rank: their digests compared across ranks
    (`_differ_across_ranks`, collectives). After ``seed_per_rank`` they differ, unless the
    program seeded them again."""
    numpy = sys.modules.get("numpy")
    states = (random.getstate() if "random" in streams else None,
              numpy.random.get_state() if numpy is not None and "numpy" in streams else None)
    digest = hashlib.sha1(pickle.dumps(states))
    if "torch" in streams:
        digest.update(torch.get_rng_state().numpy().tobytes())
    mine = float(int(digest.hexdigest()[:12], 16))  # 48 bits: exact in a float64
    return not _differ_across_ranks([torch.tensor([mine], dtype=torch.float64)])


def any_rank(flag) -> bool:
    """True on every rank when ``flag`` is true on any rank; 1 process: ``bool(flag)``. For a
    training step that a rank would skip on its own (``if tm.any_rank(torch.isnan(loss)):
    continue``): DDP's backward is a collective, so the ranks must skip together. A
    collective: call it on every rank."""
    if not is_distributed():
        return bool(flag)
    return all_reduce(int(bool(flag)), op="max") > 0


def all_ranks(flag) -> bool:
    """True on every rank when ``flag`` is true on every rank; 1 process: ``bool(flag)``. For a
    training step that a rank would take only on its own test (``if tm.all_ranks(loss >
    threshold): loss.backward()``): DDP's backward is a collective, so the ranks step together or
    not at all. A collective: call it on every rank."""
    if not is_distributed():
        return bool(flag)
    return all_reduce(int(bool(flag)), op="min") > 0


def share_params(model) -> None:
    """Copy rank 0's parameters and buffers to every rank, in place (what DDP does when it wraps a
    model), for a model that cannot be wrapped (one differentiated with ``torch.autograd.grad``
    over its own parameters), and for a wrapped model whose weights the program sets again (a
    repeat that resets them before building a new optimizer). 1 process, or anything that is not
    a module: nothing. A collective: call it on every rank."""
    if not is_distributed() or not isinstance(model, nn.Module):
        return
    _require_pg()
    comm = device() if _nccl() else torch.device("cpu")
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            buf = t.detach().to(comm)
            dist.broadcast(buf, src=0)
            t.copy_(buf.to(t.device))


def sync_grads(model) -> None:
    """Average the ``.grad`` of every parameter across ranks, in place (what DDP's backward
    does), for a model that cannot be wrapped; call it after the backward, before the
    optimizer's step. A gradient missing on some ranks counts as zero there. 1 process:
    nothing. A collective: call it on every rank."""
    if not is_distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if not grads:
        return
    averaged = all_reduce(*grads, op="mean")
    for p, g in zip(params, averaged if len(grads) > 1 else (averaged,)):
        p.grad = g


# id(meter) -> (the meter, kept so that its id stays its own; the fields reduced; their values right
# after its last reduction)
_REDUCED_METERS: dict = {}
_METER_FIELDS = (("sum", "count"), ("total", "count"), ("sum", "n"), ("total", "n"), ("_sum", "_count"),
                 ("running_sum", "count"), ("total", "steps"))
_METER_COUNTS = ("count", "n", "cnt", "num", "num_samples", "_count")
# the sums of a meter that keeps one per metric (`sum_rmse`, `total_loss`, `rmse_sum`)
_SUM_FIELD = re.compile(r"^_?(sum|total)_|_(sum|total)$")


def reduce_meter(meter, over=None):
    """Sum a running-average object's totals and count across ranks, in place, and recompute its
    ``avg`` where that is a plain attribute; returns it. Recognised: ``AverageMeter``-style
    classes (the pairs ``sum``/``count``, ``total``/``count``, ``sum``/``n``, ``total``/``n``), and
    meters that keep one sum per metric beside one count (``sum_rmse``, ``sum_mae``, ...,
    ``count``: a depth-completion meter updated with a result object), as numbers, tensors or
    numpy arrays (a segmentation meter's per-class sums).
    An ``avg`` that is a read-only property (computed from the total and count) is left to
    compute itself. An object without such numeric fields is returned unchanged (every rank has the
    same class, so every rank skips alike). ``over``: the loader the meter averaged; where it is
    not sharded (``sharded``) the meter already covers the whole data and is left as it is.
    A meter that keeps accumulating after a reduction (never reset between epochs) is reduced by
    what it gained since, so nothing is counted twice. 1 process: unchanged. A collective: call it
    on every rank."""
    if not is_distributed() or (over is not None and not sharded(over)):
        return meter
    fields = _meter_fields(meter)
    if fields is None:
        return meter
    values = [getattr(meter, name) for name in fields]  # the count last
    done = _REDUCED_METERS.get(id(meter))
    if done is not None and done[1] == fields and _at_least(values[-1], done[2][-1]):
        # (reduced before, then updated on this rank only: reduce the gain, keep the reduced part)
        gained = all_reduce(*[v - d for v, d in zip(values, done[2])])
        values = [d + g for d, g in zip(done[2], gained)]
    else:
        values = list(all_reduce(*values))
    _REDUCED_METERS[id(meter)] = (meter, fields, values)
    with contextlib.suppress(AttributeError, TypeError):
        for name, value in zip(fields, values):
            setattr(meter, name, value)
    if len(fields) == 2 and "avg" in getattr(meter, "__dict__", {}) \
            and not isinstance(getattr(type(meter), "avg", None), property):
        with contextlib.suppress(AttributeError, TypeError, ZeroDivisionError):
            meter.avg = values[0] / values[1] if values[1] else meter.avg
    return meter


def _meter_fields(meter):
    """The fields ``reduce_meter`` sums, the count last: a known total/count pair, or every
    ``sum_*``/``*_sum``/``total_*`` field beside a count; None for an object with neither."""
    def numeric(value) -> bool:
        return (isinstance(value, (numbers.Real, torch.Tensor)) or _ndarray(value)) and not isinstance(value, bool)

    for total_name, count_name in _METER_FIELDS:
        if numeric(getattr(meter, total_name, None)) and numeric(getattr(meter, count_name, None)):
            return [total_name, count_name]  # (an array: a segmentation meter's per-class sums)
    count = next((c for c in _METER_COUNTS if numeric(getattr(meter, c, None))), None)
    sums = sorted(k for k, v in getattr(meter, "__dict__", {}).items()
                  if k != count and _SUM_FIELD.search(k) and numeric(v))
    return [*sums, count] if count is not None and sums else None


def _at_least(a, b) -> bool:
    """`a >= b` for numbers, tensors and arrays (every element)."""
    try:
        return float(a) >= float(b)
    except (TypeError, ValueError):
        import numpy as np

        return bool(np.all(np.asarray(a) >= np.asarray(b)))


def _to_cpu(value):
    """Tensors (also inside a dict, list or tuple of one item's metrics) detached on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# tm.save calls per file on this rank: {absolute path: count}. Rank 0 says in the store when its
# n-th save of a path is complete; another rank that called tm.save(path) n times and then loads
# path waits for that, so it never reads the previous checkpoint (or none) while rank 0 writes.
_SAVES: dict = {}
_SAVED_KEY = "torchmigrate/saved/"
_LOAD_WAITING = False
_SAVE_WAIT_WARNED: set = set()


def _save_key(path) -> str | None:
    """The absolute path a save or load names (`_SAVES`' key); None for a file object."""
    return os.path.abspath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None


def _count_save(path) -> str | None:
    key = _save_key(path)
    if key is None:
        return None
    _SAVES[key] = _SAVES.get(key, 0) + 1
    return f"{_SAVED_KEY}{key}/{_SAVES[key]}"


def _save_wait_s() -> float:
    return float(os.environ.get("TORCHMIGRATE_SAVE_WAIT", "300"))


def _wait_for_saves() -> None:
    """On ranks other than 0, ``torch.load`` of a path this rank passed to ``tm.save`` first waits
    until rank 0 has written it as often (the n-th save): a checkpoint saved by rank 0 only and
    loaded by every rank (the best model reloaded for testing, in another function or module)
    is the one rank 0 just wrote, not the previous one or a missing file. No barrier, so ranks
    that load at different times never hang; after ``TORCHMIGRATE_SAVE_WAIT`` seconds (300) the
    load goes on with a warning that the ranks disagree on when to save."""
    global _LOAD_WAITING
    if _LOAD_WAITING or is_main():
        return
    _LOAD_WAITING = True
    if getattr(torch.load, "_torchmigrate_waits", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(f, *args, **kwargs):
        if _SAVES and _pg():
            key = _save_key(f)
            if key in _SAVES:
                _await_save(key, f)
        return original(f, *args, **kwargs)

    load._torchmigrate_waits = True
    torch.load = load


def _await_save(key: str, shown) -> None:
    wait = _save_wait_s()
    try:
        dist.distributed_c10d._get_default_store().wait(
            [f"{_SAVED_KEY}{key}/{_SAVES[key]}"], datetime.timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - a store that cannot answer must not stop the load
        if key in _SAVE_WAIT_WARNED:
            return
        _SAVE_WAIT_WARNED.add(key)
        _warn(f"rank {rank()} loads {os.fspath(shown)} after its tm.save number {_SAVES[key]}, which rank 0 "
              f"had not written after {wait:.0f} s: the ranks disagree on when to save (a decision taken "
              "from per-rank values?), so this rank may load an older file")


def save(obj, f, *args, **kwargs) -> None:
    """``torch.save`` on global rank 0 only, with ``torch.save``'s arguments (``tm.save(obj=state,
    f=path, pickle_protocol=2)`` as well as ``tm.save(state, path)``); other ranks return at once
    (no collective, so it is safe inside ``if tm.is_main():``). Paths are written atomically: a
    temp file in the same folder, then ``os.replace``, so a crash never leaves a half-written
    checkpoint. File-like objects are passed to ``torch.save`` as is (on rank 0). A rank that
    then loads the path with ``torch.load`` waits until rank 0's save is complete (no barrier
    needed)."""
    done = _count_save(f) if world_size() > 1 else None
    if not is_main():
        return
    if not isinstance(f, (str, os.PathLike)):
        torch.save(obj, f, *args, **kwargs)
        return
    _write_atomically(obj, f, *args, **kwargs)
    if done is not None and _pg():
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(done, "1")


def _write_atomically(obj, path, *args, **kwargs) -> None:
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f, *args, **kwargs)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(f, map_location="cpu", weights_only=True, **kwargs):
    """``torch.load`` onto the CPU by default (every rank loading to cuda:0 would crowd one GPU),
    with ``torch.load``'s arguments (``tm.load(f=path)`` too).

    ``weights_only=True`` on every torch version (torch's own default only since 2.6): only
    tensors and plain containers are unpickled, so a checkpoint from an untrusted source cannot
    run code on load. Checkpoints holding arbitrary objects, e.g. an ``argparse.Namespace`` of
    hyper-parameters, fail with ``UnpicklingError`` and need ``weights_only=False``, which
    executes whatever the file's pickle says: only for files you trust. torchmigrate never
    flips it silently.
    """
    return torch.load(f, map_location=map_location, weights_only=weights_only, **kwargs)


def strip_prefix(state_dict, prefixes=("module.", "_orig_mod.")):
    """A new state dict whose keys lose the given prefixes, repeatedly (``module._orig_mod.fc.w``
    -> ``fc.w``), so DDP/DataParallel/compiled checkpoints load into a plain model. Key order,
    the OrderedDict type and torch's ``_metadata`` (module versions) are preserved."""
    prefixes = (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)

    def strip(key: str) -> str:
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if p and key.startswith(p):
                    key, changed = key[len(p):], True
        return key

    out = OrderedDict() if isinstance(state_dict, OrderedDict) else {}
    for k, v in state_dict.items():
        out[strip(k) if isinstance(k, str) else k] = v
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None and isinstance(out, OrderedDict):
        out._metadata = OrderedDict()
        for k, v in meta.items():
            out._metadata.setdefault(strip(k + ".")[:-1] if k else k, v)
    return out


def load_state_dict(model, state_dict, strict: bool = True, **kwargs):
    """Load ``strip_prefix(state_dict)`` into ``unwrap(model)``; returns torch's
    ``(missing_keys, unexpected_keys)`` result. Works whatever wrapped the saving model."""
    return unwrap(model).load_state_dict(strip_prefix(state_dict), strict=strict, **kwargs)


def seed_per_rank() -> None:
    """From here on, every rank draws its own random numbers: dropout masks, augmentations,
    noise, and the seeds of DataLoader workers (drawn from torch's generator when a loader
    starts an epoch). Migrated programs call it once training starts, after the model is built
    and wrapped and the data is split, so everything drawn before (initial weights, a random
    split, a generated validation set) stays identical on every rank, as in the original.

    Rank r > 0 reseeds ``random``, numpy (if installed) and torch (CPU and every GPU) from a
    draw of its own torch stream mixed with r: reproducible when the program seeds, different
    on every rank, and different each call. Rank 0 and a single process keep their streams
    untouched, so ``python train.py`` draws exactly what the original program drew. Samplers
    are not affected: ``sampler``/``DistributedSampler`` shuffle with their own seed and epoch,
    ``shard_sampler`` draws under a seed of its own, so ranks still agree on the permutation."""
    global _PER_RANK_STREAMS
    me = rank()
    if world_size() > 1:
        _PER_RANK_STREAMS = True
        if _pg():
            _shared_seed()  # (a collective, while every rank is here: `same_draws` needs it, and has none)
    if me == 0 or world_size() <= 1:
        return
    base = int(torch.randint(0, 2 ** 62, (1,)).item())
    _reseed((base ^ (me * 0x9E3779B97F4A7C15)) % 2 ** 63)  # a different seed for every rank


def _reseed(seed: int) -> None:
    """Seed Python's, numpy's (if installed) and torch's global generators (CPU and every GPU,
    lazily) through the generators themselves, not the module functions a program may have
    assigned over (`random.seed = 42`, a slip for a call, leaves the generator and breaks the
    name)."""
    random.Random.seed(random._inst, seed)
    numpy = _numpy()
    if numpy is not None:
        numpy.random.mtrand._rand.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed ``random``, numpy (if installed) and torch (CPU and all GPUs); returns the seed used.
    ``per_rank`` adds ``rank()`` so ranks draw different augmentations/dropout masks; leave it
    off where ranks must agree (model init before DDP broadcasts anyway)."""
    global _PER_RANK_STREAMS
    seed = int(seed) + (rank() if per_rank else 0)
    if per_rank and world_size() > 1:
        _PER_RANK_STREAMS = True
    _reseed(seed)
    return seed


class _Null:
    """Stand-in returned by ``main_only`` on non-main ranks: absorbs attribute access, calls,
    indexing (``run["acc"].append(x)``, ``run["params"] = p`` on a neptune run) and ``with`` blocks
    (each returns the null object again) and is falsy."""

    def _self(self, *args, **kwargs):
        return self

    __call__ = __enter__ = __getitem__ = _self

    def __setitem__(self, key, value):
        pass

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return False

    def __repr__(self):
        return "<torchmigrate.runtime null object (not the main process)>"


@contextlib.contextmanager
def main_process_first(local: bool = False):
    """Run the block on the main process first and on the other ranks once it is done.

    For what every rank needs but only one should produce: a dataset download
    (``torchvision.datasets.MNIST(root, download=True)``, ``datasets.load_dataset``), a vocabulary
    or a preprocessed cache written on first use. Rank 0 runs the block while the others wait at
    a barrier; then they run it and find the files complete (a download skips what exists, a cache
    is loaded instead of rebuilt). Without that, every rank downloads into the same folder at once
    and one can read another's half-written file. ``local=True``: the first process of each node
    (``local_rank() == 0``) goes first, for data kept on node-local disks. One process, or no
    process group: the block just runs. Must be entered by every rank (it communicates); if the
    block raises on the rank that goes first, that rank does not release the others: it fails, and
    so does their barrier (torchrun stops the group), instead of every rank retrying the download.
    """
    if not is_distributed():
        yield
        return
    first = local_rank() == 0 if local else is_main()
    if not first:
        barrier()
    yield
    if first:
        barrier()


def goes_first(local: bool = False) -> bool:
    """True on the process that runs a ``main_process_first`` block first (global rank 0, or with
    ``local=True`` the first process of each node); true in one process. For a test inside such a
    block that forces a rebuild (``if (rebuild_cache and tm.goes_first()) or not exists(cache):``):
    the process that goes first rebuilds, the others then find the cache it built instead of
    deleting and rebuilding it under it. Collective-free."""
    return local_rank() == 0 if local else is_main()


def main_only(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` on the main process only; elsewhere a null object that absorbs
    any use, so ``writer = tm.main_only(SummaryWriter, log_dir)`` then ``writer.add_scalar(...)``
    and ``writer.close()`` run unguarded on every rank. Collective-free."""
    return factory(*args, **kwargs) if is_main() else _Null()

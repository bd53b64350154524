"""torchmigrate.runtime in one process without a launcher (plus environment-only checks of what
other ranks would do). Multi-process behaviour lives in test_runtime_dist.py."""
from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import types
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, RandomSampler,
                              SequentialSampler)

import torchmigrate.runtime as tm

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(CUDA, reason="checks the CPU policy")
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHMIGRATE_AMP", "TORCHMIGRATE_BACKEND")


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    """No torchrun or SLURM variables; module state reset around every test."""
    for k in list(os.environ):
        if k in LAUNCH_VARS or k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    tm.cleanup()
    yield
    tm.cleanup()
    logging.disable(logging.NOTSET)


@pytest.fixture
def other_rank(monkeypatch):
    """The environment rank 1 of 2 sees under torchrun (no process group is created)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")


def small_model():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


# ------------------------------------------------------------------ import, setup, queries

def test_module_is_vendorable_and_import_initialises_nothing(tmp_path):
    shutil.copy(Path(tm.__file__), tmp_path / "torchmigrate_runtime.py")
    code = ("import sys, torch, torchmigrate_runtime as tm; "
            "print(torch.cuda.is_initialized(), torch.distributed.is_initialized(), "
            "'torchmigrate' in sys.modules, 'torch._dynamo' in sys.modules, tm.world_size())")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and "SLURM" not in k}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=120,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "False", "1"]


def test_public_api_is_documented():
    assert len(tm.__doc__) > 500 and "SLURM_PROCID" in tm.__doc__
    for name in tm.__all__:
        assert getattr(tm, name).__doc__, name


def test_setup_one_process():
    ctx = tm.setup()
    assert ctx == tm.Ctx(rank=0, local_rank=0, world_size=1,
                         device=torch.device("cuda", 0) if CUDA else torch.device("cpu"),
                         is_main=True)
    assert tm.setup(backend="gloo", timeout=5) is ctx  # second call: same object, no re-init
    assert not dist.is_initialized()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.rank = 3
    tm.cleanup()
    tm.cleanup()  # harmless twice
    assert tm.setup() is not ctx and tm.setup() == ctx  # a fresh setup after cleanup


def test_queries_before_setup():
    assert (tm.rank(), tm.local_rank(), tm.world_size()) == (0, 0, 1)
    assert tm.is_main() and not tm.is_distributed()
    assert tm.device() == (torch.device("cuda", 0) if CUDA else torch.device("cpu"))


def test_queries_read_torchrun_env_without_setup(other_rank, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (tm.rank(), tm.local_rank(), tm.world_size()) == (3, 1, 4)
    assert not tm.is_main() and tm.is_distributed()
    if not CUDA:
        assert tm.device() == torch.device("cpu")


def test_torchrun_world_size_one_creates_no_group(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    ctx = tm.setup()
    assert (ctx.rank, ctx.world_size, ctx.is_main) == (0, 1, True)
    assert not dist.is_initialized()


@pytest.fixture
def one_fake_gpu(monkeypatch):
    """CUDA with one visible GPU, as far as setup() can tell; init_process_group only records."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", dev)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw["device_id"])))
    return calls


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_setup_on_the_cpu_where_cuda_is_available(one_fake_gpu, monkeypatch, how):
    """A program that names no device (`tm.setup(device="cpu")`, or TORCHMIGRATE_DEVICE=cpu):
    on a GPU host its ranks stay on the CPU, with gloo, and its model is not moved to a GPU,
    so it stays beside the tensors the program makes on the CPU."""
    monkeypatch.setattr(tm, "_ON_CPU", False)
    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert tm.device() == torch.device("cuda", 0)  # (one fake GPU: local rank 1 modulo 1)
    monkeypatch.setattr(tm, "_same_hash_seed", lambda *a: None)
    monkeypatch.setattr(tm, "_install_failure_hook", lambda *a: None)
    monkeypatch.setattr(tm, "_share_random_streams", lambda: None)
    monkeypatch.setattr(tm, "_watch_writes", lambda: None)
    monkeypatch.setattr(tm, "_wait_for_saves", lambda: None)
    monkeypatch.setattr(tm, "rank", lambda: 1)
    monkeypatch.setattr(tm, "world_size", lambda: 2)
    if how == "argument":
        ctx = tm.setup(device="cpu")
    else:
        monkeypatch.setenv("TORCHMIGRATE_DEVICE", "cpu")
        ctx = tm.setup()
    monkeypatch.setattr(tm, "_CTX", None)  # (the fake group is gone; cleanup() must not destroy it)
    monkeypatch.setattr(tm, "_OWN_PG", False)
    assert ctx.device == torch.device("cpu")
    assert one_fake_gpu == [("init", "gloo", None)]  # no set_device, no NCCL
    assert tm.device() == torch.device("cpu")


def test_device_arg_makes_any_gpu_the_ranks_own(monkeypatch):
    """`add_argument("-d", default="cuda:0", type=tm.device_arg)`: the default and a `-d cuda:0`
    given to every rank both mean local rank 1's GPU on rank 1; the CPU stays the CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("-d", "--device", default="cuda:0", type=tm.device_arg)
    assert parser.parse_args([]).device == "cuda:1"
    assert parser.parse_args(["-d", "cuda:0"]).device == "cuda:1"
    assert parser.parse_args(["-d", "cuda"]).device == "cuda:1"
    assert parser.parse_args(["-d", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["-d", "gpu please"])


def test_gpu_ids_are_the_ranks_own_gpu_or_every_gpu_in_one_process(monkeypatch):
    """`tm.gpu_ids()` for a program's `list(range(torch.cuda.device_count()))`: rank 1 of a
    torchrun launch lists its own GPU only; one process lists every GPU; the CPU lists none."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(tm, "_ON_CPU", False)
    monkeypatch.delenv("TORCHMIGRATE_DEVICE", raising=False)
    assert tm.gpu_ids() == [0, 1, 2, 3]
    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    assert tm.gpu_ids() == [1]
    monkeypatch.setenv("TORCHMIGRATE_DEVICE", "cpu")
    assert tm.gpu_ids() == []


def test_setup_device_other_than_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(tm, "_ON_CPU", False)
    with pytest.raises(ValueError, match=r"setup\(device='cuda:1'\): only 'cpu'"):
        tm.setup(device="cuda:1")


@pytest.mark.parametrize("local_world, fails", [("2", True), ("1", False)])
def test_nccl_needs_a_gpu_per_process_on_the_node(one_fake_gpu, monkeypatch, local_world, fails):
    """torchrun --nproc-per-node=2 on a 1-GPU node: a clear error before NCCL's "Duplicate GPU
    detected"; one process per node on two nodes is fine (rank 1, its node's only GPU)."""
    for k, v in {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": local_world}.items():
        monkeypatch.setenv(k, v)
    if fails:
        with pytest.raises(RuntimeError, match=r"2 processes on this node share 1 visible GPU.*"
                                               r"--nproc-per-node=1.*TORCHMIGRATE_BACKEND=gloo"):
            tm.setup()
        assert ("init", "nccl", torch.device("cuda", 0)) not in one_fake_gpu
    else:
        tm.setup()
        assert one_fake_gpu == [("set_device", torch.device("cuda", 0)),
                                ("init", "nccl", torch.device("cuda", 0))]
    monkeypatch.setattr(tm, "_CTX", None)  # nothing was really initialised


def test_one_process_setup_leaves_cuda_unstarted(one_fake_gpu, monkeypatch):
    """`python train.py` of a program that sets CUDA_VISIBLE_DEVICES after the inserted
    `tm.setup()` (`os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu` once the options are parsed):
    setup must not start CUDA (`is_available()` and `set_device` do), or the program's choice of
    GPU is ignored and it runs on GPU 0."""
    def starts_cuda():
        raise AssertionError("setup() started CUDA in one process")
    monkeypatch.setattr(torch.cuda, "is_available", starts_cuda)
    ctx = tm.setup()
    monkeypatch.setattr(tm, "_CTX", None)
    assert ctx.device == torch.device("cuda", 0) and one_fake_gpu == []


@pytest.mark.parametrize("env, value, if_unset, visible, warned", [
    ({}, "3", False, "3", False),  # one process: the program's choice, as in the original
    ({"LOCAL_WORLD_SIZE": "2"}, "0", False, "4,5", True),  # two ranks on one GPU: the launcher's kept
    ({"LOCAL_WORLD_SIZE": "2"}, 1, False, "4,5", True),
    ({"LOCAL_WORLD_SIZE": "2"}, "2,3", False, "2,3", False),  # a GPU for each process: kept
    ({"LOCAL_WORLD_SIZE": "2"}, "-1", False, "-1", False),  # no GPU for anyone: a CPU run
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, "0,1", False, "4,5", True),
    ({}, "3", True, "4,5", False),  # setdefault's form: something is set already
])
def test_visible_devices_keeps_a_gpu_for_each_process(monkeypatch, capsys, env, value, if_unset, visible, warned):
    """`os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu` becomes `tm.visible_devices(args.gpu)`."""
    for k in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(tm, "_VISIBLE_WARNED", set())
    tm.visible_devices(value, if_unset=if_unset)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible
    err = capsys.readouterr().err
    assert ("test_runtime_single.py:" in err and "CUDA_VISIBLE_DEVICES=" in err
            and "kept the launcher's GPUs" in err) == warned


def test_gloo_may_share_one_gpu(one_fake_gpu, monkeypatch):
    for k, v in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                 "TORCHMIGRATE_BACKEND": "gloo"}.items():
        monkeypatch.setenv(k, v)
    ctx = tm.setup()
    assert ctx.device == torch.device("cuda", 0)  # local rank 1 modulo one GPU
    assert one_fake_gpu[-1] == ("init", "gloo", None)
    monkeypatch.setattr(tm, "_CTX", None)


def test_communicating_helpers_set_up_the_group_on_first_use(other_rank, monkeypatch):
    """A helper that needs the group calls setup() itself (a program whose own tm.setup() comes
    later, or ran before a misplaced tm.cleanup(), still works)."""
    calls = []

    def fake_setup(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("set up")

    monkeypatch.setattr(tm, "setup", fake_setup)
    for helper in (lambda: tm.all_reduce(1), lambda: tm.wrap_model(nn.Linear(2, 2)), tm.barrier):
        with pytest.raises(RuntimeError, match="set up"):
            helper()
    assert len(calls) == 3


# ------------------------------------------------------------------ SLURM

def test_slurm_single_task(monkeypatch):
    for k, v in {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1",
                 "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "node[01-04],other"}.items():
        monkeypatch.setenv(k, v)
    ctx = tm.setup()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main) == (0, 0, 1, True)
    assert not dist.is_initialized()
    exported = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                              "MASTER_ADDR", "MASTER_PORT")}
    assert exported == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                        "MASTER_ADDR": "node01", "MASTER_PORT": str(15000 + 123456 % 20000)}


def test_slurm_env_read_before_setup(monkeypatch):
    for k, v in {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}.items():
        monkeypatch.setenv(k, v)
    assert (tm.rank(), tm.local_rank(), tm.world_size()) == (5, 1, 8)
    monkeypatch.setenv("RANK", "1")  # torchrun's variables win over SLURM's
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert (tm.rank(), tm.local_rank(), tm.world_size()) == (1, 0, 2)


@pytest.mark.parametrize("env, addr, port", [
    ({}, "127.0.0.1", "29500"),
    ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu7"}, "gpu7", "15007"),
    ({"SLURM_JOB_ID": "7", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234",
      "SLURM_JOB_NODELIST": "gpu7"}, "10.0.0.2", "1234"),
])
def test_slurm_master_address(monkeypatch, env, addr, port):
    for k, v in {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", **env}.items():
        monkeypatch.setenv(k, v)
    tm.setup()
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (addr, port)
    assert os.environ["LOCAL_RANK"] == "0"  # SLURM_LOCALID absent: 0


@pytest.mark.parametrize("nodelist, first", [
    ("node[01-04],other", "node01"), ("gpu7", "gpu7"), ("a[3,5-6]-ib,b", "a3-ib"),
    ("r[2-3]-n[08-09]", "r2-n08"), ("x1,x2", "x1"), ("", ""),
])
def test_first_host_of_nodelist(nodelist, first):
    assert tm._first_host(nodelist) == first


# ------------------------------------------------------------------ models

def test_wrap_model_one_process_moves_without_wrapping():
    model = small_model()
    wrapped = tm.wrap_model(model, find_unused_parameters=True, sync_bn=True)
    assert wrapped is model.to(tm.device())
    assert isinstance(wrapped[1], nn.BatchNorm1d)  # no SyncBatchNorm without a process group
    assert next(wrapped.parameters()).device.type == tm.device().type
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert tm.wrap_model(frozen) is frozen


def test_wrap_model_without_move_keeps_the_programs_device():
    """`if not args.no_cuda: model.cuda()` then `tm.wrap_model(model, move=False)`: with the flag,
    the model stays on the CPU even where CUDA is available (its batches stay there too)."""
    model = small_model()
    assert tm.wrap_model(model, move=False) is model
    assert next(model.parameters()).device.type == "cpu"
    assert tm.wrap_model({"net": model}, move=False)["net"] is model


def test_wrap_model_returns_what_is_not_a_module_unchanged():
    """`else: generator = None` then the migration's `generator = tm.wrap_model(generator)`: the
    program's own `if generator is not None` must keep seeing None."""
    assert tm.wrap_model(None) is None
    holder = argparse.Namespace(parameters=lambda: iter(()))
    assert tm.wrap_model(holder) is holder


def test_wrap_model_takes_a_mean_or_a_summed_loss_only():
    model = nn.Linear(2, 2)
    assert tm.wrap_model(model, loss_reduction="sum") is model  # one process: nothing to combine
    with pytest.raises(ValueError, match="loss_reduction"):
        tm.wrap_model(model, loss_reduction="total")


def test_replicas_is_the_count_only_where_a_data_parallel_is_kept(monkeypatch):
    """Inputs copied once per GPU for DataParallel's scatter (`x.repeat(tm.replicas(n_gpu), 1)`):
    one copy while no DataParallel runs (the migration dropped it, or under torchrun, where DDP
    scatters nothing), the program's count once wrap_model keeps one in one process."""
    monkeypatch.setattr(tm, "_DATA_PARALLEL_KEPT", False)
    assert tm.replicas(4) == 1
    tm.wrap_model(small_model())
    assert tm.replicas(4) == 1
    episode = tm.wrap_model(nn.Linear(3, 2), data_parallel=True)
    assert tm.replicas(4) == 4
    shots = torch.randn(1, 3, device=tm.device()).repeat(tm.replicas(1), 1)
    assert episode(shots).shape == (1, 2)
    monkeypatch.setattr(tm, "is_distributed", lambda: True)
    assert tm.replicas(4) == 1


def test_wrap_model_keeps_a_former_data_parallel_in_one_process():
    """A program that used nn.DataParallel reads `.module` anywhere: in one process it keeps it."""
    model = small_model()
    wrapped = tm.wrap_model(model, data_parallel=True)
    assert isinstance(wrapped, nn.DataParallel) and wrapped.module is model
    assert tm.wrap_model(wrapped, data_parallel=True) is wrapped
    out = wrapped(torch.randn(4, 3, device=tm.device()))
    assert out.shape == (4, 2) and tm.unwrap(wrapped) is model
    # behind a flag in the original, the plain model: its checkpoints keep working either way
    plain = small_model().state_dict()
    assert list(wrapped.state_dict()) == list(plain)
    wrapped.load_state_dict(plain)
    wrapped.load_state_dict({"module." + k: v for k, v in plain.items()})
    model.n_classes = 2
    assert wrapped.n_classes == 2


def test_a_former_data_parallel_container_keeps_iteration_in_one_process():
    """`losses = nn.DataParallel(nn.ModuleList([...]))` then `for l in get_losses():`: the kept
    DataParallel iterates, indexes and counts its container, as DDP's wrapper does, and keeps
    DataParallel's name."""
    heads = nn.ModuleList([nn.L1Loss(), nn.MSELoss()])
    wrapped = tm.wrap_model(heads, data_parallel=True)
    assert isinstance(wrapped, nn.DataParallel) and type(wrapped).__name__ == "DataParallel"
    assert [type(h).__name__ for h in wrapped] == ["L1Loss", "MSELoss"]
    assert len(wrapped) == 2 and isinstance(wrapped[1], nn.MSELoss)
    plain = tm.wrap_model(nn.Linear(2, 2), data_parallel=True)
    with pytest.raises(TypeError):
        iter(plain)  # a module that is no container stays one


def test_a_kept_data_parallel_names_parameters_as_its_module():
    """`update_average(shadow, model)` matching `named_parameters()` of a copy of the plain
    module with those of the wrapper: the names are the module's, as in the original."""
    model = small_model()
    wrapped = tm.wrap_model(model, data_parallel=True)
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [n for n, _ in wrapped.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert [n for n, _ in wrapped.named_parameters(prefix="gen")][0].startswith("gen.module.")


def test_shard_sampler_of_no_sampler_is_the_loaders_own_order():
    """`sampler=tm.shard_sampler(train_sampler, dataset=ds, shuffle=train_sampler is None)` with
    `shuffle=False` on the loader: one process keeps what the original loader did either way."""
    ds = torch.utils.data.TensorDataset(torch.arange(10.0))
    assert isinstance(tm.shard_sampler(None, dataset=ds, shuffle=True), torch.utils.data.RandomSampler)
    assert list(tm.shard_sampler(None, dataset=ds, shuffle=False)) == list(range(10))
    weighted = torch.utils.data.WeightedRandomSampler(torch.ones(10), 10)
    assert tm.shard_sampler(weighted, dataset=ds, shuffle=False) is weighted
    with pytest.raises(TypeError, match="no dataset"):
        tm.shard_sampler(None)


def test_unwrap_nested_wrappers():
    inner = small_model()
    compiled = torch.compile(inner, backend="eager")  # OptimizedModule; never run here
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert tm.unwrap(nn.DataParallel(compiled)) is inner
    assert tm.unwrap(torch.compile(nn.DataParallel(inner), backend="eager")) is inner
    assert tm.unwrap(nn.DataParallel(nn.DataParallel(inner))) is inner
    assert tm.unwrap(inner) is inner

    class CompileLike(nn.Module):  # anything exposing its module as _orig_mod
        def __init__(self, mod):
            super().__init__()
            self._orig_mod = mod

    assert tm.unwrap(CompileLike(nn.DataParallel(inner))) is inner
    for obj in (None, "model", 3):
        assert tm.unwrap(obj) is obj


def test_strip_prefix():
    w, b = torch.ones(1), torch.zeros(1)
    sd = OrderedDict([("module._orig_mod.fc.weight", w), ("module.fc.bias", b),
                      ("_orig_mod.module.head", b), ("modules.x", w)])
    out = tm.strip_prefix(sd)
    assert isinstance(out, OrderedDict) and out is not sd
    assert list(out) == ["fc.weight", "fc.bias", "head", "modules.x"]
    assert out["fc.weight"] is w
    assert list(sd)[0] == "module._orig_mod.fc.weight"  # input untouched
    plain = tm.strip_prefix({"model.a": 1, "b": 2}, prefixes=("model.",))
    assert plain == {"a": 1, "b": 2} and type(plain) is dict


def test_strip_prefix_keeps_metadata_for_batchnorm_versions():
    sd = nn.DataParallel(small_model()).state_dict()
    assert "module.1" in sd._metadata
    out = tm.strip_prefix(sd)
    assert "1" in out._metadata and out._metadata["1"] == sd._metadata["module.1"]
    assert not any(k.startswith("module") for k in out._metadata)


def test_load_state_dict_across_wrappers():
    torch.manual_seed(0)
    src = small_model()
    wrapped_sd = nn.DataParallel(torch.compile(src, backend="eager")).state_dict()
    assert next(iter(wrapped_sd)).startswith("module._orig_mod.")
    dst = small_model()
    result = tm.load_state_dict(nn.DataParallel(dst), wrapped_sd)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k
    bad = OrderedDict(wrapped_sd)
    bad["module.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="extra"):
        tm.load_state_dict(dst, bad)
    assert tm.load_state_dict(dst, bad, strict=False).unexpected_keys == ["extra"]


# ------------------------------------------------------------------ checkpoints

def test_save_is_atomic_and_loadable(tmp_path):
    path = tmp_path / "ckpt.pt"
    tm.save({"step": 1, "w": torch.arange(3)}, path)  # PathLike
    tm.save({"step": 2, "w": torch.arange(3)}, str(path))  # str, overwrites
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    loaded = tm.load(path)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.arange(3))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        tm.save({"fn": lambda: None}, path)  # fails mid-write ...
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # ... no temp file left
    assert tm.load(path)["step"] == 2  # ... previous checkpoint intact


def test_save_and_load_take_torch_s_keyword_names(tmp_path):
    """`torch.save(obj=..., f=..., pickle_protocol=2)` becomes `tm.save(...)` with its keywords
    as written (TM501 swaps the function only): the runtime takes torch's names."""
    path = tmp_path / "ckpt.pt"
    tm.save(obj={"step": 3}, f=path, pickle_protocol=2)
    assert tm.load(f=path)["step"] == 3
    buf = io.BytesIO()
    tm.save(obj={"step": 4}, f=buf)
    buf.seek(0)
    assert tm.load(f=buf, map_location="cpu")["step"] == 4


def test_save_to_file_object():
    buf = io.BytesIO()
    tm.save({"a": torch.ones(2)}, buf)
    buf.seek(0)
    assert torch.equal(tm.load(buf)["a"], torch.ones(2))


def test_save_on_other_rank_writes_nothing(other_rank, tmp_path):
    tm.save({"a": 1}, tmp_path / "x.pt")
    buf = io.BytesIO()
    tm.save({"a": 1}, buf)
    assert os.listdir(tmp_path) == [] and buf.getvalue() == b""


def test_load_maps_to_cpu_and_respects_weights_only(tmp_path):
    path = tmp_path / "t.pt"
    tm.save({"t": torch.ones(2, device=tm.device())}, path)
    assert tm.load(path)["t"].device.type == "cpu"
    assert tm.load(path, map_location=tm.device())["t"].device.type == tm.device().type
    tm.save({"args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(pickle.UnpicklingError):  # torch's default weights_only=True
        tm.load(path)
    assert tm.load(path, weights_only=False)["args"].lr == 0.1


# ------------------------------------------------------------------ data

def test_samplers_one_process():
    ds = list(range(10))
    assert isinstance(tm.sampler(ds), RandomSampler)
    assert isinstance(tm.sampler(ds, shuffle=[0]), RandomSampler)  # any truthy expression
    assert isinstance(tm.sampler(ds, shuffle=0), SequentialSampler)
    assert list(tm.sampler(ds, shuffle=False)) == ds
    es = tm.eval_sampler(ds)
    assert isinstance(es, SequentialSampler) and list(es) == ds


def test_samplers_for_other_rank_from_env(other_rank):
    ds = list(range(7))
    s = tm.sampler(ds, shuffle=True, seed=3, drop_last=True)
    assert isinstance(s, DistributedSampler)
    assert (s.rank, s.num_replicas, s.seed, s.drop_last, s.shuffle) == (1, 2, 3, True, True)
    es = tm.eval_sampler(ds)
    assert list(es) == [1, 3, 5] and len(es) == 3
    es.set_epoch(4)  # no-op
    assert list(es) == [1, 3, 5]


class EpochSampler(SequentialSampler):
    def __init__(self, data):
        super().__init__(data)
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


def test_set_epoch_finds_the_sampler():
    ds = list(range(4))
    s = EpochSampler(ds)
    tm.set_epoch(DataLoader(ds, sampler=s, batch_size=2), 1)
    tm.set_epoch(DataLoader(ds, batch_sampler=BatchSampler(s, 2, False)), 2)
    tm.set_epoch(s, 3)
    assert s.epochs == [1, 2, 3]
    tm.set_epoch(DataLoader(ds, shuffle=True), 4)  # RandomSampler: nothing to call
    tm.set_epoch(object(), 5)


def test_gather_for_metrics_one_process():
    x = torch.arange(6.0)
    assert tm.gather_for_metrics(x) is x
    assert torch.equal(tm.gather_for_metrics(x, total_len=4), x[:4])
    out = tm.gather_for_metrics({"p": x, "pair": (x, x[:2])}, total_len=3)
    assert torch.equal(out["p"], x[:3]) and torch.equal(out["pair"][1], x[:2])
    assert tm.gather_for_metrics(torch.tensor(2.0)).shape == (1,)
    with pytest.raises(TypeError):
        tm.gather_for_metrics([1, 2])


# ------------------------------------------------------------------ collectives, one process

def test_all_reduce_is_identity_with_types():
    assert tm.all_reduce(3) == 3 and type(tm.all_reduce(3)) is int
    assert tm.all_reduce(2.5, op="max") == 2.5
    assert tm.all_reduce(3, op="mean") == 3.0 and type(tm.all_reduce(3, op="mean")) is float
    t = torch.tensor([1.0, 2.0])
    assert tm.all_reduce(t) is t
    a, b, c = tm.all_reduce(1, 2.0, t, op="min")
    assert (a, b, type(a)) == (1, 2.0, int) and c is t
    mean = tm.all_reduce(torch.tensor([1, 2]), op="mean")
    assert mean.dtype == torch.float32 and mean.tolist() == [1.0, 2.0]
    counted = tm.all_reduce(torch.tensor([True, False]))
    assert counted.dtype == torch.int64 and counted.tolist() == [1, 0]
    assert tm.all_reduce(True) == 1
    assert tm.all_ranks(1) is True and tm.all_ranks(0) is False and tm.any_rank(0) is False
    assert tm.reduce_batch_total(2.5, over=[1, 2]) == 2.5
    per_class = [3, 4]
    got, heads = tm.all_reduce(per_class, (1.5, 2))
    assert got == [3, 4] and got is not per_class and type(heads) is tuple and heads == (1.5, 2)
    assert tm.all_reduce([1, 2], op="mean") == [1.0, 2.0] and tm.all_reduce([]) == []
    np = pytest.importorskip("numpy")
    array = np.asarray(1.5, dtype=np.float32)  # `loss.detach().cpu().numpy()`
    got = tm.all_reduce(array, op="mean")
    assert isinstance(got, np.ndarray) and float(got) == 1.5
    with pytest.raises(TypeError, match="nested"):
        tm.all_reduce([[1], [2]])
    with pytest.raises(ValueError, match="op"):
        tm.all_reduce(1, op="prod")


def test_barrier_and_no_sync_one_process():
    tm.barrier()

    class Recorder(nn.Linear):
        entered = 0

        def no_sync(self):
            Recorder.entered += 1
            return torch.no_grad()

    m = Recorder(2, 2)
    for sync in (True, False):
        with tm.no_sync(m, sync=sync):
            pass
    assert Recorder.entered == 0  # one process: never skip the (absent) all-reduce


def test_main_process_first_one_process_just_runs_the_block():
    ran = []
    for local in (False, True):
        with tm.main_process_first(local=local):
            ran.append(local)
    assert ran == [False, True]  # no process group, no barrier
    with pytest.raises(KeyError):  # an error in the block is the caller's
        with tm.main_process_first():
            raise KeyError("x")


def test_main_process_first_waits_before_the_block_on_other_ranks(other_rank, monkeypatch):
    events = []
    monkeypatch.setattr(tm, "barrier", lambda: events.append("barrier"))
    with tm.main_process_first():
        events.append("block")
    monkeypatch.setenv("LOCAL_RANK", "0")  # rank 1, first process of its node
    with tm.main_process_first(local=True):
        events.append("local block")
    assert events == ["barrier", "block", "local block", "barrier"]


def test_no_sync_enters_model_no_sync_when_distributed(other_rank):
    calls = []

    class FakeDDP:
        def no_sync(self):
            calls.append("no_sync")
            return torch.no_grad()

    with tm.no_sync(FakeDDP(), sync=False):
        assert not torch.is_grad_enabled()
    with tm.no_sync(FakeDDP(), sync=True):
        assert torch.is_grad_enabled()
    with tm.no_sync(nn.Linear(2, 2), sync=False):  # unwrapped model: nothing to skip
        pass
    assert calls == ["no_sync"]


# ------------------------------------------------------------------ AMP

@pytest.mark.parametrize("env, expected", [
    ("bf16", torch.bfloat16), ("fp16", torch.float16), ("off", None), ("OFF", None),
    ("auto", "auto"), (None, "auto"),
])
def test_amp_dtype_policy(monkeypatch, env, expected):
    if env is not None:
        monkeypatch.setenv("TORCHMIGRATE_AMP", env)
    if expected == "auto":  # no autocast on the CPU: it would slow CPUs without bf16 units down
        expected = None if not CUDA else torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert tm.amp_dtype() == expected


def test_amp_dtype_argument_overrides_env(monkeypatch):
    monkeypatch.setenv("TORCHMIGRATE_AMP", "off")
    assert tm.amp_dtype("fp16") == torch.float16
    assert tm.amp_dtype(torch.bfloat16) == torch.bfloat16
    monkeypatch.setenv("TORCHMIGRATE_AMP", "fp16")
    assert tm.amp_dtype("off") is None
    with pytest.raises(ValueError, match="fp8"):
        tm.amp_dtype("fp8")


def matmul_dtype(ctx):
    a = torch.randn(4, 4, device=tm.device())
    with ctx:
        return (a @ a).dtype


def test_autocast_follows_policy(monkeypatch):
    assert matmul_dtype(tm.autocast()) == (tm.amp_dtype() or torch.float32)
    assert matmul_dtype(tm.autocast("bf16")) == torch.bfloat16
    assert matmul_dtype(tm.autocast(enabled=False)) == torch.float32
    assert matmul_dtype(tm.autocast("off")) == torch.float32
    monkeypatch.setenv("TORCHMIGRATE_AMP", "off")
    assert matmul_dtype(tm.autocast()) == torch.float32
    assert tm.autocast().device == tm.device().type


@cpu_only
def test_grad_scaler_disabled_on_cpu():
    for scaler in (tm.GradScaler(), tm.GradScaler(dtype="fp16"), tm.GradScaler(enabled=False)):
        assert not scaler.is_enabled()
    scaler = tm.GradScaler(dtype="fp16")
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = model.weight.detach().clone()
    loss = model(torch.ones(3, 2)).sum()
    assert scaler.scale(loss) is loss
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(model.weight, before)  # step() really stepped
    assert tm.GradScaler(enabled=True).is_enabled()  # explicit request wins


# ------------------------------------------------------------------ misc

def test_print_only_on_main(capsys, monkeypatch):
    tm.print("hello", 1, sep="-")
    assert capsys.readouterr().out == "hello-1\n"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    tm.print("hidden")
    assert capsys.readouterr().out == ""


def test_print_writes_each_line_in_one_write():
    """Another rank's output cannot split the line on a shared console."""
    class Stream:
        writes, flushed = [], 0

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushed += 1

    stream = Stream()
    tm.print("loss", 0.5, sep="=", end="!\n", file=stream)
    tm.print("step", 3, file=stream, flush=False)
    assert stream.writes == ["loss=0.5!\n", "step 3\n"] and stream.flushed == 1


def test_seed_everything_reproducible(other_rank):
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    assert tm.seed_everything(7) == 7
    first = draw()
    tm.seed_everything(7)
    assert draw() == first
    assert tm.seed_everything(7, per_rank=True) == 8  # rank 1
    assert draw() != first
    tm.seed_everything(8)
    second = draw()
    tm.seed_everything(7, per_rank=True)
    assert draw() == second


def test_seed_per_rank_leaves_one_process_alone():
    """One process (and rank 0) keeps its stream: the migrated program draws what the original did."""
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    tm.seed_everything(3)
    expected = draw()
    tm.seed_everything(3)
    tm.seed_per_rank()
    assert draw() == expected


def test_seed_per_rank_other_rank(other_rank):
    """Rank 1 gets a stream of its own, reproducible from the program's seed."""
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    tm.seed_everything(3)
    rank0 = draw()
    tm.seed_everything(3)
    tm.seed_per_rank()
    rank1 = draw()
    assert all(a != b for a, b in zip(rank0, rank1))
    tm.seed_everything(3)
    tm.seed_per_rank()
    assert draw() == rank1


def test_seed_per_rank_keeps_samplers_agreeing(other_rank, monkeypatch):
    """The training samplers' permutations do not come from the streams seed_per_rank moves:
    a rank that diverged still takes the samples it would have taken."""
    monkeypatch.setattr(tm, "is_distributed", lambda: True)  # samplers as under torchrun (no group needed)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)
    orders = []
    for diverge in (False, True):
        tm.seed_everything(5)
        monkeypatch.setattr(tm, "_SAMPLERS_MADE", 0)  # the same sampler both times (see `_own_seed`)
        if diverge:
            tm.seed_per_rank()
        orders.append((list(tm.sampler(range(10), shuffle=True)), list(tm.shard_sampler(weighted))))
    assert orders[0] == orders[1]


@pytest.mark.parametrize("size,world,expected", [(64, 1, 64), (64, 2, 32), (96, 4, 24), (None, 2, None)])
def test_per_rank_batch(monkeypatch, size, world, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert tm.per_rank_batch(size) == expected


def test_shared_generator_in_one_process_is_the_default_stream():
    """A migrated `random_split(..., generator=tm.shared_generator())` run as one process splits,
    and leaves the global stream, exactly as the original split did."""
    data = list(range(10))
    torch.manual_seed(4)
    original = [list(part) for part in torch.utils.data.random_split(data, [7, 3])], torch.rand(2).tolist()
    torch.manual_seed(4)
    migrated = [list(part) for part in torch.utils.data.random_split(data, [7, 3], generator=tm.shared_generator())]
    assert (migrated, torch.rand(2).tolist()) == original
    assert tm.shared_generator(3) is not torch.default_generator


def test_per_rank_batch_rounds_up_and_names_the_nearest_sizes(monkeypatch, capsys):
    """A size that does not divide must not stop the program (a GAN's batch of 1 on 2 ranks):
    every rank loads the next size up, and rank 0 says which sizes keep the global batch (a batch
    smaller than the world, a bucket loaded whole, says how to keep it instead)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(tm, "_BATCH_WARNED", set())
    assert tm.per_rank_batch(10) == 3 and tm.per_rank_batch(10) == 3
    assert tm.per_rank_batch(1) == 1
    err = capsys.readouterr().err
    assert err.count("the batch size 10 does not divide among 4 processes") == 1
    assert "a global batch of 12 instead of 10" in err and "A batch size of 8 or 12" in err
    assert "A batch size of 4 keeps" not in err  # 1 sample on 4 ranks: no size near it splits
    assert "A batch of 1 cannot be split" in err and "divide the bucket size by 4" in err


def test_per_rank_batch_never_leaves_one_sample_of_several(monkeypatch, capsys):
    """BatchNorm cannot train on one sample ("Expected more than 1 value per channel"): a batch
    of 2 to world_size samples gives each rank 2 (a larger global batch, said once), never 1."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(tm, "_BATCH_WARNED", set())
    monkeypatch.setattr(tm.gc, "get_objects", lambda: [])  # the loader comes before any model
    assert [tm.per_rank_batch(n) for n in (2, 3, 4, 4, 5, 8)] == [2, 2, 2, 2, 2, 2]
    err = capsys.readouterr().err
    assert err.count("one sample per rank") == 3 and "a global batch of 8 instead of 2" in err
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).train()
    model(torch.randn(tm.per_rank_batch(2), 3))  # (one row would raise)


def test_per_rank_batch_divides_down_to_one_where_no_model_holds_a_batchnorm(monkeypatch, capsys):
    """Models built before the loader and none with a BatchNorm (Zero-DCE's curve estimator, an
    AOD-Net): one sample per rank trains, so the global batch is kept (8 on 8 ranks stays 8)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(tm, "_BATCH_WARNED", set())
    plain = [torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())]
    monkeypatch.setattr(tm.gc, "get_objects", lambda: plain)
    assert [tm.per_rank_batch(n) for n in (4, 2, 8)] == [1, 1, 2]
    assert "one sample per rank" not in capsys.readouterr().err
    plain.append(torch.nn.BatchNorm2d(4))
    assert tm.per_rank_batch(4) == 2


def test_goes_first_is_the_main_process_or_the_node_leader(other_rank, monkeypatch):
    """`if (rebuild_cache and tm.goes_first()) or not exists(p):` under main_process_first: only
    the process that goes first rebuilds."""
    assert not tm.goes_first()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert tm.goes_first(local=True) and not tm.goes_first()


def test_data_parallel_is_the_forward_under_torchrun(monkeypatch):
    """One process: nn.parallel.data_parallel as written (on CPU, the module's forward); under
    torchrun: the module called on this rank's inputs, a tensor or a tuple, with its kwargs."""
    seen = []

    class Two(torch.nn.Module):
        def forward(self, a, b=None, scale=1.0):
            seen.append((a.shape, None if b is None else b.shape, scale))
            return a * scale

    x, y = torch.ones(4, 2), torch.zeros(4, 3)
    calls = []
    monkeypatch.setattr(torch.nn.parallel, "data_parallel", lambda *a, **k: calls.append((a, k)) or "original")
    assert tm.data_parallel(Two(), x, [0, 1]) == "original" and calls[0][1]["device_ids"] == [0, 1]
    monkeypatch.setattr(tm, "is_distributed", lambda: True)
    assert torch.equal(tm.data_parallel(Two(), (x, y), module_kwargs={"scale": 2.0}), 2 * x)
    assert torch.equal(tm.data_parallel(Two(), x, device_ids=[0, 1], output_device=0), x)
    assert seen == [((4, 2), (4, 3), 2.0), ((4, 2), None, 1.0)] and len(calls) == 1


def test_main_only(other_rank, monkeypatch):
    made = []

    def factory(*args, **kwargs):
        made.append((args, kwargs))
        return io.StringIO()

    null = tm.main_only(factory, "logdir", flush_secs=5)
    assert made == [] and not null
    null.add_scalar("loss", 1.0, 2)
    null.writer.nested.call(1)
    with null as w:
        w.write("x")
    null["train/acc"].append(0.5)  # a neptune run's fields
    null["parameters"] = {"lr": 0.1}
    null.close()
    monkeypatch.setenv("RANK", "0")
    real = tm.main_only(factory, "logdir", flush_secs=5)
    assert isinstance(real, io.StringIO) and made == [(("logdir",), {"flush_secs": 5})]


# ------------------------------------------------------------------ CUDA (run on a GPU machine)

@needs_cuda
def test_cuda_setup_and_device():
    ctx = tm.setup()
    assert ctx.device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    t = torch.ones(2, device="cuda")
    assert tm.all_reduce(t) is t and tm.gather_for_metrics(t).device.type == "cuda"
    assert next(tm.wrap_model(nn.Linear(2, 2)).parameters()).is_cuda


@needs_cuda
def test_cuda_amp_policy_and_scaler(monkeypatch):
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert tm.amp_dtype() == expected
    assert matmul_dtype(tm.autocast("fp16")) == torch.float16
    assert matmul_dtype(tm.autocast()) == expected
    assert tm.GradScaler(dtype="fp16").is_enabled()
    assert not tm.GradScaler(dtype="bf16").is_enabled()
    assert not tm.GradScaler(enabled=False, dtype="fp16").is_enabled()
    monkeypatch.setenv("TORCHMIGRATE_AMP", "fp16")
    scaler = tm.GradScaler()
    assert scaler.is_enabled()
    model = nn.Linear(4, 1).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tm.autocast():
        loss = model(torch.randn(8, 4, device="cuda")).float().pow(2).mean()
    scaled = scaler.scale(loss)
    assert scaled is not loss and scaled.item() == pytest.approx(loss.item() * 65536.0, rel=1e-3)
    scaled.backward()
    scaler.step(opt)
    scaler.update()


def test_grad_scales_a_gradient_penalty_that_would_flush_to_zero_in_fp16():
    """tm.grad (TM411) follows the AMP recipe: the fp16 gradient 1e-8 flushes to zero unscaled,
    and survives when the outputs are scaled and the result unscaled."""
    def penalty_grad(grad_fn):
        x = torch.tensor([1.0], requires_grad=True)
        y = (x.half() * 1e-4) * 1e-4
        return grad_fn(outputs=y, inputs=x, grad_outputs=torch.ones_like(y), create_graph=True)[0]

    assert penalty_grad(torch.autograd.grad).item() == 0.0
    scaler = tm.GradScaler(enabled=True, init_scale=2.0 ** 10)  # the newest enabled scaler is the default
    got = penalty_grad(tm.grad)
    assert got.item() == pytest.approx(1e-8, rel=1e-2)
    assert penalty_grad(lambda **kw: tm.grad(scaler=tm.GradScaler(enabled=False), **kw)).item() == 0.0
    del scaler


def test_eval_sampler_keeps_a_loaders_shuffle_in_one_process():
    """A test loader with shuffle=True (scored on its first batches) keeps its random order
    when the migrated program runs as plain `python train.py` (issue 14, item 3)."""
    from torch.utils.data import RandomSampler, SequentialSampler

    assert isinstance(tm.eval_sampler(list(range(5)), shuffle=True), RandomSampler)
    assert isinstance(tm.eval_sampler(list(range(5))), SequentialSampler)


def test_to_float32_casts_low_precision_outputs_in_any_container():
    from collections import OrderedDict, namedtuple

    Out = namedtuple("Out", "logits aux")
    half = torch.ones(2, dtype=torch.bfloat16, requires_grad=True)
    fp16 = torch.ones(2, dtype=torch.float16)
    ints = torch.ones(2, dtype=torch.long)

    assert tm.to_float32(half).dtype == torch.float32
    assert tm.to_float32(ints) is ints  # not floating: untouched
    full = torch.ones(2)
    assert tm.to_float32(full) is full  # already float32: no copy

    class ModelOutput(OrderedDict):  # transformers-style output dict
        pass

    nested = tm.to_float32(ModelOutput(logits=half, labels=ints, extra=[fp16, "name"]))
    assert type(nested) is ModelOutput
    assert nested["logits"].dtype == torch.float32 and nested["labels"] is ints
    assert nested["extra"][0].dtype == torch.float32 and nested["extra"][1] == "name"
    pair = tm.to_float32(Out(half, (fp16, 3)))
    assert isinstance(pair, Out) and pair.logits.dtype == torch.float32 and pair.aux[0].dtype == torch.float32
    assert pair.aux[1] == 3 and tm.to_float32(None) is None
    pair.logits.sum().backward()  # differentiable: a loss computed from it still trains
    assert half.grad is not None


# ------------------------------------------------------------------ hand-made batches, full-batch indices

def test_shard_helpers_return_their_input_in_one_process():
    batches, idx, mask = range(0, 100, 32), torch.arange(10), torch.arange(10) < 4
    gen = (b for b in [1, 2])
    assert tm.shard_range(batches) is batches
    assert tm.shard_indices(idx) is idx and tm.shard_indices(mask) is mask
    assert tm.shard_batches(gen) is gen
    loss = torch.tensor(2.5, requires_grad=True)
    assert tm.shard_mean(loss, idx) is loss


def test_shard_range_gives_rank_1_every_second_batch_padded_to_equal_counts(other_rank):
    assert tm.shard_range(range(0, 128, 32)) == range(32, 128, 64)  # divides: stays a range
    # 5 batches on 2 ranks: rank 0 gets 0, 2, 4 and rank 1 gets 1, 3 and the first batch again
    assert list(tm.shard_range(range(0, 160, 32))) == [32, 96, 0]
    assert tm.shard_range(["a", "b", "c"]) == ["b", "a"]
    assert list(tm.shard_range(range(0))) == []


def test_shard_indices_of_index_tensors_arrays_lists_and_masks(other_rank):
    assert tm.shard_indices(torch.arange(5)).tolist() == [1, 3]
    assert tm.shard_indices(np.arange(5)).tolist() == [1, 3]
    assert tm.shard_indices([10, 11, 12]) == [11]
    mask = torch.tensor([True, False, True, True, False, True])
    part = tm.shard_indices(mask)
    assert part.dtype == torch.bool and part.tolist() == [False, False, True, False, False, True]
    assert tm.shard_indices(np.array([[True, True], [False, True]])).tolist() == [[False, True], [False, False]]


def test_shard_batches_of_a_list_and_of_an_iterator(other_rank, monkeypatch):
    monkeypatch.setitem(tm._PASSES, "count", 0)  # the first pass of the process
    assert tm.shard_batches([1, 2, 3, 4, 5]) == [2, 4, 1]

    def shuffled(n):
        order = list(range(n))
        random.shuffle(order)  # draws as it goes, from the global stream
        yield from order

    sharded = tm.shard_batches(shuffled(5), seed=7)
    random.seed(123)
    before = random.random()
    got = list(sharded)
    random.seed(123)
    assert random.random() == before  # the program's own stream is untouched
    # rank 0 of the same seed would see the same order: its items at even positions
    order = list(range(5))
    random.Random(7).shuffle(order)
    assert got == [order[1], order[3], order[0]]


def test_shard_batches_shards_an_unsharded_loader_in_place_and_keeps_a_sharded_one(other_rank):
    loader = DataLoader(list(range(10)), batch_size=2)
    assert tm.shard_batches(loader) is loader
    assert [b.tolist() for b in loader] == [[2, 3], [6, 7], [0, 1]]  # batches 1, 3 and padding
    assert len(loader) == 3
    sharded = DataLoader(list(range(10)), batch_size=2, sampler=DistributedSampler(list(range(10)),
                                                                                    num_replicas=2, rank=1))
    assert tm.shard_batches(sharded) is sharded
    assert tm.shard_batches(sharded).sampler.__class__ is DistributedSampler


def test_over_a_loader_in_one_process_nothing_is_sharded_and_values_pass_through():
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=4, sampler=tm.eval_sampler(list(range(6))))
    assert tm.sharded(loader) is False
    assert tm.all_reduce(3, 2.5, over=loader) == (3, 2.5)
    assert tm.gather_for_metrics(torch.arange(5.0), 3, over=loader).tolist() == [0.0, 1.0, 2.0]


def test_input_in_one_process_is_the_builtin(monkeypatch):
    monkeypatch.setattr("builtins.input", lambda prompt="": f"typed after {prompt!r}")
    assert tm.input("dataset? ") == "typed after 'dataset? '"


def test_bar_stream_in_one_process_is_the_given_file():
    assert tm.bar_stream() is None
    assert tm.bar_stream(sys.stderr) is sys.stderr


def test_to_device_moves_tensors_and_keeps_everything_else():
    """A batch `(count, x, lengths, ids)`: the tensor moves, a count, a list and strings stay."""
    x, lengths = torch.randn(2, 3), [3, 1]
    n, moved, kept, name = tm.to_device(2, x, lengths, "a")
    assert n == 2 and kept is lengths and name == "a"
    assert torch.equal(moved.cpu(), x) and moved.device == tm.device()
    assert tm.to_device(x).device == tm.device()  # one value: that value, not a tuple
    assert tm.to_device(5) == 5


def test_grad_scaler_lets_a_step_without_gradients_pass():
    """An optimizer whose parameters got no gradient this step (the other model of a GAN step):
    torch's scaler asserts "No inf checks were recorded"; tm's steps nothing, as optimizer.step()
    would, and its scale stays. A step with gradients still goes through the scaler."""
    scaler = tm.GradScaler(enabled=True)
    used, idle = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt_used, opt_idle = torch.optim.SGD([used], lr=0.5), torch.optim.SGD([idle], lr=0.5)
    scale = scaler.get_scale()
    for _ in range(2):
        opt_used.zero_grad(), opt_idle.zero_grad()
        scaler.scale((used * 2).sum()).backward()
        scaler.step(opt_idle)  # no gradient: nothing to do
        scaler.step(opt_used)
        scaler.update()
    assert torch.equal(idle.detach(), torch.ones(2))
    assert torch.allclose(used.detach(), torch.ones(2) - 2 * 0.5 * 2)
    opt_idle.zero_grad()
    scaler.scale(idle.detach().sum() * 0 + torch.tensor(1.0, requires_grad=True)).backward()
    scaler.step(opt_idle)
    scaler.update()  # only a step without gradients since the last update: the scale stays
    assert scaler.get_scale() >= scale


def test_grad_scaler_steps_a_projects_optimizer_wrapper():
    """`scaler.step(optimizer)` where `optimizer` is the project's own wrapper (a warm-up
    schedule around Adam, no `param_groups`): the scaler unscales the held optimizer's
    gradients and calls the wrapper's own `step()` (its schedule too), and skips it on an
    overflow, as it would a torch optimizer."""
    class Warmup:
        def __init__(self, optimizer):
            self.optimizer, self.steps = optimizer, 0

        def step(self):
            self.steps += 1
            for group in self.optimizer.param_groups:
                group["lr"] = 0.5
            self.optimizer.step()

    scaler = tm.GradScaler(enabled=True)
    w = torch.nn.Parameter(torch.ones(2))
    wrapped = Warmup(torch.optim.SGD([w], lr=0.0))
    scaler.scale((w * 2).sum()).backward()
    scaler.unscale_(wrapped)  # (gradient clipping reads unscaled gradients)
    scaler.step(wrapped)
    scaler.update()
    assert wrapped.steps == 1 and torch.allclose(w.detach(), torch.ones(2) - 0.5 * 2)
    w.grad = None
    scaler.scale((w * float("inf")).sum()).backward()
    scaler.step(wrapped)  # an overflow: skipped, the scale shrinks
    scaler.update()
    assert wrapped.steps == 1


def test_as_device_reads_any_gpu_as_this_process_own():
    for spec in (0, 3, "cuda", "cuda:1", torch.device("cuda", 2)):
        assert tm.as_device(spec) == tm.device()
    assert tm.as_device("cpu") == torch.device("cpu")
    assert tm.as_device(torch.device("meta")) == torch.device("meta")


def test_files_in_a_private_temporary_folder_are_not_shared_writes():
    """A rank writing into a folder tempfile made for it (ROUGE's config) writes its own file."""
    import tempfile

    root = tm._temp_root()
    with tempfile.TemporaryDirectory() as folder:
        assert tm._private_temp(os.path.join(folder, "task.xml"), root)
    assert not tm._private_temp(os.path.join(tempfile.gettempdir(), "results.txt"), root)
    assert not tm._private_temp("results.txt", root)


def test_the_drift_check_reads_sparse_and_nested_inputs():
    """A full-batch graph model's sparse features (VGAE) are a step's input: the check that
    compares inputs across ranks reads their values and never fails the step."""
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert tm._fingerprint((dense.to_sparse(),)) == tm._fingerprint((dense.to_sparse().coalesce().values(),))
    assert tm._fingerprint(dense.to_sparse_csr()) is not None
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    tm._fingerprint(nested)  # a value or None, never an error


def test_set_device_is_a_no_op_off_cuda(monkeypatch):
    """What a module's own `torch.cuda.set_device(i)` becomes: on a CPU run it must not raise
    (torch.cuda.set_device(cpu) does), and it names the process's device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    called = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: called.append(d))
    assert tm.set_device() == torch.device("cpu") and called == []


def test_parallel_part_keeps_the_module_level(monkeypatch):
    """`model.features = nn.DataParallel(model.features)` becomes `tm.parallel_part(...)`:
    DataParallel in one process, a plain holder under torchrun; both save `features.module.*`,
    the original's keys, and run the submodule's forward unchanged."""
    def build(part):
        torch.manual_seed(0)
        net = nn.Sequential()
        net.features = part(nn.Linear(3, 2))
        return net

    alone = build(tm.parallel_part)
    assert isinstance(alone.features, nn.DataParallel)
    monkeypatch.setattr(tm, "world_size", lambda: 2)
    ranked = build(tm.parallel_part)
    assert isinstance(ranked.features, tm.ParallelPart)
    assert list(ranked.state_dict()) == list(alone.state_dict()) == ["features.module.weight", "features.module.bias"]
    x = torch.randn(4, 3)
    assert torch.equal(ranked.features(x), alone.features(x))


def test_hydra_config_copies_and_logs_left_to_rank_0(monkeypatch):
    """A `@hydra.main` program under torchrun: on ranks other than 0, setup() adds the overrides
    that keep Hydra's `.hydra/*.yaml` and log files to rank 0, keeping any the command line sets;
    a program without a Hydra main keeps its command line."""
    namespace = {}
    exec(compile("def decorated_main(cfg=None):\n    return cfg\n", os.path.join("site", "hydra", "main.py"), "exec"),
         namespace)
    fake_main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    monkeypatch.setattr(sys, "argv", ["train.py", "lr=0.1", "hydra/job_logging=colorlog"])
    tm._hydra_quiet_on_other_ranks()
    assert sys.argv == ["train.py", "lr=0.1", "hydra/job_logging=colorlog"]  # no Hydra main
    fake_main.train_model = namespace["decorated_main"]
    tm._hydra_quiet_on_other_ranks()
    assert sys.argv == ["train.py", "lr=0.1", "hydra/job_logging=colorlog", "hydra.output_subdir=null",
                        "hydra/hydra_logging=disabled"]


def test_unsharded_builds_whole_evaluation_loaders(monkeypatch):
    """`dev = tm.unsharded(get_loader, dev_file, 8)` for the factory that also builds the
    training loader: inside it the sampler draws every sample, in the same order on every rank
    where it shuffles, and the batch is not divided; outside it the factory shards as before."""
    monkeypatch.setattr(tm, "world_size", lambda: 2)
    monkeypatch.setattr(tm, "rank", lambda: 1)
    monkeypatch.setattr(tm, "_SAMPLERS_MADE", 0)
    data = list(range(10))

    def get_loader(dataset, batch_size, shuffle=True):
        return tm.sampler(dataset, shuffle=shuffle), tm.per_rank_batch(batch_size)

    sharded, per_rank = get_loader(data, 8)
    assert len(list(sharded)) == 5 and per_rank == 4
    whole, batch = tm.unsharded(get_loader, data, 8)
    assert sorted(whole) == data and batch == 8
    in_order, _ = tm.unsharded(get_loader, data, 8, shuffle=False)
    assert list(in_order) == data
    monkeypatch.setattr(tm, "_SAMPLERS_MADE", 1)
    first = list(tm.unsharded(get_loader, data, 8)[0])
    monkeypatch.setattr(tm, "_SAMPLERS_MADE", 1)
    assert list(tm.unsharded(get_loader, data, 8)[0]) == first  # the same order wherever it is built alike


def test_shard_stream_names_what_it_cannot_cut(monkeypatch, capsys):
    """`batchify(tm.shard_stream(args), data, bsz)`: options instead of data are returned as they
    are, and rank 0 says where, once."""
    monkeypatch.setattr(tm, "world_size", lambda: 2)
    monkeypatch.setattr(tm, "rank", lambda: 0)
    monkeypatch.setattr(tm, "_STREAM_WARNED", set())
    options = argparse.Namespace(bsz=4)
    assert tm.shard_stream(options) is options and tm.shard_stream(options) is options
    err = capsys.readouterr().err
    assert err.count("shard_stream was handed a Namespace") == 1 and "test_runtime_single.py:" in err
    assert tm.shard_stream(iter([1, 2])) is not None and "handed a list_iterator" not in capsys.readouterr().err
    path = "dataset/tacred/train.json"  # a file the iterator reads: never cut as characters
    assert tm.shard_stream(path) == path and "handed a str" in capsys.readouterr().err

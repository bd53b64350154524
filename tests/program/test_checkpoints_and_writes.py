"""The checkpoint and file-write facts (`program.checkpoints`, `program.writes`) without any rule:
the file a save or load names, buffers and file objects, loads and barriers in order, what a load
feeds and what a checkpoint holds; which calls download, write files or test whether one exists."""

from __future__ import annotations

import textwrap

import libcst as cst

from torchmigrate import analysis
from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.checkpoints import (SAVES, feeds_state_dict, file_handle, follows_save, is_buffer,
                                              load_events, non_tensor_saved, path_text)
from torchmigrate.program.writes import (early_return_check, existence_if, fetches, under_main_process_first,
                                         writes_file)
from torchmigrate.rule import Options


def context(source: str):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [])


def calls(ctx, name: str):
    """The calls of the module resolved as `name` (or spelled so), in call order."""
    return [c for c, n in analysis.facts(ctx).calls if (n or code(c.func)) == name]


def test_the_path_of_a_save_is_read_through_an_opened_file():
    ctx = context("""
        import torch
        def save(state, best):
            with open(best, "wb") as f:
                torch.save(state, f)
            torch.save(state, "last.pt")
    """)
    into_file, into_path = calls(ctx, "torch.save")
    assert path_text(ctx, into_file, into_file.args[1].value) == "best"
    assert file_handle(ctx, into_file, into_file.args[1].value)[0]
    assert path_text(ctx, into_path, into_path.args[1].value) == '"last.pt"'
    assert file_handle(ctx, into_path, into_path.args[1].value) == (False, None)


def test_a_save_into_a_memory_buffer_is_a_buffer():
    ctx = context("""
        import io
        import torch
        stream = io.BytesIO()
        torch.save(state, stream)
        out = io.BytesIO()
        torch.save(state, out)
        torch.save(state, path)
    """)
    saves = calls(ctx, "torch.save")
    scope = ctx.module
    assert [is_buffer(ctx, c.args[1].value, scope) for c in saves] == [True, True, False]


def test_loads_and_barriers_in_call_order_and_what_follows_a_save():
    ctx = context("""
        import shutil
        import torch
        import torch.distributed as dist
        torch.save(state, path)
        shutil.copyfile(path, best)
        dist.barrier()
        state = torch.load(path)
    """)
    assert [name for _, _, name in load_events(ctx)] == ["torch.distributed.barrier", "torch.load"]
    (copy,) = calls(ctx, "shutil.copyfile")
    assert follows_save(ctx, copy)
    (save,) = calls(ctx, "torch.save")
    assert not follows_save(ctx, save)
    assert "torch.save" in SAVES


def test_a_load_feeds_a_state_dict_through_assignments():
    ctx = context("""
        import torch
        def resume(model, path, out):
            ckpt = torch.load(path)
            weights = ckpt["model"]
            model.load_state_dict(weights)
            stats = torch.load(out)
            print(stats)
    """)
    into_model, printed = calls(ctx, "torch.load")
    lsd = [c for c, _ in analysis.facts(ctx).calls
           if isinstance(c.func, cst.Attribute) and c.func.attr.value == "load_state_dict"]
    assert feeds_state_dict(ctx, into_model, lsd)
    assert not feeds_state_dict(ctx, printed, lsd)


def test_non_tensor_objects_put_in_checkpoints():
    ctx = context("""
        import torch
        cfg = dict(lr=0.1)
        torch.save({"model": net.state_dict(), "args": args, "cfg": cfg}, path)
    """)
    assert non_tensor_saved(ctx) == ["args"]


def test_downloads_and_hugging_face_cache_writes():
    ctx = context("""
        import torchvision
        from datasets import load_dataset
        train = torchvision.datasets.CIFAR10("data", train=True, download=True)
        test = torchvision.datasets.CIFAR10("data", train=False, download=False)
        ds = load_dataset("imdb")
        ds = ds.map(tokenize)
        other.map(tokenize)
    """)
    found = {code(c).split("(")[0]: fetches(ctx, c, n) for c, n in analysis.facts(ctx).calls}
    assert found["load_dataset"] and found["ds.map"] and not found["other.map"]
    train, test = calls(ctx, "torchvision.datasets.CIFAR10")
    assert fetches(ctx, train, "torchvision.datasets.CIFAR10")
    assert not fetches(ctx, test, "torchvision.datasets.CIFAR10")


def test_writes_under_an_existence_test_or_after_an_early_return():
    ctx = context("""
        import os
        import pickle
        import torch
        def vocabulary(path):
            if not os.path.exists(path):
                torch.save(build(), path)
            return torch.load(path)

        def features(path):
            if os.path.isfile(path):
                return load(path)
            with open(path, "wb") as f:
                pickle.dump(compute(), f)
    """)
    (save,) = calls(ctx, "torch.save")
    assert writes_file(save, "torch.save")
    assert code(existence_if(ctx, save).test).strip() == "not os.path.exists(path)"
    (opened,) = calls(ctx, "open")
    assert writes_file(opened, "open")
    assert existence_if(ctx, opened) is None
    assert code(early_return_check(ctx, opened).test).strip() == "os.path.isfile(path)"
    assert early_return_check(ctx, save) is None


def test_already_under_main_process_first():
    ctx = context("""
        import torchvision
        with accelerator.main_process_first():
            first = torchvision.datasets.MNIST("data", download=True)
        alone = torchvision.datasets.MNIST("data", download=True)
    """)
    first, alone = calls(ctx, "torchvision.datasets.MNIST")
    assert under_main_process_first(ctx, first)
    assert not under_main_process_first(ctx, alone)

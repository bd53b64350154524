"""The rank facts (`program.ranks`, `program.rank_guards`, `program.collectives`) without any
rule: which expressions depend on the rank and on which ranks a test holds, which code runs on
some ranks only, which calls must run on every rank."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.collectives import is_collective, runs_user_code
from torchmigrate.program.rank_guards import caller_guards, collective_guard, rank_guard_of, under_rank_guard
from torchmigrate.program.ranks import rank_dependent, rank_polarity, rank_word
from torchmigrate.rule import Options


def context_of(source: str):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [])


def call_named(ctx, name: str) -> cst.Call:
    return next(c for c in ctx.nodes(cst.Call) if code(c.func) == name)


@pytest.mark.parametrize("test, polarity", [
    ("rank == 0", "main"),
    ("dist.get_rank() == 0", "main"),
    ("args.local_rank in [-1, 0]", "main"),
    ("not rank", "main"),
    ("tm.is_main()", "main"),
    ("is_main_process", "main"),
    ("rank != 0", "other"),
    ("rank > 0", "other"),
    ("rank", "other"),
    ("rank == 1", "other"),
    ('int(os.environ["LOCAL_RANK"]) == 0', "main"),
    ("rank % 2 == 1", "other"),
    ("rank == world_size - 1", "any"),
    ("rank == 0 or rank == 1", "any"),
    ("args.local_rank != -1", None),  # "distributed at all": holds on every rank
    ("args.local_rank >= 0", None),
    ("epoch == 0", None),
    ("negative_all_rank", None),  # a setting about ranks, the same on every rank
])
def test_rank_polarity_says_on_which_ranks_a_test_holds(test, polarity):
    assert rank_polarity(cst.parse_expression(test)) == polarity


def test_rank_words_hold_a_rank_not_a_setting_about_ranks():
    assert all(rank_word(w) for w in ("rank", "local_rank", "get_global_rank", "rank_id"))
    assert not any(rank_word(w) for w in ("negative_all_rank", "ranking", "lora_rank_x"))


def test_a_name_assigned_a_rank_test_is_rank_dependent_too():
    ctx = context_of("""
        import torch.distributed as dist
        save_logs = dist.get_rank() == 0
        device = torch.device(f"cuda:{gpu}")
        if save_logs:
            log(x)
        if device:
            log(y)
    """)
    first, second = [n for n in ctx.nodes(cst.If)]
    assert rank_dependent(ctx, first.test)
    assert not rank_dependent(ctx, second.test)


def test_rank_guards_are_ifs_conditionals_shortcuts_and_early_exits():
    ctx = context_of("""
        if rank == 0:
            a()
        b() if tm.is_main() else None
        is_main and c()
        def f():
            if rank != 0:
                return
            d()
        e()
    """)
    for name in ("a", "b", "c", "d"):
        assert under_rank_guard(ctx, call_named(ctx, name)), name
    assert rank_guard_of(ctx, call_named(ctx, "e")) is None


def test_a_collective_guard_is_also_around_the_calls_of_the_function():
    ctx = context_of("""
        import torch.distributed as dist
        def save():
            dist.barrier()
        def evaluate():
            dist.all_reduce(t)
        if rank == 0:
            save()
        evaluate()
    """)
    assert rank_guard_of(ctx, call_named(ctx, "dist.barrier")) is None
    assert collective_guard(ctx, call_named(ctx, "dist.barrier")) is not None
    assert collective_guard(ctx, call_named(ctx, "dist.all_reduce")) is None
    assert caller_guards(ctx, call_named(ctx, "dist.barrier")) is not None
    assert caller_guards(ctx, call_named(ctx, "dist.all_reduce")) is None


def test_collectives_are_torch_distributed_and_runtime_calls_that_communicate():
    assert is_collective("torch.distributed.all_reduce")
    assert is_collective("torchmigrate.runtime.barrier")
    assert not is_collective("torch.distributed.get_rank")
    assert not is_collective("utils.all_reduce")
    assert not is_collective(None)


def test_code_that_runs_a_forward_a_collective_or_a_function_of_the_file_runs_user_code():
    ctx = context_of("""
        import torch
        import torch.distributed as dist
        def denorm(x):
            return (x + 1) / 2
        def evaluate(m):
            return m(x)
        log(denorm(x).clamp(0, 1))
        log(evaluate(model))
        log(dist.all_reduce(t))
        log(len(x))
    """)
    args = [c.args[0].value for c in ctx.nodes(cst.Call) if code(c.func) == "log"]
    assert [runs_user_code(ctx, a) for a in args] == [False, True, True, False]

"""Data-loading rules (TM201-TM204): the shared loader analysis, classification, lint gating,
call rewriting, the example scripts, and a torchrun run showing that migrated loaders shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import libcst as cst
import pytest

from conftest import FIXTURES, migrate
from launcher import torchrun
from torchmigrate.engine.process import process_source, run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.rule import Options
from torchmigrate import analysis
from torchmigrate.program.loaders import loader_facts, loaders, refs_at
from torchmigrate.rules.data.base import DataRule
from torchmigrate.rules.data.plan import data_plan
from torchmigrate.rules.data.rewrite import rewrite_call
from torchmigrate.rules.data.tm201_dist_sampler import DistSampler
from torchmigrate.rules.data.tm202_set_epoch import SetEpoch
from torchmigrate.rules.data.tm203_eval_unpadded import EvalUnpadded
from torchmigrate.rules.data.tm204_sampler_shuffle_conflict import SamplerShuffleConflict

DATA_RULES = [DistSampler, SetEpoch, EvalUnpadded, SamplerShuffleConflict]
SCRIPTS = sorted((FIXTURES / "scripts").glob("*.py"))


def analyse(source: str, mode: str = "ddp", rules=(), **options):
    source = textwrap.dedent(source).lstrip("\n")
    ctx = run_rules(cst.parse_module(source), "x.py", Options(mode=mode, **options), list(rules))
    return ctx, loaders(ctx)


def run(source: str, mode: str = "ddp", rules=DATA_RULES, **extra):
    source = textwrap.dedent(source).lstrip("\n")
    options = Options(mode=mode, fix=mode == "lint", **extra)
    result = process_source(source, "x.py", options, rules)
    compile(result.new_source, "x.py", "exec")
    assert migrate(result.new_source, options, rules) == result.new_source, "second run must be a no-op"
    return result


# --- the published facts ----------------------------------------------------------------------

def test_facts_shape_and_refs():
    ctx, found = analyse("""
        import torch
        from torch.utils.data import DataLoader as DL

        def get_loaders(bs):
            train_loader = DL(train_set, batch_size=bs, shuffle=True)
            val_loader = DL(test_set, batch_size=100)
            return train_loader, val_loader

        @torch.no_grad()
        def evaluate(model, loader):
            for x, y in loader:
                pass

        class Trainer:
            def build(self):
                self.extra = DL(MyDataset(root), batch_size=4, shuffle=is_train)

        trn, vl = get_loaders(32)
        evaluate(model, vl)
        loaders = {"train": DL(a), "test": DL(b)}
    """)
    assert ctx.facts["loaders"].loaders is found
    by_target = {x.target: x for x in found}
    assert set(by_target) == {"train_loader", "val_loader", "self.extra", 'loaders["train"]', 'loaders["test"]'}
    assert [by_target[t].kind for t in ("train_loader", "val_loader", "self.extra")] == ["train", "eval", "mixed"]
    assert by_target["val_loader"].eval is True and by_target["self.extra"].eval is None
    assert by_target['loaders["test"]'].kind == "eval" and by_target['loaders["train"]'].kind == "train"
    assert all(x.status == "plain" for x in found)
    plan = {t: data_plan(ctx).of(x) for t, x in by_target.items()}
    assert plan["train_loader"].sampler == "distributed" and plan["val_loader"].sampler == "eval"
    assert plan["self.extra"].hoist == ("line", "extra_dataset")
    assert plan["train_loader"].needs_epoch and not plan["val_loader"].needs_epoch
    # names under which the loaders are visible elsewhere in the file
    assert {r.text for r in by_target["train_loader"].refs} == {"train_loader", "trn"}
    assert {r.text for r in by_target["val_loader"].refs} == {"val_loader", "vl", "loader"}
    module = ctx.module
    evaluate = next(s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == "evaluate")
    loop = evaluate.body.body[0]
    assert isinstance(loop, cst.For)
    assert [x.target for r in refs_at(ctx, loop.iter) for x in r.loaders] == ["val_loader"]


def test_no_dataloader_costs_nothing():
    ctx, found = analyse("import torch\nx = torch.zeros(3)\n", rules=DATA_RULES)
    assert found == [] and loader_facts(ctx).scan is None


def test_facts_without_any_data_rule_enabled():
    # Another family (e.g. TM701) may ask for the facts when no data rule runs.
    ctx, found = analyse("""
        from torch.utils.data import DataLoader
        val_loader = DataLoader(val_ds, batch_size=8)
    """, rules=())
    assert [(x.target, x.kind) for x in found] == [("val_loader", "eval")]


@pytest.mark.parametrize("line,kind", [
    ("train_loader = DataLoader(ds, batch_size=4)", "train"),
    ("trainloader = DataLoader(ds)", "train"),
    ("loader = DataLoader(ds)", "train"),
    ("testloader = DataLoader(ds)", "eval"),
    ("val_dl = DataLoader(ds)", "eval"),
    ("validLoader = DataLoader(ds)", "eval"),
    ("dev_loader = DataLoader(ds)", "eval"),
    ("device_loader = DataLoader(ds)", "train"),  # `device` is not `dev`
    ("loader = DataLoader(val_set)", "eval"),
    ("loader = DataLoader(MNIST(root, train=False))", "eval"),
    ("loader = DataLoader(MNIST(root, train=True))", "train"),
    ("loader = DataLoader(ImageFolder(os.path.join(root, 'val')))", "eval"),
    ("loader = DataLoader(load(split='validation'))", "eval"),
    ("loader = DataLoader(ds, shuffle=is_train)", "mixed"),
    ("loader = DataLoader(ds, shuffle=args.shuffle)", "train"),
    ("train_val_loader = DataLoader(ds)", "train"),
])
def test_classification(line, kind):
    _ctx, found = analyse("from torch.utils.data import DataLoader\n" + line + "\n")
    assert found[0].kind == kind


def test_function_name_classifies():
    _ctx, found = analyse("""
        from torch.utils.data import DataLoader
        def get_test_loader(ds):
            return DataLoader(ds, batch_size=8)
        def make_train_loader(ds):
            return DataLoader(ds, batch_size=8, shuffle=True)
    """)
    assert [x.kind for x in found] == ["eval", "train"]


@pytest.mark.parametrize("source,status", [
    ("loader = DataLoader(ds, sampler=DistributedSampler(ds))", "distributed"),
    # behind the program's flag, in a file that is not distributed otherwise: off in the run migrated
    ("s = DistributedSampler(ds) if d else None\nloader = DataLoader(ds, sampler=s)", "custom"),
    ("torch.distributed.init_process_group('nccl')\ns = DistributedSampler(ds) if d else None\n"
     "loader = DataLoader(ds, sampler=s)", "distributed"),
    ("loader = DataLoader(ds, sampler=tm.sampler(ds, shuffle=True))", "distributed"),
    ("loader = DataLoader(ds, sampler=WeightedRandomSampler(w, 10))", "custom"),
    ("loader = DataLoader(ds, batch_sampler=my_batches)", "custom"),
    ("loader = DataLoader(ds, sampler=None, shuffle=True)", "plain"),
    ("loader = DataLoader(*args)", "unknown"),
    ("loader = DataLoader(**cfg)", "unknown"),
    ("kw = {'num_workers': 2}\nloader = DataLoader(ds, **kw)", "plain"),
    ("kw = {'sampler': s}\nloader = DataLoader(ds, **kw)", "unknown"),
    ("loader = DataLoader(MyShards(root, rank=rank, world_size=ws))", "sharded"),
    ("loader = DataLoader(wds.WebDataset(urls))", "iterable"),
    ("class S(IterableDataset):\n    pass\nloader = DataLoader(S())", "iterable"),
])
def test_status(source, status):
    header = ("import torch\nimport webdataset as wds\nimport torchmigrate.runtime as tm\n"
              "from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, WeightedRandomSampler\n")
    _ctx, found = analyse(header + source + "\n")
    assert found[-1].status == status


GRAD_AND_NO_GRAD = """
    import torch
    from torch.utils.data import DataLoader
    val_loader = DataLoader(val_ds, batch_size=8)
    test_loader = DataLoader(test_ds, batch_size=8)
    for x in val_loader:
        model(x)
    with torch.no_grad():
        for x in test_loader:
            model(x)
"""


def test_eval_iterated_with_gradients_is_kept_whole():
    """Unpadded shards would give the ranks different batch counts where a DDP forward with
    gradients needs equal ones, and padded ones count samples twice: every rank evaluates it all."""
    ctx, found = analyse(GRAD_AND_NO_GRAD)
    assert [loader_facts(ctx).iterated_with_grad(x) for x in found] == [True, False]
    plan = data_plan(ctx)
    assert [plan.of(x).sampler for x in found] == [None, "eval"]
    assert "gradients enabled" in plan.of(found[0]).unproven and not plan.of(found[1]).unproven


def test_eval_iterated_with_gradients_gets_padded_sampler_with_shard_eval():
    ctx, found = analyse(GRAD_AND_NO_GRAD, shard_eval=True)
    plan = data_plan(ctx)
    assert [(plan.of(x).eval_with_grad, plan.of(x).sampler) for x in found] == [(True, "distributed"), (False, "eval")]


# --- modes and gating --------------------------------------------------------------------------

SINGLE_GPU = """
    import torch
    from torch.utils.data import DataLoader, SubsetRandomSampler
    train_loader = DataLoader(train_ds, batch_size=32, shuffle=True)
    val_loader = DataLoader(val_ds, batch_size=32)
    bad = DataLoader(ds, batch_size=32, shuffle=True, sampler=SubsetRandomSampler(idx))
    for epoch in range(3):
        for x in train_loader:
            pass
"""


def test_lint_single_gpu_file_reports_only_the_crash():
    result = run(SINGLE_GPU, mode="lint")
    assert [f.code for f in result.findings] == ["TM204"]


def test_ddp_migrates_single_gpu_file():
    result = run(SINGLE_GPU)
    assert sorted({f.code for f in result.findings}) == ["TM201", "TM202", "TM203", "TM204"]
    assert "sampler=tm.sampler(train_ds, shuffle=True)" in result.new_source
    # no loop over `val_loader` here proves what it computes reduced: every rank evaluates it all
    assert "val_loader = DataLoader(val_ds, batch_size=32)\n" in result.new_source
    assert [f.advice for f in result.findings if f.code == "TM203"] == [True, False]
    assert "val_loader = DataLoader(val_ds, batch_size=32)\ntm.same_draws(val_loader)\n" in result.new_source
    assert "    tm.set_epoch(train_loader, epoch)\n" in result.new_source


def test_lint_distributed_file_reports_missing_sampler_and_set_epoch():
    result = run("""
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("gloo")
        sampler = DistributedSampler(ds)
        loader = DataLoader(ds, batch_size=32, sampler=sampler)
        aux = DataLoader(aux_ds, batch_size=32, shuffle=True)
        val_loader = DataLoader(val_ds, batch_size=32)
        for epoch in range(3):
            for x in loader:
                pass
    """, mode="lint")
    assert [f.code for f in result.findings] == ["TM201", "TM202"]
    assert "    sampler.set_epoch(epoch)\n" in result.new_source  # plain torch where it can be
    assert "val_loader = DataLoader(val_ds, batch_size=32)\n" in result.new_source


def test_correct_distributed_script_is_byte_identical():
    source = textwrap.dedent("""
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler
        dist.init_process_group("nccl")
        train_sampler = DistributedSampler(train_ds) if args.distributed else None
        train_loader = DataLoader(train_ds, batch_size=32, shuffle=(train_sampler is None), sampler=train_sampler)
        val_loader = DataLoader(val_ds, batch_size=64)
        for epoch in range(10):
            if args.distributed:
                train_sampler.set_epoch(epoch)
            train(train_loader)
    """).lstrip()
    for mode in ("ddp", "lint"):
        result = run(source, mode=mode)
        assert result.new_source == source and not result.findings


def test_self_sharding_frameworks_are_left_alone():
    result = run("""
        import lightning as L
        from torch.utils.data import DataLoader
        loader = DataLoader(ds, batch_size=4, shuffle=True)
    """)
    assert not [f for f in result.findings if f.code.startswith("TM2")]
    assert "sampler" not in result.new_source


# --- rewriting ----------------------------------------------------------------------------------

@pytest.mark.parametrize("before,after", [
    ("DataLoader(ds, 8, True)", "DataLoader(ds, 8, sampler=S)"),
    ("DataLoader(ds, 8, True, None, None, 2)", "DataLoader(ds, 8, sampler=S, batch_sampler=None, num_workers=2)"),
    ("DataLoader(ds)", "DataLoader(ds, sampler=S)"),
    ("DataLoader(ds, shuffle=True, batch_size=8)", "DataLoader(ds, sampler=S, batch_size=8)"),
    ("DataLoader(ds, batch_size=8, sampler=None, shuffle=False)", "DataLoader(ds, batch_size=8, sampler=S)"),
    ("DataLoader(ds, batch_size=8, **kw)", "DataLoader(ds, batch_size=8, sampler=S, **kw)"),
    ("DataLoader(\n    ds,\n    batch_size=8,\n)", "DataLoader(\n    ds,\n    batch_size=8,\n    sampler=S,\n)"),
    ("DataLoader(\n    ds,\n    shuffle=True,\n)", "DataLoader(\n    ds,\n    sampler=S,\n)"),
])
def test_rewrite_call(before, after):
    call = cst.parse_expression(before)
    assert code(rewrite_call(call, cst.Name("S"))) == after


def test_rewrite_call_drops_shuffle_only():
    call = cst.parse_expression("DataLoader(ds, 8, True, my_sampler, num_workers=2)")
    assert code(rewrite_call(call, None)) == "DataLoader(ds, 8, sampler=my_sampler, num_workers=2)"


def test_long_lines_are_wrapped_at_the_open_parenthesis():
    result = run("""
        from torch.utils.data import DataLoader
        def main():
            train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=4)
            val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=args.workers)
    """, rules=[DistSampler, EvalUnpadded], shard_eval=True)
    # at most 99 columns, or the longest line the call already had
    assert ("    train_loader = DataLoader(train_set, batch_size=args.batch_size,\n"
            "                              sampler=tm.sampler(train_set, shuffle=True), num_workers=4)\n") in result.new_source
    assert ("    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=tm.eval_sampler(val_set),\n"
            "                            num_workers=args.workers)\n") in result.new_source


def test_the_whole_rest_of_the_line_counts_when_wrapping():
    """The arguments after the sampler stay on its line only if all of them fit, not just the
    first (milesial/Pytorch-UNet's loaders went to 127 columns)."""
    result = run("""
        from torch.utils.data import DataLoader
        def main():
            val_loader = DataLoader(val, batch_size=batch_size, shuffle=False, num_workers=8, pin_memory=True, drop_last=True)
            vl = DataLoader(val, batch_size=4, shuffle=False, num_workers=8, drop_last=True)
    """, rules=[DistSampler, EvalUnpadded], shard_eval=True)
    assert ("    val_loader = DataLoader(val, batch_size=batch_size, sampler=tm.eval_sampler(val),\n"
            "                            num_workers=8, pin_memory=True, drop_last=True)\n") in result.new_source
    assert ("    vl = DataLoader(val, batch_size=4, sampler=tm.eval_sampler(val), num_workers=8, drop_last=True)\n"
            in result.new_source)


def test_hoisted_names_do_not_clash():
    result = run("""
        from torch.utils.data import DataLoader
        train_dataset = None
        def dataset():
            pass
        train_loader = DataLoader(Ds(1), shuffle=True)
        loader = DataLoader(Ds(2))
        train_loader2 = DataLoader(Ds(3))
    """, rules=[DistSampler])
    lines = result.new_source.splitlines()
    assert "train_dataset_2 = Ds(1)" in lines and "dataset_2 = Ds(2)" in lines
    assert "train_dataset2 = Ds(3)" in lines


def test_hoist_keeps_fixes_of_other_rules_inside_the_dataset():
    # A REPLACE on a node inside the dataset expression (as TM103 would make) survives the hoist.
    from torchmigrate.finding import replace

    class CudaToDevice(DataRule):
        code = "TM999"
        name = "test-cuda"
        commands = frozenset({"ddp"})

        def leave_Module(self, node):
            for call, _name in analysis.facts(self.ctx).calls:
                if isinstance(call.func, cst.Attribute) and call.func.attr.value == "cuda":
                    self.report(call, "cuda", edits=[replace(call, lambda c: cst.parse_expression(
                        code(c.func.value) + ".to(device)"))])

    source = "from torch.utils.data import DataLoader\nloader = DataLoader(TensorDataset(x.cuda()), shuffle=True)\n"
    out = process_source(source, "x.py", Options(mode="ddp"), [DistSampler, CudaToDevice]).new_source
    assert "dataset = TensorDataset(x.to(device))\n" in out


# --- the example scripts ------------------------------------------------------------------------

@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_scripts_data_rules_compile_and_are_idempotent(script):
    source = script.read_text(encoding="utf-8")
    result = run(source)
    if "DataLoader" in source and "DistributedSampler" not in source:
        assert "tm.sampler(" in result.new_source
        # (a loader read again whenever it runs out, `except StopIteration:`, starts passes that
        # only its sampler can number: tm.sampler does, and nothing is added)
        assert ("tm.set_epoch(" in result.new_source) != ("except StopIteration" in source)
    assert not [f for f in result.findings if f.safety.value == "manual" and not f.advice]


# --- under torchrun ----------------------------------------------------------------------------

SEEN = '''
import json
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class IndexedDataset(Dataset):
    def __init__(self, n):
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i]


def get_loaders(bs):
    train_loader = DataLoader(IndexedDataset(64), batch_size=bs, shuffle=True)
    val_loader = DataLoader(IndexedDataset(21), batch_size=bs)
    return train_loader, val_loader


def train_one_epoch(model, loader):
    return [i for idx, x in loader for i in idx.tolist()]


def main():
    torch.manual_seed(0)
    train_loader, val_loader = get_loaders(8)
    record = {"train": [], "val": []}
    for epoch in range(3):
        record["train"].append(train_one_epoch(None, train_loader))
        with torch.no_grad():
            record["val"].append([i for idx, _ in val_loader for i in idx.tolist()])
    with open(os.path.join(os.environ["OUT_DIR"], f"seen_{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
'''


def test_migrated_loaders_shard_under_torchrun(tmp_path):
    script = tmp_path / "seen.py"
    # the sampler mechanics (the loop records the indices it sees, which no rule reduces: sharded
    # by --shard-eval)
    result = process_source(SEEN, str(script), Options(mode="ddp", shard_eval=True), DATA_RULES)
    assert "tm.set_epoch(train_loader, epoch)" in result.new_source
    script.write_text(result.new_source)
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    # one process: the migrated script still runs as `python seen.py`
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    single = json.loads((tmp_path / "seen_0.json").read_text())
    assert sorted(single["train"][0]) == list(range(64)) and single["val"][0] == list(range(21))
    run = torchrun("--standalone", "--nproc-per-node=2", script, env=env, timeout=180,
                   stale=[tmp_path / "seen_*.json"])
    assert run.returncode == 0, run.report()
    ranks = [json.loads((tmp_path / f"seen_{r}.json").read_text()) for r in (0, 1)]
    for epoch in range(3):
        a, b = ranks[0]["train"][epoch], ranks[1]["train"][epoch]
        assert len(a) == len(b) == 32 and sorted(a + b) == list(range(64))  # disjoint shards
        va, vb = ranks[0]["val"][epoch], ranks[1]["val"][epoch]
        assert sorted(va + vb) == list(range(21))  # every eval sample exactly once, no padding
    assert ranks[0]["train"][0] != ranks[0]["train"][1]  # set_epoch reshuffles

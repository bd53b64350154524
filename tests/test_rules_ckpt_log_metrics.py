"""Checkpoint (TM501, TM502), logging (TM601, TM602) and metrics (TM701, TM702) rules: what the
fixtures cannot show (lint findings, safety classes, helpers, suppression) and one real torchrun
run of migrated evaluation code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import libcst as cst
import pytest

from conftest import FIXTURES, migrate
from torchmigrate.engine.process import process_source
from torchmigrate.rule import Context, Options
from torchmigrate.rules import get_rule, select
from torchmigrate.rules.checkpoint.tm501_save_main_unwrapped import is_local_rank_test
from torchmigrate.program.ranks import rank_dependent

CODES = ("TM501", "TM502", "TM601", "TM602", "TM701", "TM702")
DDP = Options(mode="ddp")
LINT = Options(mode="lint")


def run(source: str, options: Options = DDP, codes=CODES):
    return process_source(textwrap.dedent(source).lstrip("\n"), "train.py", options, [get_rule(c) for c in codes])


def codes_of(result, safety=None):
    return [f.code for f in result.findings if safety is None or f.safety.value == safety]


# --- helpers ---------------------------------------------------------------------------------

def _ctx(source: str) -> Context:
    module = cst.parse_module(source)
    return Context(module, "x.py", DDP)


@pytest.mark.parametrize("test,expected", [
    ("rank == 0", True),
    ("dist.get_rank() == 0", True),
    ("tm.is_main()", True),
    ("args.local_rank in [-1, 0]", True),
    ("accelerator.is_main_process", True),
    ("not accelerator.is_local_main_process", True),
    ("master_process", True),
    ("int(os.environ['LOCAL_RANK']) == 0", True),
    ("trainer.is_global_zero", True),
    ("epoch % 10 == 0", False),
    ("args.distributed", False),
    ("torch.cuda.is_available()", False),
])
def test_rank_dependent(test, expected):
    ctx = _ctx("x = 1\n")
    assert rank_dependent(ctx, cst.parse_expression(test)) is expected


@pytest.mark.parametrize("test,expected", [
    ("args.local_rank == 0", True),
    ("0 == local_rank", True),
    ("args.local_rank in [-1, 0]", True),
    ("local_rank in (0, -1)", True),
    ("self.local_rank <= 0", True),
    ("int(os.environ['LOCAL_RANK']) == 0", True),
    ("rank == 0", False),
    ("dist.get_rank() == 0", False),
    ("args.local_rank != -1", False),
    ("args.local_rank == 1", False),
])
def test_local_rank_test(test, expected):
    assert is_local_rank_test(cst.parse_expression(test)) is expected


# --- commands and modes ----------------------------------------------------------------------

def test_rules_belong_to_ddp_and_lint_only():
    for code in CODES:
        rule = get_rule(code)
        assert rule.commands == {"ddp", "lint"}
        assert rule in select(command="ddp") and rule not in select(command="amp")


def test_lint_is_silent_on_single_process_files():
    result = run("""
        import torch
        from tqdm import tqdm
        print("x")
        for x, y in tqdm(val_loader):
            correct = 0
        torch.save(model.state_dict(), "m.pt")
        sd = torch.load("m.pt")
    """, LINT)
    assert result.findings == []


def test_lint_reports_distributed_files():
    result = run("""
        import torch
        import torch.distributed as dist
        from sklearn.metrics import roc_auc_score
        from tqdm import tqdm
        dist.init_process_group("nccl")
        print("x")
        preds, labels = [], []
        for x, y in tqdm(val_loader):
            preds.append(model(x))
            labels.append(y)
        print(roc_auc_score(torch.cat(labels), torch.cat(preds)))
        torch.save(model.state_dict(), "m.pt")
        sd = torch.load("m.pt")
    """, LINT)
    found = codes_of(result)
    for code in ("TM501", "TM502", "TM601", "TM602", "TM702"):
        assert code in found, found
    save = next(f for f in result.findings if f.code == "TM501")
    assert "torch.save without a rank guard in a file that initialises a process group" in save.message
    assert next(f for f in result.findings if f.code == "TM702").safety.value == "manual"
    assert result.new_source == result.source  # lint without --fix writes nothing


def test_lint_fix_applies_safe_fixes_only():
    source = """
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
        emb = torch.load("emb.pt")
        model.load_state_dict(torch.load("m.pt"))
    """
    fixed = run(source, Options(mode="lint", fix=True)).new_source
    assert 'model.load_state_dict(torch.load("m.pt", map_location="cpu"))' in fixed
    assert 'emb = torch.load("emb.pt")\n' in fixed  # unsafe: not a state dict
    unsafe = run(source, Options(mode="lint", fix=True, unsafe_fixes=True)).new_source
    assert 'emb = torch.load("emb.pt", map_location="cpu")' in unsafe


def test_manual_findings_become_one_todo_each():
    result = run("""
        import torch
        def evaluate(model, loader):
            correct = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum().item()
            return correct / len(loader.dataset)
    """)
    assert codes_of(result, "manual") == ["TM701"]
    assert result.new_source.count("# TODO(torchmigrate): TM701") == 1
    again = run(result.new_source)
    assert again.new_source == result.new_source


def test_suppression_comment():
    result = run("""
        import torch
        print("every rank, on purpose")  # torchmigrate: ignore[TM601]
        print("once")
    """)
    assert 'print("every rank, on purpose")  # torchmigrate: ignore[TM601]' in result.new_source
    assert 'tm.print("once")' in result.new_source


def test_vendored_runtime_alias_and_existing_alias():
    result = process_source("import torch\nimport torchmigrate.runtime as rt\nprint('x')\n", "t.py", DDP,
                            [get_rule("TM601")])
    assert result.new_source == "import torch\nimport torchmigrate.runtime as rt\nrt.print('x')\n"
    vendored = Options(mode="ddp", runtime_module="torchmigrate_runtime")
    result = process_source("import torch\nprint('x')\n", "t.py", vendored, [get_rule("TM601")])
    assert "import torchmigrate_runtime as tm" in result.new_source and "tm.print('x')" in result.new_source


def test_reduction_never_under_rank_guard():
    result = run("""
        import torch
        def evaluate(model, loader):
            correct = total = 0
            for x, y in loader:
                correct += (model(x).argmax(1) == y).sum().item()
                total += y.size(0)
            return correct / total
        if tm.is_main():
            evaluate(model, val_loader)
    """, codes=("TM701",))
    assert not [line for line in result.new_source.splitlines() if line.strip().startswith("correct, total =")]
    assert codes_of(result, "manual") == ["TM701"]


def test_metric_messages_name_the_dataset():
    # a loader sharded by --shard-eval although its predictions are not gathered (kept whole otherwise)
    result = run("""
        import torch
        from torch.utils.data import DataLoader
        from sklearn.metrics import roc_auc_score
        test_loader = DataLoader(test_set, batch_size=50)
        scores = []
        labels = []
        for x, y in test_loader:
            scores.append(model(x))
            labels.append(y)
        auc = roc_auc_score(torch.cat(labels), torch.cat(scores))
        torch.save(torch.cat(scores), "scores.pt")  # the scores go elsewhere too: not gathered by the fix
    """, codes=("TM702",), options=Options(mode="ddp", shard_eval=True))
    message = result.findings[0].message
    assert "tm.gather_for_metrics(torch.cat(labels), len(test_set))" in message
    assert "`roc_auc_score`" in message


def test_rules_do_not_import_matchers():
    code = ("import sys, torchmigrate.rules as r; r.all_rules();"
            "assert 'libcst.matchers' not in sys.modules; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the example scripts ---------------------------------------------------------------------

SCRIPTS = sorted((FIXTURES / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_scripts_compile_and_are_idempotent(script):
    rules = select(["TM2", "TM5", "TM6", "TM7"], command="ddp")
    source = script.read_text()
    out = migrate(source, DDP, rules)
    compile(out, str(script), "exec")
    assert migrate(out, DDP, rules) == out
    # saves go under `if tm.is_main():`, or stay under the script's own global-rank guard
    assert "torch.save(" not in out or "if tm.is_main()" in out or "BytesIO" in out \
        or "if dist.get_rank() == 0:" in out or "args.rank == 0:" in out


# --- a real run ------------------------------------------------------------------------------

EVAL_SCRIPT = '''
import os

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm import tqdm

import torchmigrate.runtime as tm

tm.setup()
labels = (torch.arange(11) % 3 == 0).long()
val_ds = TensorDataset(torch.arange(11).float(), labels)
val_loader = DataLoader(val_ds, batch_size=2, sampler=tm.eval_sampler(val_ds))
correct, total = 0, 0
for x, y in tqdm(val_loader):
    correct += (y == 1).sum().item()
    total += y.size(0)
print(f"acc {correct}/{total}")
torch.save({"acc": correct / total}, os.path.join(os.environ["OUT_DIR"], "checkpoint.pt"))
tm.cleanup()
'''


def test_migrated_eval_reduces_once_under_torchrun(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tqdm")
    script = tmp_path / "eval.py"
    out = run(EVAL_SCRIPT).new_source
    assert "correct, total = tm.all_reduce(correct, total)" in out
    assert 'tm.print(f"acc {correct}/{total}")' in out
    assert "disable=not tm.is_main()" in out and "tm.save(" in out
    script.write_text(out)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", OUT_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    single = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert single.returncode == 0, single.stderr
    assert single.stdout.count("acc 4/11") == 1
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("acc 4/11") == 1, proc.stdout  # reduced, printed once
    assert (tmp_path / "checkpoint.pt").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]

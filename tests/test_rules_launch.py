"""Finding-level tests for the launch and device rules (TM101-TM105).

Fixtures check the rewritten text; these check what fixtures cannot: lint-mode reports (which
leave the text unchanged), safety classes, that rewritten code behaves as intended when run,
and that the rules compose with each other on whole scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURES, ROOT
from torchmigrate.engine.process import process_source
from torchmigrate.finding import Safety
from torchmigrate.rule import Options
from torchmigrate.rules import get_rule

CODES = ("TM101", "TM102", "TM103", "TM104", "TM105")
SCRIPTS = sorted((FIXTURES / "scripts").glob("*.py"))


def run(source: str, *codes: str, mode: str = "ddp", fix: bool = False, unsafe: bool = False):
    options = Options(mode=mode, fix=fix or unsafe, unsafe_fixes=unsafe)
    rules = [get_rule(c) for c in (codes or CODES)]
    return process_source(textwrap.dedent(source).lstrip("\n"), "t.py", options, rules)


def found(result, code=None):
    return [(f.code, f.line) for f in result.findings if code is None or f.code == code]


# --- TM101 -----------------------------------------------------------------------------------

def test_tm101_lint_reports_spawn_and_hard_coded_init():
    result = run((FIXTURES / "TM101" / "mp_spawn_lint.in.py").read_text(), "TM101", mode="lint")
    assert found(result) == [("TM101", 8), ("TM101", 13)]
    init, spawn = result.findings
    assert "world_size=4" in init.message and "tcp://" in init.message and "rank=" not in init.message
    assert "torchrun" in spawn.message
    assert all(f.safety is Safety.MANUAL for f in result.findings)
    assert not result.changed


def test_tm101_lint_is_quiet_on_single_gpu_and_env_init():
    single = run("""
        import torch
        if __name__ == "__main__":
            main()
        """, "TM101", mode="lint")
    env_init = run("""
        import torch.distributed as dist
        dist.init_process_group("nccl", init_method="env://")
        """, "TM101", mode="lint")
    assert found(single) == [] and found(env_init) == []


def test_tm101_skips_library_modules_but_not_scripts():
    library = run("""
        import torch
        torch.backends.cudnn.benchmark = True
        def build():
            return torch.nn.Linear(2, 2)
        """, "TM101")
    script = run("""
        import torch
        def train():
            pass
        train()
        """, "TM101")
    assert not library.changed
    assert script.new_source.splitlines()[1:3] == ["import torchmigrate.runtime as tm", "tm.setup()"]
    assert script.new_source.rstrip().endswith("train()\ntm.cleanup()")


@pytest.mark.parametrize("exit_line", ["sys.exit(main())", "raise SystemExit(main())"])
def test_tm101_cleanup_runs_when_main_exits(tmp_path, exit_line):
    """The try/finally really runs tm.cleanup() (and so destroys the process group)."""
    source = f"""
        import sys
        import torch
        import torchmigrate.runtime
        def main():
            return 3
        if __name__ == "__main__":
            {exit_line}
        """
    out = run(source, "TM101").new_source
    probe = tmp_path / "probe.py"
    probe.write_text(out.replace("import torchmigrate.runtime as tm\n",
                                 "import torchmigrate.runtime as tm\n"
                                 "tm.cleanup = lambda: print('cleaned up')\n"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == "cleaned up"


def test_tm101_legacy_launch_script_moves_onto_the_runtime_in_ddp_only():
    """A torch.distributed.launch script: `ddp` (all launch and model rules) leaves nothing that
    needs CUDA or a process group in a one-process run; `lint` reports none of it."""
    source = (FIXTURES / "TM101" / "legacy_lint.in.py").read_text().split("\n", 1)[1]
    codes = (*CODES, "TM301", "TM302")
    migrated = run(source, *codes).new_source
    for gone in ("set_device", "init_process_group", "device_ids", "dist.get_rank", "dist.get_world_size",
                 "dist.barrier", "destroy_process_group", 'torch.device("cuda"'):
        assert gone not in migrated, gone
    for there in ("tm.setup()", "device = tm.device()", "model = tm.wrap_model(Net().to(device))",
                  "if tm.rank() == 0:", "tm.cleanup()"):
        assert there in migrated, there
    assert run(migrated, *codes).new_source == migrated
    linted = run(source, "TM101", "TM103", "TM301", "TM302", mode="lint", fix=True)
    assert linted.new_source == source and not found(linted)


def test_tm101_legacy_init_with_its_own_ranks_is_reported_not_half_migrated():
    result = run((FIXTURES / "TM101" / "legacy_own_ranks.in.py").read_text(), *CODES, "TM301")
    assert found(result, "TM101") == [("TM101", 9)]
    assert "\n        tm.setup()" not in result.new_source and "print(dist.get_rank()" in result.new_source


# --- TM102 -----------------------------------------------------------------------------------

def _parse_with(source: str, argv, env):
    namespace = {}
    saved = dict(os.environ)
    try:
        os.environ.pop("LOCAL_RANK", None)
        os.environ.update(env)
        exec(compile(source + "\nresult = parser.parse_args(argv)\n", "t.py", "exec"),
             {"argv": argv, **namespace}, namespace)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return namespace["result"]


@pytest.mark.parametrize("original", [
    'parser.add_argument("--local_rank", type=int, default=-1)',
    'parser.add_argument("--local_rank", type=int)',
    'parser.add_argument("--local-rank", type=int, default=-1)',
    'parser.add_argument("--local_rank", dest="local_rank", type=int, required=True)',
])
def test_tm102_migrated_option_works_with_every_launcher(original):
    source = f"""
        # migrated for torch
        import argparse
        parser = argparse.ArgumentParser()
        {original}
        """
    out = run(source, "TM102").new_source
    assert "import os" in out
    fallback = None if "default" not in original else -1
    # python train.py
    if "required" not in original:
        assert _parse_with(out, [], {}).local_rank == fallback
    # torchrun: no argument, LOCAL_RANK in the environment
    assert _parse_with(out, [], {"LOCAL_RANK": "3"}).local_rank == 3
    # torch.distributed.launch, old and new spelling
    assert _parse_with(out, ["--local_rank=1"], {"LOCAL_RANK": "1"}).local_rank == 1
    assert _parse_with(out, ["--local-rank=2"], {"LOCAL_RANK": "2"}).local_rank == 2


def test_tm102_fires_in_lint_on_any_file():
    result = run((FIXTURES / "TM102" / "basic.in.py").read_text(), "TM102", mode="lint")
    assert found(result) == [("TM102", 7)]
    assert result.findings[0].safety is Safety.SAFE and not result.changed


# --- TM103 -----------------------------------------------------------------------------------

def test_tm103_lint_only_in_distributed_files():
    single = run("""
        import torch
        device = torch.device("cuda:0")
        x = torch.ones(1).cuda()
        """, "TM103", mode="lint")
    assert found(single) == []
    pinned = run("""
        import os, torch
        import torch.distributed as dist
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        x = torch.ones(1).cuda()
        y = torch.ones(1).to("cuda:0")
        z = torch.ones(1).cuda(0)
        torch.cuda.set_device(0)
        """, "TM103", mode="lint")
    assert found(pinned) == [("TM103", 6), ("TM103", 7), ("TM103", 8)]


def test_tm103_string_device_kept_when_compared():
    result = run("""
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        amp = device == "cuda"
        x = torch.ones(1).to(device)
        """, "TM103")
    assert not result.changed and found(result) == []


def test_tm103_cuda_visible_devices_kept_per_process():
    migrated = run("""
        import os, torch
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
        """, "TM103")
    assert [f.safety for f in migrated.findings] == [Safety.SAFE]
    assert "tm.visible_devices(args.gpus)\n" in migrated.new_source and "TODO" not in migrated.new_source


_BATCH_SCRIPT = """
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
    net = nn.Linear(4, 2)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for epoch in range(2):
        for i, data in enumerate(loader, 0):
            inputs, labels = data
            optimizer.zero_grad()
            loss = criterion(net(inputs), labels)
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        for images, labels in loader:
            _, predicted = torch.max(net(images).data, 1)
            correct = (predicted == labels).sum()
    """


@pytest.mark.parametrize("codes, ok", [(("TM101", "TM301"), False), (("TM101", "TM103", "TM301"), True)])
def test_tm103_batches_follow_the_wrapped_model(tmp_path, codes, ok):
    """tm.wrap_model moves the model to tm.device(); in a file that never moves anything the
    batches must follow. Without a GPU, a "meta" tm.device() shows the mismatch just the same."""
    out = run(_BATCH_SCRIPT, *codes).new_source
    assert ("inputs, labels = tm.to_device(inputs, labels)" in out) is ok
    probe = tmp_path / "probe.py"
    probe.write_text(out.replace("import torchmigrate.runtime as tm\n",
                                 "import torchmigrate.runtime as tm\n"
                                 "tm.device = lambda: torch.device('meta')\n"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode == 0) is ok, proc.stderr[-2000:]
    if not ok:
        assert "device" in proc.stderr


def test_tm103_batch_moves_only_in_files_that_never_move_anything():
    moved = _BATCH_SCRIPT.replace("inputs, labels = data", "inputs, labels = data[0].to(dev), data[1].to(dev)")
    assert "to(tm.device())" not in run(moved, "TM101", "TM103", "TM301").new_source
    # no TM301 (the model stays where it is): nothing to follow
    assert "to(tm.device())" not in run(_BATCH_SCRIPT, "TM101", "TM103").new_source


def test_tm103_int_device_followed_through_calls():
    result = run((FIXTURES / "TM103" / "int_device_variable.in.py").read_text(), "TM103")
    assert found(result) == [("TM103", 28)] and result.findings[0].safety is Safety.SAFE
    assert "device = tm.device()  # shorthand for cuda:0" in result.new_source
    mixed = run((FIXTURES / "TM103" / "int_device_mixed.in.py").read_text(), "TM103")
    assert [f.safety for f in mixed.findings if f.line == 3] == [Safety.MANUAL]


# --- TM104 -----------------------------------------------------------------------------------

def test_tm104_reports_in_lint_without_changing_text():
    result = run((FIXTURES / "TM104" / "rank_guards.in.py").read_text(), "TM104", mode="lint")
    assert found(result) == [("TM104", n) for n in (8, 11, 14, 16, 18, 22)]
    assert not result.changed


def test_tm104_symmetric_patterns_are_not_reported():
    result = run((FIXTURES / "TM104" / "symmetric_barrier.in.py").read_text(), "TM104", mode="lint")
    assert found(result) == []


def test_tm104_ddp_forward_uses_trained_models_when_migrating():
    source = """
        import torch
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if is_main_process():
            model(torch.ones(2))
        """
    assert found(run(source, "TM104")) == [("TM104", 5)]
    assert found(run(source, "TM104", mode="lint")) == []  # not a DDP model in this file


# --- TM105 -----------------------------------------------------------------------------------

def test_tm105_is_unsafe_and_only_applied_with_unsafe_fixes():
    source = (FIXTURES / "TM105" / "unsafe_fix.in.py").read_text()
    safe = run(source, "TM105", mode="lint", fix=True)
    assert not safe.changed and {f.safety for f in safe.findings} == {Safety.UNSAFE}
    unsafe = run(source, "TM105", mode="lint", unsafe=True)
    assert unsafe.changed and unsafe.new_source.count("tm.seed_everything(") == 2


DISTRIBUTED = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"


def test_tm105_one_finding_per_seed_and_scope():
    """Seeding lines of one scope with the same seed are one finding, even when an import or an
    `if cuda:` separates them (in a program that is distributed already; a migration keeps the
    seeding and gives each rank its streams where training starts); the unsafe fix still
    rewrites every one of them."""
    source = DISTRIBUTED + (FIXTURES / "TM105" / "cuda_seed_in_branch.in.py").read_text()
    assert found(run(source, "TM105", mode="lint")) == [("TM105", 9), ("TM105", 16)]
    # a migration keeps the seeding (no training loop here: nothing to place), DDP or not
    assert found(run(source, "TM105")) == found(run(source[len(DISTRIBUTED):], "TM105")) == []
    between = run(DISTRIBUTED + (FIXTURES / "TM105" / "import_between_seeds.in.py").read_text(), "TM105",
                  mode="lint")
    assert found(between) == [("TM105", 7)]
    lint = run((FIXTURES / "TM105" / "cuda_seed_in_branch_lint.in.py").read_text(), "TM105", mode="lint",
               unsafe=True)
    assert lint.new_source.count("tm.seed_everything(7, per_rank=True)") == 2
    assert "manual_seed" not in lint.new_source and "random.seed" not in lint.new_source


def test_tm105_lint_needs_a_distributed_file():
    assert found(run("import torch\ntorch.manual_seed(0)\n", "TM105", mode="lint")) == []
    assert found(run(DISTRIBUTED + "import torch\ntorch.manual_seed(0)\n", "TM105", mode="lint")) == [("TM105", 4)]


def test_tm105_places_the_streams_once_per_training_loop():
    """A migration inserts `tm.seed_per_rank()` before the outermost training loop, whatever
    its spelling (for over a loader, while over steps, a trainer method), and never twice."""
    source = """
        import torch
        def fit(model, loader, steps):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = 0
            while step < steps:
                for batch in loader:
                    opt.zero_grad()
                    model(batch).sum().backward()
                    opt.step()
                    step += 1
        def pretrain(model, data):
            opt = torch.optim.Adam(model.parameters())
            for x in data:
                opt.zero_grad()
                model(x).mean().backward()
                opt.step()
        """
    result = run(source, "TM105")
    assert result.new_source.count("tm.seed_per_rank()") == 2
    assert [f.safety for f in result.findings] == [Safety.SAFE, Safety.SAFE]
    lines = result.new_source.splitlines()
    assert lines[lines.index("    while step < steps:") - 1] == "    tm.seed_per_rank()"
    assert run(result.new_source, "TM105").new_source == result.new_source


# --- together --------------------------------------------------------------------------------

def test_rules_compose_on_a_guarded_script():
    result = run("""
        import argparse
        import random
        import torch

        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, default=0)

        def main(args):
            random.seed(0)
            torch.manual_seed(0)
            torch.cuda.set_device(args.local_rank)
            model = torch.nn.Linear(2, 2).cuda(args.local_rank)

        if __name__ == "__main__":
            main(parser.parse_args())
        """)
    out = result.new_source
    assert "tm.setup()" in out and "tm.cleanup()" in out
    assert "set_device" not in out and ".to(tm.device())" in out
    assert '"--local-rank", "--local_rank"' in out and "import os" in out
    assert "TM105" not in out and "random.seed(0)" in out  # no training loop here: the seeding stays as it is
    assert run(out).new_source == out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize("mode", ["ddp", "lint"])
def test_scripts_compile_and_are_idempotent(script, mode):
    source = script.read_text(encoding="utf-8")
    first = process_source(source, str(script), Options(mode=mode, fix=True, unsafe_fixes=True),
                           [get_rule(c) for c in CODES])
    compile(first.new_source, str(script), "exec")
    again = process_source(first.new_source, str(script), Options(mode=mode, fix=True, unsafe_fixes=True),
                           [get_rule(c) for c in CODES])
    assert again.new_source == first.new_source

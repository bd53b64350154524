"""TM505 main-process-first: what the fixtures (fixtures/TM505) cannot show: lint, how it works
with TM501/TM504 and TM104, and a migrated download that runs on two ranks."""

from __future__ import annotations

import textwrap

from torchmigrate.engine.process import process_source
from torchmigrate.rule import Options
from torchmigrate.rules import get_rule, select

DDP = Options(mode="ddp")
LINT = Options(mode="lint")

CACHE = """
    import os
    import torch
    def weights(dataset, cache):
        if not os.path.exists(cache):
            torch.save(dataset.stats(), cache)
        return torch.load(cache, map_location="cpu")
    """


def run(source: str, options: Options = DDP, codes=("TM505",)):
    rules = [get_rule(c) for c in codes] if codes else select(command=options.mode)
    return process_source(textwrap.dedent(source).lstrip("\n"), "train.py", options, rules)


def test_lint_reports_only_distributed_files_and_fixes_them():
    plain = "import torchvision\nds = torchvision.datasets.MNIST('data', download=True)\n"
    assert not run(plain, LINT).findings
    distributed = "import torch.distributed as dist\ndist.init_process_group('gloo')\n" + plain
    (finding,) = run(distributed, LINT).findings
    assert (finding.code, finding.line, finding.safety.value) == ("TM505", 4, "safe")
    fixed = run(distributed, Options(mode="lint", fix=True)).new_source
    assert "with tm.main_process_first():\n    ds = torchvision.datasets.MNIST('data', download=True)\n" in fixed


def test_a_cache_under_main_process_first_needs_no_barrier_before_its_load():
    """TM501 asks for a barrier between a main-process-only save and a load of the same file;
    main_process_first's barrier is that barrier."""
    with_tm505 = run(CACHE, codes=("TM501", "TM505"))
    assert "with tm.main_process_first():" in with_tm505.new_source
    assert "barrier" not in with_tm505.new_source
    assert [f.code for f in with_tm505.findings if not f.applied] == []
    without = run(CACHE, codes=("TM501",))  # TM505 off: a barrier before the load, which every rank runs
    assert "    tm.barrier()\n    return torch.load(cache" in without.new_source
    assert [f.code for f in without.findings if not f.applied] == []


def test_a_cache_written_under_main_process_first_gets_no_rank_guard():
    source = """
        import os
        import pickle
        import torch
        def vocab(words, path):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    return pickle.load(f)
            table = sorted(set(words))
            with open(path, "wb") as f:
                pickle.dump(table, f)
            return table
        """
    out = run(source, codes=("TM504", "TM505")).new_source
    assert "is_main" not in out and out.count("with tm.main_process_first():") == 1
    # without TM505 the write is guarded once (not once for the `with` and again for the dump)
    assert run(source, codes=("TM504",)).new_source.count("if tm.is_main():") == 1


def test_main_process_first_under_a_rank_guard_is_a_hang():
    source = """
        import torch
        import torchmigrate.runtime as tm
        tm.setup()
        if tm.is_main():
            with tm.main_process_first():
                x = 1
        """
    assert "TM104" in {f.code for f in run(source, LINT, codes=("TM104",)).findings}


def test_migration_is_idempotent_with_every_rule():
    source = textwrap.dedent(CACHE) + "import torchvision\nds = torchvision.datasets.MNIST('data', download=True)\n"
    once = run(source, codes=()).new_source
    assert once.count("with tm.main_process_first():") == 2
    assert run(once, codes=()).new_source == once

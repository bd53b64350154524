"""TM301-TM306 beyond the fixtures: reported findings, lint behaviour, shared facts, analysis
extensions, robustness, and one real 2-rank run of a migrated script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import libcst as cst
import pytest

from conftest import FIXTURES
from torchmigrate import analysis
from torchmigrate.engine.process import process_source, run_rules
from torchmigrate.finding import Safety
from torchmigrate.rule import Options
from torchmigrate.rules import get_rule, select
from torchmigrate.rules.model.plan import wrapped_models

MODEL_CODES = ("TM301", "TM302", "TM303", "TM304", "TM305", "TM306")


def model_rules(*codes):
    return [get_rule(c) for c in (codes or MODEL_CODES)]


def run(source, mode="ddp", codes=(), **options):
    opts = Options(mode=mode, fix=mode == "lint", **options)
    return process_source(textwrap.dedent(source).lstrip(), "t.py", opts, model_rules(*codes))


def findings(result, code=None):
    return [f for f in result.findings if code is None or f.code == code]


def context(source, mode="ddp", codes=()):
    opts = Options(mode=mode)
    module = cst.parse_module(textwrap.dedent(source).lstrip())
    return run_rules(module, "t.py", opts, model_rules(*codes))


# --- analysis: which models an optimizer trains ------------------------------------------

@pytest.mark.parametrize("source,expected", [
    ("opt = torch.optim.SGD(params=model.parameters(), lr=0.1)", ["model"]),
    ("params = [p for p in net.parameters() if p.requires_grad]\nopt = torch.optim.SGD(params, lr=0.1)", ["net"]),
    ("opt = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()))", ["enc", "dec"]),
    ("opt = torch.optim.AdamW([{'params': model.backbone.parameters(), 'lr': 1e-4},\n"
     "                         {'params': model.head.parameters()}])", ["model"]),
    ("optimizer = getattr(torch.optim, args.optim)(model.parameters(), lr=args.lr)", ["model"]),
    ("optimizer = model.configure_optimizers(0.1, 6e-4)", ["model"]),
    ("optimizer = create_optimizer_v2(net, 'adamw', lr=1e-3)", ["net"]),
    ("optimizer = build_optimizer(cfg, model)", ["model"]),
    ("scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 10)", []),
    ("ema = torch.optim.swa_utils.AveragedModel(model)", []),
])
def test_trained_models(source, expected):
    ctx = context("import torch\n" + source + "\n")
    assert analysis.trained_models(ctx) == expected


def test_helper_optimizer_maps_to_caller():
    ctx = context("""
        import torch
        def make(net, cfg):
            groups = []
            for name, p in net.named_parameters():
                groups.append({"params": [p], "weight_decay": 0.0 if "bias" in name else cfg.wd})
            return torch.optim.AdamW(groups, lr=cfg.lr)
        def main():
            model = Net()
            optimizer = make(model, cfg)
    """)
    opts = analysis.optimizers(ctx)
    site = [o for o in opts if o.via is not None]
    assert len(site) == 1 and site[0].models == ("model",) and site[0].target == "optimizer"
    assert site[0].via.models == ("net",)


def test_wrapped_models_fact():
    ctx = context("""
        import torch
        netG, netD = G(), D()
        teacher = T().eval()
        optG = torch.optim.Adam(netG.parameters())
        optD = torch.optim.Adam(netD.parameters())
    """)
    assert wrapped_models(ctx) == ["netG", "netD"]
    assert ctx.facts["wrapped_models"] == ["netG", "netD"]


def test_unwrapped_attrs_fact():
    ctx = context("""
        import torch
        model = Net()
        optimizer = torch.optim.Adam(model.parameters())
        torch.save(model.state_dict(), "m.pt")
    """)
    wrapped_models(ctx)
    attrs = ctx.facts["unwrapped_attrs"]
    assert [a.attr.value for a in attrs] == ["state_dict"]


# --- what gets reported -------------------------------------------------------------------

def test_one_wrap_per_model_even_with_several_optimizers():
    result = run("""
        import torch
        model = Net()
        opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, opt1)
        opt2 = torch.optim.SGD(model.head.parameters(), lr=0.01)
    """, codes=("TM301",))
    assert result.new_source.count("tm.wrap_model(") == 1


def test_reports_are_positioned_and_manual_notes_become_todos():
    result = run("""
        import torch
        model = Net().cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(train_ds, batch_size=32)
    """, codes=("TM301", "TM305"))
    (wrap,) = findings(result, "TM301")
    (note,) = findings(result, "TM305")
    assert (wrap.line, wrap.safety, wrap.applied) == (3, Safety.SAFE, True)
    assert (note.line, note.safety, note.applied) == (3, Safety.MANUAL, False)
    assert "# TODO(torchmigrate): TM305" in result.new_source


def test_lint_reports_without_rewriting_unless_fix():
    source = """
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl")
        model = DDP(Net().cuda(), device_ids=[0])
        model.generate(x)
    """
    result = process_source(textwrap.dedent(source).lstrip(), "t.py", Options(mode="lint"), model_rules())
    assert {f.code for f in result.findings} >= {"TM301", "TM302"}
    assert result.new_source == textwrap.dedent(source).lstrip()
    fixed = run(source, mode="lint")
    assert "device_ids=[tm.local_rank()]" in fixed.new_source
    assert "tm.unwrap(model).generate(x)" in fixed.new_source


def test_lint_reports_state_dict_saved_from_the_scripts_own_ddp_only():
    """`torch.save(model.state_dict())` of a DDP the script built, also as a value of the saved
    dict; not an alias of `model.module`, not `model.module.state_dict()`, not a state dict that
    is not saved, not a model wrapped only behind a flag. Reported, never rewritten by lint."""
    source = (FIXTURES / "TM302" / "lint_user_ddp_state_dict.in.py").read_text()
    result = process_source(source, "t.py", Options(mode="lint", fix=True), model_rules())
    assert [(f.code, f.line) for f in findings(result, "TM302")] == [("TM302", 19), ("TM302", 20)]
    assert all(f.safety is Safety.MANUAL and "module." in f.message for f in findings(result, "TM302"))
    assert result.new_source == source


def test_lint_sync_bn_is_an_unsafe_fix_for_user_ddp_only():
    source = """
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl")
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)).cuda()
        model = DDP(model, device_ids=[local_rank])
    """
    result = run(source, mode="lint", codes=("TM304",))
    (f,) = findings(result, "TM304")
    assert f.safety is Safety.UNSAFE and f.edits and not f.applied
    result = run(source, mode="lint", codes=("TM304",), unsafe_fixes=True)
    assert "model = tm.sync_batchnorm(model)\nmodel = DDP(" in result.new_source  # SyncBN on CUDA only
    # torchmigrate's own wrap lints clean; `ddp` without --sync-bn leaves it alone too
    migrated = """
        import torch.nn as nn
        import torchmigrate.runtime as tm
        model = tm.wrap_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)))
    """
    assert not findings(run(migrated, mode="lint"))
    assert not findings(run(migrated, mode="ddp"))


def test_advice_goes_to_lint_for_user_ddp_and_to_ddp_for_new_wraps():
    user = """
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
            def forward(self, x):
                return self.fc(x)
        dist.init_process_group("gloo")
        model = DDP(MLP(), find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(train_ds, batch_size=32, sampler=sampler)
    """
    ddp = run(user)
    assert ddp.new_source == textwrap.dedent(user).lstrip() and not ddp.findings
    lint = {f.code for f in run(user, mode="lint").findings}
    assert lint == {"TM303", "TM305"}
    single = """
        import torch
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(train_ds, batch_size=32)
    """
    assert {f.code for f in run(single).findings} == {"TM301", "TM305"}
    full_batch = """
        import torch
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    assert {f.code for f in run(full_batch).findings} == {"TM301"}, "no DataLoader: the batch does not grow"
    assert not run(single, mode="lint").findings


def test_lint_dataparallel_fires_in_any_file_but_conversion_rules_do_not():
    result = process_source("import torch.nn as nn\nmodel = nn.DataParallel(Net())\n"
                            "opt = torch.optim.SGD(model.parameters())\n", "t.py", Options(mode="lint"),
                            model_rules())
    assert [f.code for f in result.findings if f.safety is not Safety.MANUAL] == ["TM306"]


def test_amp_command_does_not_run_model_rules():
    assert not [r for r in select(command="amp") if r.code in MODEL_CODES]
    assert {r.code for r in select(command="ddp")} >= set(MODEL_CODES)


def test_sync_bn_counts_as_its_own_change():
    result = run("""
        import torch
        import torch.nn as nn
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """, codes=("TM301", "TM304"), sync_bn=True)
    assert result.new_source.count("tm.wrap_model(model, sync_bn=True)") == 1
    assert [f.applied for f in findings(result, "TM304")] == [True]


def test_dataparallel_gets_exactly_one_wrap_in_every_rule_combination():
    source = """
        import torch
        import torch.nn as nn
        model = Net()
        if torch.cuda.device_count() > 1:
            model = nn.DataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.save(model.module.state_dict(), "m.pt")
    """
    for codes in [("TM306",), ("TM301", "TM306"), ("TM302", "TM306"), MODEL_CODES]:
        out = run(source, codes=codes).new_source
        assert out.count("tm.wrap_model(") == 1, codes
        assert "DataParallel(" not in out and "model.module" not in out, codes
    # TM301 alone never wraps a DataParallel in DDP
    out = run(source, codes=("TM301",)).new_source
    assert "tm.wrap_model" not in out


def test_existing_wrap_of_any_kind_blocks_a_new_one():
    for wrap in ("DDP(model, device_ids=[rank])", "FSDP(model)", "tm.wrap_model(model)"):
        out = run(f"""
            import torch
            import torchmigrate.runtime as tm
            from torch.nn.parallel import DistributedDataParallel as DDP
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model = {wrap}
        """, codes=("TM301",)).new_source
        assert out.count("model = ") == 2, wrap


def test_config_roots_are_not_wrapped():
    result = run("""
        import torch
        args = parser.parse_args()
        optimizer = torch.optim.SGD(args.model.parameters(), lr=0.1)
    """, codes=("TM301",))
    assert "wrap_model(args" not in result.new_source
    assert findings(result, "TM301")[0].safety is Safety.MANUAL


def test_plan_failure_is_reported_not_raised(monkeypatch):
    from torchmigrate.rules.model import plan as model_plan_module

    monkeypatch.delenv("TORCHMIGRATE_DEBUG", raising=False)

    def boom(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(model_plan_module.Plan, "_plan_new", boom)
    source = "import torch\nmodel = Net()\noptimizer = torch.optim.SGD(model.parameters())\n"
    result = process_source(source, "t.py", Options(mode="ddp"), model_rules())
    (f,) = result.findings
    assert f.code == "TM301" and f.safety is Safety.MANUAL and "boom" in f.message
    compile(result.new_source, "t.py", "exec")


def test_fixture_scripts_migrate_idempotently():
    """Every example script, model rules only: output compiles and a second run is a no-op."""
    from conftest import FIXTURES

    opts = Options(mode="ddp")
    for path in sorted((FIXTURES / "scripts").glob("*.py")):
        first = process_source(path.read_text(), str(path), opts, model_rules()).new_source
        compile(first, str(path), "exec")
        assert process_source(first, str(path), opts, model_rules()).new_source == first, path.name


# --- a real 2-rank run ----------------------------------------------------------------------

SCRIPT = """
import os
import torch
import torch.nn as nn
import torchmigrate.runtime as tm

tm.setup()
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.backbone(x))

    def freeze_backbone(self):
        for p in self.backbone.parameters():
            p.requires_grad = False


model = Net()
if torch.cuda.device_count() > 1:
    model = nn.DataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(tm.rank())
for step in range(6):
    if step == 3:
        model.module.freeze_backbone()
    x = torch.randn(16, 8, generator=g)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
torch.save(model.module.state_dict(), os.path.join(os.environ["OUT_DIR"], f"rank{tm.rank()}.pt"))
tm.cleanup()
"""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_migrated_dataparallel_script_trains_under_torchrun(tmp_path):
    """DataParallel + `.module` + parameters frozen after the wrap: the migrated script runs on
    2 gloo ranks (find_unused_parameters=True is what keeps DDP from failing) and ends with the
    same parameters on both ranks and no `module.` prefix in the saved keys."""
    import torch

    out = run(SCRIPT, codes=MODEL_CODES).new_source
    assert "find_unused_parameters=True" in out and ".module" not in out
    script = tmp_path / "train.py"
    script.write_text(out)
    env = dict(os.environ, OUT_DIR=str(tmp_path), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["torchrun", "--standalone", "--nproc-per-node=2", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert list(a) == list(b) and not any(k.startswith("module.") for k in a)
    # parameters agree; BatchNorm running stats are per rank until DDP's next forward broadcast
    params = [k for k in a if not k.startswith("backbone.1.") or k.endswith(("weight", "bias"))]
    assert all(torch.equal(a[k], b[k]) for k in params)
    single = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]

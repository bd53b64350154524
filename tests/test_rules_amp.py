"""Mixed-precision rules (TM401-TM410, TM503, TM604) beyond the per-rule fixtures: how the rules
work together on whole scripts, the `--amp` policy options, the TM406/TM410 hand-over, and the
promises of issue 5 (no apex import left, one rule per edited node, idempotent output)."""

from __future__ import annotations

import ast
import re
import textwrap
from collections import defaultdict

import libcst as cst
import pytest

from conftest import FIXTURES
from torchmigrate.engine.process import process_source
from torchmigrate.finding import EditKind
from torchmigrate.rule import Options
from torchmigrate.rules import get_rule, select
from torchmigrate.rules.amp.base import convertible_call

SCRIPTS = FIXTURES / "scripts"
ALL_SCRIPTS = sorted(SCRIPTS.glob("*.py"))
AMP_FAMILY = {"TM401", "TM402", "TM403", "TM404", "TM405", "TM406", "TM407", "TM408", "TM409", "TM410",
              "TM503", "TM604"}


def run(source: str, mode: str = "amp", amp: str = "auto", codes=None, path: str = "train.py"):
    rules = [get_rule(c) for c in codes] if codes else select(command=mode)
    options = Options(mode=mode, amp=amp, fix=mode == "lint")
    return process_source(textwrap.dedent(source), path, options, rules)


def code_only(source: str) -> str:
    """The source without comment lines (TODO messages mention `tm.autocast` too)."""
    return "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))


def apex_imports(source: str):
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "apex"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "apex":
            out.append(node.module)
    return out


@pytest.mark.parametrize("mode", ["amp", "ddp"])
@pytest.mark.parametrize("script", ALL_SCRIPTS, ids=lambda p: p.name)
def test_migrated_scripts_compile_are_idempotent_and_apex_free(script, mode):
    source = script.read_text(encoding="utf-8")
    result = run(source, mode)
    compile(result.new_source, str(script), "exec")
    assert run(result.new_source, mode).new_source == result.new_source, "second run must be a no-op"
    assert not apex_imports(result.new_source)


@pytest.mark.parametrize("mode", ["amp", "ddp"])
def test_each_call_is_edited_by_one_rule(mode):
    """TM406/TM410 (and every AMP rule) never both rewrite one node."""
    sources = [p.read_text(encoding="utf-8") for p in ALL_SCRIPTS]
    sources += [p.read_text(encoding="utf-8") for code in sorted(AMP_FAMILY)
                for p in sorted((FIXTURES / code).glob("*.in.py"))]
    for source in sources:
        result = run(source, mode)
        owners = defaultdict(set)
        for f in result.findings:
            if not f.applied:
                continue
            for edit in f.edits:
                if edit.kind is EditKind.REPLACE and isinstance(edit.target, (cst.Call, cst.ImportFrom, cst.Import)):
                    owners[edit.target].add(f.code)
        clashes = {cst.Module([]).code_for_node(n): c for n, c in owners.items() if len(c) > 1 and c & AMP_FAMILY}
        assert not clashes, clashes


CUDA_AMP = (SCRIPTS / "cuda_amp_accum.py").read_text(encoding="utf-8")
APEX = (SCRIPTS / "apex_amp.py").read_text(encoding="utf-8")
PLAIN = (SCRIPTS / "toplevel_classifier.py").read_text(encoding="utf-8")


def test_migration_hands_existing_amp_to_the_runtime():
    out = run(CUDA_AMP, "amp").new_source
    assert "scaler = tm.GradScaler(enabled=use_amp)" in out
    assert "with tm.autocast(enabled=use_amp):" in out
    assert "from torch.cuda.amp" not in out and "from torch.amp" not in out  # the imports went with the calls
    codes = {f.code for f in run(CUDA_AMP, "amp").findings if f.applied}
    assert {"TM406", "TM410"} <= codes


def test_lint_still_reports_torch_cuda_amp():
    result = run(CUDA_AMP, "lint")
    reported = [f for f in result.findings if f.code == "TM406"]
    assert len(reported) >= 3  # the import, GradScaler(...) and autocast(...)
    assert not [f for f in result.findings if f.code == "TM410"]
    assert 'GradScaler("cuda", enabled=use_amp)' in result.new_source  # `lint --fix` modernises


def test_amp_off_leaves_mixed_precision_alone():
    for source in (PLAIN, CUDA_AMP):
        result = run(source, "amp", amp="off")
        assert "tm.autocast" not in result.new_source and "tm.GradScaler" not in result.new_source
        assert not [f for f in result.findings if f.code in ("TM401", "TM402", "TM403", "TM405", "TM410", "TM503")]
    # torch.cuda.amp is still modernised (TM406), and apex still has to go (TM407)
    assert 'autocast("cuda", enabled=use_amp)' in run(CUDA_AMP, "amp", amp="off").new_source
    off = run(APEX, "amp", amp="off").new_source
    assert not apex_imports(off) and "scaler = tm.GradScaler(enabled=False)" in off and "tm.autocast" not in off


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_forced_dtype_reaches_autocast_and_scaler(amp):
    for source in (PLAIN, CUDA_AMP, APEX):
        out = run(source, "ddp", amp=amp).new_source
        calls = re.findall(r"tm\.(?:autocast|GradScaler)\([^)]*\)", out)
        assert calls
        assert all(f'dtype="{amp}"' in c for c in calls), calls


def test_auto_policy_passes_no_dtype():
    out = run(PLAIN, "ddp").new_source
    assert "scaler = tm.GradScaler()" in out and "with tm.autocast():" in out


def test_apex_script_becomes_torch_amp():
    result = run(APEX, "amp")
    out = result.new_source
    assert not apex_imports(out)
    assert "amp.initialize" not in out and "amp.scale_loss" not in out
    assert "scaler.scale(loss).backward()" in out
    assert "scaler.unscale_(optimizer)\n        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)" in out
    assert '"amp": scaler.state_dict()' in out and 'scaler.load_state_dict(checkpoint["amp"])' in out
    assert "with tm.autocast():" in out
    assert out.count("scaler.update()") == 1
    # the report names what apex options were dropped
    assert any("opt_level" in f.message for f in result.findings if f.code == "TM407")


def test_accumulation_under_ddp():
    result = run(CUDA_AMP, "ddp")
    out = result.new_source
    assert "with tm.no_sync(model, sync=(i + 1) % accum_steps == 0):" in out
    no_sync = out.index("tm.no_sync"), out.index("with tm.autocast"), out.index("scaler.scale(loss).backward()")
    assert no_sync[0] < no_sync[1] < no_sync[2], "forward and backward inside no_sync"
    # the step condition is not changed; the partial last window is reported instead
    assert "        if (i + 1) % accum_steps == 0:\n" in out
    assert any(f.code == "TM404" and "partial" in f.message and not f.applied for f in result.findings)
    # no DDP no_sync in single-GPU AMP migrations
    assert "no_sync" not in run(CUDA_AMP, "amp").new_source


def test_manual_cases_leave_one_todo_each():
    source = """
    import torch
    model = Net().cuda().half()
    optimizer = torch.optim.LBFGS(model.parameters())
    for x, y in loader:
        def closure():
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss
        optimizer.step(closure)
    """
    once = run(source, "amp").new_source
    assert once.count("TODO(torchmigrate): TM402") == 2  # .half() and the closure
    assert "tm.autocast" not in code_only(once) and "GradScaler" not in code_only(once)
    assert run(once, "amp").new_source == once


def test_eval_loops_get_autocast_without_scaler():
    out = run((SCRIPTS / "helper_loaders.py").read_text(encoding="utf-8"), "amp").new_source
    evaluate = out[out.index("def evaluate"):]
    evaluate = evaluate[:evaluate.index("\n\n\n")]
    assert "with tm.autocast():\n                output = model(data)" in evaluate
    assert "scaler" not in evaluate


def test_bce_blocks_autocast_and_is_reported():
    result = run((SCRIPTS / "binary_bce_steps.py").read_text(encoding="utf-8"), "amp")
    assert any(f.code == "TM409" and "BCEWithLogitsLoss" in f.message for f in result.findings)
    assert "tm.autocast" not in code_only(result.new_source)  # neither the training step nor the evaluation
    assert "GradScaler" not in code_only(result.new_source)  # no loss scaling without autocast
    assert ".backward()" in result.new_source and "scaler" not in code_only(result.new_source)


def test_dataparallel_forward_gets_autocast_in_amp_mode_only():
    source = (SCRIPTS / "dataparallel.py").read_text(encoding="utf-8")
    amp = run(source, "amp").new_source
    assert "    def forward(self, x):\n        with tm.autocast():\n            return self.classifier(self.embed(x))" in amp
    assert not [f for f in run(source, "ddp").findings if f.code == "TM405"]


def test_dataparallel_forward_autocast_brings_its_scaler_in_the_same_run():
    """TM405 puts the forward under autocast although BCELoss keeps the step out of a new
    autocast region; the forward then runs in fp16 on CUDA, so the loss is scaled: in this run,
    not only in the next (found by the fuzzing in test_robustness.py)."""
    source = """
        import torch
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 1)

            def forward(self, x):
                return torch.sigmoid(self.fc(x))


        model = nn.DataParallel(Net().cuda())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in loader:
            loss = nn.BCELoss()(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        """
    once = run(source, "amp").new_source
    assert "with tm.autocast():" in once and "scaler.scale(loss).backward()" in once
    assert run(once, "amp").new_source == once


def test_policy_keeps_calls_it_cannot_express():
    call = cst.parse_expression("autocast(cache_enabled=False)")
    assert not convertible_call(call, "torch.cuda.amp.autocast")
    assert convertible_call(cst.parse_expression("autocast(True, torch.float16)"), "torch.cuda.amp.autocast")
    assert not convertible_call(cst.parse_expression('autocast("cuda", torch.float16, True, False)'), "torch.autocast")


def test_frameworks_that_own_precision_are_left_alone():
    source = """
    import torch
    from accelerate import Accelerator
    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    """
    result = run(source, "amp")
    assert not [f for f in result.findings if f.code in AMP_FAMILY]


def test_cli_amp_command_rewrites_apex(tmp_path, run_cli):
    path = tmp_path / "train.py"
    path.write_text(APEX, encoding="utf-8")
    dry = run_cli("amp", "--dry-run", path)
    assert dry.exit_code == 1 and "-from apex import amp" in dry.stdout
    assert path.read_text(encoding="utf-8") == APEX
    done = run_cli("amp", path)
    assert "TM407" in done.output and not apex_imports(path.read_text(encoding="utf-8"))
    again = run_cli("amp", "--dry-run", path)
    assert "@@" not in again.stdout  # nothing left to change (manual findings may remain)


@pytest.mark.parametrize("code", sorted(AMP_FAMILY))
def test_amp_rules_are_documented(code, run_cli):
    result = run_cli("explain", code)
    assert result.exit_code == 0
    assert "What it does" in result.stdout and "Why is this bad" in result.stdout


# --- issues found on real scripts -------------------------------------------------------------

GCN_LIKE = """
import torch


def train_iter(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == '__main__':
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    losses = [train_iter(model, optimizer, x, y) for _ in range(5)]
"""


@pytest.mark.parametrize("mode", ["amp", "ddp"])
def test_scaler_is_created_before_the_code_that_uses_it_runs(mode, monkeypatch):
    """pytorch/examples gcn: the optimizer is built in the `__main__` block and stepped in a
    function; a scaler appended after the block raised NameError."""
    torch = pytest.importorskip("torch")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHMIGRATE_AMP"):
        monkeypatch.delenv(key, raising=False)
    # the script never moves its inputs (TM103 says so): on a GPU machine ddp mode's wrap_model
    # would put the model on the GPU, so run it as on a CPU-only machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = run(GCN_LIKE, mode).new_source
    guard = out.index("if __name__ == '__main__':")
    assert guard < out.index("scaler = tm.GradScaler()") < out.index("losses = [train_iter(")
    assert not out.rstrip().endswith("scaler = tm.GradScaler()")
    namespace = {"__name__": "__main__"}
    exec(compile(out, "gcn_like.py", "exec"), namespace)  # CPU: bf16 autocast, disabled scaler
    assert len(namespace["losses"]) == 5
    import torchmigrate.runtime as tm
    tm.cleanup()


NANOGPT_LIKE = """
import torch
from contextlib import nullcontext
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))
model = GPT(conf).to(device)
optimizer = torch.optim.AdamW(model.parameters())

@torch.no_grad()
def estimate_loss():
    for k in range(eval_iters):
        with ctx:
            logits, loss = model(X, Y)

for it in range(100):
    with ctx:
        logits, loss = model(X, Y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
"""


@pytest.mark.parametrize("mode", ["amp", "ddp"])
def test_autocast_held_in_a_variable_is_not_wrapped_again(mode):
    out = run(NANOGPT_LIKE, mode).new_source
    assert "with tm.autocast(" not in out
    assert out.count("with ctx:") == 2
    # TM410 still hands the context to the runtime's policy, keeping the user's dtype
    assert "ctx = nullcontext() if device_type == 'cpu' else tm.autocast(dtype=ptdtype)" in out
    assert "scaler = tm.GradScaler(enabled=(dtype == 'float16'))" in out


def test_step_on_the_backward_line_is_no_accumulation():
    source = """
    import torch
    opt = torch.optim.Adam(model.parameters())
    for batch in loader:
        opt.zero_grad()
        loss = model(batch).sum()
        loss.backward(); opt.step()
    """
    result = run(source, "ddp")
    assert not [f for f in result.findings if f.code == "TM404"]
    assert "TM404" not in result.new_source


def test_autocast_dtype_does_not_reach_other_threads():
    """What TM405 rests on: autocast's dtype is thread-local, and DataParallel's replica threads
    re-enter autocast with the caller's enabled flag only, so they get the default dtype."""
    import inspect
    import threading

    torch = pytest.importorskip("torch")
    from torch.nn.parallel import parallel_apply

    source = inspect.getsource(parallel_apply)
    assert re.search(r"autocast\(\s*device_type,\s*enabled=autocast_enabled\s*\)", source)
    seen = {}

    def replica(enabled):  # what parallel_apply's worker does, on the CPU
        with torch.autocast("cpu", enabled=enabled):
            seen["enabled"] = torch.is_autocast_enabled("cpu")
            seen["dtype"] = torch.get_autocast_dtype("cpu")

    with torch.autocast("cpu", dtype=torch.float16):
        thread = threading.Thread(target=replica, args=(torch.is_autocast_enabled("cpu"),))
        thread.start()
        thread.join()
    assert seen == {"enabled": True, "dtype": torch.bfloat16}  # CPU's default, not the caller's float16


def test_dataparallel_message_names_what_is_lost():
    doc = get_rule("TM405").documentation()
    assert "dtype" in doc and "enabled" in doc and "1.10" in doc
    source = """
    import torch
    import torchvision
    model = torch.nn.DataParallel(torchvision.models.resnet18()).cuda()
    """
    finding = next(f for f in run(source, "amp").findings if f.code == "TM405")
    assert "default dtype" in finding.message and "does not reach" not in finding.message


def test_autocast_starts_at_the_forward():
    """yolov3 / ESRGAN: input preparation, LR warm-up, plotting and `zero_grad()` before the
    model call stay outside autocast."""
    source = """
    import torch
    import torch.nn.functional as F
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (imgs, targets) in enumerate(loader):
        imgs = F.interpolate(imgs.to(device), scale_factor=0.5)
        optimizer.zero_grad()
        if i <= warmup:
            for g in optimizer.param_groups:
                g["lr"] = 0.1 * i / warmup
        if i == 0:
            plot_images(imgs)
        pred = model(imgs)
        loss = F.cross_entropy(pred, targets)
        loss.backward()
        optimizer.step()
    """
    out = run(source, "amp").new_source
    body = out[out.index("with tm.autocast():"):]
    assert body.startswith("with tm.autocast():\n        pred = model(imgs)\n        loss = F.cross_entropy")
    assert out.index("plot_images(imgs)") < out.index("with tm.autocast():")


def test_fill_constants_fitted_by_tm412_run_under_fp16_autocast():
    """The attention module of TM412's fixture fails under fp16 autocast as written ("value cannot
    be converted to type c10::Half without overflow") and runs once migrated (CPU autocast in
    float16 stands for a GPU without bf16)."""
    import importlib.util

    import torch

    def load(name):
        spec = importlib.util.spec_from_file_location(name, FIXTURES / "TM412" / f"attention_masks.{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 8), torch.randint(0, 6, (2, 5, 5))
    pad = torch.zeros(2, 5, 5, dtype=torch.bool)
    original, migrated = load("in").Attention(8), load("out").Attention(8)
    migrated.load_state_dict(original.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="without overflow"):
            original(x, mask, pad)
        out = migrated(x, mask, pad)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    assert torch.allclose(migrated(x, mask, pad), original(x, mask, pad))  # float32: unchanged

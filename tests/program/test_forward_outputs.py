"""The facts the AMP plan asks of the statements it would put under autocast, without any rule:
where forward outputs go (`program.forward_outputs`: into numpy, into a function that is not
torch's, read for their value after a block) and the training facts that moved out of the plan
(`computes_bce`, `grad_consumers`, `half_models`)."""

from __future__ import annotations

import textwrap

import libcst as cst

from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.forward_outputs import output_facts
from torchmigrate.program.precision import apex_amp_calls
from torchmigrate.program.training import training_facts
from torchmigrate.rule import Options


def context(source: str):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [])


def body_of(ctx, name: str):
    """The statements of the first loop in function `name`."""
    func = next(f for f in ctx.nodes(cst.FunctionDef) if f.name.value == name)
    loop = next(s for s in func.body.body if isinstance(s, (cst.For, cst.With)))
    while isinstance(loop, cst.With):
        loop = loop.body.body[0]
    return list(loop.body.body)


def text(node) -> str:
    return code(node).strip()


EVAL = """
    import numpy as np
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(loader):
        for x, y in loader:
            out = model(x)
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()

    def to_numpy(loader):
        preds = []
        for x, y in loader:
            out = model(x)
            preds.append(out)
        return np.concatenate(preds)

    def converted(loader):
        for x, y in loader:
            out = model(x)
            labels = out.argmax(1).cpu().numpy()

    def metric(loader):
        with torch.no_grad():
            for x, y in loader:
                sr = model(x)
                score = ssim(sr, y)
"""


def test_numpy_escape_through_a_list_and_not_after_a_conversion():
    ctx = context(EVAL)
    outputs = output_facts(ctx)
    assert outputs.numpy_escape(body_of(ctx, "to_numpy")[:1]) == "preds"
    assert outputs.numpy_escape(body_of(ctx, "converted")[:1]) is None
    assert outputs.numpy_escape(body_of(ctx, "train")[:2]) is None  # the loss is not an output


def test_outputs_that_leave_torch():
    ctx = context(EVAL)
    outputs = output_facts(ctx)
    body = body_of(ctx, "metric")
    forward = [c for c in ctx.within(body[0], cst.Call)]
    assert outputs.leave_torch(body, forward)  # `ssim(sr, y)`: the project's metric
    body = body_of(ctx, "converted")
    assert not outputs.leave_torch(body, [c for c in ctx.within(body[0], cst.Call)])


def test_outputs_a_block_binds_and_their_precise_uses():
    ctx = context("""
        import torch

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        teacher = Teacher()

        def evaluate(loader):
            with torch.no_grad():
                for x, y in loader:
                    logits, feats = model(x)
                    with torch.no_grad():
                        t = teacher(x)
                    pred = model(x).argmax(1)
                    n = len(logits)
                    shape = feats.shape
                    order = t.argmax(1)
                    total += criterion(logits, y).item()
    """)
    body = body_of(ctx, "evaluate")
    outputs = output_facts(ctx)
    assert outputs.bound_in(body[:3]) == ["logits", "feats", "t"]  # not `pred`: an argmax
    later = body[3:]
    assert [name for name in ("logits", "feats", "t") if any(outputs.precise_use(name, s) for s in later)] \
        == ["logits"]


def test_bce_gradient_consumers_and_half_models():
    ctx = context("""
        import torch
        import torch.nn as nn
        from apex import amp

        criterion = nn.BCELoss()
        model = Net().half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def bce(p, y):
            return criterion(p, y)

        def train(loader):
            for x, y in loader:
                loss = bce(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
                norm = model.fc.weight.grad.norm()
                optimizer.step()
    """)
    facts = training_facts(ctx)
    body = body_of(ctx, "train")
    assert facts.computes_bce(body[:1]) and not facts.computes_bce(body[1:])
    assert [(text(s), apex) for s, _scope, apex in facts.grad_consumers()] == [
        ("torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)", True),
        ("norm = model.fc.weight.grad.norm()", False)]
    assert [text(c) for c in facts.half_models()] == ["Net().half()"]
    assert [n for _c, n in apex_amp_calls(ctx)] == ["apex.amp.master_params"]

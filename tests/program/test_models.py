"""The model facts (`program.models`) without any rule: where a model is created and what it is
made of (BatchNorm layers, submodules used only in some branches, heads whose outputs training
throws away), and models differentiated by hand; the same whatever rules run."""

from __future__ import annotations

import textwrap

import libcst as cst

from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.models import functional_model, model_facts
from torchmigrate.rule import Options
from torchmigrate.rules import select


def facts_of(source: str, rules=(), mode: str = "ddp"):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    ctx = run_rules(module, "x.py", Options(mode=mode), list(rules))
    return ctx, model_facts(ctx)


NETS = """
    import torch
    import torch.nn as nn
    import torchvision
    from torch.nn.parallel import DistributedDataParallel as DDP

    def conv_bn(c):
        return nn.Sequential(nn.Conv2d(c, c, 3), nn.BatchNorm2d(c))

    class Net(nn.Module):
        def __init__(self, aux):
            super().__init__()
            self.body = conv_bn(3)
            self.aux = nn.Linear(4, 4)
            self.act = nn.ReLU()
        def forward(self, x):
            out = self.body(x)
            if random.random() < 0.5:
                out = out + self.aux(out)
            return self.act(out)

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x):
            return self.fc(x)

    def build():
        return Plain().cuda()

    net = Net(True).cuda()
    plain = build()
    resnet = torchvision.models.resnet50()
    net = DDP(net)
"""


def test_origin_is_the_class_function_or_library_that_creates_the_model():
    ctx, facts = facts_of(NETS)
    net = facts.origin("net", ctx.module, None, None)
    assert (net.kind, net.node.name.value, code(net.call)) == ("class", "Net", "Net(True)")
    plain = facts.origin("plain", ctx.module, None, None)
    assert (plain.kind, plain.node.name.value) == ("function", "build")
    assert facts.model_class(plain).name.value == "Plain"
    resnet = facts.origin("resnet", ctx.module, None, None)
    assert (resnet.kind, resnet.node) == ("library", "torchvision.models.resnet50")


def test_definitions_leave_out_the_wraps():
    ctx, facts = facts_of(NETS)
    ((assign, value),) = facts.definitions("net", ctx.module, None)
    assert code(value) == "Net(True).cuda()" and assign.value is value
    assert len(facts.assignments("net")) == 2


def test_batchnorm_through_building_blocks_and_torchvision():
    ctx, facts = facts_of(NETS)
    assert facts.has_bn(facts.origin("net", ctx.module, None, None))
    assert facts.has_bn(facts.origin("resnet", ctx.module, None, None))
    assert not facts.has_bn(facts.origin("plain", ctx.module, None, None))


def test_submodules_used_in_some_branches_only():
    ctx, facts = facts_of(NETS)
    net = facts.model_class(facts.origin("net", ctx.module, None, None))
    plain = facts.model_class(facts.origin("plain", ctx.module, None, None))
    assert [name for name, _ in facts.conditional_submodules(net)] == ["aux"]  # not the parameterless ReLU
    assert facts.conditional_submodules(plain) == []
    assert facts.uses_every_submodule(plain) and not facts.uses_every_submodule(net)


HEADS = """
    import torch
    import torch.nn as nn

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.proj = nn.Linear(4, 2)
        def forward(self, x):
            h = self.body(x)
            return h, self.proj(h)

    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in loader:
        out, _ = model(x)
        out.sum().backward()
        optimizer.step()
"""


def test_heads_whose_outputs_every_training_call_discards():
    ctx, facts = facts_of(HEADS)
    origin = facts.origin("model", ctx.module, None, None)
    assert facts.discarded_heads(origin, "model") == ("TwoHeads", ["proj"])
    kept = HEADS.replace("out, _ = model(x)", "out, z = model(x)")
    ctx, facts = facts_of(kept)
    assert facts.discarded_heads(facts.origin("model", ctx.module, None, None), "model") == ("", [])


def test_a_model_differentiated_by_hand():
    ctx, _ = facts_of("""
        import torch
        net = Net()
        grads = torch.autograd.grad(loss, net.parameters())
    """)
    assert functional_model(ctx, "net") and not functional_model(ctx, "other")


def test_the_facts_do_not_depend_on_the_rules_enabled():
    def summary(rules, mode):
        ctx, facts = facts_of(NETS, rules, mode)
        net = facts.origin("net", ctx.module, None, None)
        return (net.kind, facts.has_bn(net), [n for n, _ in facts.conditional_submodules(facts.model_class(net))])

    assert summary((), "ddp") == summary(select(command="ddp"), "ddp") == summary(select(command="lint"), "lint")


def test_wrapper_kinds_and_what_they_wrap():
    ctx, facts = facts_of("""
        import torch
        import torch.nn as nn
        import torchmigrate.runtime as tm
        from torch.nn.parallel import DistributedDataParallel as DDP
        from accelerate import Accelerator
        a = DDP(net, device_ids=[0])
        b = nn.DataParallel(module=net).cuda()
        c = tm.wrap_model(net)
        d = Accelerator().prepare(net)
        e = Net()
    """, mode="lint")  # (`ddp` leaves a file Accelerate drives alone, TM101)
    kinds = {}
    for call, name in facts.f.calls:
        kind = facts.wrapper_kind(call, name)
        if kind is not None:
            outer, holder = facts.wrapper_site(call)
            module = code(facts.wrapped_arg(call).value) if kind != "other" else None
            kinds[code(holder.targets[0].target)] = (kind, module, code(outer))
    assert kinds == {
        "a": ("ddp", "net", "DDP(net, device_ids=[0])"),
        "b": ("dp", "net", "nn.DataParallel(module=net).cuda()"),
        "c": ("tm", "net", "tm.wrap_model(net)"),
        "d": ("other", None, "Accelerator().prepare(net)"),
    }
    assert facts.framework

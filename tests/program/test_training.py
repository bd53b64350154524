"""The training facts (`program.training`, `program.precision`) without any rule: the training
steps (backwards, optimizer steps), the autocast blocks and scalers already there, where a loss is
defined and where its forward starts, evaluation loops, gradient reads; the same whatever rules
run and whatever the options."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from torchmigrate.engine.process import run_rules
from torchmigrate.syntax.nodes import code
from torchmigrate.program.precision import apex_level, caller_dtype
from torchmigrate.program.training import training_facts
from torchmigrate.rule import Options
from torchmigrate.rules import select


def facts_of(source: str, rules=(), **options):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    ctx = run_rules(module, "x.py", Options(**{"mode": "ddp", **options}), list(rules))
    return ctx, training_facts(ctx)


def text(node) -> str:
    return code(node).strip()


TRAIN = """
    import torch
    from torch.utils.data import DataLoader

    model = Net().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(loader):
        for x, y in loader:
            x = x.to("cuda")
            out = model(x)
            loss = criterion(out, y)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    def evaluate(loader):
        with torch.no_grad():
            for x, y in loader:
                pred = model(x)

    def probe(x):
        model(x).sum().backward()  # no step here: not a training step
"""


def test_training_steps_are_a_backward_and_a_step_in_one_function():
    ctx, facts = facts_of(TRAIN)
    (site,) = facts.sites
    (step,) = facts.steps
    assert (text(site.call), site.kind, text(site.loss), site.paired) == ("loss.backward()", "plain", "loss", False)
    assert site.scope is step.scope and site.scope.name.value == "train"
    assert (text(step.call), step.kind, text(step.optimizer)) == ("optimizer.step()", "plain", "optimizer")
    assert facts.sites_by_scope == {site.scope}
    assert not facts.framework and not facts.existing_scalers and not facts.autocast_withs


def test_where_the_loss_is_defined_and_where_its_forward_starts():
    ctx, facts = facts_of(TRAIN)
    (site,) = facts.sites
    last, inline = facts.loss_definition(site)
    assert text(last) == "loss = criterion(out, y)" and inline is False
    first = facts.forward_start(last)
    assert text(first) == "out = model(x)"  # input preparation before it stays out
    prep = ctx.parent(first).body[0]
    assert text(prep) == 'x = x.to("cuda")'
    assert facts.data_only(prep) and not facts.calls_model(prep) and facts.calls_model(first)
    assert not facts.covered(first)

    _ctx, facts = facts_of("""
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    """)
    assert facts.loss_definition(facts.sites[0]) == (None, True)  # the forward is in the backward


def test_evaluation_loops_gradient_reads_and_clipping():
    ctx, facts = facts_of(TRAIN + """
    def clip(model):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)

    def train_logged(loader):
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            norm = sum(p.grad.norm() for p in model.parameters())
            clip(model)
            optimizer.step()
    """)
    (loop, calls), = facts.eval_forwards().items()
    assert ctx.enclosing(loop, cst.FunctionDef).name.value == "evaluate" and [text(c) for c in calls] == ["model(x)"]
    assert facts.clip_helpers() == {"clip"}
    assert [text(ctx.statement_of(n)) for n in facts.grad_reads()] == ["norm = sum(p.grad.norm() for p in model.parameters())"]
    train_logged = facts.sites[1]
    read = ctx.statement_of(facts.grad_reads()[0])
    assert facts.position(train_logged.statement, train_logged.scope) < facts.position(read, train_logged.scope)


def test_autocast_already_there_through_holders_factories_and_decorators():
    ctx, facts = facts_of("""
        import torch
        from contextlib import nullcontext

        amp_ctx = nullcontext() if device == "cpu" else torch.autocast("cuda", dtype=torch.bfloat16)

        def autocast_for(device):
            return torch.autocast(device, dtype=torch.bfloat16)

        class Net(torch.nn.Module):
            @torch.autocast("cuda", dtype=torch.bfloat16)
            def forward(self, x):
                return self.fc(x)

        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            with amp_ctx:
                loss = criterion(model(x), y)
            scaler.scale(loss).backward()
            with autocast_for("cuda"):
                aux = model(x)
            scaler.step(optimizer)
            scaler.update()
    """)
    assert [text(w.items[0].item) for w in facts.autocast_withs] == ['autocast_for("cuda")', "amp_ctx"]
    (site,) = facts.sites
    assert (site.kind, text(site.loss)) == ("scaled", "loss")
    last, _ = facts.loss_definition(site)
    assert last in facts.autocast_set and facts.forward_under_autocast()
    assert [(t, text(c)) for t, c in facts.existing_scalers] == [("scaler", 'torch.amp.GradScaler("cuda")')]
    assert [(s.kind, text(s.optimizer)) for s in facts.steps] == [("scaled", "optimizer")]
    assert text(caller_dtype(ctx)) == "torch.bfloat16"


def test_optional_amp_closures_bce_and_frameworks():
    _ctx, facts = facts_of("""
        import torch.nn as nn
        criterion = nn.BCELoss()

        def bce(p, y):
            return criterion(p, y)

        def train():
            for x, y in loader:
                loss = bce(model(x), y)
                if use_amp:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                optimizer.step(closure)
    """)
    plain = next(s for s in facts.sites if s.kind == "plain")
    assert plain.paired  # the non-AMP branch of an optional-AMP `if`
    assert [s.kind for s in facts.steps] == ["closure"]
    assert facts.bce_names() == {"criterion"} and facts.bce_functions() == {"bce"}
    _ctx, facts = facts_of("import lightning\nloss.backward()\noptimizer.step()\n", mode="lint")
    assert facts.framework


def test_apex_opt_level():
    ctx, _facts = facts_of("""
        from apex import amp
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    """)
    level, call = apex_level(ctx)
    assert level == "O2" and text(call).startswith("amp.initialize(")


def summary(facts) -> tuple:
    """The facts as plain text, to compare runs."""
    return (
        [(text(s.statement), s.kind, s.paired) for s in facts.sites],
        [(text(s.call), s.kind) for s in facts.steps],
        [text(w) for w in facts.autocast_withs],
        [t for t, _ in facts.existing_scalers],
        [text(facts.forward_start(facts.loss_definition(s)[0])) for s in facts.sites
         if facts.loss_definition(s)[0] is not None],
        [text(c) for calls in facts.eval_forwards().values() for c in calls],
        [text(n) for n in facts.grad_reads()],
        sorted(facts.clip_helpers()),
    )


@pytest.mark.parametrize("mode,amp", [("ddp", "auto"), ("amp", "bf16"), ("amp", "off"), ("lint", "auto")])
def test_the_same_whatever_rules_run_and_whatever_the_options(mode, amp):
    _ctx, alone = facts_of(TRAIN)
    _ctx, with_rules = facts_of(TRAIN, rules=select(command=mode), mode=mode, amp=amp)
    assert summary(with_rules) == summary(alone)
    assert summary(alone)[0] == [("loss.backward()", "plain", False)]

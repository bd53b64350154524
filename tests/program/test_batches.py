"""The batch facts (`program.batches`) without any rule: hand-made batch loops, loops over
iterables of batches, the draws that order them, and full-batch losses over training indices."""

from __future__ import annotations

import textwrap

import libcst as cst

from torchmigrate.engine.process import run_rules
from torchmigrate.program.batches import batch_facts
from torchmigrate.rule import Options


def facts_of(source: str):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    ctx = run_rules(module, "x.py", Options(mode="ddp"), [], None)
    return ctx, batch_facts(ctx)


def text(node) -> str:
    return cst.Module([]).code_for_node(node)


def test_range_loops_that_slice_data_in_a_training_step_and_their_orders():
    ctx, facts = facts_of("""
        import numpy as np
        import torch

        def train(X, y, bs, steps):
            perm = torch.randperm(len(X))
            for i in range(0, len(X), bs):
                idx = perm[i:i + bs]
                loss = model(X[idx]).sum()
                loss.backward()
                opt.step()
            order = list(range(len(X)))
            np.random.shuffle(order)
            for k, b in enumerate(range(len(X) // bs)):
                step(X[b * bs:(b + 1) * bs])
            for t in range(steps):  # a step counter: no slice of data
                loss = model(sample()).sum()
                loss.backward()
                opt.step()

        def step(xb):
            model(xb).sum().backward()
            opt.step()
    """)
    first, second = facts.loops
    assert (first.kind, text(first.wrapped), first.sliced) == ("range", "range(0, len(X), bs)", ("perm",))
    assert [(o.kind, o.name, text(o.node)) for o in first.orders] == [("draw", "perm", "torch.randperm(len(X))")]
    assert (second.kind, text(second.wrapped), second.sliced, second.orders) == (
        "range", "range(len(X) // bs)", ("X",), [])  # a step through a function of the module
    assert not first.carried and not first.sharded and first.unknown_order is None
    assert facts.order_draws == {id(first.orders[0].node)}


def test_state_carried_between_batches_and_orders_the_tool_cannot_share():
    _, facts = facts_of("""
        from sklearn.utils import shuffle
        for epoch in range(3):
            X, y = shuffle(X, y)
            hidden = None
            for i in range(0, len(X), 8):
                x = X[i:i + 8]
                x = x.float()  # assigned earlier in the iteration: not carried
                out, hidden = model(x, hidden)
                loss = crit(out, y[i:i + 8])
                loss.backward()
                opt.step()
    """)
    (loop,) = facts.loops
    assert loop.carried == "hidden" and loop.unknown_order == "`shuffle(X, y)`"


def test_loops_over_iterables_of_batches():
    _, facts = facts_of("""
        import itertools
        def fit(batches, train_loader, val_iter):
            for xb, yb in tqdm(batches):
                model(xb).sum().backward(); opt.step()
            for step in itertools.count():
                model(sample()).sum().backward(); opt.step()
            for lr in [0.1, 0.01]:
                model(x).sum().backward(); opt.step()
            for xb in val_iter:
                model(xb).sum().backward(); opt.step()
            for xb in tm.shard_batches(batches):
                model(xb).sum().backward(); opt.step()
    """)
    assert [(b.kind, text(b.wrapped), b.sharded) for b in facts.loops] == [
        ("iterable", "batches", False), ("iterable", "tm.shard_batches(batches)", True)]


def test_full_batch_losses_over_fixed_training_indices():
    _, facts = facts_of("""
        import torch.nn as nn
        import torch.nn.functional as F
        criterion = nn.CrossEntropyLoss()
        summed = nn.CrossEntropyLoss(reduction="sum")

        def train(idx_train, idx_val):
            out = model(features, adj)
            loss = F.nll_loss(out[idx_train], labels[idx_train]) + criterion(out[data.train_mask], data.y[data.train_mask])
            F.nll_loss(out[idx_val], labels[idx_val])  # evaluation indices
            summed(out[idx_train], labels[idx_train])  # not a mean
            F.nll_loss(out[idx_train], labels[idx_train], weight=w)  # a weighted mean
            loss.backward()
            opt.step()

        def minibatches(train_idx):
            for batch_train_idx in train_idx.split(64):  # a loop over batches of indices
                out = model(features, adj)
                F.nll_loss(out[batch_train_idx], labels[batch_train_idx]).backward()
                opt.step()
    """)
    assert [(text(x.call).split("(")[0], x.index) for x in facts.losses] == [
        ("F.nll_loss", "idx_train"), ("criterion", "data.train_mask")]

"""Probe launched by tests/test_runtime_dist.py under torchrun: the helpers that shard training data
that no sampler can (hand-made batch loops, batch iterators, full-batch index sets). Writes this
rank's observations to <outdir>/rank<R>.json."""
import json
import os
import random
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import torchmigrate.runtime as tm


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()


def shuffling_batches(n, batch_size):
    """A generator of the kind programs write: a new random order each pass, drawn as it goes."""
    order = list(range(n))
    random.shuffle(order)
    for i in range(0, n, batch_size):
        yield order[i:i + batch_size]


def full_batch_step(x, y, idx, sharded):
    """One full-batch step of a linear model on the training rows `idx`; returns (loss, grads)."""
    torch.manual_seed(0)
    plain = nn.Linear(3, 1)
    model = tm.wrap_model(plain) if sharded else plain
    out = model(x)
    if sharded:
        part = tm.shard_indices(idx)
        loss = tm.shard_mean(F.mse_loss(out[part], y[part]), idx)
    else:
        loss = F.mse_loss(out[idx], y[idx])
    loss.backward()
    return loss.item(), flat(p.grad for p in plain.parameters())


def main(outdir):
    ctx = tm.setup()
    res = {"rank": ctx.rank}
    res["range"] = list(tm.shard_range(range(0, 10, 2)))  # 5 batch starts: padded to 3 each
    res["indices"] = tm.shard_indices(torch.arange(7)).tolist()
    res["mask"] = tm.shard_indices(torch.tensor([1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)).tolist()
    rows = torch.arange(7)
    state, mine = torch.zeros(6), torch.tensor([0, 1] if ctx.rank == 0 else [4])
    state[tm.all_rows(mine)] = tm.all_rows(mine.float() + 1)  # every rank's rows, on every rank
    res["state"] = state.tolist()
    with torch.no_grad():
        res["state_no_grad"] = tm.all_rows(mine).tolist()  # (an evaluation: no collective)
        keys = torch.full((2 if ctx.rank == 0 else 1, 3), float(ctx.rank), requires_grad=False)
        res["queue_keys"] = tm.gather_rows(keys).tolist()  # an enqueue under no_grad: gathered
    res["parts"] = [tm.rank_part(rows[0:5]).tolist(), tm.rank_part(list(range(7))), tm.rank_part(rows[:1]).tolist()]

    random.seed(100 + ctx.rank)  # every rank its own stream, as with per-rank seeds
    batches = tm.shard_batches(shuffling_batches(9, 2))
    res["iterator_passes"] = [list(batches)]
    batches = tm.shard_batches(shuffling_batches(9, 2))
    res["iterator_passes"].append(list(batches))
    res["own_stream_kept"] = random.Random(100 + ctx.rank).random() == random.random()

    loader = tm.shard_batches(DataLoader(list(range(10)), batch_size=3, shuffle=True))
    res["loader"] = [b.tolist() for b in loader]

    # full batch: 7 training rows (not a multiple of 2) among 10, weighted shares
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 3, generator=g), torch.randn(10, 1, generator=g)
    idx = torch.tensor([0, 2, 3, 5, 6, 8, 9])
    res["full_loss"], res["full_grads"] = full_batch_step(x, y, idx, sharded=False)
    res["sharded_loss"], res["sharded_grads"] = full_batch_step(x, y, idx, sharded=True)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[idx] = True
    res["mask_loss"], res["mask_grads"] = full_batch_step(x, y, mask, sharded=True)
    with open(os.path.join(outdir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(res, f)
    tm.cleanup()


if __name__ == "__main__":
    main(sys.argv[1])

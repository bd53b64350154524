"""The runtime's safety nets for programs of several modules, in one process: the DDP that
`wrap_model` returns resolves the module's own attributes, the training sampler reshuffles where
nobody calls `set_epoch`, and `gather_list` is the identity without a process group."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchmigrate.runtime as tm
from torchmigrate.runtime import _DDP, _EpochSampler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_classes = 3
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)

    def init_hidden(self, n):
        return torch.zeros(n, 3)

    def loss_of(self, x):  # a forward outside forward()
        return self.fc(x).sum()


@pytest.fixture
def group():
    """A one-rank gloo group, so DistributedDataParallel can be built in this process."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_wrapper_reads_the_modules_attributes(group):
    ddp = _DDP(Net())
    assert ddp.n_classes == 3
    assert ddp.init_hidden(2).shape == (2, 3)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel)
    with pytest.raises(AttributeError):
        ddp.missing_attribute


def test_a_method_run_outside_forward_trains_without_a_warning(group):
    """Its gradients are averaged after the backward (see _DDP), so nothing needs saying."""
    ddp = _DDP(Net())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ddp.loss_of(torch.ones(1, 4)).backward()
        with torch.no_grad():
            ddp.init_hidden(1)
    assert not [w for w in seen if "torchmigrate" in str(w.message)]
    assert ddp.module.fc.weight.grad is not None and ddp._tm_mode == "ddp"


def test_wrapper_loads_a_checkpoint_of_the_plain_module(group):
    plain = Net()
    ddp = _DDP(Net())
    ddp.load_state_dict(plain.state_dict())
    assert torch.equal(ddp.module.fc.weight, plain.fc.weight)
    ddp.load_state_dict(_DDP(plain).state_dict())  # prefixed keys still load the usual way


def test_sampler_reshuffles_each_pass_until_set_epoch():
    data = list(range(40))
    sampler = _EpochSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    other = _EpochSampler(data, num_replicas=2, rank=1, shuffle=True, seed=0)
    first, second = list(sampler), list(sampler)
    assert first != second, "a second pass is a new epoch"
    a, b = list(other), list(other)
    assert not set(first) & set(a) and not set(second) & set(b), "ranks stay disjoint each pass"
    sampler.set_epoch(7)
    assert list(sampler) == list(sampler), "an explicit epoch is kept, as DistributedSampler does"


def test_gather_list_is_the_identity_in_one_process():
    values = [1.0, 2.0]
    assert tm.gather_list(values) is values


def _shards(inner, world=2, passes=2, **kwargs):
    """What each rank of `world` draws from `shard_sampler(inner)` in `passes` passes."""
    from unittest import mock

    out = []
    with mock.patch.object(tm, "world_size", lambda: world), mock.patch.object(tm, "is_distributed", lambda: True):
        for r in range(world):  # each rank a process of its own: its samplers counted from 0
            with mock.patch.object(tm, "rank", lambda r=r: r), mock.patch.object(tm, "_SAMPLERS_MADE", 0):
                s = tm.shard_sampler(inner, **kwargs)
                out.append([list(s) for _ in range(passes)] + [len(s)])
    return out


def test_shard_sampler_shares_any_sampler_out_by_rank():
    from torch.utils.data import BatchSampler, SequentialSampler, WeightedRandomSampler

    (a0, a1, n0), (b0, b1, n1) = _shards(WeightedRandomSampler(torch.ones(10), 10))
    assert n0 == n1 == 5 and len(a0) == len(b0) == 5
    assert a0 != a1, "a new draw each epoch"
    # the same draw on both ranks, split: rank 0 takes items 0, 2, 4..., rank 1 items 1, 3, 5...
    assert _shards(WeightedRandomSampler(torch.ones(10), 10)) == [[a0, a1, 5], [b0, b1, 5]]
    (c, _, m0), (d, _, m1) = _shards(BatchSampler(SequentialSampler(range(9)), 2, False))
    assert c == [[0, 1], [4, 5], [8]] and d == [[2, 3], [6, 7], [0, 1]], "padded to equal step counts"
    assert m0 == m1 == 3


def test_shard_sampler_reads_like_the_sampler_it_wraps():
    """`len(loader.sampler.indices)` (a SubsetRandomSampler's split) after the migration."""
    import copy
    import pickle
    from unittest import mock
    from torch.utils.data import SubsetRandomSampler

    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "is_distributed", lambda: True), \
            mock.patch.object(tm, "_SAMPLERS_MADE", 0):  # (the count other tests' samplers start from)
        s = tm.shard_sampler(SubsetRandomSampler([3, 5, 7]))
        assert list(s.indices) == [3, 5, 7] and len(s) == 2
        assert list(pickle.loads(pickle.dumps(s)).indices) == [3, 5, 7]
        assert copy.copy(s).inner is s.inner
        with pytest.raises(AttributeError):
            s.no_such_attribute


class _IdentityBatches(torch.utils.data.Sampler):
    """P identities, K images each, one identity's images after another (a PK sampler for a
    triplet or binomial loss): index i shows identity i // 10."""

    def __init__(self, identities=5, k=2):
        self.identities, self.k = identities, k

    def __iter__(self):
        for c in torch.randperm(self.identities).tolist():
            yield from (10 * c + j for j in range(self.k))

    def __len__(self):
        return self.identities * self.k


def test_shard_sampler_deals_blocks_of_the_batch_so_groups_stay_on_one_rank():
    (a0, a1, n0), (b0, b1, n1) = _shards(_IdentityBatches(), batch_size=4)
    assert n0 == n1 == 8 and len(a0) == len(b0) == 8  # 10 items in blocks of 4: 2 blocks each, padded
    for drawn in (a0, a1, b0, b1):
        for batch in (drawn[:4], drawn[4:]):
            ids = [i // 10 for i in batch]
            assert ids[0] == ids[1] and ids[2] == ids[3]  # both images of an identity in one batch
    assert set(a0) | set(b0) == {10 * c + j for c in range(5) for j in range(2)}  # every item dealt
    # one item at a time (no batch size), as before: rank r keeps items r, r+W, ...
    (c0, _, m0), (d0, _, m1) = _shards(_IdentityBatches())
    assert m0 == m1 == 5 and all(x // 10 == y // 10 for x, y in zip(c0, d0))  # each identity split


def test_shard_sampler_splits_every_batch_of_a_batch_sampler_and_keeps_their_number():
    """FixMatch's loaders: a BatchSampler over a sampler sized for `n_iters` batches, drawn with
    `next()` n_iters times: each rank gets n_iters batches, its contiguous part of each, and
    together the ranks cover every batch the one process drew."""
    from torch.utils.data import BatchSampler, RandomSampler

    inner = BatchSampler(RandomSampler(range(50), replacement=True, num_samples=5 * 6), 6, drop_last=True)
    (a0, _, n0), (b0, _, n1) = _shards(inner, split_batches=True)
    assert n0 == n1 == 5 and len(a0) == len(b0) == 5  # the number of batches kept
    assert all(len(x) == len(y) == 3 for x, y in zip(a0, b0))
    torch.manual_seed(0)
    (c0, _, _), (d0, _, _) = _shards(BatchSampler(range(7), 3, drop_last=False), split_batches=True)
    assert [x + y for x, y in zip(c0, d0)] == [[0, 1, 2], [3, 4, 5], [6, 6]]  # a short batch lends its item


def test_shard_sampler_keeps_a_sampler_that_already_takes_the_rank():
    """`DistributedSampler(ds) if args.distributed else None` with the flag on: not sharded twice."""
    from unittest import mock
    from torch.utils.data import DistributedSampler

    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "is_distributed", lambda: True), \
            mock.patch.object(tm, "_SAMPLERS_MADE", 0):  # (the count other tests' samplers start from)
        s = DistributedSampler(range(10), num_replicas=2, rank=1)
        assert tm.shard_sampler(s) is s
        assert len(list(tm.shard_sampler(None, dataset=range(10), shuffle=True))) == 5


def test_shard_sampler_is_the_sampler_itself_in_one_process():
    from torch.utils.data import RandomSampler

    s = RandomSampler(range(5))
    assert tm.shard_sampler(s) is s


def test_reduce_meter_leaves_a_meter_alone_in_one_process():
    class Meter:
        sum, count, avg = 6.0, 3, 2.0

    m = Meter()
    assert tm.reduce_meter(m) is m and (m.sum, m.count, m.avg) == (6.0, 3, 2.0)


def test_each_sampler_shuffles_with_its_own_seed_alike_on_every_rank():
    """Two loaders that shuffled independently (unpaired A and B zipped) must not draw one order."""
    from unittest import mock

    seeds = []
    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "is_distributed", lambda: True):
        for r in range(2):
            with mock.patch.object(tm, "rank", lambda r=r: r), mock.patch.object(tm, "_SAMPLERS_MADE", 0):
                a, b = tm.sampler(range(16)), tm.sampler(range(16))
                seeds.append((a.seed, b.seed))
    assert seeds[0] == seeds[1] and seeds[0][0] != seeds[0][1]


def test_shard_stream_leaves_loaders_and_iterators_alone():
    from unittest import mock

    loader = torch.utils.data.DataLoader(range(8))
    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "rank", lambda: 1):
        assert tm.shard_stream(loader) is loader
        it = iter(range(4))
        assert tm.shard_stream(it) is it
        assert tm.shard_stream(torch.arange(10)).tolist() == [5, 6, 7, 8, 9]  # a token stream: contiguous
        assert tm.shard_stream(list(range(12))) == [6, 7, 8, 9, 10, 11]  # token ids in a list, too
        assert tm.shard_stream("abcdefgh") == "efgh"  # characters


def test_shard_stream_deals_lists_of_samples_at_random_and_keeps_lengths_aligned():
    """A list of samples saved in class order is dealt out at random (the same deal on every
    rank), every sample in some rank's part, equal lengths; a tensor of the same length handed to
    the same iterator is cut the same way."""
    from unittest import mock

    graphs = [("class0", i) for i in range(9)] + [("class1", i) for i in range(8)]  # 17, in class order
    labels = torch.tensor([0] * 9 + [1] * 8)
    parts, label_parts = [], []
    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "_STREAM_PARTS", {}):
        for r in range(2):
            with mock.patch.object(tm, "rank", lambda r=r: r):
                parts.append(tm.shard_stream(graphs))
                label_parts.append(tm.shard_stream(labels))
                assert tm.shard_stream(tuple(graphs)) == tuple(parts[-1])
    assert len(parts[0]) == len(parts[1]) == 9  # padded: the same number of steps on both ranks
    assert set(parts[0]) | set(parts[1]) == set(graphs)  # no sample left out
    assert len(set(parts[0]) & set(parts[1])) == 1  # the one padded sample
    for part in parts:
        assert {c for c, _ in part} == {"class0", "class1"}  # not one class per rank
    for part, lab in zip(parts, label_parts):
        assert [0 if c == "class0" else 1 for c, _ in part] == lab.tolist()  # aligned with its list


class _Endless(torch.utils.data.Sampler):
    """The endless sampler widely copied from style-transfer code: a numpy permutation, and after
    each round numpy reseeded from the OS (`np.random.seed()`) for the next one."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        import numpy as np
        order, i = np.random.permutation(self.n), 0
        while True:
            yield int(order[i])
            i += 1
            if i >= self.n:
                np.random.seed()
                order, i = np.random.permutation(self.n), 0

    def __len__(self):
        return 2 ** 31


def test_shard_sampler_agrees_across_ranks_on_draws_made_as_it_goes():
    import itertools
    from unittest import mock

    import numpy as np

    n, rounds = 10, 3
    reseed = np.random.seed
    drawn, after = [], []
    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "is_distributed", lambda: True):
        for r in range(2):
            np.random.seed(100 + r)  # each rank's own numpy stream, as after tm.seed_per_rank()
            with mock.patch.object(tm, "rank", lambda r=r: r), mock.patch.object(tm, "_SAMPLERS_MADE", 0):
                drawn.append(list(itertools.islice(iter(tm.shard_sampler(_Endless(n))), rounds * n // 2)))
            after.append(np.random.random())
    for k in range(rounds):  # each round of the shared sequence is split between the ranks
        mine = [set(d[k * n // 2:(k + 1) * n // 2]) for d in drawn]
        assert not mine[0] & mine[1] and mine[0] | mine[1] == set(range(n)), f"round {k}"
    # the program's own numpy stream is untouched by the sampler's draws, and numpy's seed is its own again
    assert after == [np.random.RandomState(100 + r).random_sample() for r in range(2)]
    assert np.random.seed is reseed


class _NoLength(torch.utils.data.Sampler):
    """DomainBed's `_InfiniteSampler`: endless batches of an inner batch sampler, and no `__len__`."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        while True:
            yield from torch.randperm(self.n).tolist()


def test_shard_sampler_of_an_endless_sampler_without_a_length():
    """No `len()` to pad to: each rank takes every W-th item of the shared draw, endlessly."""
    import itertools
    from unittest import mock

    taken = []
    with mock.patch.object(tm, "world_size", lambda: 2), mock.patch.object(tm, "is_distributed", lambda: True):
        for r in range(2):
            with mock.patch.object(tm, "rank", lambda r=r: r), mock.patch.object(tm, "_SAMPLERS_MADE", 0):
                s = tm.shard_sampler(_NoLength(6))
                taken.append(list(itertools.islice(iter(s), 9)))
                with pytest.raises(TypeError):
                    len(s)
    assert len(taken[0]) == len(taken[1]) == 9
    assert not set(taken[0][:3]) & set(taken[1][:3])  # one round of 6: 3 each, disjoint

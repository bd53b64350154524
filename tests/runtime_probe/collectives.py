"""Probe launched by tests/test_runtime_dist.py under torchrun: exercises every communicating
helper of torchmigrate.runtime and writes this rank's observations to <outdir>/rank<R>.json."""
import copy
import json
import logging
import os
import random
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import torchmigrate.runtime as tm


def flat(tensors):
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).tolist()


def described(value):
    """JSON-friendly (value, type, device) of an all_reduce result."""
    if isinstance(value, torch.Tensor):
        return {"value": value.float().cpu().tolist(), "type": "tensor",
                "dtype": str(value.dtype), "device": value.device.type}
    return {"value": value, "type": type(value).__name__}


def fake_download(folder, rank):
    """What `torchvision.datasets.X(root, download=True)` does: fetch unless the file is there.
    Returns whether it found the file at entry; the fetch is slow, so a rank running it at the
    same time as another would find it missing too (or half written)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "data.bin")
    present = os.path.exists(path)
    if not present:
        with open(path + f".part{rank}", "w") as f:
            time.sleep(0.5)
            f.write(f"downloaded by rank {rank}")
        os.replace(path + f".part{rank}", path)
    with open(os.path.join(folder, "log.txt"), "a") as f:
        f.write(f"{rank} {'found' if present else 'downloaded'}\n")
    return present


class Writer:
    """Stands in for SummaryWriter: writes a file on close."""

    def __init__(self, path):
        self.path, self.rows = path, []

    def add_scalar(self, *row):
        self.rows.append(row)

    def close(self):
        with open(self.path, "w") as f:
            f.write(repr(self.rows))


def main(outdir):
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    # each process's own unseeded streams, as a program that never seeds has them
    import numpy as np
    random.seed(os.getpid())
    np.random.seed(os.getpid() % 2 ** 32)
    torch.manual_seed(os.getpid())
    ctx = tm.setup(timeout=60)
    r, dev = ctx.rank, tm.device()
    # after set-up every rank draws what rank 0 draws (a dataset generated at random agrees)
    first_draws = [random.random(), float(np.random.random()), torch.rand(1).item()]
    res = {"ctx": {"rank": ctx.rank, "local_rank": ctx.local_rank, "world_size": ctx.world_size,
                   "device": str(ctx.device), "is_main": ctx.is_main},
           "same_ctx": tm.setup() is ctx, "backend": str(dist.get_backend()),
           "pg_world": dist.get_world_size(), "is_distributed": tm.is_distributed()}

    res["first_draws"] = first_draws
    # strings hash alike on every rank (setup restarted the process with a shared PYTHONHASHSEED):
    # a vocabulary built from a set gives every rank the same ids
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    res["set_order"] = list(set(words))
    res["hash_seed"] = [os.environ.get("PYTHONHASHSEED"), hash("alpha")]
    tm.seed_per_rank()
    res["draws_after_seed_per_rank"] = [random.random(), float(np.random.random()), torch.rand(1).item()]

    tm.print(f"PRINT-MARKER from rank {r}")
    logging.info("INFO-MARKER from rank %d", r)
    logging.warning("WARN-MARKER from rank %d", r)
    sys.stdout.flush()

    # all_reduce: numbers stay numbers, tensors stay tensors on the input's device
    res["sum_int"] = described(tm.all_reduce(r + 1))
    res["sum_big_int"] = described(tm.all_reduce(2 ** 60 + r))
    res["sum_mixed"] = [described(v) for v in tm.all_reduce(
        r + 1, 0.5 * (r + 1), torch.tensor([float(r), 10.0], device=dev),
        torch.tensor([r + 1, 2]), torch.tensor([True, r == 0]))]
    res["mean"] = [described(v) for v in tm.all_reduce(
        r + 1, 2.0 * r, torch.tensor([2.0 * r, 4.0], device=dev), torch.tensor([r, 3]),
        op="mean")]
    res["max"] = [described(v) for v in tm.all_reduce(r, float(-r), torch.tensor([r, -r]), op="max")]
    res["min"] = [described(v) for v in tm.all_reduce(r, float(-r), torch.tensor([r, -r]), op="min")]
    res["bf16"] = described(tm.all_reduce(torch.tensor([1.5, r], dtype=torch.bfloat16)))
    # lists and tuples: reduced element by element, with the other arguments, same types back
    per_class, heads = [r, 2 * r + 1], (0.5 * r, 1.0)
    lists = tm.all_reduce(per_class, heads, r)
    res["lists"] = [type(lists[0]).__name__, lists[0], type(lists[1]).__name__, list(lists[1]), lists[2],
                    per_class == [r, 2 * r + 1]]
    res["list_mean"] = tm.all_reduce([r, 1.0], op="mean")
    # dicts by key (per-timestep loss bins): an entry still the int it started as on one rank
    # (no sample reached it) and a float on the other
    bins, counts = {0: 0, 1: 0.5 * (r + 1)}, {0: r, 1: 2}
    if r == 1:
        bins[0] = 0.25
    got = tm.all_reduce(bins, counts)
    res["dicts"] = [type(got[0]).__name__, sorted(got[0].items()), sorted(got[1].items())]
    import numpy as np
    summed = tm.all_reduce(np.asarray([r, 1.0]))
    res["numpy"] = [type(summed).__name__, summed.tolist()]
    inp = torch.tensor([float(r)])
    tm.all_reduce(inp)
    res["input_untouched"] = inp.tolist() == [float(r)]

    # broadcast_object / shared_generator: rank 0's draw on every rank
    random.seed(1000 + r)
    res["broadcast"] = tm.broadcast_object({"lr": random.random(), "files": random.sample(range(50), 5)})
    res["broadcast_tensor"] = described(tm.broadcast_object(torch.randperm(6, generator=torch.Generator().manual_seed(r))))
    torch.manual_seed(r)  # unseeded alike: the split must still agree
    split = torch.utils.data.random_split(list(range(12)), [8, 4], generator=tm.shared_generator())
    res["split"] = [list(split[0].indices), list(split[1].indices)]

    # input: the main process asks, every rank gets its answer; its EOFError is raised everywhere
    import builtins
    asked = builtins.input
    builtins.input = lambda prompt="": f"answer of rank {r}"
    res["input"] = tm.input("dataset? ")
    builtins.input = (lambda prompt="": (_ for _ in ()).throw(EOFError("no stdin"))) if r == 0 else builtins.input
    try:
        tm.input("again? ")
        res["input_error"] = None
    except EOFError as exc:
        res["input_error"] = str(exc)
    # a question only rank 1 asks (it found a folder rank 0 had just made): an error, not a hang
    os.environ["TORCHMIGRATE_INPUT_WAIT"] = "2"
    res["input_alone"] = None
    if r == 1:
        try:
            tm.input("remove the folder? ")
        except RuntimeError as exc:
            res["input_alone"] = "rank 0 did not ask" in str(exc)
    builtins.input = asked

    # save then load on every rank: rank 1 loads what rank 0 has just saved, not the older file
    ckpt = os.path.join(outdir, "saved_then_loaded.pt")
    tm.save({"v": 1}, ckpt)
    tm.barrier()
    if r == 0:
        time.sleep(1.5)  # rank 0 is late to its second save
    tm.save({"v": 2}, ckpt)
    res["loaded_after_save"] = torch.load(ckpt)["v"]

    # bar_stream: a bar counts on every rank, drawn by the main process only
    from tqdm import tqdm
    bar = tqdm(total=5, file=tm.bar_stream())
    bar.update(3)
    res["bar_n"] = bar.n
    bar.close()
    res["bar_stream"] = "default" if tm.bar_stream() is None else "null"

    # share_params / sync_grads: DDP's two jobs, by hand, for a model that cannot be wrapped
    torch.manual_seed(10 + r)
    functional = nn.Linear(3, 2)
    tm.share_params(functional)
    res["shared_params"] = flat(functional.parameters())
    functional(torch.full((1, 3), float(r + 1))).sum().backward()
    res["own_grad"] = flat(p.grad for p in functional.parameters())
    tm.sync_grads(functional)
    res["synced_grad"] = flat(p.grad for p in functional.parameters())

    # synced: a loss computed by a method other than forward, still averaged by DDP; the
    # method's own `self(...)` reaches the real forward
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):
            return self.lin(x)

        def loss(self, x):
            return self(x).pow(2).mean()

    torch.manual_seed(0)
    with_loss = tm.wrap_model(WithLoss())
    x = torch.full((2, 3), float(r + 1))
    tm.unwrap(with_loss).loss(x).backward()
    res["method_grad"] = flat(p.grad for p in with_loss.parameters())
    with_loss.zero_grad()
    tm.synced(with_loss).loss(x).backward()
    res["synced_method_grad"] = flat(p.grad for p in with_loss.parameters())
    res["forward_after_synced"] = type(with_loss.module).forward is WithLoss.forward and \
        "forward" not in vars(with_loss.module)

    res["stream"] = tm.shard_stream(torch.arange(11)).tolist()  # equal parts, the remainder dropped
    res["dealt"] = [i for i, _ in tm.shard_stream([(i, "sample") for i in range(13)])]  # dealt at random, padded


    class Sentences:  # a dataset object whose __getitem__ takes one index (a slice would fail)
        vocab = {"a": 0}

        def __len__(self):
            return 9

        def __getitem__(self, i):
            return " ".join(["w"] * (int(i) + 1))

    part = tm.shard_stream(Sentences())
    res["dataset_part"] = [len(part[i].split()) - 1 for i in range(len(part))]
    res["dataset_part_vocab"] = part.vocab
    res["any_rank"] = [tm.any_rank(r == 1), tm.any_rank(False)]
    res["all_ranks"] = [tm.all_ranks(r == 1), tm.all_ranks(True)]
    # a total of batch means: the ranks' mean over a loader whose batch was divided (each rank ran
    # as many batches as one process), the sum over whole batches dealt out
    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    class Bar:  # a progress bar around a loader (tqdm keeps it in `.iterable`)
        def __init__(self, iterable):
            self.iterable = iterable

        def __iter__(self):
            return iter(self.iterable)

    divided = torch.utils.data.DataLoader(data, batch_size=tm.per_rank_batch(8), sampler=tm.sampler(data))
    whole_batches = torch.utils.data.DataLoader(data, batch_size=8, sampler=tm.sampler(data))
    res["batch_totals"] = [tm.reduce_batch_total(r + 1.0, over=divided),
                           tm.reduce_batch_total(r + 1.0, over=whole_batches),
                           tm.reduce_batch_total(r + 1.0, over=tm.shard_batches([1, 2, 3, 4])),
                           tm.reduce_batch_total(r + 1.0, over=Bar(Bar(divided))),
                           tm.sharded(Bar(divided))]
    # a hand-made iterator reshuffled per epoch by a method of its own, drawn alike on every rank
    import numpy as np
    np.random.seed(100 + r)  # each rank's own stream (as after tm.seed_per_rank)
    before = np.random.rand()
    np.random.seed(100 + r)
    res["agreed"] = [tm.agreed(np.random.permutation, 10).tolist() for _ in range(2)]
    res["agreed_kept_own"] = np.random.rand() == before  # the rank's own stream untouched
    # streams alike on every rank (a split drawn once before training under the program's seed):
    # the program's own draw, the numbers one process draws
    parted, tm._PER_RANK_STREAMS = tm._PER_RANK_STREAMS, False  # (as before seed_per_rank)
    kept = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    res["agreed_own"] = tm.agreed(np.random.permutation, 10).tolist()
    np.random.seed(7)
    res["agreed_own_expected"] = np.random.permutation(10).tolist()
    tm._PER_RANK_STREAMS = parted
    # after the streams parted (torch's and numpy's per rank), Python's seeded again just before a
    # split (a Trainer built a second time): that generator agrees, so the program's own draw
    torch.manual_seed(100 + r), np.random.seed(100 + r), random.seed(11)
    nodes = list(range(10))
    tm.agreed(random.shuffle, nodes)
    res["agreed_reseeded"] = nodes
    random.seed(11)
    expected = list(range(10))
    random.shuffle(expected)
    res["agreed_reseeded_expected"] = expected
    random.setstate(kept[0]), np.random.set_state(kept[1]), torch.set_rng_state(kept[2])
    # gather_list: predictions of a sharded loop gathered in rank order; of a whole loader, kept
    whole_ds = TensorDataset(torch.arange(6.0))
    shared_loader = DataLoader(whole_ds, batch_size=2, sampler=tm.sampler(whole_ds, shuffle=False))
    whole_loader = DataLoader(whole_ds, batch_size=2)
    preds = [x for (x,) in shared_loader]
    res["gather_list"] = [t.tolist() for t in tm.gather_list(preds, over=shared_loader)]
    res["gather_list_whole"] = [t.tolist() for t in tm.gather_list([x for (x,) in whole_loader], over=whole_loader)]
    # agreed and on_main inside a data-loader worker (no rank: no collective, the worker's own draw)
    class Drawing(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return tm.agreed(random.random) + tm.on_main(float, i)

    res["worker_draws"] = len([b for b in DataLoader(Drawing(), batch_size=1, num_workers=1)])
    # same_draws: an evaluation set that draws (a random crop), read whole by every rank after
    # seed_per_rank: alike on every rank, new each pass, the ranks' own streams put back
    class Cropping(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.tensor([random.random(), float(np.random.rand()), torch.rand(1).item()])

    def passes(loader):
        return [[b.tolist() for b in loader] for _ in range(2)]

    same = tm.same_draws(DataLoader(Cropping(), batch_size=2))
    own_state = torch.get_rng_state()
    res["same_draws"] = passes(same)
    res["same_draws_kept_own"] = torch.equal(own_state, torch.get_rng_state())
    res["same_draws_loader"] = [isinstance(same, DataLoader), len(iter(same)), len(same), type(same).__name__,
                                tm.same_draws(same) is same]
    res["own_draws"] = passes(DataLoader(Cropping(), batch_size=2))
    res["same_draws_workers"] = passes(tm.same_draws(DataLoader(Cropping(), batch_size=2, num_workers=1)))
    # on_main: a free run folder picked by probing, once (nested calls run in place), errors and
    # results that do not pickle
    def free_folder(root):
        for k in range(1, 50):
            d = os.path.join(root, f"run-{k:02d}")
            if not os.path.exists(d):
                os.makedirs(d)
                return d

    def outer(root):
        return tm.on_main(free_folder, root), tm.on_main(free_folder, root)

    runs = os.path.join(outdir, "runs")
    res["on_main"] = [tm.on_main(free_folder, runs), tm.on_main(outer, runs)]
    # a pick the helper shares itself (`tm.broadcast_object` after an inline probe loop): in place
    res["on_main_broadcast"] = tm.on_main(lambda: tm.broadcast_object(f"from rank {tm.rank()}"))
    try:
        tm.on_main(lambda: {}["missing"])
    except KeyError as exc:
        res["on_main_error"] = repr(exc)
    handle = tm.on_main(tempfile.TemporaryFile)  # a file object does not pickle: each rank opens its own
    res["on_main_local"] = [handle.write(b"x"), handle.closed]
    handle.close()
    tm.barrier()
    res["on_main_folders"] = sorted(os.listdir(runs))
    # an atomic save: each rank writes a temporary file of its own, the main one is moved into place
    placed = os.path.join(outdir, "placed.txt")
    fd, own = tempfile.mkstemp(dir=outdir, prefix=f"tmp{r}_")
    with os.fdopen(fd, "w") as f:
        f.write(f"rank {r}")
    tm.move_into_place(own, placed)
    tm.barrier()
    res["placed"] = open(placed).read()
    res["temps_left"] = sorted(n for n in os.listdir(outdir) if n.startswith("tmp"))

    shuffled_eval = tm.eval_sampler(list(range(9)), shuffle=True)
    res["eval_shuffled"] = [list(shuffled_eval), list(shuffled_eval)]

    # training sampler: disjoint shards, reshuffled by set_epoch
    sampler = tm.sampler(list(range(10)), shuffle=True, seed=0)
    loader = DataLoader(list(range(10)), batch_size=3, sampler=sampler)
    epochs = []
    for epoch in range(2):
        tm.set_epoch(loader, epoch)
        epochs.append([int(i) for batch in loader for i in batch])
    res["train_epochs"] = epochs
    res["train_sampler_type"] = [c.__name__ for c in type(sampler).__mro__]

    # eval sampler on an odd-length dataset + gather_for_metrics
    n = 7
    values = torch.arange(n, dtype=torch.float32) * 10
    feats = torch.stack([torch.arange(n), -torch.arange(n)], dim=1)
    es = tm.eval_sampler(values)
    tm.set_epoch(es, 5)  # must be a harmless no-op
    res["eval_indices"] = list(es)
    eloader = DataLoader(TensorDataset(values, feats), batch_size=2, sampler=es)
    preds, fs = [], []
    for v, f in eloader:
        preds.append((v + 1).to(dev))
        fs.append(f)
    preds, fs = torch.cat(preds), torch.cat(fs)
    gathered = tm.gather_for_metrics(preds)
    res["gathered"] = gathered.tolist()
    res["gathered_device"] = gathered.device.type
    res["gathered_feats"] = tm.gather_for_metrics(fs).tolist()
    d = tm.gather_for_metrics({"p": preds, "pair": (fs, fs)}, total_len=5)
    res["gathered_dict"] = [d["p"].tolist(), d["pair"][1].tolist()]
    # DistributedSampler(shuffle=False) pads; total_len drops the duplicates
    ps = tm.sampler(values, shuffle=False)
    padded = torch.cat([v for (v,) in DataLoader(TensorDataset(values), batch_size=3, sampler=ps)])
    res["padded_len"] = len(padded)
    res["gathered_padded"] = tm.gather_for_metrics(padded, total_len=n).tolist()

    # over=loader: reduced where the loader is sharded, left as it is where every rank iterates all
    # of it (an evaluation loader kept whole), so a whole set's sum is never counted once per rank
    whole = DataLoader(TensorDataset(values), batch_size=3)
    total_whole = sum(float(v.sum()) for (v,) in whole)
    total_shard = sum(float(v.sum()) for v, _ in eloader)
    res["sharded"] = [tm.sharded(whole), tm.sharded(eloader), tm.sharded(
        DataLoader(TensorDataset(values), batch_size=3, sampler=ps)), tm.sharded(list(range(3)))]
    res["over_whole"] = tm.all_reduce(total_whole, 7, over=whole)
    res["over_sharded"] = tm.all_reduce(total_shard, len(list(es)), over=eloader)
    res["over_mean"] = tm.all_reduce(total_whole, op="mean", over=whole)
    res["gathered_whole"] = tm.gather_for_metrics(torch.cat([v for (v,) in whole]), n, over=whole).tolist()

    class Meter:
        def __init__(self):
            self.sum, self.count, self.avg = 0.0, 0, 0.0

    meter = Meter()
    for (v,) in whole:
        meter.sum, meter.count = meter.sum + float(v.sum()), meter.count + len(v)
    tm.reduce_meter(meter, over=whole)
    res["meter_whole"] = [meter.sum, meter.count]
    # a meter kept across epochs (never reset), reduced after each: each epoch's gain counted once
    kept = Meter()
    for epoch in range(2):
        kept.sum, kept.count = kept.sum + (r + 1) * (epoch + 1), kept.count + 1
        tm.reduce_meter(kept)
    reset = Meter()
    for epoch in range(2):
        reset.sum, reset.count = float(r + 1), 1  # reset each epoch, then one update
        tm.reduce_meter(reset)
    res["meter_kept"] = [kept.sum, kept.count, reset.sum, reset.count]
    # a segmentation meter: per-class sums in a numpy array, an int count, a rounded avg
    import numpy as np

    class DiceAverage:
        def __init__(self, n):
            self.sum, self.count, self.avg = np.zeros(n), 0, np.zeros(n)

    dice = DiceAverage(2)
    dice.sum, dice.count = dice.sum + np.asarray([r + 1.0, 2.0 * r]), dice.count + 1
    dice.avg = np.around(dice.sum / dice.count, 4)
    tm.reduce_meter(dice)
    res["meter_arrays"] = [dice.sum.tolist(), int(dice.count), dice.avg.tolist()]

    # save: only rank 0 writes; every rank then loads rank 0's file
    ckdir = os.path.join(outdir, "ckpt")
    os.makedirs(ckdir, exist_ok=True)
    tm.save({"rank": r, "w": torch.full((2,), float(r))}, os.path.join(ckdir, "model.pt"))
    tm.barrier()
    res["loaded_rank"] = tm.load(os.path.join(ckdir, "model.pt"))["rank"]

    # DDP: same parameters on every rank after steps on different data
    tm.seed_everything(0, per_rank=True)  # different init per rank; DDP must broadcast rank 0's
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    res["params_init"] = flat(plain.parameters())
    model = tm.wrap_model(plain)
    res["is_ddp"] = isinstance(model, DistributedDataParallel)
    res["wrap_twice_same"] = tm.wrap_model(model) is model
    res["unwrap_is_plain"] = tm.unwrap(model) is plain
    # a profiler's per-module counters (thop: model.apply registers `total_ops` on each module,
    # the wrapper last, after its module already has one), then removed again
    model.apply(lambda m: m.register_buffer("total_ops", torch.zeros(1)))
    res["counters_everywhere"] = all("total_ops" in m._buffers for m in model.modules())
    for m in model.modules():
        m._buffers.pop("total_ops")
    frozen = tm.wrap_model(nn.Linear(2, 2).requires_grad_(False))
    res["frozen_wrapped"] = isinstance(frozen, DistributedDataParallel)
    # a module holding an already wrapped one: one wrapper, around the plain module
    inner = tm.wrap_model(nn.Linear(4, 4))
    holder = nn.Sequential(inner, nn.Linear(4, 1))
    outer = tm.wrap_model(holder)
    res["nested_ddp"] = sum(isinstance(m, DistributedDataParallel) for m in outer.modules())
    res["inner_released"] = inner.reducer is None  # (the program's own reference: a pass-through now)
    outer(torch.randn(2, 4).to(dev)).sum().backward()
    res["nested_grads"] = flat(p.grad for p in outer.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + r)
    x, y = torch.randn(16, 4, generator=g).to(dev), torch.randn(16, 1, generator=g).to(dev)
    res["params_before"] = flat(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    res["params_after"] = flat(model.parameters())
    # a loss module's own parameter (a proxy) stepped by the model's optimizer: no wrapper holds it,
    # its gradient averaged before each step (and rank 0's value taken first: each rank drew its own);
    # a parameter with an optimizer of its own (a SAC temperature, a per-task copy): left per rank
    proxy = nn.Parameter(torch.randn(1, 4).to(dev))
    alone = nn.Parameter(torch.zeros(1).to(dev))
    embed = tm.wrap_model(nn.Linear(4, 1).to(dev))
    both = torch.optim.SGD([{"params": embed.parameters()}, {"params": [proxy]}], lr=0.1)
    solo = torch.optim.SGD([alone], lr=0.1)
    for _ in range(2):
        both.zero_grad(), solo.zero_grad()
        (nn.functional.mse_loss(embed(x), y) + (proxy * x).sum().pow(2) * 1e-3 + (alone - y.mean()) ** 2).backward()
        both.step(), solo.step()
    res["stray_proxy"] = flat([proxy])
    res["stray_alone"] = flat([alone])

    # no_sync: local grads inside, all-reduced accumulated grads after a synced backward
    opt.zero_grad()
    with tm.no_sync(model, sync=False):
        nn.functional.mse_loss(model(x), y).backward()
    res["grads_nosync"] = flat(p.grad for p in model.parameters())
    with tm.no_sync(model, sync=True):
        nn.functional.mse_loss(model(x), y).backward()
    res["grads_synced"] = flat(p.grad for p in model.parameters())

    # a project object (not a module) that holds the trained module: its module is wrapped in
    # place (the frozen EMA copy is not), so training through its method averages gradients
    class Holder:
        def __init__(self, net):
            self.model = net
            self.ema = copy.deepcopy(net).requires_grad_(False)

        def step_loss(self, xb, yb):
            return nn.functional.mse_loss(self.model(xb), yb)

    torch.manual_seed(5)
    holder = tm.wrap_model(Holder(nn.Linear(4, 1)))
    holder_opt = torch.optim.SGD(holder.model.parameters(), lr=0.1)
    holder_opt.zero_grad()
    holder.step_loss(torch.randn(4, 4) + tm.rank(), torch.randn(4, 1)).backward()
    holder_opt.step()
    res["holder_wrapped"] = (isinstance(holder.model, torch.nn.parallel.DistributedDataParallel)
                             and not isinstance(holder.ema, torch.nn.parallel.DistributedDataParallel))
    res["holder_params"] = flat(holder.model.parameters())

    # checkpoint of a DDP model loads into a plain one
    sd_path = os.path.join(outdir, "ddp_state.pt")
    res["state_keys_plain"] = not any(k.startswith("module.") for k in model.state_dict())
    # names as in one process, so an EMA copy of tm.unwrap(model) matches them by name
    res["names_plain"] = ([n for n, _ in model.named_parameters()] == [n for n, _ in tm.unwrap(model).named_parameters()]
                          and not any(n.startswith("module.") for n, _ in model.named_buffers()))
    tm.save(model.state_dict(), sd_path)
    tm.barrier()
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    missing, unexpected = tm.load_state_dict(fresh, tm.load(sd_path))
    res["reload_ok"] = (not missing and not unexpected
                        and flat(fresh.parameters()) == res["params_after"])

    # main_process_first: rank 0 downloads, the other rank finds the file complete
    with tm.main_process_first():
        res["download_found"] = fake_download(os.path.join(outdir, "data"), r)
    with open(os.path.join(outdir, "data", "data.bin")) as f:
        res["download_content"] = f.read()

    writer = tm.main_only(Writer, os.path.join(outdir, f"writer{r}.txt"))
    writer.add_scalar("loss", 1.0, 0)  # a real call on rank 0, absorbed elsewhere
    writer.close()
    res["main_only"] = type(writer).__name__

    # gradient accumulation whose last window is cut short: the leftover step after the loop uses
    # gradients accumulated under no_sync that no backward averaged
    accum = tm.wrap_model(torch.nn.Linear(3, 1))
    accum_opt = torch.optim.SGD(accum.parameters(), lr=0.5)
    xs = torch.randn(6, 3, generator=torch.Generator().manual_seed(7 + r))  # each rank its own data
    for i in range(3):
        with tm.no_sync(accum, sync=(i + 1) % 2 == 0):
            accum(xs[2 * i:2 * i + 2]).sum().backward()
        if (i + 1) % 2 == 0:
            accum_opt.step()
            accum_opt.zero_grad()
    accum_opt.step()
    res["accum_params"] = [p.detach().flatten().tolist() for p in accum.parameters()]
    with open(os.path.join(outdir, f"rank{r}.json"), "w") as f:
        json.dump(res, f)
    tm.barrier()
    tm.cleanup()
    tm.cleanup()
    with open(os.path.join(outdir, f"rank{r}.done"), "w") as f:
        f.write(str(dist.is_initialized()))


if __name__ == "__main__":
    main(sys.argv[1])

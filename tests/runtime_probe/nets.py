"""Probe launched by tests/test_runtime_dist.py: the runtime's safety nets under torchrun.

No tm.setup() call: the first helper that needs the group sets it up. Models whose training
steps DDP alone cannot run (a head the loss never reads, a parameter used outside forward, a step
written as submodule calls) still train identically on every rank; a file written by rank 1
through a helper is named; parameters that drift apart are named; a pickled wrapper is the plain
module. Writes <outdir>/rank<R>.json."""
import copy
import gc
import io
import json
import os
import sys

import torch
from torch import nn

import torchmigrate.runtime as tm
import nets_helpers  # its top-level tm.cleanup() runs now


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 3)  # computed, never read by the loss
        self.scale = nn.Parameter(torch.ones(1))  # used outside forward

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


class LazyCell(nn.Module):
    """Registers its weight in its first forward (a cell sized by the first input it sees)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if not hasattr(self, "w"):
            self.register_parameter("w", nn.Parameter(torch.randn(4, 1)))
        return self.fc(x) @ self.w


class Configured(nn.Module):
    """Attributes of its own: `type` (named like Module.type) chooses the loss, `batch_size` set
    from outside between steps and read by forward."""

    def __init__(self, kind):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.type = kind
        self.batch_size = 6

    def forward(self, x):
        return self.fc(x.view(self.batch_size, -1))


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.decoder = nn.Linear(8, 1)

    def forward(self, x):
        return self.decoder(torch.relu(self.encoder(x)))


class SkipGram(nn.Module):
    def __init__(self, unused):
        super().__init__()
        self.u = nn.Embedding(20, 4, sparse=True)
        self.v = nn.Embedding(20, 4, sparse=True)
        self.aux = nn.Linear(4, 1) if unused else None

    def forward(self, a, b):
        return -torch.nn.functional.logsigmoid((self.u(a) * self.v(b)).sum(1)).mean()


class Tabular(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeds = nn.Embedding(10, 4)
        self.transformer = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.transformer(x))


class ActNormed(nn.Module):
    """Glow's ActNorm: its first training forward sets the bias from the batch it sees."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.register_buffer("initialized", torch.zeros(1))
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if self.training and self.initialized.item() == 0:
            with torch.no_grad():
                self.bias.data.copy_(-x.mean(0))
                self.initialized += 1
        return self.fc(x + self.bias)


class SparseGraph(nn.Module):
    """A full-batch graph model whose forward takes sparse features (VGAE)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, features):
        return self.fc(torch.sparse.mm(features, torch.eye(4)))


class SelfUpdating(nn.Module):
    """A GAN whose forward runs its own backward passes, per mode (FUNIT's shape): the
    discriminator's two, the second after a retained graph, and the generator's one."""

    def __init__(self):
        super().__init__()
        self.gen, self.dis = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, mode):
        if mode == "dis":
            real = self.dis(x).mean()
            real.backward(retain_graph=True)
            fake = self.dis(self.gen(x).detach()).mean()
            (-fake).backward()
            return (real - fake).detach()
        loss = -self.dis(self.gen(x)).mean()
        loss.backward()
        return loss.detach()


def self_updating_steps(model, batches):
    """Alternating discriminator and generator steps, each optimizer stepping what the forward
    left in the gradients."""
    plain = tm.unwrap(model)
    d_opt = torch.optim.SGD(plain.dis.parameters(), lr=0.1)
    g_opt = torch.optim.SGD(plain.gen.parameters(), lr=0.1)
    for x in batches:
        d_opt.zero_grad()
        model(x, "dis")
        d_opt.step()
        g_opt.zero_grad()
        model(x, "gen")
        g_opt.step()


class BufferWeights(nn.Module):
    """Weights kept as trainable buffers (a MetaModule, for second-order meta-learning)."""

    def __init__(self):
        super().__init__()
        ref = nn.Linear(4, 1)
        self.register_buffer("weight", ref.weight.data.clone().requires_grad_(True))
        self.register_buffer("bias", ref.bias.data.clone().requires_grad_(True))

    def params(self):
        return [self.weight, self.bias]

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class Bypassed(nn.Linear):
    """A model the probe trains around its wrapper."""


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def main(outdir):
    res = {}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + tm.rank())  # each rank its own batches

    # first, before anything installs the runtime's optimizer-step hook (this wrap sets up the
    # group lazily): a parameter registered in the first forward, after the wrap, on ranks seeded
    # apart, stepped by an optimizer built again after that forward (as such programs do): rank
    # 0's start, then gradients averaged by hand
    torch.manual_seed(2000 + tm.rank())
    lazy = tm.wrap_model(LazyCell())
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    own = torch.Generator().manual_seed(300 + tm.rank())
    for step in range(3):
        opt.zero_grad()
        out = lazy(torch.randn(6, 4, generator=own))
        if step == 0:
            opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
        out.pow(2).mean().backward()
        opt.step()
    res["lazy"] = flat(tm.unwrap(lazy))
    torch.manual_seed(0)

    heads = tm.wrap_model(TwoHeads())
    res["rank"] = tm.rank()
    opt = torch.optim.SGD(heads.parameters(), lr=0.1)
    for _ in range(3):
        out, _aux = heads(torch.randn(6, 4, generator=g))
        loss = (out * heads.scale).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    res["heads_mode"] = heads._tm_mode
    res["type_name"] = type(heads).__name__  # "TwoHeads", as in one process
    # `type(model)()` (a fresh copy for early stopping): a plain TwoHeads, as in one process
    fresh = type(heads)()
    res["fresh"] = [type(fresh).__name__, isinstance(fresh, nn.parallel.DistributedDataParallel),
                    sorted(fresh.state_dict()) == sorted(tm.unwrap(heads).state_dict())]
    seq = tm.wrap_model(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)))
    res["sequential"] = [len(seq), type(seq[-1]).__name__, [type(m).__name__ for m in seq]]
    res["heads"] = flat(heads.module)

    plain = tm.wrap_model(Plain())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(6, 4, generator=g)
        # the even steps go around the wrapper's forward, through its submodules
        y = plain(x) if step % 2 else plain.decoder(torch.relu(plain.encoder(x)))
        opt.zero_grad()
        y.pow(2).mean().backward()
        opt.step()
    res["plain_mode"] = plain._tm_mode
    res["plain"] = flat(plain.module)

    routed = tm.wrap_model(Plain())  # a step written as submodule calls, the first through tm.synced
    opt = torch.optim.SGD(routed.parameters(), lr=0.1)
    for _ in range(3):
        h = torch.relu(tm.synced(routed).encoder(torch.randn(6, 4, generator=g)))
        opt.zero_grad()
        tm.unwrap(routed).decoder(h).pow(2).mean().backward()
        opt.step()
    res["routed"] = flat(routed.module)

    # a discriminator with BatchNorm called on two batches before one backward (a GAN's step),
    # for 3 steps: the second call must not overwrite the statistics the first call's graph needs
    critic = tm.wrap_model(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    for _ in range(3):
        real, fake = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        (critic(real).mean() - critic(fake).mean()).backward()
        opt.step()
    res["critic_mode"] = critic._tm_mode
    res["critic"] = flat(critic.module)

    # models kept in a dict and a list, trained by one optimizer and called by key: each module
    # wrapped in place, the containers kept (other references see the wrappers)
    torch.manual_seed(7)
    nets_by_key = {"rep": nn.Linear(4, 8), "left": nn.Linear(8, 2), "right": nn.Linear(8, 2), "tag": "kept"}
    members = [nn.Linear(4, 1), nn.Linear(4, 1)]
    params = [p for key in ("rep", "left", "right") for p in nets_by_key[key].parameters()]
    params += [p for m in members for p in m.parameters()]
    same_dict, same_list = tm.wrap_model(nets_by_key), tm.wrap_model(members)
    pair = tm.wrap_model((nn.Linear(4, 1), 3))
    twice = nn.Linear(4, 1)
    aliased = tm.wrap_model({"a": twice, "b": twice})  # one module under two keys: one wrapper
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(3):
        x = torch.randn(6, 4, generator=g)
        rep = torch.relu(nets_by_key["rep"](x))
        loss = nets_by_key["left"](rep).pow(2).mean() + nets_by_key["right"](rep).abs().mean()
        loss = loss + sum(m(x).pow(2).mean() for m in members)
        opt.zero_grad()
        loss.backward()
        opt.step()
    res["containers"] = {
        "kept": [same_dict is nets_by_key, same_list is members, nets_by_key["tag"], type(pair).__name__, pair[1],
                 aliased["a"] is aliased["b"]],
        "wrapped": [[type(v).__name__, isinstance(v, nn.parallel.DistributedDataParallel)]
                    for v in (*nets_by_key.values(), *members, pair[0]) if isinstance(v, nn.Module)],
        "keys": sorted(nets_by_key["rep"].state_dict()),
        "params": {k: flat(nets_by_key[k]) for k in ("rep", "left", "right")} | {"members": flat(members[1])},
    }

    late = tm.wrap_model(Plain())
    torch.manual_seed(1000 + tm.rank())  # initialised after the wrap, on ranks seeded apart
    for m in tm.unwrap(late).modules():
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    opt = torch.optim.SGD(late.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        late(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    res["late_init"] = flat(late.module)
    # the bare module of a live wrapper, wrapped again (a training method handed the module): the
    # same wrapper, so one reducer averages its gradients
    res["rewrapped"] = tm.wrap_model(tm.unwrap(late)) is late

    # a backbone frozen when the model is wrapped and unfrozen later (fine-tuning): DDP never
    # registered it, so its gradients are averaged by hand before each step
    torch.manual_seed(9)
    tuned = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    tuned[0].requires_grad_(False)
    tuned = tm.wrap_model(tuned)
    opt = torch.optim.SGD(tuned.parameters(), lr=0.1)
    for step in range(4):
        if step == 2:
            tm.unwrap(tuned)[0].requires_grad_(True)
        opt.zero_grad()
        tuned(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    res["unfrozen"] = flat(tm.unwrap(tuned))


    # the model's own attributes through the wrapper: read (`type` is not Module.type) and set
    # (on the module, whose forward reads it)
    configured = tm.wrap_model(Configured("binary"))
    opt = torch.optim.SGD(configured.parameters(), lr=0.1)
    seen = [configured.type]
    for rows in (6, 3):
        configured.batch_size = rows
        opt.zero_grad()
        configured(torch.randn(rows, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    configured.type = "multi"
    seen += [tm.unwrap(configured).type, tm.unwrap(configured).batch_size, configured.batch_size]
    res["configured"] = seen

    # a data-dependent init in the first forward, from each rank's own batch
    normed = tm.wrap_model(ActNormed())
    opt = torch.optim.SGD(normed.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        normed(torch.randn(6, 4) + tm.rank()).pow(2).mean().backward()
        opt.step()
    res["data_init"] = flat(normed.module)

    # sparse inputs through the drift check's comparison of the step's inputs
    graph = tm.wrap_model(SparseGraph())
    opt = torch.optim.SGD(graph.parameters(), lr=0.1)
    features = torch.eye(6, 4).to_sparse()
    for _ in range(3):
        opt.zero_grad()
        graph(features).pow(2).mean().backward()
        opt.step()
    res["sparse_inputs"] = flat(graph.module)

    # word2vec: sparse embedding gradients trained by SparseAdam, with and without a head the
    # loss never reads (the second averages by hand every step, the first only the probe step)
    for name, unused in (("sparse", False), ("sparse_manual", True)):
        torch.manual_seed(3)
        skipgram = tm.wrap_model(SkipGram(unused))
        sparse_opt = torch.optim.SparseAdam([*tm.unwrap(skipgram).u.parameters(),
                                             *tm.unwrap(skipgram).v.parameters()], lr=0.1)
        for _ in range(3):
            a, b = torch.randint(0, 20, (8,), generator=g), torch.randint(0, 20, (8,), generator=g)
            sparse_opt.zero_grad()
            skipgram(a, b).backward()
            sparse_opt.step()
        res[name] = flat(tm.unwrap(skipgram))
        res[name + "_mode"] = skipgram._tm_mode

    # distillation: the optimizer trains a ModuleList (the student and an embedding), wrapped;
    # training calls the student through another list, never through the wrapped one
    torch.manual_seed(5)
    student, embed = nn.Linear(4, 3), nn.Linear(3, 2)
    module_list = nn.ModuleList([student, embed, nn.Linear(4, 3).requires_grad_(False)])
    trainable = tm.wrap_model(nn.ModuleList([student, embed]))
    opt = torch.optim.SGD(trainable.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randn(6, 4, generator=g)
        (module_list[1](module_list[0](x)).pow(2).mean() + module_list[2](x).sum()).backward()
        opt.step()
    res["container_mode"] = trainable._tm_mode
    res["container"] = flat(tm.unwrap(trainable))

    # SAINT's step: embeddings computed through tm.unwrap before the first call through the
    # wrapper (tm.synced): the first step's check of the weights must not write them in place
    torch.manual_seed(4)
    tabular = tm.wrap_model(Tabular())
    opt = torch.optim.SGD(tabular.parameters(), lr=0.1)
    for _ in range(2):
        e = tm.unwrap(tabular).embeds(torch.randint(0, 10, (6,), generator=g))
        opt.zero_grad()
        tm.unwrap(tabular).head(tm.synced(tabular).transformer(e)).pow(2).mean().backward()
        opt.step()
    res["tabular"] = flat(tm.unwrap(tabular))

    # a TorchScript model (dvector's `torch.jit.script(model)` before the wrap)
    torch.manual_seed(6)
    scripted = tm.wrap_model(torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))))
    opt = torch.optim.SGD(scripted.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        scripted(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    res["scripted"] = flat(tm.unwrap(scripted))

    # a loss summed over the batch (reduction="sum"), each rank half of the original batch:
    # summed gradients make the step one process takes on the whole batch
    torch.manual_seed(9)
    reference = nn.Linear(4, 1)
    summed = tm.wrap_model(copy.deepcopy(reference), loss_reduction="sum")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (summed, reference))
    shared = torch.Generator().manual_seed(11)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=shared), torch.randn(8, 1, generator=shared)
        mine = slice(4 * tm.rank(), 4 * tm.rank() + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(summed(x[mine]), y[mine], reduction="sum").backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y, reduction="sum").backward()
        ref_opt.step()
    res["summed"], res["summed_reference"], res["summed_mode"] = flat(tm.unwrap(summed)), flat(reference), summed._tm_mode

    # a forward that runs its own backwards: each rank's half of the batch, averaged, makes the
    # steps one process takes on the whole batch (the losses are means)
    torch.manual_seed(13)
    reference = SelfUpdating()
    updating = tm.wrap_model(copy.deepcopy(reference))
    shared = torch.Generator().manual_seed(17)
    batches = [torch.randn(6, 4, generator=shared) for _ in range(3)]
    self_updating_steps(updating, [x[3 * tm.rank():3 * tm.rank() + 3] for x in batches])
    self_updating_steps(reference, batches)
    res["self_updating"], res["self_updating_reference"] = flat(tm.unwrap(updating)), flat(reference)
    res["self_updating_mode"] = updating._tm_mode

    # a model whose weights are trainable buffers: no DDP, its gradients averaged at each step,
    # from rank 0's start (each rank built its own random weights)
    torch.manual_seed(21 + tm.rank())
    meta = tm.wrap_model(BufferWeights())
    opt = torch.optim.SGD(tm.unwrap(meta).params(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        meta(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()
    res["buffer_weights"] = torch.cat([b.detach().reshape(-1) for b in meta.buffers()]).tolist()

    # trained through another reference (an alias the wrap did not rebind): said once, on rank 0
    bypassed_plain = Bypassed(4, 1)
    kept = tm.wrap_model(bypassed_plain)  # noqa: F841 (bound, as the alias of the program was)
    opt = torch.optim.SGD(bypassed_plain.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        bypassed_plain(torch.randn(3, 4, generator=g)).sum().backward()
        opt.step()
        if step == 1:  # an evaluation through the wrapper, with gradients on: training still goes around it
            kept(torch.randn(3, 4, generator=g))
    res["bypassed"] = flat(bypassed_plain)  # averaged before each step: equal on every rank

    buffer = io.BytesIO()
    torch.save(plain, buffer)  # the wrapper pickles as the plain module
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    res["pickled_type"] = type(loaded).__name__
    res["deepcopy_type"] = type(copy.deepcopy(plain)).__name__

    # an evaluation from a thread pool (YOLO's Evaluator): the first no-grad forward takes rank
    # 0's BatchNorm buffers, once per rank, however the threads race into the wrapper
    normed_eval = tm.wrap_model(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(normed_eval.parameters(), lr=0.1)
    normed_eval(torch.randn(6, 3)).sum().backward()
    opt.step()
    normed_eval.eval()

    def one(i):
        with torch.no_grad():
            return float(normed_eval(torch.ones(1, 3) * i).sum())

    from multiprocessing.dummy import Pool as ThreadPool
    with ThreadPool(4) as pool:
        res["threaded_eval"] = len(pool.map(one, range(16)))
    res["threaded_eval_buffers"] = tm.unwrap(normed_eval)[1].running_mean.tolist()

    meter = nets_helpers.Meter()
    meter.update(float(tm.rank() + 1), n=2)
    tm.reduce_meter(meter)
    res["meter"] = [meter.sum, meter.count, meter.avg]
    results = nets_helpers.ResultMeter()
    results.update(1.0 + tm.rank(), 0.5, n=2)
    tm.reduce_meter(results)
    results.update(1.0, 1.0)  # still accumulating: reduced again by what it gained
    tm.reduce_meter(results)
    res["result_meter"] = [results.count, results.sum_rmse, results.sum_mae]

    nets_helpers.write_summary(os.path.join(outdir, "summary.txt"), "done")

    same = tm.wrap_model(nn.Linear(4, 1))  # every rank trains on the same batches
    opt = torch.optim.SGD(same.parameters(), lr=0.1)
    shared = torch.Generator().manual_seed(7)
    for _ in range(12):
        same(torch.randn(5, 4, generator=shared)).sum().backward()
        opt.step()
        opt.zero_grad()

    drifting = tm.wrap_model(nn.Linear(3, 1))
    opt = torch.optim.SGD(drifting.parameters(), lr=0.1 * (tm.rank() + 1))  # per-rank lr
    for _ in range(12):
        drifting(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()

    # a wrapper the program dropped inside a reference cycle, freed by the collector on rank 0
    # only: cleanup's last comparison of the wrapped models must not wait for it on rank 1
    gc.disable()
    dropped = [tm.wrap_model(nn.Linear(2, 2))]
    dropped.append(dropped)
    del dropped
    if tm.rank() == 0:
        gc.collect()

    with open(os.path.join(outdir, f"rank{tm.rank()}.json"), "w") as f:
        json.dump(res, f)
    tm.cleanup()
    gc.enable()


if __name__ == "__main__":
    main(sys.argv[1])

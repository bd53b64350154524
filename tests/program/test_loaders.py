"""The loader facts (`program.loaders`) without any rule: where loaders are built, what they
load and how they sample, where they are visible and iterated, across the modules of a program."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst

from torchmigrate.engine.process import run_rules
from torchmigrate.program.build import build
from torchmigrate.program.loaders import header_loop, loader_facts, loops_of, refs_at
from torchmigrate.rule import Options
from torchmigrate.rules import select


def facts_of(source: str, view=None, rules=(), mode="ddp"):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    ctx = run_rules(module, "x.py", Options(mode=mode), list(rules), view)
    return ctx, loader_facts(ctx)


def test_where_loaders_are_built_and_what_they_load():
    ctx, facts = facts_of("""
        from torch.utils.data import DataLoader as DL

        train_loader = DL(train_set, 32, True)

        def get_test_loader(root):
            return DL(MNIST(root, train=False), batch_size=100)

        class Trainer:
            def build(self):
                self.val_loader = DL(val_set, batch_size=8, shuffle=False)

        loaders = {split: DL(sets[split], shuffle=split == "train") for split in ["train", "val"]}
    """)
    train, test, val, both = facts.loaders
    assert [x.index for x in facts.loaders] == [0, 1, 2, 3]
    assert (train.target, train.kind, train.scope) == ("train_loader", "train", ctx.module)
    assert [cst.Module([]).code_for_node(x) for x in (train.dataset, train.shuffle)] == ["train_set", "True"]
    assert test.target is None and test.kind == "eval" and test.scope.name.value == "get_test_loader"
    assert facts.returns() == {"get_test_loader": {None: [test]}}
    assert (val.target, val.kind, val.eval) == ("self.val_loader", "eval", True)
    assert both.kind == "mixed" and both.condition == 'split == "train"' and both.eval is None
    assert both.bound == ("loaders['train']", "loaders['val']")
    assert all(x.status == "plain" for x in facts.loaders)


def test_how_loaders_sample():
    _ctx, facts = facts_of("""
        import torch
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, WeightedRandomSampler

        class Stream(IterableDataset):
            pass

        sampler = DistributedSampler(ds, shuffle=True)
        a = DataLoader(ds, sampler=sampler)
        b = DataLoader(ds, sampler=WeightedRandomSampler(w, len(w)))
        c = DataLoader(Stream())
        d = DataLoader(*args)
        e = DataLoader(batch_size=4)
        f = DataLoader(ds, **options)
        g = DataLoader(ds, sampler=MySampler(ds, rank=rank, world_size=world))
        h = DataLoader(ds, sampler=torch.utils.data.DistributedSampler(ds, shuffle=False))
    """)
    by = {x.target: x for x in facts.loaders}
    assert {t: x.status for t, x in by.items()} == {
        "a": "distributed", "b": "custom", "c": "iterable", "d": "unknown", "e": "unknown", "f": "unknown",
        "g": "sharded", "h": "distributed"}
    assert by["a"].sampler_shuffles and by["a"].sampler_name == (_ctx.module, "sampler")
    assert not by["h"].sampler_shuffles and by["h"].inline_distributed
    assert by["b"].custom_param == "sampler" and by["b"].custom_arg is not None
    assert [by[t].unknown for t in "def"] == ["star-args", "no-dataset", "kwargs"]
    assert cst.Module([]).code_for_node(by["f"].kwargs_arg) == "options"


def test_where_loaders_are_visible_and_iterated():
    ctx, facts = facts_of("""
        import torch
        from torch.utils.data import DataLoader

        def get_loaders():
            train_loader = DataLoader(train_set, shuffle=True)
            val_loader = DataLoader(val_set)
            return train_loader, val_loader

        def train_one_epoch(model, loader):
            for x in loader:
                model(x).sum().backward()

        @torch.no_grad()
        def evaluate(model, loader):
            for x in loader:
                model(x)

        trn, vl = get_loaders()
        for epoch in range(3):
            train_one_epoch(model, trn)
            evaluate(model, vl)
    """)
    train, val = facts.loaders
    assert {r.text for r in train.refs} == {"train_loader", "trn", "loader"}
    assert {r.text for r in val.refs} == {"val_loader", "vl", "loader"}
    # every expression naming it (bindings and returns too: the rules tell iterations apart)
    uses = [cst.Module([]).code_for_node(node) for node, _ref in facts.uses(lambda x: x is train)]
    assert uses == ["train_loader", "train_loader", "loader", "trn", "trn"]
    # the pass over `trn` runs in the epoch loop, through train_one_epoch (followed by its callers)
    node = [n for n, _ in facts.uses(lambda x: x is train)][-1]
    assert [type(loop).__name__ for loop in loops_of(node, ctx, facts.function_of(node))] == ["For"]
    assert header_loop(node, ctx) is None
    assert [x.target for r in refs_at(ctx, node) for x in r.loaders] == ["train_loader"]
    # train_one_epoch's loop runs with gradients; evaluate()'s (under no_grad) does not
    assert facts.iterated_with_grad(train) and not facts.iterated_with_grad(val)


def test_frameworks_that_shard_themselves_and_distributed_files():
    # (`ddp` leaves a Lightning program alone before any rule runs; `lint` reads it)
    _ctx, lightning = facts_of("import lightning\nfrom torch.utils.data import DataLoader\nl = DataLoader(ds)\n",
                               mode="lint")
    assert lightning.skip_file and not lightning.distributed
    _ctx, ddp = facts_of("""
        import torch.distributed as dist
        from torch.utils.data import DataLoader
        dist.init_process_group("nccl")
        l = DataLoader(ds)
    """)
    assert ddp.distributed and not ddp.skip_file


def test_no_loader_no_scan():
    _ctx, facts = facts_of("import torch\nx = torch.zeros(3)\n")
    assert facts.loaders == [] and facts.scan is None


def summary(facts):
    return [(x.target, x.kind, x.status, x.unknown, x.condition, x.bound, x.sampler_shuffles, x.grouped,
             sorted(r.text for r in x.refs), facts.iterated_with_grad(x)) for x in facts.loaders]


def test_facts_do_not_depend_on_the_rules_enabled():
    source = """
        from torch.utils.data import DataLoader
        def make(split):
            return DataLoader(Ds(split), batch_size=num_neg + 1, shuffle=split == "train")
        train_loader = make("train")
        loaders = {"train": DataLoader(a, shuffle=True), "test": DataLoader(b)}
        for epoch in range(2):
            for batch in train_loader:
                step(batch)
    """
    _ctx, alone = facts_of(source)
    _ctx, with_rules = facts_of(source, rules=select(command="ddp"))
    assert summary(alone) == summary(with_rules)


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text).lstrip("\n"))


def test_a_loader_built_in_data_py_and_iterated_in_train_py(tmp_path):
    write(tmp_path, {
        "data.py": """
            from torch.utils.data import DataLoader

            class AudioLoader(DataLoader):
                pass

            def get_loader(split, batch_size):
                return DataLoader(Points(split), batch_size=batch_size, shuffle=split == "train")
            """,
        "train.py": """
            import torch
            import data

            train_loader = data.get_loader("train", 16)
            speech = data.AudioLoader(clips, batch_size=4, shuffle=True)
            for epoch in range(3):
                for x in train_loader:
                    model(x).sum().backward()
                for clip in speech:
                    model(clip).sum().backward()
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    # across modules: the program builds loaders, and train.py names data.py's DataLoader subclass
    assert views["train.py"].program_loaders and views["data.py"].program_loaders
    assert views["train.py"].loader_classes == {"data.AudioLoader"}
    assert views["data.py"].loader_classes == {"AudioLoader"}

    ctx, data = facts_of((tmp_path / "data.py").read_text(), views["data.py"])
    (built,) = data.loaders
    assert built.scope.name.value == "get_loader" and built.kind == "mixed"
    assert data.returns() == {"get_loader": {None: [built]}}

    ctx, train = facts_of((tmp_path / "train.py").read_text(), views["train.py"])
    # the subclass call is a loader of train.py, iterated in the epoch loop
    (speech,) = train.loaders
    assert (speech.target, speech.kind, speech.status) == ("speech", "train", "plain")
    (node,) = [n for n, _ in train.uses(lambda x: x is speech)][1:]
    loops = [lp for lp in loops_of(node, ctx, ctx.module) if lp is not header_loop(node, ctx)]
    assert [lp.target.value for lp in loops] == ["epoch"]
    # `data.get_loader(...)`'s result is not followed into train.py: the facts stop at the
    # module boundary (a runtime sampler reshuffles by itself where no set_epoch can be placed)
    assert refs_at(ctx, loops[0].body.body[0].iter) == []


def test_a_loader_read_in_dataset_order_beside_its_batches():
    """A grad-free loop over a loader in a function that also reads `loader.dataset.targets`
    (a kNN monitor's feature bank and its labels) binds the loader to dataset order; reading
    the same field of a training loader (class weights) does not."""
    _ctx, facts = facts_of("""
        import torch
        from torch.utils.data import DataLoader

        train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
        memory_loader = DataLoader(memory_set, batch_size=32)
        test_loader = DataLoader(test_set, batch_size=32)
        weights = torch.bincount(torch.tensor(train_loader.dataset.targets))

        def monitor(net):
            bank = []
            with torch.no_grad():
                for x, _ in memory_loader:
                    bank.append(net(x))
                labels = torch.tensor(memory_loader.dataset.targets)
                for x, _ in test_loader:
                    net(x)
            return bank, labels

        def train(net, opt):
            for x, y in train_loader:
                loss = net(x).sum()
                loss.backward()
                opt.step()
    """)
    train, memory, test = facts.loaders
    assert memory.ordered == "memory_loader.dataset.targets"
    assert train.ordered is None and test.ordered is None


def test_a_loop_that_uses_the_batch_size_as_a_shape():
    """`out.view(opt.batch_size, ...)` in the loop over a loader built with
    `batch_size=opt.batch_size` assumes full batches; `self.batch_size` or a keyword named
    batch_size elsewhere is not that expression, and a literal size is never tracked."""
    _ctx, facts = facts_of("""
        from torch.utils.data import DataLoader

        loader = DataLoader(train_set, batch_size=opt.batch_size, shuffle=True)
        other = DataLoader(train_set, batch_size=batch_size, shuffle=True)
        fixed = DataLoader(train_set, batch_size=64, shuffle=True)
        for x in loader:
            out = net(x).view(opt.batch_size, -1)
        for x in other:
            out = net(x, batch_size=len(x)) + self.batch_size
        for x in fixed:
            out = net(x).view(64, -1)
    """)
    loader, other, fixed = facts.loaders
    assert loader.sized_by == "opt.batch_size"
    assert other.sized_by is None and fixed.sized_by is None

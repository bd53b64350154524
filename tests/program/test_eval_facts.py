"""The facts the evaluation decision is made from, without any rule: where a loader is used in
its module (`LoaderFacts.consumers`), what a loop over it leaves behind (`loop_effects`), and
which splits of loaders other modules hand a function's parameter (`ModuleView.loader_params`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst

from torchmigrate.engine.process import run_rules
from torchmigrate.program.build import build
from torchmigrate.program.loaders import loader_facts
from torchmigrate.program.loop_effects import loop_effects
from torchmigrate.program.view import ModuleView
from torchmigrate.rule import Options
from torchmigrate.syntax.nodes import code


def context(source: str, view: ModuleView = None):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [], view)


def loader_named(ctx, target):
    return next(x for x in loader_facts(ctx).loaders if x.target == target)


USES = """
    import torch
    from torch.utils.data import DataLoader

    val_loader = DataLoader(val_ds, batch_size=8)
    test_loader = DataLoader(test_ds, batch_size=8)
    dev_loader = DataLoader(dev_ds, batch_size=8)
    extra_loader = DataLoader(extra_ds, batch_size=8)

    def evaluate(model, loader):
        for x, y in enumerate(loader):
            model(x)

    def make_holdout():
        return DataLoader(holdout_ds, batch_size=8)

    holdout = make_holdout()
    evaluate(model, val_loader)
    engine.evaluate(model, test_loader)
    print(len(dev_loader))
    preds = [model(x) for x, _ in extra_loader]
    for x, _ in holdout:
        model(x)
"""


def test_consumers_follow_uses_through_functions_and_returns_of_this_module():
    ctx = context(USES)
    facts = loader_facts(ctx)
    loops, escapes = facts.consumers(loader_named(ctx, "val_loader"))
    assert [code(loop.iter) for loop in loops] == ["enumerate(loader)"] and not escapes
    holdout = next(x for x in facts.loaders if x.target is None)
    loops, escapes = facts.consumers(holdout)
    assert [code(loop.iter) for loop in loops] == ["holdout"] and not escapes


def test_consumers_name_the_uses_that_leave_the_modules_sight():
    ctx = context(USES)
    facts = loader_facts(ctx)
    why = {t: [w for _, w in facts.consumers(loader_named(ctx, t))[1]] for t in ("test_loader", "dev_loader",
                                                                                  "extra_loader")}
    assert why["test_loader"] == ["`engine.evaluate(...)` is handed it"]
    assert why["dev_loader"] == ["`len(dev_loader)` counts its batches, which sharding changes"]
    assert why["extra_loader"][0].startswith("a comprehension iterates it")


def test_a_loader_returned_to_another_module_escapes():
    source = """
        from torch.utils.data import DataLoader

        def get_loader(split):
            return DataLoader(Points(split), batch_size=8)
    """
    ctx = context(source, ModuleView(is_entry=False, followed=True, called_elsewhere=frozenset({"get_loader"})))
    loader = loader_facts(ctx).loaders[0]
    assert [w for _, w in loader_facts(ctx).consumers(loader)[1]] == ["it is returned to another module"]


EFFECTS = """
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    metric = torchmetrics.Accuracy()

    @torch.no_grad()
    def evaluate(net, loader, tracker):
        correct, total = 0, 0
        losses, preds = [], []
        for i, (x, y) in enumerate(loader):
            out = net(x)
            loss = criterion(out, y)
            correct += (out.argmax(1) == y).sum().item()
            total += y.size(0)
            losses.append(loss.item())
            preds.append(out.argmax(1))
            acc = accuracy(out, y)
            score = metric(out, y)
            tracker.update(loss.item())
            self_cache[i] = out
            np.save("out.npy", out.numpy())
            print(i, acc)
            if loss > 10:
                break
        print(i, correct / total, np.mean(losses), preds)
        for x, y in other:
            pass
        return x, y

    def accuracy(a, b):
        return (a.argmax(1) == b).float().mean()

    evaluate(model, val_loader, tracker)
"""


def test_loop_effects_list_what_leaves_the_loop():
    ctx = context(EFFECTS)
    loop = ctx.nodes(cst.For)[0]
    effects = loop_effects(ctx, loop)
    # read after the loop: the counters and the loop index (`x`, `y` are rebound by a later loop)
    assert list(effects.bound) == ["i", "correct", "total"]
    assert list(effects.appended) == ["losses", "preds"]
    kept = [what for _, what in effects.kept]
    assert kept == ["`self_cache[i]` is stored", "`metric(...)` may keep what it is handed",
                    "`tracker.update(...)` may keep per-batch values in `tracker`", "`np.save(...)` writes"]
    assert code(effects.leaves_early) == "break"


def test_forwards_losses_helpers_and_printing_keep_nothing():
    ctx = context(EFFECTS)
    kept = " ".join(what for _, what in loop_effects(ctx, ctx.nodes(cst.For)[0]).kept)
    for harmless in ("net(", "criterion(", "accuracy(", "print(", ".argmax(", ".item("):
        assert harmless not in kept


def test_loader_params_say_which_splits_other_modules_hand_a_parameter(tmp_path: Path):
    (tmp_path / "engine.py").write_text(textwrap.dedent("""
        def evaluate(model, loader):
            return [model(x) for x, _ in loader]

        def run(model, loader):
            return evaluate(model, loader)
    """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import data
        from engine import evaluate, run
        train_loader, val_loader = data.get_loaders()
        evaluate(model, val_loader)
        evaluate(model, data.get_loader("test"))
        run(model, train_loader)
        run(model, some_loader)
        score = evaluate(model, test_batches)
    """))
    (tmp_path / "data.py").write_text("def get_loaders():\n    return 1, 2\n")
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    view = program.views[str((tmp_path / "engine.py").resolve())]
    # `run` hands `evaluate` what it holds itself: training loaders reach `evaluate` too
    assert view.loader_params["run"] == {"loader": frozenset({"train", "unknown"})}
    assert view.loader_params["evaluate"] == {"loader": frozenset({"eval", "train", "unknown"})}
    (tmp_path / "train.py").write_text("from engine import evaluate\nevaluate(model, val_loader)\n"
                                       "evaluate(model, train_data)\nevaluate(model, None)\n")
    view = build([tmp_path / "train.py"], [tmp_path / "train.py"]).views[str((tmp_path / "engine.py").resolve())]
    # `train_data` is not named like a loader, but the parameter takes loaders: it counts
    assert view.loader_params["evaluate"] == {"loader": frozenset({"eval", "train"})}

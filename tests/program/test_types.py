"""What a class of the program is and what an expression holds (`program.classes`,
`program.types`), and which checkpoints hold pickled objects, without any rule: the facts the
rewrites check before they act on an object (`.cuda()`, `GradScaler.step`, `map_location`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst

from torchmigrate import analysis
from torchmigrate.engine.process import run_rules
from torchmigrate.program.build import build
from torchmigrate.program.checkpoints import holds_objects
from torchmigrate.program.classes import MODULE, OPTIMIZER, OTHER, TENSOR, OptimizerWrapper
from torchmigrate.program.types import kind_of, made_by, optimizer_wrapper_of
from torchmigrate.program.view import ModuleView
from torchmigrate.rule import Options
from torchmigrate.syntax.nodes import code


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).write_text(textwrap.dedent(text).lstrip("\n"))


def context(source: str, program: ModuleView = None):
    module = cst.parse_module(textwrap.dedent(source).lstrip("\n"))
    return run_rules(module, "x.py", Options(mode="ddp"), [], program)


def receivers(ctx, method: str):
    """`{receiver source: kind}` of the calls of `method` (`x.cuda()` -> `{"x": kind}`)."""
    return {code(c.func.value): kind_of(ctx, c.func.value) for c, _ in analysis.facts(ctx).calls
            if isinstance(c.func, cst.Attribute) and c.func.attr.value == method}


def test_classes_follow_their_bases_across_modules(tmp_path):
    write(tmp_path, {
        "train.py": """
            import torch
            from losses import FocalLoss, Backbone
            from optim import Lookahead, Holder, Noam
            """,
        "losses.py": """
            import torch.nn as nn
            from base import BaseLoss
            class FocalLoss(BaseLoss):
                pass
            class Backbone(nn.Module):
                pass
            class Head(Backbone):
                pass
            class FromLibrary(somelib.Base):
                pass
            """,
        "base.py": """
            class BaseLoss(object):
                def cuda(self):
                    return self
            """,
        "optim.py": """
            import torch
            class Lookahead(torch.optim.Optimizer):
                pass
            class Holder:
                def __init__(self, params):
                    self.optimizer = torch.optim.SGD(params, lr=0.1)
                def step(self):
                    self.optimizer.step()
            class Noam:
                def __init__(self, opt):
                    self._opt = opt
                def step(self):
                    self._opt.param_groups[0]["lr"] = 0.1
                    self._opt.step()
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["train.py"].class_kinds == {"FocalLoss": OTHER, "Backbone": MODULE, "Lookahead": OPTIMIZER,
                                             "Holder": OTHER, "Noam": OTHER}
    assert views["losses.py"].class_kinds["Head"] == MODULE and "FromLibrary" not in views["losses.py"].class_kinds
    assert views["train.py"].optimizer_wrappers == {"Holder": OptimizerWrapper("optimizer", True),
                                                    "Noam": OptimizerWrapper("_opt", False)}


def test_parameters_get_the_kind_every_call_passes(tmp_path):
    write(tmp_path, {
        "train.py": """
            import torch
            from losses import Weighted
            from trainer import Trainer
            from optim import Holder
            crit = Weighted(torch.ones(4))
            opt = Holder(model.parameters())
            Trainer(opt, "name")
            Trainer(opt, "other")
            """,
        "losses.py": """
            class Weighted:
                def __init__(self, weight):
                    self.weight = weight
            """,
        "trainer.py": """
            class Trainer:
                def __init__(self, optimizer, name):
                    self.optimizer = optimizer
            """,
        "optim.py": """
            class Holder:
                def __init__(self, params):
                    self.inner = make(params)
                def step(self):
                    self.inner.step()
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["losses.py"].param_kinds == {"Weighted.__init__": {"weight": TENSOR}}
    assert views["trainer.py"].param_kinds == {"Trainer.__init__": {"optimizer": OTHER}}
    assert views["trainer.py"].param_wrappers == {"Trainer.__init__": {"optimizer": OptimizerWrapper("inner", True)}}
    ctx = context((tmp_path / "trainer.py").read_text() + "    def fit(self):\n        self.optimizer.step()\n",
                  views["trainer.py"])
    (step,) = [c for c, _ in analysis.facts(ctx).calls if code(c) == "self.optimizer.step()"]
    assert optimizer_wrapper_of(ctx, step.func.value) == OptimizerWrapper("inner", True)


def test_what_made_a_value_and_what_its_bindings_say():
    ctx = context("""
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        from torch.utils.data import DataLoader
        class Loss:
            def cuda(self):
                return self
        class Net(nn.Module):
            pass
        def run(args, table, x: torch.Tensor, loader):
            Net().cuda()
            Loss().cuda()
            table.cuda()
            x.cuda()
            torch.zeros(3).cuda()
            F.relu(x).cuda()
            (x > 0).cuda()
            crit = Loss()
            crit.cuda()
            model = Net()
            out = model(x)
            out.cuda()
            for images, (labels, meta) in loader:
                images.cuda()
                labels.cuda()
            batch = next(iter(loader))
            batch["image"].cuda()
            w = torch.ones(2)
            w = w.cuda()
            w.cuda()
    """)
    assert receivers(ctx, "cuda") == {
        "Net()": MODULE, "Loss()": OTHER, "table": None, "x": TENSOR, "torch.zeros(3)": TENSOR,
        "F.relu(x)": TENSOR, "(x > 0)": TENSOR, "crit": OTHER, "out": TENSOR, "images": TENSOR,
        "labels": TENSOR, 'batch["image"]': TENSOR, "w": TENSOR,
    }


def test_self_attributes_and_uses():
    ctx = context("""
        import torch
        class Trainer:
            def __init__(self, net, loss):
                self.bias = torch.zeros(4)
                self.loss = loss
                self.opt = torch.optim.SGD(net.parameters(), lr=0.1)
            def fit(self, net, feats):
                self.bias.cuda()
                self.loss.cuda()
                self.opt.cuda()
                net.cuda()
                feats.view(-1)
                feats.cuda()
    """)
    assert receivers(ctx, "cuda") == {"self.bias": TENSOR, "self.loss": None, "self.opt": OPTIMIZER,
                                      "net": MODULE, "feats": TENSOR}
    (store,) = [a for a in analysis.facts(ctx).assigns if code(a.targets[0].target) == "self.opt"]
    assert made_by(ctx, store.targets[0].target) is None  # a torch optimizer: not a class of the program


def loads(ctx):
    return [c for c, n in analysis.facts(ctx).calls if n == "torch.load"]


def test_a_checkpoint_of_pickled_objects_is_told_from_state_dicts():
    ctx = context("""
        import torch
        ckpt = torch.load(p1)
        optimizer = ckpt["optimizer"]
        optimizer.step()
        net = torch.load(p2)
        net.eval()
        state = torch.load(p3)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state.get("optimizer"))
        moved = torch.load(p4).to(device)
        entry = torch.load(p5)
        entry["optim"].state_dict()
    """)
    assert [holds_objects(ctx, c) for c in loads(ctx)] == [True, True, False, False, True]


def test_keys_the_program_saves_whole_objects_under(tmp_path):
    write(tmp_path, {
        "train.py": """
            import torch
            from utils import save, load
            model = Net()
            optimizer = torch.optim.Adam(model.parameters())
            save({"net": get_module(model), "optim": optimizer, "epoch": 1, "weights": model.state_dict()})
            """,
        "utils.py": """
            import torch
            def save(state):
                torch.save(state, "ckpt.pt")
            def load():
                ckpt = torch.load("ckpt.pt")
                return ckpt["optim"], ckpt["epoch"]
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["utils.py"].pickled_keys == {"net", "optim"}
    ctx = context((tmp_path / "utils.py").read_text(), views["utils.py"])
    assert [holds_objects(ctx, c) for c in loads(ctx)] == [True]

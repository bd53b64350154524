"""The program layer without any rule: which modules make up a program, and the cross-module
facts the rules read (`ModuleView`)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from torchmigrate.program import graph
from torchmigrate.program.build import build


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))


def names(paths, root):
    return sorted(str(Path(p).resolve().relative_to(root.resolve())) for p in paths)


def test_follows_siblings_packages_relative_and_star_imports(tmp_path):
    write(tmp_path, {
        "pyproject.toml": "",
        "scripts/train.py": "import helpers\nfrom pkg.engine import run\nfrom helpers import *\nimport os, torch\n",
        "scripts/helpers.py": "import numpy\n",
        "pkg/__init__.py": "from . import models\n",
        "pkg/models.py": "import torch\n",
        "pkg/engine.py": "from .utils import save\nfrom ..unrelated import x\n",
        "pkg/utils.py": "def save(): pass\n",
        "pkg/unused.py": "",
        ".venv/lib/site.py": "",
    })
    g = graph.build([tmp_path / "scripts/train.py"])
    assert names(g.modules, tmp_path) == ["pkg/__init__.py", "pkg/engine.py", "pkg/models.py", "pkg/utils.py",
                                          "scripts/helpers.py", "scripts/train.py"]


def test_an_entry_that_imports_its_own_folder_by_name_is_run_from_the_folder_above(tmp_path):
    """`src/train.py` importing `from src.models import Net` (no `__init__.py`, no markers) only
    runs as `python -m src.train` or with PYTHONPATH from the folder above `src`: its imports are
    found from there (also `utils/` beside `src/`), two levels up at most (`src/tools/train.py` importing `src.data`)."""
    write(tmp_path, {
        "copy/src/models.py": "", "copy/src/data.py": "",
        "copy/src/train.py": "from src.models import Net\nimport src.data\nimport torch\nfrom utils.ops import f\n",
        "copy/src/tools/run.py": "from src.data import f\nimport torch\n",
        "copy/utils/ops.py": "",
        "copy/other/x.py": "",
    })
    g = graph.build([tmp_path / "copy/src/train.py"])
    assert names(g.modules, tmp_path / "copy") == ["src/data.py", "src/models.py", "src/train.py", "utils/ops.py"]
    g = graph.build([tmp_path / "copy/src/tools/run.py"])
    assert names(g.modules, tmp_path / "copy") == ["src/data.py", "src/tools/run.py"]
    # a folder named like the import but not one the entry sits in is not a place it runs from
    write(tmp_path, {"copy/other/train.py": "from src.models import Net\nimport torch\n"})
    assert names(graph.build([tmp_path / "copy/other/train.py"]).modules, tmp_path / "copy") == ["other/train.py"]


def test_installed_and_standard_modules_are_not_followed(tmp_path):
    write(tmp_path, {"train.py": "import os\nimport torch\nimport json\nfrom torch.utils.data import DataLoader\n"})
    assert names(graph.build([tmp_path / "train.py"]).modules, tmp_path) == ["train.py"]


def test_project_root_is_the_nearest_marker(tmp_path):
    write(tmp_path, {"repo/setup.py": "", "repo/src/app/train.py": ""})
    assert graph.project_root(tmp_path / "repo/src/app/train.py") == (tmp_path / "repo").resolve()
    write(tmp_path, {"lone/train.py": ""})
    assert graph.project_root(tmp_path / "lone/train.py") == (tmp_path / "lone").resolve()


def test_a_script_inside_a_package_without_markers_imports_from_where_python_m_runs_it(tmp_path):
    """`experiments/forecast.py` (run as `python -m experiments.forecast` from the copy's top
    folder, with no setup.py or .git there) imports `experiments.base` and the top-level `utils`
    package: both are found from the folder that holds the `experiments` package."""
    write(tmp_path, {
        "copy/experiments/__init__.py": "", "copy/experiments/base.py": "",
        "copy/experiments/forecast.py": "from experiments.base import Experiment\nfrom utils.ops import f\nimport torch\n",
        "copy/utils/__init__.py": "", "copy/utils/ops.py": "def f(): pass\n",
    })
    assert graph.project_root(tmp_path / "copy/experiments/forecast.py") == (tmp_path / "copy").resolve()
    g = graph.build([tmp_path / "copy/experiments/forecast.py"])
    assert {"base.py", "ops.py"} <= {Path(m).name for m in g.modules}


def test_wrapped_model_flows_into_functions_and_trainer_attributes(tmp_path):
    write(tmp_path, {
        "train.py": """
            import torch
            from engine import evaluate, Trainer
            import utils
            model = Net()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            evaluate(model.to("cpu"), loader)
            utils.save_checkpoint(state=1, net=model)
            Trainer(model, optimizer).fit()
            """,
        "engine.py": """
            from utils import log_samples
            def evaluate(model, loader):
                log_samples(model)
            class Trainer:
                def __init__(self, net, opt):
                    self.net, self.opt = net, opt
            """,
        "utils.py": """
            def save_checkpoint(state, net):
                pass
            def log_samples(m):
                pass
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["train.py"].is_entry and not views["engine.py"].is_entry
    assert views["engine.py"].wrapped_params == {"evaluate": {"model"}, "Trainer.__init__": {"net"}}
    assert views["engine.py"].wrapped_attrs == {"Trainer": {"net"}}
    assert views["utils.py"].wrapped_params == {"save_checkpoint": {"net"}, "log_samples": {"m"}}
    assert all(v.program_trains and v.followed for v in views.values())


def test_a_program_that_trains_nowhere(tmp_path):
    write(tmp_path, {"infer.py": "import torch\nfrom model import Net\nNet()(torch.zeros(1))\n",
                     "model.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n"})
    program = build([tmp_path / "infer.py"], [tmp_path / "infer.py"])
    assert not any(v.program_trains for v in program.views.values())


def test_forward_outputs_name_the_submodules_behind_each_returned_value(tmp_path):
    write(tmp_path, {
        "train.py": "import nets\nfrom nets import Net as Model\nm = Model()\n",
        "nets.py": textwrap.dedent("""
            import torch
            class Net(torch.nn.Module):
                def forward(self, x):
                    h = self.body(x)
                    if self.training:
                        h = h + self.noise(h)
                    logits = self.cls(h)
                    return logits, self.aux(h)
            class Single(torch.nn.Module):
                def forward(self, x):
                    return self.body(x)
            class Starred(torch.nn.Module):
                def forward(self, x):
                    return (*self.parts(x),)
        """),
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    expected = (frozenset({"body", "noise", "cls"}), frozenset({"body", "noise", "aux"}))
    assert views["train.py"].forward_outputs == {"Model": expected, "nets.Net": expected}
    assert views["nets.py"].forward_outputs == {"Net": expected}


def test_folder_entries_are_main_scripts_and_unimported_files(tmp_path):
    write(tmp_path, {"train.py": "import common\n", "finetune.py": "import common\nif __name__ == '__main__':\n    pass\n",
                     "common.py": "import torch\n"})
    files = sorted(tmp_path.glob("*.py"))
    program = build(files, [])
    assert names(program.entries, tmp_path) == ["finetune.py", "train.py"]
    assert program.followed == []


def test_no_follow(tmp_path):
    write(tmp_path, {"train.py": "import common\n", "common.py": ""})
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"], follow=False)
    assert program.files == [tmp_path / "train.py"] and not program.views


def test_models_reach_methods_of_instances_of_the_programs_classes(tmp_path):
    write(tmp_path, {
        "exp.py": """
            import torch
            from tools import EarlyStopping, Saver
            class Exp:
                def __init__(self):
                    self.model = build()
                    self.saver = Saver()
                def train(self):
                    opt = torch.optim.Adam(self.model.parameters())
                    stopper = EarlyStopping(patience=3)
                    stopper(0.1, self.model, "ckpt")
                    self.saver.save(self.model)
            """,
        "tools.py": """
            class EarlyStopping:
                def __init__(self, patience):
                    self.patience = patience
                def __call__(self, val_loss, model, path):
                    pass
            class Saver:
                def save(self, net):
                    pass
            """,
    })
    program = build([tmp_path / "exp.py"], [tmp_path / "exp.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["tools.py"].wrapped_params == {"EarlyStopping.__call__": {"model"}, "Saver.save": {"net"}}


def test_modules_found_through_sys_path_and_pythonpath(tmp_path, monkeypatch):
    """A recipe that runs `code/bin/train.py` with `code/` on the path (appended by the script, or
    through PYTHONPATH set by its path.sh): its `solver` and `utils` packages are the program's."""
    write(tmp_path, {
        "pyproject.toml": "",
        "code/bin/train.py": "import os, sys\nsys.path.append(os.path.join(os.path.dirname(__file__), '..'))\n"
                            "from solver.solver import Solver\n",
        "code/bin/plain.py": "from utils.helpers import build\n",
        "code/solver/__init__.py": "",
        "code/solver/solver.py": "import torch\n",
        "code/utils/__init__.py": "",
        "code/utils/helpers.py": "def build(): pass\n",
    })
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert names(graph.build([tmp_path / "code/bin/train.py"]).modules, tmp_path) == [
        "code/bin/train.py", "code/solver/__init__.py", "code/solver/solver.py"]
    assert names(graph.build([tmp_path / "code/bin/plain.py"]).modules, tmp_path) == ["code/bin/plain.py"]
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "code"))
    assert names(graph.build([tmp_path / "code/bin/plain.py"]).modules, tmp_path) == [
        "code/bin/plain.py", "code/utils/__init__.py", "code/utils/helpers.py"]


def test_imports_of_project_code_found_nowhere_are_listed(tmp_path, monkeypatch, run_cli):
    """`from models.net import Net` in code/bin/train.py needs PYTHONPATH=code (a recipe's path.sh):
    without it the module is not followed, and the report must say so; installed or missing
    third-party packages (numpy, wandb) and the standard library are not listed."""
    write(tmp_path, {
        ".git": "",
        "code/models/__init__.py": "",
        "code/models/net.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n",
        "code/bin/train.py": "import os\nimport numpy\nimport wandb\nfrom models.net import Net\nfrom .helpers import x\n",
    })
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    program = build([Path("code/bin/train.py")], [Path("code/bin/train.py")])
    assert program.unresolved == ["code/bin/train.py:4: models.net", "code/bin/train.py:5: .helpers"]
    report = tmp_path / "report.json"
    result = run_cli("ddp", "--dry-run", "--report", report, "code/bin/train.py")
    assert "Not followed" in result.output and "code/bin/train.py:4: models.net" in result.output
    assert json.loads(report.read_text())["unresolved_imports"] == program.unresolved
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "code"))
    program = build([Path("code/bin/train.py")], [Path("code/bin/train.py")])
    assert program.unresolved == ["code/bin/train.py:5: .helpers"]
    assert tmp_path / "code/models/net.py" in program.followed


def test_hand_made_batch_iterators_and_their_builders(tmp_path):
    write(tmp_path, {
        "train.py": "import utils\nfrom utils import build_iterator, minibatch\n",
        "utils.py": textwrap.dedent("""
            import torch
            class DatasetIterater(object):
                def __init__(self, batches, batch_size, device):
                    self.batches = batches
                def __next__(self):
                    raise StopIteration
                def __iter__(self):
                    return self
            class Frames(torch.utils.data.IterableDataset):
                def __init__(self, files):
                    self.files = files
                def __iter__(self):
                    yield from self.files
            def build_iterator(dataset, config):
                iter = DatasetIterater(dataset, config.batch_size, config.device)
                return iter
            def minibatch(*tensors, batch_size=8):
                for i in range(0, len(tensors[0]), batch_size):
                    yield tuple(x[i:i + batch_size] for x in tensors)
            def batch_iter(config, data, size):
                for i in range(0, len(data), size):
                    yield data[i:i + size]
            class Pairs:
                def __init__(self, X, y, size):
                    self.X, self.y, self.size = X, y, size
                def __iter__(self):
                    for i in range(0, len(self.X), self.size):
                        yield self.X[i:i + self.size], self.y[i:i + self.size]
            def paired(X, y, size, opts):
                perm = torch.randperm(len(X))
                for i in range(0, len(X), opts["size"]):
                    idx = perm[i:i + size]
                    yield X[idx], y[idx]
            def helper(x):
                return x + 1
        """),
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(k).name: v for k, v in program.views.items()}
    assert views["utils.py"].iterator_builders == {"DatasetIterater": (0,), "build_iterator": (0,), "minibatch": (-1,),
                                                   "batch_iter": (1,), "paired": (0, 1), "Pairs": (0, 1)}
    assert views["train.py"].iterator_builders == {
        "utils.DatasetIterater": (0,), "utils.build_iterator": (0,), "utils.minibatch": (-1,),
        "utils.batch_iter": (1,), "utils.paired": (0, 1), "utils.Pairs": (0, 1), "build_iterator": (0,), "minibatch": (-1,)}


def test_pythonpath_of_a_copy_without_project_markers(tmp_path, monkeypatch):
    """A repository copied without `.git`: the entry src/bin/train.py has no marker above it, so
    its own folder is the root; the PYTHONPATH folders its recipe sets (src/data) still lead into
    the copy when the tool runs from its top, and are followed."""
    write(tmp_path, {
        "src/bin/train.py": "from data import AudioDataLoader\n",
        "src/data/data.py": "import torch\nclass AudioDataLoader(torch.utils.data.DataLoader):\n    pass\n",
    })
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "src/data")
    program = build([Path("src/bin/train.py")], [Path("src/bin/train.py")])
    assert program.followed == [tmp_path / "src/data/data.py"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # run from outside the copy: its folders are not the project's
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src/data"))
    program = build([tmp_path / "src/bin/train.py"], [tmp_path / "src/bin/train.py"])
    assert program.followed == []


def test_functions_and_trainer_classes_that_build_an_optimizer_over_a_model_they_receive(tmp_path):
    """`Trainer(model, loader)` whose `__init__` builds the optimizer is, for its caller, where the
    model's optimizer is created (so the caller wraps it), like `train(model, loader)`; the
    trainer's attribute then holds a wrapped model. The project's own functions and classes are
    listed as each module spells them."""
    write(tmp_path, {
        "train.py": """
            import engine
            from engine import Trainer, fit
            from model import Net
            net = Net()
            Trainer(net, None).run()
            fit(None, net)
            engine.fit(None, net)
        """,
        "engine.py": """
            import torch
            class Trainer:
                def __init__(self, model, loader):
                    self.model = model
                    self.opt = torch.optim.SGD(model.parameters(), lr=0.1)
                def run(self):
                    pass
            def fit(loader, model):
                torch.optim.Adam(model.parameters())
        """,
        "model.py": "import torch\nclass Net(torch.nn.Module):\n    pass\n",
    })
    views = build([tmp_path / "train.py"], [tmp_path / "train.py"]).views
    entry = views[str((tmp_path / "train.py").resolve())]
    engine = views[str((tmp_path / "engine.py").resolve())]
    assert entry.optimizer_builders == {"Trainer": ((0, "model"),), "fit": ((1, "model"),),
                                        "engine.Trainer": ((0, "model"),), "engine.fit": ((1, "model"),)}
    assert engine.wrapped_attrs == {"Trainer": frozenset({"model"})}
    assert {"Trainer", "engine.Trainer", "Net"} <= entry.own_classes
    assert {"fit", "engine.fit"} <= entry.own_functions and "run" not in entry.own_functions


def test_scripts_given_together_that_share_no_module_are_separate_programs(tmp_path):
    """`torchmigrate ddp *.py` over a folder of examples: one script's BCE loss, own process group
    or endless generator is no fact of another's training; checkpoint keys that hold pickled
    objects are shared (one script saves, another loads)."""
    write(tmp_path, {
        "bce.py": "import torch\nimport torch.distributed as dist\ncrit = torch.nn.BCELoss()\n"
                  "dist.init_process_group('gloo')\n",
        "plain.py": "import torch\nfrom common import step\nnet = torch.nn.Linear(2, 2)\n"
                    "opt = torch.optim.SGD(net.parameters(), lr=1)\n"
                    "torch.save({'optim': opt}, 'c.pt')\n",
        "other.py": "import torch\nfrom common import step\n",
        "common.py": "def step():\n    pass\n",
    })
    files = [tmp_path / n for n in ("bce.py", "plain.py", "other.py")]
    program = build(files, files)
    views = {Path(p).name: v for p, v in program.views.items()}
    assert views["bce.py"].amp_hazards == {} and views["bce.py"].program_distributed
    assert views["plain.py"].amp_hazards == {} and not views["plain.py"].program_distributed
    assert not views["other.py"].program_distributed
    assert all(v.pickled_keys == {"optim"} for v in views.values())
    assert sorted(sorted(Path(m).name for m in g) for g in program.groups) == [["common.py", "other.py", "plain.py"]]


def test_a_model_built_by_a_base_class_and_trained_by_a_subclass(tmp_path):
    """The base class (another module) assigns `self.model`; the subclass builds the optimizer
    over it and never assigns it: the base's module wraps it, the subclass's knows it is
    wrapped. A method called on an instance made inline reaches the class's method, or the
    base's where the class inherits it."""
    write(tmp_path, {
        "base.py": "class Base:\n    def __init__(self):\n        self.model = self.build()\n"
                   "        self.other = None\n\n    def run(self, loader):\n        pass\n",
        "sub.py": "import torch\nfrom base import Base\n\nclass Sub(Base):\n    def fit(self, loader):\n"
                  "        opt = torch.optim.SGD(self.model.parameters(), lr=1)\n\n"
                  "class Own(Base):\n    def __init__(self):\n        self.model = None\n\n    def fit(self):\n"
                  "        opt = torch.optim.SGD(self.model.parameters(), lr=1)\n",
        "train.py": "from sub import Sub\ntrain_loader = make()\nSub().fit(train_loader)\nSub().run(train_loader)\n",
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    views = {Path(p).name: v for p, v in program.views.items()}
    assert views["base.py"].base_wraps == {"Base": {"model"}}
    assert views["sub.py"].wrapped_attrs == {"Sub": {"model"}}
    assert views["sub.py"].loader_params == {"Sub.fit": {"loader": {"train"}}}
    assert views["base.py"].loader_params == {"Base.run": {"loader": {"train"}}}

"""The whole program is found: modules reached through a search path the project sets up
(`sys.path` edits in any module, PYTHONPATH in launch files, `src/` layouts, packages installed
in place) and modules loaded by name (`importlib.import_module`, `__import__`, names in the
project's configuration files). Each without any rule: `graph.build` and `build.build` only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_graph_and_facts import names, write
from torchmigrate.program import graph
from torchmigrate.program.build import build
from torchmigrate.program.fs import Recorder, unchanged, digest


@pytest.fixture(autouse=True)
def _no_pythonpath(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)


def modules(tmp_path, entry="train.py"):
    return names(graph.build([tmp_path / entry]).modules, tmp_path)


# --- sys.path edits ---------------------------------------------------------------------------

@pytest.mark.parametrize("edit", [
    "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'lib'))",
    "sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'lib'))",
    "ROOT = Path(__file__).absolute().parent.parent\nsys.path.extend([str(ROOT / 'lib')])",
    "HERE = os.path.dirname(__file__)\nsys.path += [f'{HERE}/../lib']",
    "site.addsitedir(os.path.join(os.path.dirname(__file__), '..', 'lib'))",
    "sys.path.insert(0, os.path.realpath(os.path.join(os.getcwd(), '..', 'lib')))",
    "sys.path.insert(1, os.path.join(sys.path[0], '../lib'))",
])
def test_sys_path_spellings_in_the_entry(tmp_path, edit):
    write(tmp_path, {
        ".git": "",
        "tools/train.py": f"import os, sys, site\nfrom pathlib import Path\n{edit}\nfrom solver import Solver\n",
        "lib/solver.py": "import torch\nclass Solver: pass\n",
    })
    assert modules(tmp_path, "tools/train.py") == ["lib/solver.py", "tools/train.py"]


def test_sys_path_edited_in_an_imported_module(tmp_path):
    """`import _init_paths` (a module that only puts the project's lib/ on the path) before the
    imports that need it: the edit in that module counts for the whole program."""
    write(tmp_path, {
        ".git": "",
        "tools/train.py": "import _init_paths\nfrom core.engine import train\n",
        "tools/_init_paths.py": "import os.path as osp, sys\nthis_dir = osp.dirname(__file__)\n"
                                "sys.path.insert(0, osp.join(this_dir, '..', 'lib'))\n",
        "lib/core/__init__.py": "",
        "lib/core/engine.py": "from utils.io import save\n",
        "lib/utils/__init__.py": "",
        "lib/utils/io.py": "def save(): pass\n",
    })
    assert modules(tmp_path, "tools/train.py") == [
        "lib/core/__init__.py", "lib/core/engine.py", "lib/utils/__init__.py", "lib/utils/io.py",
        "tools/_init_paths.py", "tools/train.py"]


def test_sys_path_outside_the_project_is_not_followed(tmp_path):
    write(tmp_path, {
        "proj/.git": "",
        "proj/train.py": "import sys\nsys.path.append('../other')\nfrom helper import x\n",
        "other/helper.py": "x = 1\n",
    })
    assert names(graph.build([tmp_path / "proj/train.py"]).modules, tmp_path) == ["proj/train.py"]


@pytest.mark.parametrize("run_from", ["Code/main_training", "elsewhere"])
@pytest.mark.parametrize("edit, imported, found", [
    ("sys.path.append('..')", "from utils.utils import validate", "Code/utils/utils.py"),
    ("sys.path.insert(0, '../lib')", "from solver import Solver", "Code/lib/solver.py"),
    ("sys.path.append(os.path.join(os.path.dirname(__file__), '..', '..'))", "from Code.lib.solver import Solver",
     "Code/lib/solver.py"),
    ("sys.path += [str(Path(__file__).parent.parent / 'utils')]", "import utils as U", "Code/utils/utils.py"),
])
def test_sys_path_above_a_copy_without_project_markers(tmp_path, monkeypatch, run_from, edit, imported, found):
    """A repository copied without its `.git` (no project marker anywhere): the entry's own
    `sys.path` edit to a folder above it says where its code is, wherever the tool runs from, as
    long as it stays within two folders of the script."""
    write(tmp_path, {
        "Code/main_training/main.py": f"import os, sys\nfrom pathlib import Path\n{edit}\n{imported}\n",
        "Code/utils/__init__.py": "",
        "Code/utils/utils.py": "def validate(net, loader): pass\n",
        "Code/lib/solver.py": "class Solver: pass\n",
        "elsewhere/x.txt": "",
    })
    monkeypatch.chdir(tmp_path / run_from)
    assert found in names(graph.build([tmp_path / "Code/main_training/main.py"]).modules, tmp_path)


def test_sys_path_far_above_a_copy_without_markers_is_not_followed_and_is_named(tmp_path, monkeypatch):
    """Three folders up, in a folder with nothing of a repository's top, is a home or shared
    folder, not the program's code: not followed, and listed as not followed with that folder."""
    write(tmp_path, {
        "a/b/c/train.py": "import sys\nsys.path.append('../../..')\nfrom helper import x\nimport numpy\n",
        "helper.py": "x = 1\n",
    })
    monkeypatch.chdir(tmp_path / "a/b/c")
    built = graph.build([tmp_path / "a/b/c/train.py"])
    assert names(built.modules, tmp_path) == ["a/b/c/train.py"]
    [(line, name)] = built.unresolved[tmp_path / "a/b/c/train.py"]  # numpy is not listed
    assert line == 3 and name.startswith(f"helper (in {tmp_path}, which the program puts on sys.path")


@pytest.mark.parametrize("top_file", ["README.md", ".gitignore", "requirements.txt", "LICENSE"])
@pytest.mark.parametrize("edit", ["sys.path.append('../../../../')",
                                  "sys.path.insert(0, str(Path(__file__).resolve().parents[4]))"])
def test_sys_path_far_above_to_the_top_of_a_repository_copy_is_followed(tmp_path, monkeypatch, top_file, edit):
    """`experiments/<dataset>/<method>/<backbone>/train.py` putting the repository's top on its
    path, four folders up, in a copy without `.git`: that top holds a README, a licence, a
    requirements file or a .gitignore, so it is the program's code, followed from any folder."""
    write(tmp_path, {
        top_file: "",
        "experiments/cub/frn/conv4/train.py": f"import sys\nfrom pathlib import Path\n{edit}\n"
                                              "from trainers import trainer\nfrom models.frn import FRN\n",
        "trainers/trainer.py": "def train(): pass\n",
        "models/__init__.py": "",
        "models/frn.py": "class FRN: pass\n",
    })
    monkeypatch.chdir(tmp_path / "experiments/cub/frn/conv4")
    built = graph.build([tmp_path / "experiments/cub/frn/conv4/train.py"])
    assert names(built.modules, tmp_path) == [
        "experiments/cub/frn/conv4/train.py", "models/__init__.py", "models/frn.py", "trainers/trainer.py"]
    assert not built.unresolved


@pytest.mark.parametrize("line", ["from .functions import *", "from layers.functions import *",
                                  "from .functions import prior_box", "from .functions.prior_box import PriorBox"])
def test_a_namespace_package_imported_whole_is_found(tmp_path, line):
    """`from .functions import *` where functions/ has no `__init__.py`: a namespace package,
    found (a star names no module of it), not an import left unfollowed."""
    write(tmp_path, {
        ".git": "",
        "train.py": "from layers import *\nfrom layers.functions.prior_box import PriorBox\n",
        "layers/__init__.py": line + "\n",
        "layers/functions/prior_box.py": "class PriorBox: pass\n",
    })
    built = graph.build([tmp_path / "train.py"])
    assert not built.unresolved, built.unresolved
    assert "layers/functions/prior_box.py" in names(built.modules, tmp_path)


# --- PYTHONPATH in launch files ---------------------------------------------------------------

LAYOUTS = {
    "a shell script beside the entry": {"run.sh": "#!/bin/bash\nPYTHONPATH=code python train.py --epochs 3\n"},
    "a script in scripts/ that cds to the root": {
        "scripts/train.sh": "cd ..\nexport PYTHONPATH=$PWD/code:$PYTHONPATH\npython train.py\n"},
    "a Makefile": {"Makefile": "export PYTHONPATH := $(CURDIR)/code\n\ntrain:\n\tpython train.py\n"},
    "a README code block": {"README.md": "# Usage\n\n```bash\nexport PYTHONPATH=${PYTHONPATH}:$(pwd)/code\n"
                                         "python train.py\n```\n"},
    "an sbatch file": {"slurm/job.sbatch": "#!/bin/bash\n#SBATCH -N 1\nsrun env PYTHONPATH=code python train.py\n"},
    "a path relative to the script": {"scripts/env.sh": 'export PYTHONPATH="$(dirname "$0")/../code"\n'},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pythonpath_set_by_a_launch_file(tmp_path, layout):
    write(tmp_path, {
        ".git": "",
        "train.py": "import torch\nfrom trainer import Trainer\nfrom models.net import Net\n",
        "code/trainer.py": "import json\nclass Trainer: pass\n",
        "code/models/__init__.py": "",
        "code/models/net.py": "import torch\n",
        **LAYOUTS[layout],
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    assert names(program.followed, tmp_path) == ["code/models/__init__.py", "code/models/net.py", "code/trainer.py"]
    assert program.unresolved == []


@pytest.mark.parametrize("setting", ["PYTHONPATH=/opt/shared/code python train.py",
                                     "PYTHONPATH=$CODE_DIR python train.py"])
def test_pythonpath_outside_the_project_or_unknown_is_listed_not_followed(tmp_path, setting):
    write(tmp_path, {
        ".git": "",
        "train.py": "import torch\nfrom trainer import Trainer\n",
        "code/trainer.py": "class Trainer: pass\n",
        "run.sh": setting + "\n",
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert program.followed == [] and program.unresolved == ["train.py:2: trainer"]


# --- src/ layouts and packages installed in place ---------------------------------------------

def test_src_layout(tmp_path):
    write(tmp_path, {
        "pyproject.toml": "[project]\nname = 'proj'\n",
        "scripts/train.py": "from proj.engine import fit\n",
        "src/proj/__init__.py": "",
        "src/proj/engine.py": "from .data import loaders\n",
        "src/proj/data.py": "",
    })
    assert modules(tmp_path, "scripts/train.py") == [
        "scripts/train.py", "src/proj/__init__.py", "src/proj/data.py", "src/proj/engine.py"]


def test_src_that_is_a_package_is_not_a_search_folder(tmp_path):
    """`src/__init__.py`: the code imports `src.models`, never `models` from inside it."""
    write(tmp_path, {
        ".git": "",
        "train.py": "from models import net\nfrom src.utils import log\n",
        "src/__init__.py": "",
        "src/models/__init__.py": "",
        "src/models/net.py": "",
        "src/utils.py": "",
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert names(program.followed, tmp_path) == ["src/__init__.py", "src/utils.py"]
    assert program.unresolved == ["train.py:1: models"]


INSTALLED = {
    "setup.py find_packages": {"setup.py": "from setuptools import setup, find_packages\n"
                                           "setup(name='p', package_dir={'': 'lib'}, packages=find_packages('lib'))\n"},
    "setup.py where=": {"setup.py": "import setuptools\nsetuptools.setup(packages=setuptools.find_packages(where='lib'))\n"},
    "setup.cfg package_dir": {"setup.cfg": "[metadata]\nname = p\n\n[options]\npackage_dir =\n    =lib\n"
                                            "packages = find:\n\n[options.packages.find]\nwhere = lib\n"},
    "pyproject setuptools find": {"pyproject.toml": "[tool.setuptools.packages.find]\nwhere = [\"lib\"]\n"},
    "pyproject poetry": {"pyproject.toml": "[tool.poetry]\npackages = [{include = \"proj\", from = \"lib\"}]\n"},
    "pyproject hatch": {"pyproject.toml": "[tool.hatch.build.targets.wheel]\npackages = [\"lib/proj\"]\n"},
}


@pytest.mark.parametrize("packaging", sorted(INSTALLED))
def test_packages_installed_in_place(tmp_path, packaging):
    """`pip install -e .` of the project itself: its packages import from where its packaging
    file says, from any script of the project."""
    write(tmp_path, {
        "experiments/run_train.py": "import torch\nfrom proj.solver import Solver\n",
        "lib/proj/__init__.py": "",
        "lib/proj/solver.py": "import proj.writer\n",
        "lib/proj/writer.py": "",
        **INSTALLED[packaging],
    })
    assert modules(tmp_path, "experiments/run_train.py") == [
        "experiments/run_train.py", "lib/proj/__init__.py", "lib/proj/solver.py", "lib/proj/writer.py"]


def test_package_installed_from_a_folder_of_another_name(tmp_path):
    """`package-dir = {"fancyproj" = "code"}`: `fancyproj.trainer` is code/trainer.py."""
    write(tmp_path, {
        "pyproject.toml": "[tool.setuptools]\npackage-dir = {\"fancyproj\" = \"code\"}\npackages = [\"fancyproj\"]\n",
        "train.py": "from fancyproj.trainer import Trainer\n",
        "code/__init__.py": "",
        "code/trainer.py": "",
        "code/other.py": "",
    })
    assert modules(tmp_path) == ["code/__init__.py", "code/trainer.py", "train.py"]


# --- modules loaded by name -------------------------------------------------------------------

@pytest.mark.parametrize("loader", [
    "import importlib\ntrainer = importlib.import_module('engine.trainer')",
    "from importlib import import_module as load\nNAME = 'engine.trainer'\ntrainer = load(NAME)",
    "mod = __import__('engine.trainer', fromlist=['Trainer'])",
    "import importlib\nfor name in ('engine.trainer', 'json'):\n    importlib.import_module(name)",
    "import pydoc\nTrainer = pydoc.locate('engine.trainer.Trainer')",
    "import importlib\ntrainer = importlib.import_module('.trainer', package='engine')",
])
def test_literal_module_names(tmp_path, loader):
    write(tmp_path, {
        "train.py": f"import torch\n{loader}\n",
        "engine/__init__.py": "",
        "engine/trainer.py": "class Trainer: pass\n",
        "engine/unused.py": "",
    })
    assert modules(tmp_path) == ["engine/__init__.py", "engine/trainer.py", "train.py"]


CONFIGS = {
    "json, pytorch-template style": (
        "config/train/basic.json",
        json.dumps({"trainer": {"module": "trainer.trainer", "main": "Trainer"},
                    "model": {"module": "model.unet", "main": "UNet", "args": {"ch": 4}},
                    "optimizer": {"type": "torch.optim.Adam"}, "data": "data.csv", "log": "train.log"}, indent=2)),
    "yaml with class paths": (
        "configs/exp.yaml",
        "model:\n  target: model.unet.UNet\n  params:\n    ch: 4\ntrainer:\n  class_path: \"trainer.trainer.Trainer\"\n"),
    "toml": ("conf.toml", "[trainer]\nmodule = \"trainer.trainer\"\n[model]\nmodule = 'model.unet'\n"),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_module_names_in_the_projects_configuration(tmp_path, config):
    """`importlib.import_module(cfg["module"])` in a factory: the modules the configuration
    files name are the program's; names of files, installed classes and other words are not."""
    where, text = CONFIGS[config]
    write(tmp_path, {
        ".git": "",
        "train.py": "import torch\nfrom util.utils import initialize_config\n",
        "util/utils.py": "import importlib\n\ndef initialize_config(cfg, pass_args=True):\n"
                         "    module = importlib.import_module(cfg['module'])\n    return getattr(module, cfg['main'])\n",
        "trainer/trainer.py": "from trainer.base import BaseTrainer\n",
        "trainer/base.py": "",
        "model/unet.py": "",
        "model/other.py": "",
        "data.py": "",
        "train_log.py": "",
        where: text,
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert names(program.followed, tmp_path) == ["model/unet.py", "trainer/base.py", "trainer/trainer.py",
                                                 "util/utils.py"]
    assert program.unresolved == []


def test_hydra_targets(tmp_path):
    write(tmp_path, {
        ".git": "",
        "train.py": "import hydra\nfrom hydra.utils import instantiate\n\n@hydra.main(config_path='conf')\n"
                    "def main(cfg):\n    model = instantiate(cfg.model)\n",
        "conf/config.yaml": "defaults:\n  - model: resnet\n",
        "conf/model/resnet.yaml": "_target_: src.models.resnet.ResNet\ndepth: 18\n",
        "src/__init__.py": "",
        "src/models/__init__.py": "",
        "src/models/resnet.py": "import torch\n",
    })
    assert modules(tmp_path) == ["src/__init__.py", "src/models/__init__.py", "src/models/resnet.py", "train.py"]


@pytest.mark.parametrize("call", ["importlib.import_module('models.' + args.arch)",
                                  "importlib.import_module(f'models.{args.arch}')",
                                  "importlib.import_module('models.{}'.format(args.arch))"])
def test_a_package_and_a_run_time_name(tmp_path, call):
    """`import_module("models." + args.arch)`: the modules of `models` the configuration names,
    or all of them when it names none (the call can load only these)."""
    write(tmp_path, {
        ".git": "",
        "train.py": f"import importlib, torch\nmodel = {call}\n",
        "models/__init__.py": "",
        "models/resnet.py": "",
        "models/vgg.py": "",
    })
    assert modules(tmp_path) == ["models/__init__.py", "models/resnet.py", "models/vgg.py", "train.py"]
    write(tmp_path, {"configs/r18.yml": "arch: resnet\nlr: 0.1\n"})
    assert modules(tmp_path) == ["models/__init__.py", "models/resnet.py", "train.py"]
    (tmp_path / "models/__init__.py").unlink()  # a namespace package
    assert modules(tmp_path) == ["models/resnet.py", "train.py"]


def test_a_module_loaded_from_a_file(tmp_path):
    write(tmp_path, {
        "train.py": "import importlib.util, os\nHERE = os.path.dirname(__file__)\n"
                    "spec = importlib.util.spec_from_file_location('plugin', os.path.join(HERE, 'plugins', 'aug.py'))\n",
        "plugins/aug.py": "",
    })
    assert modules(tmp_path) == ["plugins/aug.py", "train.py"]


def test_a_run_time_name_no_configuration_names_is_listed(tmp_path):
    write(tmp_path, {
        ".git": "",
        "train.py": "import torch\nfrom registry import build\n",
        "registry.py": "import importlib\n\ndef build(args):\n    return importlib.import_module(args.trainer_module)\n",
        "configs/a.json": json.dumps({"lr": 0.1, "optimizer": "torch.optim.SGD", "out": "runs/a.json"}),
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert program.unresolved == [
        "registry.py:4: importlib.import_module(args.trainer_module) (loads a module named at run time)"]


@pytest.mark.parametrize("where", [
    {"train.py": "import argparse\nfrom factory import load\np = argparse.ArgumentParser()\n"
                 "p.add_argument('--trainer', default='engines.sgd_trainer')\nload(p.parse_args().trainer)\n"},
    {"train.py": "from factory import load\nfrom settings import TRAINER\nload(TRAINER['module'])\n",
     "settings.py": "TRAINER = dict(module='engines.sgd_trainer', lr=0.1)\n"},
])
def test_module_names_written_in_the_programs_code(tmp_path, where):
    """A default on the command line or a Python settings module of the program names the
    module a factory loads: it is followed like one a configuration file names."""
    write(tmp_path, {
        ".git": "",
        "factory.py": "import importlib\n\ndef load(name):\n    return importlib.import_module(name)\n",
        "engines/sgd_trainer.py": "",
        "engines/adam_trainer.py": "",
        **where,
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert "engines/sgd_trainer.py" in names(program.followed, tmp_path) and program.unresolved == []
    assert "engines/adam_trainer.py" not in names(program.followed, tmp_path)


def test_imports_of_installed_packages_by_name_are_not_listed(tmp_path):
    write(tmp_path, {
        "train.py": "import importlib\nfor name in ('apex', 'deepspeed'):\n    importlib.import_module(name)\n"
                    "yaml = __import__('yaml')\nnet = importlib.import_module('torchvision.models.' + arch)\n",
    })
    program = build([Path("train.py")], [Path("train.py")])
    assert program.unresolved == [] and program.followed == []


# --- the program's torch modules, the lint cache ----------------------------------------------

def test_modules_of_a_torch_program_are_marked_even_without_torch(tmp_path):
    """A helpers.py that never mentions torch is part of the torch program that imports it; an
    unrelated script beside it is not (the engine's prefilter still skips it)."""
    write(tmp_path, {
        "train.py": "import torch\nimport helpers\n",
        "helpers.py": "import json\nimport fmt\n",
        "fmt.py": "def line(x): return str(x)\n",
        "tools/plot.py": "import csv\nimport plotting\n",
        "tools/plotting.py": "",
    })
    files = [tmp_path / "train.py", tmp_path / "tools/plot.py"]
    program = build(files, files)
    torch_program = {Path(k).name for k, v in program.views.items() if v.program_torch}
    assert torch_program == {"train.py", "helpers.py", "fmt.py"}


def test_a_recorded_build_notices_a_new_launch_file(tmp_path):
    """The lint cache reuses a build only if every answer it got is the same: a launch file
    that appears (or changes its PYTHONPATH) means a new build."""
    write(tmp_path, {
        ".git": "",
        "train.py": "import torch\nfrom trainer import Trainer\n",
        "code/trainer.py": "",
    })
    recorder = Recorder()
    graph.build([tmp_path / "train.py"], fs=recorder)
    answers = [(k, p, a) for (k, p), a in recorder.answers.items()]

    def content(path):
        return digest(Path(path).read_bytes()) if Path(path).exists() else None

    assert unchanged(answers, recorder.reads, content)
    write(tmp_path, {"run.sh": "PYTHONPATH=code python train.py\n"})
    assert not unchanged(answers, recorder.reads, content)


def test_the_report_lists_a_module_loaded_by_an_unknown_name_and_does_not_claim_done(tmp_path, run_cli):
    """A trainer loaded by a name only the command line knows: nothing in it was migrated, so
    the report lists the call (file:line) under "Not followed", counts it as NOT DONE and the
    migration exits 1; once a configuration file names the module, it is followed and migrated."""
    write(tmp_path, {
        ".git": "",
        "train.py": """
            import argparse
            import torch
            from torch.utils.data import DataLoader, TensorDataset
            from factory import load_trainer

            parser = argparse.ArgumentParser()
            parser.add_argument("--trainer", required=True)
            args = parser.parse_args()
            model = torch.nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 2)), batch_size=8, shuffle=True)
            load_trainer(args.trainer).fit(model, optimizer, loader)
            """,
        "factory.py": "import importlib\n\n\ndef load_trainer(name):\n    return importlib.import_module(name)\n",
        "engines/sgd_trainer.py": "def fit(model, optimizer, loader):\n    for x, y in loader:\n"
                                  "        print('step')\n",
    })
    report = tmp_path / "report.json"
    result = run_cli("ddp", "--report", report, "train.py")
    line = "factory.py:5: importlib.import_module(name) (loads a module named at run time)"
    assert result.exit_code == 1
    assert "Not followed" in result.output and line in result.output
    assert "NOT DONE: 1 import of the program's own code not followed" in result.output
    data = json.loads(report.read_text())
    assert data["unresolved_imports"] == [line] and any("not followed" in m for m in data["not_done"])
    assert "tm.print" not in (tmp_path / "engines/sgd_trainer.py").read_text()

    write(tmp_path, {"configs/default.json": json.dumps({"trainer": "engines.sgd_trainer"})})
    result = run_cli("ddp", "train.py")
    assert "Not followed" not in result.output and "engines/sgd_trainer.py  [imported, changed]" in result.output
    assert "tm.print('step')" in (tmp_path / "engines/sgd_trainer.py").read_text()


@pytest.mark.parametrize("form", ["from utils import helper, scorer", "from lib.utils import helper, scorer"])
def test_modules_of_a_folder_without_init_imported_from_it(tmp_path, form):
    """`from utils import helper` where `utils/` has no `__init__.py` (a namespace package):
    the modules named are followed, and nothing is reported as found nowhere."""
    folder = "utils" if form.startswith("from utils") else "lib/utils"
    write(tmp_path, {
        ".git": "",
        "train.py": f"import torch\n{form}\n",
        f"{folder}/helper.py": "import torch\n",
        f"{folder}/scorer.py": "",
        f"{folder}/unused.py": "",
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    assert names(program.followed, tmp_path) == [f"{folder}/helper.py", f"{folder}/scorer.py"]
    assert program.unresolved == []

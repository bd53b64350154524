"""The effects facts (`program.effects`) without any rule: what each function, method and class of
a program does under torchrun, through calls across modules, instances, subclasses and library
sinks; which write sites still run on every rank."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from torchmigrate.program import effects, graph
from torchmigrate.program.build import build
from torchmigrate.program.effects import (CALLS, CLOCK, COLLECTIVE, MKDIR, OUTPUT, RANDOM, READ, STATE, TRAIN,
                                          WRITE)
from torchmigrate.program.facts import program_effects


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"))


def facts_of(root: Path, files: dict, entry: str = "train.py"):
    write(root, files)
    g = graph.build([root / entry])
    trees = {p: ast.parse(p.read_text()) for p in g.modules}
    return program_effects(g, trees)


def kinds(found, root: Path, module: str, qual: str):
    return found.of(str((root / module).resolve()), qual)


def left(found):
    return [(Path(w.path).name, w.line, w.how) for w in effects.unguarded_writes(found)]


def test_a_helper_in_another_module_writes_through_the_call(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import torch
            import utils
            from utils import save_params as dump
            def main(cfg):
                utils.log_row(cfg)
                dump(cfg, "params.json")
            main({})
            """,
        "utils.py": """
            import json
            def save_params(params, path):
                with open(path, "w") as f:
                    json.dump(params, f)
            def log_row(row):
                write_csv("log.csv", row)
            def write_csv(path, row):
                with open(path, "a") as f:
                    f.write(str(row))
            """,
    })
    assert kinds(found, tmp_path, "utils.py", "save_params") == {WRITE}
    assert kinds(found, tmp_path, "utils.py", "log_row") == {WRITE}  # through write_csv
    assert WRITE in kinds(found, tmp_path, "train.py", "main")
    sites = effects.unguarded_writes(found)
    assert [(Path(w.path).name, w.line, w.how, w.target) for w in sites] == [
        ("utils.py", 3, "open", "path"), ("utils.py", 8, "open", "path")]


def test_every_kind_of_effect(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import random
            import time
            import numpy as np
            import torch
            import torch.distributed as dist
            import logging
            log = logging.getLogger(__name__)
            def step(model, batch, opt):
                loss = model(batch)
                loss.backward()
                opt.step()
            def reduce(t):
                dist.all_reduce(t)
            def draw():
                return random.random() + np.random.rand() + torch.randn(3).sum().item()
            def clock():
                return time.time()
            def report(x):
                print(x)
                log.info("x=%s", x)
            def load(path):
                return np.load(path)
            def folders(path):
                import os
                os.makedirs(path, exist_ok=True)
            class Meter:
                def update(self, v):
                    self.total = v
            """,
    })
    of = lambda q: kinds(found, tmp_path, "train.py", q)  # noqa: E731
    assert of("step") == {CALLS, TRAIN}
    assert of("reduce") == {COLLECTIVE}
    assert of("draw") == {RANDOM}
    assert of("clock") == {CLOCK}
    assert of("report") == {OUTPUT}
    assert of("load") == {READ}
    assert of("folders") == {MKDIR}
    assert of("Meter.update") == {STATE}


def test_library_sinks_are_writes(tmp_path):
    found = facts_of(tmp_path, {
        "sinks.py": """
            import json, pickle, shutil, logging
            import numpy as np
            import imageio
            import cv2
            import yaml
            import torch
            import matplotlib.pyplot as plt
            from PIL import Image
            from torchvision.utils import save_image
            def every(x, df, img, path):
                np.save(path, x)
                np.savetxt(path, x)
                imageio.imwrite(path, x)
                cv2.imwrite(path, x)
                plt.savefig(path)
                df.to_csv(path)
                Image.fromarray(x).save(path)
                save_image(x, path)
                torch.save(x, path)
                shutil.copy(path, path + ".bak")
                logging.FileHandler(path)
                yaml.dump(x, open(path, "w"))
                pickle.dump(x, open(path, "wb"))
            """,
    }, entry="sinks.py")
    hows = sorted({w for _, _, w in left(found)})
    assert hows == [".save", ".to_csv", "cv2.imwrite", "imageio.imwrite", "logging.FileHandler",
                    "matplotlib.pyplot.savefig", "numpy.save", "numpy.savetxt", "open", "shutil.copy", "torch.save",
                    "torchvision.utils.save_image"]


def test_tensorboard_writers_reached_any_way(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import importlib
            import torch
            from loggers import TBLogger
            import loggers
            def main():
                tb = importlib.import_module("torch.utils.tensorboard").SummaryWriter("runs")
                writer = TBLogger("runs/a")
                deep = loggers.DeepLogger("runs/b")
                writer.log_loss(1.0, 0)
                wandb_like = loggers.WandbRun()
            main()
            """,
        "loggers.py": """
            from torch.utils.tensorboard import SummaryWriter
            import wandb
            class TBLogger(SummaryWriter):
                def log_loss(self, value, step):
                    self.add_scalar("loss", value, step)
            class DeepLogger(TBLogger):
                pass
            class WandbRun:
                def __init__(self):
                    wandb.init(project="x")
            """,
    })
    root = str(tmp_path.resolve())
    assert found.writer_classes == {(f"{root}/loggers.py", "TBLogger"), (f"{root}/loggers.py", "DeepLogger")}
    assert kinds(found, tmp_path, "loggers.py", "TBLogger.log_loss") == {WRITE}  # SummaryWriter's own method
    assert sorted(left(found)) == [("loggers.py", 10, "wandb.init"), ("train.py", 6, "SummaryWriter"),
                                   ("train.py", 7, "TBLogger"), ("train.py", 8, "loggers.DeepLogger")]


def test_a_wrapper_class_whose_methods_write(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import torch
            from logger import CsvLogger
            csv = CsvLogger("log.csv")
            csv.log(0, 1.0)
            """,
        "logger.py": """
            class CsvLogger:
                def __init__(self, path):
                    self.handle = open(path, "a")
                def log(self, epoch, loss):
                    self.handle.write(f"{epoch},{loss}\\n")
            """,
    })
    assert kinds(found, tmp_path, "logger.py", "CsvLogger.log") == {WRITE}  # through the handle opened in __init__
    # the file is written where it is opened, once: the writes through the handle are not sites
    assert left(found) == [("logger.py", 3, "open")]
    view = build([tmp_path / "train.py"], [tmp_path / "train.py"]).views[str((tmp_path / "train.py").resolve())]
    assert view.call_effects["<module>|csv.log"] == {WRITE}
    assert STATE in view.call_effects["<module>|CsvLogger"]


def test_guards_main_only_and_main_process_first_are_not_every_rank(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import json, logging, os
            import torch
            import wandb
            import torchmigrate.runtime as tm
            from helpers import dump, build_cache
            def main(rank):
                if rank == 0:
                    dump("a.json")
                if not tm.is_main():
                    return
                with open("b.txt", "w") as f:
                    f.write("b")
            def later():
                f = tm.main_only(open, "c.txt", "a")
                f.write("c")
                wandb.init(project="p", mode=None if tm.is_main() else "disabled")
                handler = logging.FileHandler("x.log") if tm.is_main() else logging.NullHandler()
                tm.save({}, "d.pt")
                with tm.main_process_first():
                    if not os.path.exists("cache"):
                        build_cache("cache")
            main(0)
            later()
            """,
        "helpers.py": """
            def dump(path):
                with open(path, "w") as f:
                    f.write("x")
            def build_cache(path):
                with open(path, "w") as f:
                    f.write("y")
            """,
    })
    assert left(found) == []


def test_a_write_only_reached_unguarded_somewhere_is_left(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import torch
            from helpers import dump
            def main(rank):
                if rank == 0:
                    dump("a.json")
                dump("b.json")
            main(0)
            """,
        "helpers.py": """
            def dump(path):
                with open(path, "w") as f:
                    f.write("x")
            """,
    })
    assert left(found) == [("helpers.py", 2, "open")]


def test_a_file_named_by_rank_is_each_ranks_own(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import torch
            def main(rank):
                with open(f"log_rank{rank}.txt", "w") as f:
                    f.write("x")
            main(0)
            """,
    })
    assert left(found) == []


def test_module_views_carry_call_effects_and_writer_classes(tmp_path):
    write(tmp_path, {
        "train.py": """
            import torch
            import loggers
            from loggers import TBLogger as TB
            def main():
                w = TB("runs")
                loggers.save_samples("x.png")
            main()
            """,
        "loggers.py": """
            import imageio
            from torch.utils.tensorboard import SummaryWriter
            class TBLogger(SummaryWriter):
                pass
            def save_samples(path):
                imageio.imwrite(path, None)
            """,
    })
    program = build([tmp_path / "train.py"], [tmp_path / "train.py"])
    view = program.views[str((tmp_path / "train.py").resolve())]
    assert {"TB", "loggers.TBLogger"} <= view.writer_classes
    assert view.call_effects["main|TB"] == {WRITE}
    assert view.call_effects["main|loggers.save_samples"] == {WRITE}
    assert view.bindings["loggers"] == (str((tmp_path / "loggers.py").resolve()), None)


def test_a_module_alone_knows_its_own_effects():
    found = effects.of_module(textwrap.dedent("""
        import json
        from torch.utils.tensorboard import SummaryWriter
        class Board(SummaryWriter):
            pass
        def dump(x, path):
            with open(path, "w") as f:
                json.dump(x, f)
        def main():
            dump({}, "a.json")
            b = Board("runs")
    """), "x.py")
    assert found["call_effects"]["main|dump"] == {WRITE}
    assert found["writer_classes"] == {"Board"}
    assert found["call_writes"]["main|dump"] == ({1}, {"path"})  # the file it writes is named by `path`


def test_first_run_builders_are_called_only_when_their_output_is_missing(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import os
            import torch
            from prep import build, export
            def main(out):
                if not os.path.isdir(out):
                    build(out)
                export(out)
                if not os.path.exists(out + "/x"):
                    export(out)
            main("features")
            """,
        "prep.py": """
            import numpy as np
            def build(out):
                np.save(out + "/a.npy", np.zeros(1))
            def export(out):
                np.save(out + "/b.npy", np.zeros(1))
            """,
    })
    assert effects.first_run_builders(found) == {(str((tmp_path / "prep.py").resolve()), "build")}


def test_a_builder_run_when_asked_or_when_its_output_is_missing_is_a_first_run_builder(tmp_path):
    """`if create: build() elif not exists(out): build() else: load()` (a preprocessing dataset
    with a `--create_data` flag): both calls build on the first run; reading a vocabulary dict
    there (`self.w2i.get(w, unk)`) is no forward of a model hidden behind an attribute."""
    found = facts_of(tmp_path, {
        "train.py": """
            import os
            import json
            import torch

            class Corpus:
                def __init__(self, out, create):
                    self.out = out
                    self.w2i = {"<unk>": 0}
                    if create:
                        self._build()
                    elif not os.path.exists(out):
                        self._build()
                    else:
                        self._load()

                def _build(self):
                    ids = [self.w2i.get(w, self.w2i["<unk>"]) for w in "a b".split()]
                    with open(self.out, "w") as f:
                        json.dump(ids, f)
                    self._load()

                def _load(self):
                    with open(self.out) as f:
                        self.ids = json.load(f)

            Corpus("ids.json", False)
            """,
    })
    assert effects.first_run_builders(found) == {(str((tmp_path / "train.py").resolve()), "Corpus._build")}


def test_files_in_a_private_temporary_folder_are_not_shared_writes(tmp_path):
    found = facts_of(tmp_path, {
        "train.py": """
            import os
            import tempfile

            def rouge(summary):
                with tempfile.TemporaryDirectory() as folder:
                    config = os.path.join(folder, "task.xml")
                    with open(config, "w") as f:
                        f.write(summary)
                scratch = tempfile.mkdtemp()
                with open(os.path.join(scratch, "out.txt"), "w") as f:
                    f.write(summary)
                with open("results.txt", "a") as f:
                    f.write(summary)

            rouge("x")
            """})
    assert left(found) == [("train.py", 12, "open")]

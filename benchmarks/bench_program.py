"""What following a program's imports costs: the program analysis (`program.build`: resolve the
imports, CPython `ast` of each module, cross-module facts) against `libcst.parse_module` of the
same files, and `ddp --check` of the entry scripts (following) against `ddp --check --no-follow`
of every file (the same files, one by one).

    python benchmarks/bench_program.py               # 40 copies of fixtures/projects, 3 repeats
    python benchmarks/bench_program.py --copies 100 --repeat 5

Each copy of each project is its own project (a `pyproject.toml` marks its root), so the corpus
holds `copies x 6` programs. The budget (DESIGN.md): the analysis at most 2x the LibCST parse.
Nothing here asserts; read the numbers.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECTS = ROOT / "fixtures" / "projects"
ENTRIES = {"shared_module": ["train.py", "finetune.py"]}


def make_corpus(folder: Path, copies: int):
    entries, files = [], []
    for i in range(copies):
        for project in sorted(p for p in PROJECTS.iterdir() if p.is_dir()):
            dest = folder / f"{project.name}_{i:03d}"
            shutil.copytree(project, dest)
            (dest / "pyproject.toml").write_text("")
            entries += [dest / e for e in ENTRIES.get(project.name, ["train.py"])]
            files += sorted(dest.rglob("*.py"))
    return entries, files


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copies", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import libcst

    from torchmigrate.program.build import build

    with tempfile.TemporaryDirectory() as tmp:
        entries, files = make_corpus(Path(tmp), args.copies)
        lines = sum(len(f.read_text().splitlines()) for f in files)
        print(f"corpus: {len(entries)} entries, {len(files)} files, {lines} lines")
        parse = timed(lambda: [libcst.parse_module(f.read_bytes()) for f in files], args.repeat)
        analysis = timed(lambda: build(entries, entries), args.repeat)
        print(f"LibCST parse (in-process)          {parse:7.3f} s")
        print(f"program analysis (in-process)      {analysis:7.3f} s  = {analysis / parse:.2f}x the parse")

        def cli(*extra):
            return lambda: subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", "--check", "-j", "1", *extra],
                                          capture_output=True, cwd=tmp)
        follow = timed(cli(*map(str, entries)), args.repeat)
        alone = timed(cli("--no-follow", *map(str, files)), args.repeat)
        print(f"ddp --check ENTRIES (follow)       {follow:7.3f} s")
        print(f"ddp --check --no-follow ALL FILES  {alone:7.3f} s  (following costs {follow / alone - 1:+.1%})")


if __name__ == "__main__":
    main()

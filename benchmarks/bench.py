"""End-to-end timing of torchmigrate against `libcst.parse_module` alone (and TorchFix).

    python benchmarks/bench.py                       # 200 generated files, 3 repeats
    python benchmarks/bench.py --files 400 --repeat 5 --torchfix /path/to/venv/bin/torchfix
    python benchmarks/bench.py --profile             # where the time goes, in-process (cProfile)

Generates a deterministic corpus by varying `fixtures/scripts/*.py` (see corpus.py) in a
temporary folder, then measures, each as the median of `--repeat` runs:

- parse-only: read + decode + `libcst.parse_module` of every file, in-process and as a fresh
  subprocess (interpreter start and `import libcst` included, which is what the CLI pays too);
  the subprocess baseline is measured before and after the CLI rows (the mean is used, as the
  machine drifts over minutes); in-process also with LibCST's node validation off, as
  torchmigrate parses (for comparison only: the ratios are to LibCST as users call it);
- `torchmigrate lint` and `torchmigrate ddp --check` end to end (subprocess, wall clock), with
  `-j 1`, `-j 2` and the default (one worker per CPU for a run this size);
- cold start: `torchmigrate lint one_file.py` (median of `--cold` runs);
- peak RSS of `lint -j 1` on a quarter of the corpus vs the whole corpus (memory must be flat);
- optionally TorchFix (`--torchfix PATH` to its console script, or found on PATH) with `-j 1`,
  and parse-only under TorchFix's own interpreter (its libcst version may differ);
- the lint cache (`bench_cache.py`): cold with and without it, warm, and `ruff check` cold.

The rows above run `lint --no-cache`: they time the engine, not the cache.

The budget (2-core machine): a whole run <= 2x parse-only, cold start <= 0.35 s, flat memory,
`-j 2` >= 1.6x faster than `-j 1`. Nothing here asserts: machines are noisy; read the numbers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cache  # noqa: E402
import corpus  # noqa: E402

PARSE_ONLY = r"""
import os, sys, io, tokenize
import libcst
n = 0
for root, dirs, names in os.walk(sys.argv[1]):
    for name in sorted(names):
        if name.endswith(".py"):
            data = open(os.path.join(root, name), "rb").read()
            enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
            libcst.parse_module(data.decode(enc))
            n += 1
print(n)
"""


def cli_command() -> List[str]:
    exe = Path(sys.executable).with_name("torchmigrate")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torchmigrate"]


ENV = dict(os.environ)


def timed(cmd: Sequence[str], ok=(0, 1)) -> Tuple[float, float, int]:
    """Wall time, CPU time (user + system, children included) and peak RSS (KiB) of one run."""
    start = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.stderr:
        proc.stderr.close()
    if proc.returncode not in ok:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def median_run(cmd: Sequence[str], repeat: int, ok=(0, 1)) -> Tuple[float, float, int]:
    """Median wall and CPU time of `repeat` runs (after one untimed warm-up), max peak RSS."""
    timed(cmd, ok)
    walls, cpus, rss = [], [], 0
    for _ in range(repeat):
        wall, cpu, peak = timed(cmd, ok)
        walls.append(wall)
        cpus.append(cpu)
        rss = max(rss, peak)
    return statistics.median(walls), statistics.median(cpus), rss


def parse_in_process(paths: Sequence[Path], repeat: int, validate: bool = True) -> float:
    """Read, decode and `libcst.parse_module` every file; `validate=False` parses the way
    torchmigrate does, with LibCST's per-node validation off (`engine.process._parser_nodes`)."""
    import contextlib
    import io
    import tokenize

    import libcst

    from torchmigrate.engine.process import _parser_nodes

    walls = []
    for _ in range(repeat):
        start = time.perf_counter()
        for path in paths:
            data = path.read_bytes()
            enc, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
            with contextlib.nullcontext() if validate else _parser_nodes():
                libcst.parse_module(data.decode(enc))
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def engine_in_process(paths: Sequence[Path], mode: str, repeat: int) -> float:
    from torchmigrate.rule import Options
    from torchmigrate.rules import select
    from torchmigrate.engine.runner import Job, process_file

    codes = tuple(r.code for r in select(command=mode))
    job = Job(Options(mode=mode), codes, write=False)
    walls = []
    for _ in range(repeat):
        start = time.perf_counter()
        for path in paths:
            process_file(str(path), job)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def profile(paths: Sequence[Path], mode: str, top: int = 30) -> None:
    import cProfile
    import pstats

    from torchmigrate.rule import Options
    from torchmigrate.rules import select
    from torchmigrate.engine.runner import Job, process_file

    codes = tuple(r.code for r in select(command=mode))
    job = Job(Options(mode=mode), codes, write=False)
    for path in paths[:5]:  # warm up imports and caches
        process_file(str(path), job)
    prof = cProfile.Profile()
    prof.enable()
    for path in paths:
        process_file(str(path), job)
    prof.disable()
    print(f"\n--- cProfile, {mode}, {len(paths)} files (cumulative) ---")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    print(f"--- cProfile, {mode} (tottime) ---")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def find_torchfix(arg: Optional[str]) -> Optional[Path]:
    if arg:
        return Path(arg)
    found = shutil.which("torchfix")
    return Path(found) if found else None


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", type=int, default=15, help="runs for the cold-start median")
    ap.add_argument("--torchfix", help="path to TorchFix's console script (default: on PATH)")
    ap.add_argument("--torchfix-repeat", type=int, default=1, help="TorchFix is slow: 1 run by default")
    ap.add_argument("--no-torchfix", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine in-process and exit")
    ap.add_argument("--keep", help="generate the corpus into this folder and keep it")
    ap.add_argument("--no-cache-bench", action="store_true", help="skip the lint cache rows (bench_cache.py)")
    args = ap.parse_args(argv)

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tm-bench-"))
    # Measure an installed tool: bytecode cached (as pip does), never written into the checkout.
    ENV.pop("PYTHONDONTWRITEBYTECODE", None)
    ENV["PYTHONPYCACHEPREFIX"] = str(tmp / "pycache")
    ENV.setdefault("NO_COLOR", "1")
    ENV.pop("TORCHMIGRATE_CACHE_DIR", None)
    try:
        big = tmp / "corpus"
        small = tmp / "corpus_small"
        for folder in (big, small):
            if folder.exists():
                shutil.rmtree(folder)
        paths = corpus.generate(big, args.files, args.seed)
        n_small = max(1, args.files // 4)
        corpus.generate(small, n_small, args.seed)
        size = sum(p.stat().st_size for p in paths)
        lines = sum(p.read_text(encoding="utf-8").count("\n") for p in paths)
        load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        print(f"corpus: {len(paths)} files, {lines} lines, {size / 1e6:.2f} MB (seed {args.seed}); "
              f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs{load}")

        if args.profile:
            profile(paths, "ddp")
            profile(paths, "lint")
            return

        tm = cli_command()
        rows: List[Tuple[str, float, Optional[float], str]] = []  # label, wall, cpu, baseline key
        base: Dict[str, float] = {}

        base["inproc"] = parse_in_process(paths, args.repeat)
        rows.append(("parse-only, in-process", base["inproc"], None, "inproc"))
        rows.append(("parse-only, in-process, node validation off", parse_in_process(paths, args.repeat, False),
                     None, "inproc"))
        parse_cmd = [sys.executable, "-c", PARSE_ONLY, str(big)]
        first = median_run(parse_cmd, args.repeat, ok=(0,))
        rows.append(("engine lint, in-process", engine_in_process(paths, "lint", args.repeat), None, "inproc"))
        rows.append(("engine ddp, in-process", engine_in_process(paths, "ddp", args.repeat), None, "inproc"))
        runs: Dict[str, float] = {}
        for label, cmd in (
            ("lint -j 1", [*tm, "lint", "--no-cache", "--exit-zero", "-j", "1", str(big)]),
            ("lint -j 2", [*tm, "lint", "--no-cache", "--exit-zero", "-j", "2", str(big)]),
            ("ddp --check -j 1", [*tm, "ddp", "--check", "-j", "1", str(big)]),
            ("ddp --check -j 2", [*tm, "ddp", "--check", "-j", "2", str(big)]),
            ("lint (default -j)", [*tm, "lint", "--no-cache", "--exit-zero", str(big)]),
            ("ddp --check (default -j)", [*tm, "ddp", "--check", str(big)]),
        ):
            wall, cpu, _ = median_run(cmd, args.repeat)
            runs[label] = wall
            rows.append((f"torchmigrate {label}", wall, cpu, "sub"))
        # the machine drifts over minutes: the baseline is the mean of parse-only medians taken
        # before and after the CLI rows
        last = median_run(parse_cmd, args.repeat, ok=(0,))
        base["sub"], base["sub_cpu"] = (first[0] + last[0]) / 2, (first[1] + last[1]) / 2
        rows.insert(2, (f"parse-only, subprocess (before {first[0]:.2f} s, after {last[0]:.2f} s)",
                        base["sub"], base["sub_cpu"], "sub"))

        tf = None if args.no_torchfix else find_torchfix(args.torchfix)
        if tf is not None and tf.exists():
            tf_python = tf.with_name("python")
            if tf_python.exists():
                wall, cpu, _ = median_run([str(tf_python), "-c", PARSE_ONLY, str(big)], args.repeat, ok=(0,))
                base["tf"], base["tf_cpu"] = wall, cpu
                rows.append(("parse-only, subprocess, TorchFix's python + libcst", wall, cpu, "tf"))
            wall, cpu, _ = median_run([str(tf), "-j", "1", str(big)], args.torchfix_repeat, ok=(0, 1))
            runs["TorchFix -j 1"] = wall
            rows.append(("TorchFix -j 1", wall, cpu, "tf" if "tf" in base else "sub"))

        print(f"\n{'what':<52} {'wall s':>7} {'cpu s':>7} {'files/s':>8} {'x parse':>8}")
        for label, wall, cpu, key in rows:
            ratio = wall / base[key]
            cpu_text = f"{cpu:7.2f}" if cpu is not None else f"{'':>7}"
            print(f"{label:<52} {wall:7.2f} {cpu_text} {len(paths) / wall:8.1f} {ratio:8.2f}")
        print("(x parse: wall-clock ratio to parse-only measured the same way: in-process rows to "
              "in-process parsing, subprocess rows to the parse-only subprocess)")

        print()
        for cmd in ("lint", "ddp --check"):
            j1, j2 = runs[f"{cmd} -j 1"], runs[f"{cmd} -j 2"]
            print(f"{cmd}: -j 2 is {j1 / j2:.2f}x faster than -j 1")
        if "TorchFix -j 1" in runs:
            print(f"TorchFix -j 1 takes {runs['TorchFix -j 1'] / runs['lint -j 1']:.1f}x the time of "
                  f"torchmigrate lint -j 1 ({runs['TorchFix -j 1'] / runs['ddp --check -j 1']:.1f}x ddp --check)")

        one = paths[0]
        cold_cmd = [*tm, "lint", "--no-cache", "--exit-zero", str(one)]
        timed(cold_cmd)  # writes the bytecode cache
        colds = [timed(cold_cmd) for _ in range(args.cold)]
        bare = [timed([sys.executable, "-c", "pass"], ok=(0,)) for _ in range(args.cold)]
        imp = [timed([sys.executable, "-c", "import libcst"], ok=(0,)) for _ in range(args.cold)]
        med = lambda runs, i: statistics.median(r[i] for r in runs)  # noqa: E731
        print(f"\ncold start `torchmigrate lint {one.name}` ({one.stat().st_size // 1024} KB), median of "
              f"{args.cold}: {med(colds, 0):.3f} s wall, {med(colds, 1):.3f} s cpu "
              f"(min {min(r[0] for r in colds):.3f} s wall)")
        print(f"  for scale: `python -c pass` {med(bare, 0):.3f} s wall / {med(bare, 1):.3f} cpu; "
              f"`python -c 'import libcst'` {med(imp, 0):.3f} s wall / {med(imp, 1):.3f} cpu")

        print()
        for label, cmd in (("lint -j 1", [*tm, "lint", "--no-cache", "--exit-zero", "-j", "1"]),
                           ("ddp --check -j 1", [*tm, "ddp", "--check", "-j", "1"])):
            _, _, rss_small = timed([*cmd, str(small)])
            _, _, rss_big = timed([*cmd, str(big)])
            print(f"peak RSS, {label}: {n_small} files {rss_small / 1024:.1f} MiB, "
                  f"{len(paths)} files {rss_big / 1024:.1f} MiB")

        if not args.no_cache_bench:
            print()
            rows = bench_cache.measure(big, ENV, tmp / "lint-cache")
            print("\n".join(bench_cache.report(rows, len(paths))))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

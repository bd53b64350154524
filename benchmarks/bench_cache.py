"""The lint cache on the 200-file corpus: what a warm run costs, what the cache costs a cold one.

    python benchmarks/bench_cache.py                  # ~3 min on 2 cores (the cold runs dominate)
    python benchmarks/bench_cache.py --installed      # also a pip-installed copy, as users run it (`installed`)

Rows, each the median of several runs in fresh processes, bytecode cached as after `pip install`:

- **cold, --no-cache**: `torchmigrate lint` computing everything;
- **cold, empty cache**: the same, hashing, recording and writing its results (the cost of the
  cache on a cold run; each run gets an empty cache folder; the two cold rows alternate, so a
  machine that drifts affects both alike);
- **warm**: the same files again, unchanged (every result from the cache), alternating with
- **ruff cold**: `ruff check --no-cache --isolated` on the same files (when ruff is installed);
- **one file edited**: the warm cache, after a new line is appended to one file (a different
  file and text each run, as a pre-commit hook sees one edited file), next to
- **that file alone**: `torchmigrate lint --no-cache` of the edited file only (start-up, LibCST
  and its own program included): what an incremental re-lint should cost at best.

It also checks that a warm run imports no LibCST (`python -X importtime`).
`bench.py` runs `measure` too, on its corpus.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

Timing = Tuple[float, float]  # wall, cpu (user + system, children included)


def _timed(cmd: Sequence[str], env: Dict[str, str], ok=(0, 1)) -> Timing:
    import time

    start = time.perf_counter()
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if proc.stderr:
        proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code not in ok:
        raise SystemExit(f"command failed ({code}): {' '.join(cmd)}\n{err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime


def _median(runs: List[Timing]) -> Timing:
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def find_ruff() -> Optional[str]:
    beside = Path(sys.executable).with_name("ruff")
    return str(beside) if beside.exists() else shutil.which("ruff")


def measure(folder: Path, env: Dict[str, str], work: Path, warm_repeat: int = 15,
            cold_repeat: int = 3, tm: Sequence[str] = (sys.executable, "-m", "torchmigrate"),
            edit_repeat: int = 5) -> Dict[str, Timing]:
    """The rows above, for the command `tm` (`python -m torchmigrate` as `env` finds it) on `folder`."""
    tm = list(tm)
    lint = ["lint", "--exit-zero", str(folder)]
    rows: Dict[str, Timing] = {}
    nocache, cached = [], []
    for i in range(cold_repeat):
        nocache.append(_timed([*tm, *lint, "--no-cache"], env))
        cached.append(_timed([*tm, *lint, "--cache-dir", str(work / f"cold-{i}")], env))
    rows["cold, --no-cache"] = _median(nocache)
    rows["cold, empty cache"] = _median(cached)
    warm = [*lint, "--cache-dir", str(work / "warm")]
    _timed([*tm, *warm], env)  # fills it
    _timed([*tm, *warm], env)  # files first hashed less than 2 s after a change are indexed now
    ruff = find_ruff()
    warms, ruffs = [], []
    for _ in range(warm_repeat):
        warms.append(_timed([*tm, *warm], env))
        if ruff:
            ruffs.append(_timed([ruff, "check", "--no-cache", "--isolated", "--exit-zero", "--quiet", str(folder)],
                                env, ok=(0,)))
    rows["warm"] = _median(warms)
    if ruffs:
        rows["ruff check, cold"] = _median(ruffs)
    imports = subprocess.run([*tm, *warm], capture_output=True, text=True, env={**env, "PYTHONPROFILEIMPORTTIME": "1"})
    rows["_libcst_imported"] = (float("libcst" in imports.stderr), 0.0)
    edited, alone = [], []
    files = sorted(folder.rglob("*.py"))
    for i in range(edit_repeat):
        target = files[(7 + 37 * i) % len(files)]
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(f"# edited by bench_cache ({i})\n")
        edited.append(_timed([*tm, *warm], env))
        alone.append(_timed([*tm, "lint", "--exit-zero", "--no-cache", str(target)], env))
    rows["one file edited"] = _median(edited)
    rows["that file alone, --no-cache"] = _median(alone)
    return rows


def report(rows: Dict[str, Timing], files: int) -> List[str]:
    lines = [f"{'lint cache, ' + str(files) + ' files':<34} {'wall s':>7} {'cpu s':>7}"]
    for label, (wall, cpu) in rows.items():
        if not label.startswith("_"):
            lines.append(f"{label:<34} {wall:7.3f} {cpu:7.3f}")
    cold, empty = rows["cold, --no-cache"], rows["cold, empty cache"]
    lines.append(f"cache cost on a cold run: {100 * (empty[0] / cold[0] - 1):+.1f}% wall, "
                 f"{100 * (empty[1] / cold[1] - 1):+.1f}% cpu (target <= 5%)")
    if "ruff check, cold" in rows:
        ruff = rows["ruff check, cold"]
        lines.append(f"warm / ruff cold: {rows['warm'][0] / ruff[0]:.2f}x wall, {rows['warm'][1] / ruff[1]:.2f}x cpu "
                     "(target <= 1)")
    lines.append("warm run imports LibCST: " + ("YES (it should not)" if rows["_libcst_imported"][0] else "no"))
    if "one file edited" in rows:
        edited = rows["one file edited"]
        lines.append(f"one file edited / warm: {edited[0] / rows['warm'][0]:.1f}x wall (target <= 3); / that file "
                     f"alone: {edited[0] / rows['that file alone, --no-cache'][0]:.1f}x wall")
    return lines


def bench_env(pycache: Path) -> Dict[str, str]:
    """As bench.py: bytecode cached (as pip does), never written into the checkout; no colour."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("TORCHMIGRATE_CACHE_DIR", None)
    env["PYTHONPYCACHEPREFIX"] = str(pycache)
    env.setdefault("NO_COLOR", "1")
    return env


def installed(tmp: Path) -> str:
    """The `torchmigrate` command of a copy installed as users install it: `pip install` into a
    fresh environment (a venv without pip that sees this environment's dependencies through a
    `.pth` line), run as its console script. Its start-up runs none of the `.pth` hooks of this
    environment, such as the finder of an editable install of torchmigrate, which cost every
    run, nor `runpy` (`python -m`)."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    bin_dir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = str(bin_dir / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    import site

    Path(purelib, "torchmigrate-bench-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps",
                    "--no-build-isolation", str(corpus.ROOT)], check=True)
    return str(bin_dir / "torchmigrate")


def _load() -> str:
    """The load averages (1, 5, 15 min): other work on the machine inflates wall times."""
    return ", load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else ""


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-repeat", type=int, default=15)
    ap.add_argument("--cold-repeat", type=int, default=3)
    ap.add_argument("--edit-repeat", type=int, default=5)
    ap.add_argument("--installed", action="store_true",
                    help="also time a copy installed with pip (as users run it: no editable-install finder)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tm-cache-bench-"))
    try:
        env = bench_env(tmp / "pycache")
        paths = corpus.generate(tmp / "corpus", args.files, args.seed)
        print(f"corpus: {len(paths)} files; python {sys.version.split()[0]}, {os.cpu_count()} CPUs")
        setups = [("python -m torchmigrate, this environment", [sys.executable, "-m", "torchmigrate"])]
        if args.installed:
            setups.append(("torchmigrate (console script) of a pip-installed copy", [installed(tmp)]))
        for i, (title, tm) in enumerate(setups):
            print(f"\n{title}{_load()}")
            rows = measure(tmp / "corpus", env, tmp / f"caches-{i}", args.warm_repeat, args.cold_repeat, tm,
                           args.edit_repeat)
            print("\n".join(report(rows, len(paths))) + f"\n(after it{_load()})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

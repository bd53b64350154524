"""What AMP buys a migrated script: time benchmarks/amp_train.py before and after `torchmigrate ddp`.

The script is copied to a temporary folder and migrated there with the CLI (the file in the repo
is never touched). Then, with the same sizes, each variant runs as `python amp_train.py`:

  original             the plain fp32 script
  migrated, AMP off    TORCHMIGRATE_AMP=off: the migration's own overhead (no autocast)
  migrated, bf16       TORCHMIGRATE_AMP=bf16: bf16 autocast, GradScaler disabled
  migrated, fp16       TORCHMIGRATE_AMP=fp16: fp16 autocast + GradScaler (CUDA only)

and the script's own timing line (ms per step after a warm-up, synchronised on CUDA) is read
back. fp32 here is true fp32: PyTorch leaves TF32 matmuls off unless a script turns them on.

    python benchmarks/amp_speed.py                   # defaults sized for one data-centre GPU
    python benchmarks/amp_speed.py --width 128 --layers 2 --steps 5   # seconds on a CPU

Run it on an idle machine; `--repeat` takes the median of several runs of each variant.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "amp_train.py"
TIMING = re.compile(r"timing: steps=(\d+) ms_per_step=([0-9.]+) samples_per_s=([0-9.]+) final_loss=(\S+)")
SIZES = ("width", "layers", "seq", "batch", "vocab", "steps", "warmup")


def _cuda_available() -> bool:
    """Asked in a child process, so this script itself never imports torch."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def _variants(cuda: bool):
    rows = [("original", None, "original"), ("migrated, AMP off", "off", "migrated"),
            ("migrated, bf16", "bf16", "migrated")]
    return rows + [("migrated, fp16", "fp16", "migrated")] if cuda else rows


def _migrate(folder: Path) -> Path:
    original = folder / "original" / SCRIPT.name
    migrated = folder / "migrated" / SCRIPT.name
    for path in (original, migrated):
        path.parent.mkdir()
        shutil.copy(SCRIPT, path)
    proc = subprocess.run([sys.executable, "-m", "torchmigrate", "ddp", str(migrated)],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: findings that need attention (seeds, learning rate)
        sys.exit(f"torchmigrate ddp failed:\n{proc.stdout}{proc.stderr}")
    return folder


def _run_once(script: Path, amp: str | None, sizes: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHMIGRATE_AMP")}
    if amp:
        env["TORCHMIGRATE_AMP"] = amp
    proc = subprocess.run([sys.executable, str(script), *sizes], cwd=script.parent, env=env,
                          capture_output=True, text=True)
    match = TIMING.search(proc.stdout)
    if proc.returncode or not match:
        sys.exit(f"{script} (TORCHMIGRATE_AMP={amp}) failed:\n{proc.stdout}{proc.stderr[-4000:]}")
    return {"ms_per_step": float(match.group(2)), "samples_per_s": float(match.group(3)),
            "final_loss": float(match.group(4))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for size in SIZES:
        parser.add_argument(f"--{size}", type=int, help="passed to amp_train.py (see its defaults)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per variant; the median is shown")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    sizes = [f"--{s}={getattr(args, s)}" for s in SIZES if getattr(args, s) is not None]
    cuda = _cuda_available()

    print(f"device: {'cuda' if cuda else 'cpu'}; sizes: {' '.join(sizes) or 'amp_train.py defaults'}")
    print(f"{'variant':<20} {'ms/step':>9} {'samples/s':>10} {'speed-up':>9} {'final loss':>11}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tm_amp_") as tmp:
        folder = _migrate(Path(tmp))
        for variant, amp, which in _variants(cuda):
            runs = [_run_once(folder / which / SCRIPT.name, amp, sizes) for _ in range(args.repeat)]
            row = {"variant": variant, "final_loss": runs[0]["final_loss"],  # same seed every run
                   **{k: statistics.median(r[k] for r in runs) for k in ("ms_per_step", "samples_per_s")}}
            ms = row["ms_per_step"]
            row["speedup"] = (rows[0] if rows else row)["ms_per_step"] / ms
            rows.append(row)
            print(f"{variant:<20} {ms:>9.2f} {row['samples_per_s']:>10.1f} {row['speedup']:>8.2f}x "
                  f"{row['final_loss']:>11.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": "cuda" if cuda else "cpu", "sizes": sizes,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-run settings and fix safety: plain data that the CLI, the lint cache and the rule
catalogue use without importing the engine or LibCST (see `errors`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

RUNTIME_MODULE = "torchmigrate.runtime"
COMMANDS = ("ddp", "amp", "lint")
# How a migration sizes each rank's batch (TM305): "global" keeps the original's global batch
# (each rank loads batch_size / world_size), "per-gpu" keeps each rank's batch and scales the
# learning rate with the number of processes.
BATCH_POLICIES = ("global", "per-gpu")


class Safety(str, enum.Enum):
    """How much a fix can be trusted; mirrors Ruff's fix-safety model."""

    SAFE = "safe"  # applied by `ddp`/`amp` and `lint --fix`
    UNSAFE = "unsafe"  # changes behaviour a user must accept (`--unsafe-fixes`)
    MANUAL = "manual"  # report only; a migration leaves one inline TODO comment


@dataclass(frozen=True)
class Options:
    """Per-run settings that change what rules do."""

    mode: str = "lint"  # "ddp", "amp" or "lint"
    amp: str = "auto"  # "auto", "bf16", "fp16", "off"
    sync_bn: bool = False
    fix: bool = False  # `lint --fix`: apply safe fixes
    unsafe_fixes: bool = False
    runtime_module: str = RUNTIME_MODULE  # "torchmigrate_runtime" with --vendor-runtime
    # False when a first pass found that the program trains but wraps no model in DDP: its
    # training data then stays whole (TM201), since shards would train one model per rank
    shard_training: bool = True
    # `--shard-eval` / `shard-eval = true`: shard evaluation loaders even where the program model
    # cannot prove that every value computed from them is reduced (a TODO says what is not)
    shard_eval: bool = False
    batch_policy: str = "global"  # see BATCH_POLICIES

    @property
    def migrating(self) -> bool:
        return self.mode in ("ddp", "amp")

"""When the DDP-conversion rules look at a file: always in `ddp`, and in `lint` only where the
file is already distributed. Not a rule module (the leading underscore): the rule catalogue
does not scan it.
"""

from __future__ import annotations

from torchmigrate import analysis
from torchmigrate.rule import Context


def active(ctx: Context) -> bool:
    """DDP-conversion rules rewrite in `ddp`; in `lint` they check files that are already
    distributed (torch.distributed / DDP / the runtime)."""
    mode = ctx.options.mode
    if mode == "ddp":
        return True
    if mode == "lint":
        return analysis.is_distributed(ctx)
    return False

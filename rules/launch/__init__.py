"""TM101-TM105, TM107, TM108, TM801: launching under torchrun (the process group, `--local_rank`,
devices from the local rank, collectives every rank joins, per-rank seeds and draws the ranks
agree on, training steps the ranks skip together, the launch commands of shell scripts).

Read in this order:

- the facts (`torchmigrate.program.ranks`, `rank_guards`, `collectives`): which expressions
  depend on the rank, which code runs on some ranks only, which calls must run on every rank;
  no rule code;
- `base`: what the rules share (the process-group calls, torch.distributed.launch's
  `--local_rank` option, the seeding calls);
- `plan`: what this run decides for a file (where `tm.setup()`/`tm.cleanup()` go, whether the
  file creates its own process group, whether it is a legacy `torch.distributed.launch` script
  moved onto the runtime); TM103 and the model rules ask it too;
- one rule per file: `tm101_setup_pg`, `tm102_local_rank_arg`, `tm103_device_from_rank`,
  `tm104_symmetric_collectives`, `tm105_per_rank_seed`, `tm107_agreed_draws`,
  `tm108_skip_together`, `tm801_dist_launch`, each with its documentation and examples.

The decisions other families ask are importable from here.
"""

from torchmigrate.rules.launch.plan import creates_own_group, legacy_launch, setup_plan

__all__ = ["creates_own_group", "legacy_launch", "setup_plan"]

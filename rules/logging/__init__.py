"""TM601, TM602: console output, trackers and progress bars once, from the main process.

Read in this order:

- the facts (`torchmigrate.program.ranks`, `rank_guards`, `collectives`): which code already
  runs on the main process only, and which code must run on every rank (so it never goes
  under a guard); no rule code;
- `base`: what the rules share (adding `mode=` / `disable=` to a call, keeping its layout);
  the `if tm.is_main():` edit is `torchmigrate.rules._guards`, shared with the checkpoint and
  file-writing rules;
- one rule per file: `tm601_main_print`, `tm602_tqdm_main`, each with its documentation and
  examples.
"""

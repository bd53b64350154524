"""TM401-TM405, TM409, TM410, TM604: mixed precision (autocast, one GradScaler, unscaling before
clipping, DDP accumulation without needless all-reduces, DataParallel's replica threads, unsafe
ops, the runtime's dtype policy, host syncs in the step).

Read in this order:

- the facts (`torchmigrate.program.training`, `torchmigrate.program.precision`): the training
  steps of the module (backwards, optimizer steps, losses and where their forward starts),
  autocast blocks and GradScalers already there, evaluation loops, gradient reads; no rule code;
- `plan`: what this run does about them, so that the rules agree (where autocast goes, the one
  GradScaler and where it is created, where `unscale_` goes, what to do by hand); it depends on
  the options and on which rules of the family run together;
- `base`: what the rules share (the base class, the runtime's AMP policy, the scaler edits that
  apex's TM407 makes too) and `edits` (the code they write);
- one rule per file: `tm401_autocast_forward`, `tm402_grad_scaler`, `tm403_unscale_before_clip`,
  `tm404_accum_no_sync`, `tm405_dp_autocast`, `tm409_amp_unsafe_op`, `tm410_amp_dtype`,
  `tm604_item_sync`, each with its documentation and examples.

The AMP rules in other modules build on these: `cuda_amp` (TM406), `apex` (TM407, TM408),
`amp_checkpoint` (TM503).
"""

"""TM401-TM412, TM503, TM604: mixed precision (autocast, one GradScaler, unscaling before
clipping, DDP accumulation without needless all-reduces, DataParallel's replica threads, the
deprecated `torch.cuda.amp`, apex's amp and parallel modules, unsafe ops, the runtime's dtype
policy, gradient penalties, fill constants beyond float16, the scaler's state in checkpoints, host
syncs in the step).

Read in this order:

- the facts (`torchmigrate.program.training`, `torchmigrate.program.precision`,
  `torchmigrate.program.forward_outputs`): the training steps of the module (backwards,
  optimizer steps, losses and where their forward starts), autocast blocks and GradScalers
  already there, evaluation loops, gradient reads, where forward outputs go (into numpy, into
  code that is not torch's, read after a block); no rule code;
- `plan`: what this run does about them, so that the rules agree (where autocast goes, the one
  GradScaler and where it is created, where `unscale_` goes, what to do by hand); it depends on
  the options and on which rules of the family run together;
- `base`: what the rules share (the base class, the runtime's AMP policy, the scaler edits that
  apex's TM407 makes too) and `edits` (the code they write); `apex`: what TM407 and TM408
  share (the apex conversions, decided once for both, and the apex imports they leave);
- one rule per file: `tm401_autocast_forward`, `tm402_grad_scaler`, `tm403_unscale_before_clip`,
  `tm404_accum_no_sync`, `tm405_dp_autocast`, `tm406_torch_cuda_amp`, `tm407_apex_amp`,
  `tm408_apex_ddp`, `tm409_amp_unsafe_op`, `tm410_amp_dtype`, `tm411_amp_grad_penalty`,
  `tm412_half_fill_overflow`,
  `tm503_scaler_state`, `tm604_item_sync`, each with its documentation and examples.
"""

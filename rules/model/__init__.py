"""TM301-TM306, TM309: wrapping trained models in DDP, and what the wrap changes (attribute
accesses through `tm.unwrap`, unused parameters, SyncBatchNorm, the learning rate, DataParallel,
models differentiated by hand).

Read in this order:

- the facts (`torchmigrate.program.models`): where each model of the module is created, what it
  is made of (BatchNorm layers, submodules `forward()` uses only in some branches, heads whose
  outputs training throws away), models differentiated by hand; no rule code;
- `plan`: what this run does with the models of the module (which ones an optimizer trains,
  which are already wrapped, where each new `tm.wrap_model` goes, what happens to
  `nn.DataParallel`, which accesses go through `tm.unwrap`, `find_unused_parameters` and
  SyncBatchNorm); it depends on the options and on which rules of the family run together;
- `base`: what the rules share (the base class, which records the rules enabled for the plan;
  the wrap call TM301 and TM306 write; the `tm.unwrap` rewrites TM302 and TM306 report);
- one rule per file: `tm301_wrap_ddp`, `tm302_unwrap_attr`, `tm303_unused_params`,
  `tm304_sync_bn`, `tm305_lr_world_size`, `tm306_data_parallel_to_ddp`,
  `tm309_functional_model`, each with its documentation and examples.
"""

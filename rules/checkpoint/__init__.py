"""TM501, TM502, TM504, TM505: files under DDP (checkpoints written once and read anywhere,
other files written by the main process, downloads and caches built by it first).

Read in this order:

- the facts (`torchmigrate.program.checkpoints`, `torchmigrate.program.writes`): the saves and
  loads of the module and the file each one names, what its checkpoints hold, which calls
  write files, download them or test whether they exist; no rule code;
- `plan`: which statements this run puts under `tm.main_process_first()`; TM501 and TM504 ask
  it whether a save or write is ordered already;
- one rule per file: `tm501_save_main_unwrapped`, `tm502_load_map_location`,
  `tm504_main_only_writes`, `tm505_main_process_first`, each with its documentation and
  examples.

Division of labour with TM302 (unwrap-attr): that rule rewrites `model.module` and the
`model.state_dict` / `model.load_state_dict` *functions* of wrapped models to `tm.unwrap(model)...`,
and a wrapped model saved whole (`torch.save(model, f)`, `{"net": net}`) to `tm.unwrap(model)`.
TM501 and TM502 never touch those nodes: TM501 edits the `torch.save` function, rank-guard tests
and whole statements; TM502 edits `torch.load` calls and the *argument* of `load_state_dict`.
"""

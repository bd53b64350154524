"""TM201-TM204: data loading under DDP (samplers, epochs, evaluation, shuffle conflicts).

Read in this order:

- the facts (`torchmigrate.program.loaders`): every DataLoader of the module, what it loads
  and how, and every name under which it is visible; no rule code;
- `plan`: what this run does with each loader (the sampler it ends up with, whether epochs need
  `set_epoch`, how its dataset expression is named, what to do by hand);
- `base`: what the rules share (when they report; giving a loader its sampler) and `rewrite`
  (the DataLoader call edit, keeping its line layout);
- one rule per file: `tm201_dist_sampler`, `tm202_set_epoch`, `tm203_eval_unpadded`,
  `tm204_sampler_shuffle_conflict`, each with its documentation and examples.
"""

"""TM701-TM703: metrics over the whole dataset, not one rank's shard (counts and sums reduced,
predictions gathered, per-batch means over every rank's batches).

Read in this order:

- the facts (`torchmigrate.program.metrics`): the loops over data loaders, the numbers, lists
  and meters they fill and what the module does with them after the loop, which calls compute
  a metric; no rule code;
- `plan`: how a loop's loader ends up sharded (from the data plan and the data rules' fixes),
  and so which denominators stay exact once sums are reduced;
- one rule per file: `tm701_reduce_counts`, `tm702_gather_for_metrics`,
  `tm703_gather_list_mean`, each with its documentation and examples.
"""

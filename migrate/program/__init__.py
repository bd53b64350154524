"""The program model: what a training program is and what is true of it, with no rule code.

How a run goes, and where each step lives:

1. engine (`torchmigrate.engine`: `runner`, `process`): takes the files given, builds the
   program, runs the enabled rules over each module, and hands their edits to apply;
2. program model (this package): facts, computed once and kept, never depending on which
   rules are enabled;
   - `graph`, `build`: entry scripts -> the project's own modules they import (never installed
     packages), on the search path the program sets up (`search_path`: `sys.path` edits,
     PYTHONPATH in launch files, `src/` layouts, packages installed in place) and through the
     modules it loads by name (`dynamic_imports`: `importlib.import_module`, the module names
     in its configuration files); `project`: one walk of the project's files for both, through
     `fs`, whose answers the lint cache records; `facts`, `view`: the cross-module facts from CPython's `ast` (cheap,
     picklable), one `ModuleView` per module: which function parameters receive a wrapped
     model from another module, which receive data loaders and of which split (`loader_params`),
     which modules are entry points, whether the program trains or builds a DataLoader at all,
     its DataLoader subclasses;
   - `loaders`: the loader facts of one module (LibCST, on first use, kept on the context):
     every DataLoader, its dataset, shuffle and sampler, train or evaluation use, the names
     it is visible under, the loops that iterate it and whether they run with gradients, and
     the uses through which it leaves the module's sight (`consumers`);
   - `training`: the training facts of one module (LibCST, on first use, kept on the
     context): the training steps (a `backward()` and an optimizer `step()` in one function),
     the autocast blocks and GradScalers already there, where each loss is defined and where
     the forward computing it starts, evaluation forwards in grad-free loops, gradient reads
     and clipping between backward and step, BCE losses; `precision`: the mixed precision a
     module already has (autocast settings, apex's opt_level, the `forward` of a model handed
     to DataParallel); `forward_outputs`: where the outputs of a forward go (into numpy, into
     a function that is not torch's, read for their value after a block); `syntax`: the tree
     questions they ask (blocks, scopes, names a statement binds and reads);
   - `ranks`: which expressions depend on the process's rank (rank names, rank tests and the
     ranks they hold on); `rank_guards`: which code runs on some ranks only (the rank guard
     around a node, or around the calls of its function); `collectives`: the calls and code
     that must run on every rank; `scopes`: per-module indexes of scopes, assignments and
     names;
   - `classes`: what each class of the program is (module, optimizer, tensor, plain class)
     through its bases across modules, the program's optimizer wrappers, the kind of value
     every call passes a parameter; `types`: what an expression of one module holds (a tensor,
     a module, an optimizer, a plain object of the program, or unknown), which the rules that
     rewrite a call on an object check first (`.cuda()`, `GradScaler.step`, `scale`);
   - `checkpoints`: the saves and loads of one module, the file each one names (also through
     `with open(path) as f`), buffers and file objects, what its checkpoints hold (pickled
     objects used as loaded: `holds_objects`); `writes`:
     which calls write files, download them (or build a dataset's cache files), test whether a
     file exists, or run under `main_process_first` already; `metrics`: the loops over data
     loaders, the counts, lists and meters they fill, what happens to them after the loop, and
     which calls compute a metric that needs every sample;
   - `effects`: what every function, method and class of the program does under torchrun
     (writes files, with the path, prints, collectives, training steps, reads, random draws,
     the clock, state), through calls, instances, subclasses and library sinks, computed once
     per program from `ast` (`facts.program_effects`) and handed to each module's view
     (`call_effects`, `call_writes`, `writer_classes`, `first_run_builders`); read again off
     the migrated sources, it tells the report which files every rank still writes;
     loaders, the counts, lists and meters they fill, what happens to them after the loop, which
     sums one reduction after the loop keeps right (`loop_sums`) and which lists are used only in
     a mean (`means_only`), and which calls compute a metric that needs every sample;
     `loop_effects`: what a loop over a loader leaves behind for the code after it (names read
     after it, lists it appends to, objects it may change, an early exit); `splits`: whether a
     name speaks of training or evaluation data;
   - `models`: the model facts of one module (LibCST, on first use, kept on the context): the
     assignments that create each model and where it comes from (a class or function of the
     module, or a library), what it is made of (BatchNorm layers, submodules `forward()` uses
     only in some branches, heads whose outputs training throws away), models differentiated
     by hand;
3. rules (`torchmigrate.rules`): per family, a plan (the decisions: what this run does with
   what the facts say) and one rule per file, which reports findings with their edits:
   - `rules/launch/`: `plan.py` decides where `tm.setup()` goes and which scripts are legacy
     launches; `tm101_setup_pg.py` ... `tm801_dist_launch.py`;
   - `rules/data/`: `plan.py` decides the sampler each loader ends up with;
     `tm201_dist_sampler.py` ... `tm204_...`;
   - `rules/model/`: `plan.py` decides which models get wrapped and where, what becomes of
     DataParallel, which accesses go through `tm.unwrap`; `tm301_wrap_ddp.py` ...
     `tm309_functional_model.py`;
   - `rules/amp/`: `plan.py` decides where autocast goes, the one GradScaler and where it is
     created, where `unscale_` goes, from the training facts, `--amp` and the rules enabled;
     `apex.py` what the two apex rules share; `tm401_autocast_forward.py` ...
     `tm412_half_fill_overflow.py`, `tm503_scaler_state.py`, `tm604_item_sync.py`;
   - `rules/checkpoint/`: `plan.py` decides which statements go under `main_process_first`;
     `tm501_save_main_unwrapped.py` ... `tm505_main_process_first.py`;
   - `rules/logging/`: `tm601_main_print.py`, `tm602_tqdm_main.py`;
   - `rules/metrics/`: `plan.py` decides how a loop's loader ends up sharded, so which
     denominators stay exact; `tm701_reduce_counts.py` ... `tm703_gather_list_mean.py`;
   - `rules/_guards.py`: the `if tm.is_main():` edit several families share;
4. apply (`torchmigrate.engine`: `apply`, `files`): the edits become the new source of every
   changed module, written all together or not at all.

All of it reads LibCST trees through `torchmigrate.syntax` (the walk, the imports table, node
helpers, code generation, positions); the command line is `torchmigrate.cli`.

Rules read the cross-module facts through `Context.program` (a `ModuleView`), the loader
facts through `loaders.loader_facts(ctx)`, the training facts through
`training.training_facts(ctx)` and the model facts through `models.model_facts(ctx)`.

Next steps, family by family (DESIGN.md, "Target layout for the program model"):
- the program-level loader facts that are still in `facts.py` (DataLoader subclasses, "builds
  a loader") join `loaders.py`, and the loader facts follow a loader that a function of another
  module returns (`data.get_loader("train")`) into the epoch loops of its callers.
"""

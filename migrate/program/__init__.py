"""The program model: what a training program is and what is true of it, with no rule code.

How a run goes, and where each step lives:

1. engine (`torchmigrate.engine`, `runner`): takes the files given, builds the program, runs
   the enabled rules over each module, and hands their edits to apply;
2. program model (this package): facts, computed once and kept, never depending on which
   rules are enabled;
   - `graph`, `build`: entry scripts -> the project's own modules they import (never installed
     packages); `facts`, `view`: the cross-module facts from CPython's `ast` (cheap,
     picklable), one `ModuleView` per module: which function parameters receive a wrapped
     model from another module, which modules are entry points, whether the program trains or
     builds a DataLoader at all, its DataLoader subclasses;
   - `loaders`: the loader facts of one module (LibCST, on first use, kept on the context):
     every DataLoader, its dataset, shuffle and sampler, train or evaluation use, the names
     it is visible under, the loops that iterate it and whether they run with gradients;
   - `training`: the training facts of one module (LibCST, on first use, kept on the
     context): the training steps (a `backward()` and an optimizer `step()` in one function),
     the autocast blocks and GradScalers already there, where each loss is defined and where
     the forward computing it starts, evaluation forwards in grad-free loops, gradient reads
     and clipping between backward and step, BCE losses; `precision`: the mixed precision a
     module already has (autocast settings, apex's opt_level, the `forward` of a model handed
     to DataParallel); `syntax`: the tree questions both ask (blocks, scopes, names a
     statement binds and reads);
   - `models`: the model facts of one module (LibCST, on first use, kept on the context): the
     assignments that create each model and where it comes from (a class or function of the
     module, or a library), what it is made of (BatchNorm layers, submodules `forward()` uses
     only in some branches, heads whose outputs training throws away), models differentiated
     by hand;
3. rules (`torchmigrate.rules`): per family, a plan (the decisions: what this run does with
   what the facts say) and one rule per file, which reports findings with their edits; the
   data family (`rules/data/`: `plan.py`, `tm201_dist_sampler.py` ... `tm204_...`) and the
   AMP family (`rules/amp/`: `plan.py` decides where autocast goes, the one GradScaler and
   where it is created, where `unscale_` goes, from the training facts, `--amp` and the rules
   enabled; `tm401_autocast_forward.py` ... `tm604_item_sync.py`) and the model family
   (`rules/model/`: `plan.py` decides which models get wrapped and where, what becomes of
   DataParallel, which accesses go through `tm.unwrap`; `tm301_wrap_ddp.py` ...
   `tm309_functional_model.py`) are laid out this way; the other families still keep their
   facts in their rule files;
4. apply (`torchmigrate.apply`, `layout`): the edits become the new source of every changed
   module, written all together or not at all.

Rules read the cross-module facts through `Context.program` (a `ModuleView`), the loader
facts through `loaders.loader_facts(ctx)`, the training facts through
`training.training_facts(ctx)` and the model facts through `models.model_facts(ctx)`.

Next steps, family by family (DESIGN.md, "Target layout for the program model"):
- the AMP rules still outside `rules/amp/` (`cuda_amp` TM406, `apex` TM407/TM408,
  `amp_penalty` TM411, `amp_checkpoint` TM503) move into the package, one rule per file;
- the program-level loader facts that are still in `facts.py` (DataLoader subclasses, "builds
  a loader") join `loaders.py`, and the loader facts follow a loader that a function of another
  module returns (`data.get_loader("train")`) into the epoch loops of its callers.
"""

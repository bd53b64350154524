"""What the rules of one module may ask about the rest of its program (see `facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Tuple

from torchmigrate.program.classes import OptimizerWrapper


@dataclass(frozen=True)
class ModuleView:
    """What the rules of one module may ask about the rest of the program."""

    is_entry: bool = True
    followed: bool = False  # part of a program of several modules
    # "func" or "Class.method" -> parameter names that receive a wrapped model
    wrapped_params: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # class name -> `self.` attributes that hold a wrapped model
    wrapped_attrs: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # class name -> `self.` attributes it assigns that a subclass trains (`program.inherited`):
    # this module wraps them where they are assigned
    base_wraps: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # names of the program's collate functions that cut a loaded batch into batches of a
    # configured size (`program.collates`): a loader using one keeps its batch (TM305)
    rebatching_collates: FrozenSet[str] = frozenset()
    # "func" or "Class.method" -> parameter -> the splits ("train", "eval", "unknown") of the
    # data loaders other modules hand it (`evaluate(model, val_loader)` in train.py: {"eval"})
    loader_params: Dict[str, Dict[str, FrozenSet[str]]] = field(default_factory=dict)
    # "func" or "Class.method" -> parameter -> the literal booleans the program's calls pass it
    # (its default where a call leaves it out): `make_loader(ds, shuffle=False)` elsewhere
    flag_args: Dict[str, Dict[str, FrozenSet[bool]]] = field(default_factory=dict)
    # names of the program's functions and methods that are endless generators (a `yield`
    # inside `while True:`), read with `next()` by training loops that count steps
    endless_generators: FrozenSet[str] = frozenset()
    # the program's modules (as this module spells them) whose forward returns a loss summed
    # over the batch (`program.summing_modules`)
    summing_modules: FrozenSet[str] = frozenset()
    # the program's modules (as spelled here) whose forward returns a tuple with losses summed
    # over the batch at these positions (`kld, nll, stats = vrnn(x)`)
    summing_parts: Dict[str, FrozenSet[int]] = field(default_factory=dict)
    # the program's classes (as this module spells them) -> `self.` attributes their instances
    # hold wrapped (`program.facts._instance_attrs`): `trainer.model` of `trainer = Trainer(cfg)`
    instance_attrs: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # the program's modules (as this module spells them) that build their own optimizer over
    # `self.parameters()` (`program.facts._self_trained`): wrapped where they are made
    self_trained: FrozenSet[str] = frozenset()
    # this module's classes among those that some module of the program makes and binds to a
    # name, where TM301 wraps them (so their own optimizer needs no TODO)
    wrapped_where_made: FrozenSet[str] = frozenset()
    # names (as this module spells them) of the program's DataLoader subclasses that pass
    # keyword arguments through: `AudioDataLoader`, `data.AudioDataLoader`
    loader_classes: FrozenSet[str] = frozenset()
    # names (as this module spells them) of the program's classes deriving, through its own
    # classes, from a torchvision/torchaudio dataset: built with `download=` they download
    # (`UnsupervisedCIFAR10(root, download=True)`, the class defined in another module)
    library_datasets: FrozenSet[str] = frozenset()
    # some module of the program uses nn.DataParallel (or `nn.parallel.data_parallel`, or a
    # DataParallel subclass of its own): inputs repeated once per GPU were made for its scatter
    data_parallel: bool = False
    # the program's module-level functions of other modules that read a model's parameters
    # (`separate_bn_paras(model)`, `get_groups(net, wd)`), as this module spells them: an
    # optimizer built from what they return trains the model handed to them; -> whether they
    # walk its submodules (`model.modules()`), where the wrapper would be one more container
    parameter_pickers: Dict[str, bool] = field(default_factory=dict)
    # the program's `nn.DataParallel` subclasses as this module spells them -> the position of
    # the module among their positional arguments (`BalancedDataParallel(gpu0_bsz, model)`: 1)
    dp_classes: Dict[str, int] = field(default_factory=dict)
    # the program's classes as this module spells them -> what they are (`classes.MODULE`,
    # `OPTIMIZER`, `TENSOR`, `OTHER`); a class whose bases the program cannot see is absent
    class_kinds: Dict[str, str] = field(default_factory=dict)
    # the program's plain classes stepped like an optimizer (`ScheduledOptim`), as this module
    # spells them -> the attribute holding the torch optimizer they step
    optimizer_wrappers: Dict[str, OptimizerWrapper] = field(default_factory=dict)
    # functions and methods of this module ("f", "Cls.__init__") -> the parameters every call
    # in the program passes a value of one known kind (`DiceLoss(torch.ones(4))`: a tensor)
    param_kinds: Dict[str, Dict[str, str]] = field(default_factory=dict)
    # ... and those every call passes an instance of one optimizer wrapper of the program
    param_wrappers: Dict[str, Dict[str, OptimizerWrapper]] = field(default_factory=dict)
    # keys of the program's checkpoint dicts that hold a whole model or optimizer object
    # (`{"optimizer": optimizer}`), not a state dict: loading one unpickles the object
    pickled_keys: FrozenSet[str] = frozenset()
    # the module-level functions and the classes that other modules of the program define, as
    # this module spells them (`focal_loss`, `losses.FocalLoss`): the project's code, not a library's
    own_functions: FrozenSet[str] = frozenset()
    # ... and those of them that clip gradients (`utils.clip_gradient(optimizer, 5.0)`): under a
    # GradScaler their call needs the gradients unscaled first, as a clip in this module does
    clip_helpers: FrozenSet[str] = frozenset()
    own_classes: FrozenSet[str] = frozenset()
    # the program's model classes whose forward() returns a tuple, as this module spells them ->
    # the `self.` submodules each returned element depends on (an unused head: TM303)
    forward_outputs: Dict[str, Tuple[FrozenSet[str], ...]] = field(default_factory=dict)
    # the program's hand-made batch iterators and the functions that build them, as this module
    # spells them -> the positions of the data arguments ((-1,): every positional argument)
    iterator_builders: Dict[str, Tuple[int, ...]] = field(default_factory=dict)
    # functions of other modules that build an optimizer over a model parameter, as this module
    # spells them -> (position, name) of each such parameter: their callers here wrap the models
    optimizer_builders: Dict[str, Tuple[Tuple[int, str], ...]] = field(default_factory=dict)
    # ... those of them that build no optimizer but step the model's parameters by hand
    hand_steppers: FrozenSet[str] = frozenset()
    # functions of other modules that train on data they are handed, as this module spells them
    # -> (position, name) of each such parameter: a loader handed there is a training loader
    training_params: Dict[str, Tuple[Tuple[int, str], ...]] = field(default_factory=dict)
    # functions of other modules that return a DataLoader they build with no sampler of their own
    # (sharded there by TM201), as this module spells them
    loader_factories: FrozenSet[str] = frozenset()
    program_trains: bool = False  # some module of the program builds an optimizer over a model or runs a backward
    # some module of the program builds a DataLoader (or subclass), or a hand-made batch
    # iterator over training data (which TM201 shards): the global batch grows with the ranks
    program_loaders: bool = False
    # some module of the program sets up torch.distributed itself (`init_process_group`, its own
    # DDP or DistributedSampler): its data is shared out by its own code
    program_distributed: bool = False
    # the program has DataLoader subclasses whose calls cannot take a `sampler=` (their
    # `__init__` passes DataLoader its own arguments): their loaders are sharded where iterated
    opaque_loaders: bool = False
    # some module of the program builds a DataLoader (or subclass), whose batch size TM305 can
    # divide among the ranks (a hand-made iterator or a library's loader it cannot)
    program_dataloaders: bool = False
    # some module connected to this one by imports uses torch: this module is part of a torch
    # program, and is analysed even if it never mentions torch
    program_torch: bool = False
    # the program replaces `builtins.print` (DeiT/DETR's `setup_for_distributed`, MoCo's
    # `print_pass`) on a path this module runs in: its prints are already rank-aware
    print_override: bool = False
    # some module of the program names a device (`program.devices`): where none does, the
    # program runs on the CPU and its ranks stay there (`tm.setup(device="cpu")`)
    program_devices: bool = True
    # functions and methods ("f", "Cls.m") of this module that other modules call, and those
    # of them that every such call reaches only under a rank guard (`if utils.is_main_process():
    # utils.save_checkpoint(...)`)
    called_elsewhere: FrozenSet[str] = frozenset()
    # this module's functions (and classes, by their `__init__`) that build an optimizer over a
    # model parameter and that another module calls: the caller wraps the model it passes
    builders_for_others: FrozenSet[str] = frozenset()
    guarded_elsewhere: FrozenSet[str] = frozenset()
    # the effects of the program's code each call of this module reaches (`program.effects`):
    # "<scope>|<callee as spelled>" ("main|utils.save_params", "Trainer.fit|self.log") -> kinds
    call_effects: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # the same keys -> (positions, keywords) of the call's arguments that name a file the code
    # it reaches writes (`write_results(results, path)`: ({1}, {"path"}))
    call_writes: Dict[str, Tuple[FrozenSet[int], FrozenSet[str]]] = field(default_factory=dict)
    # functions of this module that write files and that the program calls only when a file
    # or folder is missing (first-run builders, `program.effects.first_run_builders`)
    first_run_builders: FrozenSet[str] = frozenset()
    # the program's classes built on a library writer (a `SummaryWriter` subclass), as this
    # module spells them: building one writes files
    writer_classes: FrozenSet[str] = frozenset()
    # local name -> (module path, symbol or None): the program's modules and symbols this
    # module's imports bind, so the migrated source's effects can be read again (the report)
    bindings: Dict[str, Tuple[str, Optional[str]]] = field(default_factory=dict)
    # library names this module imports through a project module (`from dataloader import *`
    # or `import DataLoader` from it, where dataloader.py imports it from torch), with what they
    # are (`torch.utils.data.DataLoader`): the rules resolve them as if imported from the library
    reexports: Dict[str, str] = field(default_factory=dict)
    # batch-size names (`batch_size`, `train_batch_size`: the last part of `config.batch_size`)
    # that the program passes to a model or loss class it builds, or to `init_hidden(...)`, ->
    # where (`trainer.py:88 NTXentLoss(...)`): something sized by the configured batch, which a
    # rank's share of the batch would not match
    batch_consumers: Dict[str, str] = field(default_factory=dict)
    # `file:line function()` of a loss of the program that compares the samples of a batch with
    # each other (`program.batch_coupling`: contrastive, batch-hard triplets), if any
    batch_coupled: FrozenSet[str] = frozenset()
    # why the program's numbers change meaning under autocast, wherever the code sits
    # (`program.amp_hazards`: a BCE loss built in another module, a table keyed by float32/float64
    # read by a tensor's dtype, an adaptive ODE solver): its training gets no autocast; reason ->
    # whether the program must change to get mixed precision
    amp_hazards: Dict[str, bool] = field(default_factory=dict)

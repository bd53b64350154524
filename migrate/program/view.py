"""What the rules of one module may ask about the rest of its program (see `facts`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Tuple


@dataclass(frozen=True)
class ModuleView:
    """What the rules of one module may ask about the rest of the program."""

    is_entry: bool = True
    followed: bool = False  # part of a program of several modules
    # "func" or "Class.method" -> parameter names that receive a wrapped model
    wrapped_params: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # class name -> `self.` attributes that hold a wrapped model
    wrapped_attrs: Dict[str, FrozenSet[str]] = field(default_factory=dict)
    # names (as this module spells them) of the program's DataLoader subclasses that pass
    # keyword arguments through: `AudioDataLoader`, `data.AudioDataLoader`
    loader_classes: FrozenSet[str] = frozenset()
    # the program's `nn.DataParallel` subclasses as this module spells them -> the position of
    # the module among their positional arguments (`BalancedDataParallel(gpu0_bsz, model)`: 1)
    dp_classes: Dict[str, int] = field(default_factory=dict)
    # the program's classes that are not modules but have a `cuda()` method of their own (a
    # loss or metric object), as this module spells them: `x.cuda()` on one is their method
    cuda_classes: FrozenSet[str] = frozenset()
    # the module-level functions and the classes that other modules of the program define, as
    # this module spells them (`focal_loss`, `losses.FocalLoss`): the project's code, not a library's
    own_functions: FrozenSet[str] = frozenset()
    own_classes: FrozenSet[str] = frozenset()
    # the program's model classes whose forward() returns a tuple, as this module spells them ->
    # the `self.` submodules each returned element depends on (an unused head: TM303)
    forward_outputs: Dict[str, Tuple[FrozenSet[str], ...]] = field(default_factory=dict)
    # the program's hand-made batch iterators and the functions that build them, as this module
    # spells them -> the position of the data argument (-1: every positional argument)
    iterator_builders: Dict[str, int] = field(default_factory=dict)
    # functions of other modules that build an optimizer over a model parameter, as this module
    # spells them -> (position, name) of that parameter: their callers here wrap the model
    optimizer_builders: Dict[str, Tuple[int, str]] = field(default_factory=dict)
    program_trains: bool = False  # some module of the program builds an optimizer over a model
    # some module of the program builds a DataLoader (or subclass), or a hand-made batch
    # iterator over training data (which TM201 shards): the global batch grows with the ranks
    program_loaders: bool = False
    # some module of the program builds a DataLoader (or subclass), whose batch size TM305 can
    # divide among the ranks (a hand-made iterator or a library's loader it cannot)
    program_dataloaders: bool = False
    program_torch: bool = False  # some module of the program uses torch
    # the program replaces `builtins.print` (DeiT/DETR's `setup_for_distributed`, MoCo's
    # `print_pass`) on a path this module runs in: its prints are already rank-aware
    print_override: bool = False
    # functions and methods ("f", "Cls.m") of this module that other modules call, and those
    # of them that every such call reaches only under a rank guard (`if utils.is_main_process():
    # utils.save_checkpoint(...)`)
    called_elsewhere: FrozenSet[str] = frozenset()
    guarded_elsewhere: FrozenSet[str] = frozenset()

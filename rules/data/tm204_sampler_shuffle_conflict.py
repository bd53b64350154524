"""TM204: `shuffle=True` next to a sampler raises ValueError; the sampler decides the order."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import expr
from torchmigrate.program.loaders import bind_args, is_literal
from torchmigrate.rule import Example
from torchmigrate.rules.data.base import DataRule
from torchmigrate.rules.data.rewrite import rewrite_call


class SamplerShuffleConflict(DataRule):
    """
    ## What it does
    Removes `shuffle=True` from DataLoaders that also get a `sampler=` or `batch_sampler=`.
    When the sampler may be None (`sampler = DistributedSampler(ds) if distributed else None`,
    a parameter), `shuffle=True` becomes `shuffle=sampler is None`: the loader still shuffles
    when there is no sampler, as it did before.

    ## Why is this bad?
    PyTorch raises `ValueError: sampler option is mutually exclusive with shuffle` at
    construction. The sampler decides the order (a `DistributedSampler` shuffles by default,
    reseeded by `set_epoch`), so the flag has no other effect. Reported in every mode: it is a
    crash, not a style question.
    """

    code = "TM204"
    name = "sampler-shuffle-conflict"
    summary = "Drop shuffle=True where a sampler or batch_sampler is given"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader, DistributedSampler
            sampler = DistributedSampler(ds)
            loader = DataLoader(ds, batch_size=32, shuffle=True, sampler=sampler)
            """,
            after="""
            from torch.utils.data import DataLoader, DistributedSampler
            sampler = DistributedSampler(ds)
            loader = DataLoader(ds, batch_size=32, sampler=sampler)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        facts = self.facts
        for loader in facts.loaders:
            args = bind_args(loader.call)
            if args is None or "shuffle" not in args or not is_literal(args["shuffle"].value, "True"):
                continue
            given = [n for n in ("sampler", "batch_sampler") if n in args and not is_literal(args[n].value, "None")
                     and not facts.always_none(args[n].value, loader.call)]
            if not given:
                continue
            message = (f"`shuffle=True` together with `{given[0]}=` raises ValueError (mutually exclusive); "
                       "the sampler decides the order")
            values = [args[n].value for n in given]
            if not any(facts.may_be_none(v, loader.call) for v in values):
                self.report(loader.call, message + ": drop `shuffle`",
                            edits=[replace(loader.call, lambda call: rewrite_call(call, None))])
            elif len(values) == 1 and dotted(values[0]):
                text = f"{dotted(values[0])} is None"
                self.report(loader.call, message + f"; it may be None: `shuffle={text}`",
                            edits=[replace(args["shuffle"], lambda a, text=text: a.with_changes(value=expr(text)))])
            else:
                self.report(loader.call, message + " when it is not None: pass `shuffle=` only without a sampler")


"""TM303: parameters that get no gradient in some steps under DDP, and needless `find_unused_parameters=True`."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule


class UnusedParams(ModelRule):
    """
    ## What it does
    Reports models whose set of parameters that receive gradients changes between steps while
    DDP does not expect it, and the opposite, needless `find_unused_parameters=True`:

    - `forward()` calls a submodule with parameters only in some branches of an `if`
      (`if cfg.aux: out = out + self.aux(x)`), or parameters are frozen
      (`requires_grad = False`) after the model was wrapped, and the existing DDP wrap lacks
      `find_unused_parameters=True`; the wraps TM301 adds pass it in these cases;
    - `forward()` returns several outputs and every training call of the model throws some of
      them away (`logits, _ = model(x)`, `model(x)[0]`): the submodules feeding only those (an
      auxiliary or projection head, also when the model class lives in another module of the
      program) get no gradient. The wrap TM301 adds passes `find_unused_parameters=True`; an
      existing wrap without it is reported;
    - parameters are unfrozen after the wrap (DDP never synchronises them);
    - `find_unused_parameters=True` on a model whose `forward()` is straight-line code using every
      submodule (`lint` only: a migration changes nothing in a script that is already
      distributed unless it is broken). This one is a note: it costs speed, not correctness, so
      it never fails the run.

    ## Why is this bad?
    A parameter that gets no gradient in a step makes DDP fail with "Expected to have finished
    reduction in the prior iteration before starting a new one" (pytorch/pytorch#43259).
    `find_unused_parameters=True` fixes that at the cost of an extra traversal of the autograd
    graph every step, which is wasted when every parameter is always used (pytorch#50133);
    `static_graph=True` is the cheaper option when the used set never changes.

    ## Example
    ```python
    class Net(nn.Module):
        def forward(self, x):
            out = self.body(x)
            if self.use_aux:
                out = out + self.aux(x)   # self.aux unused when use_aux is False
            return out
    model = DDP(model, device_ids=[local_rank])
    ```
    """

    code = "TM303"
    name = "unused-params"
    summary = "Report conditional parameter use under DDP and needless find_unused_parameters=True"
    safety = Safety.MANUAL
    examples = (
        Example(
            before="""
            import random
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP
            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = nn.Linear(4, 4)
                    self.aux = nn.Linear(4, 4)
                def forward(self, x):
                    out = self.body(x)
                    if random.random() < 0.5:
                        out = out + self.aux(x)
                    return out
            model = DDP(Net())
            """,
            after="""
            import random
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP
            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.body = nn.Linear(4, 4)
                    self.aux = nn.Linear(4, 4)
                def forward(self, x):
                    out = self.body(x)
                    if random.random() < 0.5:
                        out = out + self.aux(x)
                    return out
            # TODO(torchmigrate): TM303 Net.forward() uses self.aux only in some branches: DDP then fails with "Expected to have finished reduction in the prior iteration"; pass find_unused_parameters=True to the wrap (or make every parameter take part in each step)
            model = DDP(Net())
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if self.plan().active[self.code]:
            self.notes(self.code)

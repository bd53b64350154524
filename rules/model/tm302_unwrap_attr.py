"""TM302: custom attributes, `.module` and `state_dict()` of a wrapped model go through `tm.unwrap`."""

from __future__ import annotations

import libcst as cst

from torchmigrate.finding import Safety
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule, report_rewrites


class UnwrapAttr(ModelRule):
    """
    ## What it does
    After a model is wrapped (by TM301, `tm.wrap_model`, `DistributedDataParallel` or a former
    `nn.DataParallel`), rewrites accesses that the wrapper does not forward:

    - `model.module` → `tm.unwrap(model)` (also `model.module.x` → `tm.unwrap(model).x`);
    - `model.state_dict()` / `model.load_state_dict(...)` → `tm.unwrap(model).state_dict()` /
      `tm.unwrap(model).load_state_dict(...)`, so checkpoints have no `module.` prefix;
    - custom attributes and methods (`model.encode(x)`, `model.config`, `model.fc`) →
      `tm.unwrap(model).encode(x)`; but the first method a training step calls between its
      forward and the loss it backpropagates, in a step that never calls `model(...)` itself
      (`loss = model.bpr_loss(u, i, j)`), → `tm.synced(model).bpr_loss(u, i, j)`: it runs as
      the forward of the DDP wrapper, which then averages the step's gradients (through
      `tm.unwrap` they would silently stay per rank);
    - the model itself where the wrapper must not go: copies (`copy.deepcopy(model)`, EMA),
      whole-model checkpoints (`torch.save(model, f)`, a value of the saved dict, list or tuple,
      also through `state = {"net": net}`) and `writer.add_graph(model, ...)` get
      `tm.unwrap(model)` (for the wraps the migration makes);
    - `isinstance(model, LatentODE)` (a class other than the wrappers' and `nn.Module`) asks
      `tm.unwrap(model)`: the wrapper is no LatentODE, and the branch would never run.

    An instance's attribute that its class holds wrapped counts as the wrapped model too:
    `trainer.model.state_dict()` after `trainer = Trainer(cfg)`, where `Trainer` (of this file or
    another module of the program, or a subclass of it) trains `self.model`, becomes
    `tm.unwrap(trainer.model).state_dict()`.

    The `nn.Module` API that DDP itself provides (`model(x)`, `parameters()`, `train()`,
    `eval()`, `to()`, `zero_grad()`, `no_sync()`, ...) is left alone. Accesses are rewritten in
    the scope after the wrap and in other functions and methods of the file that receive the
    model (`tm.unwrap` is the identity on a module that is not wrapped, so this is safe wherever
    the name holds a plain module). For scripts that build DDP themselves, `.module` stays as
    it is (it is right there); `state_dict()` and `load_state_dict()` go through `tm.unwrap`
    too, saving and loading alike (`model.state_dict()` of a DDP has `module.` keys that the
    plain model cannot load). In `lint` such a script gets a report, without a fix, for
    `torch.save(model.state_dict(), ...)` (also as a value of the saved dict) where `model` is
    provably the DDP it built (wrapped unconditionally earlier in the same function); an alias
    of the module (`model_without_ddp = model.module`) is already unwrapped.

    ## Why is this bad?
    `DistributedDataParallel` only forwards `nn.Module` attributes: `model.encode(x)` raises
    `AttributeError: 'DistributedDataParallel' object has no attribute 'encode'`, and
    `model.state_dict()` saves every key with a `module.` prefix. `model.module` on the other
    hand fails in a single-process run, where `tm.wrap_model` returns the bare model.

    ## Example
    ```python
    model = tm.wrap_model(model)
    z = model.encode(x)
    model.module.head.reset_parameters()
    ```
    becomes
    ```python
    model = tm.wrap_model(model)
    z = tm.unwrap(model).encode(x)
    tm.unwrap(model).head.reset_parameters()
    ```
    """

    code = "TM302"
    name = "unwrap-attr"
    summary = "Access custom attributes, .module and state_dict of wrapped models through tm.unwrap"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            import torchmigrate.runtime as tm
            model = tm.wrap_model(model)
            z = model.encode(x)
            model.module.head.reset_parameters()
            torch.save(model.state_dict(), "model.pt")
            """,
            after="""
            import torchmigrate.runtime as tm
            model = tm.wrap_model(model)
            z = tm.unwrap(model).encode(x)
            tm.unwrap(model).head.reset_parameters()
            torch.save(tm.unwrap(model).state_dict(), "model.pt")
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = self.plan()
        if not p.active[self.code]:
            return
        report_rewrites(self, p, "TM302")

"""TM306: `nn.DataParallel` becomes the DDP wrap (`tm.wrap_model`, `tm.unwrap`)."""

from __future__ import annotations

from typing import Dict, List, Set, Tuple

import libcst as cst

from torchmigrate.finding import Safety, insert_after, remove, replace
from torchmigrate.syntax.nodes import expr
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule, report_rewrites, wrap_call
from torchmigrate.program.models import strip_moves
from torchmigrate.rules.model.batch import policy_applied
from torchmigrate.rules.model.plan import DPSite


class DataParallelToDDP(ModelRule):
    """
    ## What it does
    Replaces `nn.DataParallel` by the DDP wrap. When TM301 wraps the same model before its
    optimizer, `model = nn.DataParallel(model, device_ids=...)` is removed (with its
    `if torch.cuda.device_count() > 1:` guard when that is all the `if` holds); otherwise it
    becomes `tm.wrap_model(model)` in place (after the guard, never inside it). `model.module` becomes
    `tm.unwrap(model)`. DataParallel's batch was the global batch: where TM305 decides the
    batch policy (by default each rank loads `batch_size / world_size`, so the global batch stays
    the one DataParallel split), nothing more is said; otherwise the rule reports that the batch
    size changes meaning. In `lint` it fires on any file; `torchmigrate amp` keeps DataParallel (TM405 moves autocast into `forward`).

    ## Why is this bad?
    DataParallel is single-process multi-threaded replication: slower than DDP even on one
    node, and the PyTorch docs recommend DDP instead. DataParallel split each batch across the
    GPUs, while under DDP every rank loads a full `batch_size`, so the global batch becomes
    world_size × larger unless each rank loads its share (`tm.per_rank_batch`, TM305).

    ## Example
    ```python
    model = Net()
    if torch.cuda.device_count() > 1:
        model = nn.DataParallel(model)
    model.to(device)
    ```
    becomes
    ```python
    model = Net()
    model = tm.wrap_model(model)
    model.to(device)
    ```
    """

    code = "TM306"
    name = "dataparallel"
    summary = "Replace nn.DataParallel with the DDP wrap (tm.wrap_model / tm.unwrap)"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            import torch
            import torch.nn as nn
            model = Net()
            if torch.cuda.device_count() > 1:
                model = nn.DataParallel(model, device_ids=[0, 1])
            model.to(device)
            torch.save(model.module.state_dict(), "model.pt")
            """,
            after="""
            import torch
            import torch.nn as nn
            import torchmigrate.runtime as tm
            model = Net()
            # TODO(torchmigrate): TM306 DataParallel split each batch across the GPUs; under DDP each rank loads a full batch, so the global batch is tm.world_size() times larger: use `batch_size // tm.world_size()` per rank to keep it (or scale the learning rate)
            model = tm.wrap_model(model)
            model.to(device)
            torch.save(tm.unwrap(model).state_dict(), "model.pt")
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        p = self.plan()
        if not p.active[self.code]:
            return
        tm = self.ctx.tm
        note = (f"DataParallel split each batch across the GPUs; under DDP each rank loads a full batch, so the "
                f"global batch is {tm}.world_size() times larger: use `batch_size // {tm}.world_size()` per rank to "
                f"keep it (or scale the learning rate)")
        # one batch-size note per function, not one per DataParallel: at the first site's statement;
        # none where TM305 decides the global batch (each rank loads its share of DataParallel's batch)
        noted: Dict[cst.CSTNode, DPSite] = {}
        for site in p.dp_sites if not policy_applied(self.ctx) else ():
            if site.action != "keep":
                scope = p.models.scope(site.wrap.call)
                first = noted.get(scope)
                if first is None or p.models.idx(site.note_stmt) < p.models.idx(first.note_stmt):
                    noted[scope] = site
        ensured: Set[Tuple[cst.CSTNode, str]] = set()
        for site in p.dp_sites:
            if site.action == "keep":
                continue
            edits = []
            w = site.wrap
            if site.action == "manual":
                chosen = noted.get(p.models.scope(w.call)) is site
                self.report(w.call, f"{site.reason}; {note}" if chosen else site.reason, statement=site.note_stmt)
                continue
            if site.action == "alias":
                edits.append(replace(w.call, lambda n: p.models.wrapped_arg(n).value.with_changes(
                    lpar=n.lpar, rpar=n.rpar) if isinstance(n, cst.Call) and p.models.wrapped_arg(n) is not None
                    else n))
                message = (f"remove nn.DataParallel: `{w.name}` is wrapped in DDP before its optimizer (TM301), "
                           f"after the weights of `{w.arg}` are loaded or initialised (DDP copies rank 0's weights "
                           "to every rank when it is built)")
            elif site.action == "remove" or (site.action == "collapse" and not site.wrap_after):
                edits.append(remove(site.target) if site.action == "remove" else
                             replace(site.target, lambda n: _else_body(n, [])))
                message = (f"remove nn.DataParallel: `{w.name.split('.')[0]}` is wrapped in DDP before its "
                           "optimizer (TM301)")
            else:
                fu, sb = bool(site.find_unused), site.sync_bn

                def build(node, fu=fu, sb=sb):
                    inner = strip_moves(node) if isinstance(node, cst.Call) else node
                    a = p.models.wrapped_arg(inner) if isinstance(inner, cst.Call) else None
                    module = a.value if a is not None else inner
                    return wrap_call(tm, module, fu, sb)

                if site.action == "inplace":
                    outer = site.outer
                    edits.append(replace(outer, lambda n, build=build: build(n).with_changes(lpar=n.lpar, rpar=n.rpar)
                                         if isinstance(n, cst.Call) else build(n)))
                else:
                    argx = p.models.wrapped_arg(w.call)
                    new = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(expr(w.name))],
                                                              wrap_call(tm, argx.value, fu, sb))])
                    if site.action == "collapse":
                        edits.append(replace(site.target, lambda n, new=new: _else_body(n, [new])))
                    elif site.action == "replace-if":
                        edits.append(replace(site.target, lambda n, new=new: new.with_changes(
                            leading_lines=n.leading_lines)))
                    else:  # move: drop the DataParallel line, wrap after the `if`
                        edits.append(remove(site.small))
                        edits.append(insert_after(site.target, [new]))
                if site.ensure_after is not None:
                    key = (site.ensure_after, w.name)
                    if key not in ensured:
                        ensured.add(key)
                        edits.append(insert_after(site.ensure_after, [cst.parse_statement(
                            f"{w.name} = {tm}.wrap_model({w.name})")]))
                    extra = (f" (it was in one branch: `{w.name}` is also wrapped after the `if`, so every branch "
                             "trains in DDP)")
                elif site.conditional:
                    extra = " (the DataParallel was conditional: check the wrap runs on every rank)"
                else:
                    extra = ""
                message = f"replace nn.DataParallel with `{tm}.wrap_model(...)`{extra}"
            self.report(w.call, message, edits=edits, imports=[self.ctx.runtime_import()])
            if noted.get(p.models.scope(w.call)) is site:
                self.report(w.call, note, statement=site.note_stmt)
        for call in p.dp_functional:
            self.report(call, "nn.parallel.data_parallel() replicates the module on every call: wrap the model once "
                              f"with `{tm}.wrap_model(model)` and call it directly")
        report_rewrites(self, p, "TM306")


def _else_body(node: cst.If, extra: List[cst.BaseStatement]):
    """The statements of an `if`'s `else:` branch (then `extra`), in place of the `if`."""
    body = node.orelse.body
    if isinstance(body, cst.SimpleStatementSuite):
        stmts = [cst.SimpleStatementLine(list(body.body))]
    else:
        stmts = list(body.body)
    stmts = stmts + list(extra)
    first = stmts[0]
    stmts[0] = first.with_changes(leading_lines=[*node.leading_lines, *getattr(first, "leading_lines", [])])
    return cst.FlattenSentinel(stmts)

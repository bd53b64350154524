"""TM306: `nn.DataParallel` becomes the DDP wrap (`tm.wrap_model`, `tm.unwrap`)."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple, Union

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Import, Safety, insert_after, insert_before, remove, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, expr
from torchmigrate.rule import Example
from torchmigrate.rules.model.base import ModelRule, report_rewrites, wrap_call
from torchmigrate.program.models import DDP_CLASSES, DP_CLASSES, strip_moves
from torchmigrate.rules.model.batch import policy_applied
from torchmigrate.rules.model.plan import DPSite


# names of a program's GPU count and GPU list (`num_gpu`, `args.n_gpus`; `len(args.gpu_ids)`)
_GPU_COUNT = re.compile(r"^(?:n_?|num_?|number_of_)gpus?$|^gpus?_?num$|^n_?devices$|^num_devices$", re.IGNORECASE)
_GPU_LIST = re.compile(r"^(?:gpu_?ids|device_?ids|gpus|gpu_list|devices)$", re.IGNORECASE)

# the calls a replicating forward helper is made of, and the argument each one names
_REPLICATE_CALLS = {"torch.nn.parallel.replicate": "module", "torch.nn.parallel.replicate.replicate": "module",
                    "torch.nn.parallel.scatter": "inputs", "torch.nn.parallel.scatter_gather.scatter": "inputs"}


class DataParallelToDDP(ModelRule):
    """
    ## What it does
    Replaces `nn.DataParallel` by the DDP wrap. When TM301 wraps the same model before its
    optimizer, `model = nn.DataParallel(model, device_ids=...)` is removed (with its
    `if torch.cuda.device_count() > 1:` guard when that is all the `if` holds); otherwise it
    becomes `tm.wrap_model(model)` in place (after the guard, never inside it). `model.module` becomes
    `tm.unwrap(model)`. A DataParallel of a submodule (`model.features =
    nn.DataParallel(model.features)`, pytorch/examples' AlexNet and VGG, also on a backbone handed
    to the trained model) becomes `tm.parallel_part(model.features)`: DataParallel in one process,
    and under torchrun, where the whole model is in DDP, a holder that runs the part on the rank's
    GPU and keeps its `.module` level, so checkpoints keep the original's `features.module.*` keys.
    DataParallel's batch was the global batch: where TM305 decides the
    batch policy (by default each rank loads `batch_size / world_size`, so the global batch stays
    the one DataParallel split), nothing more is said; otherwise the rule reports that the batch
    size changes meaning. In `lint` it fires on any file; `torchmigrate amp` keeps DataParallel (TM405 moves autocast into `forward`).
    The functional `nn.parallel.data_parallel(module, x)` becomes `tm.data_parallel(module, x)`,
    and a program's own forward helper built from `replicate`/`scatter`/`parallel_apply`/`gather`
    (a Tacotron `data_parallel_workaround(model, *input)`) starts with `if tm.is_distributed():
    return model(*input)`: under torchrun each rank sees every GPU of the node, and both would
    spread its batch over the other ranks' GPUs; in one process they run as written.
    Inputs copied once per GPU so that DataParallel's scatter hands each replica one copy
    (`shots.unsqueeze(0).repeat(num_gpu, 1, 1)`, `.expand(len(gpu_ids), ...)`,
    `.repeat(torch.cuda.device_count())`) take `tm.replicas(num_gpu)`: 1 under torchrun (each
    rank's model runs whole) and where the DataParallel was dropped, the count where it is kept.

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
    model = tm.wrap_model(model, data_parallel=torch.cuda.device_count() > 1)
    model.to(device)
    ```
    (`data_parallel=`: in one process the model stays in `nn.DataParallel` where the original
    had it, under the same test (`True` where there was none, or where the wrap cannot repeat it),
    so code anywhere that reads `model.module` keeps working; under torchrun it is DDP.)
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
            model = tm.wrap_model(model, data_parallel=torch.cuda.device_count() > 1)
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
            if site.action != "keep" and not site.loading_copy:  # (a copy built to load a checkpoint splits no batch)
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
            elif site.action == "part":
                edits.append(replace(w.call, lambda n: n.with_changes(func=expr(f"{tm}.parallel_part"))
                                     if isinstance(n, cst.Call) else n))
                message = (f"nn.DataParallel of the submodule `{w.name}` becomes `{tm}.parallel_part(...)`: "
                           "DataParallel as written in one process; under torchrun (the whole model in DDP, one GPU "
                           "per rank) a plain holder that keeps its `.module` level, so saved keys stay as they were")
            elif site.action == "remove" or (site.action == "collapse" and not site.wrap_after):
                edits.append(remove(site.target) if site.action == "remove" else
                             replace(site.target, lambda n: _else_body(n, [])))
                message = (f"remove nn.DataParallel: `{w.name.split('.')[0]}` is wrapped in DDP before its "
                           "optimizer (TM301)")
            else:
                fu, sb = bool(site.find_unused), site.sync_bn
                when = dp_condition(site) if site.action in ("replace-if", "move", "collapse") else True

                def build(node, fu=fu, sb=sb):
                    inner = strip_moves(node) if isinstance(node, cst.Call) else node
                    a = p.models.wrapped_arg(inner) if isinstance(inner, cst.Call) else None
                    module = a.value if a is not None else inner
                    return wrap_call(tm, module, fu, sb, data_parallel=True, summed=p.sums_losses())

                if site.action == "inplace":
                    outer = site.outer
                    edits.append(replace(outer, lambda n, build=build: build(n).with_changes(lpar=n.lpar, rpar=n.rpar)
                                         if isinstance(n, cst.Call) else build(n)))
                else:
                    argx = p.models.wrapped_arg(w.call)
                    new = cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(expr(w.name))],
                                                              wrap_call(tm, argx.value, fu, sb, data_parallel=when,
                                                                        summed=p.sums_losses()))])
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
                            f"{w.name} = {tm}.wrap_model({w.name}, data_parallel=True)")]))
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
        if self.ctx.options.mode == "ddp" and self.ctx.options.migrating and not analysis.is_distributed(self.ctx):
            self._dp_checks()
        for call in p.dp_functional:
            self.report(call, f"nn.parallel.data_parallel() spreads the batch over every GPU of the node, where the "
                              f"other ranks' models live: `{tm}.data_parallel` calls the module on this rank's inputs "
                              "under torchrun and keeps the original call in one process",
                        edits=[replace(call.func, lambda _f: expr(f"{tm}.data_parallel"))],
                        imports=[self.ctx.runtime_import()])
        if self.ctx.options.mode == "ddp" and self.ctx.options.migrating:
            self._replicating_helpers()
            if self.ctx.program.data_parallel or p.dp_sites or p.dp_functional:  # (here, or in another module)
                self._replicated_inputs()
        report_rewrites(self, p, "TM306")

    # --- the program's own replicate/scatter/parallel_apply helpers -----------------------
    def _replicating_helpers(self) -> None:
        """`def data_parallel_workaround(model, *input)` built from `replicate(model, ids)`,
        `scatter(input, ids)`, `parallel_apply(...)` and `gather(...)` (Tacotron and WaveRNN
        programs call it where `torch.cuda.device_count() > 1`): under torchrun every rank sees
        all the node's GPUs, so it would spread each rank's batch over the GPUs of the other
        ranks. It starts with `if tm.is_distributed(): return model(*input)` (or
        `tm.data_parallel(model, input)` for inputs given as one value): the forward on this
        rank's GPU, through the model's DDP wrapper; in one process it runs as written."""
        ctx, tm = self.ctx, self.ctx.tm
        by_function: Dict[cst.FunctionDef, Dict[str, str]] = {}
        for call, name in analysis.facts(ctx).calls:
            if name not in _REPLICATE_CALLS or not call.args or not isinstance(call.args[0].value, cst.Name):
                continue
            func = ctx.enclosing(call, cst.FunctionDef)
            if func is not None:
                by_function.setdefault(func, {})[_REPLICATE_CALLS[name]] = call.args[0].value.value
        for func, roles in by_function.items():
            module, inputs = roles.get("module"), roles.get("inputs")
            params = {p.name.value for p in func.params.params} | {p.name.value for p in func.params.kwonly_params}
            star = func.params.star_arg.name.value if isinstance(func.params.star_arg, cst.Param) else None
            if module not in params or (inputs not in params and inputs != star):
                continue
            body = func.body.body if isinstance(func.body, cst.IndentedBlock) else ()
            first = next((s for s in body if not (isinstance(s, cst.SimpleStatementLine) and isinstance(
                s.body[0], cst.Expr) and isinstance(s.body[0].value, cst.SimpleString))), None)
            if first is None or (isinstance(first, cst.If) and "is_distributed()" in code(first.test)):
                continue  # (a second run)
            forward = f"{module}(*{inputs})" if inputs == star else f"{tm}.data_parallel({module}, {inputs})"
            guard = cst.parse_statement(f"if {tm}.is_distributed():\n    return {forward}  # this rank's GPU only\n")
            self.report(func, f"{func.name.value}() spreads a batch over every GPU of the node (replicate, scatter, "
                              f"parallel_apply), where the other ranks' models live under torchrun: it calls "
                              f"`{forward}` there instead, on this rank's GPU (one process runs it as written)",
                        edits=[insert_before(first, [guard])], imports=[ctx.runtime_import()])

    # --- inputs copied once per GPU for DataParallel's scatter ----------------------------
    def _replicated_inputs(self) -> None:
        """`data_shot.unsqueeze(0).repeat(num_gpu, 1, 1, 1)`, `lengths.max().repeat(
        torch.cuda.device_count())`: a program using DataParallel copies an input once per GPU, so
        that the scatter hands every replica one copy. Under torchrun each rank's model runs whole
        (DDP scatters nothing) and would get a batch of `num_gpu` copies where it expects one:
        the count becomes `tm.replicas(num_gpu)`, 1 there (and in one process where the
        DataParallel was dropped), the count itself where it is kept."""
        ctx, tm = self.ctx, self.ctx.tm
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if not (isinstance(func, cst.Attribute) and func.attr.value in ("repeat", "expand") and call.args
                    and call.args[0].keyword is None and call.args[0].star == ""):
                continue
            count = call.args[0].value
            if not self._gpu_count(count):
                continue
            self.report(call, f"`{code(count)}` copies this input once per GPU for DataParallel's scatter; under "
                              f"torchrun each rank's model runs whole on its GPU (DDP scatters nothing) and would "
                              f"get {code(count)} copies as its batch: `{tm}.replicas(...)` is 1 there, and the count "
                              "where DataParallel is kept in one process",
                        edits=[replace(count, lambda n: expr(f"{tm}.replicas({code(n)})"))],
                        imports=[ctx.runtime_import()])

    def _gpu_count(self, node: cst.BaseExpression) -> bool:
        """`torch.cuda.device_count()`, `num_gpu`, `args.n_gpus`, `len(args.gpu_ids)`."""
        if isinstance(node, cst.Call):
            if self.ctx.resolve(node.func) == "torch.cuda.device_count" and not node.args:
                return True
            return (isinstance(node.func, cst.Name) and node.func.value == "len" and len(node.args) == 1
                    and _GPU_LIST.match((dotted(node.args[0].value) or "").rsplit(".", 1)[-1]) is not None)
        return _GPU_COUNT.match((dotted(node) or "").rsplit(".", 1)[-1]) is not None

    # --- code that tests for a DataParallel -------------------------------------------------
    def _dp_checks(self) -> None:
        """`isinstance(model, nn.DataParallel)` tests whether the model is wrapped for several
        GPUs. After the migration it is a DistributedDataParallel under torchrun and the plain
        module in one process: a test also accepts DDP (`if isinstance(net, DP): net =
        net.module` keeps unwrapping), and an `assert` that the model is a DataParallel, which
        held on every run before and would now fail on every one, goes (`tm.unwrap(model)`
        reaches the module either way)."""
        ctx = self.ctx
        replaced_here = any(site.action != "keep" for site in self.plan().dp_sites)
        for call, name in analysis.facts(ctx).calls:
            if name != "isinstance" and not (isinstance(call.func, cst.Name) and call.func.value == "isinstance"):
                continue
            if len(call.args) != 2 or any(a.keyword or a.star for a in call.args):
                continue
            if not (replaced_here or self._receives_wrapped(call.args[0].value)):
                continue
            classes = call.args[1].value
            elements = [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]
            resolved = [ctx.resolve(e) for e in elements]
            if not any(r in DP_CLASSES for r in resolved) or any(r in DDP_CLASSES for r in resolved):
                continue
            if self._ddp_tested_beside(call):
                continue
            statement = ctx.statement_of(call)
            small = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1 \
                else None
            if isinstance(small, cst.Assert) and small.test is call:
                self.report(call, f"`assert {code(call)}` held for the DataParallel this program used; now the model "
                                  f"is a DistributedDataParallel under torchrun and the plain module in one process, "
                                  f"so it would fail on every run: removed (`{ctx.tm}.unwrap(model)` gives the module "
                                  f"either way)", edits=[remove(statement)])
                continue
            ddp, imports = self._ddp_spelling()
            self.report(call, "the model is a DistributedDataParallel now, not a DataParallel: the test also "
                              "accepts DDP, so the code for a wrapped model still runs for it",
                        edits=[replace(call.args[1], lambda a, e=elements, d=ddp: a.with_changes(
                            value=cst.Tuple([*(cst.Element(x) for x in e), cst.Element(expr(d))])))],
                        imports=imports)

    def _receives_wrapped(self, value: cst.BaseExpression) -> bool:
        """`value` is a parameter (or `self.` attribute) that the program hands a model it wraps
        (`ModuleView.wrapped_params`, `wrapped_attrs`)."""
        ctx = self.ctx
        name = dotted(value)
        func = ctx.enclosing(value, cst.FunctionDef)
        if name is None or func is None:
            return False
        klass = ctx.enclosing(func, cst.ClassDef)
        if name.startswith("self.") and klass is not None:
            return name[len("self."):] in ctx.program.wrapped_attrs.get(klass.name.value, ())
        qual = f"{klass.name.value}.{func.name.value}" if klass is not None else func.name.value
        return name in ctx.program.wrapped_params.get(qual, ())

    def _ddp_tested_beside(self, call: cst.Call) -> bool:
        """`isinstance(m, DataParallel) or isinstance(m, DistributedDataParallel)`: DDP is
        tested already in the same condition."""
        ctx = self.ctx
        for anc in ctx.ancestors(call):
            if isinstance(anc, cst.BaseStatement):
                return False
            if isinstance(anc, cst.BooleanOperation):
                return any(ctx.resolve(n) in DDP_CLASSES for n in ctx.within(anc, cst.Name, cst.Attribute))
        return False

    def _ddp_spelling(self):
        """How this module names DistributedDataParallel, and the import that needs."""
        imports = self.ctx.imports
        for qualified in sorted(DDP_CLASSES):
            local = imports.alias_for(qualified)
            if local:
                return local, []
        for module, rest in (("torch.nn.parallel", "DistributedDataParallel"),
                             ("torch.nn", "parallel.DistributedDataParallel"),
                             ("torch", "nn.parallel.DistributedDataParallel")):
            local = imports.alias_for(module)
            if local:
                return f"{local}.{rest}", []
        return "torch.nn.parallel.DistributedDataParallel", [Import("torch")]


def dp_condition(site: DPSite) -> Union[bool, cst.BaseExpression]:
    """The test under which the original used DataParallel (`if not args.cpu and n_gpus > 1:`),
    for `data_parallel=`: one process then keeps DataParallel exactly where the original had it
    (code elsewhere keyed on the same test, `return self.loss if n_gpus == 1 else
    self.loss.module`, keeps seeing what it saw). True where the test is not a plain `if` holding
    the DataParallel in its body, or where that body may rebind what the test reads (the wrap
    may come after the body)."""
    node = site.target
    if not isinstance(node, cst.If) or not isinstance(node.body, cst.IndentedBlock):
        return True
    smalls = [x for line in node.body.body if isinstance(line, cst.SimpleStatementLine) for x in line.body]
    if site.small not in smalls:
        return True
    read = dotted_names(node.test)
    for statement in node.body.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            return True  # a compound statement: anything may change in it
        for small in statement.body:
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else (
                [small.target] if isinstance(small, (cst.AugAssign, cst.AnnAssign)) else [])
            if any(rebinds(dotted(t), read) for t in targets):
                return True
    return node.test


def rebinds(bound: Optional[str], read: Set[str]) -> bool:
    """Assigning the dotted name `bound` (None: a target with no dotted name, anything) may change
    one of the names a test `read`s (`args` rebinds `args.n_gpus`)."""
    return bound is None or any(r == bound or r.startswith(bound + ".") for r in read)


def dotted_names(node: cst.CSTNode) -> Set[str]:
    """`args.n_gpus`, `n_gpus`, `torch.cuda.device_count`: the longest dotted names in `node`."""
    found: Set[str] = set()

    class Collect(cst.CSTVisitor):
        def visit_Attribute(self, n: cst.Attribute) -> bool:
            name = dotted(n)
            if name is not None:
                found.add(name)
                return False
            return True

        def visit_Name(self, n: cst.Name) -> None:
            found.add(n.value)

    node.visit(Collect())
    return found


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

"""TM202: epoch loops over a reshuffling distributed loader call `set_epoch` first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import libcst as cst

from torchmigrate.finding import Safety, insert_after, insert_before
from torchmigrate.syntax.nodes import code, stmt
from torchmigrate.program.loaders import (TM_SET_EPOCH, Loader, bind_params, header_loop, is_pure, key_of, loops_of,
                                          refs_at)
from torchmigrate.program.syntax import target_names
from torchmigrate.rule import Example
from torchmigrate.rules.data.base import DataRule
from torchmigrate.syntax.walk import child_nodes
from torchmigrate.program import splits

# Calls that read a loader without iterating it.
_NON_CONSUMING = frozenset({"len", "print", "isinstance", "hasattr", "getattr", "type", "id", "str", "repr"})


@dataclass(eq=False)
class _Insertion:
    loop: cst.CSTNode
    loader: Loader
    text: str  # the loader as the loop's scope names it
    anchor: cst.CSTNode  # statement to insert at
    where: str  # "before" or "after"
    var: Optional[str]
    problem: str = ""


class SetEpoch(DataRule):
    """
    ## What it does
    Inserts `tm.set_epoch(<loader>, <epoch>)` as the first statement of every epoch loop that
    trains on a shuffling distributed loader: a loop whose body iterates the loader, passes it
    (or `self.train_loader`) to a function, or calls a same-file function or method that
    iterates it. The loop variable may have any name; `while` loops need an evident counter
    (`while epoch < n` or an `x += 1` in the body). When the loader is created inside the loop
    the call goes right after its creation; when an iterator over it is re-created inside a
    step loop (`except StopIteration: it = iter(loader)`) it goes before that. Code that does
    not use the runtime yet stays plain torch where it can: `train_sampler.set_epoch(epoch)`
    for a sampler variable, `loader.sampler.set_epoch(epoch)` for a
    `sampler=DistributedSampler(...)` argument.

    ## Why is this bad?
    `DistributedSampler` shuffles with a seed derived from its epoch, which only `set_epoch`
    changes: without it every epoch visits the samples in the same order (PyTorch warns about
    this in the sampler's docstring; the official DDP example forgets it). In a single-process
    run `tm.set_epoch` does nothing.

    Where no epoch can be named (a `while True:` loop, a loop in a function its caller passes no
    epoch to, a loop in another module), a loader whose sampler is the runtime's (`tm.sampler`,
    `tm.shard_sampler`) needs nothing: those samplers start a new epoch on every pass over them
    until `set_epoch` is called. A user's own `DistributedSampler` there is reported.

    ## Limitations
    `itertools.cycle(loader)` replays the first epoch forever and is reported for a manual
    change. Loaders rebuilt by a helper call on every epoch are not followed.
    """

    code = "TM202"
    name = "set-epoch"
    summary = "Call set_epoch on distributed samplers at the start of every epoch"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader
            train_loader = DataLoader(train_ds, batch_size=64, shuffle=True)
            for epoch in range(start, args.epochs):
                train_one_epoch(model, train_loader)
            """,
            after="""
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            train_loader = DataLoader(train_ds, batch_size=64, shuffle=True)
            for epoch in range(start, args.epochs):
                tm.set_epoch(train_loader, epoch)
                train_one_epoch(model, train_loader)
            """,
        ),
        Example(
            before="""
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler
            sampler = DistributedSampler(dataset)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            for ep in range(10):
                for x, y in loader:
                    step(x, y)
            """,
            after="""
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler
            sampler = DistributedSampler(dataset)
            loader = DataLoader(dataset, batch_size=32, sampler=sampler)
            for ep in range(10):
                sampler.set_epoch(ep)
                for x, y in loader:
                    step(x, y)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if not self.active():
            return
        facts, plan = self.facts, self.plan
        self.insertions: Dict[Tuple[int, int], _Insertion] = {}
        self.uncounted: Set[Tuple[int, int]] = set()  # loaders re-read whenever they run out (no epoch counter)
        self.problems: List[Tuple[cst.CSTNode, str, Optional[Loader]]] = []
        self.seen: Set[Tuple[int, int]] = set()
        if not any(plan.of(x).needs_epoch for x in facts.loaders):
            return
        for node, ref in list(facts.uses(lambda x: plan.of(x).needs_epoch)):
            if ref.eval:
                continue
            for loader in ref.loaders:
                if plan.of(loader).needs_epoch:
                    self._consume(node, loader, ref.text, 0)
        self._report()

    def _consume(self, node: cst.CSTNode, loader: Loader, text: str, depth: int, via_call: bool = False) -> None:
        """`node` (an expression naming `loader` as `text`, or a call of a function that iterates
        it) is used; find the epoch loop around it, or follow the function's callers."""
        ctx, facts = self.ctx, self.facts
        if depth > 6 or (id(node), loader.index) in self.seen:
            return
        self.seen.add((id(node), loader.index))
        parent = ctx.parent(node)
        call = ctx.parent(parent) if isinstance(parent, cst.Arg) and not via_call else None
        if not via_call and self._not_an_iteration(node, parent):
            return
        if isinstance(call, cst.Call):
            fname = call.func.value if isinstance(call.func, cst.Name) else None
            if fname in _NON_CONSUMING or (isinstance(call.func, cst.Attribute) and call.func.attr.value == "set_epoch") \
                    or ctx.resolve(call.func) == TM_SET_EPOCH:
                return
            if ctx.resolve(call.func) in ("itertools.cycle",):
                self.problems.append((call, f"`itertools.cycle({text})` replays the first epoch's batches and never "
                                            f"reshuffles: loop over the loader per epoch and call "
                                            f"`{ctx.tm}.set_epoch({text}, epoch)` before each pass", None))
                return
            if any(v is node for fn, skip in facts.callees(call) for _p, v in bind_params(fn, call, skip)):
                return  # the callee's parameter is followed on its own
        fn = facts.function_of(node)
        batch_loops = {id(loop) for loop in [header_loop(node, ctx)] if loop is not None}
        loops = [lp for lp in loops_of(node, ctx, fn) if id(lp) not in batch_loops]
        iter_call = isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "iter"
        if loops:
            self._at_loop(node, loops, loader, text, iter_call)
            return
        if not isinstance(fn, cst.FunctionDef) or self._contains_set_epoch(fn):
            return
        # `fn` consumes the loader without a loop: its callers' loops are the epoch loops.
        for call_site in facts.callers.get(id(fn), []):
            for callee, skip in facts.callees(call_site):
                if callee is not fn:
                    continue
                translated = self._translate(node, text, fn, call_site, skip)
                if translated is not None and self._other_loader(fn, call_site, skip, text, loader):
                    continue  # `run(model, valid_loader)`: this call hands the function another loader
                if translated is not None:
                    self._consume(call_site, loader, translated, depth + 1, via_call=True)
                elif loops_of(call_site, ctx, facts.function_of(call_site)):
                    self.problems.append((call_site, (
                        f"`{fn.name.value}()` iterates `{text}`, which its caller cannot name, inside an epoch loop: "
                        f"pass the epoch to it and call `{ctx.tm}.set_epoch({text}, epoch)` before iterating"), loader))

    def _other_loader(self, fn: cst.FunctionDef, call: cst.Call, skip: bool, text: str, loader: Loader) -> bool:
        """The argument `call` passes for the parameter `text` starts with is a known loader, but
        not `loader`: a function that iterates whatever loader it is given (`run(model,
        train_loader)`, `run(model, valid_loader)`) reshuffles each one at its own calls."""
        head = text.split(".")[0].split("[")[0]
        for param, value in bind_params(fn, call, skip):
            if param == head:
                refs = refs_at(self.ctx, value)
                return bool(refs) and not any(loader in ref.loaders for ref in refs)
        return False

    def _not_an_iteration(self, node: cst.CSTNode, parent: Optional[cst.CSTNode]) -> bool:
        """Assignment targets, aliases (`a = loader`), returns and tuples of them."""
        ctx = self.ctx
        if isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.AnnAssign, cst.Del)) \
                and getattr(parent, "target", None) is node:
            return True
        if isinstance(parent, cst.For) and parent.target is node:
            return True
        if isinstance(parent, (cst.Assign, cst.Return, cst.AnnAssign)) and parent.value is node:
            return True
        if isinstance(parent, (cst.Element, cst.DictElement)):
            holder = ctx.parent(ctx.parent(parent))
            if isinstance(holder, (cst.Assign, cst.Return)):
                return True
        return False

    def _translate(self, node: cst.CSTNode, text: str, fn: cst.FunctionDef, call: cst.Call, skip: bool) -> Optional[str]:
        """`text` (valid in `fn`) as the caller of `call` would write it."""
        facts = self.facts
        head = text.split(".")[0].split("[")[0]
        for param, value in bind_params(fn, call, skip):
            if param == head:
                if not is_pure(value):
                    return None
                return code(value) + text[len(head):]
        if head in ("self", "cls"):
            if isinstance(call.func, cst.Attribute):
                receiver = call.func.value
                if is_pure(receiver):
                    return code(receiver) + text[len(head):]
            return None
        k = key_of(node) or text
        ref = facts.lookup(node, k)
        if ref is not None and ref.scope is facts.ctx.module:
            return text
        return None

    def _contains_set_epoch(self, scope: cst.CSTNode) -> bool:
        return self.facts.contains_set_epoch(scope)

    def _at_loop(self, node: cst.CSTNode, loops: List[cst.CSTNode], loader: Loader, text: str, iter_call: bool) -> None:
        ctx = self.ctx
        loop = self._epoch_loop(loops)
        key = (id(loop), loader.index)
        statement = ctx.statement_of(node)
        if iter_call and statement is not None and isinstance(ctx.parent(statement), cst.IndentedBlock) \
                and ctx.parent(statement) is not loop.body and not self._contains_set_epoch(loop):
            # `except StopIteration: it = iter(loader)` in a loop of steps: a new pass starts
            # whenever the loader runs out, which no loop counter numbers (a set_epoch with the
            # outer counter would replay one order for every pass within it): the runtime's
            # samplers number the passes themselves; anything else gets a TODO
            self.insertions[key] = _Insertion(loop, loader, text, statement, "before", None, (
                "its iterator is made again whenever it runs out, inside a loop whose counter does not count "
                "the passes: count them and call set_epoch with that count before each `iter(...)`"))
            self.uncounted.add(key)
            return
        if key in self.uncounted:
            return
        if key in self.insertions:
            held = self.insertions[key]
            if held is None or _names_eval(text) or not _names_eval(held.text):
                return
            # one factory's loader under two names (`train_loader`, `dev_loader`): the epoch
            # reshuffles the training one
            del self.insertions[key]
        if self._contains_set_epoch(loop) or self._calls_set_epoch(loop):
            self.insertions[key] = None  # type: ignore[assignment]
            return
        var, problem = self._loop_var(loop)
        if iter_call and not _named_epoch(loop) and loop is not loops[-1]:
            # `for _ in range(accumulation_steps): batch = next(it)` inside a step loop, with
            # `it = iter(loader)` made again on StopIteration: the inner index repeats, the
            # outermost counting loop's (the step) does not
            outer = next((o for o in reversed(loops) if isinstance(o, cst.For) and _counts(o.iter)), None)
            var, problem = (self._loop_var(outer) if outer is not None else
                            (None, "its batches are drawn with next() from iterators the loop makes again"))
        body = loop.body
        if not isinstance(body, cst.IndentedBlock):
            problem = problem or "the loop body is on one line"
        anchor, where = (body.body[0] if isinstance(body, cst.IndentedBlock) else loop), "before"
        binding = self._binding_in(loop, loader, text, node)
        if binding is not None:
            anchor, where = binding, "after"
        self.insertions[key] = _Insertion(loop, loader, text, anchor, where, var, problem)

    def _binding_in(self, loop: cst.CSTNode, loader: Loader, text: str, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The statement inside `loop` that (re)creates the loader, if any."""
        ctx = self.ctx
        candidates = [loader.statement] + [r.binding for r in loader.refs if r.text == text]
        for statement in candidates:
            if statement is None or not isinstance(ctx.parent(statement), cst.IndentedBlock):
                continue
            if any(anc is loop for anc in ctx.ancestors(statement)):
                return statement
        return None

    def _calls_set_epoch(self, loop: cst.CSTNode) -> bool:
        """A function called in the loop body already calls set_epoch."""
        facts = self.facts
        functions = {id(f): f for f in (facts.ctx.enclosing(c, cst.FunctionDef) for c in facts.set_epoch_calls) if f}
        for fn in functions.values():
            for call in facts.callers.get(id(fn), []):
                if any(anc is loop for anc in self.ctx.ancestors(call)):
                    return True
        return False

    def _epoch_loop(self, loops: List[cst.CSTNode]) -> cst.CSTNode:
        for loop in loops:
            if _named_epoch(loop):
                return loop
        for loop in loops:
            if isinstance(loop, cst.For) and isinstance(loop.iter, (cst.List, cst.Tuple, cst.Set, cst.Dict)):
                continue
            return loop
        return loops[0]

    def _loop_var(self, loop: cst.CSTNode) -> Tuple[Optional[str], str]:
        if isinstance(loop, cst.For):
            if not _counts(loop.iter) and not _named_epoch(loop):
                # `for dataset in datasets:`: its variable is no epoch number
                return None, f"the loop over `{code(loop.iter)[:40]}` does not count epochs"
            target = loop.target
            if isinstance(target, cst.Name):
                return target.value, ""
            if isinstance(target, (cst.Tuple, cst.List)) and isinstance(loop.iter, cst.Call) \
                    and isinstance(loop.iter.func, cst.Name) and loop.iter.func.value == "enumerate" \
                    and target.elements and isinstance(target.elements[0].value, cst.Name):
                return target.elements[0].value.value, ""
            return None, "the loop variable is not a plain name"
        counter = self._counter(loop)
        if counter is None:
            return None, "this `while` loop has no evident epoch counter"
        return counter, ""

    def _counter(self, loop: cst.While) -> Optional[str]:
        """The `while` loop's epoch counter: a name the body adds to (`epoch += 1`) and never sets
        again (a patience counter, `bad += 1` in one branch and `bad = 0` in the other, repeats
        its values, and so would the shuffle); of several, one named like an epoch, then one added
        to once on every pass (in the body itself, not a branch or an inner loop) that the test
        reads, then any such, then one the test reads (a step count: rising, so still a new
        shuffle each pass)."""
        increments: List[str] = []
        for n in _outermost(loop.body, cst.BaseSmallStatement, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            if isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name) and isinstance(n.operator, cst.AddAssign):
                increments.append(n.target.value)
        reset = {name for n in _outermost(loop.body, cst.Assign, (cst.FunctionDef, cst.ClassDef, cst.Lambda))
                 for t in n.targets for name in target_names(t.target)}
        candidates = [name for name in increments if name not in reset]
        if not candidates:
            return None
        test_names = {n.value for n in _outermost(loop.test, cst.Name)}
        top = [s for s in loop.body.body] if isinstance(loop.body, cst.IndentedBlock) else []
        every_pass = [small.target.value for s in top if isinstance(s, cst.SimpleStatementLine) for small in s.body
                      if isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name)
                      and isinstance(small.operator, cst.AddAssign) and small.target.value in candidates]
        for preferred in ([n for n in candidates if "epoch" in n.lower()],
                          [n for n in every_pass if n in test_names],
                          every_pass,
                          [n for n in candidates if n in test_names]):
            if preferred:
                return preferred[0]
        return None

    # report --------------------------------------------------------------------------------
    def _reshuffles_itself(self, loader: Loader) -> bool:
        """A loader whose sampler is (or becomes, in this run) one of the runtime's: `tm.sampler`
        and `tm.shard_sampler` start a new epoch on every pass where nobody calls `set_epoch`, so
        a place the tool cannot reach needs no TODO."""
        decided = self.plan.of(loader)
        return loader.runtime_sampler or (decided.status in ("plain", "custom") and decided.sampler == "distributed")

    def _report(self) -> None:
        ctx, facts = self.ctx, self.facts
        tm = ctx.tm
        for node, message, loader in self.problems:
            if loader is None or not self._reshuffles_itself(loader):  # `cycle()` replays whatever the sampler does
                self.report(node, message)
        for ins in sorted((i for i in self.insertions.values() if i is not None), key=lambda i: i.loader.index):
            if (ins.problem or ins.var is None) and self._reshuffles_itself(ins.loader):
                continue
            if ins.problem or ins.var is None:
                self.report(ins.loop, f"`{ins.text}` needs `{tm}.set_epoch({ins.text}, epoch)` at the start of every "
                                      f"epoch, but {ins.problem or 'no epoch variable was found'}: add it by hand")
                continue
            call_text = f"{tm}.set_epoch({ins.text}, {ins.var})"
            imports = [ctx.runtime_import()]
            loop_scope = facts.function_of(ins.loop)
            if not ctx.uses_runtime():  # plain torch code stays plain torch where it can
                if ins.loader.sampler_name is not None and ins.loader.sampler_name[0] is loop_scope:
                    call_text = f"{ins.loader.sampler_name[1]}.set_epoch({ins.var})"
                    imports = []
                elif ins.loader.inline_distributed:
                    call_text = f"{ins.text}.sampler.set_epoch({ins.var})"
                    imports = []
            new = stmt(call_text)
            edit = insert_after(ins.anchor, [new]) if ins.where == "after" else insert_before(ins.anchor, [new])
            self.report(ins.loop, f"`{ins.text}` is reshuffled each epoch only when its sampler knows the epoch: "
                                  f"call `{call_text}` at the start of the epoch",
                        edits=[edit], imports=imports, statement=ins.loop)


def _named_epoch(loop: cst.CSTNode) -> bool:
    if isinstance(loop, cst.For):
        return "epoch" in code(loop.target).lower()
    return "epoch" in code(loop.test).lower()


# what a loop over epochs iterates: a count (`range(n)`, `itertools.count()`), also through
# `enumerate`, `tqdm`, `trange`
_COUNTING = frozenset({"range", "count", "trange", "tnrange"})
_THROUGH = frozenset({"enumerate", "tqdm", "tqdm_notebook", "progress_bar", "track"})


def _counts(node: cst.BaseExpression) -> bool:
    """`range(epochs)`, `tqdm(range(n))`, `itertools.count(1)`, `enumerate(anything)` (its index
    counts): an iterable whose items number the passes."""
    if not isinstance(node, cst.Call):
        return False
    name = code(node.func).rsplit(".", 1)[-1]
    if name in _COUNTING or name == "enumerate":
        return True
    return name in _THROUGH and bool(node.args) and _counts(node.args[0].value)


def _names_eval(text: str) -> bool:
    """`dev_loader`, `self.val_loader`: a name that says evaluation data."""
    return splits.verdict(splits.words(text.split(".")[-1].split("[")[0])) == "eval"


def _outermost(node: cst.CSTNode, kind: type, skip: Tuple[type, ...] = ()) -> List[cst.CSTNode]:
    """The `kind` nodes under `node` (not those inside one another, nor under a `skip` node),
    in source order."""
    out: List[cst.CSTNode] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, skip):
            continue
        if isinstance(n, kind):
            out.append(n)
            continue
        stack.extend(reversed(child_nodes(n)))
    return out

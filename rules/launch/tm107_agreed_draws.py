"""TM107: random draws every rank must agree on (a random learning rate, a shuffled split)."""

from __future__ import annotations

from typing import List, Optional, Set

import libcst as cst

from torchmigrate import analysis
from torchmigrate.finding import Safety, insert_after, replace
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code, set_kwarg
from torchmigrate.rule import Example, Rule
from torchmigrate.program.batches import batch_facts
from torchmigrate.program.metrics import is_load
from torchmigrate.program.effects import CLOCK, EXISTS_TESTS, MKDIR, NUMPY, OUTPUT, PROBE, READ, RANDOM, WRITE
from torchmigrate.program.rank_guards import collective_guard
from torchmigrate.program.syntax import next_statement
from torchmigrate.program.writes import call_kinds, kept_run_folder
from torchmigrate.rules._active import active
from torchmigrate.rules.launch.base import SEEDERS, per_sample
from torchmigrate.rules.launch.streams import agreed_draws, batch_permutation, in_broadcast
from torchmigrate.rules._guards import claim_tests

_RANDOM = ("random.", "numpy.random.")
_EXISTS = EXISTS_TESTS | {"os.path.lexists"}
# Draws of these modules that are not draws: generators and seeding.
_NOT_DRAWS = frozenset({"random.seed", "random.Random", "random.SystemRandom", "random.getstate",
                        "random.setstate", "numpy.random.seed", "numpy.random.default_rng",
                        "numpy.random.RandomState", "numpy.random.get_state", "numpy.random.set_state",
                        "numpy.random.Generator"})
# Of torch's draws only the permutation is configuration-like (a split); `torch.randn(...)` at
# function level is a fixed noise batch or a dummy input, the same whoever draws it.
_TORCH_DRAWS = frozenset({"torch.randperm"})
_SHUFFLES = frozenset({"random.shuffle", "numpy.random.shuffle"})
_SPLIT = "torch.utils.data.random_split"
# Reads of the clock, and other values that differ per process, that programs turn into names:
# a run folder `runs/1127_153108`, a log file with the process id. Every rank reads its own,
# so the ranks disagree (in different seconds, or always for a pid or a uuid).
_PER_PROCESS = frozenset({"datetime.datetime.now", "datetime.datetime.today", "datetime.datetime.utcnow",
                          "datetime.date.today", "time.time", "time.strftime", "time.localtime",
                          "time.gmtime", "time.ctime", "time.asctime", "uuid.uuid1", "uuid.uuid4",
                          "os.getpid"})
# Values that are only ever names.
_IDENTIFIERS = frozenset({"uuid.uuid1", "uuid.uuid4", "os.getpid"})
# What turns such a value into a name: string formatting, or paths built from it.
_NAMING_METHODS = frozenset({"strftime", "isoformat", "format", "hex", "join", "replace"})
_PATH_CALLS = frozenset({"os.path.join", "pathlib.Path", "pathlib.PurePath", "os.makedirs", "os.mkdir", "open"})
_NAMING_CALLS = frozenset({"str", "os.path.join", "pathlib.Path", "pathlib.PurePath", "os.makedirs", "open",
                           "os.mkdir", "time.strftime", "time.ctime", "time.asctime"})

class AgreedDraws(Rule):
    """
    ## What it does
    - `lr = random.random() * 1e-3` (any draw of `random`, `numpy.random`, or `torch.randperm`
      and the like) in the program's own code, outside the data pipeline and the model, becomes
      `lr = tm.broadcast_object(random.random() * 1e-3)`: rank 0 draws, every rank uses its value.
      This covers hyperparameters picked at random, epoch counts, permutations that split the
      data into train and validation, and draws inside a loop that set how many steps it takes
      (`seq_len = int(np.random.normal(bptt, 5))` followed by `i += seq_len`).
    - `random.shuffle(files)` (or `np.random.shuffle`) outside a loop is followed by
      `files[:] = tm.broadcast_object(files)`.
    - `random.shuffle(self.graphs)` (or `torch.randperm(n)`, `np.random.permutation(n)`,
      `random.sample(...)`) drawn again and again by training code, in a loop or in a function
      of another module (a trainer's epoch, a helper that mixes real and fake rows), becomes
      `tm.agreed(random.shuffle, self.graphs)`: drawn under streams seeded alike on every rank,
      new at each call, the program's own streams untouched. Once `tm.seed_per_rank()` has
      parted the streams (or per-rank work has drawn different amounts from them), each rank
      would otherwise cut its share from its own order.
    - `save_dir = util.get_save_dir(base, name)`, where the helper looks for a free name by
      testing in a loop which paths exist (and may make the folder it finds), becomes
      `save_dir = tm.on_main(util.get_save_dir, base, name)`: the main process picks, every
      rank gets its pick (run on every rank, the first rank makes `name-01` and the next finds
      it taken and makes `name-02`). The same search written inline (`while
      os.path.exists(folder): folder = f"{base}_{n}"; n += 1`) is followed by `folder =
      tm.broadcast_object(folder)`: every rank takes rank 0's pick.
    - `run_path = mkdtemp(prefix=run_id, dir=experiment_dir)` (a fresh run folder in the program's
      output folder, never removed) becomes `tm.on_main(mkdtemp, prefix=run_id,
      dir=experiment_dir)`: one folder, made by the main process, named alike on every rank.
    - `random_split(dataset, lengths)` without a generator gets
      `generator=tm.shared_generator()`, seeded alike on every rank.
    - A dataset's own random reordering, assigned (`dataset = TUDataset(root, name).shuffle()`
      in PyTorch Geometric, a Hugging Face `ds.shuffle()` without a seed), becomes
      `tm.agreed(ds.shuffle, ...)`: the same order on every rank, so the slices taken from it
      (train/test) and the shards cut from them agree.
    - `run_id = datetime.now().strftime("%m%d_%H%M%S")` (a read of the clock, a process id or
      a uuid that the program turns into a name: formatted, or part of a path), in any module of
      the program, becomes `run_id = tm.broadcast_object(datetime.now().strftime(...))`: every
      rank names the same run folder. Also where the name is built in steps (`date =
      datetime.now()`, `stamp = "{}-{}".format(date.hour, date.minute)`, `folder = root + stamp`).
      Reads of the clock for timing are left alone.
    - `answer = input("dataset? ")`, in any module (also at import time), becomes
      `tm.input("dataset? ")`: the main process asks, every rank gets its answer (under
      torchrun every rank reads the same stdin, and they would compete for its lines).

    ## Why is this bad?
    Each process has its own random stream (unseeded, it starts from the OS; seeded per rank, it
    differs by design). A value drawn once and then used as configuration differs per rank:
    ranks train with different learning rates or epoch counts (one rank leaves the loop while
    the others wait in a collective), or split the files differently so one rank's validation
    set is another rank's training set. A draw that sets the number of steps of a loop makes
    ranks run different numbers of steps, which hangs DDP.

    Draws in `__getitem__`, `forward`, transforms and collate functions (and in the methods a
    transform's `__call__` calls, such as a `get_params` that shuffles the order of its
    operations) are left alone: there different values per rank are what augmentation and
    dropout want. So is a minibatch drawn at each step (`random.sample(users, batch_size)`):
    each rank draws its own, independent batches, as data parallelism wants. Values that only seed a
    generator are left alone too (TM105 is about seeds).
    """

    code = "TM107"
    name = "agreed-draws"
    summary = "Draw random configuration once, on rank 0, and share it with every rank"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import random
            import torch
            def main(config):
                lr = random.random() * 0.0005
                epochs = random.choice([100, 150])
                train(config, lr, epochs)
            """,
            after="""
            import random
            import torch
            import torchmigrate.runtime as tm
            def main(config):
                lr = tm.broadcast_object(random.random() * 0.0005)
                epochs = tm.broadcast_object(random.choice([100, 150]))
                train(config, lr, epochs)
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        if not active(ctx) or not analysis.facts(ctx).calls:
            return
        done: Set[cst.CSTNode] = set()
        if ctx.options.migrating:
            self._probe_loops()
        made_agreed = agreed_draws(ctx)
        for call in made_agreed:
            self._agree(call)
        for call, name in analysis.facts(ctx).calls:
            if call in made_agreed:
                continue
            if name is None and isinstance(call.func, cst.Name) and call.func.value == "input":
                self._input(call)
                continue
            if name is None and _dataset_shuffle(call):
                self._shuffled_dataset(call)
                continue
            kinds = call_kinds(ctx, call)
            if kinds is not None:
                if PROBE in kinds and kinds <= _PROBES_ONLY:
                    self._on_main(call)
                elif CLOCK in kinds and kinds <= _READS_ONLY:
                    # a helper of the program that reads the clock (`cur_time = get_local_time()`)
                    assign = self._assignment(call)
                    if assign is not None and assign not in done:
                        done.add(assign)
                        self._name(assign, call)
                continue
            if not name:
                continue
            if name == "tempfile.mkdtemp":
                self._run_folder(call)
            elif name == _SPLIT:
                self._split(call)
            elif name in _SHUFFLES:
                self._shuffle(call)
            elif _is_draw(name) and not any(a.keyword is not None and a.keyword.value == "generator"
                                            for a in call.args):  # an explicit generator is seeded
                assign = self._assignment(call)
                if assign is not None and assign not in done:
                    done.add(assign)
                    self._draw(assign)
            elif name in _PER_PROCESS:
                assign = self._assignment(call)
                if assign is not None and assign not in done:
                    done.add(assign)
                    self._name(assign, call)

    # --- what qualifies -------------------------------------------------------------------

    def _assignment(self, call: cst.Call) -> Optional[cst.Assign]:
        """The `x = ...` statement whose value holds the draw (not inside a lambda or a def
        nested in the value)."""
        for anc in self.ctx.ancestors(call):
            if isinstance(anc, cst.Call) and (self.ctx.resolve(anc.func) or "").endswith(".broadcast_object"):
                return None  # already shared
            if isinstance(anc, cst.Assign):
                return anc
            if isinstance(anc, (cst.BaseStatement, cst.Lambda, cst.BaseSmallStatement)):
                return None
        return None

    def _agreed_place(self, node: cst.CSTNode) -> bool:
        """Code that runs once per rank in step with the others: not in the data pipeline or
        the model, not under a rank guard, and in an entry module if at module level."""
        ctx = self.ctx
        if not ctx.program.is_entry:
            # A draw in another module may run per sample in a data-loader worker (a crop
            # helper of `transforms.py`), where a collective cannot run.
            return False
        func = ctx.enclosing(node, cst.FunctionDef)
        if func is not None and (self._per_sample(func) or not self._called_in_step(func)):
            return False
        return collective_guard(ctx, node) is None

    def _called_in_step(self, func: cst.FunctionDef) -> bool:
        """Every use of a module-level function is a plain call from code that is not per
        sample: a function passed as a value (`transform=random_crop`, `map(f, ...)`) may run
        in a data-loader worker. Methods are judged by their class (`_per_sample`)."""
        ctx = self.ctx
        if ctx.parent(func) is not ctx.module:
            return True
        for name in ctx.named(func.name.value):
            if name is func.name or not _reads_function(ctx, name):
                continue
            call = ctx.parent(name)
            if not (isinstance(call, cst.Call) and call.func is name):
                return False
            caller = ctx.enclosing(call, cst.FunctionDef)
            if caller is not None and self._per_sample(caller):
                return False
        return True

    def _called_in_a_loop(self, func: Optional[cst.FunctionDef]) -> bool:
        """A function of this file that its callers here call inside a loop (a helper of the
        training step): what it draws is drawn again at every call, not configuration."""
        ctx = self.ctx
        if func is None:
            return False
        for name in ctx.named(func.name.value):
            call = ctx.parent(name)
            if isinstance(call, cst.Call) and call.func is name and self._loops_between(call):
                return True
            if isinstance(call, cst.Attribute) and call.attr is name and isinstance(ctx.parent(call), cst.Call) \
                    and ctx.parent(call).func is call and self._loops_between(call):
                return True
        return False

    def _per_sample(self, func: cst.FunctionDef) -> bool:
        return per_sample(self.ctx, func)

    def _loops_between(self, node: cst.CSTNode) -> List[cst.CSTNode]:
        loops = []
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                break
            if isinstance(anc, (cst.For, cst.While)):
                loops.append(anc)
        return loops

    # --- the three forms ------------------------------------------------------------------

    def _draw(self, assign: cst.Assign) -> None:
        ctx = self.ctx
        if len(assign.targets) != 1 or not self._agreed_place(assign) or self._batch_order(assign) \
                or self._in_batch_iterator(assign) \
                or any(batch_permutation(self.ctx, c) for c in self.ctx.within(assign.value, cst.Call)):
            return
        target = dotted(assign.targets[0].target)
        if target is None:
            return
        uses = self._uses_after(assign, target)
        if uses and all(self._seeds(u) for u in uses):
            return
        loops = self._loops_between(assign)
        if loops and not self._sets_step_count(loops[0], target):
            return
        if not loops and self._called_in_a_loop(ctx.enclosing(assign, cst.FunctionDef)):
            return  # drawn again at each step (mixup's `lam` in a helper the step calls): each rank its own
        why = ("sets how many steps this loop takes, so ranks would run different numbers of steps (DDP hangs)"
               if loops else "is configuration that would differ on each rank")
        self.report(assign, f"`{target}` is drawn at random on every rank and {why}: rank 0 draws and "
                            f"every rank uses its value",
                    edits=[replace(assign.value, lambda v: cst.Call(
                        func=cst.parse_expression(f"{ctx.tm}.broadcast_object"), args=[cst.Arg(v)]))],
                    imports=[ctx.runtime_import()])

    def _shuffled_dataset(self, call: cst.Call) -> None:
        """`dataset = TUDataset(root, name).shuffle()` (PyTorch Geometric, a Hugging Face dataset
        without a seed): a new dataset in an order drawn from the global streams, which differ
        per rank unless the program seeds them alike. Sliced into train and test sets, each rank
        would split the data its own way (one rank's training graphs another's test graphs) and
        the sampler's disjoint shares of positions would overlap in samples. The draw becomes
        `tm.agreed(dataset.shuffle)`: the same order on every rank (the program's own order where
        its streams are seeded alike), new at each call."""
        ctx = self.ctx
        statement = ctx.statement_of(call)
        if not isinstance(statement, cst.SimpleStatementLine) or not any(
                isinstance(small, (cst.Assign, cst.AnnAssign)) for small in statement.body):
            return  # (its value is used: a loader's in-place `shuffle()` is the data family's)
        if not self._agreed_place(call) or any(isinstance(a, cst.Call) and (ctx.resolve(a.func) or "").endswith(".agreed")
                                              for a in ctx.ancestors(call)):
            return
        self.report(call, f"`{code(call)}` draws a new order of the dataset on each rank from its own random "
                          f"streams: the ranks would split and shard the data differently; the order is drawn alike "
                          f"on every rank (`{ctx.tm}.agreed`)",
                    edits=[replace(call, lambda c: cst.Call(func=cst.parse_expression(f"{ctx.tm}.agreed"),
                                                            args=[cst.Arg(c.func), *c.args]))],
                    imports=[ctx.runtime_import()])

    def _name(self, assign: cst.Assign, read: cst.Call) -> None:
        """`run_id = datetime.now().strftime(...)` (a clock read, a pid or a uuid turned into a
        name): rank 0's value on every rank, so every rank names the same run folder and files.
        Only where every rank runs the assignment in step (not per sample, not in a loop, not
        under a rank guard), in any module of the program."""
        ctx = self.ctx
        if len(assign.targets) != 1 or self._loops_between(assign) or self._elapsed(read):
            return
        target = dotted(assign.targets[0].target)
        always_a_name = (self.ctx.resolve(read.func) or "") in _IDENTIFIERS
        if target is None or not (always_a_name or self._names(assign.value) or self._flows_to_name(assign, target)):
            return
        func = ctx.enclosing(assign, cst.FunctionDef)
        if func is not None and (self._per_sample(func) or (ctx.program.is_entry and not self._called_in_step(func))):
            return
        if collective_guard(ctx, assign) is not None or self._in_file_write(assign):
            return
        what = dotted(read.func) or "the clock"
        shared = self._named_part(assign.value, read)
        self.report(assign, f"`{target}` is made from `{what}(...)`, which each rank reads for itself, and names "
                            "something (a run folder, a file): ranks would disagree on it. Rank 0's value is "
                            "shared with every rank",
                    edits=[replace(shared, lambda v: cst.Call(
                        func=cst.parse_expression(f"{ctx.tm}.broadcast_object"), args=[cst.Arg(v)]))],
                    imports=[ctx.runtime_import()])

    def _elapsed(self, read: cst.Call) -> bool:
        """The clock read is one side of a difference (`time.time() - self.start`): a duration,
        shown or logged, never the name of a run (and a broadcast of it, in a timer's method,
        would be a collective wherever the program asks how long it has run)."""
        parent = self.ctx.parent(read)
        return isinstance(parent, cst.BinaryOperation) and isinstance(parent.operator, cst.Subtract)

    def _named_part(self, value: cst.BaseExpression, read: cst.Call) -> cst.BaseExpression:
        """What to share: the value itself (a string, a path), or, where the value is an object
        built from the name (`SummaryWriter(log_dir=root + datetime.now().strftime(...))`, a
        logger, an open file), the argument that holds the clock read: the name is shared, the
        object is built on each rank (a writer or a lock cannot be sent to the others)."""
        if not isinstance(value, cst.Call):
            return value
        func = value.func
        naming = (isinstance(func, cst.Attribute) and func.attr.value in _NAMING_METHODS) or \
            (self.ctx.resolve(func) or dotted(func) or "") in _NAMING_CALLS
        if naming:
            return value
        for a in value.args:
            if a.value is read or any(n is read for n in self.ctx.within(a.value, cst.Call)):
                return a.value
        return value

    def _in_file_write(self, node: cst.CSTNode) -> bool:
        """Inside `with open(path, "a") as log:`: the value goes into a file that the main process
        alone writes once the migration guards the block (TM504), where a collective would wait
        for the other ranks forever (BicycleGAN's `now = time.strftime("%c")` in its log header)."""
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, cst.With) and any(
                    isinstance(i.item, cst.Call) and analysis.opens_file_for_writing(i.item, self.ctx.resolve(i.item.func),
                                                                             analysis.open_modes(self.ctx))
                    for i in anc.items):
                return True
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef)):
                return False
        return False

    def _names(self, value: cst.CSTNode) -> bool:
        """`value` formats a string (`.strftime(...)`, `str(...)`, an f-string, `"%s" % x`) or
        builds a path."""
        if any(True for _ in self.ctx.within(value, cst.FormattedString)):
            return True
        for call in self.ctx.within(value, cst.Call):
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value in _NAMING_METHODS:
                return True
            if (self.ctx.resolve(func) or dotted(func) or "") in _NAMING_CALLS:
                return True
        for op in self.ctx.within(value, cst.BinaryOperation):
            if isinstance(op.operator, (cst.Modulo, cst.Add)) and isinstance(op.left, (cst.SimpleString, cst.FormattedString)):
                return True
        return False

    def _flows_to_name(self, assign: cst.Assign, target: str, depth: int = 0) -> bool:
        """A read of `target` names something, directly (`_names_use`) or through names built
        from it in the same scope: `date = datetime.now()`, `stamp = "{}-{}".format(date.hour,
        date.minute)`, `folder = root + "/run_" + stamp`, `os.makedirs(folder)`."""
        for use in self._uses_after(assign, target):
            if self._names_use(use):
                return True
            if depth >= 3:
                continue
            statement = self.ctx.statement_of(use)
            inner = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1 \
                else None
            if isinstance(inner, cst.Assign) and len(inner.targets) == 1 and _inside(self.ctx, use, inner.value) \
                    and self._builds_text(inner.value):
                name = dotted(inner.targets[0].target)
                if name is not None and name != target and self._flows_to_name(inner, name, depth + 1):
                    return True
        return False

    def _builds_text(self, value: cst.BaseExpression) -> bool:
        """`value` builds a string: formatting (`_names`) or a concatenation with a literal
        (`root + "/run_" + stamp`)."""
        if self._names(value) or isinstance(value, (cst.SimpleString, cst.ConcatenatedString)):
            return True
        return any(isinstance(op.operator, cst.Add) and (isinstance(op.left, (cst.SimpleString, cst.FormattedString))
                                                         or isinstance(op.right, (cst.SimpleString, cst.FormattedString)))
                   for op in self.ctx.within(value, cst.BinaryOperation))

    def _probe_loops(self) -> None:
        """`while os.path.exists(folder): folder = base + "_" + str(counter); counter += 1`
        written inline (not in a helper of its own, `_on_main`): every rank probes on its own,
        and a rank that probes after the main process made its folder picks the next name, so
        its run writes elsewhere (or the main process's does). After the loop, every rank takes
        rank 0's pick: `folder = tm.broadcast_object(folder)`. Only where every rank runs the
        loop in step (not per sample, not in a loop, not under a rank guard)."""
        ctx = self.ctx
        for loop in ctx.nodes(cst.While):
            test = loop.test
            while isinstance(test, cst.BooleanOperation):  # `while exists(p) and n < 100:`
                test = test.left
            if not isinstance(test, cst.Call):
                continue
            if ctx.resolve(test.func) in _EXISTS and test.args:
                probed = dotted(test.args[0].value)
            elif isinstance(test.func, cst.Attribute) and test.func.attr.value in ("exists", "is_dir") and not test.args:
                probed = dotted(test.func.value)
            else:
                continue
            if probed is None or not any(dotted(t.target) == probed for a in ctx.within(loop.body, cst.Assign)
                                         for t in a.targets):
                continue  # a wait for a file another process makes, not a search for a free name
            after = next_statement(ctx, loop)
            if after is not None and "broadcast_object" in ctx.module.code_for_node(after):
                continue  # shared already
            func = ctx.enclosing(loop, cst.FunctionDef)
            if self._loops_between(loop) or (func is not None and self._per_sample(func)) \
                    or collective_guard(ctx, loop) is not None or self._in_file_write(loop):
                continue
            self.report(loop, f"every rank probes for a free name here on its own: a rank that tests after the main "
                              f"process has made `{probed}` picks another one. Every rank takes rank 0's pick",
                        edits=[insert_after(loop, [cst.parse_statement(
                            f"{probed} = {ctx.tm}.broadcast_object({probed})")])],
                        imports=[ctx.runtime_import()])

    def _names_use(self, use: cst.CSTNode) -> bool:
        """A read of the value in a path: `os.path.join(root, run_id)`, `Path(root) / run_id`,
        `open(...)`, `os.makedirs(...)`, or formatted into one (`now.strftime("%m%d-%H%M%S")`,
        `now.isoformat()`). (A timing value printed in an f-string is no name.)"""
        parent = self.ctx.parent(use)
        if isinstance(parent, cst.Attribute) and parent.value is use and parent.attr.value in ("strftime", "isoformat") \
                and isinstance(self.ctx.parent(parent), cst.Call):
            # (a helper returning the formatted name: its callers share what it returns)
            return not isinstance(self.ctx.parent(self.ctx.parent(parent)), cst.Return)
        for anc in self.ctx.ancestors(use):
            if isinstance(anc, cst.BinaryOperation) and isinstance(anc.operator, cst.Subtract):
                return False  # `(time.time() - time_now) / iters`: a duration, not a name
            if isinstance(anc, cst.BinaryOperation) and isinstance(anc.operator, cst.Divide):
                return True
            if isinstance(anc, cst.Call):
                func = anc.func
                name = self.ctx.resolve(func) or dotted(func) or ""
                if name in _PATH_CALLS or (isinstance(func, cst.Attribute) and func.attr.value == "joinpath"):
                    return True
            if isinstance(anc, (cst.BaseStatement, cst.BaseSmallStatement)):
                return False
        return False

    def _input(self, call: cst.Call) -> None:
        """`input(prompt)`, in any module (at import time too): every rank inherits stdin, so
        the ranks compete for the lines (different answers, or EOFError on all but one).
        `tm.input` asks on the main process and gives every rank its answer. Left alone under a
        rank guard (the user already asks once) and where `input` is not the builtin."""
        ctx = self.ctx
        f = analysis.facts(ctx)
        if "input" in ctx.imports.names or "input" in f.functions or any(
                isinstance(t.target, cst.Name) and t.target.value == "input" for a in f.assigns for t in a.targets):
            return
        func = ctx.enclosing(call, cst.FunctionDef)
        if (func is not None and self._per_sample(func)) or collective_guard(ctx, call) is not None:
            return
        self.report(call, "every rank asks this question, and under torchrun every rank reads the same stdin: the "
                          "ranks compete for the answer (different answers, or EOFError on all but one). The main "
                          "process asks and every rank gets its answer",
                    edits=[replace(call.func, lambda _f: cst.parse_expression(f"{ctx.tm}.input"))],
                    imports=[ctx.runtime_import()])
        self._agreed_tests(call)

    def _agreed_tests(self, node: cst.CSTNode) -> None:
        """`if os.path.isdir(logdir): answer = tm.input(...)  else: os.makedirs(logdir)`: every rank
        must reach the question, so every rank must see what rank 0 saw of the file system before
        it created the folder; each file-system test around it becomes rank 0's answer
        (`tm.broadcast_object(os.path.isdir(logdir))`)."""
        ctx = self.ctx
        for anc in ctx.ancestors(node):
            if isinstance(anc, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return
            if not isinstance(anc, (cst.If, cst.While)):
                continue
            for test in ctx.within(anc.test, cst.Call):
                name = ctx.resolve(test.func) or dotted(test.func) or ""
                own = isinstance(test.func, cst.Attribute) and test.func.attr.value in ("exists", "is_dir", "is_file")
                if name not in _EXISTS and not own:
                    continue
                if in_broadcast(ctx, test) or not claim_tests(ctx, [test]):
                    continue  # shared already (a second run), or by another rule of this run
                self.report(test, "this test of the file system decides whether every rank reaches the question "
                                  "asked on the main process: every rank takes rank 0's answer",
                            edits=[replace(test, lambda t: cst.Call(
                                func=cst.parse_expression(f"{ctx.tm}.broadcast_object"), args=[cst.Arg(t)]))],
                            imports=[ctx.runtime_import()])

    def _shuffle(self, call: cst.Call) -> None:
        ctx = self.ctx
        statement = ctx.parent(ctx.parent(call))
        if not (isinstance(ctx.parent(call), cst.Expr) and isinstance(statement, cst.SimpleStatementLine)
                and len(statement.body) == 1 and len(call.args) == 1 and not call.args[0].star):
            return
        if not self._agreed_place(call) or self._loops_between(call) or self._batch_order(statement) \
                or self._in_batch_iterator(call):
            return
        if self._next_is_broadcast(statement):
            return
        target = cst.helpers.get_full_name_for_node(call.args[0].value)
        if target is None:
            return
        line = cst.parse_statement(f"{target}[:] = {ctx.tm}.broadcast_object({target})")
        self.report(call, f"every rank shuffles `{target}` its own way, so ranks disagree on its order (a split "
                          f"taken from it differs per rank): rank 0's order is shared with every rank",
                    edits=[insert_after(statement, [line])], imports=[ctx.runtime_import()])

    def _agree(self, call: cst.Call) -> None:
        """`random.shuffle(self.graphs)` drawn again and again by training code (each epoch, in a
        trainer's method or a helper of another module) -> `tm.agreed(random.shuffle, self.graphs)`:
        every rank draws the same order, new each call (see `streams.agreed_draws`)."""
        ctx = self.ctx
        what = code(call.func)
        self.report(call, f"`{what}(...)` draws an order again and again from each rank's own random stream (the "
                          "streams part once training starts): ranks would cut their shares from different orders, "
                          "so shares overlap and some samples are never seen. It is drawn alike on every rank",
                    edits=[_handed_to(call, f"{ctx.tm}.agreed")], imports=[ctx.runtime_import()])

    def _on_main(self, call: cst.Call) -> None:
        """`save_dir = get_save_dir(base, name)`, a helper of the program that probes for a free
        name (and makes that folder) -> `tm.on_main(get_save_dir, base, name)`: the main process
        picks, every rank gets its pick. Only where every rank runs the call in step."""
        ctx = self.ctx
        assign = ctx.parent(call)
        if not (isinstance(assign, (cst.Assign, cst.AnnAssign)) and assign.value is call) or any(a.star for a in call.args):
            return
        func = ctx.enclosing(call, cst.FunctionDef)
        if (func is not None and self._per_sample(func)) or collective_guard(ctx, call) is not None \
                or self._in_file_write(call):
            return
        what = code(call.func)
        self.report(call, f"`{what}(...)` looks for a free name by testing which paths exist: every rank would probe "
                          "on its own, and once one has made its folder the next finds it taken and picks another. "
                          "The main process picks and every rank gets its pick",
                    edits=[_handed_to(call, f"{ctx.tm}.on_main")], imports=[ctx.runtime_import()])

    def _run_folder(self, call: cst.Call) -> None:
        """`run_path = tempfile.mkdtemp(prefix=run_id, dir=experiment_dir)`, the run's output folder
        (`writes.kept_run_folder`: named inside the program's folders, never removed): each rank
        would make a folder of its own and write its run there. `tm.on_main(tempfile.mkdtemp,
        ...)`: the main process makes it, every rank gets its name."""
        ctx = self.ctx
        assign = ctx.parent(call)
        if not (isinstance(assign, cst.Assign) and assign.value is call and len(assign.targets) == 1
                and isinstance(assign.targets[0].target, cst.Name)) or any(a.star for a in call.args):
            return
        target = assign.targets[0].target.value
        if not kept_run_folder(ctx, assign):
            return
        func = ctx.enclosing(call, cst.FunctionDef)
        if (func is not None and self._per_sample(func)) or collective_guard(ctx, call) is not None \
                or self._loops_between(call):
            return
        self.report(call, f"`{target}` is a fresh folder made in the run's output folder (its name differs per call): "
                          "every rank would make one of its own and write its run there. The main process makes it "
                          "and every rank gets its name",
                    edits=[_handed_to(call, f"{ctx.tm}.on_main")], imports=[ctx.runtime_import()])

    def _split(self, call: cst.Call) -> None:
        ctx = self.ctx
        if any(a.keyword is not None and a.keyword.value == "generator" for a in call.args) \
                or any(a.star for a in call.args) or len(call.args) >= 3:
            return
        func = ctx.enclosing(call, cst.FunctionDef)
        # A split is never drawn per sample, so it is fixed in every module of the program.
        if (func is not None and self._per_sample(func)) or collective_guard(ctx, call) is not None:
            return
        self.report(call, "random_split draws from each rank's own random stream, so ranks split the dataset "
                          "differently (one rank's validation samples are another's training samples): split with "
                          "a generator seeded alike on every rank",
                    edits=[replace(call, lambda c: set_kwarg(
                        c, "generator", cst.parse_expression(f"{ctx.tm}.shared_generator()")))],
                    imports=[ctx.runtime_import()])

    # --- helpers --------------------------------------------------------------------------

    def _batch_order(self, node: cst.CSTNode) -> bool:
        """`node` draws the order of a hand-made batch loop (`perm = torch.randperm(n)` sliced
        by `for i in range(0, n, bs)`): the data family shares it where it shards the loop, and
        leaves it alone where it does not, since rank 0's order alone would make every rank
        train on the same batches."""
        draws = batch_facts(self.ctx).order_draws
        return id(node) in draws or any(id(c) in draws for c in self.ctx.within(node, cst.Call))

    def _in_batch_iterator(self, node: cst.CSTNode) -> bool:
        """`node` lies in a hand-made batch iterator or its builder (`class BatchGen: def
        __init__(self, data, bs): ... random.shuffle(batches)`; `ModuleView.iterator_builders`):
        it orders the data it is handed, which TM201 shards where it is built (`BatchGen(
        tm.shard_stream(train), 8)`). Each rank orders its own part; rank 0's order of rank 0's
        batches on every rank would make all ranks train on the same data."""
        from torchmigrate.rules.data.plan import data_plan

        builders = data_plan(self.ctx).iterator_builders
        if not builders:
            return False
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.ClassDef, cst.FunctionDef)) and self.ctx.parent(anc) is self.ctx.module:
                return anc.name.value in builders
        return False

    def _next_is_broadcast(self, statement: cst.CSTNode) -> bool:
        block = self.ctx.parent(statement)
        body = list(getattr(block, "body", ()))
        if statement not in body or body.index(statement) + 1 >= len(body):
            return False
        return "broadcast_object" in cst.Module(body=[body[body.index(statement) + 1]]).code

    def _uses_after(self, assign: cst.Assign, target: str) -> List[cst.CSTNode]:
        """Reads of `target` in the scope of the assignment (a dotted `config.lr` counts by its
        attribute reads)."""
        ctx = self.ctx
        scope = ctx.scope_of(assign)
        head = target.split(".")[-1]
        found = []
        for name in ctx.named(head):
            if ctx.scope_of(name) is not scope or _inside(ctx, name, assign):
                continue
            full = name
            parent = ctx.parent(name)
            if "." in target:
                if not (isinstance(parent, cst.Attribute) and parent.attr is name and dotted(parent) == target):
                    continue
                full = parent
            found.append(full)
        return found

    def _seeds(self, use: cst.CSTNode) -> bool:
        """A use as the argument of a seeding call, or in a print."""
        for anc in self.ctx.ancestors(use):
            if isinstance(anc, cst.Call):
                name = self.ctx.resolve(anc.func) or dotted(anc.func) or ""
                if name in SEEDERS or name.endswith(("seed_everything", ".print")) or name == "print":
                    return True
            if isinstance(anc, cst.BaseStatement):
                return False
        return False

    def _sets_step_count(self, loop: cst.CSTNode, target: str) -> bool:
        """`target` bounds the loop: read in a `while` test, a `range(...)` of a `for`, or added
        to a counter that the `while` test reads (`i += seq_len`)."""
        if isinstance(loop, cst.While):
            tested = _names_in(loop.test)
            if target in tested:
                return True
            for node in self.ctx.within(loop, cst.AugAssign, skip_defs=True):
                if dotted(node.target) in tested and target in _names_in(node.value):
                    return True
            return False
        if isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call) and dotted(loop.iter.func) == "range":
            return target in _names_in(loop.iter)
        return False


# a helper whose effects are at most these, with a clock read among them, only turns the clock
# into a value (`get_local_time()` formatting `datetime.now()`): sharing rank 0's result is safe
_READS_ONLY = frozenset({CLOCK, OUTPUT, READ, RANDOM, NUMPY})
# A helper that looks for a free name and may make the folder it finds, write a file into it,
# print, read the clock: nothing another rank needs besides what it returns (what does not
# pickle, a writer, the runtime lets each rank make for itself).
_PROBES_ONLY = frozenset({PROBE, MKDIR, WRITE, CLOCK, OUTPUT, READ, RANDOM, NUMPY})


def _handed_to(call: cst.Call, runtime: str):
    """The edit that makes `f(a, b)` `tm.agreed(f, a, b)` (or another runtime function that calls
    what it is handed with the rest of its arguments)."""
    return replace(call, lambda c: c.with_changes(
        func=cst.parse_expression(runtime),
        args=[cst.Arg(c.func, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *c.args]))


def _dataset_shuffle(call: cst.Call) -> bool:
    """`ds.shuffle()`: a dataset's method that returns it reordered at random (PyTorch Geometric,
    Hugging Face datasets), with no seed or generator of its own."""
    return isinstance(call.func, cst.Attribute) and call.func.attr.value == "shuffle" and not any(
        a.keyword is None or a.keyword.value in ("seed", "generator") for a in call.args)


def _is_draw(name: str) -> bool:
    if name in _TORCH_DRAWS:
        return True
    return name.startswith(_RANDOM) and name not in _NOT_DRAWS and name not in _SHUFFLES


def _reads_function(ctx, name: cst.Name) -> bool:
    """`name` may refer to the module's function: a read (`is_load`: not an attribute's or a
    keyword's name), and not another module's name in an import (`from linear_eval import main
    as linear_eval`)."""
    return not isinstance(ctx.parent(name), (cst.ImportAlias, cst.AsName, cst.ImportFrom)) and is_load(ctx, name)


def _inside(ctx, node: cst.CSTNode, container: cst.CSTNode) -> bool:
    return any(anc is container for anc in ctx.ancestors(node))


def _names_in(node: cst.CSTNode) -> Set[str]:
    """Dotted names read in an expression (`i`, `data.size`, `self.n`)."""
    out: Set[str] = set()

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, (cst.Name, cst.Attribute)):
            name = dotted(n)
            if name:
                out.add(name)
                if isinstance(n, cst.Name):
                    return
        for child in n.children:
            go(child)

    go(node)
    return out

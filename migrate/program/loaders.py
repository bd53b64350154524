"""Loader facts of one module: every DataLoader, what it loads and how, and where it is visible.

Built once per module on first use (`loader_facts(ctx)`, kept in ``ctx.facts["loaders"]``),
whatever rules are enabled: the data rules (`rules/data/`, their plan) decide from these facts
what to change, and other families ask them too (the metrics rules: which loader a loop
iterates). Nothing here formats a message or plans an edit.

A `Loader` (``loaders(ctx)``, in source order):

- ``call``: the ``DataLoader(...)`` `cst.Call` of the original tree (or a call of one of the
  program's DataLoader subclasses, `ModuleView.loader_classes`);
- ``statement``: the statement holding it; ``scope``: the FunctionDef (or Module) holding it;
- ``target``: what it is bound to where it is built, as source text (``train_loader``,
  ``self.val_loader``, ``loaders["train"]``) or None (``return DataLoader(...)``, an argument);
- ``kind``: ``"train"``, ``"eval"`` or ``"mixed"`` (one call builds both, e.g.
  ``shuffle=is_train`` or a dict comprehension over ``["train", "val"]``, then ``condition``
  is the expression true for training); ``eval`` is True/False/None (mixed);
- ``status``: ``"plain"`` (no sampler), ``"distributed"`` (already has a DistributedSampler or a
  ``tm.sampler``/``tm.eval_sampler``/``tm.shard_sampler``), ``"custom"`` (its own sampler or
  batch_sampler: ``custom_arg``), ``"iterable"`` (an IterableDataset), ``"unknown"``
  (``*args``/``**kwargs`` the tool cannot see: ``unknown`` says which), ``"sharded"`` (the
  dataset or sampler already takes the rank);
- ``dataset`` / ``shuffle``: the original argument expressions (None when absent);
- ``refs``: every `Ref` (scope node, source text) under which the loader is visible in this
  file: its target, names bound from helper returns (``train_loader, val_loader =
  get_loaders()``), parameters it is passed to (``def evaluate(model, loader)``), ``self.``
  attributes. `refs_at(ctx, node)` answers "which loaders does this expression denote";
  `LoaderFacts.uses` lists every expression naming one, `iterated_with_grad` whether a loop
  over one runs outside ``no_grad``.

Name resolution uses the import table (`ctx.resolve`); helpers are followed by name within the
file (functions, methods, class constructors), never across modules: across modules the
program says only which classes are DataLoader subclasses and whether any module builds a
loader (`ModuleView.loader_classes`, `program_loaders`).
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.program import effects, splits
from torchmigrate.program.writes import call_kinds
from torchmigrate.program.syntax import unparen
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.nodes import code
from torchmigrate.syntax.walk import child_nodes

# torch's DataLoader, and the subclasses of it other libraries export under that name, which take
# `sampler=` as it does (PyTorch Geometric's mini-batch loaders of graphs)
DATALOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader",
               "torch_geometric.loader.DataLoader", "torch_geometric.loader.dataloader.DataLoader",
               "torch_geometric.data.DataLoader", "torch_geometric.loader.DenseDataLoader",
               "torch_geometric.loader.dense_data_loader.DenseDataLoader", "torch_geometric.data.DenseDataLoader")
DIST_SAMPLERS = ("torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler")
# Progress bars, which wrap the loader they iterate (`for x, y in tqdm(loader)`).
TQDM_CALLS = {
    f"{module}.{fn}"
    for module in ("tqdm", "tqdm.auto", "tqdm.autonotebook", "tqdm.notebook", "tqdm.std", "tqdm.rich",
                   "tqdm.asyncio", "tqdm.tk", "tqdm.gui", "tqdm.cli")
    for fn in ("tqdm", "trange")
}
RUNTIME = "torchmigrate.runtime"
TM_SAMPLER = RUNTIME + ".sampler"
TM_EVAL_SAMPLER = RUNTIME + ".eval_sampler"
TM_SHARD_SAMPLER = RUNTIME + ".shard_sampler"
TM_SET_EPOCH = RUNTIME + ".set_epoch"
TM_UNSHARDED = RUNTIME + ".unsharded"
ITERABLE_BASES = ("torch.utils.data.IterableDataset", "torch.utils.data.dataset.IterableDataset",
                  "torch.utils.data.IterDataPipe", "torch.utils.data.datapipes.datapipe.IterDataPipe",
                  "torchdata.datapipes.iter.IterDataPipe", "datasets.IterableDataset")
# Dataset factories known to yield iterable (stream) datasets.
ITERABLE_FACTORIES = ("webdataset.", "torchdata.datapipes.iter.", "torchdata.nodes.", "torchtext.datasets.")
# Frameworks that shard data loaders themselves: the data rules stay out of their way.
SELF_SHARDING = ("pytorch_lightning", "lightning", "accelerate", "horovod", "ignite.distributed")

# DataLoader(dataset, batch_size=1, shuffle=None, sampler=None, batch_sampler=None, ...)
PARAMS = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn",
          "pin_memory", "drop_last", "timeout", "worker_init_fn", "multiprocessing_context", "generator")
KNOWN_KWARGS = frozenset(PARAMS) | {"prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"}

_RANK_RE = re.compile(r"^(?:rank|local_rank|global_rank|world_size|num_replicas|num_shards|shard_id|shard_index)$")
_TRAIN_FLAGS = ("train", "is_train", "training", "is_training")
NO_GRAD = ("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad",
           "torch.autograd.grad_mode.inference_mode", "torch.autograd.inference_mode")
# Exact-type tests for the hot paths: `isinstance` against a LibCST class goes through
# ABCMeta.__instancecheck__ whenever the type differs; these classes have no subclasses.
_REFERENCES = frozenset({cst.Name, cst.Attribute, cst.Subscript})  # what `key_of` may name
# per-sample fields of a dataset that code pairs with a loader's batches in dataset order
ORDERED_FIELDS = frozenset({"targets", "labels", "samples", "imgs", "train_labels", "test_labels", "y"})
_CHAIN = frozenset({cst.Attribute, cst.Subscript})  # `a.b`, `a[k]`: an expression on `.value`
_DEFINITIONS = frozenset({cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName})
_SCOPES = frozenset({cst.FunctionDef, cst.Lambda, cst.ClassDef})


# --- the published facts --------------------------------------------------------------------

@dataclass(eq=False)
class Ref:
    """`text` denotes `loaders` inside `scope` (a FunctionDef, ClassDef for `self.` names, or Module)."""

    scope: cst.CSTNode
    key: str
    text: str
    loaders: List["Loader"] = field(default_factory=list)
    binding: Optional[cst.CSTNode] = None  # the statement that binds it in `scope`, if any
    eval: bool = False  # a dict entry whose key says val/test (`loaders["val"]`)
    # which branch of a mixed loader built by a factory it holds, where every binding says:
    # `test_dl = make_loader(test_ds, False)` for `shuffle=train` in `make_loader` -> {"eval"}
    branches: Set[str] = field(default_factory=set)

    @property
    def branch(self) -> Optional[str]:
        """"train" or "eval" when every binding of it builds that branch, else None."""
        return next(iter(self.branches)) if len(self.branches) == 1 and "unknown" not in self.branches else None


@dataclass(eq=False)
class Loader:
    """One `DataLoader(...)` call (or a call of the program's DataLoader subclass)."""

    call: cst.Call
    statement: Optional[cst.CSTNode]
    scope: cst.CSTNode
    target: Optional[str]
    kind: str = "train"
    status: str = "plain"
    # status "unknown": what hides the sampling ("star-args", "no-dataset", "kwargs" (then
    # `kwargs_arg`), "kwargs-shuffle": `shuffle` from a dict and elsewhere)
    unknown: str = ""
    kwargs_arg: Optional[cst.BaseExpression] = None  # the `**dict` that may set `sampler`/`shuffle` (or `batch_size`)
    dataset: Optional[cst.BaseExpression] = None
    shuffle: Optional[cst.BaseExpression] = None
    kwargs_shuffle: Optional[str] = None  # the `**name` dict that may hold `shuffle`
    condition: Optional[str] = None  # mixed loaders: the expression that is true for training
    condition_is_shuffle: bool = False  # ... and it is the `shuffle=` argument itself
    sampler_shuffles: bool = False  # an existing distributed sampler shuffles
    sampler_name: Optional[Tuple[cst.CSTNode, str]] = None  # (scope, name) of an unconditional DistributedSampler
    inline_distributed: bool = False  # `sampler=DistributedSampler(...)` written in the call
    refs: List[Ref] = field(default_factory=list)
    bound: Tuple[str, ...] = ()  # the keys of the refs it is bound to where it is built
    index: int = 0
    custom_arg: Optional[cst.Arg] = None  # its own `sampler=`/`batch_sampler=` (status "custom")
    custom_param: str = ""  # ... and which of the two it is
    runtime_sampler: bool = False  # already has `tm.sampler`/`tm.shard_sampler` (reshuffles by itself)
    grouped: Optional[str] = None  # an evaluation batch size that is a computed group size (kept unsharded)
    # `memory_loader.dataset.targets`: read in dataset order beside the batches of a loader that
    # no training step iterates (a kNN feature bank): its batches must cover the dataset in order
    ordered: Optional[str] = None
    # the batch size expression (`opt.batch_size`) read inside a loop over the loader, where it
    # is a shape (`out.view(opt.batch_size, -1)`, `torch.ones(opt.batch_size, 1)`): a partial
    # last batch would not fit it
    sized_by: Optional[str] = None
    # the batch size expression read as a value inside a loop over the loader (a shape, a count;
    # a log line does not count), whatever `drop_last` says: the loop assumes that a batch holds
    # that many samples
    batch_read: Optional[str] = None
    # where those loops read it (`torch.randn(args.batch_size, nz)`, `x.view(args.batch_size, -1)`)
    batch_uses: List[cst.CSTNode] = field(default_factory=list)

    @property
    def eval(self) -> Optional[bool]:
        return {"train": False, "eval": True}.get(self.kind)


# --- small helpers ---------------------------------------------------------------------------

def _expression_words(node: cst.CSTNode) -> List[str]:
    """Words of the names and strings in an expression; `train=False` counts as 'eval'.
    (A loop, not a recursive closure: a closure that calls itself is a reference cycle, left for
    the garbage collector, which the runner keeps paused while a file is processed.)"""
    out: List[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        tp = type(n)
        if tp is cst.Name:
            out.extend(splits.words(n.value))
        elif tp is cst.SimpleString:
            try:
                value = n.evaluated_value
            except Exception:  # noqa: BLE001 - odd literals carry no signal
                continue
            if not isinstance(value, bytes):
                out.extend(splits.words(value))
        elif tp is cst.Arg and n.keyword is not None:
            if n.keyword.value in _TRAIN_FLAGS and type(n.value) is cst.Name and n.value.value in ("True", "False"):
                out.append("train" if n.value.value == "True" else "eval")
            elif n.keyword.value not in _TRAIN_FLAGS:
                stack.append(n.value)
        else:
            stack.extend(reversed(child_nodes(n)))
    return out


def key_of(node: cst.CSTNode) -> Optional[str]:
    """`a.b` for Name/Attribute chains, `a.b['k']` for a string subscript of one, else None."""
    tp = type(node)
    if tp is cst.Subscript:
        base = dotted(node.value)
        index = _literal_index(node)
        if base is not None and index is not None:
            return f"{base}[{index!r}]"
        return None
    if tp is cst.Name or tp is cst.Attribute:
        return dotted(node)
    return None


def _literal_index(node: cst.Subscript) -> Optional[str]:
    if len(node.slice) != 1 or not isinstance(node.slice[0].slice, cst.Index):
        return None
    value = node.slice[0].slice.value
    if isinstance(value, cst.SimpleString):
        try:
            text = value.evaluated_value
        except Exception:  # noqa: BLE001
            return None
        return text if isinstance(text, str) else None
    return None


def is_pure(node: cst.CSTNode) -> bool:
    """Cheap to evaluate twice and free of side effects: names, attributes, constant subscripts."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return is_pure(node.value)
    if isinstance(node, cst.Subscript):
        if not is_pure(node.value):
            return False
        for element in node.slice:
            if not isinstance(element.slice, cst.Index):
                return False
            value = element.slice.value
            if not (isinstance(value, (cst.SimpleString, cst.Integer)) or is_pure(value)):
                return False
        return True
    return False


def is_literal(node: Optional[cst.CSTNode], *values: str) -> bool:
    return isinstance(node, cst.Name) and node.value in values


def _drawing_alike(ctx, node: cst.CSTNode) -> bool:
    """`tm.same_draws(loader)`, which TM203 adds after a whole evaluation loader (an earlier run):
    the loader itself, not a use of it."""
    arg = ctx.parent(node)
    call = ctx.parent(arg) if isinstance(arg, cst.Arg) else None
    return isinstance(call, cst.Call) and ctx.resolve(call.func) == RUNTIME + ".same_draws"


def _same_test(a: str, b: str) -> bool:
    """Two tests written alike but for spaces and quotes (`x=='train'`, `x == "train"`)."""
    def norm(t: str) -> str:
        return t.replace(" ", "").replace("'", '"')
    return norm(a) == norm(b)


def _parenthesize(text: str, node: cst.CSTNode) -> str:
    return f"({text})" if isinstance(node, (cst.IfExp, cst.Lambda, cst.NamedExpr)) and not node.lpar else text


def bind_args(call: cst.Call) -> Optional[Dict[str, cst.Arg]]:
    """DataLoader parameters -> the Arg passing them, or None when `*args` hides positions."""
    out: Dict[str, cst.Arg] = {}
    position = 0
    for a in call.args:
        if a.star == "*":
            return None
        if a.star == "**":
            continue
        if a.keyword is None:
            if position >= len(PARAMS):
                return None
            out[PARAMS[position]] = a
            position += 1
        else:
            out[a.keyword.value] = a
    return out


def asks_for_evaluation(call: cst.Call, target: cst.CSTNode) -> bool:
    """`dev_loader = get_loader(...)`, `test_dl = make_loader(args.test_file, bs)`: the name it is
    bound to, else its arguments' names, say evaluation data."""
    said = splits.verdict(splits.words(code(target)))
    if said is not None:
        return said == "eval"
    found = [w for a in call.args for n in (a.value,) if type(n) in (cst.Name, cst.Attribute, cst.SimpleString)
             for w in splits.words(code(n))]
    return splits.verdict(found) == "eval"


def _func_name(call: cst.Call) -> Optional[str]:
    tp = type(call.func)
    if tp is cst.Name:
        return call.func.value
    if tp is cst.Attribute:
        return call.func.attr.value
    return None


def loops_of(node: cst.CSTNode, ctx, stop: cst.CSTNode) -> List[cst.CSTNode]:
    """Loops whose body (not header) holds `node`, innermost first, up to `stop`."""
    out = []
    child = node
    for anc in ctx.ancestors(node):
        if anc is stop:
            break
        tp = type(anc)
        if (tp is cst.For or tp is cst.While) and child in (anc.body, anc.orelse):
            out.append(anc)
        if tp in _SCOPES:
            break
        child = anc
    return out


def header_loop(node: cst.CSTNode, ctx) -> Optional[cst.For]:
    """The `for` whose iterable expression holds `node` (a batch loop over it)."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.For) and child is anc.iter:
            return anc
        if isinstance(anc, (cst.BaseStatement, cst.IndentedBlock)):
            return None
        child = anc
    return None


# --- the analysis -----------------------------------------------------------------------------

class _Scan:
    """Names, functions and returns of the module, from the context's node index."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.functions: List[cst.FunctionDef] = ctx.nodes(cst.FunctionDef)
        self.returns: List[cst.Return] = ctx.nodes(cst.Return)

    @property
    def identifiers(self) -> Set[str]:
        return {n.value for n in self.ctx.nodes(cst.Name)}

    def named(self, values: Set[str]) -> List[cst.Name]:
        """The Name nodes spelling one of `values`, in source order."""
        found = [n for v in values for n in self.ctx.named(v)]
        if len(values) > 1:
            found.sort(key=self.ctx.position)
        return found


class LoaderFacts:
    """The loaders of one module and where they are visible: built once per module (see
    `loader_facts`), whatever rules run; what to do with them is the data rules' plan."""

    def release(self) -> None:
        """Called by `Context.close()`: loaders and their refs point at each other (and at the
        module, their scope), so unlink them to let reference counting free the file's tree."""
        for loader in self.loaders:
            loader.refs.clear()

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.facts = analysis.facts(ctx)
        self.loaders: List[Loader] = []
        self.refs: Dict[Tuple[int, str], Ref] = {}
        self.dict_refs: Dict[Tuple[int, str], List[Ref]] = {}
        self.heads: Set[str] = set()  # first names of every ref key: a cheap filter for lookups
        self._sites: Optional[Tuple[Tuple[int, int, int], List[Tuple[cst.CSTNode, List[Ref]]]]] = None
        self._scope_chains: Dict[int, Tuple[cst.CSTNode, ...]] = {}  # see `scopes`
        self._words_of_dataset: Dict[int, List[str]] = {}  # see `_dataset_words`
        self.distributed = analysis.is_distributed(ctx)
        self.skip_file = any(ctx.imports.imports_module(m) for m in SELF_SHARDING)
        # calls of a loader factory that builds training loaders, made for evaluation data
        # (`dev_loader = get_loader(dev_file, bs)`): TM201 makes them `tm.unsharded(get_loader, ...)`
        self.whole_sites: List[Tuple[cst.Call, List["Loader"]]] = []
        self._eval_sites: List[Tuple[cst.Call, List["Loader"]]] = []
        subclasses = ctx.program.loader_classes  # the program's own DataLoader subclasses
        calls = [c for c, name in self.facts.calls
                 if name in DATALOADERS or (subclasses and dotted(c.func) in subclasses)]
        self.scan: Optional[_Scan] = None
        if not calls:
            return
        self.scan = _Scan(ctx)
        self.functions_by_name: Dict[str, List[cst.FunctionDef]] = {}
        for fn in self.scan.functions:
            self.functions_by_name.setdefault(fn.name.value, []).append(fn)
        self.assigns_by_key: Dict[str, List[cst.Assign]] = {}
        for assign in self.facts.assigns:
            for t in assign.targets:
                k = key_of(t.target)
                if k is not None:
                    self.assigns_by_key.setdefault(k, []).append(assign)
        # same-file call graph (by name), computed once
        self.callee_map: Dict[int, List[Tuple[cst.FunctionDef, bool]]] = {}
        self.callers: Dict[int, List[cst.Call]] = {}
        for call, _name in self.facts.calls:
            found = self._find_callees(call)
            if found:
                self.callee_map[id(call)] = found
                for fn, _skip in found:
                    self.callers.setdefault(id(fn), []).append(call)
        self.set_epoch_calls = [c for c, name in self.facts.calls if name == TM_SET_EPOCH or (
            type(c.func) is cst.Attribute and c.func.attr.value == "set_epoch")]
        self.by_call: Dict[int, Loader] = {}
        for i, call in enumerate(calls):
            self.loaders.append(self._loader(call, i))
            self.by_call[id(call)] = self.loaders[-1]
        self._follow()
        self._trained_on()
        self._only_evaluated()
        self._order_bound()
        self._sized_by_batch()
        self.whole_sites = [(c, found) for c, found in self._eval_sites
                            if all(x.kind == "train" and x.status == "plain" for x in found)]

    def _trained_on(self) -> None:
        """A loader whose name says evaluation (`valid_loader`) but that a loop of this module
        trains on (a backward pass and an optimizer step per batch: a fine-tuning run on the
        validation set, in the function it is handed to) is a training loader: its use decides,
        not its name. (A backward alone, an adversarial evaluation's, is no training.)"""
        ctx = self.ctx
        for loader in self.loaders:
            if loader.kind != "eval":
                continue
            for node, _ref in self.uses(lambda x, loader=loader: x is loader):
                site = _iteration_site(node, ctx)
                if isinstance(site, cst.For) and analysis.runs_backward(ctx, site.body) \
                        and any(type(c.func) is cst.Attribute and c.func.attr.value == "step"
                                for c in ctx.within(site.body, cst.Call, skip_defs=True)) \
                        and not self.grad_free(site, 0) and not self._trains_by_mode(site) \
                        or self._handed_to_training(node):
                    loader.kind = "train"
                    break

    def _trains_by_mode(self, loop: cst.For) -> bool:
        """Every backward of `loop` runs under a test of its function's mode parameter (`def
        iterate(mode, loader, model, optimizer)` with `if mode == "train": loss.backward()`,
        `if is_train:`): one loop for the training and the validation passes, so the loader a
        caller hands it for validation is no training loader (its name says which)."""
        ctx = self.ctx
        fn = ctx.enclosing(loop, cst.FunctionDef)
        if fn is None:
            return False
        params = {p.name.value for p in (*fn.params.params, *fn.params.kwonly_params)}
        backwards = [c for c in ctx.within(loop.body, cst.Call, skip_defs=True)
                     if type(c.func) is cst.Attribute and c.func.attr.value == "backward"]
        if not backwards:
            return False
        for call in backwards:
            tests = [anc.test for anc in ctx.ancestors(call) if isinstance(anc, cst.If)
                     and any(a is loop for a in ctx.ancestors(anc))]
            if not any(_mode_test(t, params) for t in tests):
                return False
        return True

    def _handed_to_training(self, node: cst.CSTNode) -> bool:
        """`node` is an argument of a call to another module's function that trains on that
        parameter (`train_model(model=model, db_gen=devset_gen, optimizer=optimizer)`;
        `ModuleView.training_params`)."""
        argument = self.ctx.parent(node)
        call = self.ctx.parent(argument) if isinstance(argument, cst.Arg) and argument.value is node else None
        trained = self.ctx.program.training_params.get(dotted(call.func) or "") if isinstance(call, cst.Call) else None
        if not trained:
            return False
        if argument.keyword is not None:
            return any(argument.keyword.value == name for _, name in trained)
        positional = [a for a in call.args if a.keyword is None]
        index = next((i for i, a in enumerate(positional) if a is argument), -1)
        return index >= 0 and not any(a.star for a in positional[:index + 1]) and any(index == position for position, _ in trained)

    def _only_evaluated(self) -> None:
        """A loader over the training set that no loop trains on (`example_loader =
        DataLoader(train_ds, shuffle=False)`, iterated only under `torch.no_grad()` to collect
        embeddings for a plot) is an evaluation loader: sharded as training data, every rank would
        hold, and the main process plot, only its own share. Its use decides, not its dataset."""
        ctx = self.ctx
        for loader in self.loaders:
            if loader.kind != "train" or (loader.shuffle is not None and not is_literal(loader.shuffle, "False", "None")):
                continue
            sites = [site for node, _ref in self.uses(lambda x, loader=loader: x is loader)
                     for site in [_iteration_site(node, ctx)] if isinstance(site, cst.For)]
            if sites and all(not analysis.runs_backward(ctx, site.body)
                             and (self.grad_free(site, 0) or self._in_eval_mode(site)) for site in sites):
                loader.kind = "eval"

    def _in_eval_mode(self, loop: cst.For) -> bool:
        """`model.eval()` earlier in the function of `loop`, which neither steps nor calls anything
        named for training in its body (AnTao97's feature extraction: `self.model.eval()`, then
        `feats.append(self.model(x).detach())` over the training set, no `no_grad`)."""
        ctx = self.ctx
        fn = ctx.enclosing(loop, cst.FunctionDef)
        if fn is None:
            return False
        start = ctx.position(loop) or 0
        evals = [c for c in ctx.within(fn.body, cst.Call, skip_defs=True)
                 if type(c.func) is cst.Attribute and c.func.attr.value == "eval" and not c.args
                 and (ctx.position(c) or 0) < start]
        if not evals:
            return False
        for c in ctx.within(loop.body, cst.Call, skip_defs=True):
            name = (dotted(c.func) or "").rsplit(".", 1)[-1].lower()
            if any(word in name for word in ("step", "train", "fit", "update", "backward", "learn", "optim", "loss")):
                return False  # (`learner.fit_batch(x)`, `self.train_step(batch)`: trains, elsewhere)
        return True

    # --- scopes -------------------------------------------------------------------------
    def function_of(self, node: cst.CSTNode) -> cst.CSTNode:
        return self.ctx.enclosing(node, cst.FunctionDef) or self.ctx.module

    def class_of(self, fn: cst.CSTNode) -> Optional[cst.ClassDef]:
        if not isinstance(fn, cst.FunctionDef):
            return None
        block = self.ctx.parent(fn)
        owner = self.ctx.parent(block) if block is not None else None
        return owner if isinstance(owner, cst.ClassDef) else None

    def scopes(self, node: cst.CSTNode) -> Tuple[cst.CSTNode, ...]:
        """Scopes whose names `node` can see, innermost first (methods also see `self.` names).
        Every node of a function sees the same chain, so it is built once per function (lookups
        ask for it for every name that may denote a loader)."""
        fn = self.ctx.enclosing(node, cst.FunctionDef)
        if fn is None:
            return (self.ctx.module,)
        chain = self._scope_chains.get(id(fn))
        if chain is None:
            cls = self.class_of(fn)
            chain = (fn,) + ((cls,) if cls is not None else ()) + self.scopes(fn)
            self._scope_chains[id(fn)] = chain
        return chain

    def binding_scope(self, node: cst.CSTNode, key: str) -> cst.CSTNode:
        fn = self.function_of(node)
        if key.split(".")[0] in ("self", "cls"):
            return self.class_of(fn) or fn
        return fn

    def assigns_at(self, node: cst.CSTNode, key: str) -> List[cst.Assign]:
        """Assignments to `key` that `node` sees: those of the innermost scope binding it (a
        parameter of an enclosing function hides outer assignments)."""
        found = self.assigns_by_key.get(key, [])
        if not found:
            return []
        head = key.split(".")[0].split("[")[0]
        for scope in self.scopes(node):
            if isinstance(scope, cst.ClassDef):
                if head in ("self", "cls"):
                    return [a for a in found if self.class_of(self.function_of(a)) is scope]
                continue
            here = [a for a in found if self.function_of(a) is scope]
            if here:
                return here
            if isinstance(scope, cst.FunctionDef) and head in _param_names(scope):
                return []
        return []

    def lookup(self, node: cst.CSTNode, key: str) -> Optional[Ref]:
        for scope in self.scopes(node):
            ref = self.refs.get((id(scope), key))
            if ref is not None:
                return ref
        return None

    def lookup_dict(self, node: cst.CSTNode, base: str) -> List[Ref]:
        for scope in self.scopes(node):
            refs = self.dict_refs.get((id(scope), base))
            if refs:
                return refs
        return []

    def add_ref(self, scope: cst.CSTNode, key: str, text: str, loaders: Sequence[Loader],
                binding: Optional[cst.CSTNode] = None, branches: Set[str] = frozenset({"unknown"})) -> bool:
        ref = self.refs.get((id(scope), key))
        changed = False
        if ref is not None and not branches <= ref.branches:
            ref.branches |= branches
            changed = True
        if ref is None:
            ref = Ref(scope, key, text, binding=binding, branches=set(branches))
            self.refs[(id(scope), key)] = ref
            self.heads.add(key.split(".")[0].split("[")[0])
            if "[" in key:
                self.dict_refs.setdefault((id(scope), key.split("[", 1)[0]), []).append(ref)
            changed = True
        for loader in loaders:
            if loader not in ref.loaders:
                ref.loaders.append(loader)
                loader.refs.append(ref)
                changed = True
        return changed

    def refs_at(self, node: cst.CSTNode) -> List[Ref]:
        """Refs that the expression `node` denotes (a wildcard subscript of a dict denotes all)."""
        head = node
        while type(head) in _CHAIN:
            head = head.value
        if type(head) is not cst.Name or head.value not in self.heads:
            return []
        k = key_of(node)
        if k is not None:
            ref = self.lookup(node, k)
            if ref is not None:
                return [ref]
        if type(node) is cst.Subscript:
            base = dotted(node.value)
            if base is not None and _literal_index(node) is None:
                return self.lookup_dict(node, base)
        return []

    # --- one DataLoader -----------------------------------------------------------------
    def _loader(self, call: cst.Call, index: int) -> Loader:
        ctx = self.ctx
        statement = ctx.statement_of(call)
        scope = self.function_of(call)
        loader = Loader(call, statement, scope, None, index=index)
        target_node, keys = self._target(call)
        if target_node is not None:
            base = key_of(target_node)
            if keys is None:
                loader.target = code(target_node)
                self.add_ref(self.binding_scope(call, base), base, loader.target, [loader], statement)
            else:
                comp = ctx.parent(call)
                key_var = comp.key if isinstance(comp, cst.DictComp) else None
                loader.target = f"{code(target_node)}[{code(key_var) if key_var is not None else keys[0][1]}]"
                for key_text, literal in keys:
                    text = f"{code(target_node)}[{literal}]"
                    scope = self.binding_scope(call, base)
                    self.add_ref(scope, f"{base}[{key_text!r}]", text, [loader], statement)
                    self.refs[(id(scope), f"{base}[{key_text!r}]")].eval = splits.verdict(splits.words(key_text)) == "eval"
            loader.bound = tuple(r.key for r in loader.refs)
        args = bind_args(call)
        if args is not None:
            loader.dataset = args["dataset"].value if "dataset" in args else None
            loader.shuffle = args["shuffle"].value if "shuffle" in args else None
        loader.kind, loader.condition = self._classify(call, loader, keys)
        loader.status = self._status(call, loader, args)
        if loader.kind == "eval" and args is not None and "batch_size" in args:
            size = args["batch_size"].value
            # `num_neg + 1`: one positive and its negatives per batch (`2 * bs` is just a size)
            if isinstance(size, cst.BinaryOperation) and isinstance(size.operator, (cst.Add, cst.Subtract)) \
                    and not is_literal(loader.shuffle, "True"):
                loader.grouped = code(size)
        return loader

    def _target(self, call: cst.Call):
        """(target node, dict keys) where the loader is bound: `x = DataLoader()` gives (x, None);
        `d = {"train": DataLoader()}` gives (d, [("train", '"train"')]); comprehensions over a
        literal list give every key."""
        ctx = self.ctx
        node: cst.CSTNode = call
        parent = ctx.parent(node)
        keys = None
        if isinstance(parent, cst.DictElement) and parent.value is node and isinstance(parent.key, cst.SimpleString):
            try:
                key = parent.key.evaluated_value
            except Exception:  # noqa: BLE001
                return None, None
            keys = [(key, parent.key.value)]
            node = ctx.parent(parent)
            parent = ctx.parent(node)
        elif isinstance(parent, cst.DictComp) and parent.value is node:
            keys = self._comp_keys(parent)
            if keys is None:
                return None, None
            node, parent = parent, ctx.parent(parent)
        if isinstance(parent, cst.IfExp) and node is not parent.test:  # `x = DataLoader(...) if c else None`
            node, parent = parent, ctx.parent(parent)
        index = None
        if isinstance(parent, cst.Element) and isinstance(ctx.parent(parent), cst.Tuple):
            tup = ctx.parent(parent)
            index = list(tup.elements).index(parent)
            node, parent = tup, ctx.parent(tup)
        if isinstance(parent, cst.Assign) and parent.value is node and len(parent.targets) == 1:
            target = parent.targets[0].target
        elif isinstance(parent, cst.AnnAssign) and parent.value is node:
            target = parent.target
        else:
            return None, None
        if index is not None:
            if not isinstance(target, (cst.Tuple, cst.List)) or index >= len(target.elements):
                return None, None
            target = target.elements[index].value
        if key_of(target) is None or "[" in (key_of(target) or ""):
            return None, None
        return target, keys

    def _comp_keys(self, comp: cst.DictComp):
        """Keys of `{k: ... for k in ["train", "val"]}` as (value, source literal), else None."""
        f = comp.for_in
        if f.inner_for_in is not None or not isinstance(f.target, cst.Name) or not isinstance(comp.key, cst.Name):
            return None
        if comp.key.value != f.target.value or not isinstance(f.iter, (cst.List, cst.Tuple, cst.Set)):
            return None
        out = []
        for el in f.iter.elements:
            if not isinstance(el.value, cst.SimpleString):
                return None
            try:
                out.append((el.value.evaluated_value, el.value.value))
            except Exception:  # noqa: BLE001
                return None
        return out

    def _classify(self, call: cst.Call, loader: Loader, keys) -> Tuple[str, Optional[str]]:
        ctx = self.ctx
        if keys:
            verdicts = [(splits.verdict(splits.words(k)) or "train", lit) for k, lit in keys]
            train = [lit for v, lit in verdicts if v == "train"]
            if len(train) == len(verdicts):
                return "train", None
            if not train:
                return "eval", None
            comp = ctx.parent(call)
            var = comp.for_in.target.value if isinstance(comp, cst.DictComp) else None
            if var is None:
                return "train", None
            cond = f"{var} == {train[0]}" if len(train) == 1 else f"{var} in ({', '.join(train)})"
            if loader.shuffle is not None and _same_test(code(loader.shuffle.with_changes(lpar=[], rpar=[])), cond):
                loader.condition_is_shuffle = True  # `shuffle=(x == "train")`: the split test itself
            return "mixed", cond
        if self._read_through_here(call, loader):
            return "eval", None
        shuffle = loader.shuffle
        fn = self.function_of(call)
        if shuffle is not None and not is_literal(shuffle, "True", "False", "None") and self._flag_of_factory(fn, shuffle):
            # the callers' `shuffle=True` / `shuffle=False` say which loader each call builds,
            # whatever the words of its dataset say (`Dataset.build(data, load_train=load_train)`)
            loader.condition_is_shuffle = True
            return "mixed", _parenthesize(code(shuffle), shuffle)
        if shuffle is not None and not is_literal(shuffle, "True", "False", "None") and self._set_by_split(fn, shuffle):
            # `if flag == "test": shuffle_flag = False ... else: shuffle_flag = True`: the factory
            # builds every split, whatever the words of the dataset it picks (`Data = Dataset_Pred`)
            loader.condition_is_shuffle = True
            return "mixed", _parenthesize(code(shuffle), shuffle)
        sources: List[List[str]] = []
        if loader.target:
            sources.append(splits.words(loader.target.split(".")[-1]))
        if loader.dataset is not None:
            sources.append(self._dataset_words(loader))
        if isinstance(fn, cst.FunctionDef):
            sources.append(splits.words(fn.name.value))
        for words in sources:
            verdict = splits.verdict(words)
            if verdict:
                return verdict, None
        if shuffle is not None and not is_literal(shuffle, "True", "False", "None"):
            if splits.verdict(_expression_words(shuffle)) or self._set_by_split(fn, shuffle):
                loader.condition_is_shuffle = True
                return "mixed", _parenthesize(code(shuffle), shuffle)
        if shuffle is not None and is_literal(shuffle, "False") and not any(
                a.keyword is not None and a.keyword.value in ("sampler", "batch_sampler") or a.star for a in call.args):
            # `DataLoader(data_for_imputation, bs, shuffle=False)`: told not to shuffle (and given no
            # sampler that would) and named for no split, it is read in order for its outputs
            # (inference over every sample);
            # a loop of this module that trains on it makes it a training loader (`_trained_on`)
            return "eval", None
        return "train", None

    def _flag_of_factory(self, fn: cst.CSTNode, shuffle: cst.BaseExpression) -> bool:
        """`shuffle=shuffle`, a parameter of the function that builds the loader, which the
        program's calls pass both `True` and `False` (`make_loader(train_set, shuffle=True)`,
        `make_loader(dev_set, shuffle=False)`): one factory builds the training loader and the
        evaluation ones, and the flag says which a call builds."""
        if type(shuffle) is not cst.Name or not isinstance(fn, cst.FunctionDef) \
                or shuffle.value not in _param_names(fn):
            return False
        klass = self.class_of(fn)
        qual = f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value
        values = set(self.ctx.program.flag_args.get(qual, {}).get(shuffle.value, ()))
        for call in self.callers.get(id(fn), []):  # this module's calls (a file linted on its own)
            for callee, skip in self.callees(call):
                if callee is fn:
                    passed = dict(bind_params(fn, call, skip))
                    value = passed.get(shuffle.value, _default(fn, shuffle.value))
                    if is_literal(value, "True", "False"):
                        values.add(value.value == "True")
        return values == {True, False}

    def _set_by_split(self, fn: cst.CSTNode, shuffle: cst.BaseExpression) -> bool:
        """`shuffle=shuffle`, a local of the function that builds the loader, set to `True` under a
        test naming the training split and to `False` under one naming evaluation splits (`if flag
        in ("val", "test"): shuffle = False elif flag == "train": shuffle = True`, or in the `else:`
        of such a test): one factory builds every split, and the local says which a call builds."""
        if type(shuffle) is not cst.Name or not isinstance(fn, cst.FunctionDef):
            return False
        seen = set()
        for assign in self.ctx.within(fn, cst.Assign, skip_defs=True):
            if not any(type(t.target) is cst.Name and t.target.value == shuffle.value for t in assign.targets):
                continue
            if len(assign.targets) != 1 or not is_literal(assign.value, "True", "False"):
                return False
            branch = self.ctx.enclosing(assign, cst.If, cst.Else, cst.FunctionDef)
            if isinstance(branch, cst.Else) and isinstance(self.ctx.parent(branch), cst.If) \
                    and self.ctx.parent(branch).orelse is branch:
                # `if split in ["valid", "test"]: shuffle = False else: shuffle = True`
                opposite = {"train": "eval", "eval": "train"}
                verdict = opposite.get(splits.verdict(_expression_words(self.ctx.parent(branch).test)) or "")
            elif isinstance(branch, cst.If) and assign in self.ctx.within(branch.body, cst.Assign, skip_defs=True):
                verdict = splits.verdict(_expression_words(branch.test))
            else:
                return False
            value = assign.value.value == "True"
            if verdict != ("train" if value else "eval"):
                return False
            seen.add(value)
        return seen == {True, False}

    def _read_through_here(self, call: cst.Call, loader: Loader) -> bool:
        """The loader is built and read through in the same function, in a comprehension or under
        `torch.no_grad()`, and that function trains nothing (no backward there, nor in a function
        of the program it calls) and does not let it leave (not returned, not kept on an object):
        a pass over the data to compute something from all of it (a dataset's mean and std for
        `Normalize`, the scores of every window), whatever the dataset is called. Sharded, each
        rank would compute it from its part only."""
        ctx = self.ctx
        fn = self.function_of(call)
        if not isinstance(fn, cst.FunctionDef) or (loader.target and "." in loader.target) \
                or loader.shuffle is not None and not is_literal(loader.shuffle, "False", "None"):
            return False
        if loader.target:
            uses = [n for n in ctx.named(loader.target) if ctx.enclosing(n, cst.FunctionDef) is fn
                    and not isinstance(ctx.parent(n), cst.AssignTarget) and not _drawing_alike(ctx, n)]
            read = [n for n in uses if self._iterated(n)]
            if not read or len(read) != len(uses) or not all(self._without_gradients(n) for n in read):
                return False  # returned, passed on, stored (it leaves here), or read where it may train
        elif not (self._iterated(call) and self._without_gradients(call)):
            return False
        if analysis.runs_backward(ctx, fn):
            return False
        trains = {effects.TRAIN, effects.CALLS}
        return not any(trains & set(call_kinds(ctx, c) or ()) for c in ctx.within(fn, cst.Call, skip_defs=True))

    def _iterated(self, node: cst.CSTNode) -> bool:
        """`node` is what a loop or comprehension iterates (`for b in node`, `[f(b) for b in
        node]`), also through `enumerate(...)` or a progress bar (`loader_expr`)."""
        site = _iteration_site(node, self.ctx)
        return site is not None and loader_expr(self.ctx, site.iter) is node

    def _without_gradients(self, node: cst.CSTNode) -> bool:
        """`node` is read in a comprehension, or in a `with` that turns gradients off
        (`_no_grad`), in its function: nothing trained there."""
        for anc in self.ctx.ancestors(node):
            if isinstance(anc, (cst.ListComp, cst.SetComp, cst.GeneratorExp, cst.DictComp)):
                return True
            if isinstance(anc, cst.With) and any(self._no_grad(item.item) for item in anc.items):
                return True
            if isinstance(anc, (cst.FunctionDef, cst.Lambda)):
                return False
        return False

    def _dataset_words(self, loader: Loader) -> List[str]:
        """Words of the dataset expression and of up to three assignments to it, which both
        `_classify` and `_status` weigh: found once per loader (callers must not change it)."""
        words = self._words_of_dataset.get(loader.index)
        if words is None:
            words = _expression_words(loader.dataset)
            k = key_of(loader.dataset)
            if k is not None:
                for assign in self.assigns_at(loader.call, k)[:3]:
                    words += _expression_words(assign.value)
            self._words_of_dataset[loader.index] = words
        return words

    def _status(self, call: cst.Call, loader: Loader, args) -> str:
        """"plain", "distributed", "sharded", "custom", "iterable" or "unknown" (see `Loader`)."""
        if args is None:
            loader.unknown = "star-args"
            return "unknown"
        for name in ("sampler", "batch_sampler"):
            arg = args.get(name)
            if arg is not None and not is_literal(arg.value, "None") and not self.always_none(arg.value, call):
                if self._distributed_sampler(arg.value, loader):
                    return "distributed"
                if self._mentions_rank(arg.value, call):
                    return "sharded"
                loader.custom_arg, loader.custom_param = arg, name
                return "custom"
        if loader.dataset is None:
            loader.unknown = "no-dataset"
            return "unknown"
        if self._iterable(loader.dataset, call):
            return "iterable"
        words = self._dataset_words(loader)
        if any(_RANK_RE.match(w) for w in ["_".join(words[i:i + 2]) for i in range(len(words))] + words):
            return "sharded"
        for a in call.args:
            if a.star == "**":
                keys = self._dict_keys(a.value, call)
                if keys is None and is_literal(loader.shuffle, "True") and loader.dataset is not None:
                    # `DataLoader(ds, shuffle=True, **extra)`: the dict cannot hold `shuffle` (given
                    # twice), `dataset`, or a `sampler`/`batch_sampler` (DataLoader refuses them
                    # with shuffle=True), so the sampling is this call's own (its batch size may be in it)
                    loader.kwargs_arg = a.value
                    continue
                if keys is None or keys & {"sampler", "batch_sampler", "dataset"} or not keys <= KNOWN_KWARGS:
                    loader.unknown, loader.kwargs_arg = "kwargs", a.value
                    return "unknown"
                if "shuffle" in keys:
                    if loader.shuffle is not None or not isinstance(a.value, cst.Name) or loader.kwargs_shuffle:
                        loader.unknown = "kwargs-shuffle"
                        return "unknown"
                    loader.kwargs_shuffle = a.value.value
        return "plain"

    def _mentions_rank(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        """A sampler built with the rank or world size (a project's own distributed sampler)."""
        words = _expression_words(node)
        k = key_of(node)
        if k is not None:
            for assign in self.assigns_at(at, k)[:3]:
                words += _expression_words(assign.value)
        pairs = ["_".join(words[i:i + 2]) for i in range(len(words))]
        return any(_RANK_RE.match(w) for w in pairs + words)

    def may_be_none(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        """A sampler that can be None: `x if c else None`, a name assigned something other than a
        call (`sampler = DistributedSampler(ds) if distributed else None`), or a parameter of the
        enclosing function (`def make(ds, sampler=None)`)."""
        if isinstance(node, cst.IfExp):
            return True
        k = key_of(node)
        if k is None:
            return False
        assigns = self.assigns_at(at, k)
        if any(not isinstance(a.value, cst.Call) for a in assigns):
            return True
        scope = self.ctx.scope_of(at)
        if assigns or not isinstance(node, cst.Name) or not isinstance(scope, cst.FunctionDef):
            return False
        positional, keyword_only = analysis._function_params(scope)
        return node.value in positional or node.value in keyword_only

    def always_none(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        """A name whose every assignment in scope is `None` (`sampler = None`)."""
        k = key_of(node)
        assigns = self.assigns_at(at, k) if k is not None else []
        return bool(assigns) and all(is_literal(a.value, "None") for a in assigns)

    def _dict_keys(self, node: cst.CSTNode, call: cst.Call, depth: int = 0) -> Optional[Set[str]]:
        """String keys a `**name` dict may hold, from its literal assignments and `.update()`s."""
        if depth > 3:
            return None
        if isinstance(node, cst.Dict):
            keys: Set[str] = set()
            for el in node.elements:
                if isinstance(el, cst.StarredDictElement):
                    inner = self._dict_keys(el.value, call, depth + 1)
                    if inner is None:
                        return None
                    keys |= inner
                elif isinstance(el.key, cst.SimpleString):
                    keys.add(el.key.evaluated_value)
                else:
                    return None
            return keys
        if isinstance(node, cst.IfExp):
            a = self._dict_keys(node.body, call, depth + 1)
            b = self._dict_keys(node.orelse, call, depth + 1)
            return None if a is None or b is None else a | b
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "dict":
            if any(a.keyword is None for a in node.args):
                return None
            return {a.keyword.value for a in node.args}
        if isinstance(node, cst.Name):
            assigns = self.assigns_at(call, node.value)
            if not assigns:
                return None
            keys = set()
            for assign in assigns:
                inner = self._dict_keys(assign.value, call, depth + 1)
                if inner is None:
                    return None
                keys |= inner
            # item assignments and .update() calls on the same name in the same scope
            scope = self.function_of(assigns[0])
            for k in self.assigns_by_key:
                if k.startswith(node.value + "[") and any(self.function_of(a) is scope for a in self.assigns_by_key[k]):
                    keys.add(k[len(node.value) + 2:-2])
            for c, _name in self.facts.calls:
                if isinstance(c.func, cst.Attribute) and dotted(c.func.value) == node.value \
                        and self.function_of(c) is scope:
                    if c.func.attr.value == "update":
                        for a in c.args:
                            inner = self._dict_keys(a.value, call, depth + 1) if a.keyword is None else {a.keyword.value}
                            if inner is None:
                                return None
                            keys |= inner
                    elif c.func.attr.value in ("setdefault", "__setitem__"):
                        if c.args and isinstance(c.args[0].value, cst.SimpleString):
                            keys.add(c.args[0].value.evaluated_value)
                        else:
                            return None
            return keys
        return None

    def _distributed_sampler(self, node: cst.CSTNode, loader: Loader) -> bool:
        """A DistributedSampler / tm sampler, inline or bound to a name or attribute."""
        shuffles: List[bool] = []

        def calls_in(n: cst.CSTNode) -> bool:
            found = False
            for c in calls_within(self.ctx, n):
                name = self.ctx.resolve(c.func)
                if name in DIST_SAMPLERS:
                    shuffle = next((a.value for a in c.args if a.keyword and a.keyword.value == "shuffle"), None)
                    positional = [a for a in c.args if a.keyword is None and not a.star]
                    if shuffle is None and len(positional) >= 4:
                        shuffle = positional[3].value
                    shuffles.append(not is_literal(shuffle, "False"))
                    found = True
                elif name == TM_SHARD_SAMPLER:
                    shuffles.append(True)
                    found = loader.runtime_sampler = True
                elif name in (TM_SAMPLER, TM_EVAL_SAMPLER):
                    loader.runtime_sampler = True
                    shuffle = next((a.value for a in c.args if a.keyword and a.keyword.value == "shuffle"), None)
                    if shuffle is None and len(c.args) > 1 and c.args[1].keyword is None:
                        shuffle = c.args[1].value
                    shuffles.append(name == TM_SAMPLER and not is_literal(shuffle, "False", "None"))
                    found = True
            return found

        if calls_in(node):
            if self._behind_a_flag() and not self._always_distributed(node):
                return False  # `DistributedSampler(ds) if args.distributed else None`: see below
            loader.sampler_shuffles = any(shuffles)
            loader.inline_distributed = isinstance(node, cst.Call) and self.ctx.resolve(node.func) in DIST_SAMPLERS
            return True
        k = key_of(node)
        if k is None:
            return False
        assigns = self.assigns_at(loader.call, k)
        if not any(calls_in(a.value) for a in assigns):
            return False
        if self._behind_a_flag() and not all(self._always_distributed(a.value) for a in assigns):
            # a sampler that shards only behind the program's own flag (`if args.ngpu > 1`,
            # `if args.distributed`), off in the run the migration is for: the loader is treated
            # as one with a sampler of its own that may be None (`tm.shard_sampler`, which keeps
            # a DistributedSampler the flag did build, and shards the loader's order otherwise)
            return False
        loader.sampler_shuffles = any(shuffles)
        unconditional = all(isinstance(a.value, cst.Call) and self.ctx.resolve(a.value.func) in DIST_SAMPLERS
                            for a in assigns)
        if unconditional and isinstance(node, cst.Name):
            loader.sampler_name = (self.function_of(assigns[0]), node.value)
        return True

    def _behind_a_flag(self) -> bool:
        """In a migration of a file that is not distributed otherwise (no process group, no DDP,
        no DistributedSampler built unconditionally: `analysis.is_distributed`), a sampler built
        behind the program's flag shards nothing in the run being migrated."""
        return self.ctx.options.migrating and not self.distributed

    def _always_distributed(self, node: cst.CSTNode) -> bool:
        """Every value `node` can take is a DistributedSampler (not `DistributedSampler(ds) if
        flag else None`, nor a name also bound to another sampler), or it holds a sampler of the
        runtime (a migration's own choice between a training and an evaluation sampler)."""
        runtime = (TM_SAMPLER, TM_EVAL_SAMPLER, TM_SHARD_SAMPLER)
        if any(self.ctx.resolve(c.func) in runtime for c in calls_within(self.ctx, node)):
            return True
        node = unparen(node)
        if isinstance(node, cst.IfExp):
            return self._always_distributed(node.body) and self._always_distributed(node.orelse)
        return isinstance(node, cst.Call) and self.ctx.resolve(node.func) in DIST_SAMPLERS

    def _iterable(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        def iterable_call(n: cst.CSTNode) -> bool:
            for c in calls_within(self.ctx, n):
                name = self.ctx.resolve(c.func)
                if name and (name in ITERABLE_BASES or name.startswith(ITERABLE_FACTORIES)):
                    return True
                if name in ("datasets.load_dataset",) and any(
                        a.keyword and a.keyword.value == "streaming" and is_literal(a.value, "True") for a in c.args):
                    return True
                if isinstance(c.func, cst.Name) and self._iterable_class(c.func.value, 0):
                    return True
            return False

        if iterable_call(node):
            return True
        k = key_of(node)
        return k is not None and any(iterable_call(a.value) for a in self.assigns_at(at, k)[:5])

    def _iterable_class(self, name: str, depth: int) -> bool:
        cls = self.facts.classes.get(name)
        if cls is None or depth > 5:
            return False
        for base in cls.bases:
            resolved = self.ctx.resolve(base.value)
            if resolved in ITERABLE_BASES:
                return True
            if isinstance(base.value, cst.Name) and self._iterable_class(base.value.value, depth + 1):
                return True
        return False

    # --- where loaders are used ----------------------------------------------------------
    def uses(self, want) -> Iterable[Tuple[cst.CSTNode, Ref]]:
        """(expression, ref) for every expression in the module that names a loader for which
        `want(loader)` holds: `train_loader`, `self.val_loader`, `loaders[phase]`. Attribute
        reads (`loader.dataset`) and parameter or definition names are not uses."""
        for node, found in self._use_sites():
            for ref in found:
                if any(want(x) for x in ref.loaders):
                    yield node, ref

    def _use_sites(self) -> List[Tuple[cst.CSTNode, List[Ref]]]:
        """Every expression naming a known loader, with its refs (found once, after the refs
        are complete; recomputed if a ref is added later)."""
        version = (len(self.refs), len(self.dict_refs), len(self.heads))
        if self._sites is not None and self._sites[0] == version:
            return self._sites[1]
        ctx = self.ctx
        sites = []
        for name in self.scan.named(self.heads) if self.scan is not None else ():
            parent = ctx.parent(name)
            parent_type = type(parent)
            if parent_type is cst.Attribute and parent.attr is name:
                continue
            if parent_type in _DEFINITIONS:
                continue
            if parent_type is cst.Arg and parent.keyword is name:
                continue
            node, found = self._ref_around(name)
            up = ctx.parent(node)
            if not found or type(up) in _CHAIN and up.value is node:
                continue  # `loader.dataset`, `loader.sampler`: not an iteration
            sites.append((node, found))
        self._sites = (version, sites)
        return sites

    def _order_bound(self) -> None:
        """Set `Loader.ordered` where a function iterates a loader without gradients and also
        reads per-sample data of its dataset in dataset order (`loader.dataset.targets`, a
        kNN monitor's feature bank labels): sharded, the batches would no longer line up with
        those labels (a shape error, or metrics computed on mismatched pairs)."""
        ctx = self.ctx
        reads: Dict[int, List[Tuple[cst.CSTNode, str]]] = {}  # id(loader) -> (function, text)
        for name in self.scan.named(self.heads):
            node, found = self._ref_around(name)
            dataset = ctx.parent(node)
            if not found or type(dataset) is not cst.Attribute or dataset.attr.value != "dataset":
                continue
            field_ = ctx.parent(dataset)
            if type(field_) is cst.Attribute and field_.value is dataset and field_.attr.value in ORDERED_FIELDS:
                for ref in found:
                    for loader in ref.loaders:
                        reads.setdefault(id(loader), []).append((self.function_of(name), code(field_)))
        for loader in self.loaders:
            if id(loader) not in reads or self.iterated_with_grad(loader):
                continue
            loops = {self.function_of(site) for node, _ in self.uses(lambda x: x is loader)
                     if (site := _iteration_site(node, ctx)) is not None}
            loader.ordered = next((text for fn, text in reads[id(loader)] if fn in loops), None)

    def _sized_by_batch(self) -> None:
        """Set `Loader.sized_by` where a loop over the loader reads the loader's own batch size
        expression (a name or attribute, not a literal) as a value: the code assumes full
        batches, which the original run may always have had (a dataset size divisible by the
        batch size) but a rank's share of it need not."""
        ctx = self.ctx
        for loader in self.loaders:
            args = bind_args(loader.call) or {}
            size = args.get("batch_size")
            text = code(size.value) if size is not None and isinstance(size.value, (cst.Name, cst.Attribute)) else None
            if text is None:
                continue
            bodies = []
            for node, _ref in self.uses(lambda x: x is loader):
                site = _iteration_site(node, ctx)
                body = getattr(site, "body", None) if isinstance(site, cst.For) else None
                if body is not None:
                    bodies.append(body)
            # a training loop that draws its batches some other way (`real = next(looper)` from
            # `infiniteloop(loader)`, `for step in range(total_steps)`): the noise and labels it
            # sizes by the same expression are this rank's batch too
            bodies += [loop.body for loop in analysis.training_loops(ctx) if loop.body not in bodies]
            # anywhere in the function that builds the loader (a handler defined there, a check
            # after the loop): the batch size compared with the rows of a batch read from it
            # (`assert first.shape[0] == n_init * batch_size`) is this rank's batch too
            home = ctx.enclosing(loader.call, cst.FunctionDef) or ctx.module
            compared = [n for n in ctx.within(home, type(size.value)) if code(n) == text and compared_with_rows(ctx, n)]
            if compared:
                bodies.append(home)
            for body in bodies:
                uses = [n for n in ctx.within(body, type(size.value)) if code(n) == text and not _name_part(ctx, n)
                        and not _logged(ctx, n) and (body is not home or n in compared)
                        and not any(a is loader.call for a in ctx.ancestors(n))]  # (the loader's own argument,
                # where a loop builds it afresh each epoch: `batch_iterator = iter(DataLoader(ds, batch_size))`)
                if uses:
                    loader.batch_read = text
                    known = {id(u) for u in loader.batch_uses}
                    loader.batch_uses.extend(u for u in uses if id(u) not in known)
                    if "drop_last" not in args:
                        loader.sized_by = text

    def _ref_around(self, name: cst.Name) -> Tuple[cst.CSTNode, List[Ref]]:
        """The expression starting at `name` that denotes loaders (`name`, `self.loaders[k]`,
        climbing attribute and subscript chains), and their refs (none: the top of the chain, [])."""
        node: cst.CSTNode = name
        while True:
            found = self.refs_at(node)
            up = self.ctx.parent(node)
            if found or not (type(up) in _CHAIN and up.value is node):
                return node, found
            node = up

    def consumers(self, loader: Loader) -> Tuple[List[cst.For], List[Tuple[cst.CSTNode, str]]]:
        """The `for` loops of this module that iterate the loader (directly, or through
        `enumerate`/`iter`/a progress bar), and the uses through which it leaves this module's
        sight, each with what happens there: handed to a function of another module or a
        library, returned from a function that another module calls (or that nothing here
        calls), iterated by a comprehension or together with something else, counted with
        `len()`, or bound at module level in a module that others import. Names the loader is
        bound to in this module (aliases, parameters of its functions, `self.` attributes,
        what its functions return to callers here) are followed."""
        ctx = self.ctx
        loops: List[cst.For] = []
        escapes: List[Tuple[cst.CSTNode, str]] = []
        if loader.target and loader.scope is ctx.module and not ctx.program.is_entry:
            escapes.append((loader.call, f"`{loader.target}` is bound at module level, where other modules may import it"))
        sites = [(loader.call, None)] if loader.target is None else []
        sites += list(self.uses(lambda x: x is loader))
        for node, _ref in sites:
            if _bound_here(ctx, node):
                continue  # `val_loader = ...`: where a name is bound, not a use of it
            site = _iteration_site(node, ctx)
            if isinstance(site, cst.For) and loader_expr(ctx, site.iter) is node:
                if site not in loops:
                    loops.append(site)
            elif isinstance(site, cst.For):
                escapes.append((node, f"`{code(site.iter)}` iterates it together with other data"))
            elif site is not None:
                escapes.append((node, f"a comprehension iterates it (`{code(ctx.parent(site))[:50]}`)"))
            else:
                why = self._escape(node)
                if why:
                    escapes.append((node, why))
        return loops, escapes

    def _returned(self, node: cst.CSTNode) -> bool:
        parent = self.ctx.parent(node)
        if type(parent) is cst.Element:
            parent = self.ctx.parent(self.ctx.parent(parent))
        return type(parent) is cst.Return

    def _escape(self, node: cst.CSTNode) -> str:
        """Why the loader leaves this module's sight at `node` (a use that is not an iteration),
        or "" when its further uses are followed here."""
        ctx = self.ctx
        parent = ctx.parent(node)
        if type(parent) is cst.Arg:
            call = ctx.parent(parent)
            if type(call) is cst.Call and dotted(call.func) == "len":
                return f"`{code(call)}` counts its batches, which sharding changes"
            if _drawing_alike(ctx, node):
                return ""
            if type(call) is cst.Call and any(param for callee, skip in self.callees(call)
                                              for param, value in bind_params(callee, call, skip) if value is node):
                return ""  # a parameter of a function of this module: its uses are followed
            return f"`{code(call.func) if type(call) is cst.Call else code(parent)}(...)` is handed it"
        if type(parent) is cst.Assign and parent.value is node and len(parent.targets) == 1:
            k = key_of(parent.targets[0].target)
            if k is not None and "[" not in k and self.lookup(parent, k) is not None:
                return ""  # an alias, followed
            return f"`{code(parent.targets[0].target)}` holds it"
        if self._returned(node):
            fn = ctx.enclosing(node, cst.FunctionDef)
            if fn is None:
                return "it is returned"
            klass = self.class_of(fn)
            qual = f"{klass.name.value}.{fn.name.value}" if klass is not None else fn.name.value
            if qual in ctx.program.called_elsewhere:
                return "it is returned to another module"
            callers = self.callers.get(id(fn), [])
            if not callers:
                return "it is returned, and no code of this module calls the function"
            for c in callers:
                if type(ctx.parent(c)) is not cst.Assign:
                    return f"it is returned and handed on (`{code(c)[:50]}`)"
            return ""
        return f"`{code(ctx.statement_of(node) or node)[:60]}` uses it"

    def iterated_with_grad(self, loader: Loader) -> bool:
        """A `for` (or comprehension) over the loader runs outside no_grad/inference_mode."""
        for node, _ref in self.uses(lambda x: x is loader):
            site = _iteration_site(node, self.ctx)
            if site is not None and not self.grad_free(site, 0) and not (
                    isinstance(site, cst.For) and self.forwards_grad_free(site)):
                return True
        return False

    def grad_free(self, node: cst.CSTNode, depth: int) -> bool:
        """`node` runs under `torch.no_grad()`/`inference_mode()` (a `with`, a decorator, or every
        same-file call of its function)."""
        ctx = self.ctx
        if depth > 4:
            return False
        for anc in ctx.ancestors(node):
            if isinstance(anc, cst.With) and any(self._no_grad(item.item) for item in anc.items):
                return True
            if isinstance(anc, cst.FunctionDef):
                if any(self._no_grad(d.decorator) for d in anc.decorators):
                    return True
                sites = self.callers.get(id(anc), [])
                return bool(sites) and all(self.grad_free(c, depth + 1) for c in sites)
            if isinstance(anc, (cst.Lambda, cst.ClassDef)):
                return False
        return False

    def forwards_grad_free(self, loop: cst.For) -> bool:
        """The models `loop` runs (the module's trained models, and what it calls directly in a
        `with torch.no_grad():` inside its body: `for x, y in val_loader: with torch.no_grad():
        preds = model(x)`) appear only in such blocks, and there is at least one: no DDP forward
        of the loop runs with gradients. A helper handed no model is no forward."""
        ctx = self.ctx
        inside = [c for c in ctx.within(loop.body, cst.Call, skip_defs=True) if self._in_no_grad(c, loop)]
        if not inside:
            return False
        models = set(analysis.trained_models(ctx)) | {
            dotted(c.func) for c in inside
            if isinstance(c.func, (cst.Name, cst.Attribute)) and _direct(c.func) and ctx.resolve(c.func) is None
            and not (isinstance(c.func, cst.Name) and c.func.value in _BUILTINS)}
        models.discard(None)
        uses = [n for n in ctx.within(loop.body, cst.Name, cst.Attribute, skip_defs=True)
                if dotted(n) in models and not isinstance(ctx.parent(n), cst.Attribute)]
        return bool(uses) and all(self._in_no_grad(u, loop) for u in uses)

    def _in_no_grad(self, node: cst.CSTNode, loop: cst.For) -> bool:
        return any(isinstance(a, cst.With) and any(self._no_grad(item.item) for item in a.items)
                   for a in self.ctx.ancestors_until(node, loop))

    def _no_grad(self, node: cst.CSTNode) -> bool:
        func = node.func if isinstance(node, cst.Call) else node
        name = self.ctx.resolve(func)
        if name in NO_GRAD:
            return True
        if name == "torch.set_grad_enabled" and isinstance(node, cst.Call) and node.args:
            return is_literal(node.args[0].value, "False")
        return False

    # --- following loaders through helpers ------------------------------------------------
    def _follow(self) -> None:
        """Refs for names bound from helper returns, parameters and plain aliases, to a fixpoint."""
        for _ in range(8):
            changed = False
            returns = self.returns()
            for assign in self.facts.assigns:
                changed |= self._assign_ref(assign, returns)
            for call, _name in self.facts.calls:
                if id(call) in self.callee_map:
                    changed |= self._param_refs(call)
            if not changed:
                break

    def returns(self) -> Dict[str, Dict[Optional[int], List[Loader]]]:
        """Which functions of the module return loaders: function name -> {tuple index or None:
        the loaders it returns there} (from the refs known so far: computed on each call)."""
        out: Dict[str, Dict[Optional[int], List[Loader]]] = {}
        for ret in self.scan.returns:
            fn = self.ctx.enclosing(ret, cst.FunctionDef)
            if fn is None or ret.value is None:
                continue
            values = ([(None, ret.value)] if not isinstance(ret.value, cst.Tuple)
                      else [(i, el.value) for i, el in enumerate(ret.value.elements)])
            for index, value in values:
                found = self._loaders_of(value)
                if found:
                    slot = out.setdefault(fn.name.value, {}).setdefault(index, [])
                    slot.extend(x for x in found if x not in slot)
        return out

    def _loaders_of(self, node: cst.CSTNode) -> List[Loader]:
        if id(node) in self.by_call:
            return [self.by_call[id(node)]]
        refs = self.refs_at(node) if type(node) in _REFERENCES else []
        return [x for r in refs for x in r.loaders]

    def _assign_ref(self, assign: cst.Assign, returns) -> bool:
        if len(assign.targets) != 1:
            return False
        target = assign.targets[0].target
        value = assign.value
        pairs: List[Tuple[cst.CSTNode, List[Loader]]] = []
        branches: Set[str] = {"unknown"}
        if type(value) is cst.Call and id(value) not in self.by_call:
            unsharded = self.ctx.resolve(value.func) == TM_UNSHARDED and value.args \
                and type(value.args[0].value) in (cst.Name, cst.Attribute)
            name = dotted(value.args[0].value).rsplit(".", 1)[-1] if unsharded else _func_name(value)
            result = returns.get(name) if name else None
            if result:
                if isinstance(target, (cst.Tuple, cst.List)):
                    for i, el in enumerate(target.elements):
                        if i in result:
                            pairs.append((el.value, result[i]))
                elif None in result:
                    pairs.append((target, result[None]))
                    branches = self._branch_built(value, result[None])
                    if unsharded or (branches == {"unknown"} and asks_for_evaluation(value, target)):
                        branches = {"eval"}  # a whole evaluation loader from the training loaders' factory
                        if not unsharded and all(x.scope is not self.ctx.enclosing(value, cst.FunctionDef)
                                                 for x in result[None]) \
                                and not any(c is value for c, _ in self._eval_sites):
                            self._eval_sites.append((value, result[None]))
        elif type(value) in _REFERENCES:
            found = self._loaders_of(value)
            if found:
                pairs.append((target, found))
                branches = self._branches_of(value)
        changed = False
        for node, found in pairs:
            k = key_of(node)
            if k is None or "[" in k:
                continue
            statement = self.ctx.statement_of(assign)
            changed |= self.add_ref(self.binding_scope(assign, k), k, code(node), found, statement, branches)
        return changed

    def _branch_built(self, call: cst.Call, found: List[Loader]) -> Set[str]:
        """{"train"} or {"eval"} for a call of a factory whose one loader is a mixed loader by
        its `shuffle=` parameter, passed a literal (`make_loader(test_ds, False)`), else {"unknown"}."""
        param = branch_flag(found[0]) if len(found) == 1 else None
        if param is None:
            return {"unknown"}
        for callee, skip in self.callees(call):
            if callee is not found[0].scope:
                continue
            value = dict(bind_params(callee, call, skip)).get(param, _default(callee, param))
            if is_literal(value, "True", "False"):
                return {"train" if value.value == "True" else "eval"}
        return {"unknown"}

    def _branches_of(self, node: cst.CSTNode) -> Set[str]:
        refs = self.refs_at(node) if type(node) in _REFERENCES else []
        return set().union(*(r.branches for r in refs)) if refs else {"unknown"}

    def _param_refs(self, call: cst.Call) -> bool:
        changed = False
        for callee, skip_first in self.callees(call):
            for param, value in bind_params(callee, call, skip_first):
                found = self._loaders_of(value) if type(value) in _REFERENCES else []
                if found:
                    changed |= self.add_ref(callee, param, param, found, None, self._branches_of(value))
        return changed

    def callees(self, call: cst.Call) -> List[Tuple[cst.FunctionDef, bool]]:
        return self.callee_map.get(id(call), [])

    def contains_set_epoch(self, node: cst.CSTNode) -> bool:
        return any(any(anc is node for anc in self.ctx.ancestors(c)) for c in self.set_epoch_calls)

    def _find_callees(self, call: cst.Call) -> List[Tuple[cst.FunctionDef, bool]]:
        """Same-file functions a call may run: `f(...)`, `obj.f(...)` (methods), `Cls(...)` (__init__)."""
        out: List[Tuple[cst.FunctionDef, bool]] = []
        func_type = type(call.func)
        if func_type is cst.Name:
            name = call.func.value
            for fn in self.functions_by_name.get(name, ()):
                if self.class_of(fn) is None:
                    out.append((fn, False))
            cls = self.facts.classes.get(name)
            if cls is not None:
                for fn in self.functions_by_name.get("__init__", ()):
                    if self.class_of(fn) is cls:
                        out.append((fn, True))
        elif func_type is cst.Attribute:
            for fn in self.functions_by_name.get(call.func.attr.value, ()):
                if self.class_of(fn) is not None:
                    out.append((fn, True))
        return out


def _mode_test(test: cst.BaseExpression, params: Set[str]) -> bool:
    """`mode == "train"`, `split in ("train", "trainval")`, `is_train`, `self.mode == "train"`
    read from a parameter: which pass a shared train/validation loop is in."""
    test = unparen(test)
    if isinstance(test, cst.Name):
        return test.value in params and "train" in test.value.lower()
    if not isinstance(test, cst.Comparison) or len(test.comparisons) != 1:
        return False
    sides = [unparen(test.left), unparen(test.comparisons[0].comparator)]
    named = any(isinstance(x, cst.Name) and x.value in params for x in sides)
    literal = any(isinstance(x, cst.SimpleString) or isinstance(x, (cst.Tuple, cst.List)) and x.elements
                  and all(isinstance(e.value, cst.SimpleString) for e in x.elements) for x in sides)
    return named and literal


def _name_part(ctx, node: cst.CSTNode) -> bool:
    """`batch_size` in `self.batch_size` or in `f(batch_size=...)`: part of a name, not a read."""
    parent = ctx.parent(node)
    return (type(parent) is cst.Attribute and parent.attr is node) or (type(parent) is cst.Arg and parent.keyword is node)


def _bound_here(ctx, node: cst.CSTNode) -> bool:
    """`node` is (part of) an assignment, `for` or `with` target."""
    parent = ctx.parent(node)
    while type(parent) in (cst.Element, cst.Tuple, cst.List, cst.StarredElement):
        node, parent = parent, ctx.parent(parent)
    if type(parent) is cst.AssignTarget:
        return True
    if type(parent) in (cst.AnnAssign, cst.AugAssign, cst.For, cst.CompFor) and parent.target is node:
        return True
    return type(parent) is cst.AsName


_LOGGING = re.compile(r"(^|\.)(print|info|debug|warning|log|write|add_scalars?|set_postfix|set_description|format)$")


def _logged(ctx, node: cst.CSTNode) -> bool:
    """`node` is only shown: in an f-string or the arguments of a print or logging call."""
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.FormattedStringExpression):
            return True
        if isinstance(anc, cst.Call) and _LOGGING.search(code(anc.func)):
            return True
        if isinstance(anc, cst.BaseStatement):
            return False
    return False


_BUILTINS = frozenset(dir(builtins))


def _direct(func: cst.BaseExpression) -> bool:
    """`model` or `self.model`: a callee that may be a module of the program (not a method)."""
    return isinstance(func, cst.Name) or (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                                          and func.value.value == "self")


def compared_with_rows(ctx, node: cst.CSTNode) -> bool:
    """`node` (a batch size) sits in one side of a comparison whose other side counts a batch's
    rows (`x.shape[0]`, `x.size(0)`, `len(x)`): `assert first.shape[0] == n * batch_size`."""
    side: cst.CSTNode = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, cst.Comparison):
            others = [anc.left] + [t.comparator for t in anc.comparisons]
            return any(other is not side and _counts_rows(other) for other in others)
        if isinstance(anc, cst.ComparisonTarget):
            continue  # `!= batch_size`: `side` is its comparator
        if not isinstance(anc, (cst.BinaryOperation, cst.UnaryOperation)):
            return False
        side = anc
    return False


def _counts_rows(node: cst.CSTNode) -> bool:
    """`x.shape[0]`, `x.size(0)`, `x.size()[0]`, `len(x)`."""
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) \
            and code(node.slice[0].slice.value) == "0":
        inner = node.value
        return (isinstance(inner, cst.Attribute) and inner.attr.value == "shape") or (
            isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute) and inner.func.attr.value == "size"
            and not inner.args)
    if isinstance(node, cst.Call):
        func = node.func
        if isinstance(func, cst.Attribute) and func.attr.value == "size" and len(node.args) == 1:
            return code(node.args[0].value) == "0"
        return isinstance(func, cst.Name) and func.value == "len" and len(node.args) == 1
    return False


def _iteration_site(node: cst.CSTNode, ctx) -> Optional[cst.CSTNode]:
    """The `for` or comprehension whose iterable holds `node` (`for b in tqdm(loader)`)."""
    child = node
    for anc in ctx.ancestors(node):
        if isinstance(anc, (cst.For, cst.CompFor)) and child is anc.iter:
            return anc
        if isinstance(anc, (cst.BaseStatement, cst.IndentedBlock, cst.Lambda)):
            return None
        child = anc
    return None


def loader_expr(ctx, node: cst.BaseExpression) -> cst.BaseExpression:
    """`enumerate(tqdm(loader))` -> `loader`: what a loop's iterable iterates."""
    while isinstance(node, cst.Call) and node.args and node.args[0].keyword is None:
        func = node.func
        if (isinstance(func, cst.Name) and func.value in ("enumerate", "iter")) or ctx.resolve(func) in TQDM_CALLS:
            node = node.args[0].value
        else:
            break
    return node


def calls_within(ctx, node: cst.CSTNode) -> List[cst.Call]:
    """Calls in an expression, in source order (not descending into lambdas), from the node index."""
    if type(node) is cst.Lambda:
        return []
    return ctx.within(node, cst.Call, skip_defs=True)  # an expression holds no def or class


def _param_names(fn: cst.FunctionDef) -> Set[str]:
    p = fn.params
    names = {x.name.value for x in (*p.posonly_params, *p.params, *p.kwonly_params)}
    for star in (p.star_arg, p.star_kwarg):
        if isinstance(star, cst.Param):
            names.add(star.name.value)
    return names


def conditional_sampler(loader: Loader) -> Optional[cst.IfExp]:
    """`sampler=tm.sampler(ds, shuffle=True) if train else None`: a mixed loader as the
    migration leaves it (its evaluation half without a sampler)."""
    for a in loader.call.args:
        if a.keyword is not None and a.keyword.value == "sampler" and type(a.value) is cst.IfExp \
                and is_literal(a.value.orelse, "None"):
            return a.value
    return None


def branch_flag(loader: Loader) -> Optional[str]:
    """The parameter of the function that builds `loader` which says whether a call builds its
    training half (`shuffle=train`, or `sampler=... if train else None` once migrated)."""
    if loader.kind == "mixed" and loader.condition_is_shuffle and type(loader.shuffle) is cst.Name:
        name = loader.shuffle.value
    else:
        test = conditional_sampler(loader)
        name = test.test.value if test is not None and type(test.test) is cst.Name else None
    fn = loader.scope
    return name if name is not None and isinstance(fn, cst.FunctionDef) and name in _param_names(fn) else None


def _default(fn: cst.FunctionDef, name: str) -> Optional[cst.BaseExpression]:
    """The default value of parameter `name` of `fn`, if it has one."""
    for p in (*fn.params.posonly_params, *fn.params.params, *fn.params.kwonly_params):
        if p.name.value == name:
            return p.default
    return None


def bind_params(fn: cst.FunctionDef, call: cst.Call, skip_first: bool) -> List[Tuple[str, cst.BaseExpression]]:
    params = [*fn.params.posonly_params, *fn.params.params]
    if skip_first and params and params[0].name.value in ("self", "cls"):
        params = params[1:]
    names = {p.name.value for p in (*params, *fn.params.kwonly_params)}
    out = []
    position = 0
    for a in call.args:
        if a.star:
            if a.star == "*":
                break
            continue
        if a.keyword is None:
            if position < len(params):
                out.append((params[position].name.value, a.value))
            position += 1
        elif a.keyword.value in names:
            out.append((a.keyword.value, a.value))
    return out


def loader_facts(ctx) -> LoaderFacts:
    """The module's loader facts, built on first use and kept on the context."""
    found = ctx.facts.get("loaders")
    if found is None:
        found = ctx.facts["loaders"] = LoaderFacts(ctx)
    return found  # type: ignore[return-value]


def loaders(ctx) -> List[Loader]:
    """Every DataLoader of the module, in source order."""
    return loader_facts(ctx).loaders


def refs_at(ctx, node: cst.CSTNode) -> List[Ref]:
    """Loader refs that the expression `node` denotes (empty when it is not a known loader)."""
    facts = loader_facts(ctx)
    return facts.refs_at(node) if facts.scan is not None else []

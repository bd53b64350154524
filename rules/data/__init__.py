"""TM201-TM204: data loading under DDP (samplers, epochs, evaluation, shuffle conflicts).

Every rule of this family works from one shared analysis, `loaders(ctx)`, computed on first
use and cached in ``ctx.facts["loaders"]`` so that other families (TM701 metrics, ...) can ask
which loaders exist, which are evaluation loaders and how they are sharded without redoing it.

Published shape (``ctx.facts["loaders"]``, a list in source order) of `Loader`:

- ``call``: the ``DataLoader(...)`` `cst.Call` of the original tree;
- ``statement``: the statement holding it; ``scope``: the FunctionDef (or Module) holding it;
- ``target``: what it is bound to where it is built, as source text (``train_loader``,
  ``self.val_loader``, ``loaders["train"]``) or None (``return DataLoader(...)``, an argument);
- ``kind``: ``"train"``, ``"eval"`` or ``"mixed"`` (one call builds both, e.g.
  ``shuffle=is_train`` or a dict comprehension over ``["train", "val"]``); ``eval`` is
  True/False/None (mixed);
- ``status``: ``"plain"`` (no sampler: TM201/TM203 add one), ``"distributed"`` (already has a
  DistributedSampler or a ``tm.sampler``/``tm.eval_sampler``), ``"custom"`` (its own sampler or
  batch_sampler), ``"iterable"`` (an IterableDataset), ``"unknown"`` (``*args``/``**kwargs`` the
  tool cannot see), ``"sharded"`` (the dataset already takes the rank), ``"unhoistable"``;
- ``sampler``: the sampler the loader has once this run's fixes are in: ``"distributed"``
  (padded DistributedSampler semantics: ``tm.sampler`` or ``DistributedSampler``), ``"eval"``
  (``tm.eval_sampler``: every sample exactly once across ranks), ``"mixed"``, ``"custom"`` or
  None (every rank iterates the whole dataset). An evaluation loader iterated with gradients
  enabled gets the padded ``tm.sampler(ds, shuffle=False)`` (``eval_with_grad``): a DDP
  forward then broadcasts buffers, so ranks must run equal batch counts or they hang;
- ``needs_epoch``: its sampler reshuffles, so epoch loops over it need ``set_epoch`` (TM202);
- ``dataset`` / ``shuffle``: the original argument expressions (None when absent);
- ``refs``: every `Ref` (scope node, source text) under which the loader is visible in this
  file: its target, names bound from helper returns (``train_loader, val_loader =
  get_loaders()``), parameters it is passed to (``def evaluate(model, loader)``), ``self.``
  attributes. `refs_at(ctx, node)` answers "which loaders does this expression denote".

Name resolution uses the import table (`ctx.resolve`); helpers are followed by name within the
file (functions, methods, class constructors), never across modules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.codegen import FastState
from torchmigrate.finding import Edit, Safety, insert_after, insert_before, replace
from torchmigrate.imports import dotted
from torchmigrate.nodes import code, expr, kwarg, shift_continuations, stmt
from torchmigrate.rule import Example, Rule
from torchmigrate.walk import child_nodes

DATALOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
DIST_SAMPLERS = ("torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler")
RUNTIME = "torchmigrate.runtime"
TM_SAMPLER = RUNTIME + ".sampler"
TM_EVAL_SAMPLER = RUNTIME + ".eval_sampler"
TM_SHARD_SAMPLER = RUNTIME + ".shard_sampler"
TM_SET_EPOCH = RUNTIME + ".set_epoch"
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

_EVAL_WORDS = r"val|valid|validation|validate|test|tests|testing|eval|evaluate|evaluation|dev|holdout|heldout"
_TRAIN_WORDS = r"train|training|trainval|trn"
_SUFFIX = r"(?:loader|loaders|set|sets|ds|data|dataset|datasets|dl|iter|gen|batches|split)?"
_EVAL_RE = re.compile(rf"^(?:{_EVAL_WORDS}){_SUFFIX}$")
_TRAIN_RE = re.compile(rf"^(?:{_TRAIN_WORDS}){_SUFFIX}$")
_RANK_RE = re.compile(r"^(?:rank|local_rank|global_rank|world_size|num_replicas|num_shards|shard_id|shard_index)$")
_TRAIN_FLAGS = ("train", "is_train", "training", "is_training")
NO_GRAD = ("torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad",
           "torch.autograd.grad_mode.inference_mode", "torch.autograd.inference_mode")
_NON_CONSUMING = frozenset({"len", "print", "isinstance", "hasattr", "getattr", "type", "id", "str", "repr"})
_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)
_EMPTY = cst.Module(body=[])  # code generation settings of `code()`
# Exact-type tests for the hot paths: `isinstance` against a LibCST class goes through
# ABCMeta.__instancecheck__ whenever the type differs; these classes have no subclasses.
_REFERENCES = frozenset({cst.Name, cst.Attribute, cst.Subscript})  # what `key_of` may name
_CHAIN = frozenset({cst.Attribute, cst.Subscript})  # `a.b`, `a[k]`: an expression on `.value`
_DEFINITIONS = frozenset({cst.Param, cst.FunctionDef, cst.ClassDef, cst.ImportAlias, cst.AsName})
_SCOPES = frozenset({cst.FunctionDef, cst.Lambda, cst.ClassDef})
_EQ = cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(""))


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


@dataclass(eq=False)
class Loader:
    call: cst.Call
    statement: Optional[cst.CSTNode]
    scope: cst.CSTNode
    target: Optional[str]
    kind: str = "train"
    status: str = "plain"
    sampler: Optional[str] = None
    reason: str = ""
    dataset: Optional[cst.BaseExpression] = None
    shuffle: Optional[cst.BaseExpression] = None
    kwargs_shuffle: Optional[str] = None  # the `**name` dict that may hold `shuffle`
    condition: Optional[str] = None  # mixed loaders: the expression that is true for training
    condition_is_shuffle: bool = False  # ... and it is the `shuffle=` argument itself
    sampler_shuffles: bool = False  # an existing distributed sampler shuffles
    hoist: Optional[Tuple[str, str]] = None  # ("line"|"walrus", new variable name)
    needs_epoch: bool = False  # its sampler reshuffles per epoch, so epoch loops need set_epoch
    eval_with_grad: bool = False  # an evaluation loop over it runs with gradients enabled
    sampler_name: Optional[Tuple[cst.CSTNode, str]] = None  # (scope, name) of an unconditional DistributedSampler
    inline_distributed: bool = False  # `sampler=DistributedSampler(...)` written in the call
    refs: List[Ref] = field(default_factory=list)
    index: int = 0
    custom_arg: Optional[cst.Arg] = None  # its own `sampler=`/`batch_sampler=` (status "custom")
    runtime_sampler: bool = False  # already has `tm.sampler`/`tm.shard_sampler` (reshuffles by itself)
    grouped: Optional[str] = None  # an evaluation batch size that is a computed group size (kept unsharded)

    @property
    def eval(self) -> Optional[bool]:
        return {"train": False, "eval": True}.get(self.kind)


# --- small helpers ---------------------------------------------------------------------------

def _words(text: str) -> List[str]:
    """Lower-case words of an identifier or string: `trainLoader_2` -> ['train', 'loader']."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text)
    return [w for w in re.split(r"[^a-z]+", text.lower()) if w]


def _verdict(words: Iterable[str]) -> Optional[str]:
    words = list(words)
    if any(_TRAIN_RE.match(w) for w in words):
        return "train"
    if any(_EVAL_RE.match(w) for w in words):
        return "eval"
    return None


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
            out.extend(_words(n.value))
        elif tp is cst.SimpleString:
            try:
                value = n.evaluated_value
            except Exception:  # noqa: BLE001 - odd literals carry no signal
                continue
            if not isinstance(value, bytes):
                out.extend(_words(value))
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


def _pure(node: cst.CSTNode) -> bool:
    """Cheap to evaluate twice and free of side effects: names, attributes, constant subscripts."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return _pure(node.value)
    if isinstance(node, cst.Subscript):
        if not _pure(node.value):
            return False
        for element in node.slice:
            if not isinstance(element.slice, cst.Index):
                return False
            value = element.slice.value
            if not (isinstance(value, (cst.SimpleString, cst.Integer)) or _pure(value)):
                return False
        return True
    return False


def _is_literal(node: Optional[cst.CSTNode], *values: str) -> bool:
    return isinstance(node, cst.Name) and node.value in values


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


def _func_name(call: cst.Call) -> Optional[str]:
    tp = type(call.func)
    if tp is cst.Name:
        return call.func.value
    if tp is cst.Attribute:
        return call.func.attr.value
    return None


def _loops_of(node: cst.CSTNode, ctx, stop: cst.CSTNode) -> List[cst.CSTNode]:
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


def _header_loop(node: cst.CSTNode, ctx) -> Optional[cst.For]:
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


class DataFacts:
    """Loaders, where they are visible, and what each rule of the family should do with them."""

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
        self.hoists: Dict[cst.CSTNode, "_Hoists"] = {}
        self._sites: Optional[Tuple[Tuple[int, int, int], List[Tuple[cst.CSTNode, List[Ref]]]]] = None
        self._scope_chains: Dict[int, Tuple[cst.CSTNode, ...]] = {}  # see `scopes`
        self._words_of_dataset: Dict[int, List[str]] = {}  # see `_dataset_words`
        self.distributed = analysis.is_distributed(ctx)
        self.skip_file = any(ctx.imports.imports_module(m) for m in SELF_SHARDING)
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
        self._used_names: Optional[Set[str]] = None  # see `_taken_names`
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
        for loader in self.loaders:
            if loader.kind == "eval" and loader.sampler == "eval" and self._iterated_with_grad(loader):
                # Unpadded shards give ranks different batch counts; a DDP forward with gradients
                # enabled broadcasts buffers (a collective), so the rank with more batches would
                # hang. A padded sampler keeps the counts equal.
                loader.eval_with_grad = True
                loader.sampler = "distributed"

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
                binding: Optional[cst.CSTNode] = None) -> bool:
        ref = self.refs.get((id(scope), key))
        changed = False
        if ref is None:
            ref = Ref(scope, key, text, binding=binding)
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
                    self.refs[(id(scope), f"{base}[{key_text!r}]")].eval = _verdict(_words(key_text)) == "eval"
        args = bind_args(call)
        if args is not None:
            loader.dataset = args["dataset"].value if "dataset" in args else None
            loader.shuffle = args["shuffle"].value if "shuffle" in args else None
        loader.kind, loader.condition = self._classify(call, loader, keys)
        loader.status, loader.reason = self._status(call, loader, args)
        if loader.kind == "eval" and args is not None and "batch_size" in args:
            size = args["batch_size"].value
            # `num_neg + 1`: one positive and its negatives per batch (`2 * bs` is just a size)
            if isinstance(size, cst.BinaryOperation) and isinstance(size.operator, (cst.Add, cst.Subtract)) \
                    and not _is_literal(loader.shuffle, "True"):
                loader.grouped = code(size)
        if loader.status == "plain":
            loader.hoist = self._hoist_plan(call, loader)
            if loader.hoist is None and not _pure(loader.dataset):
                loader.status = "unhoistable"
                loader.reason = ("the dataset expression cannot be moved out of this statement: assign it to a "
                                 f"variable `ds` and pass `sampler={ctx.tm}.sampler(ds, shuffle=...)` (no `shuffle=`)")
        loader.sampler = self._sampler_after(loader)
        loader.needs_epoch = self._needs_epoch(loader, args)
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
            verdicts = [(_verdict(_words(k)) or "train", lit) for k, lit in keys]
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
            return "mixed", cond
        sources: List[List[str]] = []
        if loader.target:
            sources.append(_words(loader.target.split(".")[-1]))
        if loader.dataset is not None:
            sources.append(self._dataset_words(loader))
        fn = self.function_of(call)
        if isinstance(fn, cst.FunctionDef):
            sources.append(_words(fn.name.value))
        for words in sources:
            verdict = _verdict(words)
            if verdict:
                return verdict, None
        shuffle = loader.shuffle
        if shuffle is not None and not _is_literal(shuffle, "True", "False", "None"):
            if _verdict(_expression_words(shuffle)):
                loader.condition_is_shuffle = True
                return "mixed", _parenthesize(code(shuffle), shuffle)
        return "train", None

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

    def _status(self, call: cst.Call, loader: Loader, args) -> Tuple[str, str]:
        tm = self.ctx.tm
        if args is None:
            return "unknown", (f"DataLoader(*args) hides its arguments: pass `sampler={tm}.sampler(dataset, "
                               "shuffle=...)` (without `shuffle=`) so that each rank loads its own shard")
        for name in ("sampler", "batch_sampler"):
            arg = args.get(name)
            if arg is not None and not _is_literal(arg.value, "None") and not self._always_none(arg.value, call):
                if self._distributed_sampler(arg.value, loader):
                    return "distributed", ""
                if self._mentions_rank(arg.value, call):
                    return "sharded", ""
                loader.custom_arg = arg
                return "custom", (f"this DataLoader has its own `{name}=`, which every rank iterates in full: make it "
                                  "shard by rank (e.g. a DistributedSampler over its indices, or "
                                  f"`{tm}.rank()`/`{tm}.world_size()` inside it)")
        if loader.dataset is None:
            return "unknown", (f"the dataset is not passed explicitly: pass `sampler={tm}.sampler(dataset, "
                               "shuffle=...)` so that each rank loads its own shard")
        if self._iterable(loader.dataset, call):
            return "iterable", ("an IterableDataset cannot take a sampler, so every rank streams the same samples: "
                                f"shard the stream in `__iter__` (e.g. `itertools.islice(stream, {tm}.rank(), None, "
                                f"{tm}.world_size())`, combined with `get_worker_info()` for workers)")
        words = self._dataset_words(loader)
        if any(_RANK_RE.match(w) for w in ["_".join(words[i:i + 2]) for i in range(len(words))] + words):
            return "sharded", ""
        for a in call.args:
            if a.star == "**":
                keys = self._dict_keys(a.value, call)
                if keys is None or keys & {"sampler", "batch_sampler", "dataset"} or not keys <= KNOWN_KWARGS:
                    return "unknown", (f"DataLoader(**{code(a.value)}) may set `sampler`/`shuffle` in ways the tool "
                                       f"cannot see: pass `sampler={tm}.sampler(dataset, shuffle=...)` and make sure "
                                       "the dict sets neither `sampler` nor `shuffle=True`")
                if "shuffle" in keys:
                    if loader.shuffle is not None or not isinstance(a.value, cst.Name) or loader.kwargs_shuffle:
                        return "unknown", "DataLoader gets `shuffle` from a dict and elsewhere: set the sampler by hand"
                    loader.kwargs_shuffle = a.value.value
        return "plain", ""

    def _mentions_rank(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        """A sampler built with the rank or world size (a project's own distributed sampler)."""
        words = _expression_words(node)
        k = key_of(node)
        if k is not None:
            for assign in self.assigns_at(at, k)[:3]:
                words += _expression_words(assign.value)
        pairs = ["_".join(words[i:i + 2]) for i in range(len(words))]
        return any(_RANK_RE.match(w) for w in pairs + words)

    def _may_be_none(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
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

    def _always_none(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        """A name whose every assignment in scope is `None` (`sampler = None`)."""
        k = key_of(node)
        assigns = self.assigns_at(at, k) if k is not None else []
        return bool(assigns) and all(_is_literal(a.value, "None") for a in assigns)

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
            for c in _calls(self.ctx, n):
                name = self.ctx.resolve(c.func)
                if name in DIST_SAMPLERS:
                    shuffle = next((a.value for a in c.args if a.keyword and a.keyword.value == "shuffle"), None)
                    positional = [a for a in c.args if a.keyword is None and not a.star]
                    if shuffle is None and len(positional) >= 4:
                        shuffle = positional[3].value
                    shuffles.append(not _is_literal(shuffle, "False"))
                    found = True
                elif name == TM_SHARD_SAMPLER:
                    shuffles.append(True)
                    found = loader.runtime_sampler = True
                elif name in (TM_SAMPLER, TM_EVAL_SAMPLER):
                    loader.runtime_sampler = True
                    shuffle = next((a.value for a in c.args if a.keyword and a.keyword.value == "shuffle"), None)
                    if shuffle is None and len(c.args) > 1 and c.args[1].keyword is None:
                        shuffle = c.args[1].value
                    shuffles.append(name == TM_SAMPLER and not _is_literal(shuffle, "False", "None"))
                    found = True
            return found

        if calls_in(node):
            loader.sampler_shuffles = any(shuffles)
            loader.inline_distributed = isinstance(node, cst.Call) and self.ctx.resolve(node.func) in DIST_SAMPLERS
            return True
        k = key_of(node)
        if k is None:
            return False
        assigns = self.assigns_at(loader.call, k)
        if not any(calls_in(a.value) for a in assigns):
            return False
        loader.sampler_shuffles = any(shuffles)
        unconditional = all(isinstance(a.value, cst.Call) and self.ctx.resolve(a.value.func) in DIST_SAMPLERS
                            for a in assigns)
        if unconditional and isinstance(node, cst.Name):
            loader.sampler_name = (self.function_of(assigns[0]), node.value)
        return True

    def _iterable(self, node: cst.CSTNode, at: cst.CSTNode) -> bool:
        def iterable_call(n: cst.CSTNode) -> bool:
            for c in _calls(self.ctx, n):
                name = self.ctx.resolve(c.func)
                if name and (name in ITERABLE_BASES or name.startswith(ITERABLE_FACTORIES)):
                    return True
                if name in ("datasets.load_dataset",) and any(
                        a.keyword and a.keyword.value == "streaming" and _is_literal(a.value, "True") for a in c.args):
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

    def _hoist_plan(self, call: cst.Call, loader: Loader) -> Optional[Tuple[str, str]]:
        if loader.dataset is None or _pure(loader.dataset):
            return None
        ctx = self.ctx
        statement = loader.statement
        mode = "line"
        child: cst.CSTNode = call
        in_comprehension = False
        for anc in ctx.ancestors(call):
            if anc is statement:
                break
            if isinstance(anc, cst.CompFor) and child is anc.iter:
                return None  # walrus is not allowed in a comprehension's iterable
            if isinstance(anc, _COMPREHENSIONS):
                in_comprehension = True
                mode = "walrus"
            elif isinstance(anc, (cst.Lambda, cst.IfExp, cst.BooleanOperation)):
                mode = "walrus"
            child = anc
        if statement is None:
            return None
        block = ctx.parent(statement)
        if mode == "line":
            if isinstance(statement, cst.SimpleStatementLine):
                small = ctx.enclosing(call, cst.BaseSmallStatement)
                if statement.body[0] is not small:
                    mode = "walrus"
            elif isinstance(statement, cst.For) and ctx.enclosing(call, cst.For) is statement and _within(call, statement.iter, ctx):
                pass
            elif isinstance(statement, cst.With) and any(_within(call, item, ctx) for item in statement.items):
                pass
            else:
                mode = "walrus"
            if not isinstance(block, (cst.IndentedBlock, cst.Module)):
                mode = "walrus"
        if mode == "walrus" and in_comprehension and isinstance(ctx.scope_of(call), cst.ClassDef):
            return None
        return mode, self._new_name(loader)

    def _new_name(self, loader: Loader) -> str:
        """A readable, unused name for a hoisted dataset: `train_loader` -> `train_dataset`,
        `self.extra` -> `extra_dataset`, `return DataLoader(...)` in `get_test_loader` ->
        `test_dataset`; else by kind."""
        def from_loader_name(source: str) -> Optional[str]:
            for word, repl in (("dataloader", "dataset"), ("DataLoader", "Dataset"), ("loader", "dataset"),
                               ("Loader", "Dataset")):
                if word in source:
                    return source.replace(word, repl, 1)
            if source.endswith("_dl") or source == "dl":
                return source[:-2] + "dataset"
            return None

        base = None
        if loader.target and "[" in loader.target:
            keys = [r.key for r in loader.refs]
            if len(keys) == 1:
                base = re.sub(r"\W+", "_", keys[0].split("[", 1)[1]).strip("_") + "_dataset"
        elif loader.target:
            source = loader.target.split(".")[-1]
            base = from_loader_name(source) or f"{source}_dataset"
        elif isinstance(loader.scope, cst.FunctionDef):
            base = from_loader_name(re.sub(r"^(get|build|make|create|prepare|load|setup|init)_", "",
                                           loader.scope.name.value))
        if not base or not base.isidentifier():
            base = "eval_dataset" if loader.kind == "eval" else "train_dataset" if loader.kind == "train" else "dataset"
        taken = self._taken_names()
        name, n = base, 2
        while name in taken:
            name = f"{base}_{n}"
            n += 1
        taken.add(name)
        return name

    def _taken_names(self) -> Set[str]:
        """The module's identifiers and the names given to hoisted datasets so far (gathered on
        the first hoist: most files need none, and a module has many names)."""
        if self._used_names is None:
            self._used_names = self.scan.identifiers
        return self._used_names

    def _sampler_after(self, loader: Loader) -> Optional[str]:
        if loader.status == "distributed":
            return "distributed"
        if loader.status == "custom":  # TM201 wraps a training loader's own sampler in tm.shard_sampler
            sharded = loader.custom_arg is not None and loader.kind != "eval" and not self.skip_file \
                and not self.distributed
            return "distributed" if sharded else "custom"
        if loader.status != "plain" or self.skip_file:
            return None
        if loader.kind == "eval":
            return None if self.distributed or loader.grouped else "eval"
        return "distributed" if loader.kind == "train" else "mixed"

    def _needs_epoch(self, loader: Loader, args) -> bool:
        if self.skip_file or loader.kind == "eval":
            return False
        if loader.status == "distributed":
            return loader.sampler_shuffles
        if loader.status == "custom":
            return loader.sampler == "distributed"  # a tm.shard_sampler: a new draw each epoch
        if loader.status != "plain" or loader.sampler is None:
            return False
        if loader.kind == "mixed" or loader.kwargs_shuffle:
            return True
        return loader.shuffle is not None and not _is_literal(loader.shuffle, "False", "None")

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
            node: cst.CSTNode = name
            while True:
                found = self.refs_at(node)
                if found:
                    break
                up = ctx.parent(node)
                if type(up) in _CHAIN and up.value is node:
                    node = up
                    continue
                break
            up = ctx.parent(node)
            if not found or type(up) in _CHAIN and up.value is node:
                continue  # `loader.dataset`, `loader.sampler`: not an iteration
            sites.append((node, found))
        self._sites = (version, sites)
        return sites

    def _iterated_with_grad(self, loader: Loader) -> bool:
        """A `for` (or comprehension) over the loader runs outside no_grad/inference_mode."""
        for node, _ref in self.uses(lambda x: x is loader):
            site = _iteration_site(node, self.ctx)
            if site is not None and not self.grad_free(site, 0):
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

    def _no_grad(self, node: cst.CSTNode) -> bool:
        func = node.func if isinstance(node, cst.Call) else node
        name = self.ctx.resolve(func)
        if name in NO_GRAD:
            return True
        if name == "torch.set_grad_enabled" and isinstance(node, cst.Call) and node.args:
            return _is_literal(node.args[0].value, "False")
        return False

    # --- following loaders through helpers ------------------------------------------------
    def _follow(self) -> None:
        """Refs for names bound from helper returns, parameters and plain aliases, to a fixpoint."""
        for _ in range(8):
            changed = False
            returns = self._returns()
            for assign in self.facts.assigns:
                changed |= self._assign_ref(assign, returns)
            for call, _name in self.facts.calls:
                if id(call) in self.callee_map:
                    changed |= self._param_refs(call)
            if not changed:
                break

    def _returns(self) -> Dict[str, Dict[Optional[int], List[Loader]]]:
        """function name -> {tuple index or None: loaders it returns there}."""
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
        if type(value) is cst.Call and id(value) not in self.by_call:
            name = _func_name(value)
            result = returns.get(name) if name else None
            if result:
                if isinstance(target, (cst.Tuple, cst.List)):
                    for i, el in enumerate(target.elements):
                        if i in result:
                            pairs.append((el.value, result[i]))
                elif None in result:
                    pairs.append((target, result[None]))
        elif type(value) in _REFERENCES:
            found = self._loaders_of(value)
            if found:
                pairs.append((target, found))
        changed = False
        for node, found in pairs:
            k = key_of(node)
            if k is None or "[" in k:
                continue
            statement = self.ctx.statement_of(assign)
            changed |= self.add_ref(self.binding_scope(assign, k), k, code(node), found, statement)
        return changed

    def _param_refs(self, call: cst.Call) -> bool:
        changed = False
        for callee, skip_first in self._callees(call):
            for param, value in _bind_params(callee, call, skip_first):
                found = self._loaders_of(value) if type(value) in _REFERENCES else []
                if found:
                    changed |= self.add_ref(callee, param, param, found, None)
        return changed

    def _callees(self, call: cst.Call) -> List[Tuple[cst.FunctionDef, bool]]:
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


def _within(node: cst.CSTNode, container: cst.CSTNode, ctx) -> bool:
    return node is container or any(anc is container for anc in ctx.ancestors(node))


def _calls(ctx, node: cst.CSTNode) -> List[cst.Call]:
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


def _bind_params(fn: cst.FunctionDef, call: cst.Call, skip_first: bool) -> List[Tuple[str, cst.BaseExpression]]:
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


def loaders(ctx) -> List[Loader]:
    """Every DataLoader of the module, analysed once per file (see the module docstring)."""
    return data_facts(ctx).loaders


def data_facts(ctx) -> DataFacts:
    found = ctx.facts.get("data.facts")
    if found is None:
        found = DataFacts(ctx)
        ctx.facts["data.facts"] = found
        ctx.facts["loaders"] = found.loaders
    return found  # type: ignore[return-value]


def refs_at(ctx, node: cst.CSTNode) -> List[Ref]:
    """Loader refs that the expression `node` denotes (empty when it is not a known loader)."""
    data = data_facts(ctx)
    return data.refs_at(node) if data.scan is not None else []


# --- rewriting a DataLoader call ----------------------------------------------------------------

class _Hoists:
    """`ds = <expr>` statements put before one statement; the dataset expressions are taken from
    the rewritten call (so fixes of other rules inside them survive)."""

    def __init__(self, statement: cst.CSTNode) -> None:
        self.items: List[List] = []  # [name, rewritten expression or None, column shift]
        # the edit holds the items, not this object (which holds the edit): no reference cycle
        self.edit = replace(statement, partial(_hoist, self.items))

    def add(self, name: str, shift: int = 0) -> List:
        item = [name, None, shift]
        self.items.append(item)
        return item


def _hoist(items: List[List], updated):
    """`updated` (the rewritten statement) preceded by the `name = expression` assignments."""
    if not isinstance(updated, cst.BaseStatement):
        return updated
    new = [cst.SimpleStatementLine([cst.Assign([cst.AssignTarget(cst.Name(name))], shift_continuations(value, shift))])
           for name, value, shift in items if value is not None]
    if not new:
        return updated
    new[0] = new[0].with_changes(leading_lines=updated.leading_lines)
    return cst.FlattenSentinel([*new, updated.with_changes(leading_lines=())])


def _dataset_column(ctx, call: cst.Call, layout) -> Optional[int]:
    """Column (relative to the statement) where the call's dataset argument starts."""
    if layout is None or not call.args:
        return None
    first = call.args[0]
    if first.keyword is not None and first.keyword.value != "dataset" or first.star:
        return None
    ws = call.whitespace_before_args
    if isinstance(ws, cst.ParenthesizedWhitespace):
        column = len(ws.last_line.value)
    else:
        column = layout[1] - layout[0] + len(ws.value)
    if first.keyword is not None:
        column += len(code(first.keyword)) + len(code(first.equal)) if first.equal is not cst.MaybeSentinel.DEFAULT \
            else len(first.keyword.value) + 1
    return column


def _keywordize(args: List[cst.Arg], start: int = 2) -> List[cst.Arg]:
    """Positional arguments from `start` on become keywords (so removing one cannot shift others)."""
    out = []
    position = 0
    for a in args:
        if a.keyword is None and not a.star:
            if position >= start:
                a = a.with_changes(keyword=cst.Name(PARAMS[position]), equal=_EQ)
            position += 1
        out.append(a)
    return out


def _delete(args: List[cst.Arg], index: int) -> None:
    if index == len(args) - 1 and index > 0:
        args[index - 1] = args[index - 1].with_changes(comma=args[index].comma)
    del args[index]


def _insert_after(args: List[cst.Arg], index: int, new: cst.Arg) -> None:
    prev = args[index]
    if index < len(args) - 1:
        args.insert(index + 1, new.with_changes(comma=prev.comma))
        return
    if prev.comma is cst.MaybeSentinel.DEFAULT:
        args[index] = prev.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args.append(new)
        return
    # a trailing comma: the new argument takes the separator the previous ones use
    separator = args[index - 1].comma if index > 0 else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    args[index] = prev.with_changes(comma=separator)
    args.append(new.with_changes(comma=prev.comma))


def _index(args: Sequence[cst.Arg], keyword: str) -> Optional[int]:
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value == keyword:
            return i
    return None


LINE_LIMIT = 99


def layout_of(ctx, call: cst.Call) -> Optional[Tuple[int, int, int]]:
    """(indentation of the statement, column where the call's arguments start, longest line of
    the call today) when the call starts on its statement's first line; None when unknown. The
    arguments start just after the `(`, or, when they begin on a line of their own (a hanging
    indent, `DataLoader(\n    ds, ...`), at that line's indentation."""
    statement = ctx.statement_of(call)
    if not isinstance(statement, cst.SimpleStatementLine):
        return None
    indent = 0
    for anc in ctx.ancestors(statement):
        if isinstance(anc, cst.IndentedBlock):
            indent += len(anc.indent if anc.indent is not None else ctx.module.default_indent)
    line, call_code, func_width = _line_and_call(statement.body[0], call)
    at = line.find(call_code)
    if at < 0 or "\n" in line[:at] or line.count(call_code) != 1:
        return None
    first = indent + at + func_width + 1
    hanging = call.whitespace_before_args
    if isinstance(hanging, cst.ParenthesizedWhitespace):
        first = (indent if hanging.indent else 0) + len(hanging.last_line.value)
    lines = call_code.split("\n")
    widest = max([indent + at + len(lines[0])] + [indent + len(x) for x in lines[1:]])
    return indent, first, widest


class _SpanState(FastState):
    """Code generation that notes the token span of each wanted node (its first occurrence)."""

    def __init__(self, wanted: Set[int], **kwargs) -> None:
        super().__init__(**kwargs)
        self.wanted = wanted  # ids of the wanted nodes
        self.spans: Dict[int, List[int]] = {}  # id -> [first token, token after the last]

    def before_codegen(self, node: cst.CSTNode) -> None:
        key = id(node)
        if key in self.wanted and key not in self.spans:
            self.spans[key] = [len(self.tokens), -1]

    def after_codegen(self, node: cst.CSTNode) -> None:
        span = self.spans.get(id(node))
        if span is not None and span[1] < 0:
            span[1] = len(self.tokens)


def _line_and_call(small: cst.CSTNode, call: cst.Call) -> Tuple[str, str, int]:
    """`code(small)`, `code(call)` and `len(code(call.func))` from one code generation of
    `small` when it holds the call (a call generates the same code inside its statement as on
    its own); layout_of runs for every loader that gets a sampler."""
    state = _SpanState({id(call), id(call.func)}, default_indent=_EMPTY.default_indent,
                       default_newline=_EMPTY.default_newline)
    small._codegen(state)
    tokens = state.tokens
    line = "".join(tokens)
    span = state.spans.get(id(call))
    if span is None:  # the call is in another small statement of the line
        return line, code(call), len(code(call.func))
    func = state.spans[id(call.func)]
    return line, "".join(tokens[span[0]:span[1]]), len("".join(tokens[func[0]:func[1]]))


def _single_line(comma) -> bool:
    return isinstance(comma, cst.Comma) and not isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)


def _wrap(args: List[cst.Arg], new: cst.Arg, layout: Tuple[int, int, int]) -> List[cst.Arg]:
    """Break the line before `new` (and after it) when the line holding it gets too long,
    aligning with the call's own continuation lines or its opening parenthesis."""
    indent, first, widest = layout
    limit = max(LINE_LIMIT, widest)
    cont = None
    for a in args:
        if isinstance(a.comma, cst.Comma) and isinstance(a.comma.whitespace_after, cst.ParenthesizedWhitespace):
            ws = a.comma.whitespace_after
            cont = ws
            break
    if cont is None:
        relative = first - indent
        cont = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(" " * relative))
    cont_col = indent + len(cont.last_line.value) if cont.indent else len(cont.last_line.value)
    index = args.index(new)
    texts = [_arg_text(a) for a in args[:index + 2]]
    if any("\n" in text for text in texts):
        return args  # a multi-line argument: the columns cannot be counted
    # the column where each argument starts, breaking before the new argument and before the
    # one after it when their line would get too long
    col = first
    for i, text in enumerate(texts):
        if i == index and i > 0 and col + len(text) + 1 > limit and _single_line(args[i - 1].comma):
            args[i - 1] = args[i - 1].with_changes(comma=args[i - 1].comma.with_changes(whitespace_after=cont))
            col = cont_col
        elif i == index + 1 and _single_line(args[i - 1].comma) and col + _rest_of_line(args, i) > limit:
            args[i - 1] = args[i - 1].with_changes(comma=args[i - 1].comma.with_changes(whitespace_after=cont))
        col += len(text)
        comma = args[i].comma
        if isinstance(comma, cst.Comma):
            col = cont_col if not _single_line(comma) else col + 1 + len(comma.whitespace_after.value)
    return args


def _arg_text(arg: cst.Arg) -> str:
    """An argument's code without its comma and the whitespace after it (which holds the line
    break when the call's `)` stands on a line of its own)."""
    return code(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=cst.SimpleWhitespace("")))


def _rest_of_line(args: List[cst.Arg], i: int) -> int:
    """Columns from the start of `args[i]` to the end of its line: the arguments after it up to
    the next line break, with their separators, and the comma or `)` that ends the line."""
    width = 0
    for a in args[i:]:
        text = _arg_text(a)
        if "\n" in text:
            return width + text.index("\n")
        width += len(text)
        if not _single_line(a.comma):
            break
        width += 1 + len(a.comma.whitespace_after.value)
    return width + 1


def rewrite_call(call: cst.Call, sampler: Optional[cst.BaseExpression], *, dataset: Optional[cst.BaseExpression] = None,
                 capture: Optional[List] = None, kwargs_shuffle: Optional[str] = None,
                 layout: Optional[Tuple[int, int, int]] = None) -> cst.Call:
    """Give a DataLoader call `sampler=` (or, with sampler None, only drop `shuffle`)."""
    args = _keywordize(list(call.args))
    if dataset is not None:
        for i, a in enumerate(args):
            if (a.keyword is None and not a.star) or (a.keyword is not None and a.keyword.value == "dataset"):
                if capture is not None:
                    capture[1] = a.value
                value = dataset
                if a.keyword is not None and isinstance(value, cst.NamedExpr):
                    value = value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                args[i] = a.with_changes(value=value)
                break
    shuffle = _index(args, "shuffle")
    current = _index(args, "sampler")
    new_arg = None
    if sampler is None:
        if shuffle is not None:
            _delete(args, shuffle)
    elif current is not None:
        args[current] = new_arg = args[current].with_changes(value=sampler)
        if shuffle is not None:
            _delete(args, shuffle)
    elif shuffle is not None:
        args[shuffle] = new_arg = args[shuffle].with_changes(keyword=cst.Name("sampler"), value=sampler)
    else:
        after = _index(args, "batch_size")
        if after is None:
            positional = [i for i, a in enumerate(args) if a.keyword is None and not a.star]
            after = positional[-1] if positional else 0
        _insert_after(args, after, kwarg("sampler", sampler))
        new_arg = args[after + 1]
    if kwargs_shuffle:
        for i, a in enumerate(args):
            if a.star == "**" and isinstance(a.value, cst.Name) and a.value.value == kwargs_shuffle:
                args[i] = a.with_changes(value=expr(f'{{**{kwargs_shuffle}, "shuffle": False}}'))
    if args and call.args and args[-1] is not call.args[-1] and args[-1].comma is not cst.MaybeSentinel.DEFAULT:
        last_original = call.args[-1].comma
        if last_original is cst.MaybeSentinel.DEFAULT:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    if layout is not None and new_arg is not None:
        args = _wrap(args, new_arg, layout)
    return call.with_changes(args=args)


# --- the rules ---------------------------------------------------------------------------------

class _DataRule(Rule):
    commands = frozenset({"ddp", "lint"})

    @property
    def data(self) -> DataFacts:
        return data_facts(self.ctx)

    def active(self) -> bool:
        """DDP-conversion rules report in `lint` only for files that are already distributed."""
        data = self.data
        if not data.loaders or data.skip_file:
            return False
        return self.ctx.options.mode != "lint" or data.distributed

    def add_sampler(self, loader: Loader, message: str) -> None:
        """Report a plain loader with the edit that gives it its sampler."""
        ctx, data = self.ctx, self.data
        tm = ctx.tm
        dataset_text = code(loader.dataset) if loader.hoist is None else loader.hoist[1]
        if loader.kind == "eval" and loader.eval_with_grad:
            sampler_text = f"{tm}.sampler({dataset_text}, shuffle=False)"
        elif loader.kind == "eval":
            keep = loader.shuffle is not None and not (isinstance(loader.shuffle, cst.Name)
                                                       and loader.shuffle.value in ("False", "None"))
            # the loader's own shuffle=True is kept (an evaluation that breaks early scores new batches)
            sampler_text = (f"{tm}.eval_sampler({dataset_text}, shuffle={code(loader.shuffle)})" if keep
                            else f"{tm}.eval_sampler({dataset_text})")
        else:
            shuffle = (code(loader.shuffle) if loader.shuffle is not None
                       else f'{loader.kwargs_shuffle}.get("shuffle", False)' if loader.kwargs_shuffle else "False")
            if loader.kind == "mixed":
                train_shuffle = "True" if loader.condition_is_shuffle else shuffle
                sampler_text = (f"{tm}.sampler({dataset_text}, shuffle={train_shuffle}) if {loader.condition} "
                                f"else {tm}.eval_sampler({dataset_text})")
            else:
                sampler_text = f"{tm}.sampler({dataset_text}, shuffle={shuffle})"
        sampler = expr(sampler_text)
        edits: List[Edit] = []
        capture = None
        new_dataset = None
        shared = sum(1 for x in data.loaders if x.statement is loader.statement) > 1
        layout = None if shared else layout_of(ctx, loader.call)  # widths are unknown when two change
        if loader.hoist is not None:
            mode, name = loader.hoist
            if mode == "line":
                hoists = data.hoists.get(loader.statement)
                if hoists is None:
                    hoists = data.hoists[loader.statement] = _Hoists(loader.statement)
                old = _dataset_column(ctx, loader.call, layout)
                capture = hoists.add(name, 0 if old is None else len(name) + 3 - old)
                new_dataset = cst.Name(name)
            else:
                new_dataset = cst.NamedExpr(cst.Name(name), loader.dataset)
        kw = loader.kwargs_shuffle
        if layout is not None and loader.hoist is not None and loader.hoist[0] == "line":
            indent, first, widest = layout  # the dataset expression becomes a short name
            widest -= len(code(loader.dataset)) - len(loader.hoist[1])
            layout = (indent, first, widest)

        def fix(call: cst.Call, sampler=sampler, new_dataset=new_dataset, capture=capture, kw=kw, layout=layout,
                walrus=loader.hoist is not None and loader.hoist[0] == "walrus", name=loader.hoist and loader.hoist[1]):
            if walrus:
                positional = [a for a in call.args if a.keyword is None and not a.star]
                current = positional[0] if positional else next(
                    a for a in call.args if a.keyword is not None and a.keyword.value == "dataset")
                new_dataset = cst.NamedExpr(cst.Name(name), current.value)
            return rewrite_call(call, sampler, dataset=new_dataset, capture=capture, kwargs_shuffle=kw, layout=layout)

        edits.append(replace(loader.call, fix))
        if capture is not None:
            edits.append(data.hoists[loader.statement].edit)
        self.report(loader.call, message, edits=edits, imports=[ctx.runtime_import()])

    def manual(self, loader: Loader) -> None:
        self.report(loader.call, loader.reason)


class DistSampler(_DataRule):
    """
    ## What it does
    Gives every training `DataLoader` a distributed sampler, `sampler=tm.sampler(dataset,
    shuffle=<the original shuffle>)`, and drops the `shuffle` argument (a positional `shuffle`
    becomes a keyword first). Loaders built at top level, in `main()`, in helper functions that
    return them and in trainer-class methods are all handled, under any import spelling of
    `DataLoader`. A dataset given as an expression (`DataLoader(MyDataset(root), ...)`) is first
    assigned to a variable (`train_dataset = MyDataset(root)`) so it is built only once.

    ## Why is this bad?
    DDP does not shard inputs: without a distributed sampler every rank iterates the whole
    dataset, so N processes do N times the work per epoch and see identical batches.
    `tm.sampler` is a `DistributedSampler` under torchrun and a `RandomSampler` (or
    `SequentialSampler` when not shuffling) in a plain `python train.py` run.

    Loaders whose name, dataset or enclosing function says val/test/eval/dev are left to TM203.
    A training loader with its own `sampler=`/`batch_sampler=` (`WeightedRandomSampler`,
    `RandomSampler(replacement=True)`, a bucketing sampler of the project) gets it wrapped in
    `tm.shard_sampler(...)`: the same draw on every rank (same seed, a new one each epoch), each
    rank taking every W-th item, padded to equal step counts; a sampler built with the rank or
    world size already shards and is left alone. An `IterableDataset`, or arguments hidden in
    `*args`/`**kwargs` the tool cannot see, is reported for a manual change instead, and so is a
    training step in a program that builds no DataLoader at all (full-batch tensors, a token
    stream, a hand-made batch iterator): every rank would train on the same batches. Loaders
    that already have a `DistributedSampler` or a `tm` sampler are left alone. In `lint` the rule
    reports only in files that already use torch.distributed: a training loader there without a
    distributed sampler is a bug.

    ## Limitations
    `tm.sampler` pads the last shard with repeated samples so that every rank runs the same
    number of steps; the DataLoader's own `drop_last` keeps its meaning (per-rank batches).
    A `generator=` passed to the DataLoader no longer drives the shuffling.
    """

    code = "TM201"
    name = "dist-sampler"
    summary = "Shard training DataLoaders across ranks with a distributed sampler"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader
            train_loader = DataLoader(train_ds, 64, True, num_workers=4)
            """,
            after="""
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            train_loader = DataLoader(train_ds, 64, sampler=tm.sampler(train_ds, shuffle=True), num_workers=4)
            """,
        ),
        Example(
            before="""
            import torch
            def get_train_loader(root):
                return torch.utils.data.DataLoader(ImageFolder(root), batch_size=32, shuffle=True)
            """,
            after="""
            import torch
            import torchmigrate.runtime as tm
            def get_train_loader(root):
                train_dataset = ImageFolder(root)
                return torch.utils.data.DataLoader(train_dataset, batch_size=32,
                                                   sampler=tm.sampler(train_dataset, shuffle=True))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if not self._shard_streams():
            self._no_loader_anywhere()
        if not self.active():
            return
        for loader in self.data.loaders:
            if loader.kind == "eval":
                continue
            if loader.status == "plain":
                what = f"`{loader.target}`" if loader.target else "this DataLoader"
                self.add_sampler(loader, f"{what} gives every rank the whole dataset: shard it with a distributed "
                                         f"sampler (`sampler={self.ctx.tm}.sampler(...)`)")
            elif loader.status == "custom" and loader.custom_arg is not None and not self.data.distributed:
                self._shard_custom(loader)
            elif loader.status in ("custom", "iterable", "unknown", "unhoistable") and not self.data.distributed:
                self.manual(loader)

    def _shard_streams(self) -> bool:
        """`train_data = batchify(corpus.train, bsz)` (a token stream cut into `bsz` columns, read
        with `get_batch(train_data, i)`), where the training step reads it: each rank batchifies
        its own contiguous part of the stream, `batchify(tm.shard_stream(corpus.train), bsz)`, all
        parts of one length so every rank runs the same number of steps. Evaluation streams are
        left whole. True when a stream was sharded."""
        ctx = self.ctx
        if not ctx.options.migrating or self.data.distributed or self.data.skip_file:
            return False
        sharded = False
        for assign in analysis.facts(ctx).assigns:
            value = assign.value
            if not (isinstance(value, cst.Call) and value.args and not value.args[0].star
                    and "batchify" in (dotted(value.func) or "").rsplit(".", 1)[-1].lower()):
                continue
            first = value.args[0].value
            if isinstance(first, cst.Call) and (dotted(first.func) or "").endswith("shard_stream"):
                sharded = True  # migrated already
                continue
            names = [dotted(t.target) for t in assign.targets]
            if len(names) != 1 or names[0] is None or not self._read_where_trained(names[0]):
                continue
            tm = ctx.tm
            self.report(value, f"`{names[0]}` is a token stream that every rank would read in full: each rank "
                               f"batchifies its own contiguous part (`{tm}.shard_stream`, equal lengths)",
                        edits=[replace(first, lambda f: cst.Call(func=expr(f"{tm}.shard_stream"), args=[cst.Arg(f)]))],
                        imports=[ctx.runtime_import()])
            sharded = True
        return sharded

    def _read_where_trained(self, name: str) -> bool:
        """`name` is read in a function or loop that runs a backward pass."""
        ctx = self.ctx
        head = name.split(".")[-1]
        for use in ctx.named(head):
            for anc in ctx.ancestors(use):
                if isinstance(anc, (cst.FunctionDef, cst.For, cst.While)) and analysis.runs_backward(ctx, anc):
                    return True
                if isinstance(anc, cst.FunctionDef):
                    break
        return False

    def _no_loader_anywhere(self) -> None:
        """A training step in a program that builds no DataLoader: its batches come from
        tensors (full-batch training), a token stream (`batchify`/`get_batch`) or a hand-made
        iterator, which no sampler shards. Said plainly, once, at the first backward."""
        ctx, data = self.ctx, self.data
        if not ctx.options.migrating or data.loaders or data.distributed or data.skip_file \
                or ctx.program.program_loaders:
            return
        for call, _name in analysis.facts(ctx).calls:
            func = call.func
            if isinstance(func, cst.Attribute) and func.attr.value == "backward" and not call.args:
                tm = ctx.tm
                self.report(call, "no DataLoader in this program: every rank trains on the same batches (full-batch "
                                  "tensors, a token stream, a hand-made iterator); give each rank its own part "
                                  f"(e.g. every `{tm}.world_size()`-th batch starting at `{tm}.rank()`), or keep "
                                  "identical data on purpose (full-batch training)",
                            statement=ctx.statement_of(call))
                return

    def _shard_custom(self, loader: Loader) -> None:
        """`sampler=WeightedRandomSampler(...)` -> `sampler=tm.shard_sampler(WeightedRandomSampler(...))`."""
        arg = loader.custom_arg
        name = arg.keyword.value if arg.keyword is not None else "sampler"
        tm = self.ctx.tm
        self.report(arg.value, f"this DataLoader's own `{name}=` is iterated in full by every rank: "
                               f"`{tm}.shard_sampler` shares it out by rank (same seed on every rank)",
                    edits=[replace(arg.value, lambda v: cst.Call(func=expr(f"{tm}.shard_sampler"), args=[cst.Arg(v)]))],
                    imports=[self.ctx.runtime_import()])


class EvalUnpadded(_DataRule):
    """
    ## What it does
    Gives evaluation loaders (their name, dataset, enclosing function or a `train=False` /
    `split="val"` argument says val/valid/validation/test/eval/dev) an unpadded sampler,
    `sampler=tm.eval_sampler(dataset)`, and drops `shuffle`. In `lint`, in files that already
    use torch.distributed, it reports evaluation loaders sharded with a `DistributedSampler`.

    An evaluation loader whose batch size is a computed group size (`batch_size=num_neg + 1`:
    each batch is one user's positive and negatives, read as `item[0]`) is kept unsharded and
    reported: sharding by sample would split every group across ranks and silently change the
    metric (found on guoyang9/NCF).

    ## Why is this bad?
    Without a sampler every rank evaluates the whole set (N times the work); with a
    `DistributedSampler` the set is padded with repeated samples so that it divides evenly, so
    metrics count some samples twice (5 samples on 2 ranks: rank 1 gets `[1, 3, 0]`).
    `tm.eval_sampler` gives rank r the samples r, r+N, r+2N, ...: each sample exactly once.
    Reduce the per-rank counts afterwards (TM701) or gather predictions (TM702).

    ## Limitations
    Ranks may then run one batch fewer than others, which is safe only when no per-batch
    collective runs during evaluation: evaluate under `torch.no_grad()` (a DDP forward with
    gradients enabled may broadcast buffers) or through `tm.unwrap(model)`. In files that are
    already distributed, evaluation loaders without a sampler are left alone (rank-0-only
    evaluation is a valid design).
    """

    code = "TM203"
    name = "eval-unpadded"
    summary = "Shard evaluation DataLoaders without padding (every sample exactly once)"
    safety = Safety.SAFE
    examples = (
        Example(
            before="""
            from torch.utils.data import DataLoader
            val_loader = DataLoader(val_ds, batch_size=128, shuffle=False)
            """,
            after="""
            from torch.utils.data import DataLoader
            import torchmigrate.runtime as tm
            val_loader = DataLoader(val_ds, batch_size=128, sampler=tm.eval_sampler(val_ds))
            """,
        ),
        Example(
            before="""
            import torch.utils.data as data
            test_loader = data.DataLoader(datasets.MNIST("data", train=False), batch_size=1000)
            """,
            after="""
            import torch.utils.data as data
            import torchmigrate.runtime as tm
            test_dataset = datasets.MNIST("data", train=False)
            test_loader = data.DataLoader(test_dataset, batch_size=1000, sampler=tm.eval_sampler(test_dataset))
            """,
        ),
    )

    def leave_Module(self, node: cst.Module) -> None:
        if not self.active():
            return
        data = self.data
        tm = self.ctx.tm
        for loader in data.loaders:
            if loader.kind != "eval":
                continue
            if loader.status == "plain" and not data.distributed and loader.grouped:
                self.report(loader.call, f"kept unsharded: its batch size `{loader.grouped}` is a computed group size, as when each "
                                         "batch is one group (a user's candidate items, a query's documents) that "
                                         "sharding by sample would split; every rank evaluates the whole set, so "
                                         "its metrics agree across ranks: shard whole batches by hand for a speed-up")
            elif loader.status == "plain" and not data.distributed:
                what = f"`{loader.target}`" if loader.target else "this evaluation DataLoader"
                if loader.eval_with_grad:
                    self.add_sampler(loader, (
                        f"{what} gives every rank the whole evaluation set: shard it. It is iterated with "
                        "gradients enabled, where a DDP forward broadcasts buffers and every rank must run the "
                        f"same number of batches, so it gets the padded `{tm}.sampler(..., shuffle=False)` (a "
                        f"few samples count twice); evaluate under `torch.no_grad()` to use `{tm}.eval_sampler`"))
                else:
                    self.add_sampler(loader, f"{what} gives every rank the whole evaluation set: shard it without "
                                             f"padding (`sampler={tm}.eval_sampler(...)`) so each sample counts once")
            elif loader.status in ("custom", "iterable", "unknown", "unhoistable") and not data.distributed:
                self.manual(loader)
            elif loader.status == "distributed" and not self.ctx.options.migrating and self._padded(loader):
                self.report(loader.call, "a DistributedSampler pads the evaluation set with repeated samples, so "
                                         "metrics count some samples twice: use "
                                         f"`sampler={tm}.eval_sampler(dataset)` (every sample once) when no "
                                         "per-batch collective runs during evaluation")

    def _padded(self, loader: Loader) -> bool:
        args = bind_args(loader.call) or {}
        sampler = args.get("sampler")
        if sampler is None:
            return False
        node = sampler.value
        values = [node] + [a.value for a in self.data.assigns_at(loader.call, key_of(node) or "")]
        for value in values:
            for c in _calls(self.ctx, value):
                if self.ctx.resolve(c.func) in DIST_SAMPLERS:
                    if any(a.keyword and a.keyword.value == "drop_last" and _is_literal(a.value, "True") for a in c.args):
                        return False
                    return True
        return False


class SamplerShuffleConflict(_DataRule):
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
        for loader in self.data.loaders:
            args = bind_args(loader.call)
            if args is None or "shuffle" not in args or not _is_literal(args["shuffle"].value, "True"):
                continue
            given = [n for n in ("sampler", "batch_sampler") if n in args and not _is_literal(args[n].value, "None")
                     and not self.data._always_none(args[n].value, loader.call)]
            if not given:
                continue
            message = (f"`shuffle=True` together with `{given[0]}=` raises ValueError (mutually exclusive); "
                       "the sampler decides the order")
            values = [args[n].value for n in given]
            if not any(self.data._may_be_none(v, loader.call) for v in values):
                self.report(loader.call, message + ": drop `shuffle`",
                            edits=[replace(loader.call, lambda call: rewrite_call(call, None))])
            elif len(values) == 1 and dotted(values[0]):
                text = f"{dotted(values[0])} is None"
                self.report(loader.call, message + f"; it may be None: `shuffle={text}`",
                            edits=[replace(args["shuffle"], lambda a, text=text: a.with_changes(value=expr(text)))])
            else:
                self.report(loader.call, message + " when it is not None: pass `shuffle=` only without a sampler")


# --- TM202 -----------------------------------------------------------------------------------

@dataclass(eq=False)
class _Insertion:
    loop: cst.CSTNode
    loader: Loader
    text: str  # the loader as the loop's scope names it
    anchor: cst.CSTNode  # statement to insert at
    where: str  # "before" or "after"
    var: Optional[str]
    problem: str = ""


class SetEpoch(_DataRule):
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
        data = self.data
        self.insertions: Dict[Tuple[int, int], _Insertion] = {}
        self.problems: List[Tuple[cst.CSTNode, str, Optional[Loader]]] = []
        self.seen: Set[Tuple[int, int]] = set()
        if not any(x.needs_epoch for x in data.loaders):
            return
        for node, ref in list(data.uses(lambda x: x.needs_epoch)):
            if ref.eval:
                continue
            for loader in ref.loaders:
                if loader.needs_epoch:
                    self._consume(node, loader, ref.text, 0)
        self._report()

    def _consume(self, node: cst.CSTNode, loader: Loader, text: str, depth: int, via_call: bool = False) -> None:
        """`node` (an expression naming `loader` as `text`, or a call of a function that iterates
        it) is used; find the epoch loop around it, or follow the function's callers."""
        ctx, data = self.ctx, self.data
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
            if any(v is node for fn, skip in data._callees(call) for _p, v in _bind_params(fn, call, skip)):
                return  # the callee's parameter is followed on its own
        fn = data.function_of(node)
        batch_loops = {id(loop) for loop in [_header_loop(node, ctx)] if loop is not None}
        loops = [lp for lp in _loops_of(node, ctx, fn) if id(lp) not in batch_loops]
        iter_call = isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "iter"
        if loops:
            self._at_loop(node, loops, loader, text, iter_call)
            return
        if not isinstance(fn, cst.FunctionDef) or self._contains_set_epoch(fn):
            return
        # `fn` consumes the loader without a loop: its callers' loops are the epoch loops.
        for call_site in data.callers.get(id(fn), []):
            for callee, skip in data._callees(call_site):
                if callee is not fn:
                    continue
                translated = self._translate(node, text, fn, call_site, skip)
                if translated is not None:
                    self._consume(call_site, loader, translated, depth + 1, via_call=True)
                elif _loops_of(call_site, ctx, data.function_of(call_site)):
                    self.problems.append((call_site, (
                        f"`{fn.name.value}()` iterates `{text}`, which its caller cannot name, inside an epoch loop: "
                        f"pass the epoch to it and call `{ctx.tm}.set_epoch({text}, epoch)` before iterating"), loader))

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
        data = self.data
        head = text.split(".")[0].split("[")[0]
        for param, value in _bind_params(fn, call, skip):
            if param == head:
                if not _pure(value):
                    return None
                return code(value) + text[len(head):]
        if head in ("self", "cls"):
            if isinstance(call.func, cst.Attribute):
                receiver = call.func.value
                if _pure(receiver):
                    return code(receiver) + text[len(head):]
            return None
        k = key_of(node) or text
        ref = data.lookup(node, k)
        if ref is not None and ref.scope is data.ctx.module:
            return text
        return None

    def _contains_set_epoch(self, scope: cst.CSTNode) -> bool:
        return self.data.contains_set_epoch(scope)

    def _at_loop(self, node: cst.CSTNode, loops: List[cst.CSTNode], loader: Loader, text: str, iter_call: bool) -> None:
        ctx = self.ctx
        loop = self._epoch_loop(loops)
        key = (id(loop), loader.index)
        if key in self.insertions:
            return
        if self._contains_set_epoch(loop) or self._calls_set_epoch(loop):
            self.insertions[key] = None  # type: ignore[assignment]
            return
        var, problem = self._loop_var(loop)
        body = loop.body
        if not isinstance(body, cst.IndentedBlock):
            problem = problem or "the loop body is on one line"
        anchor, where = (body.body[0] if isinstance(body, cst.IndentedBlock) else loop), "before"
        statement = ctx.statement_of(node)
        if iter_call and statement is not None and isinstance(ctx.parent(statement), cst.IndentedBlock) \
                and loop is loops[0] and ctx.parent(statement) is not body:
            anchor = statement  # an iterator re-created inside a step loop (`except StopIteration:`)
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
        data = self.data
        functions = {id(f): f for f in (data.ctx.enclosing(c, cst.FunctionDef) for c in data.set_epoch_calls) if f}
        for fn in functions.values():
            for call in data.callers.get(id(fn), []):
                if any(anc is loop for anc in self.ctx.ancestors(call)):
                    return True
        return False

    def _epoch_loop(self, loops: List[cst.CSTNode]) -> cst.CSTNode:
        def named_epoch(loop) -> bool:
            if isinstance(loop, cst.For):
                return "epoch" in code(loop.target).lower()
            return "epoch" in code(loop.test).lower()

        for loop in loops:
            if named_epoch(loop):
                return loop
        for loop in loops:
            if isinstance(loop, cst.For) and isinstance(loop.iter, (cst.List, cst.Tuple, cst.Set, cst.Dict)):
                continue
            return loop
        return loops[0]

    def _loop_var(self, loop: cst.CSTNode) -> Tuple[Optional[str], str]:
        if isinstance(loop, cst.For):
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
        increments: List[str] = []
        for n in _small_statements(loop.body):
            if isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name) and isinstance(n.operator, cst.AddAssign):
                increments.append(n.target.value)
        if not increments:
            return None
        test_names = {n.value for n in _names(loop.test)}
        for name in increments:
            if name in test_names:
                return name
        top = [s for s in loop.body.body] if isinstance(loop.body, cst.IndentedBlock) else []
        for s in top:
            if isinstance(s, cst.SimpleStatementLine):
                for small in s.body:
                    if isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name) \
                            and isinstance(small.operator, cst.AddAssign):
                        return small.target.value
        return None

    # report --------------------------------------------------------------------------------
    @staticmethod
    def _reshuffles_itself(loader: Loader) -> bool:
        """A loader whose sampler is (or becomes, in this run) one of the runtime's: `tm.sampler`
        and `tm.shard_sampler` start a new epoch on every pass where nobody calls `set_epoch`, so
        a place the tool cannot reach needs no TODO."""
        return loader.runtime_sampler or (loader.status in ("plain", "custom") and loader.sampler == "distributed")

    def _report(self) -> None:
        ctx, data = self.ctx, self.data
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
            loop_scope = data.function_of(ins.loop)
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


def _small_statements(node: cst.CSTNode) -> List[cst.CSTNode]:
    out: List[cst.CSTNode] = []

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return
        if isinstance(n, cst.BaseSmallStatement):
            out.append(n)
            return
        for child in child_nodes(n):
            go(child)

    go(node)
    return out


def _names(node: cst.CSTNode) -> List[cst.Name]:
    out: List[cst.Name] = []

    def go(n: cst.CSTNode) -> None:
        if isinstance(n, cst.Name):
            out.append(n)
            return
        for child in child_nodes(n):
            go(child)

    go(node)
    return out

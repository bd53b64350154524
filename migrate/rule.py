"""The rule API: what every rule in `torchmigrate.rules` subclasses.

A rule is a read-only visitor with `visit_<Node>` / `leave_<Node>` methods (LibCST node class
names). It reports Findings through `self.report(...)`, optionally with Edits that fix them.
All enabled rules share one traversal of one parsed module (see `walk.py`). Rules that need
the whole module before deciding collect nodes while visiting and report in `leave_Module`.

Each rule carries its own documentation (the class docstring, in Ruff's "What it does / Why is
this bad" shape) and `examples`, before/after pairs that `torchmigrate explain` prints and the
test suite runs, so documentation cannot drift from behaviour.
"""

from __future__ import annotations

import inspect
import textwrap
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple, Type

import libcst as cst

from torchmigrate.finding import Edit, Finding, Import, Safety
from torchmigrate.options import COMMANDS, RUNTIME_MODULE, Options
from torchmigrate.program.view import ModuleView
from torchmigrate.syntax.imports import ImportTable, dotted
from torchmigrate.syntax.walk import child_nodes

# (types) -> {node type: issubclass(node type, types)}, for Context.enclosing and _NodeIndex.spots
_MATCHES: Dict[Tuple[type, ...], Dict[type, bool]] = {}


@dataclass(frozen=True)
class Example:
    """A before/after pair. `after=None` means the rule leaves `before` unchanged."""

    before: str
    after: Optional[str] = None
    mode: str = "ddp"
    # the file it is written in: a Python file, or a launch file (`run.sh`, `Makefile`,
    # `README.md`: TM801), whose commands start `train.py`
    file: str = "train.py"
    also: Tuple[str, ...] = ()  # rules selected with this one (what it relies on, e.g. TM701's reductions)
    flags: Tuple[str, ...] = ()  # options of the command ("--shard-eval")

    @property
    def before_text(self) -> str:
        return textwrap.dedent(self.before).lstrip("\n")

    @property
    def after_text(self) -> Optional[str]:
        return None if self.after is None else textwrap.dedent(self.after).lstrip("\n")


class Context:
    """What rules know about the file being processed: imports, parents, options, findings."""

    def __init__(self, module: cst.Module, path: str, options: Options,
                 program: Optional[ModuleView] = None) -> None:
        self.module = module
        self.path = path
        self.options = options
        # What the rest of the program says about this module (one file alone: its own entry).
        self.program = program if program is not None else ModuleView()
        self.imports = ImportTable.from_module(module)
        for local, full in self.program.reexports.items():  # `from dataloader import *`
            if full != RUNTIME_MODULE:
                self.imports.names[local] = full
        self.parents: Dict[cst.CSTNode, cst.CSTNode] = {}
        self.preorder: List[cst.CSTNode] = []  # every node, in the order the walk met it
        self.walked = False  # the walk has met every node (set before any `leave_Module`)
        self._index: Optional[_NodeIndex] = None
        self.findings: List[Finding] = []
        # The codes of the rules that run together on this module (set by the engine): a rule
        # whose decision depends on another's edit (TM305 divides the batch of the loaders TM201
        # shards) asks here.
        self.enabled: FrozenSet[str] = frozenset()
        # Free-form facts one rule publishes for others, e.g. names of wrapped models.
        self.facts: Dict[str, object] = {}
        # enclosing(): (types) -> {id(node): answer}; ids are safe, the tree outlives the context.
        self._enclosing: Dict[Tuple[type, ...], Dict[int, Optional[cst.CSTNode]]] = {}

    def close(self) -> None:
        """Forget the file once its result is built. Rules keep the context and publish facts
        that point back at it, so the tree would otherwise live on in reference cycles until the
        garbage collector walks it; without these references most of it is freed at once. The
        findings stay valid (they hold their own nodes); the context must not be used again.
        A published fact with a `release()` method gets to break its own cycles first."""
        for fact in self.facts.values():
            release = getattr(fact, "release", None)
            if release is not None:
                release()
        self.__dict__.clear()

    # --- navigation -----------------------------------------------------------------
    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self.parents.get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
        node = self.parents.get(node)
        while node is not None:
            yield node
            node = self.parents.get(node)

    def ancestors_until(self, node: cst.CSTNode, stop: cst.CSTNode) -> List[cst.CSTNode]:
        """The ancestors of `node` below `stop` (a loop, a function), innermost first."""
        out = []
        for anc in self.ancestors(node):
            if anc is stop:
                break
            out.append(anc)
        return out

    def enclosing(self, node: cst.CSTNode, *types: type) -> Optional[cst.CSTNode]:
        # Hot path (rules ask it for most names they see): the type test is cached per node
        # type (isinstance against LibCST's ABCs is slow) and answers are memoised for every
        # node on the way up, so asking for all nodes of a deep tree stays linear.
        matches = _MATCHES.get(types)
        if matches is None:
            matches = _MATCHES[types] = {}
        memo = self._enclosing.get(types)
        if memo is None:
            memo = self._enclosing[types] = {}
        key = id(node)
        if key in memo:
            return memo[key]
        get = self.parents.get
        path = [key]
        top = node
        node = get(node)
        while node is not None:
            tp = type(node)
            hit = matches.get(tp)
            if hit is None:
                hit = matches[tp] = issubclass(tp, types)
            if hit:
                break
            key = id(node)
            if key in memo:
                node = memo[key]
                break
            path.append(key)
            top = node
            node = get(node)
        else:
            if top is not self.module:
                return None  # not (yet) linked up to the module: answer, but do not remember
        for key in path:
            memo[key] = node
        return node

    # --- indexes over the walk's nodes (from `leave_Module` on; earlier they search) -------
    def nodes(self, *types: type) -> List[cst.CSTNode]:
        """Every node of these types in the module, in source order (no walk: an index)."""
        if not self.walked:
            return _search(self.module, types, False)
        return self._node_index().find(types, 0, None)

    def within(self, node: cst.CSTNode, *types: type, skip_defs: bool = False) -> List[cst.CSTNode]:
        """Nodes of these types inside `node` (itself included), in source order; with
        `skip_defs`, not those inside a function, class or lambda defined under `node`."""
        if not self.walked:
            return _search(node, types, skip_defs)
        index = self._node_index()
        start = index.position.get(id(node))
        if start is None:  # a node built by a rule: not indexed, walk it
            return _search(node, types, skip_defs)
        end = index.end(node)
        found = index.find(types, start, end)
        if skip_defs and found:
            defs = index.find(_DEFS, start + 1, end)
            if defs:
                spans = [(index.position[id(d)], index.end(d)) for d in defs]
                found = [n for n in found if not any(a <= index.position[id(n)] <= b for a, b in spans)]
        return found

    def named(self, value: str) -> List[cst.Name]:
        """Every `Name` node spelling `value` (attribute names included), in source order."""
        if not self.walked:
            return [n for n in _search(self.module, (cst.Name,), False) if n.value == value]  # type: ignore[attr-defined]
        return self._node_index().named(value)

    def positioned(self, *types: type) -> List[Tuple[int, cst.CSTNode]]:
        """`(position, node)` for every node of these types, in source order."""
        index = self._node_index()
        preorder = index.preorder
        return [(i, preorder[i]) for i in index.spots(types)]

    def position(self, node: cst.CSTNode) -> Optional[int]:
        """Where `node` comes in source order (None for a node the walk did not meet)."""
        return self._node_index().position.get(id(node))

    def last_position(self, node: cst.CSTNode) -> int:
        """The `position` of the last node inside `node`: its subtree spans the two."""
        return self._node_index().end(node)

    def _node_index(self) -> "_NodeIndex":
        if not self.walked:
            raise RuntimeError("source positions are known only once the walk has met every node")
        if self._index is None:
            self._index = _NodeIndex(self.preorder)
        return self._index

    def statement_of(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        """The innermost statement (a line, or a compound statement header) holding `node`."""
        if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            return node
        return self.enclosing(node, cst.SimpleStatementLine, cst.BaseCompoundStatement)

    def scope_of(self, node: cst.CSTNode) -> cst.CSTNode:
        """The function, class or module whose body holds `node`."""
        return self.enclosing(node, cst.FunctionDef, cst.ClassDef, cst.Lambda) or self.module

    # --- names ----------------------------------------------------------------------
    def resolve(self, node: cst.BaseExpression) -> Optional[str]:
        return self.imports.resolve(node)

    @property
    def tm(self) -> str:
        """Local name of the runtime module in this file (`tm` unless already imported)."""
        return self.imports.alias_for(RUNTIME_MODULE) or "tm"

    def runtime_import(self) -> Import:
        return Import(self.options.runtime_module, asname=self.tm)

    def uses_runtime(self) -> bool:
        return RUNTIME_MODULE in self.imports.names.values()


_DEFS = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def _search(node: cst.CSTNode, types: Tuple[type, ...], skip_defs: bool) -> List[cst.CSTNode]:
    """`Context.within` for a node outside the index, by a walk of its subtree."""
    found = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, types):
            found.append(n)
        if skip_defs and n is not node and isinstance(n, _DEFS):
            continue
        stack.extend(reversed(child_nodes(n)))
    return found


class _NodeIndex:
    """Positions of the walk's nodes, grouped by type: a subtree is a contiguous run of the
    preorder, so "every call under this statement" is two bisections instead of a walk."""

    def __init__(self, preorder: List[cst.CSTNode]) -> None:
        self.preorder = preorder
        self.position: Dict[int, int] = {}
        self.by_type: Dict[type, List[int]] = {}
        by_type = self.by_type
        for i, node in enumerate(preorder):
            self.position[id(node)] = i
            tp = type(node)
            bucket = by_type.get(tp)
            if bucket is None:
                bucket = by_type[tp] = []
            bucket.append(i)
        self._types: Dict[Tuple[type, ...], List[int]] = {}
        self._names: Optional[Dict[str, List[cst.Name]]] = None

    def named(self, value: str) -> List[cst.Name]:
        if self._names is None:
            self._names = {}
            for i in self.by_type.get(cst.Name, ()):
                node = self.preorder[i]
                self._names.setdefault(node.value, []).append(node)  # type: ignore[attr-defined]
        return self._names.get(value, [])

    def end(self, node: cst.CSTNode) -> int:
        """Preorder position of the last node of `node`'s subtree."""
        while True:
            children = child_nodes(node)
            if not children:
                return self.position[id(node)]
            node = children[-1]

    def spots(self, types: Tuple[type, ...]) -> List[int]:
        """Positions of the nodes of these types (or their subclasses), ascending."""
        found = self._types.get(types)
        if found is None:
            # issubclass against LibCST's abstract bases is slow and a file has ~70 node types:
            # the answers are kept across files.
            matches = _MATCHES.get(types)
            if matches is None:
                matches = _MATCHES[types] = {}
            lists = []
            for tp, v in self.by_type.items():
                hit = matches.get(tp)
                if hit is None:
                    hit = matches[tp] = issubclass(tp, types)
                if hit:
                    lists.append(v)
            found = lists[0] if len(lists) == 1 else sorted(chain.from_iterable(lists))
            self._types[types] = found
        return found

    def find(self, types: Tuple[type, ...], start: int, end: Optional[int]) -> List[cst.CSTNode]:
        spots = self.spots(types)
        lo = bisect_left(spots, start) if start else 0
        hi = len(spots) if end is None else bisect_right(spots, end)
        preorder = self.preorder
        return [preorder[i] for i in spots[lo:hi]]


class Rule:
    """Base class of every rule. Subclasses set the class attributes and visit methods."""

    code: ClassVar[str] = ""
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    safety: ClassVar[Safety] = Safety.SAFE
    commands: ClassVar[FrozenSet[str]] = frozenset(COMMANDS)
    examples: ClassVar[Sequence[Example]] = ()

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def report(
        self,
        node: cst.CSTNode,
        message: str,
        *,
        edits: Sequence[Edit] = (),
        imports: Sequence[Import] = (),
        safety: Optional[Safety] = None,
        statement: Optional[cst.CSTNode] = None,
        advice: bool = False,
    ) -> Finding:
        """`advice`: the finding changes nothing about correctness (a performance hint): the
        report lists it as a note, and it neither needs attention nor fails the run."""
        finding = Finding(
            code=self.code,
            message=message,
            node=node,
            safety=safety or (self.safety if edits else Safety.MANUAL),
            edits=tuple(edits),
            imports=tuple(imports),
            statement=statement,
            advice=advice,
        )
        if edits or not self._in_torch_fallback(node):
            self.ctx.findings.append(finding)
        return finding

    def _in_torch_fallback(self, node: cst.CSTNode) -> bool:
        """`node` sits in the `except` of a `try:` that only imports from torch (`try: from
        torch.cuda.amp import GradScaler` / `except: class GradScaler: ...`, a stand-in for torch
        versions older than any the migrated program runs on): code that never runs gets no TODO."""
        ctx = self.ctx
        for anc in ctx.ancestors(node):
            if isinstance(anc, cst.ExceptHandler):
                attempt = ctx.parent(anc)
                if isinstance(attempt, cst.Try) and attempt.body.body and all(
                        isinstance(s, cst.SimpleStatementLine) and all(_imports_torch(small) for small in s.body)
                        for s in attempt.body.body):
                    return True
        return False

    @classmethod
    def documentation(cls) -> str:
        return inspect.cleandoc(cls.__doc__ or cls.summary)

    @classmethod
    def callbacks(cls) -> Tuple[List[Tuple[type, str]], List[Tuple[type, str]]]:
        """(node type, method name) pairs for the visit and leave methods this rule defines
        (found once per class: `dir()` of a rule costs more than a small file's walk)."""
        found = cls.__dict__.get("_callbacks")
        if found is None:
            found = cls._find_callbacks()
            cls._callbacks = found
        return found

    @classmethod
    def _find_callbacks(cls) -> Tuple[List[Tuple[type, str]], List[Tuple[type, str]]]:
        visits, leaves = [], []
        for attr in dir(cls):
            for prefix, out in (("visit_", visits), ("leave_", leaves)):
                if attr.startswith(prefix):
                    node_type = getattr(cst, attr[len(prefix):], None)
                    if not isinstance(node_type, type):
                        raise TypeError(f"{cls.__name__}.{attr}: no libcst node named {attr[len(prefix):]}")
                    out.append((node_type, attr))
        return visits, leaves


RuleType = Type[Rule]


def _imports_torch(small: cst.BaseSmallStatement) -> bool:
    """`import torch.x` / `from torch.x import y` (the library itself, not a project module)."""
    if isinstance(small, cst.Import):
        return all((dotted(a.name) or "").split(".")[0] == "torch" for a in small.names)
    return isinstance(small, cst.ImportFrom) and not small.relative and small.module is not None \
        and (dotted(small.module) or "").split(".")[0] == "torch"

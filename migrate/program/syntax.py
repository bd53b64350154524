"""Where a node sits among its module's statements: blocks, scopes, the names a statement binds
and reads, the calls under a node. Plain tree questions, asked of the context's parent map and
node index; the training facts (`training`) and the AMP plan (`rules/amp/plan.py`) build on
them. Answers about subtrees are memoised per module in ``ctx.facts`` (nodes are immutable)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import libcst as cst

from torchmigrate import analysis
from torchmigrate.syntax.imports import dotted
from torchmigrate.syntax.walk import child_fields, child_nodes

if TYPE_CHECKING:
    from torchmigrate.rule import Context


def subnodes(node: cst.CSTNode, skip_defs: bool = False) -> Iterator[cst.CSTNode]:
    """Every node under `node` (itself included), reading dataclass fields directly (fast).
    To find nodes of given types, `Context.within` is cheaper: it reads the file's node index."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if skip_defs and n is not node and isinstance(n, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        for name in child_fields(type(n)):
            value = getattr(n, name)
            if isinstance(value, cst.CSTNode):
                stack.append(value)
            elif isinstance(value, (tuple, list)):
                stack.extend(reversed([v for v in value if isinstance(v, cst.CSTNode)]))


def exclusive(ctx: "Context", a: cst.CSTNode, b: cst.CSTNode) -> bool:
    """`a` and `b` sit in different branches of one `if` (never both run in one pass): their
    nearest common ancestor is an `if` holding one of them in its body and the other beside it."""
    via: Dict[cst.CSTNode, cst.CSTNode] = {}
    child = a
    for anc in ctx.ancestors(a):
        via[anc] = child
        child = anc
    child = b
    for anc in ctx.ancestors(b):
        if anc in via:
            return isinstance(anc, cst.If) and via[anc] is not child and (via[anc] is anc.body or child is anc.body)
        child = anc
    return False


def iter_nodes(node: cst.CSTNode, skip_defs: bool = False) -> Iterable[cst.CSTNode]:
    """Every node under `node` (itself included), in source order, reading fields directly.
    Unlike `subnodes`, `skip_defs` skips functions and classes but still enters lambdas (the
    rank-guard facts and the rules built on them ask it that way)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if skip_defs and n is not node and isinstance(n, (cst.FunctionDef, cst.ClassDef)):
            continue
        stack.extend(reversed(child_nodes(n)))


def calls_in(ctx: Context, node: cst.CSTNode) -> List[cst.Call]:
    """Calls under `node`, not those inside a function, class or lambda defined there."""
    return _memo(ctx, "amp_calls_in", node, _calls_in)


def _calls_in(ctx: Context, node: cst.CSTNode) -> List[cst.Call]:
    return ctx.within(node, cst.Call, skip_defs=True)  # type: ignore[return-value]


def method_name(call: cst.Call) -> Optional[str]:
    return call.func.attr.value if isinstance(call.func, cst.Attribute) else None


def calls_by_method(ctx: Context) -> Dict[str, List[Tuple[cst.Call, Optional[str]]]]:
    """`{"backward": [(call, resolved name), ...], ...}` for method-style calls, built once."""
    index = ctx.facts.get("amp_by_method")
    if index is None:
        index = {}
        for call, name in analysis.facts(ctx).calls:
            func = call.func
            if type(func) is cst.Attribute:
                index.setdefault(func.attr.value, []).append((call, name))
        ctx.facts["amp_by_method"] = index
    return index  # type: ignore[return-value]


def calls_spelled(ctx: Context, spellings: Iterable[str]) -> List[cst.Call]:
    """Calls whose function is written as one of the dotted `spellings` (`model`, `self.net`),
    i.e. whose `dotted(call.func)` is one of them, in source order.

    Found from the index's Names that head each spelling, following the attributes up to the
    call, instead of spelling the function of every call in the file (tens of thousands)."""
    parent_of = ctx.parents.get
    found = []
    for text in set(spellings):
        head, *attrs = text.split(".")
        for node in ctx.named(head):
            for attr in attrs:
                parent = parent_of(node)
                if type(parent) is not cst.Attribute or parent.value is not node or parent.attr.value != attr:
                    break
                node = parent
            else:
                call = parent_of(node)
                if type(call) is cst.Call and call.func is node:
                    found.append(call)
    found.sort(key=ctx.position)
    return found


def receiver(call: cst.Call) -> Optional[cst.BaseExpression]:
    return call.func.value if isinstance(call.func, cst.Attribute) else None


def unparen(node: cst.BaseExpression) -> cst.BaseExpression:
    return node.with_changes(lpar=[], rpar=[]) if getattr(node, "lpar", None) else node


def target_names(target: cst.CSTNode) -> List[str]:
    if isinstance(target, (cst.Name, cst.Attribute)):
        d = dotted(target)
        return [d] if d else []
    if isinstance(target, cst.Subscript):
        return target_names(target.value)
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in target_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return target_names(target.value)
    return []


def _memo(ctx: Context, kind: str, node: cst.CSTNode, compute: Callable[[Context, cst.CSTNode], object]):
    """Per-file cache for the subtree helpers below (nodes are immutable). It lives in the
    context's facts, so it goes away with the file; keyed by the node itself, so a node a rule
    built stays alive while cached and its answer cannot pass to a later node at its address."""
    cache = ctx.facts.get(kind)
    if cache is None:
        cache = ctx.facts[kind] = {}
    found = cache.get(node)  # type: ignore[attr-defined]
    if found is None:
        found = cache[node] = compute(ctx, node)  # type: ignore[index]
    return found


# Nodes that bind names through a target: `binds` looks for them, `_targets_of` reads them.
_TARGET_NODES = (cst.Assign, cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.AsName, cst.NamedExpr)


def binds(ctx: Context, statement: cst.CSTNode) -> Set[str]:
    """Dotted names a statement assigns (recursing into compound statements, not into defs)."""
    return _memo(ctx, "amp_binds", statement, _binds)


def _binds(ctx: Context, statement: cst.CSTNode) -> Set[str]:
    out: Set[str] = set()
    for n in ctx.within(statement, *_TARGET_NODES, skip_defs=True):
        out.update(_targets_of(n))
    return out


def _targets_of(n: cst.CSTNode) -> List[str]:
    """Dotted names an assignment, loop, `as` or walrus node binds (none for other nodes)."""
    if isinstance(n, cst.Assign):
        return [name for t in n.targets for name in target_names(t.target)]
    if isinstance(n, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.NamedExpr)):
        return target_names(n.target)
    if isinstance(n, cst.AsName):
        return target_names(n.name)
    return []


def binds_all(ctx: Context) -> Set[str]:
    """Names bound anywhere in the file, inside functions too, with their parameters."""
    out = {n.name.value for n in ctx.nodes(cst.Param, cst.FunctionDef, cst.ClassDef)}  # type: ignore[attr-defined]
    for n in ctx.nodes(*_TARGET_NODES):
        out.update(_targets_of(n))
    return out


def reads(ctx: Context, node: cst.CSTNode) -> Set[str]:
    """Dotted names (and their prefixes) read anywhere under `node`, not inside defs there."""
    return _memo(ctx, "amp_reads", node, _reads)


def _reads(ctx: Context, node: cst.CSTNode) -> Set[str]:
    out: Set[str] = set()
    for n in ctx.within(node, cst.Name, cst.Attribute, skip_defs=True):
        d = dotted(n)
        if d:
            parts = d.split(".")
            for i in range(1, len(parts) + 1):
                out.add(".".join(parts[:i]))
    return out


def root_name(node: cst.BaseExpression) -> Optional[str]:
    """`loss` for `loss`, `loss.mean()`, `losses["total"]`, `self.loss`; None for other shapes."""
    while True:
        if isinstance(node, (cst.Name, cst.Attribute)):
            return dotted(node)
        if isinstance(node, cst.Subscript):
            node = node.value
        elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
            node = node.func.value
        else:
            return None


def statements(body) -> Sequence[cst.CSTNode]:
    if isinstance(body, (cst.IndentedBlock, cst.Module)):
        return body.body
    return ()


def block_of(ctx: Context, statement: cst.CSTNode) -> Tuple[Optional[cst.CSTNode], Sequence[cst.CSTNode]]:
    parent = ctx.parent(statement)
    if isinstance(parent, (cst.IndentedBlock, cst.Module)):
        return parent, parent.body
    return None, ()


def line_of(ctx: Context, node: cst.CSTNode) -> Optional[cst.SimpleStatementLine]:
    """The statement line holding `node`, or None when it sits in a one-line suite or a header."""
    small = ctx.enclosing(node, cst.SimpleStatementLine, cst.SimpleStatementSuite, cst.BaseCompoundStatement)
    return small if isinstance(small, cst.SimpleStatementLine) else None


def owner_statement(ctx: Context, block: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The compound statement whose suite `block` is (climbing through Else/ExceptHandler/...)."""
    node = ctx.parent(block)
    while node is not None and not isinstance(node, (cst.BaseCompoundStatement, cst.Module)):
        node = ctx.parent(node)
    return node if isinstance(node, cst.BaseCompoundStatement) else None


def scope_of(ctx: Context, node: cst.CSTNode) -> cst.CSTNode:
    cache = ctx.facts.setdefault("amp_scopes", {})
    found = cache.get(node)
    if found is None:
        n = ctx.parents.get(node)
        while n is not None and type(n) not in (cst.FunctionDef, cst.Lambda):
            n = ctx.parents.get(n)
        found = n if n is not None else ctx.module
        cache[node] = found
    return found


def class_of(ctx: Context, func: cst.CSTNode) -> Optional[cst.ClassDef]:
    if isinstance(func, cst.FunctionDef):
        block = ctx.parent(func)
        klass = ctx.parent(block) if block is not None else None
        return klass if isinstance(klass, cst.ClassDef) else None
    return None


def is_visible(ctx: Context, creation: cst.CSTNode, use: cst.CSTNode) -> bool:
    """A plain name assigned in scope `creation` can be read from scope `use`."""
    if creation is ctx.module or creation is use:
        return True
    node = use
    while node is not None and node is not ctx.module:
        node = ctx.enclosing(node, cst.FunctionDef, cst.Lambda)
        if node is creation:
            return True
    return False


def suites(statement: cst.BaseCompoundStatement) -> List[cst.CSTNode]:
    """The blocks of a compound statement: its body, every elif/else, handlers, finally."""
    out = []
    body = getattr(statement, "body", None)
    if body is not None:
        out.append(body)
    orelse = getattr(statement, "orelse", None)
    while orelse is not None:
        if isinstance(orelse, cst.If):
            out.append(orelse.body)
            orelse = orelse.orelse
        else:
            out.append(orelse.body)
            orelse = None
    for h in getattr(statement, "handlers", ()):
        out.append(h.body)
    fin = getattr(statement, "finalbody", None)
    if fin is not None:
        out.append(fin.body)
    return out


def is_attr_name(ctx: Context, node: cst.Name) -> bool:
    """`autocast` in `torch.autocast`, `amp` in `apex.amp`: an attribute, not a use of a local name."""
    parent = ctx.parent(node)
    return isinstance(parent, cst.Attribute) and parent.attr is node


def body_of(parent: cst.CSTNode) -> Optional[Sequence[cst.CSTNode]]:
    """The statements of a block (a one-line suite too), or None for a node that is no block."""
    if isinstance(parent, (cst.IndentedBlock, cst.Module, cst.SimpleStatementSuite)):
        return parent.body
    return None


def index_in(seq: Sequence[cst.CSTNode], node: cst.CSTNode) -> int:
    """The position of `node` itself (not an equal node) in `seq`, or -1."""
    for i, s in enumerate(seq):
        if s is node:
            return i
    return -1


def ranged_loop(node: cst.CSTNode) -> bool:
    """`for c in range(n):`: a loop over indices, not over data (inside a batch loop: the
    classes, heads or modules the batch's step goes through)."""
    return isinstance(node, cst.For) and isinstance(node.iter, cst.Call) and isinstance(node.iter.func, cst.Name) \
        and node.iter.func.value == "range"


def next_statement(ctx: Context, statement: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The statement right after `statement` in its block, or None (the last one, or no block)."""
    body = body_of(ctx.parent(statement))
    if body is None:
        return None
    i = index_in(body, statement)
    return body[i + 1] if 0 <= i < len(body) - 1 else None


def local_calls(ctx: Context) -> Dict[str, List[cst.Call]]:
    """Calls of this file's functions and methods by name: `name(...)`, `self.name(...)`."""
    found = ctx.facts.get("tm_local_calls")
    if found is None:
        found = {}
        for call, _ in analysis.facts(ctx).calls:
            func = call.func
            if isinstance(func, cst.Name):
                found.setdefault(func.value, []).append(call)
            elif isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value in ("self", "cls"):
                found.setdefault(func.attr.value, []).append(call)
        ctx.facts["tm_local_calls"] = found
    return found  # type: ignore[return-value]


def local_callee(ctx: Context, call: cst.Call) -> Optional[cst.FunctionDef]:
    """The function of this file (`train(...)`, a module-level def) or the method of the caller's
    class (`self.train_epoch(...)`) that `call` runs; None for anything else."""
    func = call.func
    if isinstance(func, cst.Name):
        functions = ctx.facts.get("tm_module_functions")
        if functions is None:
            functions = ctx.facts["tm_module_functions"] = {
                s.name.value: s for s in ctx.module.body if isinstance(s, cst.FunctionDef)}
        return functions.get(func.value)  # type: ignore[union-attr]
    if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name) and func.value.value == "self":
        klass = ctx.enclosing(call, cst.ClassDef)
        if klass is not None:
            return next((s for s in klass.body.body if isinstance(s, cst.FunctionDef)
                         and s.name.value == func.attr.value), None)
    return None


def last_name(node: cst.BaseExpression) -> Optional[str]:
    """`x` for `x` and for `a.b.x`; None for other expressions."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        return node.attr.value
    return None


def unconditional(ctx: Context, line: cst.CSTNode, scope: cst.CSTNode) -> bool:
    """`line` runs whenever its function does (only `for`/`with` blocks around it): a barrier
    there is reached by every rank. Under `if acc > best:` ranks may disagree and hang."""
    for anc in ctx.ancestors(line):
        if anc is scope:
            return True
        if isinstance(anc, (cst.If, cst.While, cst.Try, cst.TryStar, cst.ExceptHandler, cst.Match)):
            return False
    return True

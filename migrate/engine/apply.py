"""The one applier: turns accepted Edits into a new module.

Only the nodes on a path from the root to an edited node are rebuilt, so applying a handful of
fixes to a large file costs little more than the edits themselves. Replacement functions see the
node after its own children were rewritten, so edits on nested nodes compose.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Sequence, Set

import libcst as cst

from torchmigrate.finding import Edit, EditKind, Import
from torchmigrate.syntax.imports import ImportTable, new_import_anchor
from torchmigrate.syntax.walk import child_fields

TODO_PREFIX = "# TODO(torchmigrate): "


def apply_edits(
    module: cst.Module,
    edits: Sequence[Edit],
    parents: Dict[cst.CSTNode, cst.CSTNode],
    imports: Iterable[Import] = (),
    table: ImportTable | None = None,
) -> cst.Module:
    by_target: Dict[cst.CSTNode, List[Edit]] = defaultdict(list)
    for edit in edits:
        by_target[edit.target].append(edit)
    new_imports = _missing_imports(imports, table or ImportTable.from_module(module))
    if new_imports:
        anchor = new_import_anchor(module)
        stmts = [_import_statement(spec) for spec in new_imports]
        if anchor is None:
            by_target[module].append(Edit(EditKind.REPLACE, module, fn=_prepend(stmts)))
        else:
            by_target[anchor].insert(0, Edit(EditKind.INSERT_AFTER, anchor, statements=tuple(stmts)))
    if not by_target:
        return module
    wraps: Dict[cst.CSTNode, List[Edit]] = defaultdict(list)  # parent -> wraps of its children
    for edit in edits:
        if edit.kind is EditKind.WRAP:
            wraps[parents[edit.target]].append(edit)
            by_target[edit.target].remove(edit)
            if edit.end is not None:
                by_target.setdefault(edit.end, [])
    dirty: Set[cst.CSTNode] = set(wraps)
    for target in list(by_target) + list(wraps):
        node = parents.get(target)
        while node is not None and node not in dirty:
            dirty.add(node)
            node = parents.get(node)
    result = _Rebuilder(by_target, dirty, wraps).node(module)
    assert isinstance(result, cst.Module)
    return result


# keyword statements whose expression may have been written against the keyword (`if(x):`,
# `while(x):`, `return(x)`, `assert(x)`): the field that holds the space after the keyword
_KEYWORD_SPACE = {cst.If: ("test", "whitespace_before_test"), cst.While: ("test", "whitespace_after_while"),
                  cst.Return: ("value", "whitespace_after_return"), cst.Assert: ("test", "whitespace_after_assert")}


def _keyword_space(original: cst.CSTNode, changes: dict) -> dict:
    """`if(not exists(p)):` whose test an edit replaced by an expression without the parentheses:
    a space after the keyword, which the rewritten test now needs (`if not ...`)."""
    fields = _KEYWORD_SPACE.get(type(original))
    if fields is None or fields[0] not in changes:
        return {}
    new = changes[fields[0]]
    space = getattr(original, fields[1], None)
    if new is None or getattr(new, "lpar", None) or not isinstance(space, cst.SimpleWhitespace) or space.value:
        return {}
    return {fields[1]: cst.SimpleWhitespace(" ")}


class _Rebuilder:
    def __init__(self, edits: Dict[cst.CSTNode, List[Edit]], dirty: Set[cst.CSTNode],
                 wraps: Dict[cst.CSTNode, List[Edit]]) -> None:
        self.edits = edits
        self.dirty = dirty
        self.wraps = wraps

    def touched(self, node: object) -> bool:
        return isinstance(node, cst.CSTNode) and (node in self.dirty or node in self.edits)

    def node(self, original: cst.CSTNode):
        updated = original
        if original in self.dirty:
            changes = {}
            for name in child_fields(type(original)):
                value = getattr(original, name)
                if isinstance(value, cst.CSTNode):
                    if self.touched(value):
                        new = self.node(value)
                        if isinstance(new, cst.FlattenSentinel):
                            raise ValueError(f"cannot put several nodes in {type(original).__name__}.{name}")
                        changes[name] = None if isinstance(new, cst.RemovalSentinel) else new
                elif isinstance(value, (tuple, list)) and any(self.touched(c) for c in value):
                    changes[name] = self.sequence(original, name, value)
            if any(isinstance(v, cst.RemovalSentinel) for v in changes.values()):
                # an emptied line goes, but insertions anchored on it must survive
                return self.own_edits(original, cst.RemovalSentinel.REMOVE)
            changes.update(_keyword_space(original, changes))
            updated = original.with_changes(**changes)
        return self.own_edits(original, updated)

    def own_edits(self, original: cst.CSTNode, updated):
        before: List[cst.BaseStatement] = []
        after: List[cst.BaseStatement] = []
        for edit in self.edits.get(original, ()):
            if edit.kind is EditKind.REPLACE:
                if isinstance(updated, (cst.RemovalSentinel, cst.FlattenSentinel)):
                    continue  # already removed or expanded by an earlier edit
                updated = edit.fn(updated)
            elif edit.kind is EditKind.INSERT_BEFORE:
                before.extend(edit.statements)
            elif edit.kind is EditKind.INSERT_AFTER:
                after.extend(edit.statements)
            elif edit.kind is EditKind.TODO and isinstance(updated, cst.FlattenSentinel) and updated.nodes:
                # the statement became several (a hoisted assignment before it): above the first
                updated = cst.FlattenSentinel([add_todo(updated.nodes[0], edit.text), *updated.nodes[1:]])
            elif edit.kind is EditKind.TODO and not isinstance(updated, cst.RemovalSentinel):
                updated = add_todo(updated, edit.text)
        if before or after:
            middle = [] if isinstance(updated, cst.RemovalSentinel) else (
                list(updated.nodes) if isinstance(updated, cst.FlattenSentinel) else [updated])
            return cst.FlattenSentinel(before + middle + after)
        return updated

    def sequence(self, parent: cst.CSTNode, name: str, values):
        # entries: (originals covered, rewritten nodes); wraps merge runs of entries.
        entries = []
        for child in values:
            new = self.node(child) if self.touched(child) else child
            if isinstance(new, cst.RemovalSentinel):
                nodes = []
            elif isinstance(new, cst.FlattenSentinel):
                nodes = list(new.nodes)
            else:
                nodes = [new]
            edits = self.edits.get(child, ())
            before = sum(len(e.statements) for e in edits if e.kind is EditKind.INSERT_BEFORE)
            after = sum(len(e.statements) for e in edits if e.kind is EditKind.INSERT_AFTER)
            before = min(before, len(nodes))
            entries.append(({child}, nodes, before, min(after, len(nodes) - before)))
        if parent in self.wraps and name == "body":
            entries = _apply_wraps(entries, self.wraps[parent], values)
        out = [n for _, nodes, _, _ in entries for n in nodes]
        if values and out and hasattr(values[-1], "comma") and values[-1].comma is cst.MaybeSentinel.DEFAULT:
            if out[-1].comma is not cst.MaybeSentinel.DEFAULT:
                out[-1] = out[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        if not out:
            if isinstance(parent, cst.SimpleStatementLine):
                return cst.RemovalSentinel.REMOVE  # the whole line goes
            if isinstance(parent, cst.IndentedBlock):
                return [cst.SimpleStatementLine([cst.Pass()])]
            if isinstance(parent, cst.SimpleStatementSuite):
                return [cst.Pass()]
        return type(values)(out) if isinstance(values, tuple) else out


def _apply_wraps(entries, wraps: List[Edit], values):
    """Merge each wrapped run of entries into one statement, shortest runs first. Statements
    other rules insert before the run's first statement (moving its inputs to the device) stay
    before the new block, and those inserted after its last statement (`tm.cleanup()` at the end
    of a script, a barrier after a save) after it: a wrap takes the statements it was given, not
    what others add around them."""
    index = {child: i for i, child in enumerate(values)}
    ordered = sorted(
        (w for w in wraps if w.target in index and (w.end or w.target) in index),
        key=lambda w: index[w.end or w.target] - index[w.target],
    )
    for w in ordered:
        first = next(i for i, (orig, _, _, _) in enumerate(entries) if w.target in orig)
        last = next(i for i, (orig, _, _, _) in enumerate(entries) if (w.end or w.target) in orig)
        if last < first:
            continue
        covered = set().union(*(orig for orig, _, _, _ in entries[first:last + 1]))
        body = [n for _, nodes, _, _ in entries[first:last + 1] for n in nodes]
        kept, trailing = entries[first][2], entries[last][3]
        outside, body = body[:kept], body[kept:]
        after, body = (body[len(body) - trailing:], body[:len(body) - trailing]) if trailing else ([], body)
        if not body:
            continue
        lead = getattr(body[0], "leading_lines", ())
        if lead:
            body[0] = body[0].with_changes(leading_lines=[])
        wrapped = w.fn(body)  # one statement, or several (a FlattenSentinel)
        nodes = list(wrapped.nodes) if isinstance(wrapped, cst.FlattenSentinel) else [wrapped]
        if lead and hasattr(nodes[0], "leading_lines"):
            nodes[0] = nodes[0].with_changes(leading_lines=[*lead, *nodes[0].leading_lines])
        entries[first:last + 1] = [(covered, outside + nodes + after, len(outside), len(after))]
    return entries


def add_todo(stmt: cst.CSTNode, text: str):
    """Put `# TODO(torchmigrate): text` above a statement, once."""
    lines = getattr(stmt, "leading_lines", None)
    if lines is None:
        return stmt
    comment = TODO_PREFIX + text
    code = text.split(" ", 1)[0]
    for line in lines:
        if line.comment is not None and line.comment.value.startswith(TODO_PREFIX + code):
            return stmt
    return stmt.with_changes(leading_lines=[*lines, cst.EmptyLine(comment=cst.Comment(comment))])


# --- imports ------------------------------------------------------------------------------

def _missing_imports(specs: Iterable[Import], table: ImportTable) -> List[Import]:
    out: List[Import] = []
    for spec in specs:
        if spec in out:
            continue
        if spec.name is None:
            local = spec.asname or spec.module.split(".")[0]
            bound = spec.module if spec.asname else local
        else:
            local = spec.asname or spec.name
            bound = f"{spec.module}.{spec.name}"
        if table.names.get(local) == bound or table.names.get(local) == bound.replace("torchmigrate_runtime", "torchmigrate.runtime"):
            continue
        out.append(spec)
    return out


def _import_statement(spec: Import) -> cst.SimpleStatementLine:
    asname = f" as {spec.asname}" if spec.asname else ""
    if spec.name is None:
        return cst.parse_statement(f"import {spec.module}{asname}\n")
    return cst.parse_statement(f"from {spec.module} import {spec.name}{asname}\n")


def _prepend(stmts):
    """The imports of a module that has none, set off from its code as a person would: one
    blank line before the code, two before its first def or class."""
    def fn(module: cst.Module) -> cst.Module:
        body = list(module.body)
        for i, stmt in enumerate(body):
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                body[i] = _blank_lines_before(stmt, 2)
                break
        if body:
            body[0] = _blank_lines_before(body[0], 1)
        return module.with_changes(body=[*stmts, *body])
    return fn


def _blank_lines_before(stmt, want: int):
    blank = 0
    for line in stmt.leading_lines:
        if line.comment is not None:
            break
        blank += 1
    if blank >= want:
        return stmt
    return stmt.with_changes(leading_lines=[cst.EmptyLine()] * (want - blank) + list(stmt.leading_lines))

"""Findings and edits: the plain data that rules produce and the engine consumes.

Rules never touch files or the tree directly. They describe what is wrong (a Finding) and,
optionally, how to change it (Edits attached to the finding). One applier turns the accepted
edits into a new module, so every command (lint, --fix, ddp, amp, --dry-run) shares one path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple, Union

import libcst as cst

from torchmigrate.options import Safety


class EditKind(str, enum.Enum):
    REPLACE = "replace"
    INSERT_BEFORE = "insert_before"
    INSERT_AFTER = "insert_after"
    WRAP = "wrap"
    TODO = "todo"


Replacement = Union[cst.CSTNode, cst.RemovalSentinel, cst.FlattenSentinel]


@dataclass(frozen=True)
class Edit:
    """One change to one node of the original tree.

    `REPLACE` edits carry a function that receives the node *after* its children were
    rewritten, so edits on nested nodes compose (an outer rewrite keeps inner fixes).
    Insertions carry statements to put before/after a statement of the original tree.
    `WRAP` edits turn the run of sibling statements from `target` to `end` into one compound
    statement built by `fn` from the rewritten statements (e.g. a `with autocast():` block);
    nested or equal runs compose, innermost first.
    """

    kind: EditKind
    target: cst.CSTNode
    fn: Optional[Callable] = None
    statements: Tuple[cst.BaseStatement, ...] = ()
    text: str = ""
    end: Optional[cst.CSTNode] = None


def replace(target: cst.CSTNode, fn: Callable[[cst.CSTNode], Replacement]) -> Edit:
    return Edit(EditKind.REPLACE, target, fn=fn)


def replace_with(target: cst.CSTNode, new: Replacement) -> Edit:
    return Edit(EditKind.REPLACE, target, fn=lambda _node: new)


def remove(target: cst.CSTNode) -> Edit:
    return Edit(EditKind.REPLACE, target, fn=lambda _node: cst.RemovalSentinel.REMOVE)


def wrap(first: cst.CSTNode, last: cst.CSTNode,
         fn: Callable[[Sequence[cst.BaseStatement]], cst.BaseStatement]) -> Edit:
    """Wrap sibling statements `first`..`last` (inclusive) into `fn(rewritten statements)`."""
    return Edit(EditKind.WRAP, first, fn=fn, end=last)


def insert_before(target: cst.CSTNode, statements: Sequence[cst.BaseStatement]) -> Edit:
    return Edit(EditKind.INSERT_BEFORE, target, statements=tuple(statements))


def insert_after(target: cst.CSTNode, statements: Sequence[cst.BaseStatement]) -> Edit:
    return Edit(EditKind.INSERT_AFTER, target, statements=tuple(statements))


@dataclass(frozen=True)
class Import:
    """An import a fix needs: `import module as asname` or `from module import name as asname`."""

    module: str
    name: Optional[str] = None
    asname: Optional[str] = None


@dataclass
class Finding:
    """A rule's report about one node. Positions are filled in lazily by the engine."""

    code: str
    message: str
    node: cst.CSTNode
    safety: Safety
    edits: Tuple[Edit, ...] = ()
    imports: Tuple[Import, ...] = ()
    line: int = 0
    col: int = 0
    applied: bool = False
    suppressed: bool = False
    todo: bool = True  # leave an inline TODO when a migration cannot fix it
    # A statement that carries the inline TODO when a migration cannot fix this finding.
    statement: Optional[cst.CSTNode] = field(default=None, repr=False)
    # The fix, not applied by this run, as text edits (`process_source(..., fix_edits=True)`).
    fix: Optional[tuple] = None
    # Advice, not a defect: the program is correct either way (a performance hint, a note on
    # numerics, what the migration chose and what it costs). Listed as a note; never a TODO,
    # never counted as needing attention, never changes the exit status (SARIF's level "note").
    advice: bool = False

    @property
    def fixable(self) -> bool:
        return bool(self.edits) and self.safety is not Safety.MANUAL

"""The syntax layer: LibCST trees read and written fast, with no knowledge of training code.

`walk` (the one read-only traversal, its parent map and node index), `imports` (names resolved
from the module's own import statements), `nodes` (small helpers to build and inspect nodes),
`codegen` (fast code generation), `layout` and `positions` (where statements and reported nodes
lie in the source, without generating the whole module). The program model, the rules and the
engine build on it.

Kept empty: importing a submodule must not import the others (LibCST costs a third of a second).
"""

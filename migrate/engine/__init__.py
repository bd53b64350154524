"""The engine: runs the rules over each file or program and applies their edits.

`process` (one source in, findings and new source out: parse once, run the enabled rules in one
walk, apply), `apply` (the one applier of accepted edits), `suppress` (inline `# torchmigrate:`
suppressions), `textedits` (a fix as text replacements), `runner` (read, process, then diff,
check or write every file, in worker processes with `-j N`), `files` (reading and the change
set: every changed file written, or none), `outcome` (what one file produced, as plain records)
and `cache` (the lint cache).

Kept empty: the CLI and a warm `lint` import `outcome`, `runner` and `cache` without LibCST,
which only `process` and `apply` import.
"""

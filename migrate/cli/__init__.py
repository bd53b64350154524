"""The command line: click commands (`commands`, the `torchmigrate` console script) and what
only they need: which files a command works on (`inputs`, `discover`, `ignore`), the settings of
each (`config`, `settings`), the rule catalogue (`catalogue`), what is printed (`formats` for
lint, `report` for ddp/amp, `diff`, `explain`) and `torchmigrate verify` (`verify`, its checks
`verify_checks` and the probe `verify_probe` that torchrun's workers run).

Kept empty: the CLI never imports torch (only `verify_probe`, in the child processes, does),
and a warm `lint` never imports LibCST.
"""

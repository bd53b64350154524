"""torchmigrate: rewrite single-GPU PyTorch training scripts for torchrun + DDP + AMP.

A run goes engine -> program model -> rules -> apply, and the packages say so: `cli` (the
commands), `engine` (rules run over each module, edits applied, files written), `program` (the
facts), `torchmigrate.rules` and `syntax` (the LibCST layer all of them read trees with). What
every layer shares stays here: the rule API (`rule`, `finding`), `options`, `errors` and
`analysis`. None of it imports torch (except the probe `cli.verify_probe`, which only
torchrun's workers under `torchmigrate verify` run); `torchmigrate.runtime` is the part that
migrated scripts import.
"""

__version__ = "0.1.0"

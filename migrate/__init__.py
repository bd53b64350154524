"""torchmigrate: rewrite single-GPU PyTorch training scripts for torchrun + DDP + AMP.

The CLI and engine live here and never import torch; `torchmigrate.runtime` is the only
part that does, and only migrated scripts import it.
"""

__version__ = "0.1.0"

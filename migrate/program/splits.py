"""Which split of the data a name speaks of: training or evaluation (`train_loader`, `valset`,
`test_dl`, `get_val_loader`). Plain text rules, no LibCST: the loader facts of one module and the
cross-module facts (from CPython's `ast`) both read names this way.
"""

from __future__ import annotations

import re
from typing import Iterable, List, Optional

_EVAL_WORDS = (r"val|valid|validation|validate|test|tests|testing|eval|evaluate|evaluation|dev|holdout|heldout"
               r"|pred|predict|prediction|infer|inference")
_TRAIN_WORDS = r"train|training|trainval|trn"
_SUFFIX = r"(?:loader|loaders|set|sets|ds|data|dataset|datasets|dl|iter|gen|batches|split)?"
_EVAL_RE = re.compile(rf"^(?:{_EVAL_WORDS}){_SUFFIX}$")
_TRAIN_RE = re.compile(rf"^(?:{_TRAIN_WORDS}){_SUFFIX}$")


def words(text: str) -> List[str]:
    """Lower-case words of an identifier or string: `trainLoader_2` -> ['train', 'loader']."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text)
    return [w for w in re.split(r"[^a-z]+", text.lower()) if w]


def verdict(found: Iterable[str]) -> Optional[str]:
    """"train" when a word says training, else "eval" when one says evaluation, else None."""
    found = list(found)
    if any(_TRAIN_RE.match(w) for w in found):
        return "train"
    if any(_EVAL_RE.match(w) for w in found):
        return "eval"
    return None


def named_like_loader(name: str) -> bool:
    """A dotted name that reads as a data loader: `val_loader`, `self.dl`, `train_dl`."""
    last = name.rsplit(".", 1)[-1].lower()
    return "loader" in last or last in ("dl", "dls") or last.endswith("_dl") or last.startswith("dl_")

"""TM505: datasets downloaded, and caches built, by every rank at once.

The decisions (which statements go under `main_process_first`) are the family's plan
(`plan.py`), because TM501 and TM504 ask them too.
"""

from __future__ import annotations

from typing import Dict

import libcst as cst

from torchmigrate.finding import Safety, replace, wrap
from torchmigrate.program.writes import asks_exists
from torchmigrate.syntax.nodes import code
from torchmigrate.rule import Context, Example, Rule
from torchmigrate.rules.checkpoint.plan import plan


class MainProcessFirst(Rule):
    """
    ## What it does
    Puts what every rank would fetch or build into the same files at the same time under
    `with tm.main_process_first():`, so the main process does it first and the other ranks
    then find it complete:
    - dataset downloads: `torchvision.datasets.X(..., download=True)` (and torchaudio's),
      torchtext datasets, `datasets.load_dataset(...)` and the `.map`/`.filter` calls on what it
      returned (they write cache files), `urlretrieve`, `snapshot_download`, `hf_hub_download`,
      torchvision's `download_url`, `gdown.download`, `nltk.download`;
    - caches built on first use: an `if` that tests whether a file exists
      (`os.path.exists`, `Path(...).exists()`, ...) and downloads or writes it (a preprocessed
      dataset, a vocabulary saved with `torch.save`, `pickle.dump`, `.save(...)`), with the
      statements after it when the `if` returns the cached copy early: the test and the write
      together, so the others test again after the main process wrote the file, and load it;
    - first-run builders: an `if` that tests whether a file or folder exists and calls the
      program's own code that writes files (`if not os.path.isdir(out): preprocess(raw, out)`,
      in any module, from the program's effects) goes under the block whole, never with guards
      inside it: a half-written output folder would break every later run.

    Adjacent statements share one block. Already ordered code is left alone: under
    `main_process_first` (the runtime's, Accelerate's or Transformers'), under a rank guard, or
    after the hand-written `if rank != 0: barrier()` idiom. A write under an existence test in a
    loop, or of a state dict, is a checkpoint (TM501's), not a cache, and so is a block that trains
    (a backward pass, here or in a function it calls) when its saved result is missing: rank 0
    would train alone while the others wait, and hang at its first DDP step. A statement that also runs a
    collective, or a function called under a rank guard in this file, is reported instead (a
    barrier there would hang).

    ## Why is this bad?
    Under torchrun every rank runs the same code: eight processes download the same archive
    into the same folder and extract it over each other, or find a cache missing, build it
    and write it at once; a rank that reads while another writes gets a truncated file
    (`EOFError`, `BadZipFile`, a corrupt pickle) in some runs only. `tm.main_process_first()` is
    Accelerate's `main_process_first()` and Transformers' `training_args.main_process_first()`:
    rank 0 runs the block while the others wait at a barrier, then they run it. One process
    or no process group: the block just runs.
    """

    code = "TM505"
    name = "main-process-first"
    summary = "Download datasets and build caches on the main process first, then on the other ranks"
    safety = Safety.SAFE
    commands = frozenset({"ddp", "lint"})
    examples = (
        Example(
            before="""
            import torchvision
            train_set = torchvision.datasets.CIFAR10("data", train=True, download=True)
            test_set = torchvision.datasets.CIFAR10("data", train=False, download=True)
            """,
            after="""
            import torchvision
            import torchmigrate.runtime as tm
            with tm.main_process_first():
                train_set = torchvision.datasets.CIFAR10("data", train=True, download=True)
                test_set = torchvision.datasets.CIFAR10("data", train=False, download=True)
            """,
        ),
        Example(
            before="""
            import os
            import torch
            def vocabulary(texts, path):
                if not os.path.exists(path):
                    torch.save(sorted({w for t in texts for w in t.split()}), path)
                return torch.load(path)
            """,
            after="""
            import os
            import torch
            import torchmigrate.runtime as tm
            def vocabulary(texts, path):
                with tm.main_process_first():
                    if not os.path.exists(path):
                        torch.save(sorted({w for t in texts for w in t.split()}), path)
                return torch.load(path)
            """,
        ),
    )

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        ctx.facts["tm505_on"] = True  # TM501 asks the plan only when this rule runs

    def leave_Module(self, node: cst.Module) -> None:
        ctx = self.ctx
        found = plan(ctx)
        for target, why in found.manual:
            self.report(target, why)
        tm = ctx.tm
        for span in found.spans:
            if span.cache:
                message = (f"every rank finds this file missing at once, builds it and writes it (a rank can read "
                           f"another's half-written file); build it on the main process first with "
                           f"`{tm}.main_process_first()`, the other ranks then find it and load it")
            else:
                message = (f"every rank downloads this at once into the same place (a rank can read another's "
                           f"half-written file); download on the main process first with `{tm}.main_process_first()`")
            edits = [wrap(span.first, span.last, _main_first(tm))]
            forced = _forced_rebuilds(ctx, span.first) if span.cache else []
            if forced:
                # `if rebuild_cache or not exists(p):` the other ranks, after the main process,
                # would rebuild (delete) the cache it just built: the flag holds on rank 0 alone
                message += (f"; {' and '.join(f'`{code(f)}`' for f in forced)} forces a rebuild, which only the main "
                            "process does (the others then find the cache built)")
                edits += [replace(f, lambda n: cst.BooleanOperation(
                    left=n.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                    if isinstance(n, (cst.BooleanOperation, cst.IfExp)) else n,
                    operator=cst.And(), right=cst.parse_expression(f"{tm}.goes_first()"),
                    lpar=[cst.LeftParen()], rpar=[cst.RightParen()])) for f in forced]
            self.report(span.report, message, imports=[ctx.runtime_import()], edits=edits)


def _forced_rebuilds(ctx, first: cst.CSTNode) -> list:
    """The operands of `if force or not os.path.exists(p):` other than the existence tests: what
    makes the block run where the file exists."""
    if not isinstance(first, cst.If) or not isinstance(first.test, cst.BooleanOperation):
        return []
    operands, stack = [], [first.test]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.BooleanOperation) and isinstance(node.operator, cst.Or) and not node.lpar:
            stack += [node.right, node.left]
        else:
            operands.append(node)
    if len(operands) < 2 or not any(asks_exists(ctx, o) for o in operands):
        return []
    return [o for o in operands if not asks_exists(ctx, o)]


_HEADER: Dict[str, cst.With] = {}


def _main_first(tm: str):
    """Builds `with tm.main_process_first():` around the wrapped statements."""
    header = _HEADER.get(tm)
    if header is None:
        header = _HEADER[tm] = cst.parse_statement(f"with {tm}.main_process_first():\n    pass\n")  # type: ignore

    def build(statements):
        return header.with_changes(body=cst.IndentedBlock(body=list(statements)))

    return build

"""Evaluation loaders are sharded only where every value computed from them is proven reduced:
the decision in several styles, the report's note, and the switch (`--shard-eval`, the
`shard-eval` setting, `--no-shard-eval`)."""

from __future__ import annotations

import textwrap

import pytest

from conftest import migrate
from torchmigrate.engine.process import process_source
from torchmigrate.rule import Options
from torchmigrate.rules import select

RULES = select(command="ddp")

HEAD = """
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = torch.nn.CrossEntropyLoss()
    train_loader = DataLoader(train_set, batch_size=32, shuffle=True)
"""

# (style, code after HEAD, whether the evaluation loader is proven, a word of the note's reason)
STYLES = [
    ("counts in a trainer class", """
        class Trainer:
            def __init__(self):
                self.val_loader = DataLoader(val_set, batch_size=64)

            @torch.no_grad()
            def validate(self):
                hits, seen = 0, 0
                for images, labels in self.val_loader:
                    hits += (model(images).argmax(1) == labels).sum().item()
                    seen += labels.numel()
                return 100.0 * hits / max(seen, 1)
    """, True, ""),
    ("loss summed over the dataset", """
        test_loader = DataLoader(test_set, batch_size=64)
        def test():
            total = 0.0
            with torch.inference_mode():
                for x, y in test_loader:
                    total += criterion(model(x), y).item() * len(y)
            return total / len(test_loader.dataset)
    """, True, ""),
    ("counts over a parameter not named like a loader", """
        holdout_loader = DataLoader(holdout_set, batch_size=64)
        def score(net, data):
            right = n = 0
            with torch.no_grad():
                for inputs, targets in data:
                    right += (net(inputs).argmax(1) == targets).sum().item()
                    n += len(targets)
            return right / n
        print(score(model, holdout_loader))
    """, True, ""),
    ("losses extended, then averaged", """
        val_loader = DataLoader(val_set, batch_size=64)
        @torch.no_grad()
        def validate():
            losses = []
            for x, y in val_loader:
                losses.extend([criterion(model(x), y).item()])
            return np.mean(losses)
    """, False, "`losses.extend(...)`"),
    ("an AverageMeter", """
        val_loader = DataLoader(val_set, batch_size=64)
        @torch.no_grad()
        def validate():
            meter = AverageMeter()
            for x, y in val_loader:
                meter.update(criterion(model(x), y).item(), x.size(0))
            return meter.avg
    """, False, "`meter.update(...)`"),
    ("predict() compared with the whole label array", """
        test_loader = DataLoader(test_set, batch_size=64)
        def predict(loader):
            outputs = []
            with torch.no_grad():
                for x, _ in loader:
                    outputs.append(model(x).argmax(1))
            return torch.cat(outputs)
        accuracy = (predict(test_loader) == test_set.labels).float().mean()
    """, False, "`outputs` collects per-batch values"),
    ("early stopping on a per-batch loss", """
        val_loader = DataLoader(val_set, batch_size=64)
        with torch.no_grad():
            for x, y in val_loader:
                if criterion(model(x), y).item() > 5:
                    break
    """, False, "may stop early"),
    ("the last batch's output kept", """
        val_loader = DataLoader(val_set, batch_size=64)
        with torch.no_grad():
            for x, y in val_loader:
                out = model(x)
        print(out.shape)
    """, False, "`out` carries per-batch values"),
    ("a tensor histogram added to", """
        val_loader = DataLoader(val_set, batch_size=64)
        counts = torch.zeros(10)
        with torch.no_grad():
            for x, y in val_loader:
                counts += torch.bincount(model(x).argmax(1), minlength=10)
        print(counts)
    """, True, ""),
]


def run(body: str, **options):
    source = textwrap.dedent(HEAD).lstrip("\n") + textwrap.dedent(body)
    return process_source(source, "train.py", Options(mode="ddp", **options), RULES)


@pytest.mark.parametrize("style,body,proven,reason", STYLES, ids=[s[0] for s in STYLES])
def test_evaluation_is_sharded_only_where_every_value_is_proven_reduced(style, body, proven, reason):
    result = run(body)
    notes = [f for f in result.findings if f.advice]
    assert ("eval_sampler(" in result.new_source) == proven, result.new_source
    if proven:
        assert not notes and "tm.all_reduce(" in result.new_source
        return
    assert len(notes) == 1 and notes[0].code == "TM203" and reason in notes[0].message, notes
    assert "kept whole: every rank evaluates the whole set" in notes[0].message
    # nothing is reduced or gathered again over a loader every rank iterates in full
    for call in ("all_reduce(", "gather_list(", "reduce_meter(", "TM702", "TM701"):
        assert call not in result.new_source


@pytest.mark.parametrize("style,body,proven,reason", [s for s in STYLES if not s[2]], ids=[s[0] for s in STYLES
                                                                                          if not s[2]])
def test_shard_eval_shards_anyway_with_a_todo_that_names_the_value(style, body, proven, reason):
    result = run(body, shard_eval=True)
    assert "eval_sampler(" in result.new_source or "tm.sampler(val_set, shuffle=False)" in result.new_source
    todo = [line for line in result.new_source.splitlines() if "TODO(torchmigrate): TM203" in line]
    assert len(todo) == 1 and reason in todo[0] and "--shard-eval" in todo[0]
    assert migrate(result.new_source, Options(mode="ddp", shard_eval=True), RULES) == result.new_source


PROGRAM = """
import torch
from torch.utils.data import DataLoader

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = DataLoader(train_set, batch_size=8, shuffle=True)
val_loader = DataLoader(val_set, batch_size=8)
for epoch in range(2):
    for x, y in train_loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        preds = [model(x).argmax(1) for x, _ in val_loader]
"""


def _write(tmp_path, settings: str = ""):
    (tmp_path / "train.py").write_text(PROGRAM)
    if settings:
        (tmp_path / "pyproject.toml").write_text(f"[tool.torchmigrate]\n{settings}\n")
    return tmp_path / "train.py"


def test_the_report_says_in_one_note_that_evaluation_is_kept_whole_and_what_it_costs(tmp_path, run_cli):
    path = _write(tmp_path)
    result = run_cli("ddp", path)
    notes = result.output.split("Notes:\n", 1)[1].splitlines()
    assert "TM203 `val_loader` kept whole: every rank evaluates the whole set" in notes[0]
    assert "the cost: each rank does the whole evaluation's work" in notes[0] and "--shard-eval" in notes[0]
    attention = result.output.split("Needs attention:", 1)[-1].split("Notes:", 1)[0]
    assert "TM203" not in attention, "a note asks for nothing"
    assert "eval_sampler" not in path.read_text() and "TODO(torchmigrate): TM203" not in path.read_text()


@pytest.mark.parametrize("how", ["--shard-eval", "shard-eval = true", "shard_eval = true"])
def test_shard_eval_from_the_command_line_or_the_settings(tmp_path, run_cli, how):
    path = _write(tmp_path, how if "=" in how else "")
    result = run_cli("ddp", *([how] if how.startswith("--") else []), path)
    assert result.exit_code == 1, result.output
    text = path.read_text()
    assert "sampler=tm.eval_sampler(val_set)" in text and "TODO(torchmigrate): TM203 sharded by --shard-eval" in text


def test_no_shard_eval_overrides_the_setting(tmp_path, run_cli):
    path = _write(tmp_path, "shard-eval = true")
    run_cli("ddp", "--no-shard-eval", path)
    assert "eval_sampler" not in path.read_text()


def test_a_shard_eval_setting_that_is_not_a_boolean_is_a_usage_error(tmp_path, run_cli):
    path = _write(tmp_path, 'shard-eval = "yes"')
    result = run_cli("ddp", "--dry-run", path)
    assert result.exit_code == 2 and "shard-eval must be true or false" in result.stderr

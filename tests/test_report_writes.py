"""The report's claim about files ("done: writes, saves and logs on rank 0 only") is computed from
the effects of the migrated program (`program.effects`), never from which rules fired: a write
left to every rank anywhere in the program, in a module the rules did not change or behind a
helper, turns it into a NOT DONE line naming `file:line`."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

TRAIN = """
    import os
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import notes

    def main(out):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 2), torch.randn(8, 1)), batch_size=4, shuffle=True)
        for epoch in range(2):
            for x, y in loader:
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            with open(os.path.join(out, "history.txt"), "a") as f:
                f.write(f"{epoch} {loss.item()}\\n")
            notes.remember(out, epoch)

    if __name__ == "__main__":
        main(".")
"""


def write(root: Path, files: dict) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip("\n"))


def test_a_write_left_in_a_module_the_rules_did_not_change_is_named(tmp_path, run_cli):
    # the user told the rules to leave notes.py's write alone: it still runs on every rank
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import os
        def remember(out, epoch):
            with open(os.path.join(out, "notes.txt"), "a") as f:  # torchmigrate: ignore[TM504]
                f.write(str(epoch))
        """})
    result = run_cli("ddp", "--dry-run", tmp_path / "train.py")
    out = result.output
    assert "done: writes, saves and logs on rank 0 only" not in out, out
    assert "partly done: some writes, saves and logs moved to rank 0" in out, out
    assert "NOT DONE: files still written by every rank" in out and "notes.py:3 (open" in out, out
    assert "NOT DONE under torchrun" in out.splitlines()[-1]
    assert result.exit_code == 1


def test_writes_left_as_todos_make_the_claim_partial(tmp_path, run_cli):
    """A write the rules could only report (an HDF5 file kept open and written through methods a
    stand-in cannot take): the summary says "partly done" and points at that finding, not
    "done" (a deraining program's preprocessing, round 16)."""
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import os
        import h5py
        def remember(out, epoch):
            h5f = h5py.File(os.path.join(out, "notes.h5"), "w")
            h5f.create_dataset(str(epoch), data=[epoch])
            h5f.close()
        """})
    result = run_cli("ddp", "--dry-run", tmp_path / "train.py")
    out = result.output
    assert "done: writes, saves and logs on rank 0 only" not in out, out
    assert "partly done: some writes, saves and logs moved to rank 0" in out, out
    assert "TM504" in out, out


def test_the_claim_holds_when_every_write_runs_on_rank_0(tmp_path, run_cli):
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import os
        import torch
        def remember(out, epoch):
            with open(os.path.join(out, "notes.txt"), "a") as f:
                f.write(str(epoch))
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    assert "done: writes, saves and logs on rank 0 only: " in out, out
    assert "written by every rank" not in out and "NOT DONE" not in out, out


def test_writes_guarded_by_the_user_at_the_call_count_as_rank_0(tmp_path, run_cli):
    train = TRAIN.replace("            notes.remember(out, epoch)",
                          "            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:\n"
                          "                notes.remember(out, epoch)")
    write(tmp_path, {"train.py": train, "notes.py": """
        def remember(out, epoch):
            with open(out + "/notes.txt", "a") as f:
                f.write(str(epoch))
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    assert "written by every rank" not in out and "done: writes, saves and logs on rank 0 only" in out, out


def test_the_json_report_lists_the_writes_left(tmp_path, run_cli):
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import json
        def remember(out, epoch):
            json.dump({"epoch": epoch}, open(out + "/notes.json", "w"))  # torchmigrate: ignore[TM504]
        """})
    report = tmp_path / "report.json"
    run_cli("ddp", "--dry-run", "--report", report, tmp_path / "train.py")
    data = json.loads(report.read_text())
    assert any("files still written by every rank" in line and "notes.py:3 (open out + '/notes.json')" in line for line in data["not_done"])


def test_an_evaluation_loader_kept_whole_is_not_reported_as_sharded(tmp_path, run_cli):
    # the kept-whole loader draws alike on every rank (`tm.same_draws`, an edit of TM203), which shards nothing
    write(tmp_path, {"train.py": """
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        def main():
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            data = TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
            loader = DataLoader(data, batch_size=4, shuffle=True)
            val_loader = DataLoader(data, batch_size=4, shuffle=True)
            best = None
            for epoch in range(2):
                for x, y in loader:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                outs = []
                with torch.no_grad():
                    for x, y in val_loader:
                        outs.append(model(x))
                score = float(torch.cat(outs).mean())
                if best is None or score < best:
                    best = score

        if __name__ == "__main__":
            main()
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    assert "val_loader = DataLoader(data, batch_size=4, shuffle=True)\n+    tm.same_draws(val_loader)" in out, out
    assert "evaluation loaders sharded" not in out, out
    assert "done: training data sharded" in out, out


def test_a_shell_command_that_copies_files_counts_as_a_write(tmp_path, run_cli):
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import os
        def remember(out, epoch):
            os.system("cp train.py " + out + "/train.py.backup")  # torchmigrate: ignore[TM504]
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    assert "NOT DONE: files still written by every rank" in out and "notes.py:3 (os.system" in out, out


def test_not_done_lines_point_to_findings_that_exist(tmp_path, run_cli):
    """A NOT DONE line names where the findings are, or says that no finding could (it pointed to
    "the TM201 findings" when TM201 had emitted none)."""
    write(tmp_path, {"train.py": """
        import torch
        from engine import fit

        def build(params):
            return torch.optim.Adam(params)

        model = torch.nn.Linear(2, 1)
        fit(model, build(model.parameters()))
        """, "engine.py": """
        import torch

        def fit(model, optimizer):
            for step in range(3):
                x = torch.randn(4, 2)
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    lines = [line for line in out.splitlines() if line.strip().startswith("NOT DONE:")]
    assert lines, out
    for line in lines:
        assert "see the TM" not in line, line
        assert "(see TM" in line or "no finding says where" in line, line


def test_a_program_that_trains_where_the_tool_did_not_read_is_not_done(tmp_path, run_cli):
    """The entry hands its model to a trainer of a package the tool does not reach (two folders
    up, no project marker: the layout of a repository's examples/ folder run as a script with the
    package installed): the report must not say the program is done with "0 findings"."""
    write(tmp_path, {"lib/recsys/trainer.py": """
        def fit(model, optimizer, data):
            for x, y in data:
                loss = ((model(x) - y) ** 2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """, "lib/recsys/__init__.py": "", "examples/ranking/run.py": """
        import torch
        from recsys.trainer import fit

        model = torch.nn.Linear(2, 1)
        fit(model, torch.optim.Adam(model.parameters()), [(torch.randn(4, 2), torch.randn(4, 1))])
        print("done")
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "examples" / "ranking" / "run.py").output
    assert "NOT DONE: no training step" in out and "did not reach" in out, out
    assert "NOT DONE under torchrun" in out.splitlines()[-1], out
    # the same program with the package beside the entry: followed, trained there, not this line
    write(tmp_path, {"examples/ranking/recsys/__init__.py": "",
                     "examples/ranking/recsys/trainer.py": (tmp_path / "lib/recsys/trainer.py").read_text()})
    out = run_cli("ddp", "--dry-run", tmp_path / "examples" / "ranking" / "run.py").output
    assert "no training step" not in out and "done: models wrapped in DDP" in out, out


def test_the_main_block_of_an_imported_module_is_not_the_programs(tmp_path, run_cli):
    """`notes.py` ends with a preprocessing script under `if __name__ == "__main__":`, which never
    runs when train.py imports it: its writes are not files the program writes on every rank.
    Run as the entry, the same block is the program's."""
    write(tmp_path, {"train.py": TRAIN, "notes.py": """
        import os
        def remember(out, epoch):
            pass

        if __name__ == "__main__":
            with open("vocabulary.txt", "w") as f:  # torchmigrate: ignore[TM504]
                f.write("a b c")
        """})
    out = run_cli("ddp", "--dry-run", tmp_path / "train.py").output
    assert "NOT DONE: files still written by every rank" not in out and "vocabulary.txt" not in out, out
    alone = run_cli("ddp", "--dry-run", tmp_path / "notes.py").output
    assert "NOT DONE: files still written by every rank" in alone and "(open 'vocabulary.txt')" in alone, alone

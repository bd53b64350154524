"""Engine pieces the rules rely on: import placement, name resolution, edit composition."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from torchmigrate.engine.apply import apply_edits
from torchmigrate.finding import Import, insert_before, remove, replace, wrap
from torchmigrate.syntax.imports import ImportTable, leading_import_anchor
from torchmigrate.syntax.nodes import expr, with_block
from torchmigrate.syntax.walk import walk

TM = Import("torchmigrate.runtime", asname="tm")


def _apply(src, make_edits, imports=()):
    module = cst.parse_module(src)
    parents = {}
    walk(module, {}, {}, parents)
    return apply_edits(module, make_edits(module), parents, imports).code


def test_runtime_import_goes_into_the_first_import_block():
    src = "import torch\nloader = make(tm)\nimport numpy as np\n"
    out = _apply(src, lambda m: [], [TM])
    assert out == "import torch\nimport torchmigrate.runtime as tm\nloader = make(tm)\nimport numpy as np\n"


def test_runtime_import_after_docstring_and_future():
    src = '"""Doc."""\nfrom __future__ import annotations\nx = 1\n'
    out = _apply(src, lambda m: [], [TM])
    assert out == '"""Doc."""\nfrom __future__ import annotations\nimport torchmigrate.runtime as tm\nx = 1\n'
    assert leading_import_anchor(cst.parse_module('"""Doc."""\nx = 1\n')) is not None


def test_existing_import_is_not_duplicated():
    src = "import torchmigrate.runtime as tm\nx = 1\n"
    assert _apply(src, lambda m: [], [TM]) == src


def test_insertions_survive_when_their_anchor_line_is_removed():
    src = "import os\nfrom apex import amp\nx = 1\n"
    out = _apply(src, lambda m: [remove(m.body[1].body[0])], [TM])
    assert out == "import os\nimport torchmigrate.runtime as tm\nx = 1\n"


def test_nested_wraps_and_inner_edits_compose():
    src = "for x in loader:\n    # fwd\n    out = model(x)\n    loss = crit(out)\n    loss.backward()\n    opt.step()\n"

    def edits(m):
        body = m.body[0].body.body
        return [
            wrap(body[0], body[1], lambda b: with_block("tm.autocast()", b)),
            wrap(body[0], body[2], lambda b: with_block("tm.no_sync(model, sync=s)", b)),
            replace(body[2].body[0].value, lambda n: expr("scaler.scale(loss).backward()")),
            insert_before(body[3], [cst.parse_statement("scaler.step(opt)\n")]),
        ]

    assert _apply(src, edits) == (
        "for x in loader:\n    # fwd\n    with tm.no_sync(model, sync=s):\n        with tm.autocast():\n"
        "            out = model(x)\n            loss = crit(out)\n        scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n    opt.step()\n"
    )


def test_import_table_aliases_and_star_imports():
    table = ImportTable.from_module(cst.parse_module(
        "import torch.nn as nn\nfrom torch.cuda.amp import autocast as ac\nfrom models import *\n"
        "try:\n    from torch.utils.data import DataLoader as DL\nexcept ImportError:\n    pass\n"))
    assert table.resolve(expr("nn.DataParallel")) == "torch.nn.DataParallel"
    assert table.resolve(expr("ac")) == "torch.cuda.amp.autocast"
    assert table.resolve(expr("DL")) == "torch.utils.data.DataLoader"
    assert table.resolve(expr("torch.nn.DataParallel")) == "torch.nn.DataParallel"  # via the star import
    assert table.resolve(expr("unknown.thing")) is None
    star = ImportTable.from_module(cst.parse_module("from torch.utils.data import *\n"))
    assert star.resolve(expr("DataLoader")) == "torch.utils.data.DataLoader"
    plain = ImportTable.from_module(cst.parse_module("import os\n"))
    assert plain.resolve(expr("torch.save")) is None


def test_todo_text_is_one_line(tmp_path):
    from torchmigrate.engine.process import process_source
    from torchmigrate.finding import Safety
    from torchmigrate.rule import Options, Rule

    class Multiline(Rule):
        code = "TM999"
        name = "multiline"
        summary = "test"

        def visit_Call(self, node):
            self.report(node, "first line\nsecond line", safety=Safety.MANUAL)

    out = process_source("import torch\nf(torch)\n", "t.py", Options(mode="ddp"), [Multiline]).new_source
    assert "# TODO(torchmigrate): TM999 first line second line\nf(torch)\n" in out
    compile(out, "t.py", "exec")


def test_framework_managed_scripts_are_left_alone(run_cli, tmp_path):
    src = ("from accelerate import Accelerator\nimport torch\nfrom torch.utils.data import DataLoader\n"
           "accelerator = Accelerator()\nloader = DataLoader(ds, shuffle=True)\nprint('hi')\n"
           "torch.save(model.state_dict(), 'm.pt')\n")
    path = tmp_path / "train.py"
    path.write_text(src)
    result = run_cli("ddp", path)
    assert path.read_text() == src
    assert "uses accelerate" in result.output and result.exit_code == 1
    assert run_cli("amp", path).exit_code == 1 and path.read_text() == src


def test_files_are_processed_with_collection_paused_and_their_cycles_freed(tmp_path):
    """runner pauses the cyclic GC while it works (a speed-up of ~10%): it must restore it
    afterwards and still free each file's reference cycles (a Context and its rules refer to
    each other), so memory stays flat in the number of files."""
    import gc
    import weakref

    from torchmigrate.rule import Context, Options
    from torchmigrate.rules import select
    from torchmigrate.engine.runner import Job, run

    contexts = []
    alive_at_start = []
    real_init = Context.__init__

    def spy(self, *args, **kwargs):
        alive_at_start.append(sum(ref() is not None for ref in contexts))  # earlier files' contexts
        real_init(self, *args, **kwargs)
        contexts.append(weakref.ref(self))

    script = Path(__file__).parent.parent / "fixtures" / "scripts" / "main_function.py"
    paths = []
    for i in range(3):
        path = tmp_path / f"train_{i}.py"
        path.write_text(script.read_text())
        paths.append(path)
    job = Job(Options(mode="ddp"), tuple(r.code for r in select(command="ddp")))
    Context.__init__ = spy
    try:
        assert gc.isenabled()
        outcomes = run(paths, job)
        assert gc.isenabled()
    finally:
        Context.__init__ = real_init
    assert [o.changed for o in outcomes] == [True, True, True]
    assert alive_at_start == [0, 0, 0]


def test_parsing_skips_node_validation_only_while_libcst_parses(monkeypatch):
    """The engine turns off LibCST's node validation for the parser's own nodes and always
    turns it back on: nodes built afterwards (by rules, or by other code in this process) are
    validated, also after a file LibCST could not parse."""
    from torchmigrate.engine import process as engine

    original = cst.CSTNode.__post_init__
    seen = []
    real_parse = cst.parse_module

    def parse_module(source):
        seen.append(cst.CSTNode.__post_init__ is original)
        return real_parse(source)

    monkeypatch.setattr(cst, "parse_module", parse_module)
    engine.parse("import torch\nx = torch.zeros(1)\n")
    assert seen == [False] and cst.CSTNode.__post_init__ is original

    def broken(source):
        raise MemoryError
    monkeypatch.setattr(cst, "parse_module", broken)
    with pytest.raises(engine.InputError):
        engine.parse("import torch\n")
    assert cst.CSTNode.__post_init__ is original
    with pytest.raises(cst.CSTValidationError):  # nodes built outside the parser are validated
        cst.Name("not a name")


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).parent.parent / "fixtures" / "scripts").glob("*.py")))
def test_a_finished_files_tree_is_freed_by_reference_counting(script):
    """Rules and the facts they publish point back at the context (and loaders at their refs),
    which kept each file's tree in reference cycles for the collector to walk; `Context.close()`
    breaks them, so the tree goes as soon as the result is built, with the collector off. No
    node at all may be left for the collector: an edit whose callback is a method of the object
    holding the edit, or a closure that calls itself, is such a cycle (the runner keeps the
    collector paused and collects once per file, which is only cheap when little is left)."""
    import gc

    from torchmigrate.engine import process as engine
    from torchmigrate.rule import Options
    from torchmigrate.rules import select

    source = (Path(__file__).parent.parent / "fixtures" / "scripts" / script).read_text()
    rules = select(command="ddp")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free lands in gc.garbage
    try:
        result = engine.process_source(source, script, Options(mode="ddp"), rules)
        gc.collect()
        nodes = sorted({type(o).__name__ for o in gc.garbage if isinstance(o, cst.CSTNode)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert result.changed
    assert nodes == [], "a reference cycle kept nodes alive"


def test_a_file_alone_works_out_its_own_effects_only_when_a_rule_asks():
    """`_OwnView` fills in exactly the fields `effects.of_module` returns, on first use."""
    from torchmigrate.engine.process import _own_view
    from torchmigrate.program import effects

    source = "import torch\nimport pickle\n\ndef dump(x, p):\n    pickle.dump(x, open(p, 'wb'))\n"
    assert set(effects.of_module(source, "a.py")) == effects.OWN_FIELDS
    view = _own_view(source, "a.py")
    assert view.is_entry and len(view.__dict__["_tm_pending"][3]) == 2  # not a field they fill
    assert view.wrapped_attrs == {} and len(view.__dict__["_tm_pending"][3]) == 1
    assert view.call_writes == effects.of_module(source, "a.py")["call_writes"]
    assert not view.__dict__["_tm_pending"][3]

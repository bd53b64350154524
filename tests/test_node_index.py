"""The node index rules query instead of walking (`Context.nodes`, `within`, `named`,
`position`), checked against plain walks of the tree on the example scripts."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from torchmigrate.engine.process import run_rules
from torchmigrate.rule import Context, Options, Rule
from torchmigrate.syntax.walk import child_nodes

SCRIPTS = sorted((Path(__file__).parent.parent / "fixtures" / "scripts").glob("*.py"))
DEFS = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def preorder(node: cst.CSTNode):
    """Reference: a recursive walk in field order, as the shared walk and LibCST visit."""
    yield node
    for child in child_nodes(node):
        yield from preorder(child)


def walked(source: str) -> Context:
    return run_rules(cst.parse_module(source), "x.py", Options(mode="lint"), [])


@pytest.fixture(scope="module", params=[p.name for p in SCRIPTS])
def script(request):
    source = (Path(__file__).parent.parent / "fixtures" / "scripts" / request.param).read_text()
    return walked(source)


def test_nodes_lists_every_node_of_a_type_in_source_order(script):
    everything = list(preorder(script.module))
    for types in [(cst.Name,), (cst.Call,), (cst.Name, cst.Call), (cst.BaseCompoundStatement,), (cst.For, cst.With)]:
        assert script.nodes(*types) == [n for n in everything if isinstance(n, types)]


def test_within_equals_a_walk_of_the_subtree(script):
    for node in list(preorder(script.module))[::7]:
        assert script.within(node, cst.Name, cst.Call) == [
            n for n in preorder(node) if isinstance(n, (cst.Name, cst.Call))]


def test_within_can_leave_out_nested_definitions(script):
    for node in script.nodes(cst.FunctionDef, cst.ClassDef, cst.For, cst.If):
        expected = []
        stack = [node]
        while stack:  # the node itself is searched even when it is a def; defs under it are not
            n = stack.pop()
            if isinstance(n, cst.Call):
                expected.append(n)
            if n is not node and isinstance(n, DEFS):
                continue
            stack.extend(reversed(child_nodes(n)))
        assert script.within(node, cst.Call, skip_defs=True) == expected


def test_positions_order_nodes_and_span_subtrees(script):
    everything = list(preorder(script.module))
    assert [script.position(n) for n in everything] == list(range(len(everything)))
    for node in everything[::11]:
        inside = list(preorder(node))
        assert script.last_position(node) == script.position(inside[-1])


def test_named_finds_every_spelling(script):
    names = [n for n in preorder(script.module) if isinstance(n, cst.Name)]
    for value in {n.value for n in names}:
        assert script.named(value) == [n for n in names if n.value == value]
    assert script.named("no_such_name_here") == []


def test_nodes_built_by_rules_are_searched_not_looked_up():
    ctx = walked("import torch\nx = torch.zeros(3)\n")
    new = cst.parse_statement("y = f(g(1))\n")
    assert [cst.Module([]).code_for_node(c) for c in ctx.within(new, cst.Call)] == ["f(g(1))", "g(1)"]
    assert ctx.position(new) is None


def test_during_the_walk_queries_search_and_positions_refuse():
    """Before every node has been met the index would be incomplete: `nodes`/`within` fall
    back to searching, `position` refuses rather than answer wrongly."""
    seen = {}

    class Early(Rule):
        code = "TM999"

        def visit_Module(self, node: cst.Module) -> None:
            seen["calls"] = len(self.ctx.nodes(cst.Call))
            with pytest.raises(RuntimeError):
                self.ctx.position(node)

    run_rules(cst.parse_module("import torch\nf(g(1))\nh()\n"), "x.py", Options(mode="lint"), [Early])
    assert seen["calls"] == 3


def test_positioned_pairs_positions_with_nodes(script):
    assert script.positioned(cst.Name, cst.Call) == [
        (script.position(n), n) for n in script.nodes(cst.Name, cst.Call)]


def test_calls_to_answers_in_source_order_for_names_and_prefixes():
    from torchmigrate.analysis import calls_to

    ctx = walked(
        "import torch\nimport torch.distributed as dist\n"
        "dist.barrier()\ntorch.manual_seed(0)\ndist.init_process_group('gloo')\ntorch.manual_seed(1)\n"
        "dist.barrier()\n")
    text = lambda calls: [cst.Module([]).code_for_node(c) for c in calls]  # noqa: E731
    assert text(calls_to(ctx, "torch.manual_seed")) == ["torch.manual_seed(0)", "torch.manual_seed(1)"]
    assert text(calls_to(ctx, "torch.distributed.")) == [
        "dist.barrier()", "dist.init_process_group('gloo')", "dist.barrier()"]
    assert text(calls_to(ctx, "torch.distributed.barrier", "torch.manual_seed")) == [
        "dist.barrier()", "torch.manual_seed(0)", "torch.manual_seed(1)", "dist.barrier()"]
    assert calls_to(ctx, "torch.nothing") == []

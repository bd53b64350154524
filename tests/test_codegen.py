"""The fast printer behind `code_for` and `module_code` (torchmigrate.syntax.codegen) generates
exactly LibCST's code: for whole modules and for every node in them, for parsed code and for
nodes built the way rules build them (with LibCST's defaults for commas, `=` and semicolons).
Generated programs are compared in test_robustness.py."""
from __future__ import annotations

import libcst as cst
import pytest

from conftest import FIXTURES
from torchmigrate.syntax.codegen import code_for, module_code
from torchmigrate.syntax.walk import walk

SOURCES = sorted(FIXTURES.rglob("*.py"))


def nodes_of(module: cst.Module) -> list:
    parents: dict = {}
    walk(module, {}, {}, parents)
    return list(parents)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_every_fixture_and_each_of_its_nodes(path):
    source = path.read_text(encoding="utf-8")
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        pytest.skip("not parsable (a bad-input fixture)")
    assert module_code(module) == source == module.code
    for node in nodes_of(module):
        if type(node) is cst.Annotation:  # no code of its own: `:` or `->` comes from the parent
            continue
        assert code_for(node, module) == module.code_for_node(node), type(node).__name__


def test_indentation_newlines_and_trailing_newline_follow_the_module():
    for source in ("if x:\n\ty = 1\n", "def f():\r\n    return 1\r\n", "x = 1", "", "\n", "# c"):
        module = cst.parse_module(source)
        assert module_code(module) == module.code == source
        inner = module.with_changes(body=[*module.body, cst.parse_statement("if a:\n    b = 2\n")])
        assert module_code(inner) == inner.code


def _built() -> list:
    """Nodes as rules build them: defaults (MaybeSentinel.DEFAULT) wherever LibCST allows."""
    name, value = cst.Name("x"), cst.Integer("1")
    arg_kw = cst.Arg(value=value, keyword=cst.Name("k"))
    call = cst.Call(cst.Attribute(cst.Name("tm"), cst.Name("sampler")), [cst.Arg(name), arg_kw, cst.Arg(name, star="*")])
    elements = [cst.Element(name), cst.Element(value)]
    body = cst.IndentedBlock([cst.SimpleStatementLine([cst.Expr(call)])])
    return [
        call,
        cst.Call(cst.Name("f")),
        arg_kw,
        cst.Tuple([cst.Element(name)]),
        cst.Tuple(elements),
        cst.List(elements),
        cst.List([]),
        cst.Dict([cst.DictElement(cst.SimpleString('"a"'), value), cst.DictElement(name, call)]),
        cst.Subscript(name, [cst.SubscriptElement(cst.Index(value)), cst.SubscriptElement(cst.Index(name))]),
        cst.BinaryOperation(name, cst.Add(), value, lpar=[cst.LeftParen()], rpar=[cst.RightParen()]),
        cst.Comparison(name, [cst.ComparisonTarget(cst.Is(), cst.Name("None"))]),
        cst.UnaryOperation(cst.Not(), name),
        cst.BooleanOperation(name, cst.And(), name),
        cst.SimpleStatementLine([cst.Expr(call), cst.Assign([cst.AssignTarget(name)], value), cst.Pass(),
                                 cst.Return(), cst.AugAssign(name, cst.AddAssign(), value), cst.Return(name)]),
        cst.SimpleStatementLine([]),
        cst.If(cst.Name("flag"), body, orelse=cst.If(name, body, orelse=cst.Else(body)),
               leading_lines=[cst.EmptyLine(comment=cst.Comment("# TODO(torchmigrate): x"))]),
        cst.If(name, cst.IndentedBlock([])),
        cst.For(name, call, body, orelse=cst.Else(body)),
        cst.With([cst.WithItem(call, cst.AsName(name)), cst.WithItem(call)], body),
        cst.FunctionDef(cst.Name("f"), cst.Parameters([cst.Param(cst.Name("y")), cst.Param(name, default=value)]),
                        body, returns=cst.Annotation(cst.Name("int")),
                        decorators=[cst.Decorator(cst.Attribute(cst.Name("torch"), cst.Name("no_grad")))]),
        cst.ClassDef(cst.Name("C"), body, bases=[cst.Arg(cst.Attribute(cst.Name("nn"), cst.Name("Module")))], keywords=[arg_kw]),
        cst.ClassDef(cst.Name("D"), body),
    ]


@pytest.mark.parametrize("node", _built(), ids=lambda n: type(n).__name__)
def test_built_nodes_with_default_punctuation(node):
    module = cst.Module([])
    expected = module.code_for_node(node)
    assert code_for(node, module) == expected
    nested = module.code_for_node(cst.IndentedBlock([node])) if isinstance(node, cst.BaseStatement) else None
    if nested is not None:
        assert code_for(cst.IndentedBlock([node]), module) == nested

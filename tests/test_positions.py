"""Positions from a Layout (ast lines + code generation of one statement) and `regenerate`
(copying original statements at any depth) must give exactly what generating the whole module
gives, on awkward sources and after edits that move statements; when the Layout cannot be
trusted the whole-module path must be taken instead."""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List

import libcst as cst
import pytest

from conftest import FIXTURES
from torchmigrate.syntax import positions
from torchmigrate.syntax.layout import Layout

TRICKY = {
    "crlf": "import torch\r\n\r\n# c\r\ndef f(a,\r\n      b):\r\n    return (a +\r\n            b)\r\n",
    "tabs": "if x:\n\tif y:\n\t\tz = 1\n\t\t# deep\n\tw = 2\nelse:\n\tv = 3\n",
    "form_feed": "import torch\n\x0c\ndef f():\n    pass\n\x0c\nclass A:\n    x = 1\n",
    "continuations": (
        "x = 1 + \\\n    2\nif x and \\\n   y:\n    z = [1,\n         2]  # t\n"
        "y = 2 \\\n\nw = 3\n"
    ),
    "continuation_blank_line": "if x:\n    y = 1\n\\\n\nz = 1\n",
    "no_trailing_newline": "import torch\ndef f():\n    return torch.ones(1)",
    "no_trailing_newline_comment": "import torch\nx = torch.ones(1)\n# end",
    "decorators": (
        "import functools\n\n\n# lead\n@functools.lru_cache(\n    maxsize=None)\n# between\n@ \\\n  staticmethod\n"
        "def f():\n    pass\n\n@dataclass\nclass C:\n    @property\n    def p(self): return 1\n"
    ),
    "comments": (
        "# header\n\n'''doc'''\nimport torch  # t\n\n\nclass A:  # on header\n    # lead\n    x = 1\n"
        "        # deeper footer\n    # footer\n# module level\ndef g():\n    pass\n    # g footer\n\n# tail\n"
    ),
    "one_line_suites": "if x: pass\nelif y: a = 1; b = 2\nelse: c = 3\nwhile x: break\nfor i in y: z = i\nclass K: pass\n",
    "clauses": (
        "try:\n    a = 1\n# before except\nexcept (ValueError,\n        TypeError) as e:\n    b = 2\nexcept Exception:\n"
        "    pass\nelse:\n    c = 3\nfinally:\n    d = 4\n"
        "try:\n    pass\nexcept* OSError:\n    e = 5\n"
        "for i in x:\n    pass\nelse:\n    f = 6\nwhile y:\n    pass\nelse:\n    g = 7\n"
        "if a:\n    pass\nelif b:\n    pass\n# c\nelif c:\n    h = 8\nelse:\n    if d:\n        i = 9\n"
    ),
    "match": (
        "match command.split():\n    case [action]:\n        x = 1\n    case [action, obj] if obj:\n"
        "        y = 2\n    # comment\n    case _:\n        pass\n"
    ),
    "async": (
        "async def f():\n    async with a as b, c:\n        async for x in y:\n            await x\n"
        "    return [i async for i in z]\n"
    ),
    "unicode": (
        "s = 'ünïcödé'; t = 'x'\nπ = 3.14  # ∂\nif π:\n    café = s + '€' + t\n"
        "    d = {'ключ': 'значение', 'k': café}\n"
    ),
    "multiline_strings": (
        'x = """\nline\n    indented\n"""\ndef f():\n    y = f"""{x}\n{x}"""\n    return y\n'
        "z = ('a'\n     'b')\n"
    ),
    "deep": "def a():\n  def b():\n    class C:\n      def d(self):\n        if x:\n          return [\n1]\n",
    "mixed_indent_blocks": "class A:\n  def f(self):\n        if x:\n         y = 1\n        return y\n  z = 2\n",
    "semicolons": "a = 1; b = 2;\nif a: c = 3;\nd = 4 ;  # c\n",
    "global_after_block": "def f():\n    global x\n    x = 1\n\n\n\nx = 0\n",
}


def parent_map(module: cst.Module) -> Dict[cst.CSTNode, cst.CSTNode]:
    """Every node's parent, whitespace and comments included."""
    parents: Dict[cst.CSTNode, cst.CSTNode] = {}
    stack: List[cst.CSTNode] = [module]
    while stack:
        node = stack.pop()
        for child in node.children:
            parents[child] = node
            stack.append(child)
    return parents


def fast_positions(source: str):
    """(positions from the Layout, whole-module positions, layout) for every node of every
    statement (the module's header and footer lines hold no statement: they fall back)."""
    module = cst.parse_module(source)
    parents = parent_map(module)
    nodes = [n for stmt in module.body for n in [stmt, *parent_map(stmt)]]
    where, layout = positions.positions_and_layout(module, nodes, source, parents)
    return where, positions.positions(module, nodes), layout


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_layout_positions_equal_whole_module_positions(name):
    source = TRICKY[name]
    compile(source, name, "exec")
    where, expected, layout = fast_positions(source)
    assert layout is not None and not layout.broken, "the fast path was not taken"
    assert where == expected


def test_layout_positions_on_scripts():
    """Equal to the whole-module positions for every node, and to LibCST's PositionProvider
    for expressions and statements (the nodes findings are reported on)."""
    from libcst.metadata import MetadataWrapper, PositionProvider

    for path in sorted((FIXTURES / "scripts").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        where, expected, layout = fast_positions(source)
        assert not layout.broken, path.name
        assert where == expected, path.name
        provider = MetadataWrapper(layout.module, unsafe_skip_copy=True).resolve(PositionProvider)
        for node, position in where.items():
            if isinstance(node, (cst.BaseExpression, cst.BaseStatement, cst.BaseSmallStatement)):
                start = provider[node].start
                assert position == (start.line, start.column), (path.name, type(node).__name__)


def test_lone_carriage_returns_take_the_whole_module_path():
    source = "import torch\rx = torch.ones(1)\ry = 2\n"
    where, expected, layout = fast_positions(source)
    assert layout is None
    assert where == expected


def test_a_layout_that_disagrees_with_the_source_falls_back(monkeypatch):
    """Every statement is found one line too late: the generated text no longer matches the
    source, so the whole module is generated instead, and regenerate does not copy."""
    source = TRICKY["comments"]
    real = Layout.line_of
    monkeypatch.setattr(Layout, "line_of", lambda self, unit: real(self, unit) + 1)
    where, expected, layout = fast_positions(source)
    assert layout.broken
    assert where == expected
    module = layout.module
    edited = replace(module, module.body[-1], module.body[-1].with_changes(leading_lines=[]))
    assert positions.regenerate(edited, layout) == edited.code


def test_regenerate_falls_back_when_a_copied_span_would_not_match(monkeypatch):
    source = TRICKY["comments"]
    module = cst.parse_module(source)
    layout = Layout.build(module, source, parent_map(module))
    real = Layout.line_of
    monkeypatch.setattr(Layout, "line_of", lambda self, unit: real(self, unit) - 1)
    block = module.body[3].body
    edited = replace(module, block.body[0], cst.parse_statement("x = 2\n"))
    assert positions.regenerate(edited, layout) == edited.code
    assert layout.broken


def test_trees_that_do_not_pair_up_give_no_layout():
    module = cst.parse_module("x = 1\ny = 2\n")
    assert Layout.build(module, "x = 1\n", parent_map(module)) is None
    module = cst.parse_module("if x:\n    y = 1\n")
    assert Layout.build(module, "while x:\n    y = 1\n", parent_map(module)) is None


def test_nodes_outside_the_parent_map_fall_back(monkeypatch):
    """Such nodes get whole-module positions; the Layout stays usable for regenerate."""
    source = TRICKY["decorators"]
    module = cst.parse_module(source)
    stray = cst.Name("not_in_the_tree")
    nodes = [module.body[1], stray]
    calls = []
    real = positions._positions_by_module
    monkeypatch.setattr(positions, "_positions_by_module", lambda *a: calls.append(1) or real(*a))
    where, layout = positions.positions_and_layout(module, nodes, source, parent_map(module))
    assert calls and not layout.broken
    assert where == real(module, nodes)


# --- regenerate -----------------------------------------------------------------------------


def _with_child(parent: cst.CSTNode, old: cst.CSTNode, new) -> cst.CSTNode:
    """`parent` with child `old` replaced by `new` (a node, or a list of them in a list field)."""
    for field in dataclasses.fields(parent):
        value = getattr(parent, field.name)
        if value is old:
            return parent.with_changes(**{field.name: new})
        if isinstance(value, (list, tuple)) and any(item is old for item in value):
            items: list = []
            for item in value:
                if item is old:
                    items.extend(new if isinstance(new, list) else [new])
                else:
                    items.append(item)
            return parent.with_changes(**{field.name: items})
    raise AssertionError("not a child")


def replace(root: cst.Module, old: cst.CSTNode, new) -> cst.Module:
    """`root` with `old` replaced, rebuilding only the path to it (as the applier does)."""
    parents = parent_map(root)
    while old is not root:
        parent = parents[old]
        old, new = parent, _with_child(parent, old, new)
    return new


def statement_lists(module: cst.Module):
    """Every Module or IndentedBlock body, with its owner."""
    return [n for n in [module, *parent_map(module)] if isinstance(n, (cst.Module, cst.IndentedBlock)) and n.body]


def wrap(stmts) -> cst.With:
    return cst.With(items=[cst.WithItem(cst.parse_expression("ctx()"))], body=cst.IndentedBlock(list(stmts)))


def random_edit(module: cst.Module, rng: random.Random) -> cst.Module:
    owner = rng.choice(statement_lists(module))
    body = list(owner.body)
    i = rng.randrange(len(body))
    j = rng.randrange(i, len(body)) + 1
    kind = rng.choice(["wrap", "todo", "insert", "delete", "swap", "rename", "unindent"])
    if kind == "wrap":  # the WRAP edit: statements move one level deeper
        new_body = body[:i] + [wrap(body[i:j])] + body[j:]
    elif kind == "todo":
        stmt = body[i]
        line = cst.EmptyLine(comment=cst.Comment("# TODO(torchmigrate): x"))
        new_body = body[:i] + [stmt.with_changes(leading_lines=[*stmt.leading_lines, line])] + body[i + 1:]
    elif kind == "insert":
        new_body = body[:i] + [cst.parse_statement("tm.setup()\n")] + body[i:]
    elif kind == "delete":
        new_body = body[:i] + body[j:] or [cst.parse_statement("pass\n")]
    elif kind == "swap":
        new_body = body[:i] + body[i:j][::-1] + body[j:]
    elif kind == "rename":
        names = [n for n in parent_map(body[i]) if type(n) is cst.Name]
        if not names:
            return module
        return replace(module, rng.choice(names), cst.Name("renamed"))
    else:  # a block's statements moved up one level, after its owner
        parents = parent_map(module)
        compound = parents.get(owner)
        if type(compound) not in (cst.If, cst.For, cst.While, cst.With) or compound.body is not owner:
            return module
        if not isinstance(parents[compound], (cst.Module, cst.IndentedBlock)):
            return module  # an elif
        return replace(module, compound, [compound, *body])
    return replace(module, owner, owner.with_changes(body=new_body))


@pytest.mark.parametrize("name", sorted(TRICKY))
def test_regenerate_after_edits_on_tricky_sources(name):
    check_regenerate(TRICKY[name], seeds=range(25))


@pytest.mark.parametrize("path", sorted((FIXTURES / "scripts").glob("*.py")), ids=lambda p: p.name)
def test_regenerate_after_edits_on_scripts(path):
    check_regenerate(path.read_text(encoding="utf-8"), seeds=range(6))


def check_regenerate(source: str, seeds) -> None:
    module = cst.parse_module(source)
    for seed in seeds:
        rng = random.Random(seed)
        layout = Layout.build(module, source, parent_map(module))
        assert layout is not None
        edited = module
        for _ in range(rng.randint(1, 4)):
            edited = random_edit(edited, rng)
        assert positions.regenerate(edited, layout) == edited.code, seed
        assert not layout.broken, seed


def test_regenerate_copies_unchanged_statements_inside_edited_functions(monkeypatch):
    source = "def main():\n    a = 1\n    b = 2\n    c = 3\n    return a\n"
    module = cst.parse_module(source)
    layout = Layout.build(module, source, parent_map(module))
    block = module.body[0].body
    edited = replace(module, block.body[1], cst.parse_statement("b = 20\n"))
    copied = []
    monkeypatch.setattr(positions, "_Verbatim", lambda text: copied.append(text) or cst.parse_statement("pass\n"))
    positions.regenerate(edited, layout)
    assert copied == ["    a = 1\n", "    c = 3\n"]  # `return a` ends its block: generated


def test_moved_statements_are_generated_with_their_new_indentation():
    source = "def main():\n    x = '''\nkeep\n'''\n    y = 1\n    return y\n"
    module = cst.parse_module(source)
    layout = Layout.build(module, source, parent_map(module))
    block = module.body[0].body
    edited = replace(module, block, block.with_changes(body=[wrap(block.body[:2]), block.body[2]]))
    assert positions.regenerate(edited, layout) == edited.code
    assert "        y = 1\n" in edited.code

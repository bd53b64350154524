"""A deterministic corpus of realistic training scripts, made by varying `fixtures/scripts/*.py`.

Each generated file starts from one fixture script and then, driven by `random.Random(seed)`:

- renames the script's own identifiers (its functions, classes and variables; never imported
  names, attributes, keyword arguments, parameters or builtins) consistently through the file;
- shuffles the top-level function and class definitions;
- duplicates some of them under new names (0 to 6 extra copies), so file sizes vary from about
  80 to about 700 lines, like the training scripts found in public repositories;
- sometimes appends the definitions of a second fixture script (renamed apart).

The result parses and compiles; it is not meant to run. Used by `bench.py`, and importable by
tests that want realistic inputs.
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import random
import tokenize
from pathlib import Path
from typing import Dict, List, Sequence, Set

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "fixtures" / "scripts"

_SYNONYMS = ["net", "run", "cfg", "data", "opt", "step", "aux", "tmp", "cur", "main", "alt", "v2"]
_KEEP = set(dir(builtins)) | set(keyword.kwlist) | {"self", "cls", "__name__", "__main__", "__file__", "args"}


def fixture_scripts() -> List[Path]:
    return sorted(SCRIPTS.glob("*.py"))


def _own_names(tree: ast.Module) -> Set[str]:
    """Names the script itself defines (functions, classes, variables), minus imports/params."""
    imported: Set[str] = set()
    params: Set[str] = set()
    defined: Set[str] = set()
    class_fields: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                imported.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    params.add(arg.arg)
        elif isinstance(node, ast.ClassDef):
            defined.add(node.name)
            for item in node.body:  # dataclass fields / class attributes are reached as attributes
                for target in getattr(item, "targets", [getattr(item, "target", None)]):
                    if isinstance(target, ast.Name):
                        class_fields.add(target.id)
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    class_fields.add(item.name)  # methods are reached as attributes
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Lambda):
            for arg in node.args.args:
                params.add(arg.arg)
    return {n for n in defined - imported - params - class_fields - _KEEP if not n.startswith("__")}


def rename(source: str, mapping: Dict[str, str]) -> str:
    """Rename NAME tokens, except attributes (`x.name`) and keyword arguments (`f(name=...)`)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    out = []
    depth = 0
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.OP and tok.string in "([{":
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
        if tok.type == tokenize.NAME and tok.string in mapping:
            prev = tokens[i - 1].string if i else ""
            nxt = tokens[i + 1].string if i + 1 < len(tokens) else ""
            if prev != "." and not (depth > 0 and nxt == "=" and prev in ("(", ",")):
                tok = tok._replace(string=mapping[tok.string])
        out.append(tok)
    return _untokenize_exact(source, tokens, out)


def _untokenize_exact(source: str, old, new) -> str:
    """Replace changed tokens in place, keeping every other character of `source`."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    pieces = []
    pos = 0
    for a, b in zip(old, new):
        if a.string == b.string:
            continue
        start = offsets[a.start[0] - 1] + a.start[1]
        end = offsets[a.end[0] - 1] + a.end[1]
        pieces.append(source[pos:start])
        pieces.append(b.string)
        pos = end
    pieces.append(source[pos:])
    return "".join(pieces)


def _split(source: str):
    """(header, definitions, footer): top-level statements before the first def/class, the
    defs/classes (each with the comments and blank lines above it), and the rest."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    body = tree.body
    def_idx = [i for i, n in enumerate(body) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    if not def_idx:
        return source, [], ""
    first, last = def_idx[0], def_idx[-1]

    def start_line(node) -> int:
        return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])

    # Defs between `first` and `last` may have other statements between them; keep those with
    # the def that follows them.
    chunks: List[str] = []
    cut = start_line(body[first]) - 1
    while cut > 0 and lines[cut - 1].lstrip().startswith("#"):
        cut -= 1
    header = "".join(lines[:cut])
    prev_end = cut
    for i in range(first, last + 1):
        node = body[i]
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        end = node.end_lineno
        chunks.append("".join(lines[prev_end:end]))
        prev_end = end
    footer = "".join(lines[prev_end:])
    return header, chunks, footer


def _def_name(chunk: str) -> str:
    for node in ast.parse(chunk).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return node.name
    return ""


def vary(sources: Sequence[str], rng: random.Random, index: int) -> str:
    base = rng.randrange(len(sources))
    source = sources[base]
    names = sorted(_own_names(ast.parse(source)))
    mapping = {}
    for name in names:
        if rng.random() < 0.6:
            mapping[name] = f"{name}_{rng.choice(_SYNONYMS)}{index}"
    source = rename(source, mapping)
    header, chunks, footer = _split(source)
    if chunks:
        rng.shuffle(chunks)
        extra = []
        for _ in range(rng.choice([0, 1, 2, 3, 4, 6, 8])):
            chunk = rng.choice(chunks)
            name = _def_name(chunk)
            if name:
                extra.append(rename(chunk, {name: f"{name}_copy{len(extra)}"}))
        if rng.random() < 0.25:  # definitions from a second script, renamed apart
            other = sources[rng.randrange(len(sources))]
            other_names = sorted(_own_names(ast.parse(other)))
            other = rename(other, {n: f"{n}_x{index}" for n in other_names})
            _, other_chunks, _ = _split(other)
            extra.extend(other_chunks)
        chunks = chunks + extra
        rng.shuffle(chunks)
        source = header + "".join(c if c.endswith("\n") else c + "\n" for c in chunks) + footer
    compile(source, f"generated_{index}.py", "exec", dont_inherit=True)
    return source


def generate(folder: Path, n: int, seed: int = 0) -> List[Path]:
    """Write `n` varied scripts into `folder`; returns their paths (same seed, same files)."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = [p.read_text(encoding="utf-8") for p in fixture_scripts()]
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        text = vary(sources, rng, i)
        path = folder / f"train_{i:04d}.py"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


if __name__ == "__main__":  # pragma: no cover
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "corpus")
    made = generate(out, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    total = sum(p.stat().st_size for p in made)
    print(f"{len(made)} files, {total / 1e6:.2f} MB in {out}")

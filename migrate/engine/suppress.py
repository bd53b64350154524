"""Inline suppressions: `# torchmigrate: ignore[TM201]` on a line, `# torchmigrate: skip-file`.

Only real comments count: the source is tokenized and only COMMENT tokens are read, so the
same text inside a string literal (a docstring that documents the syntax, a generated script
in a triple-quoted string) suppresses nothing. A file that never mentions `torchmigrate:`
pays one substring search and is not tokenized.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterator, List, Optional, Tuple

_IGNORE = re.compile(r"#\s*torchmigrate:\s*ignore(?:\[([A-Za-z0-9_,\s]+)\])?")
_SKIP_FILE = re.compile(r"#\s*torchmigrate:\s*skip-file\b")

ALL = frozenset({"*"})


def comments(source: str) -> Iterator[Tuple[int, str, bool]]:
    """(line, text, alone) for each comment of `source`; `alone`: nothing but blanks before it
    on its line. A source that does not tokenize (it will fail to parse, which the engine
    reports) yields the comments before the error."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    try:
        for tok in tokens:
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string, not tok.line[:tok.start[1]].strip()
    except (tokenize.TokenError, SyntaxError):
        return


@dataclass
class Suppressions:
    skip_file: bool = False
    # line number -> codes ignored on it ("*" for all)
    lines: Dict[int, FrozenSet[str]] = field(default_factory=dict)

    @classmethod
    def scan(cls, source: str) -> "Suppressions":
        if "torchmigrate:" not in source:
            return cls()
        result = cls()
        for number, text, alone in comments(source):
            if alone and _SKIP_FILE.match(text):
                result.skip_file = True
            match = _IGNORE.search(text)
            if match:
                codes = match.group(1)
                result.lines[number] = (
                    frozenset(c.strip() for c in codes.split(",") if c.strip()) if codes else ALL
                )
        return result

    def unknown(self, known: FrozenSet[str]) -> List[Tuple[int, str]]:
        """(line, code) of each code given to an ignore comment that selects no rule of `known`
        (a typo, a removed rule): it suppresses nothing, so the user is told (as Ruff warns of
        an invalid rule code in a `# noqa`)."""
        return [(line, code) for line, codes in sorted(self.lines.items()) if codes is not ALL
                for code in sorted(codes) if not any(k.startswith(code) for k in known)]

    def covers(self, code: str, line: int) -> bool:
        codes: Optional[FrozenSet[str]] = self.lines.get(line)
        if not codes:
            return False
        return "*" in codes or any(code.startswith(c) for c in codes)

"""Inline suppressions: `# torchmigrate: ignore[TM201]` on a line, `# torchmigrate: skip-file`.

Scanned from the raw text (a regex over comment lines), so a file with no suppression pays
one substring search.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional

_IGNORE = re.compile(r"#\s*torchmigrate:\s*ignore(?:\[([A-Za-z0-9_,\s]+)\])?")
_SKIP_FILE = re.compile(r"^\s*#\s*torchmigrate:\s*skip-file\b", re.MULTILINE)

ALL = frozenset({"*"})


@dataclass
class Suppressions:
    skip_file: bool = False
    # line number -> codes ignored on it ("*" for all)
    lines: Dict[int, FrozenSet[str]] = field(default_factory=dict)

    @classmethod
    def scan(cls, source: str) -> "Suppressions":
        if "torchmigrate:" not in source:
            return cls()
        result = cls(skip_file=bool(_SKIP_FILE.search(source)))
        for number, line in enumerate(source.splitlines(), start=1):
            match = _IGNORE.search(line)
            if match:
                codes = match.group(1)
                result.lines[number] = (
                    frozenset(c.strip() for c in codes.split(",") if c.strip()) if codes else ALL
                )
        return result

    def covers(self, code: str, line: int) -> bool:
        codes: Optional[FrozenSet[str]] = self.lines.get(line)
        if not codes:
            return False
        return "*" in codes or code in codes or any(code.startswith(c) for c in codes)

"""What a program build produces (see `build`): plain data, kept apart from the build so
that the lint cache can hand back a recorded build without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from torchmigrate.program.view import ModuleView


@dataclass
class Program:
    """Every file to process, the entry points among them, and each module's view."""

    files: List[Path]
    entries: List[Path] = field(default_factory=list)
    followed: List[Path] = field(default_factory=list)  # files found through imports only
    views: Dict[str, ModuleView] = field(default_factory=dict)
    # files that import each other, directly or not: each group is written whole or not at all
    groups: List[List[str]] = field(default_factory=list)
    # `file:line: name` of imports that look like the project's own but resolve nowhere
    unresolved: List[str] = field(default_factory=list)

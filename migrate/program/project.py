"""The files of a project around an entry script, from one walk through `fs`.

A program build asks the project three things besides its modules: the names of its modules
and packages (an import of one that resolves nowhere is the project's own code reached through
a path set up at run time), the launch files and packaging files that set that path
(`search_path`), and the configuration files that name modules a program loads by name
(`dynamic_imports`). One walk answers all three; it goes through `fs`, so the lint cache
notices a launch or configuration file that appears or changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Set

from torchmigrate.program.fs import FileSystem

WALK_DEPTH = 4  # folders below the root that the walk enters (src/pkg/models/arch/x.py)
MAX_FOLDERS = 4000  # a data set unpacked in the project: stop before listing all of it
CONFIG_SUFFIXES = (".json", ".yaml", ".yml", ".toml", ".cfg")
# configuration of tools, not of the program
TOOL_CONFIGS = frozenset({"pyproject.toml", "setup.cfg", "tox.ini", "package.json", "package-lock.json",
                          ".pre-commit-config.yaml", "mkdocs.yml", "environment.yml", "environment.yaml",
                          ".readthedocs.yaml", ".readthedocs.yml", "codecov.yml", "tsconfig.json"})
MAX_CONFIG_BYTES = 256 * 1024  # larger JSON is data (annotations, vocabularies), not configuration


@dataclass
class Project:
    """What the walk saw under `root`: each folder's files and subfolders."""

    root: Path
    files: Dict[Path, List[str]] = field(default_factory=dict)  # folder -> its file names
    folders: Dict[Path, List[str]] = field(default_factory=dict)  # folder -> its subfolders entered

    def module_names(self) -> Set[str]:
        """`models` for `src/models/` or `lib/models.py`: every module and package name."""
        names: Set[str] = set()
        for folder, subfolders in self.folders.items():
            names.update(d for d in subfolders if d.isidentifier())
        for files in self.files.values():
            names.update(f[:-3] for f in files if f.endswith(".py"))
        return names

    def launch_files(self) -> List[Path]:
        from torchmigrate.launchers import kind_of

        return [folder / f for folder, files in self.files.items() for f in files if kind_of(Path(f))]

    def config_files(self) -> List[Path]:
        return [folder / f for folder, files in self.files.items() for f in files
                if f.lower().endswith(CONFIG_SUFFIXES) and f not in TOOL_CONFIGS]


def walk(root: Path, fs: FileSystem) -> Project:
    """The project's folders, breadth first, to `WALK_DEPTH` levels, leaving out version
    control, caches, builds and virtualenvs (`fs.listing` leaves out all but virtualenvs)."""
    project = Project(root)
    queue = [(root, 0)]
    while queue and len(project.files) < MAX_FOLDERS:
        folder, level = queue.pop(0)
        entries = [e for e in fs.listing(folder).split("\n") if e]
        if "pyvenv.cfg" in entries and level:
            continue  # a virtualenv: installed code
        project.files[folder] = [e for e in entries if not e.endswith("/")]
        subfolders = [e[:-1] for e in entries if e.endswith("/")]
        project.folders[folder] = subfolders
        if level < WALK_DEPTH:
            queue.extend((folder / d, level + 1) for d in subfolders)
    return project

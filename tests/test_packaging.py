"""The package builds (sdist and wheel) without a single warning from the build backend.

setuptools announced that a `project.license` TOML table stops building on 2027-02-18; its
warning scrolls past in `pip install` output, so it is caught here instead. The build runs the
backend of the test environment (no build isolation, no network) on a copy of the sources, so
it never writes `build/` or `*.egg-info` into the checkout other tests are reading.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT

BUILD = """
import setuptools.build_meta as backend
print(backend.build_sdist("dist"))
print(backend.build_wheel("dist"))
"""
# A Python warning as the warnings module prints it: `file.py:82: SetuptoolsDeprecationWarning: ...`
WARNING = re.compile(r"\w*Warning\b|deprecat", re.IGNORECASE)
# distutils' own notices that compiling bytecode is off (PYTHONDONTWRITEBYTECODE): not about us
BENIGN = re.compile(r"^warning: \w+: byte-compiling is disabled", re.IGNORECASE)


@pytest.mark.slow
def test_build_is_warning_free(tmp_path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("migrate", "rules", "runtime"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-W", "always", "-c", BUILD], cwd=tmp_path,
                         capture_output=True, text=True)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if WARNING.search(line) and not BENIGN.match(line)]
    assert not warnings, "\n".join(warnings)
    wheel = next((tmp_path / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: MIT" in archive.read(metadata).decode()
        names = archive.namelist()
    for module in ("torchmigrate/cli/commands.py", "torchmigrate/engine/process.py", "torchmigrate/syntax/walk.py",
                   "torchmigrate/program/program.py", "torchmigrate/launchers/shell.py",
                   "torchmigrate/rules/launch/plan.py", "torchmigrate/runtime/__init__.py"):
        assert module in names

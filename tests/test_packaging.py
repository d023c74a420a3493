"""What a user's pip installs: the wheel carries the PEP 561 marker and the licence.

The wheel is built from a copy of the sources (so the build writes nothing into the
checkout), with the setuptools this environment has, as the Dockerfile builds it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_py_typed_and_the_license(tmp_path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == {"text": "Apache-2.0"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for directory in set(project["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / directory, src / directory, ignore=ignore)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("prefixstore-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "prefixstore/py.typed" in names  # mypy then checks users' code against our annotations
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), [n for n in names if "dist-info" in n]

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

import pytest

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


# A non-editable install (a wheel, `pip install .`): only the path finder finds the package, and
# from the checkout's root (`python -m` puts the current directory first on sys.path) it finds the
# source tree's prefixstore/ first, whose parts (protocol/, store/, ...) live beside it, not in it.
FROM_THE_CHECKOUT = """
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path.insert(0, "")
{body}
"""


@pytest.mark.parametrize("body, expect", [
    ('sys.argv = ["prefixstore", "--version"]\nrunpy.run_module("prefixstore", run_name="__main__", alter_sys=True)',
     "prefixstore "),
    ("from prefixstore.client import PrefixClient\nfrom prefixstore.store import StoreConfig\n"
     "print(PrefixClient.__name__, StoreConfig().port)", "PrefixClient 8077"),
], ids=["python -m prefixstore --version", "from prefixstore.client import PrefixClient"])
def test_the_package_imports_from_the_checkout_root(body: str, expect: str) -> None:
    out = subprocess.run([sys.executable, "-c", FROM_THE_CHECKOUT.format(body=body)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(expect), out.stdout

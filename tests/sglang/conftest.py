"""SGLang tests: a real store process, and the writer process of the two-process tests.

SGLang is optional (``tests/sglang/install_sglang.sh`` installs what these tests import);
the modules that need it skip with that reason when it is absent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..serve_process import ServeProcess, StartServe, clean_env, serving

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("UCX_MODULES", "^ib")  # before any NIXL agent of this process starts UCX (DESIGN §9)


@pytest.fixture(scope="package", autouse=True)
def _hub_offline() -> Iterator[None]:
    """No test here needs the Hub, and CI reaches PyPI only. A hybrid backend reads its model's
    Hugging Face config from disk (client/sglang/backend.py ``model_state_shards``); before it did,
    each such backend of these tests, whose model names are on no hub, waited about 23 s in the
    Hub client's retries. Offline mode also keeps the Hub client's own calls (its user-agent
    registry) off the network. The writer process gets ``HF_HUB_OFFLINE=1`` (``written``);
    test_backend.py checks the backend itself with offline mode off. Only this package's tests:
    the tests run after them (vLLM's, which reads the mode too) see it as it was."""
    try:
        from huggingface_hub import constants
    except ImportError:  # no engine installed here: nothing reads the Hub
        yield
        return

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    yield
    constants.HF_HUB_OFFLINE = before


@pytest.fixture(scope="session")
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.fixture(scope="session")
def store(serve: StartServe, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """One real store process for the SGLang tests (namespaces keep the tests apart)."""
    return serve("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("lmdb")), "--state-admission", "always")


@pytest.fixture(scope="session")
def written(store: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A second process (SGLang's controller and the backend, tests/sglang/engine.py) saved pages."""
    assert store.url is not None
    out = tmp_path_factory.mktemp("writer") / "written.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.sglang.engine", "write", store.url, str(out)],
                          cwd=ROOT, env=clean_env(PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads(out.read_text()))


@pytest.fixture
def dead_url() -> str:
    """An address nothing listens on (reserved by the OS, then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"

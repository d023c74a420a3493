"""vLLM tests: environment for vLLM's CPU build, and a real store process.

vLLM is optional (``tests/vllm/install_vllm.sh`` installs its CPU build); the
modules that need it skip with that reason when it is absent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from ..serve_process import ServeProcess, StartServe, serving

if TYPE_CHECKING:
    from .harness import Engine

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# The engine core in this process (no engine subprocess): the end-to-end test reaches the
# worker's connector through vLLM's global KV transfer group.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.fixture(scope="session")
def store(serve: StartServe, tmp_path_factory: pytest.TempPathFactory) -> ServeProcess:
    """One real store process for the vLLM tests (each test uses its own namespace)."""
    return serve("--port", "0", "--data-dir", str(tmp_path_factory.mktemp("lmdb")), "--state-admission", "always")


@pytest.fixture(scope="session")
def cluster(serve: StartServe, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three store nodes with static membership (tests/cluster has the full harness); their URLs."""
    socks = [socket.socket() for _ in range(3)]
    for s in socks:  # ports reserved by the OS, released just before the nodes bind them
        s.bind(("127.0.0.1", 0))
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    tmp = tmp_path_factory.mktemp("cluster")
    procs = [serve("--port", url.rsplit(":", 1)[1], "--node-url", url, "--peers", ",".join(urls),
                   "--data-dir", str(tmp / f"node-{i}"), "--state-admission", "always", ready=False)
             for i, url in enumerate(urls)]
    for p in procs:
        p.wait_ready()
    return urls


@pytest.fixture
def engine_factory(store: ServeProcess) -> Iterator[Callable[..., Engine]]:
    """Builds harness Engines against the session's store (``url=`` another); closes them after."""
    from .harness import Engine

    engines: list[Engine] = []

    def make(model_id: str, **kw: object) -> Engine:
        e = Engine(kw.pop("url", store.url), model_id, **kw)  # type: ignore[arg-type]
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@pytest.fixture
def closing() -> Iterator[list[Engine]]:
    """Harness Engines a test builds itself (several ranks, two roles); closed after it."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()

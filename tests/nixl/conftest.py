"""NIXL data path tests: real agents (UCX, DRAM to DRAM over loopback), real stores.

Skipped where nixl is not installed (the ``test`` extra installs it, so CI runs them). The
check looks the package up without importing it: importing nixl with a CPU build of torch
installed costs seconds (it imports torch to look for CUDA); the code under test avoids that.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from prefixstore.store import STORE, Store, StoreConfig, create_app


def _installed() -> bool:
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):
        return False


#: Test modules start with ``pytestmark = NEEDS_NIXL``: pytest.importorskip, minus the import.
NEEDS_NIXL = pytest.mark.skipif(not _installed(), reason="nixl is not installed (pip install nixl, or the 'test' extra)")

os.environ.setdefault("UCX_MODULES", "^ib")  # before any agent of this process starts UCX


class Clock:
    """A store clock the test moves (leases expire when it says)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Start = Callable[..., Awaitable[tuple[str, Store]]]


@pytest.fixture
async def start(tmp_path: Path) -> AsyncIterator[Start]:
    """A store in this process serving NIXL: ``url, store = await start(clock, **knobs)``."""
    servers: list[TestServer] = []

    async def go(clock: Clock | None = None, **knobs: object) -> tuple[str, Store]:
        values: dict[str, object] = dict(port=0, data_dir="none", ram_bytes=256 << 10, page_bytes=4096,
                                         lease_ttl_s=5.0, nixl="on")
        values.update(knobs)
        config = StoreConfig(**values)  # type: ignore[arg-type]
        server = TestServer(create_app(config, clock or Clock()), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), server.app[STORE]

    yield go
    for s in servers:
        await s.close()

"""Shared fixtures: a real store (aiohttp app + LMDB in a temp dir) served in-process on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import Namespace
from prefixstore.store import STORE, Store, StoreConfig, create_app

from .factories import make_namespace


@pytest.fixture
def namespace() -> Namespace:
    return make_namespace()


@pytest.fixture
def store_config(tmp_path: Path) -> StoreConfig:
    # nixl off: these stores test the HTTP path (clients default to NIXL where a store serves
    # it); tests/nixl/ starts its own stores with NIXL on.
    return StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                       disk_bytes=64 << 20, nixl="off")


class RunningStore:
    """A store application served on a free loopback port."""

    def __init__(self, server: TestServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def store(self) -> Store:
        return self.server.app[STORE]

    def client(self, ns: Namespace, **overrides: object) -> PrefixClient:
        return PrefixClient(ns, ClientConfig(url=self.url, **overrides))


@pytest.fixture
async def start_store() -> AsyncIterator[Callable[[StoreConfig], Awaitable[RunningStore]]]:
    """Factory: ``running = await start_store(config)``; every store is closed at teardown."""
    servers: list[TestServer] = []

    async def start(config: StoreConfig) -> RunningStore:
        server = TestServer(create_app(config), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return RunningStore(server)

    yield start
    for s in servers:
        await s.close()


@pytest.fixture
async def running(start_store, store_config: StoreConfig) -> RunningStore:  # type: ignore[no-untyped-def]
    return await start_store(store_config)


@pytest.fixture
async def client(running: RunningStore, namespace: Namespace) -> AsyncIterator[PrefixClient]:
    c = running.client(namespace)
    yield c
    await c.close()


__all__ = ["RunningStore", "web"]

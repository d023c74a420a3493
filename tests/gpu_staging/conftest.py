"""Fixtures for the engine-side tests: the reference model, stores, clients and engines on them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.gpu_staging import Engine, EngineConfig, HybridModel, ModelConfig
from prefixstore.store import StoreConfig

from ..conftest import RunningStore

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
MakeEngine = Callable[..., Awaitable[Engine]]


@pytest.fixture(scope="session")
def model() -> HybridModel:
    torch.manual_seed(0)
    return HybridModel(ModelConfig())


def tokens(seed: int, n: int, vocab: int = 1024) -> list[int]:
    """A reproducible token stream."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store_config(tmp_path: Path, **overrides: object) -> StoreConfig:
    knobs: dict[str, object] = {"port": 0, "data_dir": str(tmp_path / "lmdb"), "ram_bytes": 64 << 20,
                                "page_bytes": 64 << 10, "disk_bytes": 256 << 20}
    knobs.update(overrides)
    return StoreConfig(**knobs)


@pytest.fixture
async def make_engine(model: HybridModel) -> AsyncIterator[MakeEngine]:
    """Factory: ``engine = await make_engine(running, block_tokens=16, page_tokens=16, mode="exact")``."""
    clients: list[PrefixClient] = []

    async def make(running: RunningStore, *, block_tokens: int = 16, client_cls: type[PrefixClient] = PrefixClient,
                   **config: object) -> Engine:
        client = client_cls(model.config.namespace(block_tokens=block_tokens), ClientConfig(url=running.url))
        clients.append(client)
        return Engine(model, client, EngineConfig(**config))

    yield make
    for c in clients:
        await c.close()

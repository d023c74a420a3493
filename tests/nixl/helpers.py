"""Chains of KV blocks whose bytes say where they came from, saved and read back through a client."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Protocol

import numpy as np

from prefixstore.client.node import NodeClient
from prefixstore.client import PrefixClient
from prefixstore.protocol import Namespace
from prefixstore.protocol.wire import GetItem
from prefixstore.store import Store

from ..factories import kv_payload, make_namespace
from ..serve_process import http_get

class MovableClock(Protocol):
    now: float


BLOCK_TOKENS = 64  # 64 tokens x 64 B = 4 KiB a block: one page at 4 KiB pages, several at 1 KiB


def namespace(**overrides: object) -> Namespace:
    return make_namespace(block_tokens=BLOCK_TOKENS, **overrides)  # type: ignore[arg-type]


def tokens(seed: int, num_blocks: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 50_000, num_blocks * BLOCK_TOKENS)]


async def save(client: PrefixClient, toks: list[int]) -> int:
    ns = client.namespace
    res = await client.save(client.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
    return res.stored


def block_reads(client: PrefixClient, toks: list[int], layer: int | None = None
                ) -> tuple[list[GetItem], list[bytes]]:
    """One item per full block (optionally one layer of it) and the bytes each must return."""
    ns = client.namespace
    p = client.prompt(toks)
    B = ns.block_tokens
    items, expected = [], []
    for j in range(len(toks) // B):
        whole = kv_payload(ns, toks, j * B, (j + 1) * B)
        if layer is None:
            items.append(GetItem(key=p.block_key(j)))
            expected.append(whole)
        else:
            offset, length = ns.kv.layer_range_bytes(B, layer, layer + 1)
            items.append(GetItem(key=p.block_key(j), layer_start=layer, layer_end=layer + 1))
            expected.append(whole[offset : offset + length])
    return items, expected


async def read(client: PrefixClient, items: list[GetItem], size: int, fill: int = 0xAB
               ) -> tuple[list[int], list[np.ndarray]]:
    outs = [np.full(size, fill, dtype=np.uint8) for _ in items]
    return await client.read(items, outs), outs


def metric(url: str, name: str, labels: str) -> float:
    """One sample of the store's /metrics, e.g. metric(url, "prefixstore_transfer_bytes_total",
    'direction="out",path="nixl"')."""
    status, body = http_get(url + "/metrics")
    assert status == 200
    sample = f"{name}{{{labels}}}" if labels else name
    m = re.search(rf"^{re.escape(sample)} (\S+)$", body.decode(), re.MULTILINE)
    assert m, f"{sample} not in /metrics"
    return float(m.group(1))


Interleave = Callable[[str, dict[str, object]], Awaitable[None]]


def interleave_after(client: PrefixClient, path: str, action: Interleave) -> Callable[[], None]:
    """Run ``action`` right after the store answers ``path`` and before the client acts on the
    answer (e.g. between the descriptors of /v1/nixl/get and the READ they feed), through the node
    client's observers seam (client/node.py). Returns what stops it."""
    node = client.impl
    assert isinstance(node, NodeClient)

    async def observe(p: str, header: dict[str, object], answer: dict[str, object]) -> None:
        if p == path:
            await action(p, answer)

    node.observers.append(observe)
    return lambda: node.observers.remove(observe)


async def lose_leases_to(store: Store, clock: MovableClock, other: PrefixClient, intruder: list[int]) -> list[bytes]:
    """The store's clock jumps past every lease; the unpinned entries go and ``other`` saves the
    chain of ``intruder``, whose blocks take their pages (lowest free pages first). Returns the
    intruder's block bytes: what a READ through stale descriptors would now copy."""
    clock.now += 100.0  # past any lease_ttl_s of these tests
    store.sweep()  # expires the leases: the entries are unpinned
    assert len(store.leases) == 0
    store.flush()  # ... deleted, their pages freed
    assert await save(other, intruder) == len(intruder) // other.namespace.block_tokens  # ... and reused
    return block_reads(other, intruder)[1]

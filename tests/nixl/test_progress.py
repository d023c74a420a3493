"""The store's NIXL progress task: quiet while nothing is handed out, prompt once something is.

An idle store shares its host with the engines it serves; every wake-up of its loop preempts one
of them (docs/benchmarks.md, the vLLM serving benchmark). So the task polls the agent slowly while
no lease or reservation is out, and a lease handed out wakes it at once: a READ under it completes
without waiting for the slow poll."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.store.nixl_target import BUSY_PROGRESS_S, IDLE_PROGRESS_S
from prefixstore.transport.nixl_agent import import_nixl

from .conftest import NEEDS_NIXL, Start
from .helpers import block_reads, namespace, read, save, tokens

pytestmark = NEEDS_NIXL


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each agent in this process called ``get_new_notifs`` (the store's progress)."""
    api = import_nixl()
    original = api.nixl_agent.get_new_notifs
    seen: list[float] = []

    def counted(self: object) -> object:
        seen.append(time.monotonic())
        return original(self)
    monkeypatch.setattr(api.nixl_agent, "get_new_notifs", counted)
    return seen


async def test_an_idle_store_polls_its_agent_a_few_times_a_second(start: Start, polls: list[float]) -> None:
    url, store = await start()
    async with PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl")) as client:
        toks = tokens(71, 4)
        assert await save(client, toks) == 4
        await asyncio.sleep(0.3)  # what the save handed out is done with
        polls.clear()
        quiet_s = 1.0
        await asyncio.sleep(quiet_s)
        # "A few times a second": 10 at IDLE_PROGRESS_S = 0.1 s; it was ~200 at 5 ms. A slow
        # machine can only make fewer.
        assert len(polls) <= 20, f"{len(polls)} polls in {quiet_s} s idle"

        # A lease handed out wakes it at once, not at its next idle poll: ask right after one.
        seen = len(polls)
        while len(polls) == seen:
            await asyncio.sleep(0.002)
        asked = time.monotonic()
        lookup = await client.lookup(client.prompt(toks), lease=True)
        assert lookup.kv_tokens == len(toks) and lookup.lease_id is not None
        held_s = 0.3
        await asyncio.sleep(held_s)
        after = [t - asked for t in polls if t >= asked]
        assert await client.release(lookup.lease_id)
        # Woken, the first poll comes within the lookup (asleep, ~IDLE_PROGRESS_S later), and it
        # polls every BUSY_PROGRESS_S while the lease is out (~300 here; asleep, at most 4).
        assert after and after[0] < IDLE_PROGRESS_S / 2, f"first poll {after[:1]} s after the lease"
        assert len(after) > 20, f"{len(after)} polls in {held_s} s with a lease out"
        assert BUSY_PROGRESS_S < IDLE_PROGRESS_S

        items, expected = block_reads(client, toks)  # and what it hands out reads back exact
        got, outs = await read(client, items, client.namespace.block_bytes)
        assert got == [len(w) for w in expected] and [o.tobytes() for o in outs] == expected
    store.check()

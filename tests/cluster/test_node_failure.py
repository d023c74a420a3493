"""SIGKILL of one of three nodes under a mixed read/write load: only the conversations whose branch
lives on that node turn into misses, no exception reaches the caller, no wrong byte is ever returned; the restarted node (same
URL, same LMDB directory) rejoins and serves what it had."""

from __future__ import annotations

import asyncio
import random
import signal
import time

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol.placement import rank

from ..factories import kv_payload, make_namespace, state_payload
from .verified import read_verified

B = 4
LENGTH = 26  # 6 full blocks + a 2-token tail: levels 0..6


def expected_kv(client: PrefixClient, tokens: list[int], dead: str | None) -> int:
    """Full reuse unless the prompt's branch node (where its first block forked) is the dead one: the
    root level's home holds only a record of the first block, and losing it costs no full block."""
    p = client.prompt(tokens)
    if dead is not None and rank(client.impl.membership.members, p.hashes[0])[0] == dead:  # type: ignore[attr-defined]
        return 0
    return len(tokens)


async def check(client: PrefixClient, ns, tokens: list[int], dead: str | None) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Look up, read every reusable byte and verify it; returns (kv_tokens, expected). A read may miss
    (the node died between lookup and read); wrong bytes never."""
    res = await client.lookup(tokens)
    want = expected_kv(client, tokens, dead)
    await read_verified(client, ns, tokens, res)
    await client.release(res.lease_id)
    return res.kv_tokens, want


def test_sigkill_one_node_under_load_then_rejoin(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--state-admission", "always", "--durability", "sync")  # a kill -9 loses no commit
    ns = make_namespace(block_tokens=B, model="failure")
    rng = random.Random(7)
    first = iter(range(1000, 1 << 20))  # a first token of its own per prompt: no prompt matches another's start

    def new_prompt() -> list[int]:
        return [next(first)] + [rng.randrange(1000) for _ in range(LENGTH - 1)]

    prompts = [new_prompt() for _ in range(24)]
    victim = cluster.urls[1]
    config = ClientConfig(urls=tuple(cluster.urls), timeout_s=2.0, connect_timeout_s=0.5, retry_after_s=0.2,
                          max_retry_after_s=0.5)

    async def save(client: PrefixClient, tokens: list[int]) -> None:
        await client.save(client.prompt(tokens), LENGTH, lambda a, b: kv_payload(ns, tokens, a, b),
                          snapshots={LENGTH: state_payload(ns, tokens, LENGTH)})

    async def run() -> None:
        # The engine's lookups on one client, the load's new saves on another: a save walks a prompt it
        # has not seen, and the lookup failures counted below are those of the lookups checked.
        async with PrefixClient(ns, config) as client, PrefixClient(ns, config) as writer:
            for tokens in prompts:
                await save(client, tokens)
            for tokens in prompts:
                got, want = await check(client, ns, tokens, None)
                assert got == want == LENGTH

            # Mixed load while the victim is SIGKILLed: lookups + verified reads, and new saves.
            killed = False
            short = 0  # lookups the dead node made short
            for step in range(60):
                if step == 10:
                    await asyncio.to_thread(cluster.procs[victim].stop, signal.SIGKILL)
                    killed = True
                tokens = prompts[step % len(prompts)]
                fresh = new_prompt()
                (got, want), _ = await asyncio.gather(check(client, ns, tokens, victim if killed else None),
                                                      save(writer, fresh))
                if killed:
                    assert got == want, (step, got, want)  # exactly that node's branches are misses
                    short += got < LENGTH
                else:
                    assert got == LENGTH
            # The dead node was noticed, and counted, not raised: every lookup it made short counts once
            # (not once per breaker trip: while the breaker is open its hops are skipped, and were not).
            assert short > 0 and client.failures["lookup"] == short, (short, dict(client.failures))

            # Restart the victim on its URL and LMDB directory: it rejoins and serves what it had.
            cluster.start_node(victim)
            deadline = time.monotonic() + 20.0
            while True:
                results = [await check(client, ns, tokens, None) for tokens in prompts]
                if all(got == LENGTH for got, _ in results):
                    break
                assert time.monotonic() < deadline, results
                await asyncio.sleep(0.2)  # the circuit breaker's retry_after_s, not a readiness guess

    asyncio.run(run())

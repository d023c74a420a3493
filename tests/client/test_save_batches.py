"""PrefixClient.save with more items than one batch (ClientConfig.max_items).

Offering every batch before putting any made the store reject the first block
of each later batch ("parent not stored": its parent was only offered), and
everything chained after it: only the first batch was saved."""

from __future__ import annotations

import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.datapath import batches as _batches

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload

NUM_BLOCKS = 50
MAX_ITEMS = 8


async def test_save_spanning_many_batches_stores_and_reads_back_everything(running: RunningStore) -> None:
    ns = make_namespace()
    B = ns.block_tokens
    toks = [(7 * i + 3) % 1000 for i in range(NUM_BLOCKS * B + 2)]  # 50 full blocks + a 2-token tail
    snapshots = {t: state_payload(ns, toks, t) for t in (5 * B, 23 * B + 1, NUM_BLOCKS * B)}
    async with running.client(ns, max_items=MAX_ITEMS) as c:
        p = c.prompt(toks)
        calls: list[tuple[int, int]] = []

        def payload(a: int, b: int) -> bytes:
            calls.append((a, b))
            return kv_payload(ns, toks, a, b)

        r = await c.save(p, len(toks), payload, snapshots)
        assert (r.stored, r.already, r.rejected, r.dropped) == (NUM_BLOCKS + 1 + len(snapshots), 0, 0, 0), r
        assert len(r.results) == NUM_BLOCKS + 1 + len(snapshots)
        assert all(res.status == "ok" for _, res in r.results)
        assert len(calls) == NUM_BLOCKS + 1  # kv_payload only for wanted items, once each
        assert c.failures == {}
        running.store.check()

        # Everything comes back, byte for byte.
        res = await c.lookup(toks)
        assert res.ok and res.kv_tokens == len(toks) and res.matched_blocks == NUM_BLOCKS
        assert res.state_tokens == NUM_BLOCKS * B
        reads = res.kv_reads(res.kv_tokens)
        assert len(reads) == NUM_BLOCKS + 1
        outs = [bytearray((b - a) * ns.kv.token_bytes) for _, a, b in reads]
        got = await c.read([item for item, _, _ in reads], outs)
        assert got == [len(o) for o in outs]
        for (_, a, b), out in zip(reads, outs):
            assert bytes(out) == kv_payload(ns, toks, a, b), (a, b)
        state = res.state_read()
        assert state is not None
        out = bytearray(ns.state.snapshot_bytes)
        assert await c.read([state], [out]) == [len(out)]
        assert bytes(out) == snapshots[NUM_BLOCKS * B]
        await c.release(res.lease_id)

        # Saving again: the store has it all, in every batch.
        again = await c.save(p, len(toks), payload, snapshots)
        assert (again.stored, again.already, again.rejected, again.dropped) == (0, NUM_BLOCKS + 1 + len(snapshots), 0, 0)
        assert len(calls) == NUM_BLOCKS + 1
        assert c.failures == {}


async def test_save_continuing_from_start_spans_batches(running: RunningStore) -> None:
    ns = make_namespace(with_state=False)
    B = ns.block_tokens
    toks = list(range(1, NUM_BLOCKS * B + 1))
    async with running.client(ns, max_items=MAX_ITEMS) as c:
        p = c.prompt(toks)
        first = await c.save(p, 10 * B, lambda a, b: kv_payload(ns, toks, a, b))
        assert (first.stored, first.rejected) == (10, 0)
        rest = await c.save(p, len(toks), lambda a, b: kv_payload(ns, toks, a, b), start=10 * B)
        assert (rest.stored, rest.already, rest.rejected, rest.dropped) == (NUM_BLOCKS - 10, 0, 0, 0)
        res = await c.lookup(toks)
        assert res.kv_tokens == len(toks) and res.matched_blocks == NUM_BLOCKS
        await c.release(res.lease_id)


async def test_save_to_a_dead_store_drops_every_batch_without_raising() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ns = make_namespace(with_state=False)
    toks = list(range(1, 20 * ns.block_tokens + 1))
    async with PrefixClient(ns, ClientConfig(url=f"http://127.0.0.1:{port}", max_items=MAX_ITEMS,
                                             connect_timeout_s=0.5)) as c:
        r = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
        assert (r.stored, r.already, r.rejected, r.dropped) == (0, 0, 0, 20)
        assert c.failures["offer"] == 1  # the first batch failed; the others were not attempted


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=40), max_bytes=st.integers(1, 120), max_items=st.integers(1, 9))
def test_read_batches_keep_order_and_limits(sizes: list[int], max_bytes: int, max_items: int) -> None:
    """Reads are cut into batches in order; a batch holds at most max_items items and max_bytes
    bytes, except an item larger than max_bytes, which goes alone; no batch could take the next
    batch's first item."""
    batches = _batches(sizes, max_bytes, max_items)
    assert [i for b in batches for i in b] == list(range(len(sizes)))
    for k, b in enumerate(batches):
        total = sum(sizes[i] for i in b)
        assert b and len(b) <= max_items and (total <= max_bytes or len(b) == 1)
        if k + 1 < len(batches):
            nxt = sizes[batches[k + 1][0]]
            assert len(b) == max_items or total + nxt > max_bytes

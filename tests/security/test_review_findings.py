"""What an independent attack on the isolation change found, each as a test that failed before its fix.

1. one lookup or probe could compare millions of stored entries (scan amplification);
2. extra keys were unbounded and charged nothing;
3. tiny entries cost their records nothing (quota, disk, index memory);
4. the sighting filter's bit positions were public (an existence oracle through admission);
5. LMDB errors outside the damage list were answered 500;
7. a single node's replication books grew without bound;
8. a commit that landed just before a tier reset was indexed as on disk;
9. a pending put whose anchor was deleted leaked the anchor's pages;
10. the cluster token registered namespaces of tenants no tenants file lists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb
import pytest

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import KVLayout, Kind, Namespace, StateLayout
from prefixstore.protocol.probe import ProbeRequest
from prefixstore.protocol.wire import LookupRequest
from prefixstore.store import Store, StoreConfig
from prefixstore.store import index as index_module

from prefixstore.store.lmdb_tier import TierDamaged, db_key

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload
from ..store.harness import CoreHarness
from ..samples import sample
from .helpers import CLUSTER_TOKEN, TOKENS, raw_post, write_tenants

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
NS = make_namespace(block_tokens=4)


def ram_config(**knobs: object) -> StoreConfig:
    values: dict[str, object] = dict(port=0, data_dir="none", ram_bytes=8 << 20, page_bytes=256, nixl="off")
    values.update(knobs)
    return StoreConfig(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 1. scan amplification


def _crowded(h: CoreHarness, levels: int, per_level: int) -> list[int]:
    """A prompt of ``levels`` blocks, and under each of its levels ``per_level`` stored tails whose
    tokens differ from the prompt's, each with a snapshot: a lookup's snapshot search must look at
    every level (none of their snapshots agrees with the prompt)."""
    prompt = [7 * i % 97 + 1000 for i in range(levels * 4)]
    h.save(prompt, len(prompt))
    for j in range(levels):
        for k in range(per_level):
            other = prompt[: j * 4] + [5000 + k, 6000 + j, 7000]  # a 3-token tail under h_j
            h.save(other, len(other), {len(other): state_payload(NS, other, len(other))})
    return prompt


def _count_comparisons(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = index_module.lcp_tokens

    def counting(a: bytes, b: bytes) -> int:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(index_module, "lcp_tokens", counting)
    return calls


def test_a_lookup_compares_a_bounded_number_of_entries(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    scan = 8
    h = CoreHarness(ram_config(max_child_scan=scan, state_admission="always"), NS)
    try:
        prompt = _crowded(h, levels=20, per_level=scan)  # 160 snapshots that never agree
        calls = _count_comparisons(monkeypatch)
        _, answer = h.lookup(prompt, lease=False)
        assert answer.kv_tokens == len(prompt)  # the blocks still match: only the search is bounded
        assert calls[0] <= 8 * scan  # SCAN_BUDGET_PER_SCAN; before: 20 levels x 8 snapshots, more with more levels
    finally:
        h.close()


def test_a_probe_compares_a_bounded_number_of_entries_and_levels_are_a_prompts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scan = 8
    h = CoreHarness(ram_config(max_child_scan=scan, state_admission="always"), NS)
    try:
        prompt = _crowded(h, levels=20, per_level=scan)
        p = Prompt(NS, prompt)
        req = ProbeRequest(namespace_id=NS.id, start=0, parent=p.root, hashes=b"".join(p.hashes[:20]),
                           tokens=p.tokens(0, 80), lease=False)
        calls = _count_comparisons(monkeypatch)
        h.store.probe(req)
        assert calls[0] <= 8 * scan  # SCAN_BUDGET_PER_SCAN
        # A probe is a slice of one prompt: each level once, its tokens one block per hash. The
        # amplification's cheapest form (one level named over and over) has no spelling; a body whose
        # tokens do not match its hashes is refused outright.
        bad = {**req.to_header(), "tokens": p.tokens(0, 4) * 50}
        with pytest.raises(Exception, match="tokens"):
            ProbeRequest.from_header(bad, h.store.limits, lambda ns_id: 4)
    finally:
        h.close()


# ---------------------------------------------------------------- 2, 3. extra keys and tiny entries


async def test_extra_keys_are_bounded(start_store: StartStore) -> None:
    running = await start_store(ram_config())
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": NS.to_wire()}, None)).status == 200
    p = Prompt(NS, [1, 2, 3, 4], extra_keys=[b"x" * 2048])
    spec, _, _ = p.kv_items(4)[0]
    answer = await raw_post(running.url, "/v1/offer", {"ns": NS.id, "items": [spec.to_wire()]}, None)
    assert answer.status == 413 and answer.body["field"] == "items[0].extra"


TINY = Namespace(model="tiny", kv=KVLayout(num_layers=1, num_heads=1, head_dim=1, dtype="int8"),
                 block_tokens=1, tenant="beta")  # 2 payload bytes a block


async def test_tiny_entries_are_charged_their_records(start_store: StartStore, tmp_path: Path) -> None:
    """200k one-byte blocks took 274 MiB of RSS on a 1 MiB quota: the record is charged now."""
    quota = 64 << 10
    tenants = write_tenants(tmp_path / "t.toml", quotas={"beta": quota})
    running = await start_store(ram_config(tenants_file=str(tenants)))
    tokens = list(range(400))
    async with running.client(TINY, token=TOKENS["beta"]) as c:
        res = await c.save(c.prompt(tokens), len(tokens), lambda a, b: bytes(2 * (b - a)))
    held = len(running.store.index.entries)
    assert 0 < held < quota // 512  # each block costs its record, not its 2 payload bytes
    assert running.store.tenant_bytes["beta"] <= quota
    assert res.stored == held


async def test_max_entries_bounds_the_index(start_store: StartStore) -> None:
    running = await start_store(ram_config(max_entries=50))
    ns = Namespace(model="tiny", kv=TINY.kv, block_tokens=1)
    async with running.client(ns) as c:
        for start in range(0, 300, 30):
            tokens = list(range(start, start + 30))
            await c.save(c.prompt(tokens), 30, lambda a, b: bytes(2 * (b - a)))
            assert len(running.store.index.entries) <= 50
    running.store.check()


# ---------------------------------------------------------------- 4. sighting filter


def test_sighting_filters_are_seeded_with_a_secret() -> None:
    a = Store(ram_config(state_admission="second-hit"))
    b = Store(ram_config(state_admission="second-hit"))
    fa, fb = a.admission[Kind.STATE].seen, b.admission[Kind.STATE].seen  # type: ignore[attr-defined]
    assert fa.seed != 0 and fa.seed != fb.seed  # bit positions nobody outside the process can compute
    key = b"\x03" + NS.id + b"\x11" * 16
    assert fa.bits(key) != fb.bits(key)


# ---------------------------------------------------------------- 5. LMDB errors outside the damage list


async def test_an_lmdb_error_outside_the_damage_list_is_never_a_500(start_store: StartStore, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """MDB_PAGE_FULL from a delete after a corrupt read escaped as a 500 four times in a row."""
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=1 << 20, page_bytes=4096, nixl="off")
    running = await start_store(config)
    tokens = list(range(40))
    async with running.client(NS) as c:
        await c.save(c.prompt(tokens), 40, lambda a, b: kv_payload(NS, tokens, a, b))
    await running.server.close()
    running = await start_store(config)  # RAM empty: reads come from LMDB
    tier = running.store.tier
    assert tier is not None
    monkeypatch.setattr(tier, "env", _Refusing(tier.env))  # every transaction of this environment fails
    async with running.client(NS) as c:
        found = await c.lookup(tokens)
        got = await c.read([item for item, _, _ in found.kv_reads(found.kv_tokens)], [bytearray(4096)] * 10)
        assert all(n == -1 for n in got)  # misses, never bytes
    assert sum(sample(running.store, "prefixstore_requests_total", endpoint=e, status="5xx")
               for e in ("/v1/lookup", "/v1/get", "/v1/put", "/v1/offer")) == 0
    assert sample(running.store, "prefixstore_lmdb_resets_total") == 1  # set aside: a fresh environment serves on
    async with running.client(NS) as c:
        assert (await c.save(c.prompt(tokens), 40, lambda a, b: kv_payload(NS, tokens, a, b))).stored == 10


class _Refusing:
    """An LMDB environment whose every transaction fails with an error outside the damage list."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def begin(self, *args: object, **kwargs: object) -> None:
        raise lmdb.PageFullError("MDB_PAGE_FULL (injected)")

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)


# ---------------------------------------------------------------- 7. single-node replication books


async def test_a_single_nodes_replication_books_stay_empty(start_store: StartStore, tmp_path: Path) -> None:
    from prefixstore.store.cluster import REPLICATOR

    running = await start_store(ram_config())
    replicator = running.server.app[REPLICATOR]
    async with running.client(NS) as c:
        for k in range(30):
            tokens = [k, k + 1, k + 2, k + 3]
            await c.save(c.prompt(tokens), 4, lambda a, b, t=tokens: kv_payload(NS, t, a, b))
            found = await c.lookup(tokens)
            await c.read([item for item, _, _ in found.kv_reads(4)], [bytearray(4096)])
    assert replicator.tracked == 0  # before: a read-rate slot per entry ever read, never pruned
    running.store.flush()
    assert not running.store.replica_keys


# ---------------------------------------------------------------- 8. a commit that lands before a reset


async def test_a_commit_racing_a_tier_reset_is_not_indexed_as_on_disk(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                              disk_bytes=64 << 20, nixl="off"))
    await store.start()
    try:
        await store.register_namespace(NS)
        tier = store.tier
        assert tier is not None
        real = tier._write_txn
        calls = [0]

        def write_txn(body: object) -> bool:
            calls[0] += 1
            if calls[0] == 1:  # the first commit meets damage; the second is queued behind it
                time.sleep(0.05)
                raise TierDamaged("injected")
            return real(body)  # type: ignore[arg-type]

        monkeypatch.setattr(tier, "_write_txn", write_txn)

        def put(tokens: list[int]) -> list[bytes]:
            p = Prompt(NS, tokens)
            specs, payloads = [], []
            for spec, a, b in p.kv_items(len(tokens)):
                payloads.append(kv_payload(NS, tokens, a, b))
                specs.append(with_payload(spec, payloads[-1]))
            plan = store.plan_put(NS.id, specs)
            for target, payload in zip(plan.targets, payloads):
                pos = 0
                for view in target or []:
                    view[:] = payload[pos : pos + len(view)]
                    pos += len(view)
            store.verify_put(plan)
            return plan.keys

        b_keys, a_keys = put(list(range(500, 516))), put(list(range(100, 116)))
        await asyncio.gather(store.commit(NS.id, b_keys), store.commit(NS.id, a_keys))
        with tier.env.begin() as txn:
            entries = tier.env.open_db(b"entries", txn=txn)
            missing = [e for e in store.index.entries.values()
                       if e.on_disk and txn.get(db_key(e.key), db=entries) is None]
        assert missing == []  # before: the racing commit's 4 entries, indexed, gone with the old file
        store.check()
    finally:
        await store.close()


# ---------------------------------------------------------------- 9. an anchor deleted under a pending put


def test_an_anchor_deleted_under_a_pending_put_gives_its_pages_back() -> None:
    h = CoreHarness(ram_config(ram_bytes=1 << 20, page_bytes=4096), NS)
    try:
        free = h.store.arena.num_free
        tokens = [1, 2, 3, 4, 5, 6, 7, 8]
        h.save(tokens[:4], 4)  # block 1
        p = Prompt(NS, tokens)
        spec, a, b = p.kv_items(8)[1]  # block 2: pins block 1 while pending
        plan = h.store.plan_put(NS.id, [with_payload(spec, kv_payload(NS, tokens, a, b))])
        assert h.store.flush() == 1  # block 1 deleted while pinned
        h.store.abort_put(plan)  # the pending put goes: its pin on block 1 with it
        assert h.store.arena.num_free == free  # before: block 1's pages leaked
        h.store.check()
    finally:
        h.close()


# ---------------------------------------------------------------- 10. the cluster token and tenants


async def test_the_cluster_token_registers_only_listed_tenants(start_store: StartStore, tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "t.toml")
    running = await start_store(ram_config(tenants_file=str(tenants), peers="http://127.0.0.1:1,http://127.0.0.1:2"))
    listed = make_namespace(tenant="alpha")
    made_up = make_namespace(tenant="mallory")
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": listed.to_wire()}, CLUSTER_TOKEN)).status == 200
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": made_up.to_wire()}, CLUSTER_TOKEN)
    assert answer.status == 403 and answer.body["field"] == "ns"
    assert made_up.id not in running.store.namespaces


__all__ = ["StateLayout", "LookupRequest"]

"""What one tenant holding a valid token can make the node hold (issue 30, defects 1, 2, 4 and 6).

1. memory past ``ram_bytes``: gets naming a disk-only entry over and over, never read, while the
   arena is pinned, each held a buffer per mention of the whole entry;
2. the arena pinned by one tenant's leases, refusing every other tenant's saves;
4. ``max_entries`` one pool: one tenant's long prompt evicted another tenant's entries;
6. lookup reports, bounded per report but not by rate, moving every tenant's hit-rate counters.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.prompt import Prompt
from prefixstore.protocol import KVLayout, Namespace
from prefixstore.protocol.wire import CONTENT_TYPE, GetItem, encode_frame, encode_get_items
from prefixstore.store import StoreConfig
from prefixstore.store.index import Entry
from prefixstore.store.leases import Leases

from ..conftest import RunningStore
from ..factories import kv_payload
from ..serve_process import StartServe, http_get, serving
from ..samples import sample
from .helpers import TOKENS, write_tenants

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
MIB = 1 << 20
BLOCK = 32


def mib_namespace(tenant: str) -> Namespace:
    """1 MiB blocks: 32 tokens x 4 layers x 8 KiB."""
    return Namespace(model="mib", kv=KVLayout(num_layers=4, num_heads=8, head_dim=128, dtype="float32"),
                     block_tokens=BLOCK, tenant=tenant)


def prompt_tokens(n: int) -> list[int]:
    return [n * 1000 + i + 1 for i in range(BLOCK)]


async def save_prompts(c: PrefixClient, first: int, count: int) -> None:
    for n in range(first, first + count):
        tokens = prompt_tokens(n)
        res = await c.save(c.prompt(tokens), BLOCK, lambda a, b, t=tokens: kv_payload(c.namespace, t, a, b))
        assert res.stored == 1, res


async def pin_arena(url: str, ns: Namespace, first: int, count: int) -> PrefixClient:
    """``count`` leases over the 1 MiB entries of prompts first.. (never released while the client lives)."""
    c = PrefixClient(ns, ClientConfig(url=url, token=TOKENS[ns.tenant]))
    for n in range(first, first + count):
        assert (await c.lookup(prompt_tokens(n))).lease_id is not None
    return c


def get_request(url: str, ns: Namespace, items: list[GetItem]) -> bytes:
    body = encode_frame({"ns": ns.id, **encode_get_items(items)})
    host = url.split("//", 1)[1]
    return (f"POST /v1/get HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Authorization: Bearer {TOKENS[ns.tenant]}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def stalled_gets(url: str, requests: list[bytes]) -> list[asyncio.StreamWriter]:
    """Send each request on its own connection and never read the answers."""
    host, port = url.split("//", 1)[1].split(":")
    writers = []
    for req in requests:
        _, writer = await asyncio.open_connection(host, int(port), limit=1 << 16)
        writer.transport.set_write_buffer_limits(0)
        writer.write(req)
        await writer.drain()
        writers.append(writer)
    return writers


async def poll(predicate: Callable[[], bool], what: str, deadline_s: float = 20.0) -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"not within {deadline_s}s: {what}"
        await asyncio.sleep(0.02)


def tenanted(tmp_path: Path, quotas: dict[str, int] | None = None, **knobs: object) -> StoreConfig:
    values: dict[str, object] = dict(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=16 * MIB, page_bytes=64 << 10,
                                     disk_bytes=1 << 30, nixl="off",
                                     tenants_file=str(write_tenants(tmp_path / "t.toml", quotas)))
    values.update(knobs)
    return StoreConfig(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 1. memory past ram_bytes


@pytest.mark.parametrize("layers", [None, (0, 1)], ids=["whole", "one-layer"])
async def test_a_get_loads_each_disk_only_entry_once_and_only_its_range(
        start_store: StartStore, tmp_path: Path, layers: tuple[int, int] | None) -> None:
    """One get naming one disk-only 1 MiB key 200 times while every arena page is pinned: before,
    200 buffers of the whole entry (200 MiB; 1 MiB each even for a one-layer range, which
    max_get_bytes counts as 256 KiB); now one buffer of the range asked, shared."""
    # The whole arena pinned by leases: possible with max_leased_share=1, and with several tenants at any share.
    running = await start_store(tenanted(tmp_path, {"alpha": 96 * MIB}, max_leased_share=1.0))
    ns = mib_namespace("alpha")
    async with PrefixClient(ns, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
        await save_prompts(c, 0, 48)
    await running.store.drain_writes()
    pins = await pin_arena(running.url, ns, 32, 16)
    store = running.store
    try:
        assert store.arena.num_free == 0
        key = Prompt(ns, prompt_tokens(0)).block_key(0)
        assert store.entry(ns.id, key).pages is None  # type: ignore[union-attr]  # disk only
        item = GetItem(key=key) if layers is None else GetItem(key=key, layer_start=layers[0], layer_end=layers[1])
        writers = await stalled_gets(running.url, [get_request(running.url, ns, [item] * 200)])
        await poll(lambda: store.reads.buffered_bytes > 0, "the get read its entry")
        expected = MIB if layers is None else MIB // 4
        assert store.reads.buffered_bytes == expected  # before: 200 MiB, for either
        assert store.metrics.registry.get_sample_value("prefixstore_read_buffer_bytes") == expected
        for w in writers:
            w.close()
        await poll(lambda: store.reads.buffered_bytes == 0, "the buffer given back when the client left")
    finally:
        await pins.close()
    store.check()


async def test_head_ranges_read_into_a_shared_buffer_are_the_saved_slices(
        start_store: StartStore, tmp_path: Path) -> None:
    """Head ranges (a TP rank's read, docs/design.md "One layout for every TP size") of a disk-only
    entry while every arena page is pinned: the items naming it share one buffer from the first
    byte any of them asks for, and each gets exactly its runs -- equal to the slice cut by hand,
    the entry still on disk only (it never came through the arena)."""
    from ..factories import head_slice

    running = await start_store(tenanted(tmp_path, {"alpha": 96 * MIB}, max_leased_share=1.0))
    ns = mib_namespace("alpha")
    async with PrefixClient(ns, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
        await save_prompts(c, 0, 48)
    await running.store.drain_writes()
    pins = await pin_arena(running.url, ns, 32, 16)
    store = running.store
    try:
        assert store.arena.num_free == 0
        asked = [(0, (2, 4), None), (0, (5, 6), None), (0, (1, 3), (1, 3)), (1, (7, 8), None)]
        keys = [Prompt(ns, prompt_tokens(n)).block_key(0) for n in (0, 1)]
        items = [GetItem(key=keys[n], head_start=h[0], head_end=h[1], layer_start=(l or (0, 0))[0],
                         layer_end=None if l is None else l[1]) for n, h, l in asked]
        want = [head_slice(ns, kv_payload(ns, prompt_tokens(n), 0, BLOCK), BLOCK, h, l) for n, h, l in asked]
        async with PrefixClient(ns, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
            outs = [bytearray(len(w)) for w in want]
            assert await c.read(items, outs) == [len(w) for w in want]
        assert [bytes(o) for o in outs] == want
        assert all(store.entry(ns.id, k).pages is None for k in keys)  # type: ignore[union-attr]
        assert store.reads.buffered_bytes == 0
    finally:
        await pins.close()
    store.check()


async def test_read_buffers_are_bounded_across_gets(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_store(tenanted(tmp_path, {"alpha": 96 * MIB}, max_leased_share=1.0,
                                         read_buffer_bytes=2 * MIB))
    ns = mib_namespace("alpha")
    async with PrefixClient(ns, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
        await save_prompts(c, 0, 48)
    await running.store.drain_writes()
    pins = await pin_arena(running.url, ns, 32, 16)
    store = running.store
    try:
        requests = [get_request(running.url, ns, [GetItem(key=Prompt(ns, prompt_tokens(n)).block_key(0))] * 50)
                    for n in range(4)]
        writers = await stalled_gets(running.url, requests)
        await poll(lambda: sample(store, "prefixstore_read_buffer_refusals_total") >= 100, "two gets past the bound answered as misses")
        assert store.reads.buffered_bytes == 2 * MIB  # two entries' worth, never more
        for w in writers:
            w.close()
        await poll(lambda: store.reads.buffered_bytes == 0, "the buffers given back")
    finally:
        await pins.close()
    async with PrefixClient(ns, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
        out = [bytearray(MIB)]
        assert await c.read([GetItem(key=Prompt(ns, prompt_tokens(0)).block_key(0))], out) == [MIB]
        assert bytes(out[0]) == kv_payload(ns, prompt_tokens(0), 0, BLOCK)  # served again once room is back


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def rss_bytes(pid: int) -> int:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m is not None
    return int(m.group(1)) << 10


def gauge(url: str, name: str) -> float:
    _, body = http_get(url + "/metrics")
    m = re.search(rf"^{name} (\S+)$", body.decode(), re.M)
    assert m is not None, name
    return float(m.group(1))


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "layer-ranges"])
async def test_the_issues_pattern_leaves_rss_within_ram_and_the_buffer_bound(
        serve: StartServe, tmp_path: Path, ranged: bool) -> None:
    """The issue's run against a real ``prefixstore serve``: 48 x 1 MiB saved, the 16 MiB arena
    pinned by 16 leases, 4 connections each sending one get that names a disk-only key 200 times
    and never reading. Before: RSS 77 -> 878 MiB (+657 MiB with layer ranges at max_get_bytes=4MiB),
    still there after the clients left. Now: within read_buffer_bytes (8 MiB here) of where it was,
    and back down once they leave."""
    tenants = write_tenants(tmp_path / "t.toml", {"alpha": 96 * MIB})
    knobs = ["--max-get-bytes", "4MiB"] if ranged else []
    proc = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"), "--ram-bytes", "16MiB", "--page-bytes", "64KiB",
                 "--tenants-file", str(tenants), "--max-leased-share", "1", "--read-buffer-bytes", "8MiB", *knobs)
    url = proc.url
    assert url is not None and proc.proc.pid
    ns = mib_namespace("alpha")
    async with PrefixClient(ns, ClientConfig(url=url, token=TOKENS["alpha"])) as c:
        await save_prompts(c, 0, 48)
    pins = await pin_arena(url, ns, 32, 16)
    try:
        before = rss_bytes(proc.proc.pid)
        requests = []
        for n in range(4):
            key = Prompt(ns, prompt_tokens(n)).block_key(0)
            item = GetItem(key=key, layer_start=n % 4, layer_end=n % 4 + 1) if ranged else GetItem(key=key)
            requests.append(get_request(url, ns, [item] * (16 if ranged else 200)))
        writers = await stalled_gets(url, requests)
        await poll(lambda: gauge(url, "prefixstore_read_buffer_bytes") > 0, "the gets were prepared")
        await asyncio.sleep(0.5)  # what is held now, is held: the gets wait on their readers
        grown = rss_bytes(proc.proc.pid) - before
        assert grown <= 8 * MIB + 24 * MIB, f"RSS grew {grown / MIB:.0f} MiB"
        for w in writers:
            w.close()
        await poll(lambda: gauge(url, "prefixstore_read_buffer_bytes") == 0, "the buffers given back")
        assert rss_bytes(proc.proc.pid) - before <= 24 * MIB  # before: still +800 MiB 12 s later
    finally:
        await pins.close()
    assert proc.stop() == 0


# ---------------------------------------------------------------- 2. leases pin the arena


async def test_one_tenants_leases_cannot_pin_the_arena_against_another(start_store: StartStore,
                                                                       tmp_path: Path) -> None:
    """Alpha (96 MiB quota) saves 48 x 1 MiB and pins the 16 MiB arena with 16 leases. Before:
    beta's one 1 MiB save was refused ("RAM arena full of pinned or uncommitted entries")."""
    running = await start_store(tenanted(tmp_path, {"alpha": 96 * MIB}))
    alpha, beta = mib_namespace("alpha"), mib_namespace("beta")
    async with PrefixClient(alpha, ClientConfig(url=running.url, token=TOKENS["alpha"])) as c:
        await save_prompts(c, 0, 48)
    await running.store.drain_writes()
    pins = await pin_arena(running.url, alpha, 32, 16)
    store = running.store
    try:
        bound = int(store.config.max_leased_share * store.config.ram_bytes)
        assert bound == 4 * MIB
        assert store.leases.bytes_held_by("alpha") <= bound  # the 12 oldest leases ended early
        assert store.held_by("alpha")["leases"] == 4
        assert store.metrics.registry.get_sample_value("prefixstore_tenant_leased_bytes",
                                                       {"tenant": "alpha"}) == 4 * MIB
        async with PrefixClient(beta, ClientConfig(url=running.url, token=TOKENS["beta"])) as b:
            tokens = prompt_tokens(7)
            res = await b.save(b.prompt(tokens), BLOCK, lambda s, e: kv_payload(beta, tokens, s, e))
            assert res.stored == 1, res  # before: rejected, the arena all alpha's pins
        # Alpha's newest leases still hold: what it reads next is there.
        got = await pins.read([GetItem(key=Prompt(alpha, prompt_tokens(47)).block_key(0))], [bytearray(MIB)])
        assert got == [MIB]
    finally:
        await pins.close()
    store.check()


def _entry(n: int, size: int) -> Entry:
    from prefixstore.protocol import Kind
    from prefixstore.protocol.hashing import BlockHash

    return Entry(key=bytes([1]) + bytes(8) + n.to_bytes(16, "little"), kind=Kind.BLOCK,
                 hash=BlockHash(n.to_bytes(16, "little")), namespace_id=bytes(8), parent=None, start=0, tokens=b"",
                 extra=b"", container=None, boundary=0, size=size, checksum=0)


def test_leases_charge_bytes_to_their_owner_and_extend_only_within_the_bound() -> None:
    def unpin(e: Entry) -> None:
        e.pins -= 1

    leases = Leases(unpin, max_per_owner=100, max_bytes_per_owner=10)
    a = [_entry(i, 3) for i in range(8)]
    first = leases.grant(a[:2], 0.0, 30.0, owner="t")  # 6 bytes
    second = leases.grant(a[2:4], 0.0, 30.0, owner="t")  # 12 > 10: the first ends
    assert not leases.holds(first) and leases.holds(second)
    assert leases.bytes_held_by("t") == 6 and [e.pins for e in a[:4]] == [0, 0, 1, 1]
    other = leases.grant(a[4:5], 0.0, 30.0, owner="u")  # another owner's bytes are its own
    assert leases.bytes_held_by("u") == 3 and leases.holds(second)
    pinned = leases.extend(second, a[5:8])  # 6 + 3 fits, one more would not
    assert pinned == [a[5]] and a[6].pins == 0 and leases.bytes_held_by("t") == 9
    big = leases.grant([_entry(9, 25)], 0.0, 30.0, owner="t")  # alone over the bound: granted, the rest ended
    assert leases.holds(big) and not leases.holds(second) and leases.bytes_held_by("t") == 25
    assert leases.extend(big, [a[7]]) == []  # nothing more while it alone is over
    leases.release(big)
    leases.release(other)
    assert leases.bytes_by_owner == {} and all(e.pins == 0 for e in a)


# ---------------------------------------------------------------- 4. entry slots


async def test_one_tenants_long_prompt_cannot_evict_anothers_entries(start_store: StartStore, tmp_path: Path) -> None:
    """Two 4 MiB quotas and max_entries=3000. Before: alpha saved one 3,000-block prompt inside its
    quota and max_entries deleted all 200 of beta's entries (200/200 hits -> 0/200)."""
    from ..factories import make_namespace

    running = await start_store(tenanted(tmp_path, {"alpha": 4 * MIB, "beta": 4 * MIB}, data_dir="none",
                                         ram_bytes=64 * MIB, page_bytes=4096, max_entries=3000))
    alpha, beta = make_namespace(tenant="alpha", block_tokens=1, num_layers=1), \
        make_namespace(tenant="beta", block_tokens=1, num_layers=1)
    betas = [[50_000 + 10 * n + i for i in range(4)] for n in range(50)]  # 50 prompts x 4 blocks
    async with PrefixClient(beta, ClientConfig(url=running.url, token=TOKENS["beta"])) as b, \
            PrefixClient(alpha, ClientConfig(url=running.url, token=TOKENS["alpha"])) as a:
        for tokens in betas:
            res = await b.save(b.prompt(tokens), 4, lambda s, e, t=tokens: kv_payload(beta, t, s, e))
            assert res.stored == 4, res
        long = list(range(1, 3001))
        res = await a.save(a.prompt(long), len(long), lambda s, e: kv_payload(alpha, long, s, e))
        assert res.dropped == 0
        hits = sum([(await b.lookup(tokens, lease=False)).kv_tokens == 4 for tokens in betas])
        assert hits == 50  # before: 0 of 50 prompts (0/200 entries)
        assert running.store.held_by("beta")["entries"] == 200
        share = running.store.ledger.entry_share
        assert share == 1500
        assert running.store.held_by("alpha")["entries"] == share  # the rest refused as over its share
    running.store.check()


# ---------------------------------------------------------------- 6. lookup reports by rate


async def test_lookup_reports_move_the_counters_no_faster_than_a_tenants_lookups(
        start_store: StartStore, tmp_path: Path) -> None:
    """Before: 2,000 reports in 0.5 s added 4.19e9 miss tokens to the counters behind every
    tenant's hit-rate panels (each within max_lookup_tokens; nothing bounded their rate)."""
    from ..factories import make_namespace
    from .helpers import raw_post

    running = await start_store(tenanted(tmp_path, data_dir="none", ram_bytes=4 * MIB, page_bytes=4096,
                                         peers="http://127.0.0.1:1,http://127.0.0.1:2"))
    ns = make_namespace(tenant="beta", block_tokens=4)
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": ns.to_wire()}, TOKENS["beta"])).status == 200

    def kv_misses() -> float:
        return sample(running.store, "prefixstore_lookup_tokens_total", kind="kv", result="miss")

    most = running.store.config.max_lookup_tokens
    report = {"ns": ns.id, "num_tokens": most, "kv_tokens": 0, "state_tokens": 0, "junction": None, "missing": None}
    before = kv_misses()
    for _ in range(200):
        answer = await raw_post(running.url, "/v1/lookup_report", report, TOKENS["beta"])
        assert answer.status == 200  # never an error: a client's breaker must not open on it
    added = kv_misses() - before
    assert added <= 8 * most  # before: 200 x 2,097,152 = 4.2e8 at once
    dropped = running.store.metrics.registry.get_sample_value("prefixstore_lookup_reports_dropped_total")
    assert dropped is not None and dropped >= 190
    # Real lookups earn their reports: a probe carrying a prompt lets one report of it count.
    p = Prompt(ns, list(range(1, 41)))
    probe = {"ns": ns.id, "start": 0, "parent": p.root, "hashes": b"".join(p.hashes), "tokens": p.packed,
             "lease": False}
    small = {**report, "num_tokens": 40}
    for _ in range(200):  # spend what is left of the allowance
        await raw_post(running.url, "/v1/lookup_report", small, TOKENS["beta"])
    before = kv_misses()
    for _ in range(20):
        assert (await raw_post(running.url, "/v1/probe", probe, TOKENS["beta"])).status == 200
        assert (await raw_post(running.url, "/v1/lookup_report", small, TOKENS["beta"])).status == 200
    assert kv_misses() - before >= 20 * 40 - 40  # each probed prompt's report counted


async def test_a_lean_probe_of_made_up_hashes_earns_what_it_carries_not_what_it_claims(
        start_store: StartStore, tmp_path: Path) -> None:
    """A lean probe (spans) carries some levels' tokens and claims the prompt's length in
    total_tokens, bounded only by the hashes sent (16 bytes a block). Earning by that claim let
    4 carried tokens and made-up hashes pay for reports of 4,000 tokens each."""
    from ..factories import make_namespace
    from .helpers import raw_post

    # A small max_lookup_tokens: the allowance refills at 4,096 tokens a second, not 2 million.
    running = await start_store(tenanted(tmp_path, data_dir="none", ram_bytes=4 * MIB, page_bytes=4096,
                                         max_lookup_tokens=4096, peers="http://127.0.0.1:1,http://127.0.0.1:2"))
    ns = make_namespace(tenant="beta", block_tokens=4)
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": ns.to_wire()}, TOKENS["beta"])).status == 200

    def kv_misses() -> float:
        return sample(running.store, "prefixstore_lookup_tokens_total", kind="kv", result="miss")

    root = Prompt(ns, [1]).root
    report = {"ns": ns.id, "num_tokens": 4000, "kv_tokens": 0, "state_tokens": 0, "junction": None, "missing": None}
    for _ in range(20):  # spend the banked allowance
        await raw_post(running.url, "/v1/lookup_report", report, TOKENS["beta"])
    probe = {"ns": ns.id, "start": 0, "parent": root, "hashes": bytes(range(16)) * 1000, "tokens": b"\x01" * 16,
             "spans": [[0, 1]], "total_tokens": 4000, "lease": False}
    before = kv_misses()
    for _ in range(20):
        assert (await raw_post(running.url, "/v1/probe", probe, TOKENS["beta"])).status == 200
        assert (await raw_post(running.url, "/v1/lookup_report", report, TOKENS["beta"])).status == 200
    # Earning by the claim: all 20 reports count (80,000 tokens). Earning by what was carried: the
    # refill's few thousand tokens a second, about one report in the time this takes.
    assert kv_misses() - before <= 4 * 4000, kv_misses() - before


def _mapped_rss(path: Path) -> int:
    """This process's resident bytes of its mappings of ``path`` (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) << 10
    return total


async def test_values_read_out_of_lmdb_do_not_stay_in_rss(tmp_path: Path) -> None:
    """Every value copied out of LMDB's map left its pages mapped: RSS grew by all that was ever
    read (360 MiB in two minutes of benchmarks/pin_soak.py) -- pages nobody needed. The tier lets
    go of its map every UNMAP_EVERY_BYTES copied out."""
    import xxhash

    from prefixstore.store.lmdb_tier import UNMAP_EVERY_BYTES, LmdbTier, StoredRecord

    tier = LmdbTier(tmp_path / "lmdb", disk_bytes=512 * MIB)
    try:
        values = [bytes([i]) * MIB for i in range(192)]
        keys = [bytes([1]) + bytes(8) + i.to_bytes(16, "little") for i in range(len(values))]
        sums = [xxhash.xxh3_64_intdigest(v) for v in values]
        await tier.write([(StoredRecord(key=k, namespace_id=bytes(8), parent=None, start=0, tokens=b"", extra=b"",
                                        container=None, boundary=0, size=MIB, checksum=c), [memoryview(v)])
                          for k, v, c in zip(keys, values, sums)], [])
        out = memoryview(bytearray(MIB))
        data = (tmp_path / "lmdb" / "data.mdb").resolve()
        for k, c, v in zip(keys, sums, values):
            assert await tier.read_into(k, MIB, c, [out]) == "ok" and out[:8] == v[:8]
        assert _mapped_rss(data) <= UNMAP_EVERY_BYTES + 8 * MIB  # before: 192 MiB, every value read
    finally:
        tier.close()

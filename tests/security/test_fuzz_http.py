"""Fuzz the wire parsers over real HTTP: random and mutated frames to every POST endpoint.

Hypothesis draws bodies of three shapes -- raw bytes, well-framed msgpack
headers whose fields are random values under the endpoint's own field names,
and byte-level mutations (flips, cuts, splices) of a valid request -- and
POSTs them to a real in-process store: the core endpoints, the cluster ones
(probe, lookup report, replica drop) and, where nixl is installed, the NIXL ones
against a store serving NIXL. Every answer must be 2xx or 4xx, never
5xx (the middleware's ``prefixstore_requests_total{status="5xx"}`` must stay
0 too, so a 500 swallowed by a client would still fail the test), and
afterwards the store must keep serving: what was stored before reads back
byte-identical, a new save + lookup + read works and ``Store.check()`` holds.

The budget is fixed (``max_examples`` per endpoint, no deadline), so the test
runs in CI in a few seconds; it is a regression net, not a campaign.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixstore.client import PrefixClient
from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import make_entry_key, pack_tokens
from prefixstore.protocol.probe import LookupReport, ProbeRequest
from prefixstore.protocol.wire import CONTENT_TYPE, MAGIC, PREFIX, WIRE_VERSION, decode_frame, encode_frame

from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..nixl.conftest import NEEDS_NIXL
from ..factories import kv_payload, make_namespace, state_payload
from ..store.test_bad_input import SEED_SNAPSHOT, SEED_TOKENS, Seeded, fresh_tokens, num_5xx, read_back, seed

NS = make_namespace()
MAX_EXAMPLES = 150  # per endpoint: ~1,000 requests in all, a few seconds

# Field names each endpoint reads, so generated headers reach past "missing".
FIELDS = {
    "/v1/namespaces": ["namespace"],
    "/v1/lookup": ["ns", "hashes", "tokens", "lease", "locations", "extras"],
    "/v1/offer": ["ns", "items"],
    "/v1/put": ["ns", "items", "commit"],
    "/v1/commit": ["ns", "keys"],
    "/v1/get": ["ns", "items", "keys", "layers", "heads"],
    "/v1/release": ["lease"],
    # cluster (store/cluster.py): served by every node
    "/v1/probe": ["ns", "start", "parent", "hashes", "tokens", "extras", "lease"],
    "/v1/lookup_report": ["ns", "num_tokens", "kv_tokens", "state_tokens", "junction", "missing"],
    "/v1/replica/drop": ["ns", "keys"],
}
# NIXL (store/nixl_target.py): fuzzed against a store serving it, where nixl is installed.
NIXL_FIELDS = {
    "/v1/nixl/metadata": ["x"],
    "/v1/nixl/get": ["ns", "items", "keys", "heads"],
    "/v1/nixl/reserve": ["ns", "items"],
    "/v1/nixl/commit": ["ns", "keys", "commit"],
    # a lookup that asks for placements (store/nixl_lookup.py), of the seeded prompt so it places some
    "/v1/lookup#nixl": ["ns", "hashes", "tokens", "lease", "nixl"],
}
ITEM_FIELDS = ["kind", "hash", "size", "parent", "tokens", "extra", "container", "boundary", "checksum", "origin"]
NS_FIELDS = ["model", "kv", "state", "block_tokens", "tp_rank", "tp_size", "tenant", "scheme"]
ENDPOINTS = list(FIELDS)
FIELDS.update(NIXL_FIELDS)


def _valid_bodies() -> dict[str, bytes]:
    """One well-formed request per endpoint, the seed of the mutations (fresh tokens: nothing stored)."""
    toks = list(range(50_000, 50_010))
    p = Prompt(NS, toks)
    specs = []
    payloads = []
    for spec, a, b in p.kv_items(10):
        data = kv_payload(NS, toks, a, b)
        specs.append(with_payload(spec, data))
        payloads.append(data)
    snap = with_payload(p.state_item(7, 10), state_payload(NS, toks, 7))
    items = [s.to_wire() for s in specs] + [snap.to_wire()]
    keys = [make_entry_key(s.kind, s.hash) for s in specs]
    return {
        "/v1/namespaces": encode_frame({"namespace": NS.to_wire()}),
        "/v1/lookup": encode_frame({"ns": NS.id, "hashes": b"".join(p.hashes), "tokens": pack_tokens(toks),
                                    "extras": [[0, b"x"]]}),
        "/v1/offer": encode_frame({"ns": NS.id, "items": items}),
        "/v1/put": encode_frame({"ns": NS.id, "items": items, "commit": False},
                                [*payloads, state_payload(NS, toks, 7)]),
        "/v1/commit": encode_frame({"ns": NS.id, "keys": keys}),
        "/v1/get": encode_frame({"ns": NS.id, "items": [[k, 0, None] for k in keys] + [[keys[0], 1, 2], [keys[0], 0, None, 0, 1]]}),
        "/v1/release": encode_frame({"lease": b"\x00" * 16}),
        "/v1/probe": encode_frame(ProbeRequest(namespace_id=NS.id, start=0, parent=p.root,
                                               hashes=b"".join(p.hashes[:2]), tokens=pack_tokens(toks[:10]),
                                               extras=((1, b"x"),)).to_header()),
        "/v1/lookup_report": encode_frame(LookupReport(namespace_id=NS.id, num_tokens=10, kv_tokens=8, state_tokens=7,
                                                       junction=p.prefix_hash(8), missing_block=None).to_header()),
        "/v1/replica/drop": encode_frame({"ns": NS.id, "keys": keys}),
        "/v1/nixl/metadata": encode_frame({}),
        "/v1/nixl/get": encode_frame({"ns": NS.id, "items": [[k, 0, None] for k in keys]}),
        "/v1/nixl/reserve": encode_frame({"ns": NS.id, "items": items}),
        "/v1/nixl/commit": encode_frame({"ns": NS.id, "keys": keys, "commit": True}),
        "/v1/lookup#nixl": encode_frame({"ns": NS.id, "hashes": b"".join(Prompt(NS, SEED_TOKENS).hashes),
                                         "tokens": pack_tokens(SEED_TOKENS), "lease": True, "nixl": True}),
    }


VALID = _valid_bodies()

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
    st.sampled_from([0, 1, 2, 3, 4, 16, 64, 256, 1 << 31, (1 << 62) + 1]),
    st.floats(allow_nan=True), st.text(max_size=12),
    st.binary(max_size=40), st.sampled_from([NS.id, b"\x00" * 8, b"\x01" * 17, b"\x02" * 16, b"\x03" + b"\x00" * 16]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.sampled_from(ITEM_FIELDS + NS_FIELDS + ["x"]), inner, max_size=6),
    ),
    max_leaves=20,
)
items = st.lists(st.dictionaries(st.sampled_from(ITEM_FIELDS), values, max_size=len(ITEM_FIELDS)), max_size=4)


@st.composite
def namespaces(draw: st.DrawFn) -> object:
    """The valid namespace list with one to three fields (or sub-fields) replaced by random values."""
    wire = NS.to_wire()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(wire) - 1))
        if isinstance(wire[i], list) and wire[i] and draw(st.booleans()):
            sub = list(wire[i])
            sub[draw(st.integers(0, len(sub) - 1))] = draw(values)
            wire[i] = sub
        else:
            wire[i] = draw(values)
    return wire


def headers_for(endpoint: str) -> st.SearchStrategy[dict[str, object]]:
    names = FIELDS[endpoint]
    per_field = {n: (st.one_of(items, values) if n in ("items", "keys") else values) for n in names}
    if endpoint == "/v1/namespaces":
        per_field["namespace"] = st.one_of(namespaces(), values)
    return st.fixed_dictionaries({}, optional=per_field)


@st.composite
def mutated(draw: st.DrawFn, endpoint: str) -> bytes:
    body = bytearray(VALID[endpoint])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(body) - 1)))
        if op == "flip" and body:
            body[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del body[pos:]
        elif op == "insert":
            body[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif body:
            del body[pos : pos + draw(st.integers(1, 16))]
    return bytes(body)


@st.composite
def framed(draw: st.DrawFn, endpoint: str) -> bytes:
    header = draw(headers_for(endpoint))
    body = encode_frame(header)
    if draw(st.booleans()):  # payload bytes after the header (put reads them; others must refuse them)
        body += draw(st.binary(max_size=300))
    if draw(st.integers(0, 9)) == 0:  # a prefix whose header_len lies
        body = PREFIX.pack(MAGIC, WIRE_VERSION, draw(st.integers(0, (1 << 32) - 1))) + body[PREFIX.size :]
    return body


def bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=200), framed(endpoint), mutated(endpoint))


async def assert_serving(running: RunningStore, client: PrefixClient, seeded: Seeded) -> None:
    """test_bad_input's health check, except that pending entries may remain: a fuzzed
    put with ``commit: false`` that happens to be valid legitimately leaves one (it
    expires after pending_ttl_s)."""
    running.store.check()
    await read_back(client, seeded.tokens, len(seeded.tokens), SEED_SNAPSHOT)
    toks = fresh_tokens(10)
    r = await client.save(client.prompt(toks), 10, lambda a, b: kv_payload(NS, toks, a, b),
                          {9: state_payload(NS, toks, 9)})
    assert (r.stored, r.rejected, r.dropped) == (4, 0, 0), r
    await read_back(client, toks, 10, 9)
    running.store.check()
    assert not client.failures, client.failures
    assert num_5xx(running) == 0


@pytest.fixture
async def session(running: RunningStore) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=running.url, timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


@pytest.fixture
async def fuzz_client(running: RunningStore) -> AsyncIterator[PrefixClient]:
    c = running.client(NS)
    yield c
    await c.close()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_fuzzed_frames_never_answer_5xx(running: RunningStore, session: aiohttp.ClientSession,
                                              fuzz_client: PrefixClient, endpoint: str) -> None:
    await fuzz(running, session, fuzz_client, endpoint)


@NEEDS_NIXL
@pytest.mark.parametrize("endpoint", list(NIXL_FIELDS))
async def test_fuzzed_nixl_frames_never_answer_5xx(start_store, store_config: StoreConfig,  # type: ignore[no-untyped-def]
                                                   endpoint: str) -> None:
    running = await start_store(dataclasses.replace(store_config, nixl="on"))
    async with aiohttp.ClientSession(base_url=running.url, timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with running.client(NS, data_path="http") as client:
            await fuzz(running, session, client, endpoint)  # seeds the store first
            if endpoint == "/v1/lookup#nixl":  # the seed body reached the placements: the seeded prompt, placed
                async with session.post("/v1/lookup", data=VALID[endpoint],
                                        headers={"Content-Type": CONTENT_TYPE}) as resp:
                    assert resp.status == 200
                    header, _ = decode_frame(await resp.read())
                placed = header["nixl"]
                assert isinstance(placed, dict) and len(placed["entries"]) >= 2  # type: ignore[arg-type]
                assert await client.release(header["lease"])  # type: ignore[arg-type]


async def fuzz(running: RunningStore, session: aiohttp.ClientSession, fuzz_client: PrefixClient,
               endpoint: str) -> None:
    seeded = await seed(fuzz_client)
    statuses: dict[int, int] = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(body=bodies(endpoint), chunked=st.integers(0, 4))
    def one(body: bytes, chunked: int) -> None:
        status = asyncio.run_coroutine_threadsafe(send(body, chunked == 0), loop).result(timeout=30)
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, (endpoint, status, body[:200])

    async def send(body: bytes, chunked: bool) -> int:
        data: bytes | AsyncIterator[bytes] = body
        if chunked:  # no Content-Length: the stream itself decides where the body ends
            async def gen() -> AsyncIterator[bytes]:
                for i in range(0, len(body), 37):
                    yield body[i : i + 37]
            data = gen()
        path = endpoint.split("#")[0]  # "/v1/lookup#nixl": a variant of a path's seed body
        async with session.post(path, data=data, headers={"Content-Type": CONTENT_TYPE}) as resp:
            await resp.read()
            return resp.status

    loop = asyncio.get_running_loop()

    # Hypothesis drives a synchronous test, so it runs on a worker thread and
    # hands each request to this test's event loop, where the store serves.
    await asyncio.to_thread(one)
    assert num_5xx(running) == 0, statuses
    assert set(statuses) <= {200, 400, 403, 404, 409, 413}, statuses
    await assert_serving(running, fuzz_client, seeded)


async def test_flush_ignores_a_garbage_body(running: RunningStore, session: aiohttp.ClientSession,
                                            fuzz_client: PrefixClient) -> None:
    """The one POST that reads no body: garbage there is ignored, not parsed."""
    seeded = await seed(fuzz_client)
    async with session.post("/v1/admin/flush", data=b"\xff" * 100) as resp:
        assert resp.status == 415  # not the frame content type: refused before anything (store/server.py)
    async with session.post("/v1/admin/flush", data=b"\xff" * 100, headers={"Content-Type": CONTENT_TYPE}) as resp:
        assert resp.status == 200
    running.store.check()
    res = await fuzz_client.lookup(seeded.tokens, lease=False)
    assert res.kv_tokens == 0  # flushed
    assert num_5xx(running) == 0


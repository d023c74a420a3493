"""Malformed and hostile requests against a real in-process store (DESIGN §11).

Every bad request must be answered 4xx with a JSON ``{"error", "field"}`` that
names the offending field, never 5xx; afterwards the store keeps serving: a
good save + lookup + read works, ``Store.check()`` passes, and everything
stored before is still found with the same bytes.

Raw bodies are POSTed with a plain ``aiohttp.ClientSession``; ``PrefixClient``
does the good requests. Bodies that must end early or carry no
Content-Length are sent chunked (an async generator), which is the only way
an honest HTTP client can make the stream itself disagree with the header.
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from prefixstore.client import PrefixClient
from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import HASH_BYTES, Kind, Namespace, chain_hash, make_entry_key, pack_tokens, unpack_tokens
from prefixstore.protocol.wire import (
    CONTENT_TYPE,
    MAGIC,
    PREFIX,
    WIRE_VERSION,
    ItemSpec,
    decode_frame,
    encode_frame,
    encode_header,
)
from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload

SEED_TOKENS = list(range(100, 111))  # B=4: blocks [0,4) [4,8), tail [8,11), snapshot at 7 (in block 1)
SEED_SNAPSHOT = 7
_fresh = itertools.count(1)

Body = bytes | Callable[[], AsyncIterator[bytes]]


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other sequence of this module shares (not even the first one)."""
    base = 10_000 + 1000 * next(_fresh)
    return list(range(base, base + n))


# ---------------------------------------------------------------- plumbing


async def post(running: RunningStore, path: str, body: Body) -> tuple[int, bytes]:
    data = body() if callable(body) else body
    async with aiohttp.ClientSession(base_url=running.url) as s:
        async with s.post(path, data=data, headers={"Content-Type": CONTENT_TYPE}) as resp:
            return resp.status, await resp.read()


def assert_error(status: int, raw: bytes, want_status: int, want_field: str) -> None:
    assert status == want_status, (status, raw[:300])
    answer = json.loads(raw)
    assert answer["field"] == want_field, answer
    assert answer["error"].startswith(f"{want_field}:"), answer


def chunked(*parts: bytes) -> Callable[[], AsyncIterator[bytes]]:
    async def gen() -> AsyncIterator[bytes]:
        for p in parts:
            yield p

    return gen


def num_5xx(running: RunningStore) -> float:
    total = 0.0
    for metric in running.store.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "prefixstore_requests_total" and sample.labels.get("status") == "5xx":
                total += sample.value
    return total


@dataclass
class Seeded:
    """What was stored before the bad request: it must survive it."""

    tokens: list[int]
    prompt: Prompt


async def seed(client: PrefixClient) -> Seeded:
    ns = client.namespace
    p = client.prompt(SEED_TOKENS)
    r = await client.save(p, len(SEED_TOKENS), lambda a, b: kv_payload(ns, SEED_TOKENS, a, b),
                          {SEED_SNAPSHOT: state_payload(ns, SEED_TOKENS, SEED_SNAPSHOT)})
    assert (r.stored, r.rejected, r.dropped) == (4, 0, 0), r
    return Seeded(tokens=SEED_TOKENS, prompt=p)


async def read_back(client: PrefixClient, tokens: list[int], kv_upto: int, snapshot: int | None) -> None:
    """Lookup finds KV [0, kv_upto) and the snapshot; the bytes read equal what was saved."""
    ns = client.namespace
    res = await client.lookup(tokens)
    assert res.ok
    assert res.kv_tokens == kv_upto, res
    assert res.state_tokens == (snapshot or 0), res
    reads = res.kv_reads(kv_upto)
    outs = [bytearray(ns.block_bytes) for _ in reads]
    got = await client.read([it for it, _, _ in reads], outs)
    for (_, a, b), out, n in zip(reads, outs, got):
        assert n == (b - a) * ns.kv.token_bytes
        assert bytes(out[:n]) == kv_payload(ns, tokens, a, b)
    if snapshot is not None:
        item = res.state_read()
        assert item is not None
        out = bytearray(ns.state.snapshot_bytes)
        assert await client.read([item], [out]) == [len(out)]
        assert bytes(out) == state_payload(ns, tokens, snapshot)
    await client.release(res.lease_id)


async def assert_healthy(running: RunningStore, client: PrefixClient, seeded: Seeded) -> None:
    """The store still serves: old data intact, a new save + lookup + read works, invariants hold."""
    running.store.check()
    await read_back(client, seeded.tokens, len(seeded.tokens), SEED_SNAPSHOT)
    ns = client.namespace
    toks = fresh_tokens(10)
    r = await client.save(client.prompt(toks), 10, lambda a, b: kv_payload(ns, toks, a, b),
                          {9: state_payload(ns, toks, 9)})
    assert (r.stored, r.rejected, r.dropped) == (4, 0, 0), r
    await read_back(client, toks, 10, 9)
    running.store.check()
    assert not client.failures, client.failures
    assert num_5xx(running) == 0
    assert not running.store.pending


async def assert_not_stored(client: PrefixClient, tokens: list[int]) -> None:
    res = await client.lookup(tokens, lease=False)
    assert res.ok and res.kv_tokens == 0, res


@pytest.fixture
async def seeded(running: RunningStore, client: PrefixClient) -> Seeded:
    return await seed(client)


# ---------------------------------------------------------------- request builders


@dataclass
class Ctx:
    ns: Namespace
    seeded: Seeded
    fresh: Prompt  # 2 full blocks + 2 tokens, nothing of it stored

    @property
    def fresh_tokens(self) -> list[int]:
        return unpack_tokens(self.fresh.packed).tolist()

    def block(self, j: int = 0) -> ItemSpec:
        spec, a, b = self.fresh.kv_items(self.fresh.num_tokens)[j]
        return with_payload(spec, kv_payload(self.ns, self.fresh_tokens, a, b))

    def tail(self) -> ItemSpec:
        spec, a, b = self.fresh.kv_items(self.fresh.num_tokens)[-1]
        assert spec.kind is Kind.TAIL
        return with_payload(spec, kv_payload(self.ns, self.fresh_tokens, a, b))

    def state(self, boundary: int = SEED_SNAPSHOT - 1, hash_at: int | None = None,
              container_block: int = 1) -> ItemSpec:
        """A snapshot of the seeded sequence registered in seeded block ``container_block``."""
        p = self.seeded.prompt
        spec = ItemSpec(kind=Kind.STATE, hash=p.prefix_hash(hash_at or boundary), size=self.ns.state.snapshot_bytes,
                        container=p.block_key(container_block), boundary=boundary)
        return with_payload(spec, state_payload(self.ns, self.seeded.tokens, boundary))


def edit(spec: ItemSpec, **changes: object) -> dict[str, object]:
    d = spec.to_wire()
    d.update(changes)
    return d


def offer_body(ctx: Ctx, items: Sequence[dict[str, object]]) -> bytes:
    return encode_frame({"ns": ctx.ns.id, "items": list(items)})


def put_body(ctx: Ctx, items: Sequence[dict[str, object]]) -> bytes:
    """A put whose payload bytes agree with the sizes its header lists (when they are sizes)."""
    sizes = [it.get("size") for it in items]
    payloads = [b"\x00" * s for s in sizes if isinstance(s, int) and not isinstance(s, bool) and 0 < s < 1 << 20]
    if len(payloads) != len(items):
        payloads = []
    return encode_frame({"ns": ctx.ns.id, "items": list(items), "commit": True}, payloads)


@pytest.fixture
def ctx(seeded: Seeded, client: PrefixClient) -> Ctx:
    return Ctx(ns=client.namespace, seeded=seeded, fresh=client.prompt(fresh_tokens(2 * 4 + 2)))


# ---------------------------------------------------------------- items: offer and put


def _tokens_wrong_count(c: Ctx) -> dict[str, object]:
    # A "block" of 3 tokens whose hash is right for those 3 tokens: only the count is wrong.
    s = c.block(0)
    toks = s.tokens[: 3 * 4]
    return edit(s, tokens=toks, hash=chain_hash(s.parent, toks), size=3 * c.ns.kv.token_bytes)


def _tail_of_block_length(c: Ctx) -> dict[str, object]:
    return edit(c.block(0), kind=int(Kind.TAIL))


ITEM_CASES: list[tuple[str, Callable[[Ctx], object], str]] = [
    ("kind-9", lambda c: [edit(c.block(), kind=9)], "items[0].kind"),
    ("kind-str", lambda c: [edit(c.block(), kind="block")], "items[0].kind"),
    ("hash-str", lambda c: [edit(c.block(), hash=c.block().hash.hex())], "items[0].hash"),
    ("hash-short", lambda c: [edit(c.block(), hash=c.block().hash[:8])], "items[0].hash"),
    ("size-negative", lambda c: [edit(c.block(), size=-256)], "items[0].size"),
    ("size-str", lambda c: [edit(c.block(), size="256")], "items[0].size"),
    ("parent-missing", lambda c: [{k: v for k, v in c.block().to_wire().items() if k != "parent"}], "items[0].parent"),
    ("tokens-list", lambda c: [edit(c.block(), tokens=c.fresh_tokens[:4])], "items[0].tokens"),
    ("block-3-tokens", lambda c: [_tokens_wrong_count(c)], "items[0].tokens"),
    ("tail-of-B-tokens", lambda c: [_tail_of_block_length(c)], "items[0].tokens"),
    ("block-size-vs-layout", lambda c: [edit(c.block(), size=c.ns.block_bytes - 4)], "items[0].size"),
    ("tail-size-vs-layout", lambda c: [edit(c.tail(), size=c.ns.block_bytes)], "items[0].size"),
    ("state-size-vs-layout", lambda c: [edit(c.state(), size=c.ns.state.snapshot_bytes * 2)], "items[0].size"),
    ("hash-not-parent+tokens", lambda c: [edit(c.block(0), hash=c.block(1).hash)], "items[0].hash"),
    ("hash-ignores-extra", lambda c: [edit(c.block(0), extra=b"lora:1")], "items[0].hash"),
    ("hash-wrong-parent", lambda c: [edit(c.block(1), parent=c.seeded.prompt.hashes[0])], "items[0].hash"),
    ("state-boundary-after-container", lambda c: [c.state(boundary=9, hash_at=9).to_wire()], "items[0].boundary"),
    ("state-boundary-at-container-start", lambda c: [c.state(boundary=4, hash_at=4).to_wire()], "items[0].boundary"),
    ("state-hash-not-p(boundary)", lambda c: [c.state(boundary=6, hash_at=5).to_wire()], "items[0].hash"),
    ("state-container-kind", lambda c: [edit(c.state(), container=make_entry_key(Kind.STATE, c.seeded.prompt.hashes[1]))],
     "items[0].container"),
    ("second-item-bad", lambda c: [c.block(0).to_wire(), edit(c.block(1), size=-1)], "items[1].size"),
    ("third-item-bad-shape", lambda c: [c.block(0).to_wire(), c.block(1).to_wire(), edit(c.tail(), hash=c.block(0).hash)],
     "items[2].hash"),
    ("items-not-a-list", lambda c: {"x": 1}, "items"),
]


@pytest.mark.parametrize("endpoint", ["/v1/offer", "/v1/put"])
@pytest.mark.parametrize(("case", "items", "field"), ITEM_CASES, ids=[c for c, _, _ in ITEM_CASES])
async def test_bad_items(running: RunningStore, client: PrefixClient, ctx: Ctx, endpoint: str, case: str,
                         items: Callable[[Ctx], object], field: str) -> None:
    raw_items = items(ctx)
    if not isinstance(raw_items, list):  # items that are not even a list
        body = encode_frame({"ns": ctx.ns.id, "items": raw_items})
    else:
        body = (put_body if endpoint == "/v1/put" else offer_body)(ctx, raw_items)
    status, raw = await post(running, endpoint, body)
    assert_error(status, raw, 400, field)
    # A bad item fails the whole request: nothing of it was taken, not even its good items.
    await assert_not_stored(client, ctx.fresh_tokens)
    await assert_healthy(running, client, ctx.seeded)


async def test_put_item_without_checksum(running: RunningStore, client: PrefixClient, ctx: Ctx) -> None:
    item = ctx.block(0).to_wire()
    del item["checksum"]
    status, raw = await post(running, "/v1/put", put_body(ctx, [item]))
    assert_error(status, raw, 400, "items[0].checksum")
    await assert_not_stored(client, ctx.fresh_tokens)
    await assert_healthy(running, client, ctx.seeded)


async def test_good_raw_put_is_accepted(running: RunningStore, client: PrefixClient, ctx: Ctx) -> None:
    """The builders above are right: unmodified, the same raw put stores the items."""
    toks = ctx.fresh_tokens
    specs = [ctx.block(0), ctx.block(1), ctx.tail()]
    payloads = [kv_payload(ctx.ns, toks, 0, 4), kv_payload(ctx.ns, toks, 4, 8), kv_payload(ctx.ns, toks, 8, 10)]
    body = encode_frame({"ns": ctx.ns.id, "items": [s.to_wire() for s in specs]}, payloads)
    status, raw = await post(running, "/v1/put", body)
    assert status == 200, raw
    await read_back(client, toks, 10, None)
    await assert_healthy(running, client, ctx.seeded)


# ---------------------------------------------------------------- framing of control requests


def _frame_cases(ns_id: bytes) -> list[tuple[str, bytes, int, str]]:
    lookup = encode_frame({"ns": ns_id, "hashes": b"", "tokens": pack_tokens([1, 2])})
    return [
        ("empty", b"", 400, "frame"),
        ("truncated-prefix", lookup[:5], 400, "frame"),
        ("truncated-header", lookup[:-3], 400, "frame.header_len"),
        ("header_len-lies", PREFIX.pack(MAGIC, WIRE_VERSION, 200) + lookup[8:], 400, "frame.header_len"),
        ("bad-magic", b"GET" + lookup[3:], 400, "frame"),
        ("json-body", b'{"ns": "00", "hashes": []}', 400, "frame"),
        ("wrong-version", lookup[:3] + bytes([WIRE_VERSION + 1]) + lookup[4:], 400, "frame.version"),
        ("not-msgpack", PREFIX.pack(MAGIC, WIRE_VERSION, 3) + b"\xc1\xc1\xc1", 400, "frame.header"),
        ("msgpack-trailing", PREFIX.pack(MAGIC, WIRE_VERSION, 2) + b"\x80\x80", 400, "frame.header"),
        ("not-a-map", encode_frame([1, 2, 3]), 400, "frame.header"),
        ("bytes-after-header", lookup + b"extra", 400, "frame"),
    ]


FRAME_CASES = _frame_cases(make_namespace().id)  # the namespace the `client` fixture registers


@pytest.mark.parametrize("endpoint", ["/v1/lookup", "/v1/offer", "/v1/commit", "/v1/get", "/v1/release",
                                      "/v1/namespaces"])
@pytest.mark.parametrize(("case", "body", "status", "field"), FRAME_CASES, ids=[c[0] for c in FRAME_CASES])
async def test_bad_control_frames(running: RunningStore, client: PrefixClient, seeded: Seeded, endpoint: str,
                                  case: str, body: bytes, status: int, field: str) -> None:
    got, raw = await post(running, endpoint, body)
    assert_error(got, raw, status, field)
    await assert_healthy(running, client, seeded)


UNKNOWN_NS = make_namespace(tenant="nobody").id


def _unknown_ns_bodies() -> list[tuple[str, bytes]]:
    key = make_entry_key(Kind.BLOCK, b"\x11" * HASH_BYTES)
    return [
        ("/v1/lookup", encode_frame({"ns": UNKNOWN_NS, "hashes": b"", "tokens": pack_tokens([1, 2])})),
        ("/v1/offer", encode_frame({"ns": UNKNOWN_NS, "items": []})),
        ("/v1/put", encode_frame({"ns": UNKNOWN_NS, "items": []})),
        ("/v1/commit", encode_frame({"ns": UNKNOWN_NS, "keys": [key]})),
        ("/v1/get", encode_frame({"ns": UNKNOWN_NS, "items": [[key, 0, None]]})),
    ]


@pytest.mark.parametrize(("endpoint", "body"), _unknown_ns_bodies(), ids=[e for e, _ in _unknown_ns_bodies()])
async def test_unknown_namespace_is_404(running: RunningStore, client: PrefixClient, seeded: Seeded, endpoint: str,
                                        body: bytes) -> None:
    status, raw = await post(running, endpoint, body)
    assert_error(status, raw, 404, "ns")
    await assert_healthy(running, client, seeded)


async def test_put_with_payload_for_unknown_namespace_is_404(running: RunningStore, client: PrefixClient,
                                                             ctx: Ctx) -> None:
    spec = ctx.block(0)
    body = encode_frame({"ns": UNKNOWN_NS, "items": [spec.to_wire()]}, [b"\x00" * spec.size])
    status, raw = await post(running, "/v1/put", body)
    assert_error(status, raw, 404, "ns")
    await assert_healthy(running, client, ctx.seeded)


def _lookup(c: Ctx, **changes: object) -> bytes:
    p = c.seeded.prompt
    header: dict[str, object] = {"ns": c.ns.id, "hashes": b"".join(p.hashes), "tokens": p.packed}
    header.update(changes)
    return encode_frame({k: v for k, v in header.items() if v is not _DROP})


def _get(c: Ctx, *item: object) -> bytes:
    return encode_frame({"ns": c.ns.id, "items": [list(item)]})


def _block_key(c: Ctx) -> bytes:
    return c.seeded.prompt.block_key(0)


def _state_key(c: Ctx) -> bytes:
    return make_entry_key(Kind.STATE, c.seeded.prompt.prefix_hash(SEED_SNAPSHOT))


_DROP = object()

FIELD_CASES: list[tuple[str, str, Callable[[Ctx], bytes], int, str]] = [
    ("lookup-ns-str", "/v1/lookup", lambda c: _lookup(c, ns=c.ns.id.hex()), 400, "ns"),
    ("lookup-ns-missing", "/v1/lookup", lambda c: _lookup(c, ns=_DROP), 400, "ns"),
    ("lookup-hashes-str", "/v1/lookup", lambda c: _lookup(c, hashes=b"".join(c.seeded.prompt.hashes).hex()), 400,
     "hashes"),
    ("lookup-hashes-list", "/v1/lookup", lambda c: _lookup(c, hashes=[bytes(h) for h in c.seeded.prompt.hashes]),
     400, "hashes"),
    ("lookup-hashes-ragged", "/v1/lookup", lambda c: _lookup(c, hashes=b"".join(c.seeded.prompt.hashes)[:-1]), 400,
     "hashes"),
    ("lookup-hashes-count", "/v1/lookup", lambda c: _lookup(c, hashes=bytes(c.seeded.prompt.hashes[0])), 400,
     "hashes"),
    ("lookup-tokens-ragged", "/v1/lookup", lambda c: _lookup(c, tokens=c.seeded.prompt.packed + b"\x01"), 400,
     "tokens"),
    ("lookup-tokens-list", "/v1/lookup", lambda c: _lookup(c, tokens=c.seeded.tokens), 400, "tokens"),
    ("lookup-lease-str", "/v1/lookup", lambda c: _lookup(c, lease="yes"), 400, "lease"),
    ("get-items-str", "/v1/get", lambda c: encode_frame({"ns": c.ns.id, "items": "all"}), 400, "items"),
    ("get-item-not-list", "/v1/get", lambda c: encode_frame({"ns": c.ns.id, "items": [_block_key(c)]}), 400,
     "items[0]"),
    ("get-key-short", "/v1/get", lambda c: _get(c, _block_key(c)[:16], 0, None), 400, "items[0].key"),
    ("get-key-kind", "/v1/get", lambda c: _get(c, b"\x07" + _block_key(c)[1:], 0, None), 400, "items[0].key"),
    ("get-layer-start-negative", "/v1/get", lambda c: _get(c, _block_key(c), -1, None), 400, "items[0].layer_start"),
    ("get-layer-end-beyond", "/v1/get", lambda c: _get(c, _block_key(c), 0, 3), 400, "items[0].layer_end"),
    ("get-layer-start-beyond", "/v1/get", lambda c: _get(c, _block_key(c), 5, None), 400, "items[0].layer_end"),
    ("get-state-layer-end-beyond", "/v1/get", lambda c: _get(c, _state_key(c), 0, 2), 400, "items[0].layer_end"),
    ("get-head-end-beyond", "/v1/get", lambda c: _get(c, _block_key(c), 0, None, 0, 2), 400, "items[0].head_end"),
    ("get-head-start-negative", "/v1/get", lambda c: _get(c, _block_key(c), 0, None, -1, None), 400,
     "items[0].head_start"),
    ("get-state-heads-opaque", "/v1/get", lambda c: _get(c, _state_key(c), 0, None, 0, 1), 400,
     "items[0].head_end"),
    ("get-packed-head-end-beyond", "/v1/get",
     lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c), "heads": struct.pack("<II", 1, 2)}), 400,
     "heads[0].head_end"),
    ("get-packed-heads-short", "/v1/get",
     lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c), "heads": b"\x00" * 4}), 400, "heads"),
    ("get-packed-keys-ragged", "/v1/get", lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c)[:16]}), 400,
     "keys"),
    ("get-packed-key-kind", "/v1/get",
     lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c) + b"\x07" + _block_key(c)[1:]}), 400, "keys[1]"),
    ("get-packed-layers-short", "/v1/get",
     lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c), "layers": b"\x00" * 4}), 400, "layers"),
    ("get-packed-layer-end-beyond", "/v1/get",
     lambda c: encode_frame({"ns": c.ns.id, "keys": _block_key(c), "layers": struct.pack("<II", 0, 3)}), 400,
     "layers[0].layer_end"),
    ("commit-keys-str", "/v1/commit", lambda c: encode_frame({"ns": c.ns.id, "keys": "k"}), 400, "keys"),
    ("commit-key-short", "/v1/commit",
     lambda c: encode_frame({"ns": c.ns.id, "keys": [_block_key(c), _block_key(c)[:5]]}), 400, "keys[1]"),
    ("release-lease-short", "/v1/release", lambda c: encode_frame({"lease": b"\x01" * 8}), 400, "lease"),
    ("release-lease-missing", "/v1/release", lambda c: encode_frame({}), 400, "lease"),
    ("namespace-missing", "/v1/namespaces", lambda c: encode_frame({}), 400, "namespace"),
    ("namespace-not-a-record", "/v1/namespaces", lambda c: encode_frame({"namespace": "m"}), 400, "namespace"),
    ("namespace-bad-field", "/v1/namespaces", lambda c: encode_frame({"namespace": [*c.ns.to_wire()[:8], 0]}), 400,
     "namespace"),
    ("namespace-future-scheme", "/v1/namespaces",
     lambda c: encode_frame({"namespace": [3, *c.ns.to_wire()[1:]]}), 400, "namespace"),
    ("put-commit-str", "/v1/put", lambda c: encode_frame({"ns": c.ns.id, "items": [], "commit": "yes"}), 400,
     "commit"),
]


@pytest.mark.parametrize(("case", "endpoint", "body", "status", "field"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
async def test_wrong_field_types(running: RunningStore, client: PrefixClient, ctx: Ctx, case: str, endpoint: str,
                                 body: Callable[[Ctx], bytes], status: int, field: str) -> None:
    got, raw = await post(running, endpoint, body(ctx))
    assert_error(got, raw, status, field)
    await assert_healthy(running, client, ctx.seeded)


async def test_get_state_layer_start_beyond(running: RunningStore, client: PrefixClient, ctx: Ctx) -> None:
    key = make_entry_key(Kind.STATE, ctx.seeded.prompt.prefix_hash(SEED_SNAPSHOT))
    try:
        status, raw = await post(running, "/v1/get", encode_frame({"ns": ctx.ns.id, "items": [[key, 5, None]]}))
    except aiohttp.ClientResponseError as err:  # the server sends an unparseable response
        status, raw = err.status, b"{}"
    assert_error(status, raw, 400, "items[0].layer_end")
    await assert_healthy(running, client, ctx.seeded)


# ---------------------------------------------------------------- put bodies that disagree with their header


def _put_parts(ctx: Ctx) -> tuple[bytes, list[bytes]]:
    """Header and payloads of a valid put of the fresh prompt's 2 blocks and tail."""
    toks = ctx.fresh_tokens
    payloads = [kv_payload(ctx.ns, toks, 0, 4), kv_payload(ctx.ns, toks, 4, 8), kv_payload(ctx.ns, toks, 8, 10)]
    specs = [ctx.block(0), ctx.block(1), ctx.tail()]
    return encode_header({"ns": ctx.ns.id, "items": [s.to_wire() for s in specs], "commit": True}), payloads


BODY_CASES: list[tuple[str, Callable[[bytes, list[bytes]], Body]]] = [
    # With a Content-Length (aiohttp sets it from the bytes given).
    ("cl-truncated-prefix", lambda h, p: h[:6]),
    ("cl-truncated-header", lambda h, p: h[:-2]),
    ("cl-header_len-lies", lambda h, p: PREFIX.pack(MAGIC, WIRE_VERSION, len(h) + 100) + h[8:]),
    ("cl-short-of-payloads", lambda h, p: h + b"".join(p)[:-1]),
    ("cl-missing-last-payload", lambda h, p: h + p[0] + p[1]),
    ("cl-bytes-after-payloads", lambda h, p: h + b"".join(p) + b"\x00"),
    ("cl-header-only", lambda h, p: h),
    # Chunked: no Content-Length, the stream itself ends early or runs on.
    ("chunked-ends-in-header", lambda h, p: chunked(h[:-2])),
    ("chunked-ends-mid-payload", lambda h, p: chunked(h, p[0], p[1][:100])),
    ("chunked-ends-between-payloads", lambda h, p: chunked(h, p[0], p[1])),
    ("chunked-header-only", lambda h, p: chunked(h)),
    ("chunked-bytes-after-payloads", lambda h, p: chunked(h, *p, b"junk")),
    ("chunked-one-byte-after", lambda h, p: chunked(h + b"".join(p) + b"\x00")),
]


@pytest.mark.parametrize(("case", "make"), BODY_CASES, ids=[c for c, _ in BODY_CASES])
async def test_put_body_disagrees_with_header(running: RunningStore, client: PrefixClient, ctx: Ctx, case: str,
                                              make: Callable[[bytes, list[bytes]], Body]) -> None:
    header, payloads = _put_parts(ctx)
    status, raw = await post(running, "/v1/put", make(header, payloads))
    assert_error(status, raw, 400, "frame")
    # Nothing of a put whose body did not arrive whole is stored, and its reserved pages are back.
    await assert_not_stored(client, ctx.fresh_tokens)
    await assert_healthy(running, client, ctx.seeded)


async def test_put_body_ends_while_skipping_a_have_item(running: RunningStore, client: PrefixClient,
                                                         ctx: Ctx) -> None:
    """The first item is already stored (its bytes are skipped); the body ends inside it."""
    s = ctx.seeded
    have = with_payload(s.prompt.kv_items(4)[0][0], kv_payload(ctx.ns, s.tokens, 0, 4))
    new = ctx.block(0)
    header = encode_header({"ns": ctx.ns.id, "items": [have.to_wire(), new.to_wire()]})
    status, raw = await post(running, "/v1/put", chunked(header, b"\x00" * 10))
    assert_error(status, raw, 400, "frame")
    await assert_not_stored(client, ctx.fresh_tokens)
    await assert_healthy(running, client, ctx.seeded)


# ---------------------------------------------------------------- checksums


async def test_checksum_mismatch_rejects_only_that_item(running: RunningStore, client: PrefixClient,
                                                        ctx: Ctx) -> None:
    ns = ctx.ns
    bad_toks, good_toks = fresh_tokens(4), fresh_tokens(4)
    bad_p, good_p = client.prompt(bad_toks), client.prompt(good_toks)
    bad_payload, good_payload = kv_payload(ns, bad_toks, 0, 4), kv_payload(ns, good_toks, 0, 4)
    bad = with_payload(bad_p.kv_items(4)[0][0], bad_payload)
    good = with_payload(good_p.kv_items(4)[0][0], good_payload)
    corrupted = bytes([bad_payload[0] ^ 0xFF]) + bad_payload[1:]  # one flipped byte "in transit"
    body = encode_frame({"ns": ns.id, "items": [bad.to_wire(), good.to_wire()]}, [corrupted, good_payload])
    status, raw = await post(running, "/v1/put", body)
    assert status == 200, raw
    results = decode_frame(raw)[0]["results"]
    assert results[0][0] == "rejected" and "checksum" in results[0][1], results
    assert results[1] == ["ok", ""], results
    await assert_not_stored(client, bad_toks)
    await read_back(client, good_toks, 4, None)
    await assert_healthy(running, client, ctx.seeded)


async def test_checksum_mismatch_of_a_parent_drops_its_children(running: RunningStore, client: PrefixClient,
                                                                ctx: Ctx) -> None:
    toks = ctx.fresh_tokens
    specs = [ctx.block(0), ctx.block(1), ctx.tail()]
    payloads = [kv_payload(ctx.ns, toks, 0, 4), kv_payload(ctx.ns, toks, 4, 8), kv_payload(ctx.ns, toks, 8, 10)]
    payloads[1] = b"\x00" * len(payloads[1])  # block 1 arrives corrupted; the tail hangs under it
    body = encode_frame({"ns": ctx.ns.id, "items": [s.to_wire() for s in specs]}, payloads)
    status, raw = await post(running, "/v1/put", body)
    assert status == 200, raw
    results = decode_frame(raw)[0]["results"]
    assert [r[0] for r in results] == ["ok", "rejected", "rejected"], results
    res = await client.lookup(toks, lease=False)
    assert res.kv_tokens == 4, res  # block 0 only: never KV past a hole
    await assert_healthy(running, client, ctx.seeded)


# ---------------------------------------------------------------- limits


@pytest.fixture
async def small(start_store, tmp_path: Path) -> AsyncIterator[tuple[RunningStore, PrefixClient, Seeded]]:  # type: ignore[no-untyped-def]
    running = await start_store(StoreConfig(port=0, data_dir=str(tmp_path / "small"), ram_bytes=1 << 20,
                                            page_bytes=4096, max_body_bytes=2048, max_header_bytes=1024,
                                            max_items=8, max_lookup_tokens=64))
    client = running.client(make_namespace())
    seeded = await seed(client)
    yield running, client, seeded
    await client.close()


def _limit_cases(ns: Namespace) -> list[tuple[str, str, Callable[[], Body], int, str]]:
    toks = fresh_tokens(40)  # 10 blocks: 2560 payload bytes > max_body_bytes
    p = Prompt(ns, toks)
    specs = [with_payload(s, kv_payload(ns, toks, a, b)) for s, a, b in p.kv_items(40)]
    payloads = [kv_payload(ns, toks, a, b) for _, a, b in p.kv_items(40)]
    big_put = encode_frame({"ns": ns.id, "items": [s.to_wire() for s in specs[:8]]}, payloads[:8])
    long_lookup = Prompt(ns, fresh_tokens(100))
    return [
        ("control-body", "/v1/lookup",
         lambda: encode_frame({"ns": ns.id, "hashes": b"", "tokens": b"", "pad": b"x" * 1100}), 413, "body"),
        ("control-body-chunked", "/v1/offer",
         lambda: chunked(encode_frame({"ns": ns.id, "items": [], "pad": b"x" * 1100})), 413, "body"),
        ("control-header_len", "/v1/lookup",
         lambda: PREFIX.pack(MAGIC, WIRE_VERSION, 1 << 20) + b"\x80", 413, "frame.header_len"),
        ("put-content-length", "/v1/put", lambda: big_put, 413, "body"),
        ("put-header_len", "/v1/put", lambda: PREFIX.pack(MAGIC, WIRE_VERSION, 1 << 20) + b"\x80", 413,
         "frame.header_len"),
        ("put-header-too-big", "/v1/put",
         lambda: encode_frame({"ns": ns.id, "items": [], "pad": b"x" * 1100}), 413, "frame.header_len"),
        ("offer-too-many-items", "/v1/offer",
         lambda: encode_frame({"ns": ns.id, "items": [specs[0].to_wire()] * 9}), 413, "items"),
        ("offer-item-size-over-body-limit", "/v1/offer",
         lambda: encode_frame({"ns": ns.id, "items": [edit(specs[0], size=4096)]}), 400, "items[0].size"),
        ("lookup-too-many-tokens", "/v1/lookup",
         lambda: encode_frame({"ns": ns.id, "hashes": b"".join(long_lookup.hashes), "tokens": long_lookup.packed}),
         413, "tokens"),
        ("commit-too-many-keys", "/v1/commit",
         lambda: encode_frame({"ns": ns.id, "keys": [p.block_key(0)] * 9}), 413, "keys"),
    ]


LIMIT_CASES = _limit_cases(make_namespace())  # the namespace the `small` fixture registers


@pytest.mark.parametrize(("case", "endpoint", "make", "status", "field"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
async def test_limits(small: tuple[RunningStore, PrefixClient, Seeded], case: str, endpoint: str,
                      make: Callable[[], Body], status: int, field: str) -> None:
    running, client, seeded = small
    got, raw = await post(running, endpoint, make())
    assert_error(got, raw, status, field)
    await assert_healthy(running, client, seeded)


async def test_chunked_put_over_body_limit(small: tuple[RunningStore, PrefixClient, Seeded]) -> None:
    running, client, seeded = small
    ns = client.namespace
    toks = fresh_tokens(40)
    p = client.prompt(toks)
    items = p.kv_items(40)
    specs = [with_payload(s, kv_payload(ns, toks, a, b)) for s, a, b in items[:8]]
    payloads = [kv_payload(ns, toks, a, b) for _, a, b in items[:8]]  # 2048 payload bytes + header > 2048
    header = encode_header({"ns": ns.id, "items": [s.to_wire() for s in specs]})
    status, raw = await post(running, "/v1/put", chunked(header, *payloads))
    try:
        assert_error(status, raw, 413, "body")
    finally:
        await assert_healthy(running, client, seeded)

"""The control channel (protocol/control.py): lookups over one WebSocket answer exactly as POSTs do,
under the same rules (tokens, tenants, limits, metrics), and a channel that cannot be opened or
breaks costs nothing but the POST the call falls back to."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prefixstore.client import ClientConfig
from prefixstore.client.control import ControlChannel
from prefixstore.client.node import NodeClient
from prefixstore.protocol.control import ANSWER, CALL, CONTROL_PATH, op_of
from prefixstore.protocol.wire import decode_frame, encode_frame
from prefixstore.store import StoreConfig, create_app
from prefixstore.store import control as store_control

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace
from ..security.helpers import TOKENS, write_tenants

NS = make_namespace()
B = NS.block_tokens
TOKENS_SAVED = list(range(1000, 1000 + 40 * B + B - 1))  # 40 blocks and a tail


async def saved(c: NodeClient) -> None:
    res = await c.save(c.prompt(TOKENS_SAVED), len(TOKENS_SAVED), lambda s, e: kv_payload(NS, TOKENS_SAVED, s, e))
    assert res.stored == 41 and res.dropped == 0, res


def node(c: object) -> NodeClient:
    impl = getattr(c, "impl", c)
    assert isinstance(impl, NodeClient)
    return impl


def requests_counted(running: RunningStore, endpoint: str) -> float:
    value = running.store.metrics.registry.get_sample_value(
        "prefixstore_requests_total", {"endpoint": endpoint, "status": "2xx"})
    return value or 0.0


async def test_lookups_over_the_channel_answer_as_posts_do(running: RunningStore) -> None:
    async with running.client(NS) as fast, running.client(NS, control_channel=False) as slow:
        await saved(node(slow))
        prompts = [TOKENS_SAVED, TOKENS_SAVED[:17 * B + B - 1],  # a hit to the tail; one ending mid-block
                   TOKENS_SAVED[:20 * B] + [7] * (3 * B),  # diverges after 20 blocks: a lean lookup's second trip
                   [5] * (3 * B), []]
        before = requests_counted(running, "/v1/lookup")
        for tokens in prompts:
            a, b = await fast.lookup(tokens), await slow.lookup(tokens)
            assert (a.ok, a.kv_tokens, a.state_tokens, a.matched_blocks) == (b.ok, b.kv_tokens, b.state_tokens,
                                                                           b.matched_blocks), tokens[:3]
            await fast.release(a.lease_id)
            await slow.release(b.lease_id)
        assert [r.kv_tokens for r in [await slow.lookup(t) for t in prompts[:3]]] == [len(TOKENS_SAVED), 17 * B + B - 1,
                                                                                      20 * B]
        channel = node(fast).control
        assert channel is not None and channel.opened == 1 and channel.carried >= 4  # one channel, the calls on it
        assert node(slow).control is None
        # Each lookup is counted once under its POST path, whichever way it came.
        assert requests_counted(running, "/v1/lookup") - before >= 2 * 4 + 3


async def test_calls_overlap_on_one_channel(running: RunningStore) -> None:
    async with running.client(NS) as c:
        await saved(node(c))
        cuts = [n * B for n in range(1, 41)]
        results = await asyncio.gather(*(c.lookup(TOKENS_SAVED[:n]) for n in cuts))
        assert [r.kv_tokens for r in results] == cuts  # each answer went to its own call
        channel = node(c).control
        assert channel is not None and channel.opened == 1 and channel.carried >= len(cuts)


async def test_a_store_without_the_channel_is_asked_by_post(store_config: StoreConfig, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An older store: the upgrade is a 404; lookups go as POSTs and answer the same."""
    monkeypatch.setattr(store_control, "install", lambda app: None)  # the app an older store would be
    server = TestServer(create_app(store_config), host="127.0.0.1")
    await server.start_server()
    try:
        running = RunningStore(server)
        async with running.client(NS) as c:
            await saved(node(c))
            assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
            assert (await c.lookup(TOKENS_SAVED[:B])).kv_tokens == B
            channel = node(c).control
            assert channel is not None and channel.opened == 0 and channel.carried == 0
            assert channel.retry_at > 0  # not tried again at every call
    finally:
        await server.close()


async def test_a_channel_closed_by_the_store_costs_no_lookup(running: RunningStore) -> None:
    async with running.client(NS) as c:
        await saved(node(c))
        assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
        channel = node(c).control
        assert channel is not None and channel.opened == 1
        for ws in list(running.server.app[store_control.CHANNELS]):
            await ws.close()
        for _ in range(3):
            assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
        assert channel.opened == 2  # opened again for the next calls


async def raw_channel(url: str, token: str | None = None, origin: str | None = None) -> aiohttp.ClientWebSocketResponse:
    headers = {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    if origin is not None:
        headers["Origin"] = origin
    session = aiohttp.ClientSession()
    try:
        ws = await session.ws_connect(url + CONTROL_PATH, headers=headers)
    except BaseException:
        await session.close()
        raise
    ws._test_session = session  # type: ignore[attr-defined]  # closed by close_raw
    return ws


async def close_raw(ws: aiohttp.ClientWebSocketResponse) -> None:
    await ws.close()
    await ws._test_session.close()  # type: ignore[attr-defined]


async def ask(ws: aiohttp.ClientWebSocketResponse, path: str, header: dict[str, object], call_id: int = 9,
              op: int | None = None) -> tuple[int, dict[str, object]]:
    await ws.send_bytes(CALL.pack(call_id, op if op is not None else op_of(path) or 0) + encode_frame(header))
    msg = await ws.receive(timeout=5)
    assert msg.type is aiohttp.WSMsgType.BINARY, msg
    got_id, status = ANSWER.unpack_from(msg.data)
    assert got_id == call_id
    body = msg.data[ANSWER.size:]
    return status, (decode_frame(body)[0] if status == 200 else json.loads(body))


async def test_bad_calls_get_a_refusal_naming_the_field_and_the_store_keeps_serving(running: RunningStore) -> None:
    async with running.client(NS) as c:
        await saved(node(c))
        ws = await raw_channel(running.url)
        try:
            status, body = await ask(ws, "/v1/lookup", {"ns": NS.id, "hashes": b"\x00" * 15, "tokens": b""})
            assert status == 400 and body["field"] == "hashes", body
            status, body = await ask(ws, "/v1/lookup", {}, op=77)
            assert status == 404 and body["field"] == "op", body
            status, body = await ask(ws, "/v1/lookup", {"ns": b"\x01" * 8, "hashes": b"", "tokens": b""})
            assert status == 404 and body["field"] == "ns", body
            await ws.send_str("not binary")
            msg = await ws.receive(timeout=5)
            assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1003
        finally:
            await close_raw(ws)
        assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)


async def test_a_call_larger_than_max_header_bytes_closes_the_channel_and_is_refused(start_store, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                     caplog) -> None:
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off", max_header_bytes=64 << 10)
    running = await start_store(config)
    long = list(range(64 * 1024))  # 256 KiB of tokens carried whole: over the limit
    async with running.client(NS, lookup_token_window=None) as c:
        res = await c.lookup(long)
        assert not res.ok and res.kv_tokens == 0  # the POST it fell back to was refused: a miss
        assert node(c).failures["lookup"] == 1
        assert "answered 413" in caplog.text  # the POST's refusal, naming the limit
        assert (await c.lookup(long[:B])).ok  # and the store keeps serving, over a new channel
        channel = node(c).control
        assert channel is not None and channel.opened == 2


async def test_the_channel_takes_the_tenants_rules(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Attacker: beta holds a valid token and alpha's namespace id (public fields)."""
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off", tenants_file=str(write_tenants(tmp_path / "t.toml")))
    running = await start_store(config)
    ns_a = make_namespace(tenant="alpha")
    async with running.client(ns_a, token=TOKENS["alpha"]) as a:
        res = await a.save(a.prompt(TOKENS_SAVED), len(TOKENS_SAVED),
                           lambda s, e: kv_payload(ns_a, TOKENS_SAVED, s, e))
        assert res.stored == 41
        assert (await a.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
        assert node(a).control is not None and node(a).control.carried >= 1
    with pytest.raises(aiohttp.WSServerHandshakeError) as no_token:
        await raw_channel(running.url)
    assert no_token.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as wrong:
        await raw_channel(running.url, token="tok-not-a-tenant")
    assert wrong.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as page:
        await raw_channel(running.url, token=TOKENS["beta"], origin="https://evil.example")
    assert page.value.status == 403
    ws = await raw_channel(running.url, token=TOKENS["beta"])
    try:
        p = node(a).prompt(TOKENS_SAVED)
        status, body = await ask(ws, "/v1/lookup", {"ns": ns_a.id, "hashes": p.hash_bytes, "tokens": p.packed,
                                                    "lease": True})
        assert status == 404 and body["field"] == "ns", body  # alpha's namespace is unknown to beta
    finally:
        await close_raw(ws)


async def test_a_token_no_longer_valid_closes_an_open_channel(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off", tenants_file=str(write_tenants(tmp_path / "t.toml")))
    running = await start_store(config)
    ns_b = make_namespace(tenant="beta")
    async with running.client(ns_b, token=TOKENS["beta"]) as b:
        await b.lookup(TOKENS_SAVED)  # registers the namespace
    ws = await raw_channel(running.url, token=TOKENS["beta"])
    try:
        p = node(b).prompt(TOKENS_SAVED)
        status, _ = await ask(ws, "/v1/lookup", {"ns": ns_b.id, "hashes": p.hash_bytes, "tokens": p.packed})
        assert status == 200
        tenants = running.store.tenants
        assert tenants is not None  # beta's token taken out, as a tenants file read anew would
        running.store.tenants = dataclasses.replace(tenants, tenants=tuple(t for t in tenants.tenants if t.name != "beta"))
        status, body = await ask(ws, "/v1/lookup", {"ns": ns_b.id, "hashes": p.hash_bytes, "tokens": p.packed})
        assert status == 401 and body["field"] == "authorization"
        msg = await ws.receive(timeout=5)
        assert msg.type is aiohttp.WSMsgType.CLOSE and msg.data == 1008
    finally:
        await close_raw(ws)


async def test_a_store_shutting_down_closes_its_channels(store_config: StoreConfig) -> None:
    server = TestServer(create_app(store_config), host="127.0.0.1")
    await server.start_server()
    running = RunningStore(server)
    c = running.client(NS)
    try:
        assert (await c.lookup(TOKENS_SAVED)).ok
        assert node(c).control is not None and node(c).control.open
        await asyncio.wait_for(server.close(), 10)  # an open channel does not hold the shutdown
    finally:
        await c.close()


async def test_the_channel_is_off_where_the_config_says(running: RunningStore) -> None:
    async with NodeClient(NS, ClientConfig(url=running.url, control_channel=False)) as off:
        assert off.control is None
        assert (await off.lookup(TOKENS_SAVED)).ok
    async with NodeClient(NS, ClientConfig(url=running.url)) as on:
        assert isinstance(on.control, ControlChannel)


async def test_answers_go_to_their_calls_whatever_their_order() -> None:
    """A node may answer overlapping calls in any order: each answer names its call."""
    from aiohttp import web
    from prefixstore.transport.frames import FramePool

    async def reversed_answers(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        calls = []
        async for msg in ws:
            call_id, _ = CALL.unpack_from(msg.data)
            calls.append((call_id, decode_frame(msg.data[CALL.size:])[0]))
            if len(calls) == 3:
                for call_id, header in reversed(calls):
                    await ws.send_bytes(ANSWER.pack(call_id, 200) + encode_frame({"echo": header["x"]}))
                calls.clear()
        return ws

    app = web.Application()
    app.router.add_get(CONTROL_PATH, reversed_answers)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    pool = FramePool(str(server.make_url("")).rstrip("/"), connect_timeout_s=1.0)
    channel = ControlChannel(pool, timeout_s=5.0)
    try:
        got = await asyncio.gather(*(channel.call("/v1/lookup", {"x": i}) for i in range(3)))
        assert got == [{"echo": 0}, {"echo": 1}, {"echo": 2}]
    finally:
        await channel.close()
        pool.close()
        await server.close()

"""The control channel (protocol/control.py): lookups over one WebSocket answer exactly as POSTs do,
under the same rules (tokens, tenants, limits, metrics), and a channel that cannot be opened or
breaks costs nothing but the POST the call falls back to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prefixstore.client import ClientConfig
from prefixstore.client.control import ControlChannel, Link
from prefixstore.client.node import NodeClient
from prefixstore.protocol.control import ANSWER, CALL, CONTROL_PATH, op_of
from prefixstore.protocol.errors import Problem, StoreError
from prefixstore.protocol.wire import decode_frame, encode_frame
from prefixstore.store import StoreConfig, create_app
from prefixstore.store import control as store_control
from prefixstore.transport.frames import FramePool

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


@contextlib.asynccontextmanager
async def channel_to(handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                     timeout_s: float = 5.0) -> AsyncIterator[ControlChannel]:
    """A channel to a stand-in node whose ``/v1/control`` is ``handler``."""
    app = web.Application()
    app.router.add_get(CONTROL_PATH, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    pool = FramePool(str(server.make_url("")).rstrip("/"), connect_timeout_s=1.0)
    channel = ControlChannel(pool, timeout_s=timeout_s)
    try:
        yield channel
    finally:
        await channel.close()
        pool.close()
        await server.close()


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

    async with channel_to(reversed_answers) as channel:
        got = await asyncio.gather(*(channel.call("/v1/lookup", {"x": i}) for i in range(3)))
        assert got == [{"echo": 0}, {"echo": 1}, {"echo": 2}]


async def test_a_call_never_answered_times_out_and_ends_the_channel() -> None:
    """An open channel whose node reads calls and answers only the first: the next call raises
    the POST's timeout error after timeout_s (no sooner, and not forever), a call sent on the same
    channel meanwhile goes as a POST, and the call after them opens a new channel. The channel's
    watchdog, armed by the first call and long past its deadline, still bounds the later ones."""
    answered: list[int] = []

    async def answers_once(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            call_id, _ = CALL.unpack_from(msg.data)
            if not answered:
                answered.append(call_id)
                await ws.send_bytes(ANSWER.pack(call_id, 200) + encode_frame({"ok": True}))
        return ws

    async with channel_to(answers_once, timeout_s=0.4) as channel:
        loop = asyncio.get_running_loop()
        assert await channel.call("/v1/lookup", {"x": 0}) == {"ok": True}
        await asyncio.sleep(0.6)  # the first call's watchdog fires with nothing pending
        started = loop.time()
        silent = asyncio.ensure_future(channel.call("/v1/lookup", {"x": 1}))
        await asyncio.sleep(0.1)
        beside = asyncio.ensure_future(channel.call("/v1/lookup", {"x": 2}))
        with pytest.raises(StoreError) as err:
            await asyncio.wait_for(silent, 3.0)
        assert err.value.problem is Problem.TIMEOUT
        assert 0.39 <= loop.time() - started < 2.0
        assert await asyncio.wait_for(beside, 3.0) is None  # its channel ended: sent as a POST
        assert not channel.open and channel.opened == 1
        answered.clear()
        assert await asyncio.wait_for(channel.call("/v1/lookup", {"x": 3}), 3.0) == {"ok": True}
        assert channel.opened == 2


def stops_reading_node() -> tuple[Callable[[web.Request], Awaitable[web.StreamResponse]], asyncio.Event]:
    """A stand-in node that accepts the channel, then reads nothing (a frozen process) until the
    event is set, and then drops the connection."""
    released = asyncio.Event()

    async def stops_reading(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        assert request.transport is not None
        request.transport.pause_reading()
        await released.wait()  # until the test is done with it (a node's close waits for its handlers)
        request.transport.abort()
        return ws
    return stops_reading, released


HUGE = {"tokens": b"\0" * (48 << 20)}  # far more than loopback's socket buffers take: its send parks


async def test_one_parked_send_is_woken_by_closing_the_channel() -> None:
    """A single call parked in its send, no call reading: closing the client ends it as a POST."""
    handler, released = stops_reading_node()
    async with channel_to(handler, timeout_s=30.0) as channel:
        try:
            call = asyncio.ensure_future(channel.call("/v1/lookup", HUGE))
            await asyncio.sleep(0.3)
            parked = not call.done()
            await asyncio.wait_for(channel.close(), 5.0)
            outcome = await asyncio.wait_for(asyncio.gather(call, return_exceptions=True), 5.0)
        finally:
            released.set()
        assert parked and list(outcome) == [None]


async def test_cancelling_one_parked_send_does_not_cancel_the_others() -> None:
    """aiohttp's senders on one connection share one drain waiter: cancelling one call's task
    cancels it for all. The call whose caller cancelled it raises CancelledError; the others end
    as POSTs (their channel, its drain spent, ends), not with a cancel nobody asked for."""
    handler, released = stops_reading_node()
    async with channel_to(handler, timeout_s=30.0) as channel:
        try:
            calls = [asyncio.ensure_future(channel.call("/v1/lookup", HUGE)) for _ in range(3)]
            await asyncio.sleep(0.3)
            parked = not any(c.done() for c in calls)
            calls[0].cancel()
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5.0)
        finally:
            released.set()
        assert parked
        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert outcomes[1:] == [None, None], outcomes
        assert not channel.open


async def test_a_channel_whose_node_takes_no_close_has_its_socket_shut() -> None:
    """Closing a channel to a node that reads nothing: aiohttp's graceful close would keep the
    socket, and every frame buffered in it, until the node reads again. After CLOSE_S it is shut."""
    handler, released = stops_reading_node()
    app = web.Application()
    app.router.add_get(CONTROL_PATH, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        ws = await session.ws_connect(str(server.make_url(CONTROL_PATH)))
        sock = ws.get_extra_info("socket")
        link = Link(ws)
        try:
            sender = asyncio.ensure_future(ws.send_bytes(HUGE["tokens"]))
            await asyncio.sleep(0.3)
            await asyncio.wait_for(ControlChannel.close_link(link), 5.0)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            for _ in range(50):
                if sock.fileno() == -1:
                    break
                await asyncio.sleep(0.05)
        finally:
            released.set()
        assert sock.fileno() == -1  # the socket is closed: nothing left buffered for the node
    await server.close()


async def test_a_call_that_opens_the_channel_has_one_deadline_for_both() -> None:
    """Opening the channel counts against the call's timeout_s: a slow upgrade then a silent node
    times the call out timeout_s after it began, not timeout_s after the channel opened."""
    async def slow_then_silent(request: web.Request) -> web.WebSocketResponse:
        await asyncio.sleep(0.8)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for _ in ws:
            pass
        return ws

    async with channel_to(slow_then_silent, timeout_s=1.0) as channel:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StoreError) as err:
            await asyncio.wait_for(channel.call("/v1/lookup", {"x": 1}), 5.0)
        assert err.value.problem is Problem.TIMEOUT
        assert 0.99 <= loop.time() - started < 1.6  # one deadline: not 0.8 s + another 1.0 s


async def test_calls_stuck_in_their_send_end_at_their_deadline() -> None:
    """A node that stopped reading (a frozen process, a flow gone silent): calls larger than the
    socket buffers park in their send, waiting to drain, which closing the connection gracefully
    does not wake. Each still ends past its deadline, with the POST's timeout error."""
    stops_reading, released = stops_reading_node()
    big = {"tokens": b"\0" * (640 << 10)}  # a 163,840-token lookup's tokens: more than the buffers hold
    async with channel_to(stops_reading, timeout_s=0.5) as channel:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            got = await asyncio.wait_for(
                asyncio.gather(*(channel.call("/v1/lookup", big) for _ in range(16)), return_exceptions=True), 5.0)
        finally:
            released.set()
        assert all(isinstance(g, StoreError) and g.problem is Problem.TIMEOUT for g in got), got
        assert loop.time() - started < 0.5 + 0.8  # at their deadline, not CLOSE_S (1 s) later when the socket is shut


async def test_an_idle_channel_is_closed_and_the_next_call_opens_another(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A channel holds a connection slot: no longer than a kept-alive connection (header_timeout_s).
    The client sees the close at its next call (no task reads an idle channel), which goes as a
    POST; the call after it opens a new channel."""
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off", header_timeout_s=0.3)
    running = await start_store(config)
    async with running.client(NS) as c:
        await saved(node(c))
        assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
        channel = node(c).control
        assert channel is not None and channel.opened == 1 and channel.carried == 1
        for _ in range(100):
            if not running.server.app[store_control.CHANNELS]:
                break
            await asyncio.sleep(0.05)
        assert not running.server.app[store_control.CHANNELS]  # closed by the store
        assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)  # by POST
        assert (await c.lookup(TOKENS_SAVED)).kv_tokens == len(TOKENS_SAVED)
        assert channel.opened == 2 and channel.carried == 2 and node(c).failures["lookup"] == 0


async def test_idle_channels_cannot_hold_a_nodes_connection_slots(tmp_path: Path) -> None:
    """An attacker opens max_connections channels and sends nothing: the node still serves others."""
    from prefixstore.store.runner import StoreRunner
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off", max_connections=4, header_timeout_s=0.3)
    runner = StoreRunner(create_app(config), config)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    held = [await raw_channel(url) for _ in range(4)]  # every slot, none of them reading
    try:
        async with aiohttp.ClientSession() as s:
            statuses = []
            for _ in range(40):
                async with s.get(url + "/healthz") as r:
                    statuses.append(r.status)
                if r.status == 200:
                    break
                await asyncio.sleep(0.1)
        assert statuses[-1] == 200, statuses  # the idle channels were closed, their slots freed
        assert len(statuses) > 1  # and they did hold every slot until then
    finally:
        for ws in held:
            await close_raw(ws)
        await runner.cleanup()


async def test_a_shutdown_is_not_held_by_a_client_that_reads_nothing(tmp_path: Path) -> None:
    from prefixstore.store.runner import StoreRunner
    config = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                         disk_bytes=64 << 20, nixl="off")
    runner = StoreRunner(create_app(config), config)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    ws = await raw_channel(f"http://127.0.0.1:{runner.addresses[0][1]}")
    call = CALL.pack(1, 99) + encode_frame({"pad": b"x" * 2000})  # each answered (404): answers pile up unread

    async def flood() -> None:
        while True:
            await ws.send_bytes(call)
    sender = asyncio.ensure_future(flood())
    try:
        await asyncio.sleep(1.0)
        assert not sender.done()  # the store stopped reading: its answers are not taken
        await asyncio.wait_for(runner.cleanup(), 10)  # closing that channel gives up after CLOSE_S
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        await close_raw(ws)


async def test_a_client_gone_mid_answer_is_no_error(running: RunningStore, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    for _ in range(2):
        ws = await raw_channel(running.url)
        call = CALL.pack(1, 99) + encode_frame({"pad": b"x" * 2000})
        for _ in range(2000):
            await ws.send_bytes(call)
        transport = ws._response.connection.transport  # type: ignore[union-attr]
        assert transport is not None
        transport.abort()
        await close_raw(ws)
        await asyncio.sleep(0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    async with running.client(NS) as c:
        assert (await c.lookup(TOKENS_SAVED)).ok  # and the store keeps serving


async def test_an_upgrade_nobody_answers_costs_one_timeout_then_posts() -> None:
    """A node (or proxy) that takes the connection and never answers the upgrade."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client goes
        writer.close()
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = FramePool(f"http://127.0.0.1:{port}", connect_timeout_s=1.0)
    channel = ControlChannel(pool, timeout_s=0.5)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        got = await asyncio.gather(*(channel.call("/v1/lookup", {"x": i}) for i in range(3)), return_exceptions=True)
        assert loop.time() - started < 2.0  # each within its timeout_s, not forever
        assert all(isinstance(g, StoreError) and g.problem is Problem.TIMEOUT for g in got), got
        for _ in range(40):  # the open gives up at its own deadline; from then on, calls are POSTs
            if channel.retry_at > 0:
                break
            await asyncio.sleep(0.05)
        assert await channel.call("/v1/lookup", {"x": 9}) is None
    finally:
        await channel.close()
        pool.close()
        server.close()


async def test_closing_the_client_does_not_cancel_another_tasks_lookup(running: RunningStore) -> None:
    c = NodeClient(NS, ClientConfig(url=running.url, timeout_s=2.0))
    await c.lookup(TOKENS_SAVED)
    outcomes: list[str] = []

    async def engine() -> None:
        for _ in range(100):
            outcomes.append("ok" if (await c.lookup(TOKENS_SAVED)).ok else "miss")
    task = asyncio.ensure_future(engine())
    await asyncio.sleep(0.02)
    await c.close()
    await asyncio.gather(task, return_exceptions=True)
    await c.close()
    assert not task.cancelled() and task.exception() is None, task
    assert len(outcomes) == 100


async def test_a_url_with_a_trailing_slash_reaches_the_channel(running: RunningStore) -> None:
    async with NodeClient(NS, ClientConfig(url=running.url + "/")) as c:
        assert (await c.lookup(TOKENS_SAVED)).ok
        assert c.control is not None and c.control.opened == 1 and c.control.carried == 1


async def test_an_op_the_node_does_not_carry_is_sent_as_a_post() -> None:
    """A newer client's call on an older node's channel: 404 naming ``op``, so the caller POSTs it."""

    async def no_such_op(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            call_id, op = CALL.unpack_from(msg.data)
            await ws.send_bytes(ANSWER.pack(call_id, 404) + json.dumps({"error": f"op: {op} unknown", "field": "op"}).encode())
        return ws

    async with channel_to(no_such_op) as channel:
        assert await channel.call("/v1/probe", {"x": 1}) is None
        assert channel.open  # the channel stays: other calls may be carried


async def test_closing_a_channel_while_it_opens_does_not_cancel_the_calls_waiting_on_it() -> None:

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    pool = FramePool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connect_timeout_s=1.0)
    channel = ControlChannel(pool, timeout_s=5.0)
    try:
        waiting = asyncio.ensure_future(channel.call("/v1/lookup", {"x": 1}))
        await asyncio.sleep(0.1)  # the call waits on the upgrade
        await channel.close()  # another task closes the client
        assert await asyncio.wait_for(waiting, 2) is None  # the call is sent as a POST, not cancelled
    finally:
        await channel.close()
        pool.close()
        server.close()


async def test_open_channels_are_a_gauge(running: RunningStore) -> None:
    def gauge() -> float | None:
        return running.store.metrics.registry.get_sample_value("prefixstore_control_channels")
    assert gauge() == 0
    async with running.client(NS) as a, running.client(NS) as b:
        await a.lookup(TOKENS_SAVED)
        await b.lookup(TOKENS_SAVED)
        assert gauge() == 2
    for _ in range(40):
        if gauge() == 0:
            break
        await asyncio.sleep(0.05)
    assert gauge() == 0

"""SyncPrefixClient against a real store process (an in-process server would share the
test's event loop, which a blocking client must not block)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from prefixstore.client import ClientConfig, SyncPrefixClient
from prefixstore.protocol.wire import GetItem

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import ServeProcess, StartServe, serving


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.fixture
def store(serve: StartServe) -> ServeProcess:
    return serve("--port", "0", "--data-dir", "none", "--ram-bytes", "1MiB", "--page-bytes", "4KiB")


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_save_lookup_read_release(store: ServeProcess) -> None:
    ns = make_namespace()
    toks = list(range(100, 111))
    assert store.url is not None
    with SyncPrefixClient(ns, ClientConfig(url=store.url)) as c:
        assert c.namespace == ns and c.config.url == store.url
        p = c.prompt(toks)
        r = c.save(p, 11, lambda a, b: kv_payload(ns, toks, a, b), {7: state_payload(ns, toks, 7)})
        assert (r.stored, r.rejected, r.dropped) == (4, 0, 0)
        res = c.lookup(toks[:10] + [5, 6])
        assert (res.kv_tokens, res.state_tokens) == (10, 7)
        reads = res.kv_reads(res.kv_tokens)
        outs = [bytearray(4 * ns.kv.token_bytes) for _ in reads]
        assert c.read([it for it, _, _ in reads], outs) == [256, 256, 192]
        assert bytes(outs[0]) == kv_payload(ns, toks, 0, 4)
        state = res.state_read()
        assert state is not None
        out = bytearray(ns.state.snapshot_bytes)
        assert c.read([state], [out]) == [len(out)]
        assert bytes(out) == state_payload(ns, toks, 7)
        assert c.release(res.lease_id) is True
        assert c.release(res.lease_id) is False
        # offer / put directly: what was saved is already there
        specs = [spec for spec, _, _ in p.kv_items(8)]
        assert [x.status for x in c.offer(specs)] == ["have", "have"]
        assert [x.status for x in c.put([(specs[0], kv_payload(ns, toks, 0, 4))])] == ["have"]
        assert c.failures == {}
    with pytest.raises(RuntimeError, match="closed"):
        c.lookup(toks)
    c.close()  # idempotent


def test_close_stops_the_loop_thread(store: ServeProcess) -> None:
    assert store.url is not None
    before = _threads()
    c = SyncPrefixClient(make_namespace(), ClientConfig(url=store.url))
    assert c.lookup([1, 2, 3, 4, 5]).ok
    assert "prefixstore-client" in _threads() - before
    c.close()
    assert "prefixstore-client" not in _threads() - before


def test_unreachable_store_is_a_miss() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ns = make_namespace()
    toks = list(range(9))
    with SyncPrefixClient(ns, ClientConfig(url=f"http://127.0.0.1:{port}", timeout_s=2, connect_timeout_s=1)) as c:
        res = c.lookup(toks)
        assert not res.ok and res.kv_tokens == 0
        assert c.read([GetItem(key=c.prompt(toks).block_key(0))], [bytearray(256)]) == [-1]
        r = c.save(c.prompt(toks), 8, lambda a, b: kv_payload(ns, toks, a, b))
        assert r.stored == 0 and r.dropped == 2
        assert c.failures["lookup"] == 1 and c.failures["read"] == 1


def test_callback_calling_back_in_raises_instead_of_deadlocking(store: ServeProcess) -> None:
    ns = make_namespace()
    toks = list(range(8))
    assert store.url is not None
    with SyncPrefixClient(ns, ClientConfig(url=store.url)) as c:
        def payload(a: int, b: int) -> bytes:
            c.lookup(toks)  # on the loop thread: would wait on itself
            return kv_payload(ns, toks, a, b)

        with pytest.raises(RuntimeError, match="own loop thread"):
            c.save(c.prompt(toks), 8, payload)
        assert c.lookup(toks).ok  # still usable


def test_close_leaves_no_task_pending_on_the_client_loop(store: ServeProcess) -> None:
    """A task left pending on the private loop would be finalised later by the garbage collector,
    on whatever thread it runs on (CPython 3.11 crashed so in a test run here): close ends them all,
    the channel's and any still in flight."""
    import asyncio

    ns = make_namespace()
    assert store.url is not None
    c = SyncPrefixClient(ns, ClientConfig(url=store.url))
    assert c.lookup(list(range(100, 111))).ok  # over the control channel: a WebSocket open on the loop
    loop = c._loop  # the test looks at the private loop itself
    in_flight = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), loop)  # a call still in flight
    c.close()
    assert in_flight.cancelled()
    assert loop.is_closed() and not [t for t in asyncio.all_tasks(loop) if not t.done()]

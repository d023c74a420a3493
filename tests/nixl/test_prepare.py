"""PrefixClient.prepare: the data path set up before the first transfer, so that the first save or
load of an engine neither waits for the NIXL agent to be made (about half a second) nor stalls
the engine's threads while it is (the agent's creation holds the GIL in stretches)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from prefixstore.client import ClientConfig, PrefixClient, SyncPrefixClient, datapath
from prefixstore.client.nixl_path import NixlPath

from ..serve_process import serving
from .conftest import NEEDS_NIXL, Start
from .helpers import namespace, save, tokens

pytestmark = NEEDS_NIXL


@pytest.fixture
def agents_made(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every NIXL path (one agent each) the clients of this test make."""
    made: list[object] = []
    real = datapath.NixlPath

    def counted() -> object:
        path = real()
        made.append(path)
        return path

    monkeypatch.setattr(datapath, "NixlPath", counted)
    return made


async def test_prepare_makes_the_agent_and_the_first_save_uses_it(start: Start, agents_made: list[object]) -> None:
    url, _ = await start(ram_bytes=1 << 20)
    async with PrefixClient(namespace(), ClientConfig(url=url, data_path="auto")) as client:
        assert client.data_path == "undecided" and not agents_made
        assert await client.prepare() is True
        assert client.data_path == "nixl" and len(agents_made) == 1  # made now, connected to the store's
        assert await save(client, tokens(61, 4)) == 4
        assert client.path_bytes["nixl"] > 0  # the save went over the agent prepare made ...
        assert len(agents_made) == 1  # ... and made no other
        assert await client.prepare() is True and len(agents_made) == 1  # asked again: nothing new


async def test_prepare_never_raises_and_says_where_payloads_go(start: Start, agents_made: list[object]) -> None:
    url, _ = await start(ram_bytes=1 << 20, nixl="off")
    async with PrefixClient(namespace(), ClientConfig(url=url)) as auto, \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="http")) as http:
        assert await auto.prepare() is False and auto.data_path == "http"  # the store serves no NIXL
        assert await http.prepare() is False and http.data_path == "http"
        assert await save(auto, tokens(62, 3)) == 3  # and saves still work over HTTP
    assert not agents_made  # the store said no (or NIXL is off): no agent is made for nothing


async def test_a_store_down_at_start_still_gets_the_agent_made(agents_made: list[object]) -> None:
    async with PrefixClient(namespace(), ClientConfig(url="http://127.0.0.1:1", timeout_s=2)) as client:
        assert await client.prepare() is False  # nothing listens there: False, no exception
        # The costly part is done all the same: a later transfer, once the store is up, only loads
        # the store's metadata instead of importing nixl and making the agent in the traffic.
        assert len(agents_made) == 1
        assert await client.prepare() is False and len(agents_made) == 1


async def test_two_setups_at_once_make_one_agent_and_load_the_stores_once(
        start: Start, agents_made: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = await start(ram_bytes=1 << 20)
    connects: list[str] = []
    real_connect = NixlPath.connect

    def counted_connect(self: NixlPath, agent_name: str, metadata: bytes, meta_gen: int | None = None) -> None:
        connects.append(agent_name)
        real_connect(self, agent_name, metadata, meta_gen)

    monkeypatch.setattr(NixlPath, "connect", counted_connect)
    async with PrefixClient(namespace(), ClientConfig(url=url)) as client:
        # Two set-ups at once, both asking the store for its agent before either has connected:
        # prepare() beside the first transfer, or two first transfers.
        data = client.impl.data  # type: ignore[union-attr]
        first, second = await asyncio.gather(data.ready(), data.ready())
        assert first is not None and first is second
        assert len(agents_made) == 1  # one agent, whichever caller made it
        # The store's agent loaded once: loading it again would drop it under any transfer
        # started in between.
        assert len(connects) == 1
        _, saved = await asyncio.gather(client.prepare(), save(client, tokens(63, 4)))
        assert saved == 4 and client.data_path == "nixl" and len(agents_made) == 1 and len(connects) == 1


def test_the_sync_client_prepares_too(tmp_path: Path) -> None:
    # The in-process store runs on a test's event loop; the sync client runs its own: a store process.
    with serving() as serve:
        proc = serve("--port", "0", "--data-dir", str(tmp_path / "data"), "--ram-bytes", "1MiB", "--page-bytes", "4KiB",
                     "--nixl", "on")
        assert proc.url is not None
        with SyncPrefixClient(namespace(), ClientConfig(url=proc.url)) as client:
            assert client.data_path == "undecided"
            assert client.prepare() is True and client.data_path == "nixl"


def test_the_sync_client_prepares_in_the_background_and_close_does_not_wait_for_it(tmp_path: Path) -> None:
    """What SGLang's backend does at start (client/sglang/backend.py): the set-up runs on the client's
    thread while the caller goes on; a store that takes the connection and never answers holds up
    neither the caller nor close()."""
    with serving() as serve:
        proc = serve("--port", "0", "--data-dir", str(tmp_path / "data"), "--ram-bytes", "1MiB", "--page-bytes", "4KiB",
                     "--nixl", "on")
        assert proc.url is not None
        with SyncPrefixClient(namespace(), ClientConfig(url=proc.url)) as client:
            future = client.prepare_in_background()
            assert future.result(timeout=60) is True and client.data_path == "nixl"
            assert sum(client.path_bytes.values()) == 0  # set up before any payload moved
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections (the kernel does) and never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        client = SyncPrefixClient(namespace(), ClientConfig(url=url, timeout_s=60))
        future = client.prepare_in_background()
        time.sleep(0.2)  # the set-up is waiting on the silent store now
        assert not future.done()
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started < 10  # not the 60 s the request may take
        assert future.cancelled()
    finally:
        silent.close()

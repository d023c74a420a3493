"""A NIXL transfer in flight leaves the GIL to the engine thread beside it.

The engine connectors poll their transfers from the client's event loop, on a thread of the
engine's process. vLLM's engine thread releases and retakes the GIL around every torch op; a poll
loop that only yields to the event loop took the GIL back so often that such a thread got it a
third as often as alone. The agent here is a stand-in that reports the transfer in flight for a
fixed time: what is tested is the client's loop, not NIXL (tests/nixl runs real transfers)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from prefixstore.client.nixl_path import TRANSFER_POLL_PAUSE_S, TRANSFER_SPIN_POLLS, NixlPath, TransferFailed

IN_FLIGHT_S = 0.3


class SlowAgent:
    """Reports every transfer in flight ("PROC") for ``hold_s``, then "DONE" (or ``end``)."""

    def __init__(self, hold_s: float, end: str = "DONE") -> None:
        self.hold_s, self.end = hold_s, end
        self.until = 0.0
        self.polls = 0
        self.released = 0

    def get_xfer_descs(self, descs: object, memory: str) -> object:
        return descs

    def initialize_xfer(self, *args: object) -> object:
        return object()

    def transfer(self, handle: object) -> str:
        self.until = time.monotonic() + self.hold_s
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        self.polls += 1
        return "PROC" if time.monotonic() < self.until else self.end

    def release_xfer_handle(self, handle: object) -> None:
        self.released += 1


def path_with(agent: SlowAgent) -> NixlPath:
    path = NixlPath.__new__(NixlPath)  # no real agent: make_agent would start UCX
    path.agent, path.name, path.remote, path.remote_gen = agent, "client", "store", None
    path._regions, path.closed = [], False
    return path


LOCAL = np.array([[4096, 64, 0]], dtype=np.uint64)
REMOTE = np.array([[8192, 64, 0]], dtype=np.uint64)


def gil_turns(seconds: float, stop: threading.Event | None = None) -> int:
    """How often this thread released and got back the GIL in ``seconds`` (or until ``stop``)."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        time.sleep(0)  # lets the GIL go and takes it back, as the engine thread does around a torch op
        n += 1
    return n


async def test_a_transfer_in_flight_is_polled_with_pauses_that_leave_the_gil() -> None:
    alone = gil_turns(IN_FLIGHT_S)
    agent = SlowAgent(IN_FLIGHT_S)
    counted: list[int] = []
    stop = threading.Event()
    engine = threading.Thread(target=lambda: counted.append(gil_turns(10 * IN_FLIGHT_S, stop)))
    engine.start()
    try:
        await path_with(agent).transfer("READ", LOCAL, REMOTE, (), timeout_s=5.0)
    finally:
        stop.set()
        engine.join()
    assert agent.released == 1
    # Not a busy loop: at most one poll per pause after the first few (a slow machine polls less).
    # Yielding only to the loop polled ~30,000 times here.
    assert agent.polls <= TRANSFER_SPIN_POLLS + IN_FLIGHT_S / TRANSFER_POLL_PAUSE_S + 1
    # The thread beside it kept most of its turns at the GIL (polled without pauses: about 0.3x).
    assert counted[0] >= 0.5 * alone, f"{counted[0]} GIL turns beside the transfer, {alone} alone"


async def test_many_transfers_in_flight_do_not_hold_up_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pacing the polls must not block the loop: other coroutines (here a ticker; in an engine the
    connector's other transfers and lookups) keep running while 512 transfers are in flight. A
    blocking pause per poll (``time.sleep``) held the loop up for the sum of every transfer's
    pause, ~75 ms between ticks here: no poll may sleep on the loop's thread, and the ticker runs
    between the polls of transfers still in flight."""
    agents = [SlowAgent(0.01) for _ in range(512)]
    loop_thread = threading.get_ident()
    slept: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if threading.get_ident() == loop_thread:
            slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)
    ticks_in_flight = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks_in_flight
        while not done.is_set():
            await asyncio.sleep(0.001)
            ticks_in_flight += any(a.released == 0 and a.polls > 0 for a in agents)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    await asyncio.gather(*(path_with(a).transfer("READ", LOCAL, REMOTE, (), timeout_s=10.0) for a in agents))
    done.set()
    await tick
    assert all(a.released == 1 for a in agents)
    assert slept == [], f"a poll blocked the event loop's thread: time.sleep {slept[:3]}"
    assert ticks_in_flight > 0


async def test_a_transfer_that_never_ends_still_times_out_and_is_released() -> None:
    agent = SlowAgent(60.0)
    with pytest.raises(TransferFailed, match="not complete within"):
        await path_with(agent).transfer("WRITE", LOCAL, REMOTE, (), timeout_s=0.05)
    assert agent.released == 1


async def test_a_failed_transfer_is_reported() -> None:
    agent = SlowAgent(0.01, end="ERR")
    with pytest.raises(TransferFailed, match="ended in state ERR"):
        await path_with(agent).transfer("READ", LOCAL, REMOTE, (), timeout_s=5.0)
    assert agent.released == 1


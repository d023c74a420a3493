"""The receiver (transport/receiver.py) alone: destinations grouped into spans, and its state machine
filling any layout of sinks from any chunking of the stream (a fake transport, no socket). Its use
against a real store and a scripted fake one: tests/transport/test_frames.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from prefixstore.transport import receiver as receiving


def test_spans_group_back_to_back_destinations() -> None:
    region = memoryview(bytearray(100))
    elsewhere = memoryview(bytearray(10))
    sinks: list[receiving.Sink] = [region[0:10], region[10:30], 5, region[30:40], region[41:50], elsewhere,
                              region[50:60], region[60:60], region[60:70]]
    spans = receiving.spans_of(sinks)
    assert spans[2] is None
    first, second = spans[0], spans[1]
    assert first is not None and second is not None
    assert first[0] is second[0] and len(first[0]) == 30 and (first[1], second[1]) == (0, 10)
    # a drop (int) breaks a run even where the memory continues; so do gaps and other allocations
    for k in (3, 4, 5, 6, 8):
        span, sink = spans[k], sinks[k]
        assert span is not None and not isinstance(sink, int)
        assert span[0] is sink and span[1] == 0
    assert spans[7] is None  # empty
    view, _ = first
    view[25:30] = b"hello"
    assert bytes(region[25:30]) == b"hello"  # the run's view is the destinations' memory


class _FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False


@pytest.mark.parametrize("seed", range(120))
async def test_receiver_fills_any_layout_from_any_chunking(seed: int) -> None:
    """Random sinks (empty, dropped, small, large, back to back or not), random bytes ahead of fill(),
    random receive sizes: every sink gets exactly its bytes, on_data reports them in order."""
    rng = np.random.default_rng(seed)
    receiver = receiving.Receiver(scratch_bytes=int(rng.choice([64, 4096, 1 << 20])))
    fake = _FakeTransport()
    receiver.connection_made(fake)
    region = bytearray(4 << 20)
    sinks: list[receiving.Sink] = []
    at = 0
    for _ in range(int(rng.integers(0, 14))):
        size = int(rng.choice([0, int(rng.integers(1, 100)), int(rng.integers(1, 5000)),
                               int(rng.integers(receiving.DIRECT_MIN_BYTES - 10, receiving.DIRECT_MIN_BYTES + 50_000))]))
        if rng.random() < 0.15:
            sinks.append(size)  # dropped
            continue
        at += int(rng.choice([0, 0, 0, 7]))  # mostly back to back
        sinks.append(memoryview(region)[at : at + size])
        at += size
    sizes = [s if isinstance(s, int) else len(s) for s in sinks]
    body = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    trailer = b"NEXT"  # bytes of whatever follows: must stay in the scratch
    stream = body + trailer
    sent = 0

    def feed(limit: int) -> None:
        nonlocal sent
        while sent < len(stream) and limit > 0 and not fake.paused:
            buf = receiver.get_buffer(-1)
            assert len(buf) > 0
            n = min(len(buf), len(stream) - sent, limit, int(rng.integers(1, 300_000)))
            buf[:n] = stream[sent : sent + n]
            receiver.buffer_updated(n)
            sent += n
            limit -= n

    feed(int(rng.integers(0, 3000)))  # bytes that arrive before fill(): the scratch (maybe paused)
    reports: list[tuple[int, int, int]] = []
    task = asyncio.create_task(receiver.fill(sinks, lambda i, a, b: reports.append((i, a, b))))
    while not task.done():
        await asyncio.sleep(0)
        feed(int(rng.integers(1, 400_000)))
    await task
    at = 0
    for i, (sink, size) in enumerate(zip(sinks, sizes)):
        if not isinstance(sink, int):
            assert bytes(sink) == body[at : at + size], i
        covered = [(a, b) for j, a, b in reports if j == i]
        assert covered and covered[0][0] == 0 and covered[-1][1] == size, (i, covered)
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(covered, covered[1:]))
        at += size
    assert [j for j, _, _ in reports] == sorted(j for j, _, _ in reports)
    feed(len(stream))  # the rest goes to the scratch, after the sinks
    assert receiver.buffered == len(stream) - len(body)
    assert await receiver.read_exactly(len(trailer)) == trailer

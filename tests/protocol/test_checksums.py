"""Batch payload checks (protocol/checksums.py): the native loop answers as python-xxhash does."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixstore.protocol import checksums


def _python(views: list[memoryview], sums: list[int]) -> list[bool]:
    return [xxhash.xxh3_64_intdigest(v) == c for v, c in zip(views, sums)]


@settings(max_examples=150, deadline=None)
@given(payloads=st.lists(st.binary(max_size=3000), max_size=12), flips=st.lists(st.booleans(), max_size=12))
def test_native_verify_equals_python_xxhash(payloads: list[bytes], flips: list[bool]) -> None:
    assert checksums._native_verify is not None, "the native check should be built (a C compiler is on CI)"
    region = bytearray(b"".join(payloads))
    views, sums, at = [], [], 0
    for j, p in enumerate(payloads):
        views.append(memoryview(region)[at : at + len(p)])
        wrong = j < len(flips) and flips[j]
        sums.append(xxhash.xxh3_64_intdigest(p) ^ (1 << (j % 64)) if wrong else xxhash.xxh3_64_intdigest(p))
        at += len(p)
    assert checksums.verify(views, sums) == _python(views, sums)
    assert checksums.verify(views, sums) == [not (j < len(flips) and flips[j]) for j in range(len(payloads))]


def test_both_loops_catch_one_changed_byte_in_a_large_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """1024 KV-block-sized payloads of one region, one byte of one changed after hashing, as a
    READ that outlived its lease would leave it: exactly that payload fails, either way."""
    region = np.random.default_rng(3).integers(0, 256, 1024 * 4096, dtype=np.uint8)
    views = [memoryview(region)[j * 4096 : (j + 1) * 4096] for j in range(1024)]
    sums = [xxhash.xxh3_64_intdigest(v) for v in views]
    region[700 * 4096 + 17] ^= 0x40
    want = [j != 700 for j in range(1024)]
    assert checksums.verify(views, sums) == want
    monkeypatch.setattr(checksums, "_native_verify", None)
    assert checksums.verify(views, sums) == want


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="one checksum per view"):
        checksums.verify([b"a"], [])
    if checksums._native_verify is None:
        pytest.skip("native loop not built")
    with pytest.raises(TypeError, match="bytes-like"):
        checksums._native_verify([1], [2])
    with pytest.raises(TypeError, match=r"checksums\[0\]"):
        checksums._native_verify([b""], ["x"])
    with pytest.raises(OverflowError):
        checksums._native_verify([b""], [1 << 64])


def _runs_beside(views: list[memoryview], sums: list[int], rounds: int) -> int:
    """How often this thread ran Python while another thread was inside the check of ``views``
    (repeated up to ``rounds`` times, until this thread has run once), with the interpreter's
    forced switching put off (switch interval 60 s): a check that holds the GIL throughout
    leaves this thread nothing until it ends; one that releases it leaves it running."""
    hashing, seen, done = threading.Event(), threading.Event(), threading.Event()

    def check() -> None:
        hashing.set()  # no GIL release between this and the check itself
        for _ in range(rounds):
            checksums.verify(views, sums)
            if seen.is_set():
                break
        done.set()

    before = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        worker = threading.Thread(target=check)
        worker.start()
        ran = 0
        while not done.is_set():
            if hashing.is_set() and not done.is_set():
                ran += 1
                seen.set()
            time.sleep(0)  # lets the worker take the GIL whenever it waits for it
        worker.join()
    finally:
        sys.setswitchinterval(before)
    return ran


def test_the_native_loop_leaves_the_gil_to_other_threads_and_python_xxhash_decides_by_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the NIXL client's overlap rule rests on (client/nixl_path.py, hash_chunk_bytes): the
    native check of 64 KiB payloads lets the loop thread run beside it, python-xxhash's does not
    (it keeps the GIL for inputs of 64 KiB or less), and releases_gil says which is which."""
    region = np.ones(16 << 20, dtype=np.uint8)  # touched: not the shared zero page
    views = [memoryview(region)[j << 16 : (j + 1) << 16] for j in range(256)]
    sums = [0] * len(views)
    if checksums._native_verify is not None:
        # Up to 500 checks of 16 MiB (seconds, even on a busy machine) for this thread to get in once.
        assert checksums.releases_gil([4096]) and _runs_beside(views, sums, rounds=500) > 0
    monkeypatch.setattr(checksums, "_native_verify", None)
    assert not checksums.releases_gil([4096, 64 << 10])
    assert _runs_beside(views, sums, rounds=3) == 0
    assert checksums.releases_gil([(64 << 10) + 1]) and not checksums.releases_gil([])

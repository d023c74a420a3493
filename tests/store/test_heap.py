"""heap_keep_bytes (store/heap.py): freed request-sized buffers stay mapped for the next request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prefixstore.store import StoreConfig
from prefixstore.store.knobs import ConfigError

# In a child: the setting is process-wide. A 3 MiB buffer is allocated and freed, and glibc's
# accounting (mallinfo2) read before, while it lives and after: mapped on its own (hblkhd grows)
# and unmapped on free, or carved from the heap (arena) and kept there after the free.
PROBE = """
import ctypes, sys
from prefixstore.store.heap import keep_freed_memory
took = keep_freed_memory(int(sys.argv[1]))
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
before = libc.mallinfo2()
buf = bytearray(3 << 20)
during = libc.mallinfo2()
del buf
after = libc.mallinfo2()
print(int(took), during.hblkhd - before.hblkhd, after.arena - during.arena)
"""


def heap_after_a_freed_buffer(keep_bytes: int) -> tuple[bool, int, int]:
    """(took effect, bytes mapped apart for the buffer, heap bytes gained (or lost) by its free)"""
    out = subprocess.run([sys.executable, "-c", PROBE, str(keep_bytes)], capture_output=True, text=True, check=True)
    took, mapped, kept = out.stdout.split()
    return took == "1", int(mapped), int(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_request_buffer_stays_in_the_heap() -> None:
    took, mapped, kept = heap_after_a_freed_buffer(16 << 20)
    assert took and mapped == 0 and kept == 0  # from the heap, and the heap kept it after the free
    took, mapped, kept = heap_after_a_freed_buffer(0)  # off: glibc maps 3 MiB apart, unmapped on free
    assert not took and mapped >= 3 << 20


def test_heap_keep_bytes_is_a_size_and_not_negative() -> None:
    assert StoreConfig.from_sources(overrides={"heap_keep_bytes": "64MiB"}, env={}).heap_keep_bytes == 64 << 20
    assert StoreConfig(heap_keep_bytes=0).heap_keep_bytes == 0
    with pytest.raises(ConfigError, match="heap_keep_bytes"):
        StoreConfig(heap_keep_bytes=-1)

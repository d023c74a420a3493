"""The RAM arena's memory: private anonymous pages that Linux may back with huge pages.

A NIXL READ of the arena (process_vm_readv over loopback, the NIC's page walk over RDMA) costs
per page: the arena was once a shared anonymous mapping, which Linux treats as shmem and backs
with 4 KiB pages only (shmem_enabled is "never" by default), and a 64 MiB READ out of it took a
third longer than out of huge pages (docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prefixstore.store.arena import Arena

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps block of the mapping that holds ``address``: its permissions
    (``perms``) and its counters (``Rss``, ``AnonHugePages``, ... in kB)."""
    block: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            if block is not None:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= address < hi:
                block = {"perms": head[1]}
        elif block is not None and head[0].endswith(":"):
            block[head[0][:-1]] = head[1]
    assert block is not None, f"no mapping holds {address:#x}"
    return block


def test_the_arena_is_a_private_mapping() -> None:
    arena = Arena(8 << 20, 64 << 10)
    perms = _mapping(int(arena.region.ctypes.data))["perms"]
    assert perms.startswith("rw") and perms.endswith("p"), f"arena mapping is {perms}, expected private rw"


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here")
def test_a_prefaulted_arena_gets_huge_pages_where_the_kernel_offers_them() -> None:
    arena = Arena(64 << 20, 64 << 10)
    if not arena.prefault():
        pytest.skip("MADV_POPULATE_WRITE unsupported (Linux < 5.14)")
    arena.region[:] = 1  # a populated arena; writing must not split it back into small pages
    smaps = _mapping(int(arena.region.ctypes.data))
    huge_kb = int(smaps.get("AnonHugePages", "0"))
    # 64 MiB holds at least 31 aligned 2 MiB extents; demand most of them (khugepaged aside,
    # a fragmented host may fail a few allocations).
    assert huge_kb >= 32 << 10, f"only {huge_kb} kB of the 64 MiB arena is on huge pages ({smaps})"

"""The store process's memory: keep freed request buffers for the next request, and let go of the
pages of LMDB values once they are copied out.

A lookup of a 131,072-token prompt carries 655 KB; aiohttp, msgpack and the store build a few
buffers of that size per request and free them at its end. glibc hands memory that large back
to the kernel on free (``mmap`` chunks, or a trimmed heap top), so the next request faults every
4 KiB page in again: on a 2-vCPU VM that was about half of a lookup's server time
(docs/benchmarks.md, issue 17). :func:`keep_freed_memory` raises glibc's trim and mmap thresholds
(``mallopt``), so up to ``heap_keep_bytes`` of freed memory stays mapped and is reused. It bounds
what the process keeps beyond what it uses (RSS stays within that of its peak use plus the
knob); payloads never come from this heap (they live in the RAM arena). A C library without
``mallopt`` (musl, macOS) is left as it is.

:func:`unmap_pages` drops this process's mapping of a range's whole pages (``MADV_DONTNEED``). The
LMDB tier calls it on its whole memory map every 64 MiB copied out of it (store/lmdb_tier.py
``LmdbTier.let_go``): those file pages stay in the kernel's page cache (a later access maps them
again, a minor fault each), but no longer count in the process's RSS, which otherwise grew with
every value ever read -- by 360 MiB in benchmarks/pin_soak.py's two minutes -- and made RSS say
nothing about what the store holds.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable

log = logging.getLogger(__name__)
PAGE_BYTES = mmap.PAGESIZE
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise() if _MADV_DONTNEED is not None else None


def unmap_pages(address: int, length: int) -> None:
    """Drop this process's mapping of the whole pages inside [address, address + length) of a
    file-backed shared mapping (the data stays in the page cache and in the file; the next access
    maps it again). Nothing where madvise is missing."""
    if _MADVISE is None or _MADV_DONTNEED is None:
        return
    lo = -(-address // PAGE_BYTES) * PAGE_BYTES
    hi = (address + length) // PAGE_BYTES * PAGE_BYTES
    if hi > lo:
        _MADVISE(lo, hi - lo, _MADV_DONTNEED)

# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_freed_memory(keep_bytes: int) -> bool:
    """Keep up to ``keep_bytes`` of freed heap mapped (0: the C library's own behaviour).
    Allocations under a quarter of it come from the heap (reused), larger ones are mapped and
    unmapped on their own. Returns whether the setting took effect."""
    if keep_bytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("heap_keep_bytes: this C library has no mallopt; left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_threshold = min(keep_bytes // 4, 32 << 20)  # glibc refuses a larger mmap threshold
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, min(keep_bytes, 2**31 - 1)))
    if not ok:
        log.info("heap_keep_bytes: mallopt refused %d bytes; left as it is", keep_bytes)
    return ok


__all__ = ["PAGE_BYTES", "keep_freed_memory", "unmap_pages"]

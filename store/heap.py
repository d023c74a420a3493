"""The store process's C heap: keep freed request buffers for the next request.

A lookup of a 131,072-token prompt carries 655 KB; aiohttp, msgpack and the store build a few
buffers of that size per request and free them at its end. glibc hands memory that large back
to the kernel on free (``mmap`` chunks, or a trimmed heap top), so the next request faults every
4 KiB page in again: on a 2-vCPU VM that was about half of a lookup's server time
(docs/benchmarks.md, issue 17). :func:`keep_freed_memory` raises glibc's trim and mmap thresholds
(``mallopt``), so up to ``heap_keep_bytes`` of freed memory stays mapped and is reused. It bounds
what the process keeps beyond what it uses (RSS stays within that of its peak use plus the
knob); payloads never come from this heap (they live in the RAM arena). A C library without
``mallopt`` (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

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


__all__ = ["keep_freed_memory"]

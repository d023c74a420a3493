"""Checking a batch of payloads against their xxh3-64 checksums (DESIGN: every crossing verified).

:func:`verify` answers, per payload, whether its bytes match. Where the optional native module
(``protocol/_checksums.c``, built at install with a C compiler) is present, the whole batch is
hashed in one call with the GIL released; otherwise a Python loop over python-xxhash gives the
same answers. The difference matters to a thread that hashes beside the event loop (the NIXL
client overlaps hashing chunk k with READing chunk k+1): python-xxhash holds the GIL while it
hashes 64 KiB or less, so such a thread checking 64 KiB KV blocks kept the loop thread waiting a
whole switch interval (5 ms) at a time; the native loop releases it once per batch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import xxhash

try:  # the optional native loop; same answers
    from ._checksums import digests as _native_digests
    from ._checksums import verify as _native_verify
except ImportError:  # no C compiler at install time
    _native_verify = None
    _native_digests = None
NATIVE = _native_verify is not None
"""Whether the native batch verifier (protocol/_checksums.c) is in use (``prefixstore stats``)."""

GIL_FREE_ABOVE_BYTES = 64 << 10
"""python-xxhash releases the GIL only while hashing more than this many bytes (measured: a
thread hashing 64 KiB inputs kept another waiting 5.2-6.0 ms for the GIL; 64 KiB + 1 byte inputs,
0.07-0.09 ms)."""


def releases_gil(sizes: Sequence[int]) -> bool:
    """Whether :func:`verify` of payloads of these sizes leaves the GIL to other threads while
    it hashes (always with the native loop; with python-xxhash, only above 64 KiB each)."""
    return _native_verify is not None or (bool(sizes) and min(sizes) > GIL_FREE_ABOVE_BYTES)


def verify(views: Sequence[memoryview], checksums: Sequence[int]) -> list[bool]:
    """Per payload, whether ``xxh3_64(views[i]) == checksums[i]`` (views sliced to the payload)."""
    if len(views) != len(checksums):
        raise ValueError("verify: one checksum per view")
    if _native_verify is not None:
        return list(map(bool, _native_verify(views if isinstance(views, list) else list(views),
                                             checksums if isinstance(checksums, list) else list(checksums))))
    return [xxhash.xxh3_64_intdigest(v) == c for v, c in zip(views, checksums)]


def digests(views: Sequence[memoryview]) -> list[int]:
    """The xxh3-64 of every view, in order (a put's checksums). With the native loop the batch is
    hashed with the GIL released, so a caller may run this in a thread beside its event loop."""
    if _native_digests is not None:
        raw = _native_digests(views if isinstance(views, list) else list(views))
        return list(memoryview(raw).cast("Q")) if sys.byteorder == "little" else \
            [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
    return [xxhash.xxh3_64_intdigest(v) for v in views]


__all__ = ["GIL_FREE_ABOVE_BYTES", "NATIVE", "digests", "releases_gil", "verify"]

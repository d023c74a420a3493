"""A fixed-memory sighting filter that ages: "have I seen this key recently?".

Two generations of a Bloom-style bit array share the byte budget. Keys are
added to the current generation; a key counts as seen if either generation
has it. When the current generation has taken as many keys as keep its false
positive rate low, it becomes the previous one and a fresh array takes its
place, so sightings older than about two generations are forgotten without
any per-key state. Bit positions come from one xxh3-128 of the key (keys
are usually hashes already, but a filter must not depend on that), seeded
with a secret the store draws at start-up (``seed``): with public bit
positions, one tenant could grind keys of its own that set the bits of
another tenant's key and learn from its own admission answers whether that
key was sighted (THREAT_MODEL.md).
"""

from __future__ import annotations

import numpy as np
import xxhash

_NUM_PROBES = 3


class SightingFilter:
    def __init__(self, num_bytes: int, seed: int = 0) -> None:
        if num_bytes < 16:
            raise ValueError(f"sighting filter: num_bytes must be >= 16, got {num_bytes}")
        self.num_bits = (num_bytes // 2) * 8
        self._current = np.zeros(self.num_bits // 8, dtype=np.uint8)
        self._previous = np.zeros(self.num_bits // 8, dtype=np.uint8)
        # ~1/8 fill per generation keeps false positives near 0.2% with 3 probes.
        self.generation_capacity = max(1, self.num_bits // (8 * _NUM_PROBES))
        self._added = 0
        self._seed = seed

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def memory_bytes(self) -> int:
        return self._current.nbytes + self._previous.nbytes

    def bits(self, key: bytes) -> list[int]:
        """The bit positions of ``key`` (seeded: see the module docstring)."""
        return self._bits(key)

    def _bits(self, key: bytes) -> list[int]:
        h = xxhash.xxh3_128_intdigest(key, seed=self._seed)
        return [(h >> (40 * i)) % self.num_bits for i in range(_NUM_PROBES)]

    @staticmethod
    def _has(arr: np.ndarray, bits: list[int]) -> bool:
        return all(arr[b >> 3] >> (b & 7) & 1 for b in bits)

    def __contains__(self, key: bytes) -> bool:
        bits = self._bits(key)
        return self._has(self._current, bits) or self._has(self._previous, bits)

    def add(self, key: bytes) -> None:
        bits = self._bits(key)
        if self._has(self._current, bits):
            return
        for b in bits:
            self._current[b >> 3] |= np.uint8(1 << (b & 7))
        self._added += 1
        if self._added >= self.generation_capacity:
            self._previous, self._current = self._current, self._previous
            self._current[:] = 0
            self._added = 0

"""Where vLLM's CPU attention kernel puts each element of a token's K and V inside a block,
learned from the kernel itself.

vLLM's CPU backend picks a kernel per machine and dtype (``_get_attn_isa``:
vec, vec16, amx, neon, ...), and each packs a block its own way. The vec
kernels keep ``K^T [D, N]`` then ``V [N, D]`` per block and head; the AMX
kernel (bfloat16, block sizes that are multiples of 32, CPUs with AMX tiles)
pre-packs both into tile rows, pairs of elements interleaved, so that its
tile loads need no shuffle. An earlier connector knew the vec layout only,
checked it at start-up, and on an AMX machine stayed idle, which then held
every save it had planned (issue 29): one hand-written layout per ISA is a
layout wrong on the next machine.

So the connector asks the kernel. It writes tokens whose K and V elements
carry their own coordinates, one base-8 digit per probe (digits 1..8 are
exact in every dtype the connector moves, float8 included), into a zeroed
scratch block, and reads back where each coordinate landed::

    probe k:  K[slot, head, dim] = digit_k(id) + 1,  V = 0     (then the same for V, K = 0)
              id = (slot * heads + head) * head_dim + dim
    block:    | ... 3 ... 1 ... 8 ...|   -> position p holds digit_k of the id stored there

The result, a :class:`SlotMap`, is two arrays ``[slots, heads, head_dim]`` of
element offsets inside one kernel block; gathering and scattering through it
is one advanced-index op per K and per V, as for the strided layouts.

What is checked before a map is used (else :class:`LayoutUnsupported`, and the
connector stays idle, acknowledging what the scheduler planned):

* the kernel writes only inside the block the slot names (the scratch holds
  two blocks; probes go to the second, the first must stay zero);
* every coordinate lands in exactly one position and no position receives
  two (a permutation onto the positions it uses);
* a write of random values at slots that cross a block boundary reads back
  through the map equal to what was written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

KernelWrite = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
"""``write(key [t, heads, d], value [t, heads, d], key_cache, value_cache, slots [t])``: a cache
write the way vLLM's CPU backend calls its kernel, key_cache and value_cache being the halves of
the layer's view reinterpreted as ``[blocks, heads, 2 * block_tokens, head_dim]``."""

DIGIT_BASE = 8
"""Probe values are 1..8: exact integers in float32/16, bfloat16, both float8s, int8 and uint8."""


class LayoutUnsupported(ValueError):
    """A cache layout this connector does not move (the connector then never loads or saves)."""


@dataclass(frozen=True, slots=True)
class SlotMap:
    """Element offsets, inside one kernel block of one layer (``heads * block_tokens * 2 * head_dim``
    elements), of every K and V element of each token slot."""

    k: np.ndarray
    """``[block_tokens, heads, head_dim]`` int64: where K[slot, head, dim] sits."""
    v: np.ndarray
    """The same for V."""

    @property
    def block_tokens(self) -> int:
        return int(self.k.shape[0])

    def strided(self) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None:
        """K's and V's (offset, slot stride, head stride, dim stride) where each is an affine
        function of (slot, head, dim), as in the vec kernels' layout; None where not (AMX's tile
        packing). A strided layout is moved through views (one strided copy per index op); any
        other through element offsets, several times slower (tests/vllm/test_slot_map.py)."""
        out = []
        for offsets in (self.k, self.v):
            n, heads, d = offsets.shape
            base = int(offsets[0, 0, 0])
            st = int(offsets[1, 0, 0]) - base if n > 1 else 0
            sh = int(offsets[0, 1, 0]) - base if heads > 1 else 0
            sj = int(offsets[0, 0, 1]) - base if d > 1 else 0
            grid = (base + st * np.arange(n)[:, None, None] + sh * np.arange(heads)[None, :, None]
                    + sj * np.arange(d)[None, None, :])
            if not np.array_equal(grid, offsets):
                return None
            out.append((base, st, sh, sj))
        return out[0], out[1]


def cpu_kernel_write(dtype: torch.dtype, block_tokens: int, head_dim: int, isa: str | None = None) -> KernelWrite:
    """vLLM's own CPU cache-write kernel for the ISA the engine's attention layers use (``isa``:
    what vLLM's CPU backend set on them), or else the one its backend picks for these shapes
    (v1/attention/backends/cpu_attn.py). Raises LayoutUnsupported where this vLLM has none."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        chosen = isa if isa is not None else _get_attn_isa(dtype, block_tokens, head_dim)
    except Exception as err:  # noqa: BLE001 -- a vLLM without the CPU backend: the layout is unknown
        raise LayoutUnsupported(f"CPU attention cache write unavailable: {err}") from err

    def write(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, chosen)

    return write


def _halves(scratch: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's key and value caches over a ``[blocks, heads, n, 2d]`` view, as vLLM's CPU
    backend derives them (``kv_cache.view(blocks, heads, 2n, d).chunk(2, dim=2)``)."""
    blocks, heads, n, c = scratch.shape
    key_cache, value_cache = scratch.view(blocks, heads, 2 * n, c // 2).chunk(2, dim=2)
    return key_cache, value_cache


def learn_slot_map(heads: int, block_tokens: int, head_dim: int, dtype: torch.dtype,
                   write: KernelWrite) -> SlotMap:
    """Probe ``write`` (see the module docstring) and return where it puts every element."""
    n, d = block_tokens, head_dim
    count = n * heads * d
    ids = np.arange(count, dtype=np.int64).reshape(n, heads, d)
    digits = 1
    while DIGIT_BASE ** digits < count:
        digits += 1
    scratch = torch.zeros(2, heads, n, 2 * d, dtype=dtype)
    key_cache, value_cache = _halves(scratch)
    slots = torch.arange(n, 2 * n, dtype=torch.long)  # every slot of block 1
    zeros = torch.zeros(n, heads, d, dtype=dtype)
    maps: list[np.ndarray] = []
    for which in ("k", "v"):
        found = np.zeros(heads * n * 2 * d, dtype=np.int64)
        written: np.ndarray | None = None
        for k in range(digits):
            probe = torch.from_numpy((ids // DIGIT_BASE ** k) % DIGIT_BASE + 1).to(dtype)
            scratch.zero_()
            write(*((probe, zeros) if which == "k" else (zeros, probe)), key_cache, value_cache, slots)
            if scratch[0].view(torch.uint8).count_nonzero():
                raise LayoutUnsupported("vLLM's CPU attention kernel writes outside the block a slot names")
            got = scratch[1].reshape(-1).to(torch.float32).numpy()
            mask = got != 0
            if written is None:
                written = mask
            elif not np.array_equal(written, mask):
                raise LayoutUnsupported("vLLM's CPU attention kernel writes different positions for different values")
            value = np.rint(got[mask]).astype(np.int64) - 1
            if (value < 0).any() or (value >= DIGIT_BASE).any() or not np.allclose(got[mask], value + 1):
                raise LayoutUnsupported("vLLM's CPU attention kernel does not copy values unchanged")
            found[mask] += value * DIGIT_BASE ** k
        assert written is not None
        positions = np.flatnonzero(written)
        where = np.full(count, -1, dtype=np.int64)
        stored = found[positions]
        if len(positions) != count or (stored >= count).any() or len(np.unique(stored)) != count:
            raise LayoutUnsupported(f"vLLM's CPU attention kernel does not place each {which.upper()} element "
                                    "once in its block")
        where[stored] = positions
        maps.append(where.reshape(n, heads, d))
    slot_map = SlotMap(k=maps[0], v=maps[1])
    _check_round_trip(slot_map, heads, d, dtype, write)
    return slot_map


def _check_round_trip(slot_map: SlotMap, heads: int, d: int, dtype: torch.dtype, write: KernelWrite) -> None:
    """Random K and V at slots crossing a block boundary read back whole through the map."""
    n = slot_map.block_tokens
    scratch = torch.zeros(2, heads, n, 2 * d, dtype=dtype)
    key_cache, value_cache = _halves(scratch)
    g = torch.Generator().manual_seed(0)
    t = min(n + 3, 2 * n)
    kv = torch.randint(-64, 64, (2, t, heads, d), generator=g).to(dtype)
    slots = torch.arange(t, dtype=torch.long) + (2 * n - t)
    write(kv[0].contiguous(), kv[1].contiguous(), key_cache, value_cache, slots)
    flat = scratch.view(2, -1)
    blocks = (slots // n).numpy()[:, None, None]
    within = (slots % n).numpy()
    for i, offsets in enumerate((slot_map.k, slot_map.v)):
        got = flat[torch.from_numpy(blocks), torch.from_numpy(offsets[within])]
        if not torch.equal(got, kv[i]):
            raise LayoutUnsupported("vLLM's CPU attention kernel disagrees with the layout learned from it")


__all__ = ["DIGIT_BASE", "KernelWrite", "LayoutUnsupported", "SlotMap", "cpu_kernel_write", "learn_slot_map"]

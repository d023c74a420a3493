"""Paged KV as engines keep it, and gather/scatter between pages and store payloads.

The cache of all attention layers is one tensor; layer ``l`` is the per-layer
block an engine (vLLM, SGLang) allocates::

    data[l] : pages x 2 x page_tokens x kv_heads x head_dim      (2 = K, V)

A sequence owns a list of pages (its page table); token t lives in page
``table[t // page_tokens]`` at slot ``t % page_tokens``. The page size is the
engine's and is independent of the store's block size B: a store block may
start mid-page and span several pages.

A store payload for tokens [a, b) and layers [l0, l1) is layer-major
(protocol/namespace.py, KVLayout)::

    | l0: K[a..b) V[a..b) | l0+1: K V | ... |      each token = kv_heads*head_dim elements

Viewing the cache as rows of ``kv_heads * head_dim`` elements, row
``((l * pages + p) * 2 + c) * page_tokens + s`` holds component c of the
token in page p, slot s, layer l. Every payload is then a list of rows, and
gather / scatter are one ``index_select`` / ``index_copy_`` per run of
equal-length payloads, whatever the page size. (A copy per page would cost a
kernel launch per 16 tokens; the index ops move the same bytes in one pass.)

Rows can be wider than one token: g consecutive tokens of one component in
one page are contiguous in both layouts whenever g divides the page size and
every payload's start and length, so a run moves ``g`` tokens per index
entry, g = gcd(page_tokens, starts, length). With 16-token pages and blocks
that is 8 KiB per entry instead of 512 B; a page size of 7 against blocks
of 16 falls back to g = 1 (docs/gpu_staging.md compares the two).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .reference_model import ModelConfig


class CacheFull(RuntimeError):
    """No free page is left; the message names the knob (num_pages)."""


@dataclass(frozen=True, slots=True)
class Span:
    """One payload in a batch: it holds ``payload_tokens`` tokens, the first ``tokens`` of which
    belong at positions [start, start + tokens) of the sequence."""

    start: int
    tokens: int
    payload_tokens: int

    @property
    def whole(self) -> bool:
        return self.tokens == self.payload_tokens


class PagedKVCache:
    """KV of every attention layer in engine layout, pages handed out to sequences."""

    def __init__(self, *, num_layers: int, num_pages: int, page_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if min(num_layers, num_pages, page_tokens, num_heads, head_dim) < 1:
            raise ValueError("num_layers, num_pages, page_tokens, num_heads and head_dim must be positive")
        self.num_layers, self.num_pages, self.page_tokens = num_layers, num_pages, page_tokens
        self.num_heads, self.head_dim = num_heads, head_dim
        self.data = torch.zeros(num_layers, num_pages, 2, page_tokens, num_heads, head_dim, dtype=dtype,
                                device=device)
        self.rows = self.data.view(-1, num_heads * head_dim)
        self._wide: dict[int, Tensor] = {1: self.rows}
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: recently freed pages are reused first

    @classmethod
    def for_model(cls, config: ModelConfig, *, num_pages: int, page_tokens: int,
                  device: torch.device | str = "cpu") -> PagedKVCache:
        return cls(num_layers=len(config.attention_layers), num_pages=num_pages, page_tokens=page_tokens,
                   num_heads=config.num_kv_heads, head_dim=config.head_dim, device=device)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def row_elems(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.data.element_size()

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def wide_rows(self, g: int) -> Tensor:
        """The cache as rows of g tokens (g divides page_tokens)."""
        if g not in self._wide:
            if self.page_tokens % g:
                raise ValueError(f"a row of {g} tokens does not divide a page of {self.page_tokens}")
            self._wide[g] = self.data.view(-1, g * self.row_elems)
        return self._wide[g]

    def layer(self, layer: int) -> Tensor:
        """Layer ``layer``'s block: pages x 2 x page_tokens x heads x head_dim."""
        return self.data[layer]

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise CacheFull(f"num_pages: {num_pages} more pages needed, {len(self._free)} free of {self.num_pages}")
        return [self._free.pop() for _ in range(num_pages)]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))

    def sequence(self) -> SequenceKV:
        return SequenceKV(self)


class SequenceKV:
    """One sequence's pages: append K/V during compute, gather/scatter store payloads."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.pages: list[int] = []
        self._table = torch.empty(0, dtype=torch.long, device=cache.device)

    @property
    def capacity_tokens(self) -> int:
        return len(self.pages) * self.cache.page_tokens

    def reserve(self, num_tokens: int) -> None:
        """Make room for tokens [0, num_tokens)."""
        missing = -(-num_tokens // self.cache.page_tokens) - len(self.pages)
        if missing > 0:
            self.pages.extend(self.cache.allocate(missing))
            self._table = torch.tensor(self.pages, dtype=torch.long, device=self.cache.device)

    def release(self) -> None:
        self.cache.free(self.pages)
        self.pages = []
        self._table = self._table[:0]

    # ------------------------------------------------------------ row indices

    def _rows(self, tokens: Tensor, layer_start: int, layer_end: int, g: int = 1) -> Tensor:
        """Rows of ``g`` tokens starting at ``tokens`` (any shape ``(..., n)``; multiples of g), in
        payload order ``(..., layer, K/V, n)`` flattened, indexing :meth:`PagedKVCache.wide_rows`."""
        c = self.cache
        per_page = c.page_tokens // g
        base = self._table[tokens // c.page_tokens] * (2 * per_page) + (tokens % c.page_tokens) // g
        layers = torch.arange(layer_start, layer_end, device=c.device) * (c.num_pages * 2 * per_page)
        comps = torch.arange(2, device=c.device) * per_page
        rows = base.unsqueeze(-2).unsqueeze(-2) + (layers.view(-1, 1, 1) + comps.view(1, 2, 1))
        return rows.reshape(-1)

    def rows(self, start: int, end: int, layer_start: int = 0, layer_end: int | None = None, g: int = 1) -> Tensor:
        """Cache rows (of ``g`` tokens) of the payload of tokens [start, end), layers [layer_start, layer_end)."""
        layer_end = self.cache.num_layers if layer_end is None else layer_end
        if not 0 <= start <= end <= self.capacity_tokens:
            raise IndexError(f"tokens [{start}, {end}) outside the {self.capacity_tokens} reserved")
        return self._rows(torch.arange(start, end, g, device=self.cache.device), layer_start, layer_end, g)

    def span_rows(self, starts: Sequence[int], length: int, layer_start: int, layer_end: int, g: int = 1) -> Tensor:
        """Rows (of ``g`` tokens) of several equal-length payloads back to back, each in payload order."""
        first = torch.tensor(list(starts), dtype=torch.long, device=self.cache.device)
        tokens = first.unsqueeze(1) + torch.arange(0, length, g, device=self.cache.device)
        if len(starts) and max(starts) + length > self.capacity_tokens:
            raise IndexError(f"payload tokens beyond the {self.capacity_tokens} reserved")
        return self._rows(tokens, layer_start, layer_end, g)

    def _width(self, *token_counts: int) -> int:
        """The widest row every given start and length is a multiple of (it always divides a page)."""
        return math.gcd(self.cache.page_tokens, *token_counts)

    # ------------------------------------------------------------ compute side

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Append K/V ``(n, heads, head_dim)`` of positions [start, start + n) in ``layer``."""
        n = k.shape[0]
        g = self._width(start, n)
        src = torch.stack([k, v]).reshape(2 * n // g, g * self.cache.row_elems)
        self.cache.wide_rows(g).index_copy_(0, self.rows(start, start + n, layer, layer + 1, g), src)

    def read(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """K and V ``(end, heads, head_dim)`` of positions [0, end) in ``layer`` (a gathered copy)."""
        g = self._width(end)
        kv = self.cache.wide_rows(g).index_select(0, self.rows(0, end, layer, layer + 1, g))
        k, v = kv.view(2, end, self.cache.num_heads, self.cache.head_dim).unbind(0)
        return k, v

    # ------------------------------------------------------------ store payloads

    def gather(self, out: Tensor, spans: Sequence[tuple[int, int]], layer_start: int = 0,
               layer_end: int | None = None) -> None:
        """Write the payloads of token ranges [a, b) back to back into ``out`` (rows x row_elems).

        One ``index_select`` per run of equal-length ranges (a save is many full
        blocks and at most one tail)."""
        layer_end = self.cache.num_layers if layer_end is None else layer_end
        num_layers = layer_end - layer_start
        row = 0
        for starts, length in _runs([(a, b - a) for a, b in spans]):
            n = len(starts) * num_layers * 2 * length
            g = self._width(length, *starts)
            torch.index_select(self.cache.wide_rows(g), 0, self.span_rows(starts, length, layer_start, layer_end, g),
                               out=out[row : row + n].view(-1, g * out.shape[-1]))
            row += n

    def scatter(self, src: Tensor, spans: Sequence[Span], layer_start: int = 0, layer_end: int | None = None) -> None:
        """Write payloads lying back to back in ``src`` (rows x row_elems) into the pages.

        A payload may hold more tokens than the sequence uses (a stored child
        that agrees with the prompt for its first tokens only): its K and V
        then each contribute their first ``tokens`` rows, nothing else."""
        layer_end = self.cache.num_layers if layer_end is None else layer_end
        num_layers = layer_end - layer_start
        row = 0
        whole: list[Span] = []

        def flush() -> None:
            nonlocal row
            for starts, length in _runs([(s.start, s.tokens) for s in whole]):
                n = len(starts) * num_layers * 2 * length
                g = self._width(length, *starts)
                self.cache.wide_rows(g).index_copy_(0, self.span_rows(starts, length, layer_start, layer_end, g),
                                                    src[row : row + n].view(-1, g * src.shape[-1]))
                row += n
            whole.clear()

        for span in spans:
            if span.whole:
                whole.append(span)
                continue
            flush()
            n = num_layers * 2 * span.payload_tokens
            used = src[row : row + n].view(num_layers, 2, span.payload_tokens, -1)[:, :, : span.tokens]
            dst = self.rows(span.start, span.start + span.tokens, layer_start, layer_end)
            self.cache.rows.index_copy_(0, dst, used.reshape(-1, used.shape[-1]))
            row += n
        flush()


def _runs(spans: Sequence[tuple[int, int]]) -> list[tuple[list[int], int]]:
    """Group consecutive (start, length) pairs of equal length: [(starts, length), ...]."""
    out: list[tuple[list[int], int]] = []
    for start, length in spans:
        if length == 0:
            continue
        if out and out[-1][1] == length:
            out[-1][0].append(start)
        else:
            out.append(([start], length))
    return out


__all__ = ["CacheFull", "PagedKVCache", "SequenceKV", "Span"]

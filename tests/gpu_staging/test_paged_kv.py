"""Gather and scatter between paged KV (any page size) and layer-major store payloads."""

from __future__ import annotations

import pytest
import torch

from prefixstore.gpu_staging import CacheFull, PagedKVCache, SequenceKV, Span
from prefixstore.protocol import KVLayout

LAYERS, HEADS, DIM = 3, 2, 4
LAYOUT = KVLayout(num_layers=LAYERS, num_heads=HEADS, head_dim=DIM, dtype="float32")


def filled(page_tokens: int, num_tokens: int, num_pages: int = 64) -> tuple[SequenceKV, torch.Tensor]:
    """A sequence whose K/V are known: a distinct number per element, ``truth[layer, K/V, token]``."""
    cache = PagedKVCache(num_layers=LAYERS, num_pages=num_pages, page_tokens=page_tokens, num_heads=HEADS,
                         head_dim=DIM)
    cache.allocate(3)  # pages taken by someone else: the sequence's pages are not 0, 1, 2, ...
    seq = cache.sequence()
    seq.reserve(num_tokens)
    truth = torch.arange(LAYERS * 2 * num_tokens * HEADS * DIM, dtype=torch.float32).view(
        LAYERS, 2, num_tokens, HEADS, DIM)
    for layer in range(LAYERS):
        seq.write(layer, 0, truth[layer, 0], truth[layer, 1])
    return seq, truth


def payload(truth: torch.Tensor, a: int, b: int, l0: int = 0, l1: int = LAYERS) -> torch.Tensor:
    """The store payload of tokens [a, b), layers [l0, l1), built straight from KVLayout's description."""
    return truth[l0:l1, :, a:b].contiguous().view(-1, HEADS * DIM)


@pytest.mark.parametrize("page_tokens", [1, 3, 4, 16])
def test_gather_builds_layer_major_payloads_whatever_the_page_size(page_tokens: int) -> None:
    seq, truth = filled(page_tokens, 23)
    spans = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 23)]  # store blocks of 4 and a tail of 3
    out = torch.empty(sum(b - a for a, b in spans) * LAYERS * 2, HEADS * DIM)
    seq.gather(out, spans)
    expected = torch.cat([payload(truth, a, b) for a, b in spans])
    assert torch.equal(out, expected)
    assert out.numel() * 4 == LAYOUT.payload_bytes(23)
    # One layer range of one block: the byte range KVLayout.layer_range_bytes names.
    one = torch.empty(2 * 4, HEADS * DIM)
    seq.gather(one, [(8, 12)], 1, 2)
    offset, length = LAYOUT.layer_range_bytes(4, 1, 2)
    block_bytes = payload(truth, 8, 12).view(-1).view(torch.uint8)
    assert torch.equal(one.view(-1).view(torch.uint8), block_bytes[offset : offset + length])


@pytest.mark.parametrize(("page_tokens", "block_tokens"), [(16, 16), (5, 4), (4, 6), (7, 16)])
def test_scatter_then_gather_round_trips(page_tokens: int, block_tokens: int) -> None:
    src_seq, truth = filled(3, 40)  # the source engine pages by 3
    spans = [(a, min(a + block_tokens, 37)) for a in range(0, 37, block_tokens)]
    payloads = torch.empty(37 * LAYERS * 2, HEADS * DIM)
    src_seq.gather(payloads, spans)

    dst = PagedKVCache(num_layers=LAYERS, num_pages=32, page_tokens=page_tokens, num_heads=HEADS, head_dim=DIM)
    dst.data.fill_(-1.0)
    seq = dst.sequence()
    seq.reserve(37)
    seq.scatter(payloads, [Span(a, b - a, b - a) for a, b in spans])
    for layer in range(LAYERS):
        k, v = seq.read(layer, 37)
        assert torch.equal(k, truth[layer, 0, :37]) and torch.equal(v, truth[layer, 1, :37])


def test_scatter_of_a_partly_used_payload_writes_only_the_used_tokens() -> None:
    src, truth = filled(4, 16)
    block = torch.empty(16 * LAYERS * 2, HEADS * DIM)
    src.gather(block, [(8, 16)])  # a stored child of 8 tokens; the prompt agrees with its first 3

    dst = PagedKVCache(num_layers=LAYERS, num_pages=8, page_tokens=5, num_heads=HEADS, head_dim=DIM)
    dst.data.fill_(-1.0)
    seq = dst.sequence()
    seq.reserve(16)
    seq.scatter(block[: 8 * LAYERS * 2], [Span(8, 3, 8)])
    for layer in range(LAYERS):
        k, v = seq.read(layer, 16)
        assert torch.equal(k[8:11], truth[layer, 0, 8:11]) and torch.equal(v[8:11], truth[layer, 1, 8:11])
        assert (k[11:] == -1).all() and (v[11:] == -1).all() and (k[:8] == -1).all()


def test_pages_run_out_with_a_message_naming_the_knob() -> None:
    cache = PagedKVCache(num_layers=1, num_pages=2, page_tokens=4, num_heads=1, head_dim=2)
    seq = cache.sequence()
    seq.reserve(8)
    with pytest.raises(CacheFull, match="num_pages"):
        seq.reserve(9)
    seq.release()
    assert cache.num_free_pages == 2

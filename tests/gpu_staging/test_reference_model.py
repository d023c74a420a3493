"""The reference model: the chunked delta rule is the recurrence, chunking never changes logits,
and a snapshot is exactly what the namespace's StateLayout describes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixstore.gpu_staging import HybridModel, ModelConfig, PagedKVCache, RecurrentState, recompute_logits
from prefixstore.gpu_staging.reference_model import delta_rule_chunked, delta_rule_reference

from .conftest import tokens

TOL = 1e-5


@pytest.mark.parametrize("n", [1, 5, 64, 65, 200])
def test_chunked_delta_rule_is_the_token_recurrence(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    H, d = 4, 32
    q = F.normalize(torch.randn(n, H, d, generator=g), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(n, H, d, generator=g), dim=-1)
    v = torch.randn(n, H, d, generator=g)
    log_a = -F.softplus(torch.randn(n, H, generator=g)) / torch.logspace(0, 3, H)
    b = torch.sigmoid(torch.randn(n, H, generator=g))
    s0 = torch.randn(H, d, d, generator=g) * 0.1
    s_ref, s_chunk = s0.clone(), s0.clone()
    o_ref = delta_rule_reference(q, k, v, log_a, b, s_ref)
    o_chunk = delta_rule_chunked(q, k, v, log_a, b, s_chunk, chunk=16)
    assert (o_ref - o_chunk).abs().max() <= TOL
    assert (s_ref - s_chunk).abs().max() <= TOL


def test_prefill_chunking_does_not_change_logits(model: HybridModel) -> None:
    toks = tokens(1, 150)
    whole = recompute_logits(model, toks, all_logits=True)
    cache = PagedKVCache.for_model(model.config, num_pages=40, page_tokens=7)
    seq, state = cache.sequence(), RecurrentState(model.config)
    ids = torch.tensor(toks)
    parts, start = [], 0
    for end in (1, 17, 64, 65, 101, 150):  # odd chunk ends, a one-token chunk, a page size of 7
        parts.append(model(ids[start:end], start=start, kv=seq, state=state, logits="all"))
        start = end
    assert (torch.cat(parts) - whole).abs().max() <= TOL
    assert whole.std() > 0.5  # logits are not degenerate: the bound above means something


def test_snapshot_payload_is_the_state_layout(model: HybridModel) -> None:
    ns = model.config.namespace(block_tokens=16)
    state = RecurrentState(model.config)
    state.flat.normal_()
    payload = state.payload()
    assert payload.numel() == ns.state.snapshot_bytes == state.num_bytes
    # Layer-major, the delta-rule matrix then the conv window, as StateLayout.shapes says.
    (heads, dk, dv), (conv_dim, width) = ns.state.shapes
    layer1 = payload[ns.state.layer_bytes : 2 * ns.state.layer_bytes].view(torch.float32)
    assert torch.equal(layer1[: heads * dk * dv].view(heads, dk, dv), state.ssm(1))
    assert torch.equal(layer1[heads * dk * dv :].view(conv_dim, width), state.conv(1))
    restored = RecurrentState(model.config).load_payload_(payload.clone())
    assert torch.equal(restored.flat, state.flat)


def test_namespace_names_weights_and_layout() -> None:
    a, b = ModelConfig(), ModelConfig(seed=1)
    assert a.namespace().id != b.namespace().id  # other weights: never the same cache
    ns = a.namespace(block_tokens=16)
    assert (ns.kv.num_layers, ns.kv.num_heads, ns.kv.head_dim, ns.kv.dtype) == (2, 2, 64, "float32")
    assert ns.state.num_layers == 4
    with pytest.raises(ValueError, match="layers"):
        ModelConfig(layers=("linear", "mamba"))

"""Model presets and the FLOP model, pinned to values worked out by hand from the published
shapes (each preset's comment in admission/model_shape.py). Eviction ranks by these numbers
and `plan` prints them, so a changed constant must fail a test."""

from __future__ import annotations

import pytest

from prefixstore.admission import MODEL_PRESETS, ModelShape, get_model


def test_bytes_per_token_and_per_snapshot_of_every_preset() -> None:
    got = {name: (m.kv_bytes_per_token, m.state_bytes, m.num_layers) for name, m in MODEL_PRESETS.items()}
    assert got == {
        # layers x components x kv heads x head dim x 2 bytes; linear layers x per-layer state
        "mamba2-hybrid-7b": (4 * 2 * 8 * 128 * 2, 24 * (2 * 4096 * 128 + 4 * 2 * 4096) * 2, 28),
        "gdn-hybrid": (12 * 2 * 2 * 256 * 2, 36 * (16 * 128 * 128 + 4 * 3 * 2048) * 2, 48),
        "kda-hybrid": (7 * 1 * 1 * 576 * 2, 20 * (32 * 128 * 128 + 4 * 3 * 4096) * 4, 27),
        "transformer-7b": (32 * 2 * 8 * 128 * 2, 0, 32),
    }
    assert got["mamba2-hybrid-7b"][:2] == (16_384, 51_904_512)  # the figures docs/benchmarks.md quotes


def test_linear_layer_flops_of_the_presets() -> None:
    inner = 2 * 4096  # Mamba2: expand 2
    assert get_model("mamba2-hybrid-7b").linear_flops_per_token == 2 * (4096 * 2 * inner + inner * 4096) + 6 * inner * 128
    assert get_model("gdn-hybrid").linear_flops_per_token == 2 * (4 * 2048 * 16 * 128) + 6 * 16 * 128 * 128
    assert get_model("kda-hybrid").linear_flops_per_token == 2 * (4 * 2304 * 32 * 128) + 6 * 32 * 128 * 128
    assert get_model("transformer-7b").linear_flops_per_token == 0
    assert [m.hidden_size for m in MODEL_PRESETS.values()] == [4096, 2048, 2304, 4096]


def test_prefill_flops_by_hand_on_a_toy_shape() -> None:
    toy = ModelShape(name="toy", hidden_size=2, num_attention_layers=1, num_linear_layers=1, num_kv_heads=1,
                     head_dim=2, linear_flops_per_token=10)
    # d = 2, n = 3: MLP 2*2*4*d*d = 64 and projections 2*4*d*d = 32 per token; causal attention 2*n*n*d = 36;
    # the linear layer: n * (10 + 64).
    assert toy.prefill_flops(3) == 3 * (32 + 64) + 36 + 3 * (10 + 64) == 546
    assert toy.segment_flops(1, 3) == toy.prefill_flops(3) - toy.prefill_flops(1)
    assert ModelShape(name="t", hidden_size=2, num_attention_layers=1, num_linear_layers=0, num_kv_heads=1,
                      head_dim=2).linear_flops_per_token == 0
    with pytest.raises(TypeError):
        ModelShape("positional", 2, 1, 1, 1, 2)  # type: ignore[misc]  # keyword-only: no silent field swaps

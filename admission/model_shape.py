"""Model shapes as data, and what follows from them: bytes per token, bytes per
snapshot, recompute FLOPs.

A hybrid stack has ``num_attention_layers`` full-attention layers (paged KV,
grows with the prefix) and ``num_linear_layers`` recurrent layers (constant
state). The FLOP model is the usual dense-transformer accounting, kept simple
on purpose: it ranks entries by recompute saved per byte, it does not predict
kernel times.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixstore.protocol.namespace import DTYPE_BYTES


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    hidden_size: int
    num_attention_layers: int
    num_linear_layers: int
    num_kv_heads: int
    head_dim: int
    kv_components: int = 2  # K and V; 1 for a compressed latent (MLA)
    kv_dtype: str = "float16"
    state_bytes_per_layer: int = 0  # recurrent + conv state of one linear layer
    linear_flops_per_token: int = 0  # per linear layer, per token (projections + state update)
    mlp_ratio: float = 4.0  # MLP width / hidden (an MLP follows every layer)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_attention_layers * self.kv_components * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def state_bytes(self) -> int:
        return self.num_linear_layers * self.state_bytes_per_layer

    @property
    def num_layers(self) -> int:
        return self.num_attention_layers + self.num_linear_layers

    def prefill_flops(self, num_tokens: int) -> float:
        """FLOPs to run a prefix of ``num_tokens`` tokens through the model from scratch."""
        d, n = self.hidden_size, float(num_tokens)
        mlp = 2 * 2 * self.mlp_ratio * d * d  # up + down projections, 2 FLOPs per MAC
        attn_proj = 2 * 4 * d * d  # q, k, v, o (an upper bound under GQA)
        attention = self.num_attention_layers * (n * (attn_proj + mlp) + 2 * n * n * d)  # causal QK^T and AV
        linear = self.num_linear_layers * n * (self.linear_flops_per_token + mlp)
        return attention + linear

    def segment_flops(self, start: int, end: int) -> float:
        """FLOPs to compute tokens [start, end) given the KV and state of [0, start)."""
        return self.prefill_flops(end) - self.prefill_flops(start)


def _mamba2_linear_flops(d: int, state: int, expand: int = 2) -> int:
    inner = expand * d
    return 2 * (d * 2 * inner + inner * d) + 6 * inner * state  # in/out projections + scan


def _delta_linear_flops(d: int, heads: int, head_dim: int) -> int:
    return 2 * (4 * d * heads * head_dim) + 6 * heads * head_dim * head_dim  # q,k,v,o + delta-rule update


#: Presets, by name (``--model`` in simulate / plan). Sizes follow the published
#: shapes of each family closely enough for capacity planning; substitute your
#: model's real per-layer sizes for anything finer.
MODEL_PRESETS: dict[str, ModelShape] = {
    # 7B Attention-Mamba2 hybrid as in the Marconi paper: 24 SSM + 4 attention, d=4096, N=128, fp16.
    "mamba2-hybrid-7b": ModelShape(
        name="mamba2-hybrid-7b", hidden_size=4096, num_attention_layers=4, num_linear_layers=24,
        num_kv_heads=8, head_dim=128, state_bytes_per_layer=(2 * 4096 * 128 + 4 * 2 * 4096) * 2,
        linear_flops_per_token=_mamba2_linear_flops(4096, 128)),
    # Gated-DeltaNet hybrid (3 linear : 1 attention), d=2048, 16 heads x 128 state per linear layer.
    "gdn-hybrid": ModelShape(
        name="gdn-hybrid", hidden_size=2048, num_attention_layers=12, num_linear_layers=36,
        num_kv_heads=2, head_dim=256, state_bytes_per_layer=(16 * 128 * 128 + 4 * 3 * 2048) * 2,
        linear_flops_per_token=_delta_linear_flops(2048, 16, 128)),
    # Kimi-Delta-Attention hybrid (3 KDA : 1 MLA), compressed latent KV (one 576-wide component).
    "kda-hybrid": ModelShape(
        name="kda-hybrid", hidden_size=2304, num_attention_layers=7, num_linear_layers=20,
        num_kv_heads=1, head_dim=576, kv_components=1, state_bytes_per_layer=(32 * 128 * 128 + 4 * 3 * 4096) * 4,
        linear_flops_per_token=_delta_linear_flops(2304, 32, 128)),
    # A plain 7B transformer: the degenerate case, no state.
    "transformer-7b": ModelShape(
        name="transformer-7b", hidden_size=4096, num_attention_layers=32, num_linear_layers=0,
        num_kv_heads=8, head_dim=128),
}


def get_model(name: str) -> ModelShape:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODEL_PRESETS)}") from None

"""Tiny random-weight models for vLLM's CPU engine, written by transformers into a directory.

Shared by the end-to-end tests (tests/vllm/test_engine_e2e.py) and the multi-turn benchmark
(benchmarks/vllm_multiturn.py), so both run the same model. Nothing is downloaded: the weights
come from ``torch.manual_seed(0)`` and the config here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}
"""vLLM 0.32's CPU rotary-embedding kernel (``torch.ops._C.rotary_embedding``, the CustomOp's
``forward_cpu``) takes ``num_tokens = query.numel() / query.size(-1)``: a ``[tokens, heads,
head_size]`` query, which LFM2's attention passes (``models/lfm2.py:176``), is read as
``tokens * heads`` one-head tokens, rotated by ``positions[token * heads + head]``, which runs past
the batch's positions into whatever vLLM's persistent buffer holds there. Outputs then depend on
where prefill chunks end (-0.7825 vs -0.7511 for one log-probability) and differ from transformers
by up to 0.2. With the op's PyTorch path (this setting, vLLM's ``compilation_config``) vLLM's LFM2
equals transformers' to 1e-4 at every position, in one chunk or in 32-token chunks (docs/vllm.md)."""


def save_tiny(model_cls: Any, config: Any, path: Path) -> str:
    """Random weights (seed 0) of ``model_cls(config)`` saved at ``path``; the path as a string."""
    import torch

    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)
    return str(path)


def lfm2(path: Path, *, hidden_size: int = 128, num_layers: int = 4, max_position_embeddings: int = 1024) -> str:
    """A hybrid LFM2: short-conv layers beside full attention, alternating (conv first).

    The defaults are the tests' 4-layer model; the benchmark may widen it. ``max_position_embeddings``
    only bounds the prompt length (rotary embeddings have no weights), so the same seed gives
    the same weights whatever it is."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    if num_layers < 2 or num_layers % 2:
        raise ValueError(f"num_layers: an even number >= 2 (conv and attention alternate), got {num_layers}")
    # vLLM 0.32's LFM2 reads the conv/block sizes under these (older) config names.
    config = Lfm2Config(vocab_size=512, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=2,
                        max_position_embeddings=max_position_embeddings,
                        layer_types=["conv", "full_attention"] * (num_layers // 2), conv_L_cache=3,
                        conv_dim=hidden_size, block_dim=hidden_size, block_ff_dim=2 * hidden_size,
                        block_auto_adjust_ff_dim=False, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
                        norm_eps=1e-5, initializer_range=0.5)
    return save_tiny(Lfm2ForCausalLM, config, path)


def qwen3_next(path: Path, *, max_position_embeddings: int = 1024) -> str:
    """A gated-delta-net hybrid shaped like Qwen3-Next (linear attention, then full attention), in
    the smallest shapes vLLM's CPU kernels take, with a long-memory decay so its state matters."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # vLLM's CPU gated-delta-net kernel takes bfloat16 only and head sizes of 64 or more
    # (ops/cpu/gdn_attention.py:158, chunk_gated_delta_rule_cpu).
    config = Qwen3NextConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=64, linear_num_value_heads=2,
                             linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             shared_expert_intermediate_size=64, layer_types=["linear_attention", "full_attention"],
                             max_position_embeddings=max_position_embeddings, initializer_range=0.5)
    import torch

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    for layer in model.model.layers:  # a long memory (decay exp(-exp(A_log) * dt) near 1): the state matters
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.A_log.data.fill_(-8.0)
    model.save_pretrained(path)
    return str(path)


__all__ = ["NATIVE_ROPE", "lfm2", "qwen3_next", "save_tiny"]

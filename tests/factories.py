"""Factories for test data: namespaces, token streams, payloads whose bytes say where they came from."""

from __future__ import annotations

import numpy as np

from prefixstore.protocol import KVLayout, Namespace, StateLayout


def make_namespace(*, block_tokens: int = 4, with_state: bool = True, tenant: str = "default",
                   model: str = "test-hybrid", num_layers: int = 2) -> Namespace:
    """A tiny hybrid namespace: 2 attention layers x 1 head x 4 dims fp32 (64 B/token), 16-byte state."""
    return Namespace(
        model=model,
        kv=KVLayout(num_layers=num_layers, num_heads=1, head_dim=4, dtype="float32"),
        state=StateLayout(num_layers=1, shapes=((2, 2),), dtype="float32") if with_state else StateLayout(),
        block_tokens=block_tokens,
        tenant=tenant,
    )


def kv_payload(ns: Namespace, tokens: list[int] | np.ndarray, start: int, end: int) -> bytes:
    """A deterministic store-layout payload for tokens [start, end) of a sequence.

    Each token's bytes derive from (position, token id, every earlier token), so
    a payload is only equal to another if the prefixes are equal — a wrong
    read cannot pass for a right one."""
    toks = np.asarray(tokens, dtype=np.uint64)
    prefix = np.cumsum(toks * np.uint64(2654435761) + np.uint64(1), dtype=np.uint64)
    per_layer = ns.kv.layer_token_bytes
    out = np.empty((ns.kv.num_layers, end - start, per_layer), dtype=np.uint8)
    for layer in range(ns.kv.num_layers):
        for i, pos in enumerate(range(start, end)):
            seed = int(prefix[pos]) ^ (pos << 20) ^ (layer << 40)
            out[layer, i] = np.random.default_rng(seed & 0xFFFFFFFFFFFF).integers(0, 256, per_layer, dtype=np.uint8)
    return out.tobytes()


def state_payload(ns: Namespace, tokens: list[int] | np.ndarray, t: int) -> bytes:
    """A deterministic snapshot payload for the state after consuming tokens[:t]."""
    toks = np.asarray(tokens[:t], dtype=np.uint64)
    seed = int(np.sum(toks * np.arange(1, t + 1, dtype=np.uint64) * np.uint64(40503), dtype=np.uint64)) ^ t
    return np.random.default_rng(seed & 0xFFFFFFFFFFFF).integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8).tobytes()

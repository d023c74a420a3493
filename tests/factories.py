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


def make_headed_namespace(*, block_tokens: int = 4, num_heads: int = 4, model: str = "test-headed") -> Namespace:
    """A hybrid namespace addressable per head: 2 attention layers x ``num_heads`` KV heads x 4 dims
    fp32; a state of 2 layers, each an fp32 [U, 2, 2] tensor beside a bf16 [U, 3] one (U = num_heads)."""
    return Namespace(
        model=model,
        kv=KVLayout(num_layers=2, num_heads=num_heads, head_dim=4, dtype="float32"),
        state=StateLayout(num_layers=2, shapes=((num_heads, 2, 2), (num_heads, 3)), num_heads=num_heads,
                          dtypes=("float32", "bfloat16")),
        block_tokens=block_tokens,
    )


def head_slice(ns: Namespace, payload: bytes, num_tokens: int, heads: tuple[int, int],
               layers: tuple[int, int] | None = None) -> bytes:
    """Heads [a, b) (of layers [l0, l1)) of a KV payload, cut with numpy from the layout's own
    description ``[layer][K|V][head][token][dim]``: independent of ``Namespace.payload_runs``."""
    kv = ns.kv
    a = np.frombuffer(payload, dtype=np.uint8).reshape(kv.num_layers, kv.num_components, kv.num_heads, -1)
    l0, l1 = layers or (0, kv.num_layers)
    return a[l0:l1, :, heads[0]:heads[1]].tobytes()


def state_head_slice(ns: Namespace, payload: bytes, heads: tuple[int, int]) -> bytes:
    """State heads [a, b) of a snapshot: per layer, each tensor's rows a..b."""
    st = ns.state
    out = []
    layers = np.frombuffer(payload, dtype=np.uint8).reshape(st.num_layers, st.layer_bytes)
    for row in layers:
        pos = 0
        for size in st.tensor_bytes:
            tensor = row[pos : pos + size].reshape(st.num_heads, -1)
            out.append(tensor[heads[0]:heads[1]].tobytes())
            pos += size
    return b"".join(out)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise (uint64, wrapping): neighbouring inputs, unrelated outputs."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def kv_payload(ns: Namespace, tokens: list[int] | np.ndarray, start: int, end: int) -> bytes:
    """A deterministic store-layout payload for tokens [start, end) of a sequence.

    Each token's bytes derive from (position, token id, every earlier token), per layer, so
    a payload is only equal to another if the prefixes are equal — a wrong
    read cannot pass for a right one. Made in one vectorized pass (a counter-mode mix of each
    (layer, token)'s seed): a generator per layer and token made a 64-block save of a 256-layer
    model take 13 s."""
    toks = np.asarray(tokens, dtype=np.uint64)
    # Each (position, token) pair mixed before the running sum, so the sum is not order-free: a
    # prefix with two tokens swapped, or two changed by opposite amounts, sums to another value.
    at = np.arange(len(toks), dtype=np.uint64)
    prefix = np.cumsum(_mix64(toks ^ (at << np.uint64(32)) ^ np.uint64(0x5851F42D4C957F2D)), dtype=np.uint64)
    per_layer = ns.kv.layer_token_bytes
    positions = np.arange(start, end, dtype=np.uint64)
    layers = np.arange(ns.kv.num_layers, dtype=np.uint64)
    seeds = _mix64(prefix[start:end] ^ (positions << np.uint64(20)))[None, :] ^ _mix64(layers << np.uint64(40) | np.uint64(1))[:, None]
    words = -(-per_layer // 8)
    counters = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    out = _mix64(seeds[:, :, None] + counters[None, None, :]).view(np.uint8)
    return np.ascontiguousarray(out[:, :, :per_layer]).tobytes()


def state_payload(ns: Namespace, tokens: list[int] | np.ndarray, t: int) -> bytes:
    """A deterministic snapshot payload for the state after consuming tokens[:t]."""
    toks = np.asarray(tokens[:t], dtype=np.uint64)
    seed = int(np.sum(toks * np.arange(1, t + 1, dtype=np.uint64) * np.uint64(40503), dtype=np.uint64)) ^ t
    return np.random.default_rng(seed & 0xFFFFFFFFFFFF).integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8).tobytes()

"""A small hybrid model in torch: the one reference that tests, benchmarks and the demo run.

Six layers by default, ``L L A L L A``: four gated delta-rule (linear
attention) layers with a short causal convolution, and two full-attention
layers with RoPE that read and write a paged KV cache. Weights are random,
seeded, float32; nothing is downloaded. Every layer is followed by a SwiGLU
MLP; norms are RMSNorm (pre-norm).

What a sequence holds while it runs::

    attention layer a   paged KV: K and V of every consumed token (grows)     -> store KV blocks/tails
    linear layer i      S_i[h, d_k, d_v]  delta-rule state (constant size)    -> store snapshots
                        conv_i[c, w-1]    the last w-1 conv inputs

Gated delta rule, per head (row convention, o_t = S_t^T q_t)::

    S_t = a_t * S_{t-1} + k_t u_t^T,   u_t = b_t * (v_t - a_t * S_{t-1}^T k_t)

with ``a_t`` in (0, 1) a learned decay and ``b_t`` in (0, 1) the write
strength. Heads get decays spread from fast (about 10 tokens) to slow (about
10,000 tokens), as trained models have, so a state rebuilt from a short
suffix (Tail-Replay) measurably differs from the exact one.

Prefill uses the chunkwise-parallel (WY) form of the recurrence -- the
algorithm engines' kernels use -- and :func:`delta_rule_reference` is the
token-by-token loop it is tested against. The chunked form is about 50x
faster here; a token loop spends its time in per-op overhead (and with the
batched-matmul form, in OpenMP barriers on a loaded 2-core machine).

Exactness across a cache hit: every quantity of token t depends on the state
at t and the tokens from t on, never on where a prefill chunk started, except
through float rounding of differently-shaped matmuls (about 1e-7 relative).
The reuse tests check logits against full recompute to 1e-5.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prefixstore.protocol.namespace import KVLayout, Namespace, StateLayout



class SequenceKV(Protocol):
    """What the model needs of one sequence's paged KV (gpu_staging/paged_kv.py ``SequenceKV``
    is the implementation; the model names only this, so the two modules do not import each other)."""

    def reserve(self, num_tokens: int) -> None:
        """Make room for tokens [0, num_tokens)."""

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Append K/V ``(n, heads, head_dim)`` of positions [start, start + n) in ``layer``."""

    def read(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        """K and V ``(end, heads, head_dim)`` of positions [0, end) in ``layer``."""

LayerKind = Literal["linear", "attention"]
LogitsFor = Literal["last", "all", "none"]

#: Tokens per chunk of the chunkwise delta rule (the WY solve is C x C per head).
DELTA_CHUNK = 64


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and seed of the reference model; every field changes the namespace (see :meth:`namespace`)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    layers: tuple[LayerKind, ...] = ("linear", "linear", "attention", "linear", "linear", "attention")
    num_heads: int = 4
    """Query heads of an attention layer."""
    num_kv_heads: int = 2
    """K/V heads of an attention layer (grouped-query attention); what the paged KV stores."""
    head_dim: int = 64
    linear_heads: int = 4
    """Heads of a delta-rule layer; its state is linear_heads x linear_head_dim x linear_head_dim."""
    linear_head_dim: int = 64
    conv_width: int = 4
    """Taps of the causal depthwise convolution over q, k, v; its state keeps conv_width - 1 inputs."""
    mlp_hidden: int = 512
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for kind in self.layers:
            if kind not in ("linear", "attention"):
                raise ValueError(f"layers: unknown layer kind {kind!r}; choose linear or attention")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads: must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim: RoPE needs an even head_dim")
        if self.conv_width < 2:
            raise ValueError("conv_width: must be at least 2 (the state keeps conv_width - 1 inputs)")

    @property
    def attention_layers(self) -> list[int]:
        """Model layer index of each attention layer; position in this list = KV layer in the store."""
        return [i for i, kind in enumerate(self.layers) if kind == "attention"]

    @property
    def linear_layers(self) -> list[int]:
        """Model layer index of each linear layer; position in this list = state layer in a snapshot."""
        return [i for i, kind in enumerate(self.layers) if kind == "linear"]

    @property
    def conv_dim(self) -> int:
        return 3 * self.linear_heads * self.linear_head_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Tensors of one linear layer's state, in payload order."""
        d = self.linear_head_dim
        return ((self.linear_heads, d, d), (self.conv_dim, self.conv_width - 1))

    @property
    def revision(self) -> str:
        """A digest of every field: different weights or shapes never share a namespace."""
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:16]

    def namespace(self, *, block_tokens: int = 16, tenant: str = "default") -> Namespace:
        """The store namespace of this model's KV and state (float32, layer-major). Its payloads are
        token-major inside a layer's K and V, not the head-major layout engines share
        (docs/design.md, "One layout for every TP size"), and its state is not laid out by head
        unit: the revision says so, so no namespace of the shared layout can ever equal this one."""
        return Namespace(
            model="prefixstore-reference-hybrid",
            revision=self.revision + "|kv:token-major",
            kv=KVLayout(num_layers=len(self.attention_layers), num_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype="float32"),
            state=StateLayout(num_layers=len(self.linear_layers), shapes=self.state_shapes, dtype="float32"),
            block_tokens=block_tokens,
            tenant=tenant,
        )


class RecurrentState:
    """All linear layers' state in one contiguous float32 tensor, laid out as a snapshot payload.

    ::

        flat[i] = | S_i: heads x d_k x d_v | conv_i: conv_dim x (w-1) |     i = linear layer 0, 1, ...

    So a snapshot is one ``clone()`` (copy before extend) and its payload is
    that tensor's bytes, exactly what :class:`StateLayout` describes.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu",
                 flat: Tensor | None = None) -> None:
        self.config = config
        heads, d, _ = config.state_shapes[0]
        self._ssm_elems = heads * d * d
        per_layer = self._ssm_elems + config.conv_dim * (config.conv_width - 1)
        shape = (len(config.linear_layers), per_layer)
        if flat is None:
            flat = torch.zeros(shape, dtype=torch.float32, device=device)
        elif tuple(flat.shape) != shape or flat.dtype != torch.float32:
            raise ValueError(f"state tensor: expected float32 {shape}, got {flat.dtype} {tuple(flat.shape)}")
        self.flat = flat

    def ssm(self, i: int) -> Tensor:
        heads, d, _ = self.config.state_shapes[0]
        return self.flat[i, : self._ssm_elems].view(heads, d, d)

    def conv(self, i: int) -> Tensor:
        return self.flat[i, self._ssm_elems :].view(self.config.conv_dim, self.config.conv_width - 1)

    def zero_(self) -> RecurrentState:
        self.flat.zero_()
        return self

    def clone(self) -> RecurrentState:
        return RecurrentState(self.config, flat=self.flat.clone())

    def copy_(self, other: RecurrentState) -> RecurrentState:
        self.flat.copy_(other.flat)
        return self

    @property
    def num_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def payload(self) -> Tensor:
        """The snapshot payload: the flat tensor's bytes (a uint8 view, host memory)."""
        return self.flat.detach().cpu().contiguous().view(-1).view(torch.uint8)

    def load_payload_(self, payload: Tensor) -> RecurrentState:
        """Overwrite from a snapshot payload (uint8, exactly ``num_bytes``)."""
        if payload.numel() != self.num_bytes:
            raise ValueError(f"snapshot payload: expected {self.num_bytes} bytes, got {payload.numel()}")
        self.flat.view(-1).copy_(payload.view(torch.float32))
        return self


# ---------------------------------------------------------------- the delta rule


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, b: Tensor, state: Tensor,
                       chunk: int = DELTA_CHUNK) -> Tensor:
    """Gated delta rule over n tokens, chunkwise-parallel (WY form); updates ``state`` in place.

    Shapes: q, k ``(n, H, dk)`` (k L2-normalised), v ``(n, H, dv)``, log_a and b
    ``(n, H)``, state ``(H, dk, dv)``. Returns o ``(n, H, dv)``.

    Within a chunk, with G_t = sum of log a up to t (from the chunk start) and
    S0 the state before it, unrolling the recurrence gives::

        (I + A) U = b*V - (b*exp(G)*K) S0       A[t,i] = b_t exp(G_t - G_i) k_t.k_i   (i < t)
        O         = (exp(G)*Q) S0 + (M * Q K^T) U  M[t,i] = exp(G_t - G_i)              (i <= t)
        S_end     = exp(G_C) S0 + (exp(G_C - G)*K)^T U

    Everything but the S0 terms is computed for all chunks at once; the pass
    over chunks is a few small matmuls each.
    """
    n, H, dk = k.shape
    dv = v.shape[-1]
    if n == 0:
        return v.new_zeros(0, H, dv)
    pad = (-n) % chunk
    if pad:
        # Padded tokens have a = 1 (log 0), b = 0 and zero vectors: they change nothing.
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        log_a, b = (F.pad(x, (0, 0, 0, pad)) for x in (log_a, b))
    N = (n + pad) // chunk
    # (H, N, C, d) layouts.
    qc = q.view(N, chunk, H, dk).permute(2, 0, 1, 3)
    kc = k.view(N, chunk, H, dk).permute(2, 0, 1, 3)
    vc = v.view(N, chunk, H, dv).permute(2, 0, 1, 3)
    bc = b.view(N, chunk, H).permute(2, 0, 1)
    g = log_a.view(N, chunk, H).permute(2, 0, 1).cumsum(-1)  # G_t, (H, N, C)

    diff = g.unsqueeze(-1) - g.unsqueeze(-2)  # G_t - G_i
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, torch.full_like(diff, -math.inf)).exp()  # M, zero above the diagonal
    eye = torch.eye(chunk, dtype=torch.bool, device=q.device)
    A = bc.unsqueeze(-1) * decay.masked_fill(eye, 0) * (kc @ kc.transpose(-1, -2))  # strictly lower
    I_plus_A = A + eye.to(q.dtype)
    # (I + A)^-1 applied to both right-hand sides in one unit-lower-triangular solve.
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * g.exp()).unsqueeze(-1) * kc], dim=-1)
    sol = torch.linalg.solve_triangular(I_plus_A, rhs, upper=False, unitriangular=True)
    u_v, w = sol[..., :dv], sol[..., dv:]  # U = u_v - w S0
    qk = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * g.exp().unsqueeze(-1)
    k_to_end = kc * (g[..., -1:] - g).exp().unsqueeze(-1)
    end_decay = g[..., -1].exp()  # (H, N)

    out = torch.empty(H, N, chunk, dv, dtype=q.dtype, device=q.device)
    S = state
    for c in range(N):
        u = u_v[:, c] - w[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + qk[:, c] @ u
        S = end_decay[:, c].view(H, 1, 1) * S + k_to_end[:, c].transpose(-1, -2) @ u
    state.copy_(S)
    return out.permute(1, 2, 0, 3).reshape(N * chunk, H, dv)[:n]


def delta_rule_reference(q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, b: Tensor, state: Tensor) -> Tensor:
    """The same recurrence token by token: the definition the chunked form is tested against."""
    H, dv = v.shape[1], v.shape[2]
    out = torch.empty(q.shape[0], H, dv, dtype=q.dtype)
    S = state
    for t in range(q.shape[0]):
        S = log_a[t].exp().view(H, 1, 1) * S
        u = b[t].unsqueeze(-1) * (v[t] - (k[t].unsqueeze(-1) * S).sum(1))
        S = S + k[t].unsqueeze(-1) * u.unsqueeze(1)
        out[t] = (q[t].unsqueeze(-1) * S).sum(1)
    state.copy_(S)
    return out


# ---------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: Tensor = self.down(F.silu(gate) * up)
        return out


class DeltaRuleLayer(nn.Module):
    """Gated delta-rule mixer: q/k/v projections, causal conv, decay and write gates, output gate."""

    inv_tau: Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        H, d = config.linear_heads, config.linear_head_dim
        self.H, self.d, self.width = H, d, config.conv_width
        self.qkv = nn.Linear(config.hidden_size, 3 * H * d, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(config.conv_dim, config.conv_width))
        self.decay_proj = nn.Linear(config.hidden_size, H, bias=False)
        self.write_proj = nn.Linear(config.hidden_size, H, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, H * d, bias=False)
        self.out_proj = nn.Linear(H * d, config.hidden_size, bias=False)
        # Per-head decay time scales from ~10 to ~10,000 tokens (a = exp(-softplus(.) / tau)).
        self.register_buffer("inv_tau", 1.0 / torch.logspace(1, 4, H), persistent=False)
        self.head_norm = RMSNorm(d)

    def forward(self, x: Tensor, ssm: Tensor, conv: Tensor) -> Tensor:
        n = x.shape[0]
        H, d = self.H, self.d
        qkv = self.qkv(x)  # (n, conv_dim)
        # Causal depthwise conv over [previous w-1 inputs, this chunk]; as an
        # explicit sum of w shifted products it is the same arithmetic whatever
        # the chunking (conv1d picks algorithms by length).
        window = torch.cat([conv.t(), qkv], dim=0)  # (w-1+n, conv_dim)
        mixed = window[0:n] * self.conv_weight[:, 0]
        for tap in range(1, self.width):
            mixed = mixed + window[tap : tap + n] * self.conv_weight[:, tap]
        conv.copy_(window[n:].t())  # copy before extend: the state now ends at the chunk's last token
        mixed = F.silu(mixed)
        q, k, v = mixed.view(n, 3, H, d).unbind(1)
        q = F.normalize(q, dim=-1) * d**-0.5
        k = F.normalize(k, dim=-1)
        log_a = -F.softplus(self.decay_proj(x)) * self.inv_tau
        b = torch.sigmoid(self.write_proj(x))
        o = delta_rule_chunked(q, k, v, log_a, b, ssm)
        o = self.head_norm(o).reshape(n, H * d) * F.silu(self.gate_proj(x))
        out: Tensor = self.out_proj(o)
        return out


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding of x ``(n, heads, dim)`` at absolute ``positions`` (elementwise: chunking-proof)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # (n, dim/2)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class AttentionLayer(nn.Module):
    """Grouped-query attention with RoPE over the sequence's paged KV (K is cached after RoPE)."""

    def __init__(self, config: ModelConfig, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.Hq, self.Hkv, self.D = config.num_heads, config.num_kv_heads, config.head_dim
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(config.hidden_size, self.Hq * self.D, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * self.Hkv * self.D, bias=False)
        self.out_proj = nn.Linear(self.Hq * self.D, config.hidden_size, bias=False)

    def forward(self, x: Tensor, start: int, kv: SequenceKV, write_kv: bool) -> Tensor:
        n = x.shape[0]
        positions = torch.arange(start, start + n, device=x.device)
        q = rope(self.q_proj(x).view(n, self.Hq, self.D), positions, self.theta)
        if write_kv:
            k, v = self.kv_proj(x).view(n, 2, self.Hkv, self.D).unbind(1)
            kv.write(self.kv_layer, start, rope(k, positions, self.theta), v)
        keys, values = kv.read(self.kv_layer, start + n)  # (start+n, Hkv, D) each
        q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
        if start == 0:
            o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
        else:
            # Query i sits at position start + i: it sees keys [0, start + i].
            mask = torch.ones(n, start + n, dtype=torch.bool, device=x.device).tril(start)
            o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)
        out: Tensor = self.out_proj(o.squeeze(0).transpose(0, 1).reshape(n, self.Hq * self.D))
        return out


class Block(nn.Module):
    def __init__(self, config: ModelConfig, kind: LayerKind, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.index = index  # among layers of its kind: KV layer or state layer
        self.norm1 = RMSNorm(config.hidden_size)
        self.mixer: nn.Module = DeltaRuleLayer(config) if kind == "linear" else AttentionLayer(config, index)
        self.norm2 = RMSNorm(config.hidden_size)
        self.mlp = MLP(config.hidden_size, config.mlp_hidden)


class HybridModel(nn.Module):
    """The reference hybrid model. Single sequence, no batching: readable, not fast."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ModelConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        counters = {"linear": 0, "attention": 0}
        blocks = []
        for kind in config.layers:
            blocks.append(Block(config, kind, counters[kind]))
            counters[kind] += 1
        self.blocks = nn.ModuleList(blocks)
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(config.seed)
        self.requires_grad_(False)
        self.eval()

    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or "norm.weight" in name:
                continue  # RMSNorm gains stay 1
            if name == "embed.weight":
                std = 1.0
            elif name.endswith("conv_weight"):
                std = 0.5
            else:
                std = 1.0 / math.sqrt(p.shape[-1])  # fan-in scaling keeps activations O(1)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor,
        *,
        start: int,
        kv: SequenceKV,
        state: RecurrentState,
        before_layer: Callable[[int], None] | None = None,
        write_kv: bool = True,
        logits: LogitsFor = "last",
    ) -> Tensor:
        """Feed ``tokens`` (positions start .. start+n-1) through the model.

        The sequence's KV must hold [0, start) (and gets [start, start+n)
        appended when ``write_kv``); ``state`` is the recurrent state at
        ``start`` and is advanced in place to start+n. ``before_layer(i)`` runs
        before model layer i reads its cache or state: a layer-wise load blocks
        there until layer i is in place (:meth:`LayerwiseLoad.wait_for_layer`).
        ``write_kv=False`` (Tail-Replay) reads the cache without overwriting
        the loaded, exact KV of these positions. Returns logits of the last
        token ``(vocab,)``, of all ``(n, vocab)``, or an empty tensor."""
        kv.reserve(start + tokens.shape[0])
        x = self.embed(tokens)
        for i, module in enumerate(self.blocks):
            block = cast(Block, module)
            if before_layer is not None:
                before_layer(i)
            h = block.norm1(x)
            if block.kind == "linear":
                mixed = block.mixer(h, state.ssm(block.index), state.conv(block.index))
            else:
                mixed = block.mixer(h, start, kv, write_kv)
            x = x + mixed
            x = x + block.mlp(block.norm2(x))
        if logits == "none":
            empty: Tensor = x.new_empty(0)
            return empty
        if logits == "last":
            x = x[-1:]
        out = self.lm_head(self.norm(x))
        result: Tensor = out[0] if logits == "last" else out
        return result


__all__ = ["DELTA_CHUNK", "HybridModel", "LayerKind", "ModelConfig", "RecurrentState", "delta_rule_chunked",
           "delta_rule_reference", "rope"]

"""The Namespace record: what the bytes of an entry mean.

Two engines share cache only if their namespaces are equal. Every field that
changes the meaning or layout of a payload is part of the record, so a config
change yields a new namespace id and a stale-format read is impossible by
construction (DESIGN §3). The tenant is a field too, so two tenants' namespaces,
roots and chains always differ. A namespace id is the hash of public fields,
though: anyone can compute another tenant's chain for a guessed prompt, so
isolation rests on the store scoping every key by the request's namespace
(store/index.py), which the server checks the caller's tenant owns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import msgpack
import xxhash

#: Bytes per element of every dtype a layout may name. Unknown dtypes are
#: rejected when the namespace is built, never guessed.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

#: Version of the canonical encoding, of the payload layout and of the hash chain (DESIGN §3).
#: Bump it when any changes: every namespace id changes with it. Version 2 is the layout that
#: names no tensor-parallel rank (a payload is addressable per KV head and per state head, so an
#: engine at any TP size reads its own heads' slices); version 1 named the rank and size.
HASH_SCHEME_VERSION = 2

#: Per-rank namespaces of the earlier scheme (1): still decoded, registered, persisted and served
#: (whole entries and layer ranges) for the clients that speak them, never made by this build's
#: clients, and never shared with version 2 (docs/design.md, "One layout for every TP size").
LEGACY_HASH_SCHEMES = frozenset({1})

NAMESPACE_ID_BYTES = 8

# Bounds on every field, checked when a record is built (so at registration, before anything is
# stored). A namespace is public, tenant-supplied input that the store keeps, persists and
# consults on every request: without bounds one registration of millions of state shapes froze a
# store's event loop for seconds and made every later lookup on it slow. The bounds are far above
# any real model (the largest have ~100 layers, a few state tensors per layer).
MAX_NAME_BYTES = 256  # model, revision, tenant (UTF-8)
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 1 << 16
MAX_COMPONENTS = 8
MAX_STATE_TENSORS = 16  # tensors per state layer
MAX_STATE_DIMS = 8  # dimensions per tensor
MAX_STATE_DIM = 1 << 32  # elements along one dimension (engines may hand a state over as one flat tensor)
MAX_TP_SIZE = 1024
MAX_PAYLOAD_BYTES = 1 << 40  # a block's or a snapshot's bytes: a size every wire integer holds
MAX_PAYLOAD_RUNS = 1 << 16  # byte runs one ranged read of one payload may name (layers x tensors)


class NamespaceError(ValueError):
    """A namespace record is malformed; the message names the field."""


def _dtype_bytes(dtype: str, field_name: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise NamespaceError(
            f"{field_name}: unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Paged KV of the full-attention layers, as the store lays it out.

    A payload of n tokens is layer-major: layer 0's components for the n
    tokens, then layer 1, ...; within a layer, component c (K then V; one
    latent for MLA-style caches), and within a component head after head,
    each head its n tokens of ``head_dim`` elements (hash scheme 2)::

        | layer 0: K[h,n,d] V[h,n,d] | layer 1: K V | ... | layer L-1: K V |

    So a range of layers is one contiguous byte range (an engine loads layer by
    layer), and a range of heads is one run per layer and component: an engine
    at tensor-parallel size t reads exactly its own heads, whatever TP size
    wrote the entry. ``num_heads`` is the model's KV head count, never a
    rank's share. (Hash scheme 1, per rank: ``K[n,h,d]``, a rank's heads.)
    """

    num_layers: int
    num_heads: int
    head_dim: int
    dtype: str = "float16"
    num_components: int = 2

    def __post_init__(self) -> None:
        for name, hi in (("num_layers", MAX_LAYERS), ("num_heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM),
                         ("num_components", MAX_COMPONENTS)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= hi:
                raise NamespaceError(f"kv.{name}: must be an integer in [0, {hi}], got {value!r}")
        _dtype_bytes(self.dtype, "kv.dtype")

    @cached_property
    def layer_token_bytes(self) -> int:
        """Bytes one token occupies in one layer (all components)."""
        return self.num_components * self.num_heads * self.head_dim * _dtype_bytes(self.dtype, "kv.dtype")

    @cached_property
    def token_bytes(self) -> int:
        """Bytes one token occupies across all full-attention layers."""
        return self.num_layers * self.layer_token_bytes

    def payload_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.token_bytes

    def layer_range_bytes(self, num_tokens: int, layer_start: int, layer_end: int) -> tuple[int, int]:
        """Byte offset and length of layers [layer_start, layer_end) in a payload of num_tokens."""
        per_layer = num_tokens * self.layer_token_bytes
        return layer_start * per_layer, (layer_end - layer_start) * per_layer

    def to_wire(self) -> list[object]:
        return [self.num_layers, self.num_heads, self.head_dim, self.dtype, self.num_components]

    @classmethod
    def from_wire(cls, raw: object) -> KVLayout:
        if not isinstance(raw, (list, tuple)) or len(raw) != 5:
            raise NamespaceError("kv: expected [num_layers, num_heads, head_dim, dtype, num_components]")
        num_layers, num_heads, head_dim, dtype, num_components = raw
        if not isinstance(dtype, str):
            raise NamespaceError("kv.dtype: must be a string")
        return cls(
            num_layers=_int(num_layers, "kv.num_layers"),
            num_heads=_int(num_heads, "kv.num_heads"),
            head_dim=_int(head_dim, "kv.head_dim"),
            dtype=dtype,
            num_components=_int(num_components, "kv.num_components"),
        )


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Recurrent (+ conv) state of the linear-attention layers.

    ``shapes`` are the tensors one layer holds (for a delta-rule layer, e.g.
    ``((heads, d, d), (conv_dim, conv_width - 1))``); every layer holds the
    same tensors. A snapshot payload is layer-major like KV: layer 0's tensors
    in order, then layer 1, ... A plain transformer has ``num_layers == 0``.

    ``num_heads`` > 0 makes a snapshot addressable per state head: every
    tensor's first dimension is then ``num_heads``, one row per head unit (a
    delta-rule or Mamba head group, a conv channel), in the order tensor
    parallelism splits them, so rank r of t holds rows [r*U/t, (r+1)*U/t) of
    every tensor and reads them as one run per layer and tensor::

        | layer 0: T0[U, ...] T1[U, ...] | layer 1: T0 T1 | ...

    0: the bytes are opaque to the store (no head ranges). ``dtypes``: one per
    tensor where they differ (an fp32 SSM state beside a bf16 conv state);
    empty when every tensor is ``dtype`` (a tuple of equal ones is folded into
    ``dtype``, so one layout has one encoding).
    """

    num_layers: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float16"
    num_heads: int = 0
    dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.dtypes, tuple) or not all(isinstance(d, str) for d in self.dtypes):
            raise NamespaceError("state.dtypes: expected a tuple of dtype names")
        if self.dtypes:
            if len(self.dtypes) != len(self.shapes):
                raise NamespaceError(f"state.dtypes: one per tensor ({len(self.shapes)}), got {len(self.dtypes)}")
            for dt in self.dtypes:
                _dtype_bytes(dt, "state.dtypes")
            object.__setattr__(self, "dtype", self.dtypes[0])
            if len(set(self.dtypes)) == 1:
                object.__setattr__(self, "dtypes", ())
        if not isinstance(self.num_heads, int) or isinstance(self.num_heads, bool) \
                or not 0 <= self.num_heads <= MAX_STATE_DIM:
            raise NamespaceError(f"state.num_heads: must be an integer in [0, {MAX_STATE_DIM}], got {self.num_heads!r}")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) \
                or not 0 <= self.num_layers <= MAX_LAYERS:
            raise NamespaceError(f"state.num_layers: must be an integer in [0, {MAX_LAYERS}], got {self.num_layers!r}")
        if len(self.shapes) > MAX_STATE_TENSORS:
            raise NamespaceError(f"state.shapes: at most {MAX_STATE_TENSORS} tensors per layer, got {len(self.shapes)}")
        for shape in self.shapes:
            if not 1 <= len(shape) <= MAX_STATE_DIMS:
                raise NamespaceError(f"state.shapes: a tensor has 1 to {MAX_STATE_DIMS} dimensions, got {len(shape)}")
            if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d <= MAX_STATE_DIM for d in shape):
                raise NamespaceError(f"state.shapes: dimensions must be integers in [1, {MAX_STATE_DIM}], "
                                     f"got {shape!r}")
        if self.num_layers and not self.shapes:
            raise NamespaceError("state.shapes: a state layout with layers needs at least one tensor shape")
        if self.num_heads and any(shape[0] != self.num_heads for shape in self.shapes):
            raise NamespaceError(f"state.shapes: with num_heads={self.num_heads} every tensor's first dimension "
                                 f"is num_heads, got {[s[0] for s in self.shapes]}")
        _dtype_bytes(self.dtype, "state.dtype")
        if self.snapshot_bytes > MAX_PAYLOAD_BYTES:
            raise NamespaceError(f"state: a snapshot would be {self.snapshot_bytes} bytes, more than "
                                 f"{MAX_PAYLOAD_BYTES}")

    @property
    def tensor_dtypes(self) -> tuple[str, ...]:
        """The dtype of each tensor of a layer."""
        return self.dtypes or (self.dtype,) * len(self.shapes)

    @cached_property
    def tensor_bytes(self) -> tuple[int, ...]:
        """Bytes of each tensor of one layer."""
        return tuple(math.prod(shape) * _dtype_bytes(dt, "state.dtype")
                     for shape, dt in zip(self.shapes, self.tensor_dtypes))

    @cached_property
    def layer_bytes(self) -> int:
        return sum(self.tensor_bytes)

    @cached_property
    def snapshot_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range_bytes(self, layer_start: int, layer_end: int) -> tuple[int, int]:
        return layer_start * self.layer_bytes, (layer_end - layer_start) * self.layer_bytes

    def to_wire(self) -> list[object]:
        # The three-field form for an opaque state with one dtype: what scheme 1 wrote, so a
        # per-rank namespace re-encodes to the bytes (and the id) it was registered with.
        out: list[object] = [self.num_layers, [list(s) for s in self.shapes], self.dtype]
        if self.num_heads or self.dtypes:
            out += [self.num_heads, list(self.dtypes)]
        return out

    @classmethod
    def from_wire(cls, raw: object) -> StateLayout:
        if not isinstance(raw, (list, tuple)) or len(raw) not in (3, 5):
            raise NamespaceError("state: expected [num_layers, shapes, dtype] or [num_layers, shapes, dtype, "
                                 "num_heads, dtypes]")
        num_layers, shapes, dtype = raw[:3]
        num_heads: object = 0
        dtypes: object = []
        if len(raw) == 5:
            num_heads, dtypes = raw[3:]
            if not isinstance(dtypes, (list, tuple)) or len(dtypes) > MAX_STATE_TENSORS \
                    or not all(isinstance(d, str) for d in dtypes):
                raise NamespaceError("state.dtypes: expected a list of dtype names")
        if not isinstance(shapes, (list, tuple)):
            raise NamespaceError("state.shapes: expected a list of shapes")
        # Before looking at any shape: a hostile record may list millions of them.
        if len(shapes) > MAX_STATE_TENSORS:
            raise NamespaceError(f"state.shapes: at most {MAX_STATE_TENSORS} tensors per layer, got {len(shapes)}")
        if not all(isinstance(s, (list, tuple)) for s in shapes):
            raise NamespaceError("state.shapes: expected a list of shapes")
        if any(len(s) > MAX_STATE_DIMS for s in shapes):
            raise NamespaceError(f"state.shapes: a tensor has 1 to {MAX_STATE_DIMS} dimensions")
        if not isinstance(dtype, str):
            raise NamespaceError("state.dtype: must be a string")
        return cls(
            num_layers=_int(num_layers, "state.num_layers"),
            shapes=tuple(tuple(_int(d, "state.shapes") for d in s) for s in shapes),
            dtype=dtype,
            num_heads=_int(num_heads, "state.num_heads"),
            dtypes=tuple(dtypes),  # type: ignore[arg-type]  # checked above
        )


def _int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise NamespaceError(f"{name}: must be an integer, got {type(value).__name__}")
    return value


def _str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise NamespaceError(f"{name}: must be a string, got {type(value).__name__}")
    if len(value) > MAX_NAME_BYTES or len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise NamespaceError(f"{name}: at most {MAX_NAME_BYTES} bytes (UTF-8), got {len(value.encode('utf-8', 'surrogatepass'))}")
    return value


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything that decides whether two engines may share an entry.

    No tensor-parallel rank or size (hash scheme 2): the layouts name the model's heads, and an
    engine at any TP size reads its own heads' slices (KVLayout, StateLayout), so every TP size of
    one model shares one namespace. ``tp_rank`` / ``tp_size`` exist only in records of the legacy
    per-rank scheme 1 (LEGACY_HASH_SCHEMES); a scheme-2 record must leave them at 0 / 1."""

    model: str
    revision: str = ""
    kv: KVLayout
    state: StateLayout = field(default_factory=StateLayout)
    tp_rank: int = 0
    """Legacy (hash scheme 1) only: the rank whose heads the record's payloads held."""
    tp_size: int = 1
    """Legacy (hash scheme 1) only."""
    block_tokens: int = 16
    hash_scheme: int = HASH_SCHEME_VERSION
    tenant: str = "default"

    def __post_init__(self) -> None:
        # The same rules as from_wire: a record the constructor accepts must
        # also encode, register and decode, or its engine silently never hits.
        for name in ("model", "revision", "tenant"):
            _str(getattr(self, name), name)
        for name in ("block_tokens", "tp_rank", "tp_size", "hash_scheme"):
            _int(getattr(self, name), name)
        if not isinstance(self.kv, KVLayout):
            raise NamespaceError(f"kv: expected a KVLayout, got {type(self.kv).__name__}")
        if not isinstance(self.state, StateLayout):
            raise NamespaceError(f"state: expected a StateLayout, got {type(self.state).__name__}")
        if not self.model:
            raise NamespaceError("model: must be a non-empty string")
        if not 1 <= self.block_tokens <= 65536:
            raise NamespaceError(f"block_tokens: must be an integer in [1, 65536], got {self.block_tokens!r}")
        if not isinstance(self.tp_size, int) or not 1 <= self.tp_size <= MAX_TP_SIZE:
            raise NamespaceError(f"tp_size: must be an integer in [1, {MAX_TP_SIZE}], got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise NamespaceError(f"tp_rank: must be in [0, tp_size), got {self.tp_rank!r}")
        if self.hash_scheme != HASH_SCHEME_VERSION and self.hash_scheme not in LEGACY_HASH_SCHEMES:
            raise NamespaceError(
                f"hash_scheme: this build speaks version {HASH_SCHEME_VERSION} "
                f"(and reads {sorted(LEGACY_HASH_SCHEMES)}), got {self.hash_scheme!r}"
            )
        if not self.legacy and (self.tp_rank, self.tp_size) != (0, 1):
            raise NamespaceError(f"tp_rank/tp_size: a namespace of hash scheme {HASH_SCHEME_VERSION} names no "
                                 "tensor-parallel rank (its payloads are addressable per head); leave them 0/1")
        if self.legacy and (self.state.num_heads or self.state.dtypes):
            raise NamespaceError("state: per-head and per-tensor dtype state layouts need hash scheme "
                                 f"{HASH_SCHEME_VERSION}")
        if self.kv.token_bytes == 0 and self.state.snapshot_bytes == 0:
            raise NamespaceError("kv/state: a namespace must hold KV or state bytes")
        if self.block_bytes > MAX_PAYLOAD_BYTES:
            raise NamespaceError(f"kv: a block of {self.block_tokens} tokens would be {self.block_bytes} bytes, "
                                 f"more than {MAX_PAYLOAD_BYTES}")

    @property
    def legacy(self) -> bool:
        """A per-rank record of hash scheme 1 (still served; no head ranges)."""
        return self.hash_scheme in LEGACY_HASH_SCHEMES

    def to_wire(self) -> list[object]:
        """Canonical form: a fixed-order list, so equal records encode equally. Scheme 2 has 7
        fields; a legacy record keeps its 9 (with rank and size), so its id never changes."""
        if not self.legacy:
            return [self.hash_scheme, self.tenant, self.model, self.revision, self.kv.to_wire(),
                    self.state.to_wire(), self.block_tokens]
        return [
            self.hash_scheme,
            self.tenant,
            self.model,
            self.revision,
            self.kv.to_wire(),
            self.state.to_wire(),
            self.tp_rank,
            self.tp_size,
            self.block_tokens,
        ]

    @classmethod
    def from_wire(cls, raw: object) -> Namespace:
        if not isinstance(raw, (list, tuple)) or len(raw) not in (7, 9):
            raise NamespaceError("namespace: expected a 7-field record (or a 9-field one of hash scheme 1)")
        scheme = _int(raw[0], "hash_scheme")  # before any set lookup: a hostile record may put a list here
        if len(raw) == 7:
            hash_scheme, tenant, model, revision, kv, state, block_tokens = raw
            if scheme in LEGACY_HASH_SCHEMES:
                raise NamespaceError(f"namespace: a record of hash scheme {hash_scheme} has 9 fields")
            tp_rank: object = 0
            tp_size: object = 1
        else:
            hash_scheme, tenant, model, revision, kv, state, tp_rank, tp_size, block_tokens = raw
            if scheme not in LEGACY_HASH_SCHEMES:
                raise NamespaceError(f"namespace: a record of hash scheme {hash_scheme!r} has 7 fields "
                                     "(9 is the per-rank scheme 1)")
        return cls(
            hash_scheme=_int(hash_scheme, "hash_scheme"),
            tenant=_str(tenant, "tenant"),
            model=_str(model, "model"),
            revision=_str(revision, "revision"),
            kv=KVLayout.from_wire(kv),
            state=StateLayout.from_wire(state),
            tp_rank=_int(tp_rank, "tp_rank"),
            tp_size=_int(tp_size, "tp_size"),
            block_tokens=_int(block_tokens, "block_tokens"),
        )

    def encode(self) -> bytes:
        return bytes(msgpack.packb(self.to_wire(), use_bin_type=True))

    @classmethod
    def decode(cls, raw: bytes) -> Namespace:
        """The record :meth:`encode` wrote; NamespaceError (or a msgpack error) when it is not one."""
        try:
            wire = msgpack.unpackb(raw, raw=False)
        except Exception as err:  # msgpack raises several unrelated types on garbage
            raise NamespaceError(f"namespace: not a msgpack record ({type(err).__name__})") from err
        return cls.from_wire(wire)

    @cached_property
    def id(self) -> bytes:
        """xxh3-64 of the canonical encoding, big-endian, 8 bytes."""
        return xxhash.xxh3_64_digest(self.encode())

    @property
    def id_hex(self) -> str:
        return self.id.hex()

    @cached_property
    def has_state(self) -> bool:
        return self.state.snapshot_bytes > 0

    @cached_property
    def block_bytes(self) -> int:
        """Payload bytes of one full KV block."""
        return self.kv.payload_bytes(self.block_tokens)

    def payload_runs(self, is_state: bool, num_tokens: int, layer_start: int = 0, layer_end: int | None = None,
                     head_start: int = 0, head_end: int | None = None) -> list[tuple[int, int]]:
        """The (offset, length) byte runs, in payload order, of layers [layer_start, layer_end)
        and heads [head_start, head_end) (None: through the last) of a snapshot (``is_state``) or
        of a KV payload of ``num_tokens`` tokens: one run for all heads, else one per layer and
        component (state: per layer and tensor), adjacent runs merged::

            KV, heads [1, 3) of 4, layers [0, 2):   | L0 K: h0 [h1 h2] h3 | L0 V: h0 [h1 h2] h3 | L1 ...

        The store serves and clients cut reads by this one rule. ValueError says which layers or
        heads do not exist, or that this namespace's payloads are not addressable per head."""
        if head_start == 0 and head_end is None:
            return [self.payload_range(is_state, num_tokens, layer_start, layer_end)]
        what, num_layers = ("state", self.state.num_layers) if is_state else ("KV", self.kv.num_layers)
        if self.legacy:
            raise ValueError(f"a per-rank namespace (hash scheme {self.hash_scheme}) has no head ranges")
        hi = num_layers if layer_end is None else layer_end
        if hi > num_layers or layer_start >= hi:
            raise ValueError(f"the {what} has {num_layers} layers, asked for [{layer_start}, {hi})")
        if is_state:
            num_heads = self.state.num_heads
            if not num_heads:
                raise ValueError("the state is not addressable per head (state.num_heads = 0)")
            unit = [b // num_heads for b in self.state.tensor_bytes]
            layer_bytes = self.state.layer_bytes
        else:
            num_heads = self.kv.num_heads
            head_bytes = num_tokens * self.kv.head_dim * DTYPE_BYTES[self.kv.dtype]
            unit = [head_bytes] * self.kv.num_components
            layer_bytes = num_tokens * self.kv.layer_token_bytes
        h_hi = num_heads if head_end is None else head_end
        if h_hi > num_heads or head_start >= h_hi:
            raise ValueError(f"the {what} has {num_heads} heads, asked for [{head_start}, {h_hi})")
        if (hi - layer_start) * len(unit) > MAX_PAYLOAD_RUNS:
            raise ValueError(f"more than {MAX_PAYLOAD_RUNS} runs in one payload; ask for fewer layers")
        runs: list[tuple[int, int]] = []
        for layer in range(layer_start, hi):
            base = layer * layer_bytes
            for size in unit:
                offset, length = base + head_start * size, (h_hi - head_start) * size
                if runs and runs[-1][0] + runs[-1][1] == offset:
                    runs[-1] = (runs[-1][0], runs[-1][1] + length)
                else:
                    runs.append((offset, length))
                base += num_heads * size
        return runs

    def payload_range(self, is_state: bool, num_tokens: int, layer_start: int, layer_end: int | None
                      ) -> tuple[int, int]:
        """Byte offset and length of layers [layer_start, layer_end) (None: through the last) of a
        snapshot (``is_state``) or of a KV payload of ``num_tokens`` tokens; (0, whole) for all
        layers. The store serves and clients cut reads by this one rule. ValueError says which
        layers do not exist."""
        if layer_start == 0 and layer_end is None:
            return 0, self.state.snapshot_bytes if is_state else self.kv.payload_bytes(num_tokens)
        what, num_layers = ("state", self.state.num_layers) if is_state else ("KV", self.kv.num_layers)
        hi = num_layers if layer_end is None else layer_end
        if hi > num_layers or layer_start >= hi:
            raise ValueError(f"the {what} has {num_layers} layers, asked for [{layer_start}, {hi})")
        if is_state:
            return self.state.layer_range_bytes(layer_start, hi)
        return self.kv.layer_range_bytes(num_tokens, layer_start, hi)

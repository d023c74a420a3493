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

#: Version of the canonical encoding and of the hash chain (DESIGN §3). Bump it
#: when either changes: every namespace id changes with it.
HASH_SCHEME_VERSION = 1

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
    latent for MLA-style caches) for all n tokens, each token
    ``num_heads * head_dim`` elements. So a range of layers is one contiguous
    byte range, and an engine can load layer by layer::

        | layer 0: K[n,h,d] V[n,h,d] | layer 1: K V | ... | layer L-1: K V |
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
    """

    num_layers: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float16"

    def __post_init__(self) -> None:
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
        _dtype_bytes(self.dtype, "state.dtype")
        if self.snapshot_bytes > MAX_PAYLOAD_BYTES:
            raise NamespaceError(f"state: a snapshot would be {self.snapshot_bytes} bytes, more than "
                                 f"{MAX_PAYLOAD_BYTES}")

    @cached_property
    def layer_bytes(self) -> int:
        itemsize = _dtype_bytes(self.dtype, "state.dtype")
        return sum(math.prod(shape) for shape in self.shapes) * itemsize

    @cached_property
    def snapshot_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range_bytes(self, layer_start: int, layer_end: int) -> tuple[int, int]:
        return layer_start * self.layer_bytes, (layer_end - layer_start) * self.layer_bytes

    def to_wire(self) -> list[object]:
        return [self.num_layers, [list(s) for s in self.shapes], self.dtype]

    @classmethod
    def from_wire(cls, raw: object) -> StateLayout:
        if not isinstance(raw, (list, tuple)) or len(raw) != 3:
            raise NamespaceError("state: expected [num_layers, shapes, dtype]")
        num_layers, shapes, dtype = raw
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
    """Everything that decides whether two engines may share an entry."""

    model: str
    revision: str = ""
    kv: KVLayout
    state: StateLayout = field(default_factory=StateLayout)
    tp_rank: int = 0
    tp_size: int = 1
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
        if self.hash_scheme != HASH_SCHEME_VERSION:
            raise NamespaceError(
                f"hash_scheme: this build speaks version {HASH_SCHEME_VERSION}, got {self.hash_scheme!r}"
            )
        if self.kv.token_bytes == 0 and self.state.snapshot_bytes == 0:
            raise NamespaceError("kv/state: a namespace must hold KV or state bytes")
        if self.block_bytes > MAX_PAYLOAD_BYTES:
            raise NamespaceError(f"kv: a block of {self.block_tokens} tokens would be {self.block_bytes} bytes, "
                                 f"more than {MAX_PAYLOAD_BYTES}")

    def to_wire(self) -> list[object]:
        """Canonical form: a fixed-order list, so equal records encode equally."""
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
        if not isinstance(raw, (list, tuple)) or len(raw) != 9:
            raise NamespaceError("namespace: expected a 9-field record")
        hash_scheme, tenant, model, revision, kv, state, tp_rank, tp_size, block_tokens = raw
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

"""The Namespace record (DESIGN §3): canonical encoding, id, validation, derived sizes."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import xxhash

from prefixstore.protocol import (
    HASH_SCHEME_VERSION,
    KVLayout,
    Namespace,
    NamespaceError,
    StateLayout,
)

from ..factories import make_namespace


def base() -> Namespace:
    return Namespace(
        model="acme/hybrid-7b",
        revision="r1",
        kv=KVLayout(num_layers=3, num_heads=2, head_dim=8, dtype="bfloat16", num_components=2),
        state=StateLayout(num_layers=4, shapes=((4, 8, 8), (16, 3)), dtype="float32"),
        tp_rank=1,
        tp_size=2,
        block_tokens=16,
        tenant="team-a",
    )


# ---------------------------------------------------------------- encoding and id


@pytest.mark.parametrize("ns", [base(), make_namespace(), make_namespace(with_state=False)], ids=["hybrid", "factory", "no-state"])
def test_wire_round_trip(ns: Namespace) -> None:
    assert Namespace.from_wire(ns.to_wire()) == ns
    # ... also through the bytes that actually travel (msgpack turns tuples into lists).
    again = Namespace.from_wire(msgpack.unpackb(ns.encode(), raw=False))
    assert again == ns
    assert again.id == ns.id
    assert again.encode() == ns.encode()


def test_id_is_xxh3_64_of_canonical_encoding() -> None:
    ns = base()
    expected = xxhash.xxh3_64_digest(msgpack.packb(ns.to_wire(), use_bin_type=True))
    assert ns.id == expected
    assert isinstance(ns.id, bytes) and len(ns.id) == 8
    assert ns.id_hex == expected.hex()


def test_id_is_stable() -> None:
    # Equal records built independently have equal ids, call after call.
    a, b = base(), base()
    assert a is not b and a == b
    assert a.id == b.id == a.id
    # A golden value: if this changes, every stored entry becomes unreachable.
    # Changing the canonical encoding must bump HASH_SCHEME_VERSION (and this value).
    assert make_namespace().id_hex == "b388ef478777052f"
    assert HASH_SCHEME_VERSION == 1


def _replace_kv(ns: Namespace, **kw: object) -> Namespace:
    return dataclasses.replace(ns, kv=dataclasses.replace(ns.kv, **kw))


def _replace_state(ns: Namespace, **kw: object) -> Namespace:
    return dataclasses.replace(ns, state=dataclasses.replace(ns.state, **kw))


CHANGES = {
    "model": lambda ns: dataclasses.replace(ns, model="acme/hybrid-7b-instruct"),
    "revision": lambda ns: dataclasses.replace(ns, revision="r2"),
    "revision-empty": lambda ns: dataclasses.replace(ns, revision=""),
    "kv.num_layers": lambda ns: _replace_kv(ns, num_layers=4),
    "kv.num_heads": lambda ns: _replace_kv(ns, num_heads=4),
    "kv.head_dim": lambda ns: _replace_kv(ns, head_dim=16),
    "kv.dtype": lambda ns: _replace_kv(ns, dtype="float16"),  # same itemsize, different meaning
    "kv.num_components": lambda ns: _replace_kv(ns, num_components=1),
    "state.num_layers": lambda ns: _replace_state(ns, num_layers=5),
    "state.shapes": lambda ns: _replace_state(ns, shapes=((4, 8, 8), (16, 4))),
    "state.shapes-order": lambda ns: _replace_state(ns, shapes=((16, 3), (4, 8, 8))),
    "state.shapes-transposed": lambda ns: _replace_state(ns, shapes=((8, 4, 8), (16, 3))),  # same bytes
    "state.dtype": lambda ns: _replace_state(ns, dtype="bfloat16"),
    "tp_rank": lambda ns: dataclasses.replace(ns, tp_rank=0),
    "tp_size": lambda ns: dataclasses.replace(ns, tp_size=4),
    "block_tokens": lambda ns: dataclasses.replace(ns, block_tokens=32),
    "tenant": lambda ns: dataclasses.replace(ns, tenant="team-b"),
}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_every_field_changes_the_id(field: str) -> None:
    ns = base()
    changed = CHANGES[field](ns)
    assert changed != ns
    assert changed.id != ns.id
    assert changed.encode() != ns.encode()


def test_all_changed_ids_are_distinct() -> None:
    ids = {CHANGES[f](base()).id for f in CHANGES} | {base().id}
    assert len(ids) == len(CHANGES) + 1


def test_tenant_is_structural() -> None:
    a, b = make_namespace(tenant="a"), make_namespace(tenant="b")
    assert a.id != b.id
    assert a.to_wire()[1] == "a"


# ---------------------------------------------------------------- validation


def _kv() -> KVLayout:
    return KVLayout(num_layers=2, num_heads=1, head_dim=4, dtype="float32")


BAD_RECORDS = [
    ("model", lambda: Namespace(model="", kv=_kv())),
    ("block_tokens", lambda: Namespace(model="m", kv=_kv(), block_tokens=0)),
    ("block_tokens", lambda: Namespace(model="m", kv=_kv(), block_tokens=65537)),
    ("block_tokens", lambda: Namespace(model="m", kv=_kv(), block_tokens=4.0)),
    ("tp_size", lambda: Namespace(model="m", kv=_kv(), tp_size=0)),
    ("tp_rank", lambda: Namespace(model="m", kv=_kv(), tp_rank=2, tp_size=2)),
    ("tp_rank", lambda: Namespace(model="m", kv=_kv(), tp_rank=-1)),
    ("hash_scheme", lambda: Namespace(model="m", kv=_kv(), hash_scheme=HASH_SCHEME_VERSION + 1)),
    ("kv/state", lambda: Namespace(model="m", kv=KVLayout(num_layers=0, num_heads=1, head_dim=4))),
    ("kv.num_layers", lambda: KVLayout(num_layers=-1, num_heads=1, head_dim=4)),
    ("kv.num_heads", lambda: KVLayout(num_layers=1, num_heads="2", head_dim=4)),
    ("kv.head_dim", lambda: KVLayout(num_layers=1, num_heads=1, head_dim=True)),
    ("kv.num_components", lambda: KVLayout(num_layers=1, num_heads=1, head_dim=4, num_components=-2)),
    ("kv.dtype", lambda: KVLayout(num_layers=1, num_heads=1, head_dim=4, dtype="float64")),
    ("state.num_layers", lambda: StateLayout(num_layers=-1, shapes=((2,),))),
    ("state.shapes", lambda: StateLayout(num_layers=1, shapes=((2, 0),))),
    ("state.shapes", lambda: StateLayout(num_layers=1, shapes=())),
    ("state.dtype", lambda: StateLayout(num_layers=1, shapes=((2,),), dtype="fp4")),
]


@pytest.mark.parametrize(("field", "build"), BAD_RECORDS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_RECORDS)])
def test_invalid_record_names_the_field(field: str, build) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NamespaceError) as info:
        build()
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def _wire_with(index: int, value: object) -> list[object]:
    raw = base().to_wire()
    raw[index] = value
    return raw


def _kv_wire_with(index: int, value: object) -> list[object]:
    raw = base().to_wire()
    kv = list(raw[4])
    kv[index] = value
    raw[4] = kv
    return raw


def _state_wire_with(index: int, value: object) -> list[object]:
    raw = base().to_wire()
    state = list(raw[5])
    state[index] = value
    raw[5] = state
    return raw


BAD_WIRE = [
    ("namespace", "not a list"),
    ("namespace", base().to_wire()[:8]),
    ("namespace", base().to_wire() + [0]),
    ("hash_scheme", _wire_with(0, "1")),
    ("hash_scheme", _wire_with(0, 99)),
    ("tenant", _wire_with(1, 7)),
    ("model", _wire_with(2, b"bytes-not-str")),
    ("model", _wire_with(2, "")),
    ("revision", _wire_with(3, None)),
    ("kv", _wire_with(4, {"num_layers": 2})),
    ("kv", _wire_with(4, [2, 1, 4, "float32"])),
    ("state", _wire_with(5, "none")),
    ("tp_rank", _wire_with(6, 1.0)),
    ("tp_size", _wire_with(7, None)),
    ("block_tokens", _wire_with(8, True)),
    ("block_tokens", _wire_with(8, 0)),
    ("kv.num_layers", _kv_wire_with(0, "3")),
    ("kv.num_heads", _kv_wire_with(1, -1)),
    ("kv.head_dim", _kv_wire_with(2, None)),
    ("kv.dtype", _kv_wire_with(3, 2)),
    ("kv.dtype", _kv_wire_with(3, "float128")),
    ("kv.num_components", _kv_wire_with(4, [])),
    ("state.num_layers", _state_wire_with(0, "4")),
    ("state.shapes", _state_wire_with(1, "4x8x8")),
    ("state.shapes", _state_wire_with(1, [[4, "8"]])),
    ("state.shapes", _state_wire_with(1, [[4, 0]])),
    ("state.dtype", _state_wire_with(2, None)),
]


@pytest.mark.parametrize(("field", "raw"), BAD_WIRE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_WIRE)])
def test_from_wire_rejects_and_names_the_field(field: str, raw: object) -> None:
    with pytest.raises(NamespaceError) as info:
        Namespace.from_wire(raw)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


CONSTRUCTOR_ACCEPTS_UNENCODABLE = [
    ("block_tokens", {"block_tokens": True}),
    ("tp_size", {"tp_size": True}),
    ("tp_rank", {"tp_rank": False}),
    ("model", {"model": 5}),
    ("tenant", {"tenant": None}),
    ("revision", {"revision": 3}),
]


@pytest.mark.parametrize(("field", "kw"), CONSTRUCTOR_ACCEPTS_UNENCODABLE,
                         ids=[f for f, _ in CONSTRUCTOR_ACCEPTS_UNENCODABLE])
def test_constructor_rejects_what_from_wire_rejects(field: str, kw: dict[str, object]) -> None:
    with pytest.raises(NamespaceError) as info:
        Namespace(kv=_kv(), **{"model": "m", **kw})
    assert str(info.value).startswith(f"{field}:")


def test_namespace_error_is_a_value_error() -> None:
    assert issubclass(NamespaceError, ValueError)


# ---------------------------------------------------------------- sizes


def test_kv_sizes_hand_computed() -> None:
    ns = base()
    # 2 components (K, V) x 2 heads x 8 dims x 2 bytes (bf16) = 64 bytes per token per layer.
    assert ns.kv.layer_token_bytes == 64
    # x 3 layers.
    assert ns.kv.token_bytes == 192
    assert ns.kv.payload_bytes(5) == 960
    # A block is 16 tokens.
    assert ns.block_bytes == 16 * 192 == 3072
    # Layers [1, 3) of a 5-token payload: layer-major, each layer 5 x 64 = 320 bytes.
    assert ns.kv.layer_range_bytes(5, 1, 3) == (320, 640)
    assert ns.kv.layer_range_bytes(5, 0, 3) == (0, 960)
    assert ns.kv.layer_range_bytes(16, 2, 3) == (2048, 1024)


def test_mla_like_kv_has_one_component() -> None:
    kv = KVLayout(num_layers=4, num_heads=1, head_dim=576, dtype="float8_e4m3fn", num_components=1)
    assert kv.layer_token_bytes == 576
    assert kv.token_bytes == 2304


def test_state_sizes_hand_computed() -> None:
    ns = base()
    # Per layer: 4*8*8 + 16*3 = 256 + 48 = 304 elements x 4 bytes (fp32) = 1216 bytes.
    assert ns.state.layer_bytes == 1216
    assert ns.state.snapshot_bytes == 4 * 1216 == 4864
    assert ns.state.layer_range_bytes(1, 3) == (1216, 2432)
    assert ns.state.layer_range_bytes(0, 4) == (0, 4864)
    assert ns.has_state


def test_factory_namespace_sizes() -> None:
    ns = make_namespace()
    assert ns.kv.token_bytes == 64  # 2 layers x 2 comps x 1 head x 4 dims x 4 bytes
    assert ns.block_bytes == 256
    assert ns.state.snapshot_bytes == 16
    plain = make_namespace(with_state=False)
    assert not plain.has_state and plain.state.snapshot_bytes == 0


def test_state_only_namespace_is_valid() -> None:
    ns = Namespace(model="pure-ssm", kv=KVLayout(num_layers=0, num_heads=0, head_dim=0),
                   state=StateLayout(num_layers=2, shapes=((3,),), dtype="int8"))
    assert ns.block_bytes == 0
    assert ns.state.snapshot_bytes == 6
    assert Namespace.from_wire(ns.to_wire()) == ns

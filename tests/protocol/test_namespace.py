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
        block_tokens=16,
        tenant="team-a",
    )


def legacy() -> Namespace:
    """A per-rank record of hash scheme 1, as a client of the earlier release registered it."""
    return dataclasses.replace(base(), hash_scheme=1, tp_rank=1, tp_size=2)


def per_head() -> Namespace:
    """A state addressable per head: 4 head units, an fp32 recurrent state beside a bf16 conv state."""
    return dataclasses.replace(base(), state=StateLayout(num_layers=2, shapes=((4, 8, 8), (4, 6, 3)), num_heads=4,
                                                         dtypes=("float32", "bfloat16")))


# ---------------------------------------------------------------- encoding and id


@pytest.mark.parametrize("ns", [base(), make_namespace(), make_namespace(with_state=False), legacy(), per_head()],
                         ids=["hybrid", "factory", "no-state", "legacy", "per-head"])
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
    assert make_namespace().id_hex == GOLDEN_ID
    assert HASH_SCHEME_VERSION == 2


GOLDEN_ID = "4c1c7d4d305bff09"


def test_a_legacy_record_keeps_its_id() -> None:
    """A per-rank namespace registered by a scheme-1 client before this release re-encodes to the
    same bytes, so its stored entries stay reachable (the golden value of that release)."""
    old = dataclasses.replace(make_namespace(), hash_scheme=1)
    assert old.legacy and old.id_hex == "b388ef478777052f"
    assert Namespace.decode(old.encode()) == old and len(old.to_wire()) == 9
    assert make_namespace().id != old.id and len(make_namespace().to_wire()) == 7


def test_no_tp_rank_in_a_canonical_namespace() -> None:
    """Every TP size of a model keys one namespace: scheme 2 names no rank, and refuses one."""
    assert "tp_rank" not in str(base().to_wire())
    with pytest.raises(NamespaceError, match="^tp_rank/tp_size:"):
        dataclasses.replace(base(), tp_rank=1, tp_size=2)
    with pytest.raises(NamespaceError, match="^state:"):  # head-addressable state is scheme 2's
        dataclasses.replace(per_head(), hash_scheme=1)


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
    "state.num_heads": lambda ns: _replace_state(ns, shapes=((4, 8, 8), (4, 12)), num_heads=4),
    "state.dtypes": lambda ns: _replace_state(ns, dtypes=("float32", "bfloat16")),
    "hash_scheme": lambda ns: dataclasses.replace(ns, hash_scheme=1),
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
    ("tp_size", lambda: Namespace(model="m", kv=_kv(), tp_size=0, hash_scheme=1)),
    ("tp_rank", lambda: Namespace(model="m", kv=_kv(), tp_rank=2, tp_size=2, hash_scheme=1)),
    ("tp_rank", lambda: Namespace(model="m", kv=_kv(), tp_rank=-1, hash_scheme=1)),
    ("tp_rank/tp_size", lambda: Namespace(model="m", kv=_kv(), tp_rank=0, tp_size=2)),
    ("state.num_heads", lambda: StateLayout(num_layers=1, shapes=((2,),), num_heads=-1)),
    ("state.shapes", lambda: StateLayout(num_layers=1, shapes=((4, 2), (3, 2)), num_heads=4)),
    ("state.dtypes", lambda: StateLayout(num_layers=1, shapes=((2,), (2,)), dtypes=("float32",))),
    ("state.dtypes", lambda: StateLayout(num_layers=1, shapes=((2,),), dtypes=("fp4",))),
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


def _legacy_wire_with(index: int, value: object) -> list[object]:
    raw = legacy().to_wire()
    raw[index] = value
    return raw


BAD_WIRE = [
    ("namespace", "not a list"),
    ("namespace", base().to_wire()[:6]),
    ("namespace", base().to_wire() + [0]),
    ("namespace", legacy().to_wire()[:7]),  # a scheme-1 record has 9 fields
    ("namespace", base().to_wire()[:6] + [0, 1, 16]),  # and a scheme-2 one 7
    ("hash_scheme", _wire_with(0, "1")),
    ("hash_scheme", _wire_with(0, 99)),
    ("hash_scheme", _wire_with(0, [1])),  # unhashable: found by the fuzzer as a 500
    ("tenant", _wire_with(1, 7)),
    ("model", _wire_with(2, b"bytes-not-str")),
    ("model", _wire_with(2, "")),
    ("revision", _wire_with(3, None)),
    ("kv", _wire_with(4, {"num_layers": 2})),
    ("kv", _wire_with(4, [2, 1, 4, "float32"])),
    ("state", _wire_with(5, "none")),
    ("tp_rank", _legacy_wire_with(6, 1.0)),
    ("tp_size", _legacy_wire_with(7, None)),
    ("block_tokens", _wire_with(6, True)),
    ("block_tokens", _wire_with(6, 0)),
    ("block_tokens", _legacy_wire_with(8, 0)),
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
    ("state", base().to_wire()[:5] + [[4, [[4, 8, 8]], "float32", 4]] + [16]),  # 4 fields: neither form
    ("state.dtypes", base().to_wire()[:5] + [[4, [[4, 8, 8]], "float32", 4, "float32"]] + [16]),
    ("state.num_heads", base().to_wire()[:5] + [[4, [[4, 8, 8]], "float32", "4", []]] + [16]),
]


@pytest.mark.parametrize(("field", "raw"), BAD_WIRE, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_WIRE)])
def test_from_wire_rejects_and_names_the_field(field: str, raw: object) -> None:
    with pytest.raises(NamespaceError) as info:
        Namespace.from_wire(raw)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


CONSTRUCTOR_ACCEPTS_UNENCODABLE = [
    ("block_tokens", {"block_tokens": True}),
    ("tp_size", {"tp_size": True, "hash_scheme": 1}),
    ("tp_rank", {"tp_rank": False, "hash_scheme": 1}),
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


def test_equal_dtypes_fold_into_dtype() -> None:
    """One layout, one encoding: a per-tensor dtype tuple of equal names is the plain ``dtype``."""
    a = StateLayout(num_layers=1, shapes=((2,), (3,)), dtypes=("bfloat16", "bfloat16"))
    assert a == StateLayout(num_layers=1, shapes=((2,), (3,)), dtype="bfloat16")
    mixed = StateLayout(num_layers=1, shapes=((2,), (3,)), dtypes=("float32", "bfloat16"))
    assert mixed.tensor_bytes == (8, 6) and mixed.layer_bytes == 14


# ---------------------------------------------------------------- ranges: layers and heads


def test_kv_head_runs_hand_computed() -> None:
    """Scheme 2 lays a KV payload out [layer][K|V][head][token][dim]: a head range is one run per
    layer and component; all heads of a layer range is one run."""
    ns = dataclasses.replace(base(), kv=KVLayout(num_layers=3, num_heads=4, head_dim=8, dtype="bfloat16"))
    head = 5 * 8 * 2  # 5 tokens x 8 dims x 2 bytes
    layer = 2 * 4 * head  # K and V of 4 heads
    assert ns.payload_runs(False, 5, 0, None) == [(0, 3 * layer)]
    assert ns.payload_runs(False, 5, 1, 3) == [(layer, 2 * layer)]
    assert ns.payload_runs(False, 5, 0, 2, 1, 3) == [
        (1 * head, 2 * head), (4 * head + 1 * head, 2 * head),  # layer 0: K heads 1-2, V heads 1-2
        (layer + 1 * head, 2 * head), (layer + 5 * head, 2 * head)]
    # The last heads of K and the first of V are adjacent: merged.
    assert ns.payload_runs(False, 5, 2, 3, 0, 4) == [(2 * layer, layer)]
    assert ns.payload_runs(False, 5, 0, 1, 2, None) == [(2 * head, 2 * head), (6 * head, 2 * head)]


def test_state_head_runs_hand_computed() -> None:
    ns = per_head()
    t0, t1 = 8 * 8 * 4, 6 * 3 * 2  # per head unit: fp32 8x8, bf16 6x3
    layer = 4 * (t0 + t1)
    assert ns.state.layer_bytes == layer
    assert ns.payload_runs(True, 0, 0, None, 2, 4) == [
        (2 * t0, 2 * t0), (4 * t0 + 2 * t1, 2 * t1),
        (layer + 2 * t0, 2 * t0), (layer + 4 * t0 + 2 * t1, 2 * t1)]


@pytest.mark.parametrize(("ns", "args", "why"), [
    (base(), (False, 4, 0, None, 0, 3), "2 heads"),
    (base(), (False, 4, 0, None, 1, 1), "2 heads"),
    (base(), (False, 4, 2, 5, 0, 1), "3 layers"),
    (base(), (True, 0, 0, None, 0, 1), "not addressable per head"),
    (legacy(), (False, 4, 0, None, 0, 1), "per-rank namespace"),
    (per_head(), (True, 0, 0, None, 3, 5), "4 heads"),
], ids=["heads-beyond", "heads-empty", "layers-beyond", "opaque-state", "legacy", "state-heads-beyond"])
def test_head_ranges_that_do_not_exist_are_refused(ns: Namespace, args: tuple, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=why):
        ns.payload_runs(*args)


def test_a_legacy_namespace_still_serves_layer_ranges() -> None:
    assert legacy().payload_runs(False, 5, 1, 3) == [legacy().kv.layer_range_bytes(5, 1, 3)]

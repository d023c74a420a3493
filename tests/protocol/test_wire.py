"""The wire format: framing, field validation, message round trips, and a bounded fuzz."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixstore.protocol import BlockHash, Kind, block_hashes, make_entry_key, pack_tokens, prefix_hash, root_hash
from prefixstore.protocol.errors import HTTP_STATUS, ItemStatus, Problem, Reason
from prefixstore.protocol.wire import (
    MAGIC,
    PREFIX,
    PREFIX_BYTES,
    WIRE_VERSION,
    GET_STATUSES,
    EntryRef,
    GetAnswer,
    GetItem,
    GetResult,
    ItemResult,
    ItemSpec,
    Limits,
    LookupAnswer,
    LookupRequest,
    WireError,
    decode_frame,
    decode_header,
    encode_frame,
    encode_get_items,
    encode_header,
    encode_header_parts,
    parse_get_items,
    parse_items,
    parse_prefix,
)

from ..factories import make_namespace

NS = make_namespace()
B = NS.block_tokens
LIMITS = Limits(max_header_bytes=1 << 16, max_items=64, max_lookup_blocks=1024, max_lookup_tokens=4096,
                max_body_bytes=1 << 20)
TOKENS = list(range(10, 10 + 2 * B + 1))
HASHES = block_hashes(NS, TOKENS)


def block_tokens_of(ns_id: bytes) -> int:
    if ns_id != NS.id:
        raise WireError("ns", "unknown namespace", Problem.UNKNOWN)
    return B


def block_spec(j: int = 0, checksum: int | None = 12345) -> ItemSpec:
    parent = root_hash(NS) if j == 0 else HASHES[j - 1]
    return ItemSpec(kind=Kind.BLOCK, hash=HASHES[j], size=NS.block_bytes, parent=parent,
                    tokens=pack_tokens(TOKENS[j * B : (j + 1) * B]), checksum=checksum)


def tail_spec() -> ItemSpec:
    return ItemSpec(kind=Kind.TAIL, hash=prefix_hash(NS, TOKENS, 2 * B + 1), size=NS.kv.token_bytes,
                    parent=HASHES[1], tokens=pack_tokens(TOKENS[2 * B :]), extra=b"img:1")


def state_spec() -> ItemSpec:
    return ItemSpec(kind=Kind.STATE, hash=prefix_hash(NS, TOKENS, 3), size=NS.state.snapshot_bytes,
                    container=make_entry_key(Kind.BLOCK, HASHES[0]), boundary=3, checksum=2**64 - 1)


def through_msgpack(obj: object) -> object:
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


# ---------------------------------------------------------------- framing


@pytest.mark.parametrize("payloads", [[], [b""], [b"abc"], [b"x" * 1000, b"", memoryview(b"yz")]])
def test_frame_round_trip(payloads: list[bytes | memoryview]) -> None:
    header = {"ns": NS.id, "items": [1, 2, {"a": b"\x00" * 16}], "commit": True, "s": "é"}
    frame = encode_frame(header, payloads)
    assert frame[:3] == MAGIC and frame[3] == WIRE_VERSION
    got, rest = decode_frame(frame)
    assert got == header
    assert bytes(rest) == b"".join(bytes(p) for p in payloads)
    assert encode_header(header) == frame[: len(frame) - len(rest)]


@pytest.mark.parametrize("header", [
    {},
    {"ns": b"\x01" * 16, "lease": True},
    # a lookup's shape: bins of 64 KiB and more are sent from their own buffers
    {"ns": b"\x01" * 16, "hashes": bytes(range(256)) * 512, "tokens": memoryview(b"\x07" * (1 << 19)),
     "lease": False, "extras": [[3, b"img"]]},
    {"bin16": b"x" * 65535, "bin32": b"y" * 65536, **{f"k{i}": i for i in range(17)}},  # map 16
])
def test_header_parts_are_the_header_bytes(header: dict[str, object]) -> None:
    """The parts are the same bytes as one encoded header, and the large values travel uncopied."""
    parts = encode_header_parts(header)
    plain = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in header.items()}
    assert b"".join(bytes(p) for p in parts) == encode_header(plain)
    assert decode_frame(b"".join(bytes(p) for p in parts))[0] == plain
    large = [v for v in header.values() if isinstance(v, (bytes, memoryview)) and len(v) >= 1 << 16]
    views = [p for p in parts if isinstance(p, memoryview)]
    assert len(views) == len(large)
    assert all(p.obj is (v.obj if isinstance(v, memoryview) else v) for p, v in zip(views, large))


def test_parse_prefix_returns_header_length() -> None:
    assert parse_prefix(PREFIX.pack(MAGIC, WIRE_VERSION, 77), 100) == 77
    assert parse_prefix(PREFIX.pack(MAGIC, WIRE_VERSION, 100), 100) == 100  # the limit itself is allowed


@pytest.mark.parametrize(("prefix", "field", "status"), [
    (PREFIX.pack(b"PSG", WIRE_VERSION, 4), "frame", 400),
    (PREFIX.pack(b"HTT", WIRE_VERSION, 4), "frame", 400),
    (PREFIX.pack(MAGIC, WIRE_VERSION + 1, 4), "frame.version", 400),
    (PREFIX.pack(MAGIC, 0, 4), "frame.version", 400),
    (PREFIX.pack(MAGIC, WIRE_VERSION, 101), "frame.header_len", 413),
    (PREFIX.pack(MAGIC, WIRE_VERSION, 2**32 - 1), "frame.header_len", 413),
    (PREFIX.pack(MAGIC, WIRE_VERSION, 4)[:7], "frame", 400),
    (b"", "frame", 400),
], ids=["magic", "http", "version-next", "version-0", "oversize", "oversize-max", "truncated", "empty"])
def test_parse_prefix_rejects(prefix: bytes, field: str, status: int) -> None:
    with pytest.raises(WireError) as info:
        parse_prefix(prefix, 100)
    assert info.value.field == field
    assert HTTP_STATUS[info.value.problem] == status
    assert str(info.value).startswith(f"{field}:")


def test_decode_frame_rejects_a_header_len_that_lies() -> None:
    frame = encode_header({"a": 1})
    with pytest.raises(WireError) as info:
        decode_frame(frame[:-1])
    assert info.value.field == "frame.header_len" and HTTP_STATUS[info.value.problem] == 400
    with pytest.raises(WireError) as info:
        decode_frame(frame[:5])
    assert info.value.field == "frame"


def test_decode_frame_applies_the_header_limit() -> None:
    frame = encode_header({"blob": b"x" * 200})
    with pytest.raises(WireError) as info:
        decode_frame(frame, max_header_bytes=100)
    assert HTTP_STATUS[info.value.problem] == 413


@pytest.mark.parametrize("raw", [b"\xc1", b"\x92\x01", b"\x81\xa1a\x01\x02", b"", b"\xdd\xff\xff\xff\xff",
                                 msgpack.packb({1: 2}), b"\x81\x91\x01\x02"],
                         ids=["reserved-byte", "truncated-array", "trailing-bytes", "empty", "huge-array", "int-key",
                              "array-key"])
def test_decode_header_rejects_non_msgpack(raw: bytes) -> None:
    with pytest.raises(WireError) as info:
        decode_header(raw)
    assert info.value.field == "frame.header"


@pytest.mark.parametrize("value", [[1, 2], 3, "map", b"bin", None, True])
def test_decode_header_rejects_non_maps(value: object) -> None:
    with pytest.raises(WireError) as info:
        decode_header(msgpack.packb(value, use_bin_type=True))
    assert info.value.field == "frame.header"
    assert "expected a map" in info.value.message


# ---------------------------------------------------------------- message round trips


@pytest.mark.parametrize("make", [block_spec, tail_spec, state_spec, lambda: block_spec(1, None)],
                         ids=["block", "tail-with-extra", "state", "block-no-checksum"])
def test_item_spec_round_trip(make) -> None:  # type: ignore[no-untyped-def]
    spec = make()
    assert ItemSpec.from_wire(spec.to_wire(), "items[0].", LIMITS.max_body_bytes) == spec
    assert ItemSpec.from_wire(through_msgpack(spec.to_wire()), "items[0].", LIMITS.max_body_bytes) == spec


def test_parse_items_round_trip() -> None:
    specs = [block_spec(0), block_spec(1), tail_spec(), state_spec()]
    header, _ = decode_frame(encode_frame({"items": [s.to_wire() for s in specs]}))
    assert parse_items(header, LIMITS) == specs


@pytest.mark.parametrize("item", [
    GetItem(key=make_entry_key(Kind.BLOCK, HASHES[0])),
    GetItem(key=make_entry_key(Kind.TAIL, HASHES[1]), layer_start=1, layer_end=2),
    GetItem(key=make_entry_key(Kind.STATE, HASHES[1]), layer_start=3),
], ids=["whole", "range", "open-range"])
def test_get_item_round_trip(item: GetItem) -> None:
    assert GetItem.from_wire(item.to_wire(), "items[0]") == item
    assert GetItem.from_wire(through_msgpack(item.to_wire()), "items[0]") == item


# ---------------------------------------------------------------- get items and answers, packed

get_items = st.lists(st.builds(
    GetItem,
    key=st.builds(lambda k, h: make_entry_key(k, BlockHash(h)), st.sampled_from(list(Kind)),
                  st.binary(min_size=16, max_size=16)),
    layer_start=st.integers(0, 50),
    layer_end=st.none() | st.integers(51, 2**32 - 1),
    head_start=st.integers(0, 50) | st.just(0),
    head_end=st.none() | st.integers(51, 2**32 - 1),
), max_size=LIMITS.max_items)


@given(items=get_items, whole=st.booleans(), all_heads=st.booleans())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_packed_get_items_round_trip(items: list[GetItem], whole: bool, all_heads: bool) -> None:
    if whole:
        items = [GetItem(key=it.key) for it in items]
    if all_heads:
        items = [GetItem(key=it.key, layer_start=it.layer_start, layer_end=it.layer_end) for it in items]
    header = encode_get_items(items)
    assert ("layers" in header) == any(it.layer_start or it.layer_end is not None for it in items)
    assert ("heads" in header) == any(not it.all_heads for it in items)
    assert parse_get_items(through_msgpack(header), LIMITS) == items  # type: ignore[arg-type]
    # The older form is still read, with the same items.
    assert parse_get_items({"items": [it.to_wire() for it in items]}, LIMITS) == items


KEY = make_entry_key(Kind.BLOCK, HASHES[0])


@pytest.mark.parametrize(("header", "field", "status"), [
    ({"keys": KEY[:-1]}, "keys", 400),
    ({"keys": KEY + b"\x09" + KEY[1:]}, "keys[1]", 400),
    ({"keys": "not bytes"}, "keys", 400),
    ({"keys": KEY * (LIMITS.max_items + 1)}, "keys", 413),
    ({"keys": KEY * 2, "layers": struct.pack("<II", 0, 1)}, "layers", 400),
    ({"keys": KEY * 2, "layers": struct.pack("<IIII", 0, 0, 3, 3)}, "layers[1]", 400),
    ({"keys": KEY, "layers": struct.pack("<II", 5, 2)}, "layers[0]", 400),
    ({"keys": KEY * 2, "heads": struct.pack("<II", 0, 1)}, "heads", 400),
    ({"keys": KEY, "heads": struct.pack("<II", 3, 3)}, "heads[0]", 400),
    ({}, "items", 400),
])
def test_packed_get_items_name_the_field(header: dict[str, object], field: str, status: int) -> None:
    with pytest.raises(WireError) as info:
        parse_get_items(header, LIMITS)
    assert info.value.field == field and HTTP_STATUS[info.value.problem] == status


@pytest.mark.parametrize("item", [
    GetItem(key=KEY, layer_end=0),
    GetItem(key=KEY, layer_start=3, layer_end=3),
    GetItem(key=KEY, layer_start=4, layer_end=2),
    GetItem(key=KEY, layer_start=1 << 32),
    GetItem(key=KEY, layer_end=1 << 32),
    GetItem(key=KEY, layer_start=-1),
    GetItem(key=KEY[:-1]),
    GetItem(key=KEY, head_end=0),
    GetItem(key=KEY, head_start=2, head_end=1),
], ids=["end-0", "empty", "reversed", "start-u32", "end-u32", "negative", "short-key", "heads-end-0", "heads-reversed"])
def test_encoding_refuses_what_no_store_takes(item: GetItem) -> None:
    """A caller's malformed item is named before anything is sent (``layer_end=0`` would otherwise
    read as "to the last layer" in the packed form, where the older form was refused)."""
    with pytest.raises(ValueError, match=r"items\[1\]"):
        encode_get_items([GetItem(key=KEY), item])


def test_get_items_hash_by_value() -> None:
    assert len({GetItem(key=KEY, layer_start=1), GetItem(key=KEY, layer_start=1), GetItem(key=KEY)}) == 2


get_answers = st.lists(st.tuples(st.sampled_from(GET_STATUSES), st.integers(0, 2**40),
                                 st.integers(0, 2**64 - 1)), max_size=64).map(
    lambda rows: GetAnswer([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]))


@given(answer=get_answers, packed=st.booleans())
def test_get_answer_round_trip(answer: GetAnswer, packed: bool) -> None:
    header = through_msgpack(answer.to_header(packed))
    assert isinstance(header, dict) and (("status" in header) == packed) and (("items" in header) != packed)
    assert GetAnswer.from_header(header, len(answer.statuses)) == answer


def test_packed_answer_layout() -> None:
    """The bytes another implementation would read: a status code per item, then u64 LE arrays."""
    header = GetAnswer([GET_STATUSES[0], GET_STATUSES[1]], [65536, 0], [2**64 - 1, 0]).to_header()
    assert header == {"status": b"\x00\x01", "sizes": struct.pack("<QQ", 65536, 0),
                      "checksums": struct.pack("<QQ", 2**64 - 1, 0)}


@pytest.mark.parametrize(("header", "field"), [
    (GetAnswer([GET_STATUSES[0]] * 2, [1, 2], [3, 4]).to_header(), "status"),  # two items for three asked
    ({**GetAnswer([GET_STATUSES[0]] * 3, [1, 2, 3], [3, 4, 5]).to_header(), "status": b"\x00\x00\x09"}, "status"),
    ({**GetAnswer([GET_STATUSES[0]] * 3, [1, 2, 3], [3, 4, 5]).to_header(), "sizes": b"\x00" * 16}, "sizes"),
    ({**GetAnswer([GET_STATUSES[0]] * 3, [1, 2, 3], [3, 4, 5]).to_header(), "checksums": None}, "checksums"),
    (GetAnswer([GET_STATUSES[0]] * 2, [1, 2], [3, 4]).to_header(packed=False), "items"),
])
def test_get_answer_names_the_field(header: dict[str, object], field: str) -> None:
    with pytest.raises(WireError) as info:
        GetAnswer.from_header(header, 3)
    assert info.value.field == field


def test_lookup_request_round_trip() -> None:
    req = LookupRequest(namespace_id=NS.id, hashes=b"".join(HASHES), tokens=pack_tokens(TOKENS), lease=False,
                        locations=True)
    header, _ = decode_frame(encode_frame(req.to_header()))
    assert LookupRequest.from_header(header, LIMITS, block_tokens_of) == req
    assert req.num_blocks == 2 and req.num_tokens == len(TOKENS)


@pytest.mark.parametrize("answer", [
    LookupAnswer(num_tokens=9, matched_blocks=0, kv_tokens=0, state_tokens=0, checkpoint_hint=0, block_bytes=256),
    LookupAnswer(num_tokens=9, matched_blocks=2, kv_tokens=9, state_tokens=3, checkpoint_hint=9, block_bytes=256,
                 child=EntryRef(key=make_entry_key(Kind.TAIL, HASHES[1]), num_tokens=3, usable_tokens=1, size=192,
                                tier="ram"),
                 snapshot=EntryRef(key=make_entry_key(Kind.STATE, HASHES[0]), num_tokens=0, usable_tokens=3,
                                   size=16, tier="disk"),
                 lease_id=b"L" * 16, lease_ttl_s=30.0, block_tiers=b"\x00\x01"),
], ids=["miss", "full"])
def test_lookup_answer_round_trip(answer: LookupAnswer) -> None:
    header, _ = decode_frame(encode_frame(answer.to_header()))
    assert LookupAnswer.from_header(header) == answer


def test_results_round_trip() -> None:
    r = ItemResult(ItemStatus.REJECTED, Reason.ADMISSION)
    assert r.to_wire() == ["rejected", "admission"]
    assert ItemResult.from_wire(through_msgpack(r.to_wire())) == r
    failed = ItemResult(ItemStatus.REJECTED, Reason.DISK_FAILED, detail="OSError")
    assert ItemResult.from_wire(through_msgpack(failed.to_wire())) == failed
    assert failed.text == "disk write failed: OSError"
    elsewhere = ItemResult(ItemStatus.ELSEWHERE, Reason.FORK_BRANCH, branch=HASHES[0])
    assert ItemResult.from_wire(through_msgpack(elsewhere.to_wire())) == elsewhere
    g = GetResult("ok", 256, 2**64 - 1)
    assert GetResult.from_wire(through_msgpack(g.to_wire())) == g


# ---------------------------------------------------------------- wrong types name the field


def _item(**changes: object) -> dict[str, object]:
    d = block_spec().to_wire()
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k)
        else:
            d[k] = v
    return d


def _state(**changes: object) -> dict[str, object]:
    d = state_spec().to_wire()
    d.update(changes)
    return d


_DROP = object()

BAD_ITEMS = [
    ("items[0]", "not a map"),
    ("items[0]", [1, 2, 3]),
    ("items[0].kind", _item(kind=9)),
    ("items[0].kind", _item(kind=0)),
    ("items[0].kind", _item(kind="block")),
    ("items[0].kind", _item(kind=_DROP)),
    ("items[0].hash", _item(hash="0123456789abcdef")),
    ("items[0].hash", _item(hash=b"\x00" * 15)),
    ("items[0].hash", _item(hash=None)),
    ("items[0].size", _item(size=-1)),
    ("items[0].size", _item(size=0)),
    ("items[0].size", _item(size=LIMITS.max_body_bytes + 1)),
    ("items[0].size", _item(size=256.0)),
    ("items[0].size", _item(size=True)),
    ("items[0].checksum", _item(checksum=-1)),
    ("items[0].checksum", _item(checksum=2**64)),
    ("items[0].checksum", _item(checksum="abc")),
    ("items[0].parent", _item(parent=None)),
    ("items[0].parent", _item(parent=_DROP)),
    ("items[0].tokens", _item(tokens=[1, 2, 3, 4])),
    ("items[0].tokens", _item(tokens=b"\x01\x02\x03")),
    ("items[0].tokens", _item(tokens=b"")),
    ("items[0].extra", _item(extra="lora")),
    ("items[0].container", _state(container=b"\x01" * 16)),
    ("items[0].container", _state(container=make_entry_key(Kind.STATE, HASHES[0]))),
    ("items[0].container", _state(container=None)),
    ("items[0].boundary", _state(boundary=0)),
    ("items[0].boundary", _state(boundary="3")),
]


@pytest.mark.parametrize(("field", "raw"), BAD_ITEMS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_ITEMS)])
def test_item_from_wire_names_the_field(field: str, raw: object) -> None:
    with pytest.raises(WireError) as info:
        parse_items({"items": [raw]}, LIMITS)
    assert info.value.field == field, str(info.value)
    assert HTTP_STATUS[info.value.problem] == 400


def test_item_index_is_named() -> None:
    with pytest.raises(WireError) as info:
        parse_items({"items": [block_spec().to_wire(), block_spec(1).to_wire(), _item(hash=7)]}, LIMITS)
    assert info.value.field == "items[2].hash"


@pytest.mark.parametrize(("header", "field", "status"), [
    ({}, "items", 400),
    ({"items": "abc"}, "items", 400),
    ({"items": {"0": 1}}, "items", 400),
    ({"items": [block_spec().to_wire()] * (LIMITS.max_items + 1)}, "items", 413),
])
def test_parse_items_list(header: dict[str, object], field: str, status: int) -> None:
    with pytest.raises(WireError) as info:
        parse_items(header, LIMITS)
    assert (info.value.field, HTTP_STATUS[info.value.problem]) == (field, status)


def _lookup(**changes: object) -> dict[str, object]:
    d = LookupRequest(namespace_id=NS.id, hashes=b"".join(HASHES), tokens=pack_tokens(TOKENS)).to_header()
    d.update(changes)
    return d


@pytest.mark.parametrize(("header", "field", "status"), [
    (_lookup(ns="deadbeef"), "ns", 400),
    (_lookup(ns=NS.id + b"x"), "ns", 400),
    (_lookup(ns=b"\x00" * 8), "ns", 404),
    (_lookup(hashes="".join(h.hex() for h in HASHES)), "hashes", 400),
    (_lookup(hashes=b"".join(HASHES)[:-1]), "hashes", 400),
    (_lookup(hashes=b"".join(HASHES[:1])), "hashes", 400),  # 1 hash for 2 full blocks
    (_lookup(hashes=[bytes(h) for h in HASHES]), "hashes", 400),
    (_lookup(tokens=TOKENS), "tokens", 400),
    (_lookup(tokens=pack_tokens(TOKENS) + b"\x00"), "tokens", 400),
    (_lookup(tokens=b"\x00" * 4 * (LIMITS.max_lookup_tokens + 1)), "tokens", 413),
    (_lookup(hashes=b"\x00" * 16 * (LIMITS.max_lookup_blocks + 1)), "hashes", 413),
    (_lookup(lease="yes"), "lease", 400),
    (_lookup(locations=1), "locations", 400),
], ids=["ns-str", "ns-9", "ns-unknown", "hashes-str", "hashes-ragged", "hashes-count", "hashes-list", "tokens-list",
        "tokens-ragged", "tokens-limit", "hashes-limit", "lease", "locations"])
def test_lookup_request_names_the_field(header: dict[str, object], field: str, status: int) -> None:
    with pytest.raises(WireError) as info:
        LookupRequest.from_header(header, LIMITS, block_tokens_of)
    assert (info.value.field, HTTP_STATUS[info.value.problem]) == (field, status), str(info.value)


@pytest.mark.parametrize(("raw", "field"), [
    ("key", "items[0]"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 0], "items[0]"),
    ([b"\x00" * 17, 0, None], "items[0].key"),
    ([b"\x04" + HASHES[0], 0, None], "items[0].key"),
    ([HASHES[0], 0, None], "items[0].key"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), -1, None], "items[0].layer_start"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), "0", None], "items[0].layer_start"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 2, 2], "items[0].layer_end"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 0, "all"], "items[0].layer_end"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 0, None, -1, None], "items[0].head_start"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 0, None, 2, 2], "items[0].head_end"),
    ([make_entry_key(Kind.BLOCK, HASHES[0]), 0, None, 2], "items[0]"),
])
def test_get_item_names_the_field(raw: object, field: str) -> None:
    with pytest.raises(WireError) as info:
        GetItem.from_wire(raw, "items[0]")
    assert info.value.field == field


def _answer(**changes: object) -> dict[str, object]:
    d = LookupAnswer(num_tokens=9, matched_blocks=2, kv_tokens=9, state_tokens=3, checkpoint_hint=0,
                     block_bytes=256).to_header()
    d.update(changes)
    return d


@pytest.mark.parametrize(("header", "field"), [
    (_answer(kv_tokens="9"), "kv_tokens"),
    (_answer(num_tokens=-1), "num_tokens"),
    (_answer(child="x"), "child"),
    (_answer(snapshot=[b"\x03" * 17, 0, 3]), "snapshot"),
    (_answer(child=[b"short", 1, 1, 1, "ram"]), "child.key"),
    (_answer(lease="lease"), "lease"),
])
def test_lookup_answer_names_the_field(header: dict[str, object], field: str) -> None:
    with pytest.raises(WireError) as info:
        LookupAnswer.from_header(header)
    assert info.value.field == field


_KEY = make_entry_key(Kind.TAIL, HASHES[0])


@pytest.mark.parametrize("call", [
    lambda: LookupAnswer.from_header(_answer(child=[_KEY, None, 1, 1, "ram"])),
    lambda: LookupAnswer.from_header(_answer(child=[_KEY, "x", 1, 1, "ram"])),
    lambda: LookupAnswer.from_header(_answer(snapshot=[_KEY, 0, 3, [], "ram"])),
    lambda: LookupAnswer.from_header(_answer(child=[_KEY, -3, 1, 1, "ram"])),
    lambda: GetResult.from_wire(["ok", None, 0]),
    lambda: GetResult.from_wire(["ok", "256", "x"]),
    lambda: GetResult.from_wire(["ok", -4, 0]),
], ids=["entry-none", "entry-str", "entry-list", "entry-negative", "get-none", "get-str", "get-negative"])
def test_answers_with_wrong_types_raise_wire_error(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(WireError):
        call()


# ---------------------------------------------------------------- fuzz: only WireError ever


def parse_everything(body: bytes) -> None:
    """What the server does with a control body; anything but WireError escapes and fails the test."""
    try:
        header, _ = decode_frame(body, LIMITS.max_header_bytes)
    except WireError:
        return
    for parse in (lambda: parse_items(header, LIMITS), lambda: LookupRequest.from_header(header, LIMITS, block_tokens_of)):
        try:
            parse()
        except WireError as err:
            assert isinstance(err.field, str) and err.field
            assert 400 <= HTTP_STATUS[err.problem] < 500
    raw = header.get("items")
    if isinstance(raw, list):
        for i, x in enumerate(raw):
            try:
                GetItem.from_wire(x, f"items[{i}]")
            except WireError:
                pass


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=40),
    st.sampled_from([NS.id, HASHES[0], make_entry_key(Kind.BLOCK, HASHES[0]), make_entry_key(Kind.STATE, HASHES[0]),
                     pack_tokens(TOKENS), b"".join(HASHES), 0, 1, 2, 3, 4, B, NS.block_bytes]),
)
# Shallow on purpose: deep recursive strategies cost seconds of generation for no extra coverage
# (every reader checks the type of the value it takes before looking inside).
_values = _scalars | st.lists(_scalars, max_size=3) | st.dictionaries(st.text(max_size=4), _scalars, max_size=2)
_field_names = st.sampled_from(["ns", "items", "hashes", "tokens", "lease", "locations", "kind", "hash", "size",
                                "parent", "extra", "container", "boundary", "checksum", "commit"])
_item_maps = st.dictionaries(_field_names, _values, max_size=9)
_headers = st.dictionaries(_field_names, _values | st.lists(_item_maps, max_size=3), max_size=7)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(body: bytes) -> None:
    parse_everything(body)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_behind_a_valid_prefix(raw: bytes) -> None:
    parse_everything(PREFIX.pack(MAGIC, WIRE_VERSION, len(raw)) + raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_headers)
def test_fuzz_random_msgpack_maps(header: dict[str, object]) -> None:
    parse_everything(encode_frame(header))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["kind", "hash", "size", "parent", "tokens", "extra", "container", "boundary",
                                 "checksum"]), unique=True), st.data())
def test_fuzz_mutated_valid_items(drop_or_replace: list[str], data: st.DataObject) -> None:
    """Start from valid items and corrupt some fields: deeper paths than random maps reach."""
    items = [s.to_wire() for s in (block_spec(), tail_spec(), state_spec())]
    for item in items:
        for name in drop_or_replace:
            if data.draw(st.booleans()):
                item.pop(name, None)
            else:
                item[name] = data.draw(_values)
    parse_everything(encode_frame({"ns": NS.id, "items": items}))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 200), st.binary(max_size=8))
def test_fuzz_truncated_and_spliced_frames(cut: int, junk: bytes) -> None:
    frame = encode_frame({"ns": NS.id, "items": [block_spec().to_wire(), state_spec().to_wire()]})
    parse_everything(frame[:cut] + junk)
    parse_everything(frame[:cut] + junk + frame[cut:])


def test_prefix_layout() -> None:
    assert PREFIX_BYTES == 8
    assert encode_header({})[:8] == MAGIC + bytes([WIRE_VERSION]) + struct.pack("<I", 1)
    assert BlockHash(b"x" * 16) == b"x" * 16


@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_travels_as_its_code_and_reads_back_as_itself(reason: Reason) -> None:
    """The wire carries the code; the words stay at each end (Reason.text)."""
    wire = through_msgpack(ItemResult(ItemStatus.REJECTED, reason).to_wire())
    assert wire[1] == reason.value
    back = ItemResult.from_wire(wire)
    assert back.reason is reason and back.detail == ""
    assert reason is Reason.NONE or reason.text


def test_an_older_peers_words_read_as_their_reason_an_unknown_code_as_other() -> None:
    """A node or client of before the codes sent the reason's words: read into the member once, at
    the wire, so no code anywhere compares words. A code this end does not know is OTHER, kept as
    the detail for the warning."""
    old = ItemResult.from_wire(["rejected", "tenant quota exceeded"])
    assert old.reason is Reason.QUOTA and old.detail == ""
    old = ItemResult.from_wire(["rejected", "held here as a fork record: the block's branch node holds its payload",
                                {"fork": False}])
    assert old.reason is Reason.RECORD
    new = ItemResult.from_wire(["rejected", "a_reason_from_the_future"])
    assert new.reason is Reason.OTHER and new.detail == "a_reason_from_the_future"
    assert new.text == "other: a_reason_from_the_future"

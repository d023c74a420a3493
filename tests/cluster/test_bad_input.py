"""The cluster endpoints answer malformed input with a 4xx naming the field, never a 5xx."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixstore.protocol.wire import CONTENT_TYPE, decode_frame, encode_frame
from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..factories import make_namespace

NS = make_namespace(block_tokens=4)
ROOT = b"\x01" * 16


@pytest.fixture
def store_config(tmp_path: Path) -> StoreConfig:
    """A node configured as one of a cluster (lookup reports are taken only there); its peers
    need not answer for these checks."""
    return StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                       disk_bytes=64 << 20, nixl="off", peers="http://127.0.0.1:1,http://127.0.0.1:2")


async def post(running: RunningStore, path: str, header: dict[str, object]) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as session:
        async with session.post(running.url + path, data=encode_frame(header),
                                headers={"Content-Type": CONTENT_TYPE}) as resp:
            body = await resp.json() if resp.content_type == "application/json" else {}
            return resp.status, body


async def post_frame(running: RunningStore, path: str, header: dict[str, object]) -> tuple[int, dict[str, object]]:
    """POST a frame; the answer's frame header (200) or JSON error body."""
    async with aiohttp.ClientSession() as session:
        async with session.post(running.url + path, data=encode_frame(header),
                                headers={"Content-Type": CONTENT_TYPE}) as resp:
            raw = await resp.read()
            if resp.status != 200:
                return resp.status, json.loads(raw)
            header_out, _ = decode_frame(raw)
            return resp.status, header_out


async def register(running: RunningStore) -> None:
    status, _ = await post(running, "/v1/namespaces", {"namespace": NS.to_wire()})
    assert status == 200


async def test_probe_fields_are_checked(running: RunningStore) -> None:
    await register(running)
    good = {"ns": NS.id, "start": 0, "parent": ROOT, "hashes": b"\x02" * 16, "tokens": b"\x00" * 16}
    cases = {
        "start": {**good, "start": -1},
        "parent": {**good, "parent": b"\x01" * 5},
        "hashes": {**good, "hashes": b"\x02" * 5},
        "tokens": {**good, "tokens": b"\x00" * 12},  # one hash: exactly one block (4 tokens) and < 4 more
        "extras": {**good, "extras": "x"},
        "extras[0]": {**good, "extras": [[7, b"x"]]},  # a level this probe does not ask
        "extras[1]": {**good, "tokens": b"\x00" * 20, "extras": [[0, b"x"], [0, b"y"]]},  # repeated
        "ns": {**good, "ns": b"\x00" * 8},
    }
    for field, header in cases.items():
        status, body = await post(running, "/v1/probe", header)
        assert 400 <= status < 500 and body["field"] == field, (field, status, body)
    status, _ = await post(running, "/v1/probe", good)
    assert status == 200
    status, _ = await post(running, "/v1/probe", {**good, "tokens": b"\x00" * 28})  # one block and a 3-token tail
    assert status == 200


async def test_lean_probe_fields_are_checked(running: RunningStore) -> None:
    """A lean probe (spans, total_tokens) is checked as a lean lookup is, and must carry its first level."""
    await register(running)
    # Three blocks and a tail of 2 (14 tokens, 4 levels); levels 0 and 3 carried: 4 + 2 tokens.
    good = {"ns": NS.id, "start": 0, "parent": ROOT, "hashes": b"\x02" * 48, "tokens": b"\x00" * 24,
            "spans": [[0, 1], [3, 1]], "total_tokens": 14}
    cases = {
        "total_tokens": {**good, "total_tokens": 20},  # three hashes: 12 to 15 tokens
        "spans": {**good, "spans": [[1, 1], [3, 1]], "tokens": b"\x00" * 24},  # not its first level
        "spans[1]": {**good, "spans": [[0, 1], [0, 1]]},  # not disjoint
        "tokens": {**good, "tokens": b"\x00" * 28},  # more than the spans name
    }
    for field, header in cases.items():
        status, body = await post(running, "/v1/probe", header)
        assert 400 <= status < 500 and body["field"] == field, (field, status, body)
    status, answer = await post_frame(running, "/v1/probe", good)
    assert status == 200 and answer["held"] == 0  # nothing stored: no level needed either


async def test_report_and_drop_fields_are_checked(running: RunningStore) -> None:
    await register(running)
    status, body = await post(running, "/v1/lookup_report",
                              {"ns": NS.id, "num_tokens": 4, "kv_tokens": 8, "state_tokens": 0})
    assert status == 400 and body["field"] == "kv_tokens"
    status, body = await post(running, "/v1/replica/drop", {"ns": NS.id, "keys": [b"\x09" * 17]})
    assert status == 400 and body["field"] == "keys[0]"
    status, _ = await post(running, "/v1/replica/drop", {"ns": NS.id, "keys": [b"\x01" * 17]})
    assert status == 200  # a key this node does not hold as a replica: nothing to drop


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(["start", "parent", "hashes", "tokens", "extras", "lease", "spans",
                                               "total_tokens"]),
                              st.one_of(st.integers(-2, 5), st.binary(max_size=40), st.none(), st.text(max_size=3),
                                        st.lists(st.lists(st.one_of(st.integers(-1, 3), st.binary(max_size=4)),
                                                          max_size=3), max_size=3),
                                        st.integers(-(1 << 63), (1 << 63) - 1)), max_size=6))
async def test_probe_never_answers_5xx(running: RunningStore, fields: dict[str, object]) -> None:
    await register(running)
    status, _ = await post(running, "/v1/probe", {"ns": NS.id, **fields})
    assert status < 500

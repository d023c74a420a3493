"""A tenant's lean lookup or probe whose hashes are not a chain (a forged hash inside a run the
store holds) is answered, never a 5xx: the store's binary search over the held run trusts the
hashes to chain, as an honest client's do, and the snapshot search below it read the forged
level's block as if it were there (store/index.py ``Index.run``)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from prefixstore.protocol.hashing import TOKEN_BYTES
from prefixstore.protocol.wire import CONTENT_TYPE, decode_frame, encode_frame
from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload

NS = make_namespace(block_tokens=4)


@pytest.fixture
def store_config(tmp_path: Path) -> StoreConfig:
    return StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                       disk_bytes=64 << 20, nixl="off", state_admission="always")


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/probe"])
async def test_a_forged_hash_inside_a_held_run_is_answered(running: RunningStore, path: str) -> None:
    tokens = list(range(1, 33))  # 8 blocks of 4
    async with running.client(NS) as client:
        p = client.prompt(tokens)
        saved = await client.save(p, len(tokens), lambda a, b: kv_payload(NS, tokens, a, b),
                                  {6: state_payload(NS, tokens, 6)})  # a snapshot under level 1
        assert saved.rejected == 0 and saved.dropped == 0, saved
    # h1, a forged h2, then the true h3..h8: the binary search finds h8 and calls all 8 levels held;
    # the lean request carries the tokens of levels 0 and 7 only.
    forged = p.hash_bytes[:16] + b"\xee" * 16 + p.hash_bytes[32:]
    header: dict[str, object] = {"ns": NS.id, "hashes": forged, "spans": [[0, 1], [7, 1]], "total_tokens": 32,
                                 "tokens": p.packed[: 4 * TOKEN_BYTES] + p.packed[28 * TOKEN_BYTES:]}
    if path == "/v1/probe":
        header.update(start=0, parent=p.root)
    async with aiohttp.ClientSession() as session:
        async with session.post(running.url + path, data=encode_frame(header),
                                headers={"Content-Type": CONTENT_TYPE}) as resp:
            raw = await resp.read()
            assert resp.status == 200, raw[:500]
            answer, _ = decode_frame(raw)
    # Nothing under the forged level is reported (its block is not there to compare against).
    assert answer.get("state_tokens", 0) == 0 and not answer.get("snaps"), answer
    async with running.client(NS) as client:  # and the node keeps serving the true prompt
        got = await client.lookup(tokens)
        assert (got.kv_tokens, got.state_tokens) == (32, 6)
        await client.release(got.lease_id)

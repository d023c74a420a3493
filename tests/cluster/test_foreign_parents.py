"""A cluster node holds blocks whose parent lives on another node (protocol/placement.py): the store
takes them given their start, adopts them when the parent arrives later, and keeps every other
invariant (Store.check after each step)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol.errors import Reason
from prefixstore.protocol.wire import STATUS_OK, WANT
from prefixstore.store import StoreConfig

from ..factories import kv_payload, make_namespace
from ..store.harness import CoreHarness

B = 4
TOKENS = list(range(1, 13))  # three blocks


def put(h: CoreHarness, p: Prompt, j: int, commit: bool = True):  # type: ignore[no-untyped-def]
    spec, a, b = p.kv_items(12)[j]
    spec = with_payload(dataclasses.replace(spec, start=a), kv_payload(h.ns, TOKENS, a, b))
    assert h.store.offer(h.ns.id, [spec])[0].status == WANT
    plan = h.store.plan_put(h.ns.id, [spec])
    pos = 0
    payload = kv_payload(h.ns, TOKENS, a, b)
    for view in plan.targets[0] or []:
        view[:] = payload[pos : pos + len(view)]
        pos += len(view)
    h.store.verify_put(plan)
    if not commit:
        return plan
    assert h.run(h.store.commit(h.ns.id, plan.keys[:1]))[0].status == STATUS_OK
    return plan


def test_blocks_with_foreign_parents(tmp_path: Path) -> None:
    ns = make_namespace(block_tokens=B)
    cluster = StoreConfig(port=0, data_dir=str(tmp_path / "c"), peers="http://a:1,http://b:2")
    h = CoreHarness(cluster, ns)
    p = Prompt(ns, TOKENS)
    try:
        put(h, p, 2)  # block 3: its parent (block 2) is another node's
        h.store.check()
        pending = put(h, p, 1, commit=False)  # block 2 put (pins nothing: its parent is foreign too)
        put(h, p, 0)  # block 1 arrives and commits while block 2 is pending
        h.store.check()
        key = pending.keys[0]
        assert h.run(h.store.commit(ns.id, [key]))[0].status == STATUS_OK  # adopts block 3; unpins nothing
        h.store.check()
        h.drain()  # the write-behind pins what it is writing
        assert all(e.pins == 0 for e in h.store.index.entries.values())
        assert h.store.entry(ns.id, key).num_children == 1
        h.restart()  # reloaded from LMDB in any order: the same index
        h.store.check()
        assert len(h.store.index.entries) == 3
        assert h.store.flush() == 3
        h.store.check()
    finally:
        h.close()
    # A single node still refuses a block whose parent it does not hold.
    single = CoreHarness(StoreConfig(port=0, data_dir="none"), ns)
    try:
        spec, a, b = p.kv_items(12)[2]
        spec = dataclasses.replace(spec, start=a)
        assert single.store.offer(ns.id, [spec])[0].reason is Reason.PARENT_MISSING
    finally:
        single.close()

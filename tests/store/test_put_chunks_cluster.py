"""A cluster node plans a put whole (store/puts.py): whether an item hangs below a fork record held
here is decided against the items before it in the same put, so a chain of 70 blocks below a fork
record is answered ``elsewhere`` to its last block, never half of it stored here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.wire import STATUS_OK
from prefixstore.store import StoreConfig
from prefixstore.store.puts import CHUNK_ITEMS, PutOrder

from ..factories import kv_payload, make_namespace
from .harness import CoreHarness

B = 4
NUM = CHUNK_ITEMS + 6  # blocks below the record: more than one chunk


def test_a_chain_below_a_fork_record_is_elsewhere_to_its_end(tmp_path: Path) -> None:
    """Plant: chunk on a cluster node too -> the blocks past the first chunk are stored here."""
    ns = make_namespace(block_tokens=B)
    h = CoreHarness(StoreConfig(port=0, data_dir="none", ram_bytes=4 << 20, page_bytes=4096,
                                peers="http://a:1,http://b:2"), ns)
    try:
        tokens = list(range(100, 100 + B * (NUM + 1)))
        p = Prompt(ns, tokens)
        items = p.kv_items(len(tokens))
        spec, a, b = items[0]  # block 1: a fork record here (its payload is on its branch node)
        record = dataclasses.replace(spec, record=True, size=0, start=a)
        plan = h.store.reserve(ns.id, [record])
        assert h.run(h.store.commit(ns.id, plan.keys))[0].status == STATUS_OK
        chain = [with_payload(dataclasses.replace(s, start=a), kv_payload(ns, tokens, a, b)) for s, a, b in items[1:]]
        order = PutOrder(namespace_id=ns.id, items=chain, commit=True, replica=False,
                         payload_bytes=sum(s.size for s in chain))
        intake = h.store.intake(order)
        for plan in intake:
            assert all(t is None for t in plan.targets)  # nothing of it is taken here
        results = h.run(intake.finish(None))
        assert [(r.status, r.reason) for r in results] == [(ItemStatus.ELSEWHERE, Reason.FORK_BRANCH)] * NUM
        assert len(h.store.index.entries) == 1
        h.store.check()
    finally:
        h.close()

"""Exact metric values in a cluster of real store processes, scraped from every node's /metrics.

A cluster lookup is answered by probes, and the client reports what a single node's
lookup would have counted to one node (store/cluster.py ``lookup_report``), so
summed over the nodes the counters must equal the single-node values
(tests/store/test_metric_values.py), and the junction sighting must still reach
the admission policy of the node that owns the snapshot.
"""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from prefixstore.client import ClientConfig, PrefixClient

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import http_get

A = list(range(1, 11))  # B = 4: blocks [1..4], [5..8], tail [9, 10]


def scrape_sum(urls: list[str], name: str, labels: dict[str, str]) -> float:
    """``name{labels}`` summed over the nodes."""
    total = 0.0
    for url in urls:
        status, body = http_get(url + "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == name and s.labels == labels:
                    total += s.value
    return total


def test_cluster_counters_sum_to_the_single_node_values(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(2, "--state-admission", "second-hit")
    ns = make_namespace(block_tokens=4)

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as c:
            saved = await c.save(c.prompt(A), 10, lambda a, b: kv_payload(ns, A, a, b))
            assert saved.stored == 3
            r1 = await c.lookup(A + [90, 91], lease=False)  # KV for 10, no snapshot: a junction at 10
            assert (r1.kv_tokens, r1.state_tokens, r1.checkpoint_hint) == (10, 0, 10)
            # second-hit: the lookup was the junction's second sighting, so the first offer is taken.
            snap = await c.save(c.prompt(A), 10, lambda a, b: kv_payload(ns, A, a, b),
                                {10: state_payload(ns, A, 10)})
            assert (snap.stored, snap.already, snap.rejected) == (1, 3, 0), snap
            r2 = await c.lookup(A[:6] + [50, 51], lease=False)  # KV for 6, no snapshot at or below 6
            r3 = await c.lookup(A + [90, 91], lease=False)  # KV and the snapshot for 10
            assert (r2.kv_tokens, r2.state_tokens, r3.kv_tokens, r3.state_tokens) == (6, 0, 10, 10)

    asyncio.run(run())
    urls = cluster.urls
    got = {(k, r): scrape_sum(urls, "prefixstore_lookup_tokens_total", {"kind": k, "result": r})
           for k in ("kv", "state") for r in ("hit", "miss")}
    assert got == {("kv", "hit"): 10 + 6 + 10, ("kv", "miss"): 2 + 2 + 2,
                   ("state", "hit"): 0 + 0 + 10, ("state", "miss"): 12 + 8 + 2}
    assert scrape_sum(urls, "prefixstore_lookups_total", {}) == 3
    entries = {(k, t): scrape_sum(urls, "prefixstore_entries", {"kind": k, "tier": t})
               for k in ("kv", "state") for t in ("ram", "disk")}
    assert entries == {("kv", "ram"): 3, ("kv", "disk"): 3, ("state", "ram"): 1, ("state", "disk"): 1}
    stored = {(k, t): scrape_sum(urls, "prefixstore_stored_bytes", {"kind": k, "tier": t})
              for k in ("kv", "state") for t in ("ram", "disk")}
    assert stored == {("kv", "ram"): 640, ("kv", "disk"): 640, ("state", "ram"): 16, ("state", "disk"): 16}
    assert scrape_sum(urls, "prefixstore_admission_total", {"kind": "state", "decision": "rejected"}) == 0

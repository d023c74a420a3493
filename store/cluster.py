"""The cluster side of the HTTP plane: membership, per-level probes, lookup reports, replica drops.

Installed into every store app by ``create_app`` (a single node is a cluster
of one: it answers ``/v1/members`` with itself, so a cluster client pointed at
it works unchanged)::

    GET  /v1/members[?key=HEX]   -> JSON {members, epoch, self, previous, changed_s_ago, owner_grace_s,
                                          refresh_s[, order]}   (order: rendezvous order of KEY)
    POST /v1/probe        {ns, levels, lease}            -> ProbeAnswer    (protocol/probe.py, store/lookups.py)
    POST /v1/lookup_report {ns, num_tokens, kv_tokens, state_tokens, junction, missing} -> {counted}
    POST /v1/replica/drop {ns, keys}                     -> {dropped}      (store/replication.py)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from prefixstore.protocol.errors import Problem
from prefixstore.protocol.probe import LookupReport, ProbeRequest
from prefixstore.protocol.wire import WireError, req_bin, req_entry_keys
from .config import StoreConfig
from .http import CLUSTER_SIZE, CONTROL_CALLS, PROBE_NIXL, READINESS, STORE, control_header, frame_response, owned
from .membership import DnsResolver, Membership
from .replication import Replicator

MEMBERSHIP = web.AppKey("membership", Membership)
REPLICATOR = web.AppKey("replicator", Replicator)


async def members(request: web.Request) -> web.Response:
    membership = request.app[MEMBERSHIP]
    answer = membership.describe()
    key = request.query.get("key")
    if key is not None:
        try:
            raw = bytes.fromhex(key)
        except ValueError:
            raise WireError("key", "expected hex") from None
        answer["order"] = membership.rank(raw)
    return web.json_response(answer)


def answer_probe(request: web.Request, header: dict[str, object]) -> dict[str, object]:
    """A probe's answer (the POST route's and the control channel's, store/control.py)."""
    store = request.app[STORE]
    req = ProbeRequest.from_header(header, store.limits, lambda ns_id: owned(request, ns_id).block_tokens)
    membership = request.app[MEMBERSHIP]
    root_home = membership.is_home if membership.is_cluster else (lambda key: True)
    answer = store.probe(req, request.app[REPLICATOR].replicas_of(), root_home=root_home, copies=store.replica_keys)
    if req.nixl and answer.need_level is None and (extension := request.app.get(PROBE_NIXL)) is not None:
        answer = dataclasses.replace(answer, nixl=extension(req, answer))
    return answer.to_header()


async def probe(request: web.Request) -> web.Response:
    return frame_response(answer_probe(request, await control_header(request)))


async def lookup_report(request: web.Request) -> web.Response:
    """What a single node's lookup would have taught its policies and metrics (store/lookups.py
    ``learn``), reported by the client to the node that owns the junction."""
    store = request.app[STORE]
    if not request.app[MEMBERSHIP].is_cluster:
        # Only a cluster client merging probes has something to report; on a single node a report
        # could only move counters every tenant's dashboards read, for the price of 60 bytes.
        raise WireError("lookup_report", "this node is not part of a cluster: lookups report themselves",
                        Problem.UNKNOWN)
    report = LookupReport.from_header(await control_header(request), store.limits)
    owned(request, report.namespace_id)
    # Past the tenant's allowance it teaches nothing, but is answered all the same: a refusal would
    # open the client's circuit breaker on this node (store/lookups.py, "Reports are bounded by rate").
    return frame_response({"counted": store.report(report)})


async def replica_drop(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    keys = req_entry_keys(header, "keys", store.limits.max_items)
    return frame_response({"dropped": await request.app[REPLICATOR].drop(ns_id, keys)})


def install(app: web.Application, config: StoreConfig, clock: Callable[[], float] = time.monotonic,
            resolver: DnsResolver | None = None) -> None:
    store = app[STORE]
    membership = Membership(config, resolver, clock)
    replicator = Replicator(store, membership, clock)
    app[MEMBERSHIP] = membership
    app[REPLICATOR] = replicator
    app[CLUSTER_SIZE] = lambda: len(membership.members) if membership.is_cluster else 1
    membership.on_change(lambda view: store.metrics.members.set(len(membership.members)))
    app[READINESS]["membership"] = lambda: None if membership.known else (
        f"peers_dns={config.peers_dns} has not answered yet: this node does not know its cluster")

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await membership.start()
        store.metrics.members.set(len(membership.members) or 1)
        await replicator.start()
        yield
        await replicator.close()
        await membership.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/v1/members", members)
    app.router.add_post("/v1/probe", probe)
    app[CONTROL_CALLS]["/v1/probe"] = answer_probe
    app.router.add_post("/v1/lookup_report", lookup_report)
    app.router.add_post("/v1/replica/drop", replica_drop)


__all__ = ["MEMBERSHIP", "REPLICATOR", "install"]

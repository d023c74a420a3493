"""The cluster side of the HTTP plane: membership, per-level probes, lookup reports, replica drops.

Installed into every store app by ``create_app`` (a single node is a cluster
of one: it answers ``/v1/members`` with itself, so a cluster client pointed at
it works unchanged)::

    GET  /v1/members[?key=HEX]   -> JSON {members, epoch, self, previous, changed_s_ago, owner_grace_s,
                                          refresh_s[, order]}   (order: rendezvous order of KEY)
    POST /v1/probe        {ns, levels, lease}            -> ProbeAnswer    (protocol/probe.py, store/probe.py)
    POST /v1/lookup_report {ns, num_tokens, kv_tokens, state_tokens, junction, missing} -> {}
    POST /v1/replica/drop {ns, keys}                     -> {dropped}      (store/replication.py)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from ..protocol.hashing import BlockHash
from ..protocol.keys import Kind
from ..protocol.probe import LookupReport, ProbeAnswer, ProbeRequest
from ..protocol.wire import WireError, req_bin, req_entry_keys
from .config import StoreConfig
from .index import store_key
from .membership import DnsResolver, Membership
from .probe import probe as probe_levels
from .replication import Replicator
from .server import STORE, _control_header, _frame_response, _owned

MEMBERSHIP = web.AppKey("membership", Membership)
REPLICATOR = web.AppKey("replicator", Replicator)
ProbeExtension = Callable[[ProbeRequest, ProbeAnswer], dict[str, object] | None]
PROBE_NIXL: web.AppKey[ProbeExtension] = web.AppKey("probe_nixl")
"""Set by store/nixl_target.py where NIXL is served: the ``nixl`` part of a probe that asks for it."""


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


async def probe(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    req = ProbeRequest.from_header(header, store.limits, lambda ns_id: _owned(request, ns_id).block_tokens)
    answer = probe_levels(store, req, request.app[REPLICATOR].replicas_of())
    if req.nixl and (extension := request.app.get(PROBE_NIXL)) is not None:
        answer = dataclasses.replace(answer, nixl=extension(req, answer))
    return _frame_response(answer.to_header())


async def lookup_report(request: web.Request) -> web.Response:
    """What a single node's lookup would have taught its policies and metrics (store/core.py
    ``_count_lookup``), reported by the client to the node that owns the junction."""
    store = request.app[STORE]
    report = LookupReport.from_header(await _control_header(request), store.limits)
    ns = _owned(request, report.namespace_id)
    now = store.clock()
    if report.junction is not None and ns.has_state:
        junction = BlockHash(report.junction)
        store.admission[Kind.STATE].on_sighting(Kind.STATE, store_key(ns.id, Kind.STATE, junction), now)
        store.eviction.on_miss(Kind.STATE, ns.id + junction, now)
    if report.missing_block is not None:
        store.eviction.on_miss(Kind.BLOCK, ns.id + report.missing_block, now)
    m = store.metrics
    m.lookups.inc()
    m.lookup_tokens.labels("kv", "hit").inc(report.kv_tokens)
    m.lookup_tokens.labels("kv", "miss").inc(report.num_tokens - report.kv_tokens)
    if ns.has_state:
        m.lookup_tokens.labels("state", "hit").inc(report.state_tokens)
        m.lookup_tokens.labels("state", "miss").inc(report.num_tokens - report.state_tokens)
    return _frame_response({})


async def replica_drop(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    _owned(request, ns_id)
    keys = req_entry_keys(header, "keys", store.limits.max_items)
    return _frame_response({"dropped": await request.app[REPLICATOR].drop(ns_id, keys)})


def install(app: web.Application, config: StoreConfig, clock: Callable[[], float] = time.monotonic,
            resolver: DnsResolver | None = None) -> None:
    store = app[STORE]
    membership = Membership(config, resolver, clock)
    replicator = Replicator(store, membership, clock)
    app[MEMBERSHIP] = membership
    app[REPLICATOR] = replicator
    membership.on_change(lambda view: store.metrics.members.set(len(membership.members)))

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
    app.router.add_post("/v1/lookup_report", lookup_report)
    app.router.add_post("/v1/replica/drop", replica_drop)


__all__ = ["MEMBERSHIP", "REPLICATOR", "install"]

"""The store's data-plane routes: every POST body is a frame (protocol/wire.py)::

    POST /v1/namespaces   {namespace}                 -> {ns}
    POST /v1/lookup       {ns, hashes, tokens[, spans, total_tokens], ...} -> LookupAnswer
                          (a lean request that did not carry the stop level: {need_level})
    POST /v1/offer        {ns, items}                 -> {results: [[want|have|rejected, reason]]}
    POST /v1/put          {ns, items, commit} + payloads -> {results: [[status, reason]]}
    POST /v1/commit       {ns, keys}                  -> {results}
    POST /v1/get          {ns, keys[, layers]}        -> {status, sizes, checksums} + payloads
                          (or the older {ns, items}   -> {items: [[status, size, checksum]]} + payloads)
    POST /v1/release      {lease}                     -> {released}

Put bodies are streamed straight into the arena pages the store reserved, and get bodies
streamed out of them (store/sendbody.py), so bulk bytes are never copied into intermediate
Python objects here. A
body that is not in within ``request_timeout_s`` is answered 408 (a put's reserved pages are
freed); a get answer the client does not take within it is cut off (its pins dropped).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from aiohttp import web

from prefixstore.protocol.errors import Problem
from prefixstore.protocol.namespace import Namespace
from prefixstore.transport.stream import FrameReader
from prefixstore.protocol.wire import (
    CONTENT_TYPE,
    LookupRequest,
    WireError,
    encode_header,
    parse_get_items,
    parse_items,
    req_bin,
    req_bool,
    req_entry_keys,
)
from .puts import read_order
from .http import (BODY_SENT, CONTROL_CALLS, LOOKUP_NIXL, PEER, STORE, TENANT, control_header, frame_response, owned, placed,
                   single_node_only, stalled)
from .sendbody import write_body

log = logging.getLogger(__name__)

NAMESPACE_HEADER_BYTES = 16 << 10
"""Most header bytes a namespace registration may carry: a record within protocol/namespace.py's
bounds is under 2 KiB, and the body is refused on its Content-Length before any of it is parsed."""


async def register_namespace(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await control_header(request, NAMESPACE_HEADER_BYTES)
    if "namespace" not in header:
        raise WireError("namespace", "missing")
    ns = Namespace.from_wire(header["namespace"])
    if store.tenants is not None and request[TENANT] == PEER:
        if not store.tenants.has(ns.tenant):
            # A node pushes replicas of tenants' namespaces, never of names no tenants file lists.
            raise WireError("ns", f"no tenant {ns.tenant!r} in this node's tenants file", Problem.FORBIDDEN)
    elif store.tenants is not None and ns.tenant != request[TENANT]:
        raise WireError("ns", f"the namespace's tenant {ns.tenant!r} is not the tenant of this token",
                        Problem.FORBIDDEN)
    return frame_response({"ns": await store.register_namespace(ns)})


def answer_lookup(request: web.Request, header: dict[str, object]) -> dict[str, object]:
    """A lookup's answer (the POST route's and the control channel's, store/control.py)."""
    store = request.app[STORE]
    single_node_only(request, "lookup")
    req = LookupRequest.from_header(header, store.limits, lambda ns_id: owned(request, ns_id).block_tokens)
    answer = store.lookup(req, asyncio.get_running_loop().call_soon)  # its lessons after the answer is sent
    if req.nixl and answer.need_level is None and (extension := request.app.get(LOOKUP_NIXL)) is not None:
        answer = dataclasses.replace(answer, nixl=extension(req, answer))
    return answer.to_header()


async def lookup(request: web.Request) -> web.Response:
    single_node_only(request, "lookup")
    return frame_response(answer_lookup(request, await control_header(request)))


async def offer(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    items = parse_items(header, store.limits)
    placed(request, items)
    results = store.offer(ns_id, items, req_bool(header, "place", default=True))
    return frame_response({"results": [r.to_wire() for r in results]})


async def put(request: web.Request) -> web.Response:
    """Frames a put: the header, then each chunk's payloads into the pages its plan reserved, as the
    store plans it (store/puts.py decides; this reads bytes and answers)."""
    store = request.app[STORE]
    if request.content_length is not None and request.content_length > store.config.max_body_bytes:
        raise WireError("body", f"{request.content_length} bytes exceeds max_body_bytes={store.config.max_body_bytes}",
                        Problem.TOO_LARGE)
    body = FrameReader(request.content)
    # One deadline for the whole body (header and payloads), but not for the
    # commit: cancelling a commit while its LMDB write is in flight would leave
    # the entries half committed, and the commit does not wait on the client.
    deadline = asyncio.get_running_loop().time() + store.config.request_timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            header, header_len = await body.read_header(store.config.max_header_bytes)
    except asyncio.IncompleteReadError:
        raise WireError("frame", "truncated before the end of the header") from None
    except TimeoutError:
        raise stalled(store) from None
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    order = read_order(header, ns_id, header_len, request.content_length, store.limits, store.config.max_body_bytes,
                       from_peer=request[TENANT] == PEER)
    placed(request, order.items)
    await store.room_for(order.items)
    intake = store.intake(order)
    try:
        async with asyncio.timeout_at(deadline):  # a stalled client must not hold its reserved pages
            for plan in intake:  # the next chunk is planned while this one's bytes arrive
                for part in plan.body():  # items in adjacent pages: one view (store/writes.py PutPlan.body)
                    if isinstance(part, int):
                        await body.skip(part)
                    else:
                        await body.readinto([part])
            if not await body.at_eof():
                raise WireError("frame", "bytes follow the last payload the header lists")
    except asyncio.IncompleteReadError:
        intake.abort()
        raise WireError("frame", "body ended before every payload the header lists arrived") from None
    except TimeoutError:
        intake.abort()
        raise stalled(store) from None
    except BaseException:
        intake.abort()
        raise
    store.metrics.transfer_bytes.labels("in", "http").inc(order.payload_bytes)
    # Pushed by a hot entry's owner (store/replication.py): marked as a replica only when it comes
    # from a node (the cluster token; any caller on an open store, whose nodes carry none).
    replicas = store.replica_keys if order.replica and (request[TENANT] == PEER or store.tenants is None) else None
    results = await intake.finish(replicas)
    return frame_response({"results": [r.to_wire() for r in results]})


async def commit(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    keys = req_entry_keys(header, "keys", store.limits.max_items)
    results = await store.commit(ns_id, keys)
    return frame_response({"results": [r.to_wire() for r in results]})


async def get(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    items = parse_get_items(header, store.limits)
    packed = "keys" in header  # answered in the request's form; refusals name the request's fields
    plan = await store.prepare_get(ns_id, items, field="layers" if packed else "items")
    try:
        head = encode_header(plan.answer().to_header(packed=packed))
        payload = plan.payload_bytes
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        response.content_length = len(head) + payload
        await response.prepare(request)
        # From here the answer is on the wire: a failure can no longer be answered, only cut off
        # (an error response written now would land inside this one's body).
        try:
            # A client that stops reading would otherwise keep these entries
            # pinned (never evicted) for as long as it holds the connection.
            async with asyncio.timeout(store.config.request_timeout_s):
                await response.write(head)
                # Adjacent payloads merged (ReadPath.body_views), sent from the arena's pages
                # without the transport's copy where the connection allows (store/sendbody.py).
                request[BODY_SENT] = await write_body(request, response, store.body_views(plan))
                await response.write_eof()
        except TimeoutError:
            log.warning("get: client took the answer off the wire slower than request_timeout_s=%g; disconnected",
                        store.config.request_timeout_s)
            cut_off(request)
            return response
        except OSError as err:  # the client went away mid-answer (reset, broken pipe): nothing left to say
            log.debug("get: the client closed the connection mid-answer (%s: %s)", type(err).__name__, err)
            cut_off(request)
            return response
        except BaseException:
            cut_off(request)
            raise
        store.metrics.transfer_bytes.labels("out", "http").inc(payload)
        return response
    finally:
        store.finish_get(plan)


def cut_off(request: web.Request) -> None:
    """End a connection whose answer was started and cannot be finished: the client sees a
    truncated body (its Content-Length unmet), never another response spliced into it; aiohttp
    then takes the response it is handed as a client that went away."""
    if request.transport is not None:
        request.transport.abort()


async def release(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await control_header(request)
    lease_id = req_bin(header, "lease", size=16)
    return frame_response({"released": store.release(lease_id)})


def install(app: web.Application) -> None:
    app.router.add_post("/v1/namespaces", register_namespace)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_post("/v1/offer", offer)
    app.router.add_post("/v1/put", put)
    app.router.add_post("/v1/commit", commit)
    app.router.add_post("/v1/get", get)
    app.router.add_post("/v1/release", release)
    app[CONTROL_CALLS]["/v1/lookup"] = answer_lookup


__all__ = ["NAMESPACE_HEADER_BYTES", "install"]

"""An HTTP proxy in front of a store that fails some of the connector's loads on purpose (the
``flaky`` side of benchmarks/vllm_serving.py, and tests/vllm's serving test).

Every request is forwarded to the store unchanged, but every ``--fail-every``-th *leased*
lookup (what a vLLM worker sends right before it reads: ``"lease": true``; the scheduler's own
lookups are lease-free) is answered 503 instead: to the engine, the store changed between its
lookup and its load. Those loads fail, and vLLM must recompute the requests and keep serving.

    python benchmarks/_fault_proxy.py --store http://127.0.0.1:8077 --fail-every 2

Prints ``LISTENING <port>`` once it accepts connections; runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal

import aiohttp
from aiohttp import web

from prefixstore.protocol.wire import WireError, decode_frame

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def leased(body: bytes) -> bool:
    """Whether a lookup body asks for a lease (its framed header's ``lease`` field, true by default)."""
    try:
        header, _ = decode_frame(body)
    except (WireError, ValueError):
        return False
    return bool(header.get("lease", True))


def make_app(store: str, fail_every: int) -> web.Application:
    counter = itertools.count(1)
    app = web.Application(client_max_size=1 << 30)
    failed = [0]

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/v1/lookup" and fail_every and leased(body) and next(counter) % fail_every == 0:
            failed[0] += 1
            return web.Response(status=503, text="fault proxy: this load's lookup fails on purpose")
        session: aiohttp.ClientSession = app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with session.request(request.method, store + request.path_qs, data=body, headers=headers) as r:
            payload = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS}
            return web.Response(status=r.status, body=payload, headers=out)

    async def faults(_: web.Request) -> web.Response:
        return web.json_response({"failed_lookups": failed[0]})

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_get("/fault-proxy/faults", faults)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(store: str, fail_every: int) -> None:
    runner = web.AppRunner(make_app(store, fail_every), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"LISTENING {runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--store", required=True, help="The store's URL (every request is forwarded there).")
    p.add_argument("--fail-every", type=int, default=2,
                   help="Answer every N-th leased lookup 503 (0: never). Default: 2.")
    args = p.parse_args()
    asyncio.run(serve(args.store.rstrip("/"), args.fail_every))


if __name__ == "__main__":
    main()

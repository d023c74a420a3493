"""A prefill/decode proxy for vLLM instances that disaggregate through prefixstore.

    python examples/pd_proxy.py --port 8000 --prefill http://p:8100 --decode http://d:8200

The flow of vLLM's own disaggregation examples (``toy_proxy_server.py``): each completion request
goes to a prefill instance (``kv_role: kv_producer``) with ``max_tokens=1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the prefill instance computes the prompt,
saves its KV and state to the store, and answers with ``kv_transfer_params`` saying what it saved;
the same request then goes to a decode instance (``kv_role: kv_consumer``) with those params,
which loads the prompt from the store (waiting, a bounded time, for the prefill's commit) and
generates; its answer is streamed back. Prefill and decode instances may run different
tensor-parallel sizes and block sizes (docs/vllm.md, "Prefill/decode disaggregation").

Several ``--prefill`` / ``--decode`` URLs are taken round robin. Each answer carries the prefill
call's duration in the ``x-prefill-seconds`` header.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator

from aiohttp import ClientSession, ClientTimeout, web

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What the prefill call carries in ``kv_transfer_params`` (the keys vLLM's example sends)."""


async def prefill(session: ClientSession, url: str, path: str, body: dict[str, object]) -> dict[str, object]:
    """The prefill call: the request with one token to generate; returns the prefill instance's
    ``kv_transfer_params`` (empty when it had nothing to hand over: the decode then recomputes)."""
    req = {**body, "kv_transfer_params": dict(PREFILL_PARAMS), "max_tokens": 1, "stream": False}
    req.pop("stream_options", None)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    for key in ("min_tokens", "min_completion_tokens"):  # not for the prefill
        req.pop(key, None)
    async with session.post(url + path, json=req) as resp:
        resp.raise_for_status()
        answer = await resp.json()
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else {}


def decode_body(body: dict[str, object], params: dict[str, object]) -> dict[str, object]:
    """The decode call: the original request with the prefill's ``kv_transfer_params``."""
    return {**body, "kv_transfer_params": params} if params else dict(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--prefill", action="append", required=True,
                        help="a prefill instance's base URL (kv_producer); repeat for several")
    parser.add_argument("--decode", action="append", required=True,
                        help="a decode instance's base URL (kv_consumer); repeat for several")
    args = parser.parse_args()
    prefills: Iterator[str] = itertools.cycle([u.rstrip("/") for u in args.prefill])
    decodes: Iterator[str] = itertools.cycle([u.rstrip("/") for u in args.decode])
    sessions: list[ClientSession] = []

    async def start(app: web.Application) -> None:
        sessions.append(ClientSession(timeout=ClientTimeout(total=None)))

    async def close(app: web.Application) -> None:
        for s in sessions:
            await s.close()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = sessions[0]
        started = time.perf_counter()
        params = await prefill(session, next(prefills), request.path, body)
        prefill_s = time.perf_counter() - started
        async with session.post(next(decodes) + request.path, json=decode_body(body, params)) as resp:
            out = web.StreamResponse(status=resp.status, headers={
                "Content-Type": resp.headers.get("Content-Type", "application/json"),
                "x-prefill-seconds": f"{prefill_s:.6f}"})
            await out.prepare(request)
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)

    web.run_app(app, host=args.host, port=args.port, print=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()

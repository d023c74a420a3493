"""What the machine leaves a process that is neither an engine nor the benchmark's client: a probe
of benchmarks/vllm_serving.py that times one lookup every ``--interval-s`` against its own
``prefixstore serve`` (a store no engine uses) while a side serves, until its standard input
closes, then prints one JSON line: the answered lookups' p50, p99 and largest round trip in
milliseconds, how many took longer than 250 ms (the connector's ``lookup_timeout_s``), and how
many failed (not timed: a store that died answers fast and would look healthy).

Why: the store side's engines wait for a store and a connector thread that share the machine's
cores with the engines. A slow answer there is either the store's own work or the machine's
scheduling of every other process; this probe runs nothing the side runs, so what it sees under
each side (and under vLLM alone, where no store is in the path) is the machine's part. Its own
load is one small lookup per interval over HTTP.

    python benchmarks/_store_probe.py --url http://127.0.0.1:PORT < /dev/null   # one figure, idle
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol.namespace import KVLayout, Namespace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="The probe's own store (no engine uses it).")
    p.add_argument("--interval-s", type=float, default=0.05, help="Pause between lookups (default 0.05 s).")
    p.add_argument("--tokens", type=int, default=1024, help="Tokens per looked-up prompt (default 1,024).")
    p.add_argument("--min-s", type=float, default=2.0,
                   help="Probe at least this long, even if standard input closes earlier (default 2 s).")
    return p.parse_args(argv)


async def probe(args: argparse.Namespace, stop: threading.Event) -> tuple[list[float], int]:
    ns = Namespace(model="serving-probe", block_tokens=16, tenant="bench",
                   kv=KVLayout(num_layers=1, num_heads=1, head_dim=2, dtype="float16"))
    rng = np.random.default_rng(0)
    times: list[float] = []
    failed = 0
    started = time.monotonic()
    async with PrefixClient(ns, ClientConfig(url=args.url, timeout_s=30, data_path="http")) as client:
        await client.lookup(rng.integers(0, 30000, args.tokens).tolist(), lease=False)  # connects, registers: not timed
        while not stop.is_set() or time.monotonic() - started < args.min_s:
            tokens = rng.integers(0, 30000, args.tokens).tolist()
            t = time.perf_counter()
            answer = await client.lookup(tokens, lease=False)
            if answer.ok:
                times.append(time.perf_counter() - t)
            else:  # the probe's store did not answer (died, refused): counted, not timed
                failed += 1
            await asyncio.sleep(args.interval_s)
    return times, failed


def summarize(times: list[float], failed: int = 0) -> dict[str, float | int]:
    ms = np.asarray(times) * 1e3
    if not len(ms):
        return {"n": 0, "failed": failed}
    return {"n": int(len(ms)), "failed": failed, "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 2),
            "over_250ms": int((ms > 250).sum())}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()  # until the benchmark closes it
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(json.dumps(summarize(*asyncio.run(probe(args, stop)))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

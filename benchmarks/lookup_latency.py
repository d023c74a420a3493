"""Prefix-lookup latency, p50 and p99: 1k, 32k and 131k tokens, one node and a 4-node cluster,
idle and under 16 concurrent clients. No peer publishes this figure; this is ours.

Set-up, per topology: ``prefixstore serve`` processes on 127.0.0.1 (real processes, the default
LMDB tier with write-behind, static membership; the 4-node cluster places each prompt's branch by
rendezvous, DESIGN §8), a namespace with 16-token blocks and tiny KV payloads (128 B a block: the
lookup measures the index and the wire, not bytes). Per prompt length it saves one random prompt
in full, then times ``client.lookup(tokens)`` end to end (hashing the prompt, the lean request of
protocol/match.py, the answer, a lease) on:

===========  ==================================================================================
hit          the stored prompt (every block held: the match runs to its end)
miss         a fresh random prompt of the same length (nothing held)
===========  ==================================================================================

``idle``: one client, one lookup at a time. ``16 clients``: 15 more clients in a second process
(each its own connection pool, one lookup in flight each, hits of the same length, in a loop)
while the measured client runs, so 16 lookups are in flight at once. Hit and miss reps are
interleaved (``--whole``: with lookups that carry every token, through a second client;
``--post``: with lookups sent as one POST each, the control channel off). The cluster's lookups go through the cluster client (the walk of DESIGN §8: the
prompt's branch node answers, a report goes to the junction's owner).

The machine has 2 cores: under load the store processes, the load process and the measured
client share them, so the loaded figures show queueing on this machine, not a cluster's capacity.
Writes lookup_latency.json and lookup_latency.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import _harness as H
from _cluster import start_processes, stop_processes
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Namespace

BLOCK_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/lookup_latency.py",
        description="Lookup latency p50/p99 (hit and miss) at several prompt lengths, one node and a cluster,\n"
                    "idle and under concurrent clients. Real serve processes on 127.0.0.1.\n"
                    "Writes lookup_latency.json and lookup_latency.png to --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 32768, 131072],
                   metavar="N,N", help="Prompt lengths in tokens (multiples of 16). Default: 1024,32768,131072.")
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4], metavar="N,N",
                   help="Cluster sizes to run (1: a single node). Default: 1,4.")
    p.add_argument("--concurrency", type=int, default=16,
                   help="Clients with a lookup in flight in the loaded runs, the measured one included. Default: 16.")
    p.add_argument("--whole", action="store_true",
                   help="Also time lookups that carry every token of the prompt (a second client with "
                        "lookup_token_window=None: the request of every client before lean lookups, and on a "
                        "cluster every probe whole), interleaved with the lean ones: kinds hit-whole, miss-whole.")
    p.add_argument("--post", action="store_true",
                   help="Also time lookups sent as one HTTP POST each (a second client with control_channel=False: "
                        "the request of every client before the control channel, and on a cluster every probe), "
                        "interleaved with the others: kinds hit-post, miss-post.")
    p.add_argument("--no-loaded", action="store_true",
                   help="Skip the runs under concurrent clients (idle only).")
    H.add_common_args(p, reps="200 per cell (20 with --quick)", warmup="10 (2 with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = [min(t, 4096) for t in args.tokens]
    args.reps = args.reps or (20 if args.quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    if any(t <= 0 or t % BLOCK_TOKENS for t in args.tokens):
        p.error(f"--tokens: positive multiples of {BLOCK_TOKENS}")
    if any(n < 1 for n in args.nodes):
        p.error("--nodes: at least 1")
    if args.concurrency < 1:
        p.error("--concurrency: at least 1")
    return args


def namespace() -> Namespace:
    return Namespace(model="bench-lookup-latency", block_tokens=BLOCK_TOKENS, tenant="bench",
                     kv=KVLayout(num_layers=1, num_heads=1, head_dim=2, dtype="float16"))


def config(urls: Sequence[str], whole: bool = False, post: bool = False) -> ClientConfig:
    knobs: dict[str, Any] = {"lookup_token_window": None} if whole else {}
    if post:
        knobs["control_channel"] = False
    return ClientConfig(url=urls[0], timeout_s=60, **knobs) if len(urls) == 1 else \
        ClientConfig(urls=tuple(urls), timeout_s=60, **knobs)


def prompt_tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 31, n, dtype=np.uint32)


def load_worker(urls: list[str], tokens: list[int], clients: int, seed: int, stop: Any, ready: Any) -> None:
    """The other clients (a process of their own): ``clients`` lookups of stored prompts in flight, in a loop."""
    async def main() -> None:
        ns = namespace()
        prompts = [prompt_tokens(seed + t, t) for t in tokens]
        async with contextlib.AsyncExitStack() as stack:
            cs = [await stack.enter_async_context(PrefixClient(ns, config(urls))) for _ in range(clients)]

            async def loop(c: PrefixClient, i: int) -> None:
                k = i
                while not stop.is_set():
                    await c.lookup(prompts[k % len(prompts)])
                    k += 1
            for c in cs:  # connect and learn the members before the measured client starts
                await c.lookup(prompts[0])
            ready.set()
            await asyncio.gather(*(loop(c, i) for i, c in enumerate(cs)))
    asyncio.run(main())


async def save_prompts(client: PrefixClient, ns: Namespace, tokens: Sequence[int], seed: int) -> None:
    for t in tokens:
        toks = prompt_tokens(seed + t, t)
        payload = bytes(ns.block_bytes)
        p = client.prompt(toks)
        r = await client.save(p, t, lambda a, b: payload[: ns.kv.payload_bytes(b - a)])
        got = await client.lookup(toks)
        if got.kv_tokens != t:
            raise SystemExit(f"set-up: a lookup of the {t}-token prompt matched {got.kv_tokens} (save: {r})")


async def measure(args: argparse.Namespace, urls: list[str], loaded: bool) -> dict[int, dict[str, H.Samples]]:
    ns = namespace()
    out: dict[int, dict[str, H.Samples]] = {}
    stop = ready = proc = None
    if loaded and args.concurrency > 1:
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        proc = ctx.Process(target=load_worker, args=(urls, list(args.tokens), args.concurrency - 1, args.seed,
                                                     stop, ready), daemon=True)
        proc.start()
        if not await asyncio.to_thread(ready.wait, 120):
            raise SystemExit("load process did not start")
    try:
        async with PrefixClient(ns, config(urls)) as lean, PrefixClient(ns, config(urls, whole=True)) as whole, \
                PrefixClient(ns, config(urls, post=True)) as posts:
            for t in args.tokens:
                hit = prompt_tokens(args.seed + t, t)
                kinds = ["hit", "miss"] + (["hit-whole", "miss-whole"] if args.whole else []) + \
                    (["hit-post", "miss-post"] if args.post else [])
                samples = {k: H.Samples(k) for k in kinds}
                for rep in range(args.warmup + args.reps):
                    miss = prompt_tokens(args.seed * 7919 + rep + 1, t)  # fresh every rep: never stored
                    order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]  # each kind first in turn
                    for kind in order:
                        toks, want = (hit, t) if kind.startswith("hit") else (miss, 0)
                        client = whole if kind.endswith("whole") else posts if kind.endswith("post") else lean
                        start = time.perf_counter()
                        got = await client.lookup(toks)
                        took = time.perf_counter() - start
                        if got.kv_tokens != want:
                            raise SystemExit(f"{kind} lookup of {t} tokens matched {got.kv_tokens}, expected {want}")
                        if rep >= args.warmup:
                            samples[kind].add(took)
                        if got.lease_id is not None:
                            await client.release(got.lease_id)
                out[t] = samples
                H.progress(f"  {len(urls)} node(s), {'loaded' if loaded else 'idle'}, {t} tokens: " + ", ".join(
                    f"{k} p50 {s.median * 1e3:.2f} ms p99 {s.quantile(0.99) * 1e3:.2f} ms" for k, s in samples.items()))
    finally:
        if stop is not None and proc is not None:
            stop.set()
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()
    return out


async def run(args: argparse.Namespace) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for n in args.nodes:
        with tempfile.TemporaryDirectory(prefix="lookup-latency-") as tmp:
            H.progress(f"starting {n} serve process(es)")
            urls, procs = await asyncio.to_thread(start_processes, n, ["--ram-bytes", "256MiB"], Path(tmp),
                                                  "256MiB", "4KiB")
            try:
                async with PrefixClient(namespace(), config(urls)) as setup:
                    await save_prompts(setup, namespace(), args.tokens, args.seed)
                for loaded in (False,) if args.no_loaded else (False, True):
                    got = await measure(args, urls, loaded)
                    for t, samples in got.items():
                        for kind, s in samples.items():
                            rows.append({"nodes": n, "load": f"{args.concurrency} clients" if loaded else "idle",
                                         "tokens": t, "kind": kind, "p50_ms": s.median * 1e3,
                                         "p99_ms": s.quantile(0.99) * 1e3, "n": len(s.values)})
            finally:
                stop_processes(procs)
    return rows


def plot(rows: list[dict[str, Any]], tokens: Sequence[int], path: Path) -> None:
    plt = H.pyplot()
    loads = sorted({r["load"] for r in rows}, key=lambda x: x != "idle")
    nodes = sorted({r["nodes"] for r in rows})
    fig, axes = plt.subplots(1, len(tokens), figsize=(4.2 * len(tokens), 3.8), squeeze=False)
    for ax, t in zip(axes[0], tokens):
        labels, p50, p99 = [], [], []
        for n in nodes:
            for load in loads:
                for kind in ("hit", "miss", "hit-whole", "miss-whole", "hit-post", "miss-post"):
                    r = next((r for r in rows if r["nodes"] == n and r["load"] == load and r["tokens"] == t
                              and r["kind"] == kind), None)
                    if r is None:
                        continue
                    labels.append(f"{n}n {load.replace(' clients', 'c')}\n{kind}")
                    p50.append(r["p50_ms"])
                    p99.append(r["p99_ms"])
        x = np.arange(len(labels))
        ax.bar(x - 0.2, p50, 0.4, label="p50", color="#4c72b0")
        ax.bar(x + 0.2, p99, 0.4, label="p99", color="#dd8452")
        ax.set_xticks(x, labels, fontsize=6)
        ax.set_ylabel("ms")
        ax.set_title(f"lookup of {t:,} tokens", fontsize=9)
        ax.legend(fontsize=7)
    H.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    H.progress(f"lookup latency: tokens {args.tokens}, nodes {args.nodes}, {args.concurrency} clients loaded, "
               f"{args.reps} reps (+{args.warmup} warm-up)")
    rows = asyncio.run(run(args))
    table = H.print_table("Lookup latency, end to end (ms)", ["nodes", "load", "tokens", "kind", "p50 ms", "p99 ms", "n"],
                          [[r["nodes"], r["load"], f"{r['tokens']:,}", r["kind"], r["p50_ms"], r["p99_ms"], r["n"]]
                           for r in rows])
    H.write_json(args.out, "lookup_latency", {"benchmark": "lookup_latency", "argv": sys.argv[1:],
                                              "machine": H.machine_note(), "args": {
        "tokens": args.tokens, "nodes": args.nodes, "concurrency": args.concurrency, "reps": args.reps,
        "warmup": args.warmup, "quick": args.quick, "whole": args.whole, "post": args.post, "no_loaded": args.no_loaded}, "results": rows, "table_markdown": table})
    plot(rows, args.tokens, args.out / "lookup_latency.png")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

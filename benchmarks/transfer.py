"""Batched GET and PUT throughput over HTTP, against a raw-socket loopback transfer of the same bytes.

What it does, per payload size (default 1 MiB and 64 KiB):

1. Builds a namespace whose KV block payload is exactly that size (B=16
   tokens, fp16, head_dim 128; layers x heads chosen to fit), starts a store
   (``--server``: in-process or a child process; LMDB tier in a temp dir by
   default) and a raw bulk server in the same mode.
2. PUTs one batch of ``--batch-bytes`` (default 64 MiB: 64 x 1 MiB or 1024 x
   64 KiB blocks of one chain) and reads it back once, checking the bytes.
3. Times, interleaved rep by rep, the median over ``--reps`` of:

   ==============  ==================================================================
   store GET       ``PrefixClient.read(items, outs)``: one POST /v1/get for the batch,
                   payloads streamed into preallocated buffers, checksums verified
   store PUT       ``PrefixClient.put(items)``: one POST /v1/put of a *fresh* chain
                   (new keys each rep, so every byte is written), checksummed by the
                   client, verified and committed by the store (LMDB write-through)
   raw GET / PUT   the same chunks over one kept-alive socket driven by the event loop
                   (``sock_sendall`` per chunk; ``sock_recv_into`` straight into each
                   output buffer): one kernel copy per side, no framing, no checksums
   streams GET/PUT the same over asyncio streams (bytes per read, then a copy into the
                   buffer), the pattern aiohttp uses; informational
   ==============  ==================================================================

Throughput is payload bytes / wall time of the call, in GB/s (1e9 B/s);
ratios are store / raw (raw = sock_recv_into). The issue's target: GET >= 60%
of raw.

``--profile`` adds a cProfile run of store GETs and PUTs with an in-process
store (both sides in one profile) and writes the top functions to
``transfer_profile_<op>_<size>.txt`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path

import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem, ItemSpec

TARGET_GET_RATIO = 0.60
BLOCK_TOKENS = 16
HEAD_DIM = 128
OPS = ["store_get", "raw_get", "streams_get", "store_put", "raw_put", "streams_put"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/transfer.py",
        description="Batched GET and PUT throughput over HTTP against a raw-socket loopback transfer of\n"
                    "the same bytes in the same chunking, in the same run. Writes transfer.json and\n"
                    "transfer.png to --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--payload-sizes", type=lambda s: [H.parse_size(x) for x in s.split(",")],
                   default=[1 << 20, 64 << 10], metavar="SIZES",
                   help="Comma-separated KV block payload sizes (64KiB, 1MiB, ...; multiples of 8KiB). "
                        "Each gets a namespace whose block_bytes is exactly that size. Default: 1MiB,64KiB.")
    p.add_argument("--batch-bytes", type=H.parse_size, default=64 << 20, metavar="SIZE",
                   help="Payload bytes per GET or PUT call (one HTTP request; batch = this / payload size); "
                        "4MiB with --quick. Default: 64MiB.")
    p.add_argument("--server", choices=["inprocess", "subprocess"], default="subprocess",
                   help="inprocess: store and raw server in this event loop (one core for both sides); "
                        "subprocess: each in a child process (client and server on different cores). "
                        "Default: subprocess.")
    p.add_argument("--tier", choices=["lmdb", "ram"], default="lmdb",
                   help="lmdb: LMDB capacity tier in a temp dir, so PUT commits write through to disk (the "
                        "product default); ram: RAM only, PUT measures the HTTP path alone. Default: lmdb.")
    p.add_argument("--profile", action="store_true",
                   help="Also profile store GETs and PUTs (cProfile, in-process store) and write the top "
                        "functions to --out.")
    p.add_argument("--profile-reps", type=int, default=5, help="Calls per operation in the --profile run. Default: 5.")
    H.add_common_args(p, reps="15 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_bytes = min(args.batch_bytes, 4 << 20)
    args.reps = args.reps or (2 if args.quick else 15)
    args.warmup = args.warmup if args.warmup is not None else 1
    for size in args.payload_sizes:
        if size % (BLOCK_TOKENS * 2 * 2 * HEAD_DIM) or args.batch_bytes % size or args.batch_bytes < size:
            p.error(f"--payload-sizes: {size} must be a multiple of 8KiB dividing --batch-bytes={args.batch_bytes}")
    return args


def make_namespace(payload_bytes: int) -> Namespace:
    """A namespace whose full block (16 tokens, all layers, K and V, fp16) is exactly payload_bytes."""
    per_head_layer = BLOCK_TOKENS * 2 * 2 * HEAD_DIM  # tokens x (K, V) x fp16 x head_dim
    total = payload_bytes // per_head_layer  # num_layers * num_heads
    heads = next(h for h in (8, 4, 2, 1) if total % h == 0 and total // h >= 1)
    ns = Namespace(model=f"bench-transfer-{payload_bytes}", block_tokens=BLOCK_TOKENS, tenant="bench",
                   kv=KVLayout(num_layers=total // heads, num_heads=heads, head_dim=HEAD_DIM, dtype="float16"))
    assert ns.block_bytes == payload_bytes, (ns.block_bytes, payload_bytes)
    return ns


class Chains:
    """Fresh chains of blocks (new token ids, so new keys) with payloads sliced from one source buffer."""

    def __init__(self, client: PrefixClient, num_blocks: int, payload_bytes: int, seed: int) -> None:
        self.client = client
        self.num_blocks = num_blocks
        self.payload_bytes = payload_bytes
        self.rng = np.random.default_rng(seed)
        self.source = self.rng.integers(0, 256, num_blocks * payload_bytes, dtype=np.uint8)
        view = self.source.data
        self.payloads = [view[j * payload_bytes : (j + 1) * payload_bytes] for j in range(num_blocks)]

    def fresh(self) -> list[tuple[ItemSpec, memoryview]]:
        tokens = self.rng.integers(0, 1 << 31, self.num_blocks * BLOCK_TOKENS, dtype=np.uint32)
        prompt = self.client.prompt(tokens)
        specs = [spec for spec, _, _ in prompt.kv_items(prompt.num_tokens)]
        return list(zip(specs, self.payloads))


def ram_bytes_for(total: int) -> int:
    """Arena: the GET set + the PUT batch in flight + the previous one (+ slack). Older PUT
    batches are demoted (lmdb) or deleted (ram) by LRU, never the GET set, which every rep reads."""
    return 3 * total + (16 << 20)


#: Both arenas are sized for recency order (the GET set is always the most recently read);
#: a throughput benchmark must not depend on what a FLOP-aware policy values.
EVICTION = "lru"


async def prepare(client: PrefixClient, size: int, n: int, ram_bytes: int, seed: int
                  ) -> tuple[Chains, list[tuple[ItemSpec, memoryview]], list[float]]:
    """Warm the arena, then store the GET set and check one read-back.

    The arena is fresh anonymous memory: the first write to each of its pages
    takes a page fault, which on this VM runs at ~0.2-1.5 GB/s and would
    dominate any PUT into untouched pages. A long-running store has touched
    its arena long ago, so the measured PUTs must too: the warm-up PUTs cycle
    fresh chains through every page first (their times are kept as the
    cold-arena figure)."""
    chains = Chains(client, n, size, seed)
    cold: list[float] = []
    for _ in range(-(-ram_bytes // (n * size)) + 1):
        batch = chains.fresh()
        t = time.perf_counter()
        res = await client.put(batch)
        cold.append(time.perf_counter() - t)
        if any(r.status != "ok" for r in res):
            raise SystemExit(f"{size}: arena warm-up put failed: {res[:3]} (failures {dict(client.failures)})")
    get_set = chains.fresh()
    res = await client.put(get_set)
    if any(r.status != "ok" for r in res):
        raise SystemExit(f"{size}: set-up put failed: {res[:3]} (failures {dict(client.failures)})")
    return chains, get_set, cold


async def bench_size(size: int, args: argparse.Namespace) -> dict[str, object]:
    ns = make_namespace(size)
    n = args.batch_bytes // size
    total = n * size
    ram_bytes = ram_bytes_for(total)
    page_bytes = min(size, 64 << 10)
    H.progress(f"{size >> 10} KiB: namespace {ns.kv.num_layers} layers x {ns.kv.num_heads} heads x {HEAD_DIM} "
               f"fp16, B={BLOCK_TOKENS} (block_bytes={ns.block_bytes}); batch {n} x {size >> 10} KiB = "
               f"{total / 2**20:.0f} MiB; server={args.server}, tier={args.tier}")
    async with H.serve_store(args.server, ram_bytes=ram_bytes, page_bytes=page_bytes, tier=args.tier,
                             eviction=EVICTION) as rs, \
            H.serve_raw(args.server, "bulk", max_bytes=total) as raw_port, \
            PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120)) as client:
        chains, get_set, cold = await prepare(client, size, n, ram_bytes, args.seed)
        items = [GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec, _ in get_set]
        out_region = np.zeros(total, dtype=np.uint8)
        out_region[:] = 1  # touch every page of the output buffers before timing
        outs = [out_region.data[j * size : (j + 1) * size] for j in range(n)]
        got = await client.read(items, outs)
        if got != [size] * n or not np.array_equal(out_region, chains.source):
            raise SystemExit(f"{size}: read-back failed or returned other bytes (failures {dict(client.failures)})")
        H.progress(f"{size >> 10} KiB: arena warmed by {len(cold)} PUTs (first, into untouched pages: "
                   f"{total / cold[0] / 1e9:.2f} GB/s); GET set stored and read back intact")
        raw = await H.RawClient.connect(raw_port)
        streams = await H.StreamsClient.connect(raw_port)
        samples = {op: H.Samples(op) for op in OPS}
        clock = time.perf_counter
        gc.collect()
        for rep in range(args.warmup + args.reps):
            t = clock()
            await raw.get(outs)
            t_raw_get = clock() - t
            t = clock()
            got = await client.read(items, outs)
            t_get = clock() - t
            t = clock()
            await streams.get(outs)
            t_streams_get = clock() - t
            batch = chains.fresh()
            t = clock()
            await raw.put(chains.payloads)
            t_raw_put = clock() - t
            t = clock()
            res = await client.put(batch)
            t_put = clock() - t
            t = clock()
            await streams.put(chains.payloads)
            t_streams_put = clock() - t
            if got != [size] * n or any(r.status != "ok" for r in res):
                raise SystemExit(f"{size}: a timed GET or PUT failed: read {set(got)}, put "
                                 f"{sorted({r.status for r in res})} (failures {dict(client.failures)})")
            if rs.store is not None:
                store = rs.store
                demoted = sum(1 for spec, _ in get_set
                              if (e := store.entry(ns.id, make_entry_key(Kind.BLOCK, spec.hash))) is None or e.pages is None)
                if demoted:
                    H.progress(f"warning: {demoted} GET entries were demoted to disk (raise ram_bytes)")
            if rep >= args.warmup:
                for op, v in (("raw_get", t_raw_get), ("store_get", t_get), ("streams_get", t_streams_get),
                              ("raw_put", t_raw_put), ("store_put", t_put), ("streams_put", t_streams_put)):
                    samples[op].add(v)
                H.progress(f"{size >> 10} KiB rep {rep - args.warmup + 1}/{args.reps}: "
                           f"GET store {total / t_get / 1e9:.2f} raw {total / t_raw_get / 1e9:.2f} GB/s; "
                           f"PUT store {total / t_put / 1e9:.2f} raw {total / t_raw_put / 1e9:.2f} GB/s")
        raw.close()
        streams.close()
    figures: dict[str, dict[str, float]] = {}
    for op in OPS:
        s = samples[op]
        base = samples["raw_get" if op.endswith("get") else "raw_put"].median
        figures[op] = {"median_gbps": total / s.median / 1e9, "p10_gbps": total / s.quantile(0.9) / 1e9,
                       "p90_gbps": total / s.quantile(0.1) / 1e9, "median_ms": s.median * 1e3,
                       "ratio_to_raw": base / s.median, "n": len(s.values)}
    return {"payload_bytes": size, "batch_items": n, "batch_bytes": total, "server": args.server,
            "tier": args.tier, "ram_bytes": ram_bytes, "page_bytes": page_bytes,
            "namespace": {"num_layers": ns.kv.num_layers, "num_heads": ns.kv.num_heads,
                          "head_dim": HEAD_DIM, "block_tokens": BLOCK_TOKENS},
            "cold_arena_put_gbps": [total / t / 1e9 for t in cold],
            "figures": figures, "target_get_ratio": TARGET_GET_RATIO,
            "target_met": figures["store_get"]["ratio_to_raw"] >= TARGET_GET_RATIO}


async def profile_size(size: int, args: argparse.Namespace) -> dict[str, str]:
    """cProfile of store GETs and PUTs with the store in this process: client and server in one profile."""
    ns = make_namespace(size)
    n = args.batch_bytes // size
    total = n * size
    ram_bytes = ram_bytes_for(total)
    paths: dict[str, str] = {}
    async with H.serve_store("inprocess", ram_bytes=ram_bytes, page_bytes=min(size, 64 << 10), tier=args.tier,
                             eviction=EVICTION) as rs, \
            PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120)) as client:
        chains, get_set, _ = await prepare(client, size, n, ram_bytes, args.seed)
        items = [GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec, _ in get_set]
        outs = [memoryview(bytearray(b"\1" * size)) for _ in range(n)]
        await client.read(items, outs)
        for op in ("get", "put"):
            prof = cProfile.Profile()
            wall = 0.0
            for _ in range(args.profile_reps):
                batch = chains.fresh()
                started = time.perf_counter()
                prof.enable()
                if op == "get":
                    await client.read(items, outs)
                else:
                    await client.put(batch)
                prof.disable()
                wall += time.perf_counter() - started
            text = io.StringIO()
            text.write(f"# store {op.upper()} of {n} x {size} B, {args.profile_reps} calls, in-process store "
                       f"(client + server in one profile), tier={args.tier}, warm arena; "
                       f"{wall / args.profile_reps * 1e3:.1f} ms/call under cProfile\n\n")
            st = pstats.Stats(prof, stream=text)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(30)
            path = args.out / f"transfer_profile_{op}_{size >> 10}KiB.txt"
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text.getvalue())
            prof.dump_stats(str(path.with_suffix(".prof")))
            paths[op] = str(path)
            H.progress(f"profile of {op.upper()} {size >> 10} KiB written to {path}")
    return paths


def plot(results: list[dict[str, object]], path: Path) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    colors = {"store": "#4c72b0", "raw": "#8c8c8c", "streams": "#c4ad66"}
    for ax, op in zip(axes, ("get", "put")):
        width = 0.26
        for i, kind in enumerate(("store", "raw", "streams")):
            xs, ys, lo, hi = [], [], [], []
            for k, r in enumerate(results):
                f = r["figures"][f"{kind}_{op}"]  # type: ignore[index]
                xs.append(k + (i - 1) * width)
                ys.append(f["median_gbps"])
                lo.append(f["median_gbps"] - f["p10_gbps"])
                hi.append(f["p90_gbps"] - f["median_gbps"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[kind],
                   label={"store": "store (HTTP)", "raw": "raw socket", "streams": "asyncio streams"}[kind])
            if kind == "store":
                for x, y, h, r in zip(xs, ys, hi, results):
                    ratio = r["figures"][f"store_{op}"]["ratio_to_raw"]  # type: ignore[index]
                    ax.text(x, y + h, f"{ratio:.0%}", ha="center", va="bottom", fontsize=8, fontweight="bold")
        ax.set_xticks(range(len(results)), [f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}"  # type: ignore[call-overload]
                                            for r in results], fontsize=8)
        ax.set_ylabel("GB/s (median, p10-p90)")
        ax.set_title(f"batched {op.upper()} ({'vs raw; target 60%' if op == 'get' else 'vs raw'})", fontsize=9)
        ax.legend(fontsize=7)
    r0 = results[0]
    fig.suptitle(f"prefixstore transfer throughput (loopback, server={r0['server']}, tier={r0['tier']})",
                 fontsize=10)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.progress(f"transfer benchmark: payloads {[s >> 10 for s in args.payload_sizes]} KiB, batch "
               f"{args.batch_bytes / 2**20:.0f} MiB, {args.reps} reps (+{args.warmup} warm-up), "
               f"server={args.server}, tier={args.tier}")
    results = [await bench_size(size, args) for size in args.payload_sizes]
    rows = []
    for r in results:
        figs = r["figures"]
        assert isinstance(figs, dict)
        for op in OPS:
            f = figs[op]
            rows.append([f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}", op.replace("_", " "),  # type: ignore[call-overload]
                         f["median_gbps"], f["p10_gbps"], f["p90_gbps"], f["median_ms"], f"{f['ratio_to_raw']:.0%}"])
    table = H.print_table(f"Transfer throughput (GB/s = 1e9 B/s, median over reps; server={args.server}, "
                          f"tier={args.tier}; ratio to raw socket)",
                          ["payload x batch", "op", "GB/s", "p10", "p90", "ms/call", "vs raw"], rows)
    for r in results:
        f = r["figures"]["store_get"]  # type: ignore[index]
        print(f"{int(r['payload_bytes']) >> 10} KiB: GET at {f['ratio_to_raw']:.0%} of raw; "  # type: ignore[call-overload]
              f"target >= {TARGET_GET_RATIO:.0%}: {'MET' if r['target_met'] else 'NOT MET'}")
    profiles = {}
    if args.profile:
        for size in args.payload_sizes:
            profiles[str(size)] = await profile_size(size, args)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "transfer.png")
    H.write_json(args.out, "transfer", {
        "benchmark": "transfer", "argv": sys.argv[1:], "machine": H.machine_note(),
        "settings": {"payload_sizes": args.payload_sizes, "batch_bytes": args.batch_bytes, "reps": args.reps,
                     "warmup": args.warmup, "server": args.server, "tier": args.tier, "quick": args.quick},
        "results": results, "profiles": profiles, "table_markdown": table,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

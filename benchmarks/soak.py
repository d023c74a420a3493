"""Soak: many concurrent clients mixing lookups, saves and reads against one store for a fixed time.

What it does:

1. Starts a store in a child process (``--server subprocess``, the default:
   client and server on different cores) with the LMDB tier in a temporary
   directory (``--tier ram`` for RAM only), sized so the working set does not
   fit in RAM: reads come from both tiers and RAM eviction runs throughout.
2. Builds a pool of conversations: ``--systems`` shared system prompts, each
   followed by a user part; every save extends a conversation by a turn (the
   next prompt replays the previous one, as multi-turn chat does).
3. Runs ``--clients`` workers (each with its own ``PrefixClient`` and
   connection pool) for ``--duration-s``. Each picks an operation by the
   weights of ``--mix``:

   ======  ================================================================
   lookup  ``client.lookup(tokens, lease=False)`` of a conversation
   save    ``client.save`` of a conversation's next turn (offer, put, commit)
   read    lookup with a lease, then ``client.read`` of every matched entry
           (the timed part), every byte checked, then ``release``
   ======  ================================================================

   Payloads are a pattern of the entry's own hash, so any read can be checked
   byte by byte whichever writer stored it.
4. Reports per operation: count, ops/s, p50/p99/max latency; and the errors:
   exceptions, client failure counters (the client turns store errors into
   misses and counts them), wrong bytes, and the store's own 5xx counter.
   Zero errors are expected; the exit status is 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol import KVLayout, Namespace, StateLayout
from prefixstore.protocol.wire import GetItem

OPS = ("lookup", "save", "read")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/soak.py",
        description="Soak: concurrent clients mixing lookups, saves and reads against one store for a fixed time;\n"
                    "p50/p99 latency and ops/s per operation, zero errors expected.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=H.DEFAULT_OUT,
                   help="Directory for soak.json and soak.png (created if missing; benchmarks/out/ is git-ignored).")
    p.add_argument("--quick", action="store_true",
                   help="A few-second smoke run (3 s, 4 clients, a small pool). Figures are not meaningful.")
    p.add_argument("--duration-s", type=float, default=None, help="Seconds of load. Default: 60 (3 with --quick).")
    p.add_argument("--clients", type=int, default=None,
                   help="Concurrent clients, each with its own connection pool. Default: 16 (4 with --quick).")
    p.add_argument("--mix", default="6:1:3",
                   help="Relative weights lookup:save:read of the operations each client picks. Default: 6:1:3.")
    p.add_argument("--systems", type=int, default=8, help="Shared system prompts. Default: 8.")
    p.add_argument("--conversations", type=int, default=None,
                   help="Conversations in the pool (each grows by a turn per save). Default: 256 (32 with --quick).")
    p.add_argument("--system-tokens", type=int, default=512, help="Tokens of each system prompt. Default: 512.")
    p.add_argument("--turn-tokens", type=int, default=128,
                   help="Tokens a save adds to a conversation (user + answer). Default: 128.")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="A conversation longer than this restarts from its system prompt. Default: 4096.")
    p.add_argument("--block-tokens", type=int, default=16, help="Store block size B in tokens. Default: 16.")
    p.add_argument("--token-bytes", type=int, default=512,
                   help="KV bytes per token (a small model layout; a 16-token block is 8 KiB). Default: 512.")
    p.add_argument("--ram-bytes", type=int, default=64 << 20,
                   help="RAM arena of the store. Default: 64 MiB (less than the working set: eviction runs).")
    p.add_argument("--disk-bytes", type=int, default=1 << 30, help="LMDB payload budget. Default: 1 GiB.")
    p.add_argument("--tier", choices=("lmdb", "ram"), default="lmdb",
                   help="lmdb: write-through LMDB tier in a temp dir (default); ram: RAM only.")
    p.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess",
                   help="Where the store runs (see benchmarks/_harness.py). Default: subprocess.")
    p.add_argument("--seed", type=int, default=1234, help="Seed of the workload. Default: 1234.")
    args = p.parse_args(argv)
    args.duration_s = args.duration_s if args.duration_s is not None else (3.0 if args.quick else 60.0)
    args.clients = args.clients if args.clients is not None else (4 if args.quick else 16)
    args.conversations = args.conversations if args.conversations is not None else (32 if args.quick else 256)
    weights = [float(x) for x in args.mix.split(":")]
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        p.error(f"--mix: expected three non-negative weights lookup:save:read, got {args.mix!r}")
    args.weights = weights
    if args.token_bytes % 4:
        p.error("--token-bytes: must be a multiple of 4 (float32 elements)")
    return args


def namespace(args: argparse.Namespace) -> Namespace:
    return Namespace(model="bench-soak", kv=KVLayout(num_layers=args.token_bytes // 4, num_heads=1, head_dim=1,
                                                     dtype="float32"),
                     state=StateLayout(), block_tokens=args.block_tokens, tenant="bench")


def pattern(digest: bytes, size: int) -> bytes:
    """The payload of the entry whose hash is ``digest``: checkable by any reader."""
    return (digest * (size // len(digest) + 1))[:size]


@dataclass
class Stats:
    latency: dict[str, H.Samples] = field(default_factory=lambda: {op: H.Samples(op) for op in OPS})
    timeline: list[tuple[float, str, float]] = field(default_factory=list)  # (t since start, op, seconds)
    errors: Counter[str] = field(default_factory=Counter)
    read_bytes: int = 0
    saved_entries: int = 0


class Pool:
    """Conversations: system prompt + turns. Saves extend one; lookups and reads pick one."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.args, self.rng = args, rng
        self.systems = [[rng.randrange(1, 50_000) for _ in range(args.system_tokens)] for _ in range(args.systems)]
        self.convs = [list(self.systems[i % args.systems]) + self._turn() for i in range(args.conversations)]

    def _turn(self) -> list[int]:
        return [self.rng.randrange(1, 50_000) for _ in range(self.args.turn_tokens)]

    def pick(self) -> int:
        # Skewed: a few conversations are hot (recent), most are cold.
        return min(int(self.rng.paretovariate(1.2)) - 1, len(self.convs) - 1) if self.rng.random() < 0.7 \
            else self.rng.randrange(len(self.convs))

    def grow(self, i: int) -> list[int]:
        conv = self.convs[i] + self._turn()
        if len(conv) > self.args.max_tokens:
            conv = list(self.systems[i % self.args.systems]) + self._turn()
        self.convs[i] = conv
        return conv


async def worker(w: int, url: str, ns: Namespace, pool: Pool, args: argparse.Namespace, stats: Stats,
                 start: float, end: float) -> None:
    rng = random.Random(args.seed * 1000 + w)
    client = PrefixClient(ns, ClientConfig(url=url, timeout_s=30.0))
    try:
        while time.perf_counter() < end:
            op = rng.choices(OPS, weights=args.weights)[0]
            try:
                if op == "lookup":
                    tokens = pool.convs[pool.pick()]
                    t0 = time.perf_counter()
                    res = await client.lookup(tokens, lease=False)
                    dt = time.perf_counter() - t0
                    if not res.ok:
                        stats.errors["lookup not ok"] += 1
                elif op == "save":
                    tokens = pool.grow(pool.pick())
                    p = Prompt(ns, tokens)
                    hashes = {(a, b): spec.hash for spec, a, b in p.kv_items(len(tokens))}
                    t0 = time.perf_counter()
                    r = await client.save(p, len(tokens), lambda a, b: pattern(hashes[(a, b)], (b - a) * ns.kv.token_bytes))
                    dt = time.perf_counter() - t0
                    stats.saved_entries += r.stored
                    if r.dropped:
                        stats.errors["save dropped"] += r.dropped
                else:
                    tokens = pool.convs[pool.pick()]
                    res = await client.lookup(tokens, lease=True)
                    if not res.ok:
                        stats.errors["lookup not ok"] += 1
                        continue
                    reads = res.kv_reads(res.kv_tokens)
                    if not reads:
                        await client.release(res.lease_id)
                        continue
                    items: list[GetItem] = [item for item, _, _ in reads]
                    outs = [bytearray(ns.block_bytes) for _ in reads]
                    t0 = time.perf_counter()
                    got = await client.read(items, outs)
                    dt = time.perf_counter() - t0
                    await client.release(res.lease_id)
                    for item, out, n in zip(items, outs, got):
                        if n < 0:
                            stats.errors["leased entry missed on read"] += 1
                        elif bytes(out[:n]) != pattern(item.key[1:], n):
                            stats.errors["wrong bytes"] += 1
                        else:
                            stats.read_bytes += n
            except Exception as err:  # counted and reported; a soak keeps going
                stats.errors[f"{op}: {type(err).__name__}"] += 1
                continue
            stats.latency[op].add(dt)
            stats.timeline.append((t0 - start, op, dt))
        for name, n in client.failures.items():
            stats.errors[f"client failure: {name}"] += n
    finally:
        await client.close()


async def server_5xx(url: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(m.group(1)) for m in re.finditer(r'^prefixstore_requests_total\{[^}]*status="5xx"[^}]*\} (\S+)$',
                                                       text, re.M))


def plot(stats: Stats, duration_s: float, path: Path) -> None:
    plt = H.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    nbins = max(1, int(duration_s))
    for op in OPS:
        per_s = [0] * nbins
        lat: list[list[float]] = [[] for _ in range(nbins)]
        for t, o, dt in stats.timeline:
            if o == op and 0 <= int(t) < nbins:
                per_s[int(t)] += 1
                lat[int(t)].append(dt * 1e3)
        xs = list(range(nbins))
        a.plot(xs, per_s, label=op)
        b.plot(xs, [sorted(v)[min(len(v) - 1, int(0.99 * len(v)))] if v else float("nan") for v in lat], label=op)
    a.set(xlabel="second", ylabel="ops/s", title="throughput per second")
    b.set(xlabel="second", ylabel="p99 latency (ms)", title="p99 latency per second", yscale="log")
    a.legend()
    b.legend()
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ns = namespace(args)
    H.progress(f"soak: {args.clients} clients, {args.duration_s:g} s, mix lookup:save:read = {args.mix}, "
               f"{args.conversations} conversations, {args.server} store ({args.tier})")
    pool = Pool(args, random.Random(args.seed))
    stats = Stats()
    async with H.serve_store(args.server, ram_bytes=args.ram_bytes, page_bytes=ns.block_bytes, tier=args.tier,
                             disk_bytes=args.disk_bytes) as rs:
        # Warm-up (not timed): every conversation saved once, so lookups and reads find something.
        seeder = PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=60.0))
        try:
            for conv in pool.convs:
                p = Prompt(ns, conv)
                hashes = {(a, b): spec.hash for spec, a, b in p.kv_items(len(conv))}
                await seeder.save(p, len(conv), lambda a, b, h=hashes: pattern(h[(a, b)], (b - a) * ns.kv.token_bytes))
        finally:
            await seeder.close()
        H.progress(f"seeded {len(pool.convs)} conversations; load for {args.duration_s:g} s")
        start = time.perf_counter()
        end = start + args.duration_s

        async def report() -> None:
            while time.perf_counter() < end:
                await asyncio.sleep(min(10.0, max(0.5, args.duration_s / 6)))
                n = sum(len(s.values) for s in stats.latency.values())
                H.progress(f"  {time.perf_counter() - start:5.1f} s: {n:,} ops, {sum(stats.errors.values())} errors")

        reporter = asyncio.create_task(report())
        await asyncio.gather(*(worker(w, rs.url, ns, pool, args, stats, start, end) for w in range(args.clients)))
        elapsed = time.perf_counter() - start
        reporter.cancel()
        fivexx = await server_5xx(rs.url)
        lmdb_bytes = rs.lmdb_file_bytes()
    if fivexx:
        stats.errors["server 5xx"] += int(fivexx)

    rows: list[list[object]] = []
    results: list[dict[str, object]] = []
    total = 0
    for op in OPS:
        s = stats.latency[op]
        if not s.values:
            continue
        row = {"op": op, "n": len(s.values), "ops_per_s": len(s.values) / elapsed, "p50_ms": s.quantile(0.5) * 1e3,
               "p99_ms": s.quantile(0.99) * 1e3, "max_ms": max(s.values) * 1e3}
        results.append(row)
        rows.append([op, row["n"], row["ops_per_s"], row["p50_ms"], row["p99_ms"], row["max_ms"]])
        total += len(s.values)
    rows.append(["all", total, total / elapsed, "", "", ""])
    H.print_table(f"Soak: {args.clients} clients for {elapsed:.1f} s (read = the get of every matched entry; "
                  f"{stats.read_bytes / (1 << 20):.0f} MiB read and checked)",
                  ["op", "n", "ops/s", "p50 ms", "p99 ms", "max ms"], rows)
    errors = dict(stats.errors)
    H.progress(f"errors: {sum(errors.values())} {errors if errors else ''}")
    if lmdb_bytes:
        H.progress(f"LMDB file: {lmdb_bytes / (1 << 20):.1f} MiB on disk = {lmdb_bytes / args.disk_bytes:.2f} x "
                   f"disk_bytes ({args.disk_bytes / (1 << 20):.0f} MiB)")
    args.out.mkdir(parents=True, exist_ok=True)
    H.write_json(args.out, "soak", {
        "benchmark": "soak", "argv": sys.argv[1:], "machine": H.machine_note(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "elapsed_s": elapsed, "results": results, "errors": errors, "read_bytes": stats.read_bytes,
        "saved_entries": stats.saved_entries, "lmdb_file_bytes": lmdb_bytes,
        "lmdb_file_over_disk_bytes": lmdb_bytes / args.disk_bytes if lmdb_bytes else None,
    })
    plot(stats, elapsed, args.out / "soak.png")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

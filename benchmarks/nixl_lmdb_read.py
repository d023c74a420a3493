"""NIXL GET of LMDB-resident entries: READ straight out of LMDB's map vs promotion into RAM first.

What it does, in one run, against two store child processes (LMDB tier, NIXL on, LRU eviction,
a RAM arena of exactly one batch) that differ only in ``nixl_map_txns``:

* **map** store (``nixl_map_txns=64``): /v1/nixl/get pins the LMDB values in one read
  transaction, verifies their xxh3 and hands out descriptors into LMDB's registered map; the
  client READs them where they lie. Nothing is copied into the arena.
* **promote** store (``nixl_map_txns=0``, what the store did before): /v1/nixl/get copies each
  value from LMDB into arena pages (xxh3 verified), then hands out arena descriptors.

Per payload size (default 1 MiB and 64 KiB; a KV block of exactly that size, B=16 tokens, fp16,
head_dim 128) each store gets the same ``--sets`` (default 3) GET sets of ``--batch-bytes``
(default 64 MiB) plus one more set put last, which pushes the others out of RAM. Reps are
interleaved (map, promote, map, promote, ...); rep r reads set r mod --sets, so on the promote
store the set read was pushed out of RAM by the sets promoted since (LRU): every timed GET
reads LMDB-resident entries on both stores, which the script checks through the stores' own
counters (``prefixstore_nixl_disk_reads_total{how}``) and refuses to report otherwise. The last
set, RAM-resident on the map store, is also read there: the arena READ as a reference.

Every GET is ``PrefixClient.read`` with ``data_path="nixl"`` into one output region registered
once, xxh3 of every payload verified by the client, the lease released. Throughput is payload
bytes / wall time of the call in GB/s (1e9 B/s), median over ``--reps``. The LMDB files are in a
temporary directory, so their pages sit in the OS page cache: this measures the copy the store
makes, not the disk.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

import _harness as H
import nixl_transfer as NT
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem

BLOCK_TOKENS = NT.BLOCK_TOKENS
OPS = ["map", "promote", "ram"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/nixl_lmdb_read.py",
        description="NIXL GET of LMDB-resident entries: READ straight out of LMDB's memory map (store with\n"
                    "nixl_map_txns=64) vs promotion into the RAM arena first (store with nixl_map_txns=0),\n"
                    "two store child processes in one run, reps interleaved. Writes nixl_lmdb_read.json and\n"
                    "nixl_lmdb_read.png to --out. Needs nixl (pip install nixl).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    NT.add_batch_args(p, "Payload bytes per GET call (batch = this / payload size)")
    p.add_argument("--sets", type=int, default=3,
                   help="GET sets per payload size, read in turn (at least 2: a set is read again only "
                        "after another was promoted, which pushes it out of the promote store's RAM). "
                        "Default: 3.")
    H.add_common_args(p, reps="9 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    NT.finish_batch_args(p, args)
    if args.sets < 2:
        p.error("--sets: at least 2")
    return args


def make_namespace(payload_bytes: int) -> Namespace:
    return NT.make_namespace(payload_bytes, model="bench-lmdb-read")


async def disk_reads(url: str) -> dict[str, float]:
    """The store's prefixstore_nixl_disk_reads_total by how (map, promoted)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {how: float(v) for how, v in re.findall(r'^prefixstore_nixl_disk_reads_total\{how="(\w+)"\} (\S+)$',
                                                     text, re.MULTILINE)}


class Sets:
    """``count`` GET sets plus one pushing set, the same bytes put into both stores."""

    def __init__(self, ns: Namespace, size: int, n: int, count: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.size, self.n = size, n
        self.source = rng.integers(0, 256, (count + 1) * n * size, dtype=np.uint8)
        self.tokens = [rng.integers(0, 1 << 31, n * BLOCK_TOKENS, dtype=np.uint32) for _ in range(count + 1)]

    def payloads(self, k: int) -> list[memoryview]:
        base = k * self.n * self.size
        return [self.source.data[base + j * self.size : base + (j + 1) * self.size] for j in range(self.n)]

    def expected(self, k: int) -> np.ndarray:
        return self.source[k * self.n * self.size : (k + 1) * self.n * self.size]


async def load(client: PrefixClient, sets: Sets) -> list[list[GetItem]]:
    """Put every set (the pushing one last); the GET items of each."""
    items = []
    for k, toks in enumerate(sets.tokens):
        prompt = client.prompt(toks)
        specs = [spec for spec, _, _ in prompt.kv_items(prompt.num_tokens)]
        results = await client.put(list(zip(specs, sets.payloads(k))))
        if any(r.status != "ok" for r in results):
            raise SystemExit(f"set-up put failed: {[r.status for r in results][:4]} ({dict(client.failures)})")
        items.append([GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec in specs])
    return items


async def bench_size(urls: dict[str, str], size: int, args: argparse.Namespace) -> dict[str, object]:
    ns = make_namespace(size)
    n = args.batch_bytes // size
    total = n * size
    H.progress(f"{size >> 10} KiB: {n} x {size >> 10} KiB = {total / 2**20:.0f} MiB a batch, {args.sets} sets + 1")
    sets = Sets(ns, size, n, args.sets, args.seed + size)
    async with PrefixClient(ns, ClientConfig(url=urls["map"], timeout_s=120, data_path="nixl")) as on_map, \
            PrefixClient(ns, ClientConfig(url=urls["promote"], timeout_s=120, data_path="nixl")) as promote:
        clients = {"map": on_map, "promote": promote}
        items = {}
        for name, client in clients.items():
            H.progress(f"{size >> 10} KiB: putting {args.sets + 1} sets into the {name} store")
            items[name] = await load(client, sets)
        out_region = np.zeros(total, dtype=np.uint8)
        outs = [out_region.data[j * size : (j + 1) * size] for j in range(n)]
        for client in clients.values():
            client.register_buffer(out_region)
        samples = {op: H.Samples(op) for op in OPS}
        clock = time.perf_counter
        gc.collect()
        for rep in range(args.warmup + args.reps):
            k = rep % args.sets
            times = {}
            for op, name, which in (("map", "map", k), ("promote", "promote", k), ("ram", "map", args.sets)):
                before = await disk_reads(urls[name])
                out_region[:] = 0
                t = clock()
                got = await clients[name].read(items[name][which], outs)
                times[op] = clock() - t
                after = await disk_reads(urls[name])
                if got != [size] * n or not np.array_equal(out_region, sets.expected(which)):
                    raise SystemExit(f"{size}: {op} GET failed ({dict(clients[name].failures)})")
                delta = {how: after.get(how, 0) - before.get(how, 0) for how in ("map", "promoted")}
                want = {"map": {"map": n, "promoted": 0}, "promote": {"map": 0, "promoted": n},
                        "ram": {"map": 0, "promoted": 0}}[op]
                if delta != want:
                    raise SystemExit(f"{size}: the {op} GET did not read what it should (disk reads {delta}, "
                                     f"expected {want}): the set was not where the benchmark assumes")
            if rep >= args.warmup:
                for op, v in times.items():
                    samples[op].add(v)
                H.progress(f"{size >> 10} KiB rep {rep - args.warmup + 1}/{args.reps}: map "
                           f"{total / times['map'] / 1e9:.2f}, promote {total / times['promote'] / 1e9:.2f}, "
                           f"RAM {total / times['ram'] / 1e9:.2f} GB/s")
        for name, client in clients.items():
            if client.path_bytes["http"] or client.failures:
                raise SystemExit(f"the {name} client used HTTP ({client.path_bytes['http']} bytes, "
                                 f"{dict(client.failures)})")
    figures = {op: {"median_gbps": total / s.median / 1e9, "p10_gbps": total / s.quantile(0.9) / 1e9,
                    "p90_gbps": total / s.quantile(0.1) / 1e9, "median_ms": s.median * 1e3, "n": len(s.values)}
               for op, s in samples.items()}
    # Throughput ratios (a time ratio inverted): map READ GB/s over promotion's, and over the arena's.
    ratios = {"map_to_promote": samples["promote"].median / samples["map"].median,
              "map_to_ram": samples["ram"].median / samples["map"].median}
    return {"payload_bytes": size, "batch_items": n, "batch_bytes": total, "figures": figures, "ratios": ratios}


def plot(results: list[dict[str, object]], path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    colors = {"map": "#4c72b0", "promote": "#c44e52", "ram": "#8c8c8c"}
    labels = {"map": "LMDB-resident: READ from LMDB's map", "promote": "LMDB-resident: promoted into RAM first",
              "ram": "RAM-resident (reference)"}
    width = 0.8 / len(OPS)
    for i, op in enumerate(OPS):
        xs, ys, lo, hi = [], [], [], []
        for k, r in enumerate(results):
            f = r["figures"][op]  # type: ignore[index]
            xs.append(k + (i - (len(OPS) - 1) / 2) * width)
            ys.append(f["median_gbps"])
            lo.append(f["median_gbps"] - f["p10_gbps"])
            hi.append(f["p90_gbps"] - f["median_gbps"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[op], label=labels[op])
        if op == "map":
            for x, y, h, r in zip(xs, ys, hi, results):
                ax.text(x, y + h, f"{r['ratios']['map_to_promote']:.2f}x\npromote",  # type: ignore[index]
                        ha="center", va="bottom", fontsize=7, fontweight="bold")
    ax.set_xticks(range(len(results)), [f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}"  # type: ignore[call-overload]
                                        for r in results], fontsize=8)
    ax.set_ylabel("GB/s (median, p10-p90)")
    ax.set_title("NIXL GET of LMDB-resident entries (UCX over loopback, CPU only, stores in child processes)",
                 fontsize=9)
    ax.legend(fontsize=7)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("UCX_MODULES", "^ib")
    note = H.machine_note()
    H.progress(f"machine: {note}")
    ram = args.batch_bytes  # one batch: the last set put pushes every other out; a promoted set, the one before
    results: list[dict[str, object]] = []
    common = {"ram_bytes": ram, "page_bytes": 64 << 10, "tier": "lmdb", "eviction": "lru", "nixl": "on"}
    async with H.serve_store("subprocess", nixl_map_txns=64, **common) as on_map, \
            H.serve_store("subprocess", nixl_map_txns=0, **common) as promote:
        H.progress(f"stores: map {on_map.url}, promote {promote.url} (ram={ram >> 20} MiB each, LMDB, nixl=on)")
        for size in args.payload_sizes:
            results.append(await bench_size({"map": on_map.url, "promote": promote.url}, size, args))
    rows = [[f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}",  # type: ignore[call-overload]
             r["figures"]["map"]["median_gbps"], r["figures"]["promote"]["median_gbps"],  # type: ignore[index]
             f"{r['ratios']['map_to_promote']:.2f}x", r["figures"]["ram"]["median_gbps"],  # type: ignore[index]
             f"{r['ratios']['map_to_ram']:.0%}"]  # type: ignore[index]
            for r in results]
    H.print_table("NIXL GET of LMDB-resident entries, GB/s (median)",
                  ["batch", "map READ", "promoted", "map/promoted", "RAM-resident", "map/RAM"], rows)
    payload = {"benchmark": "nixl_lmdb_read", "argv": sys.argv[1:], "machine": note, "reps": args.reps,
               "sets": args.sets, "results": results}
    H.write_json(args.out, "nixl_lmdb_read", payload)
    plot(results, args.out / "nixl_lmdb_read.png")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

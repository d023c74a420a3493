"""LMDB's own write options, measured on the write-behind's transaction shape (not assumed).

One transaction puts ``--txn-bytes`` (64 MiB, store/behind.py's TXN_BYTES) of values of one size
(1 MiB and 64 KiB) under random 26-byte keys (the store's keys are hashes), into two named
databases like store/lmdb_tier.py (payload + a small record), in a fresh environment per
variant; variants interleaved rep by rep, median GB/s of payload bytes:

=================  ======================================================================
default            what the tier opens today: sync=False, metasync=False, readahead=False
writemap           + writemap=True (writes go straight into the shared map: no malloc'd
                   dirty pages copied at commit)
writemap+async     + map_async=True (with sync=False it changes nothing LMDB does at commit)
append (sorted)    default, keys sorted within the transaction and put with append=True
                   where they sort after everything stored: the store's keys are hashes, so
                   this only applies to a transaction's own keys; shown as an upper bound
=================  ======================================================================

``python benchmarks/lmdb_options.py`` (writes lmdb_options.json and lmdb_options.png to --out).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import lmdb
import numpy as np

import _harness as H

VARIANTS = {
    "default": {},
    "writemap": {"writemap": True},
    "writemap+async": {"writemap": True, "map_async": True},
    "append (sorted)": {},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/lmdb_options.py",
                                description="LMDB write options on the write-behind's transaction shape.")
    p.add_argument("--value-sizes", type=lambda s: [H.parse_size(x) for x in s.split(",")],
                   default=[1 << 20, 64 << 10], metavar="SIZES", help="Value sizes. Default: 1MiB,64KiB.")
    p.add_argument("--txn-bytes", type=H.parse_size, default=64 << 20, metavar="SIZE",
                   help="Payload bytes per transaction. Default: 64MiB (8MiB with --quick).")
    p.add_argument("--txns", type=int, default=4, help="Transactions per rep (the map fills as it would). Default: 4.")
    H.add_common_args(p, reps="5 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    if args.quick:
        args.txn_bytes = min(args.txn_bytes, 8 << 20)
    args.reps = args.reps or (2 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else 1
    return args


def run(variant: str, size: int, args: argparse.Namespace, payload: memoryview, rng: np.random.Generator) -> float:
    """Seconds for ``args.txns`` transactions in a fresh environment."""
    d = tempfile.mkdtemp(prefix="lmdb-options-")
    try:
        env = lmdb.open(d, map_size=4 * args.txns * args.txn_bytes + (256 << 20), max_dbs=4, sync=False,
                        metasync=False, readahead=False, **VARIANTS[variant])
        payloads, entries = env.open_db(b"payloads"), env.open_db(b"entries")
        n = args.txn_bytes // size
        record = b"r" * 160
        total = 0.0
        append = variant.startswith("append")
        for i in range(args.txns):
            # append: every key after every stored one (a counter byte, then sorted), which hashes
            # never are: an upper bound of what MDB_APPEND could give.
            keys = [bytes([2, i]) + rng.bytes(24) if append else bytes([2]) + rng.bytes(25) for _ in range(n)]
            if append:
                keys.sort()
            t = time.perf_counter()
            with env.begin(write=True) as txn:
                for j, k in enumerate(keys):
                    txn.put(k, payload[(j % 4) * size : (j % 4 + 1) * size], db=payloads, append=append)
                    txn.put(k, record, db=entries, append=append)
            total += time.perf_counter() - t
        env.close()
        return total
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    rows, results = [], []
    for size in args.value_sizes:
        payload = memoryview(rng.integers(0, 256, 4 * size, dtype=np.uint8).tobytes())
        samples = {v: H.Samples(v) for v in VARIANTS}
        for rep in range(args.warmup + args.reps):
            order = list(VARIANTS)[rep % len(VARIANTS):] + list(VARIANTS)[: rep % len(VARIANTS)]
            for v in order:
                s = run(v, size, args, payload, rng)
                if rep >= args.warmup:
                    samples[v].add(s)
            H.progress(f"{size >> 10} KiB rep {rep + 1}/{args.warmup + args.reps}")
        base = samples["default"].median
        for v, s in samples.items():
            gbps = args.txns * args.txn_bytes / s.median / 1e9
            rows.append([f"{size >> 10} KiB", v, gbps, f"{base / s.median:.2f}x"])
            results.append({"value_bytes": size, "variant": v, "median_gbps": gbps, "vs_default": base / s.median})
    table = H.print_table(f"LMDB write transactions of {args.txn_bytes >> 20} MiB (GB/s of payload, median)",
                          ["values", "variant", "GB/s", "vs default"], rows)
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    sizes = args.value_sizes
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        ys = [r["median_gbps"] for r in results if r["variant"] == v]
        ax.bar([k + (i - (len(VARIANTS) - 1) / 2) * width for k in range(len(sizes))], ys, width, label=v)
    ax.set_xticks(range(len(sizes)), [f"{s >> 10} KiB values" for s in sizes], fontsize=8)
    ax.set_ylabel("GB/s of payload (median)")
    ax.set_title(f"LMDB write transactions of {args.txn_bytes >> 20} MiB", fontsize=9)
    ax.legend(fontsize=7)
    args.out.mkdir(parents=True, exist_ok=True)
    H.save_figure(fig, args.out / "lmdb_options.png")
    H.write_json(args.out, "lmdb_options", {"benchmark": "lmdb_options", "argv": sys.argv[1:],
                                            "machine": H.machine_note(), "results": results,
                                            "table_markdown": table, "lmdb_version": lmdb.version()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

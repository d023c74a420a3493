"""What copying values out of the LMDB tier costs when their pages are let go, or kept mapped.

The tier copies every value it reads out of LMDB's memory map (a promotion into the arena, or a
read buffer). Mapped file pages count in the process's RSS, so every 64 MiB copied out the tier
drops its mapping of the whole map (store/lmdb_tier.py ``LmdbTier.let_go``): RSS then does not
grow with every value ever read. The data stays in the page cache; a later read maps it again, a
minor fault per page. This measures that cost where it is largest -- the same values read again
and again, which a store does only when it cannot promote them -- in three variants:

=====================  ==================================================================
kept mapped            nothing let go (before issue 30)
let go every 64 MiB    what the tier does
let go every value     a madvise per read (the alternative rejected: a TLB shootdown each)
=====================  ==================================================================

* per value size (``--sizes``), ``--values`` values written to a fresh tier;
* per rep, each variant reads every value twice through the tier's ``read_into`` (checksum
  verified, as the store reads); the second pass is timed;
* variants interleaved rep by rep; medians over ``--reps``; the process's file-backed RSS after
  each variant's pass.

``python benchmarks/lmdb_reads.py`` (writes lmdb_reads.json and lmdb_reads.png to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import xxhash

import _harness as H
from prefixstore.store import lmdb_tier
from prefixstore.store.lmdb_tier import LmdbTier, StoredRecord

MIB = 1 << 20
VARIANTS = {"kept mapped": 1 << 62, "let go every 64 MiB": lmdb_tier.UNMAP_EVERY_BYTES, "let go every value": 1}


def rss_file() -> int:
    m = re.search(r"^RssFile:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) << 10 if m else 0


async def measure(size: int, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    tier = LmdbTier(tmp / f"lmdb-{size}", disk_bytes=2 * size * args.values + (64 << 20))
    try:
        values = [os.urandom(size) for _ in range(args.values)]
        keys = [bytes([1]) + bytes(8) + i.to_bytes(16, "little") for i in range(args.values)]
        sums = [xxhash.xxh3_64_intdigest(v) for v in values]
        records = [StoredRecord(key=k, namespace_id=bytes(8), parent=None, start=0, tokens=b"", extra=b"",
                                container=None, boundary=0, size=size, checksum=c) for k, c in zip(keys, sums)]
        await tier.write([(r, [memoryview(v)]) for r, v in zip(records, values)], [])
        dest = [memoryview(bytearray(size))]
        per_read: dict[str, list[float]] = {v: [] for v in VARIANTS}
        file_bytes: dict[str, list[int]] = {v: [] for v in VARIANTS}
        for rep in range(args.warmup + args.reps):
            for variant in VARIANTS:
                lmdb_tier.UNMAP_EVERY_BYTES = VARIANTS[variant]  # read by the tier at each read
                for timed in (False, True):
                    t = time.perf_counter()
                    for k, c in zip(keys, sums):
                        if await tier.read_into(k, size, c, dest) != "ok":
                            raise SystemExit(f"value {k.hex()} did not read back")
                    if timed and rep >= args.warmup:
                        per_read[variant].append((time.perf_counter() - t) / len(keys))
                        file_bytes[variant].append(rss_file())
        lmdb_tier.UNMAP_EVERY_BYTES = VARIANTS["let go every 64 MiB"]
    finally:
        tier.close()
    out: dict[str, object] = {"size_bytes": size, "values": args.values}
    for variant in VARIANTS:
        out[variant] = {"us_per_read": statistics.median(per_read[variant]) * 1e6,
                        "rss_file_mib": statistics.median(file_bytes[variant]) / MIB}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/lmdb_reads.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64KiB,1MiB", help="Value sizes, comma-separated. Default: 64KiB,1MiB.")
    p.add_argument("--values", type=int, default=128, help="Values per size. Default: 128.")
    H.add_common_args(p, reps="15", warmup="2")
    args = p.parse_args(argv)
    if args.quick:
        args.values, args.reps, args.warmup = 16, 3, 1
    args.reps = args.reps or 15
    args.warmup = 2 if args.warmup is None else args.warmup
    sizes = [H.parse_size(s) for s in args.sizes.split(",") if s]
    results = []
    with tempfile.TemporaryDirectory(prefix="prefixstore-lmdb-reads-") as tmp:
        for size in sizes:
            H.progress(f"{size} B values: {args.values} of them, {args.reps} reps")
            results.append(asyncio.run(measure(size, args, Path(tmp))))
    rows = []
    for r in results:
        size = r["size_bytes"]
        assert isinstance(size, int)
        kept = r["kept mapped"]
        assert isinstance(kept, dict)
        for variant in VARIANTS:
            v = r[variant]
            assert isinstance(v, dict)
            rows.append([f"{size >> 10} KiB", variant, v["us_per_read"], v["us_per_read"] / kept["us_per_read"],
                         v["rss_file_mib"]])
    H.print_table("a value read again out of LMDB, through the tier's read_into (median us per read)",
                  ["value", "pages", "us per read", "/ kept mapped", "RssFile MiB after"], rows)
    H.write_json(args.out, "lmdb_reads", {"benchmark": "lmdb_reads", "machine": H.machine_note(),
                                          "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                          "results": results})
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(results))
    for j, variant in enumerate(VARIANTS):
        ax.bar([x + (j - 1) * 0.27 for x in xs], [r[variant]["us_per_read"] for r in results], 0.27,  # type: ignore[index]
               label=variant)
    ax.set_xticks(list(xs), [f"{r['size_bytes'] >> 10} KiB" for r in results])  # type: ignore[operator]
    ax.set_ylabel("us per read (median)")
    ax.set_title("re-reading a value out of LMDB's map")
    ax.legend(fontsize=8)
    H.save_figure(fig, args.out / "lmdb_reads.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

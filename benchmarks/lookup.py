"""Lookup latency of a long prompt: client hashing, round trip, server time, vs a raw echo.

What it does, per store block size B (default 16 and 256):

1. Starts a store in-process (aiohttp AppRunner + TCPSite on 127.0.0.1, LMDB
   tier in a temporary directory) and a raw asyncio echo server in the same
   event loop.
2. Saves the KV of the first ``--stored-tokens`` tokens of a random prompt
   (a tiny KV layout, 8 bytes/token, so set-up takes seconds) plus
   ``--snapshots`` state snapshots at boundaries inside it.
3. Looks up a ``--tokens``-token prompt that agrees with the stored one for
   exactly ``--stored-tokens`` tokens, then diverges; checks the answer
   (kv_tokens, state_tokens) before timing anything.
4. Times, interleaved rep by rep, the median over ``--reps`` of:

   ========================  ===============================================================
   hash (uint32 array)       ``Prompt(ns, np.ndarray[uint32])``: pack + block hash chain
   hash (list[int])          the same from a Python list (np.asarray of the list dominates)
   client encode             joining the hashes and msgpack-encoding the lookup frame
   server parse              decode_frame + LookupRequest.from_header (the handler's parse)
   server Store.lookup       ``Store.lookup(req)`` called directly (index match + lease)
   server encode             encode_frame of the answer
   round trip                ``await client.lookup(prompt)`` with a prebuilt Prompt
   end-to-end                ``await client.lookup(tokens)``: hashing + round trip
   raw echo                  same request/response body sizes over a raw asyncio socket
   ========================  ===============================================================

   The middleware's latency histogram (``prefixstore_request_duration_seconds``)
   gives the mean server-side handler time as a cross-check.

Ratios are to the raw echo of the same byte sizes in the same run. The
issue's target: end-to-end under 5 ms at B=16.

Everything runs in one event loop (one thread): a round trip is client CPU +
server CPU + the loopback stack, with no cross-process wake-up. That is what
lets Store.lookup be timed on the very store that answers the HTTP requests.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol import KVLayout, Namespace, StateLayout
from prefixstore.protocol.wire import LookupRequest, decode_frame, encode_frame, encode_header

TARGET_E2E_MS = 5.0

ROWS = [
    ("hash_array", "hash (uint32 array)"),
    ("hash_list", "hash (list[int])"),
    ("client_encode", "client encode"),
    ("server_parse", "server parse"),
    ("server_lookup", "server Store.lookup"),
    ("server_encode", "server encode"),
    ("round_trip", "round trip"),
    ("end_to_end", "end-to-end"),
    ("echo", "raw echo"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/lookup.py",
        description="Lookup latency of a long prompt (hashing, round trip, server time) against a raw\n"
                    "asyncio echo of the same byte sizes, in the same run. The store runs in-process\n"
                    "(aiohttp AppRunner/TCPSite on 127.0.0.1). Writes lookup.json and lookup.png to --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072, help="Tokens in the looked-up prompt; 16384 with --quick. Default: 131072.")
    p.add_argument("--stored-tokens", type=int, default=None,
                   help="Tokens of the prompt whose KV is stored before timing (the match length). "
                        "Default: tokens - tokens/128 + 3 (~99%% of the prompt, ending mid-block at both B).")
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 256], metavar="B,B",
                   help="Comma-separated store block sizes (tokens per block); one namespace and store each. "
                        "Default: 16,256.")
    p.add_argument("--snapshots", type=int, default=4,
                   help="State snapshots stored at evenly spaced boundaries inside the stored prefix. Default: 4.")
    p.add_argument("--tier", choices=["lmdb", "ram"], default="lmdb",
                   help="lmdb: LMDB capacity tier in a temp dir (the product default); ram: RAM only. Default: lmdb.")
    H.add_common_args(p, reps="300 (5 with --quick)", warmup="20 (2 with --quick)")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens = min(args.tokens, 16384)
    args.reps = args.reps or (5 if args.quick else 300)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 20)
    if args.stored_tokens is None:
        args.stored_tokens = args.tokens - args.tokens // 128 + 3
    if not 0 < args.stored_tokens <= args.tokens:
        p.error("--stored-tokens must be in [1, --tokens]")
    return args


def make_namespace(block_tokens: int) -> Namespace:
    """1 attention layer x 1 head x 2 dims fp16 (8 B/token: K and V); one 8x8 fp16 state (128 B)."""
    return Namespace(model="bench-lookup", kv=KVLayout(num_layers=1, num_heads=1, head_dim=2, dtype="float16"),
                     state=StateLayout(num_layers=1, shapes=((8, 8),), dtype="float16"),
                     block_tokens=block_tokens, tenant="bench")


async def bench_block_size(B: int, args: argparse.Namespace, tokens: np.ndarray) -> dict[str, object]:
    ns = make_namespace(B)
    S, N = args.stored_tokens, args.tokens
    # One page per block: blocks, tails and snapshots each take ceil(size / page) pages.
    page_bytes = max(ns.block_bytes, ns.state.snapshot_bytes)
    ram_bytes = (S // B + args.snapshots + 64) * page_bytes * 2
    boundaries = sorted({max(1, S * (k + 1) // (args.snapshots + 1) - 7) for k in range(args.snapshots)})
    rng = np.random.default_rng(args.seed + B)
    async with H.serve_store("inprocess", ram_bytes=ram_bytes, page_bytes=page_bytes, tier=args.tier) as rs, \
            PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120)) as client:
        store = rs.store
        assert store is not None
        # ---- set-up: save KV of [0, S) and the snapshots
        started = time.perf_counter()
        kv = rng.integers(0, 256, S * ns.kv.token_bytes, dtype=np.uint8)
        tb = ns.kv.token_bytes
        snap = rng.integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8)
        stored_prompt = client.prompt(tokens[:S])
        # Saved in segments of at most max_items blocks: one save() of more items than
        # ClientConfig.max_items splits its *offer* into batches, and a later batch's first
        # block is rejected "parent not stored" (its parent was only offered, not yet put).
        # See docs/benchmarks.md, "Findings".
        seg_tokens = (client.config.max_items - 1) * B
        num_stored = 0
        for start in range(0, S, seg_tokens):
            end = min(S, start + seg_tokens)
            snaps = {t: snap for t in boundaries} if end == S else None
            saved = await client.save(stored_prompt, end, lambda a, b: kv[a * tb : b * tb], snaps, start=start)
            num_stored += saved.stored
            if saved.rejected or saved.dropped or client.failures:
                raise SystemExit(f"B={B}: set-up save of [{start}, {end}) rejected {saved.rejected}, dropped "
                                 f"{saved.dropped} (failures {dict(client.failures)}): {saved.results[:3]}")
        expected = S // B + (1 if S % B else 0) + len(boundaries)
        if num_stored != expected:
            raise SystemExit(f"B={B}: set-up stored {num_stored} entries, expected {expected}")
        H.progress(f"B={B}: stored {num_stored} entries ({S} tokens, {len(boundaries)} snapshots) "
                   f"in {time.perf_counter() - started:.1f}s")

        # ---- the looked-up prompt: agrees with the stored one for exactly S tokens
        lookup_tokens = tokens.copy()
        if S < N:
            lookup_tokens[S] = (int(tokens[S]) + 1) % 50000  # diverge right at S
        token_list = lookup_tokens.tolist()
        prompt = client.prompt(lookup_tokens)
        res = await client.lookup(prompt)
        if not res.ok or res.kv_tokens != S or res.state_tokens != boundaries[-1]:
            raise SystemExit(f"B={B}: lookup answered kv_tokens={res.kv_tokens} state_tokens={res.state_tokens}, "
                             f"expected {S} and {boundaries[-1]} (ok={res.ok})")
        H.progress(f"B={B}: lookup verified: kv_tokens={res.kv_tokens} state_tokens={res.state_tokens} "
                   f"checkpoint_hint={res.checkpoint_hint}")

        # ---- the exact bytes on the wire, for the echo baseline and the server-side timings
        req = LookupRequest(namespace_id=ns.id, hashes=b"".join(prompt.hashes), tokens=prompt.packed,
                            lease=client.config.lease)
        req_body = encode_header(req.to_header())
        header, _ = decode_frame(req_body)
        parsed = LookupRequest.from_header(header, store.limits, lambda ns_id: store.namespace(ns_id).block_tokens)
        answer_body = encode_frame(store.lookup(parsed).to_header())
        H.progress(f"B={B}: request body {len(req_body):,} B ({len(prompt.hashes):,} hashes + {N:,} tokens), "
                   f"answer body {len(answer_body):,} B")

        samples = {key: H.Samples(key) for key, _ in ROWS}
        hist = store.metrics.registry
        labels = {"endpoint": "/v1/lookup"}

        def hist_reading() -> tuple[float, float]:
            return (hist.get_sample_value("prefixstore_request_duration_seconds_sum", labels) or 0.0,
                    hist.get_sample_value("prefixstore_request_duration_seconds_count", labels) or 0.0)

        async with H.serve_raw("inprocess", "echo", req_bytes=len(req_body), resp_bytes=len(answer_body)) as port:
            raw = await H.RawClient.connect(port)
            resp_view = memoryview(bytearray(len(answer_body)))
            clock = time.perf_counter
            gc.collect()
            hist_start: tuple[float, float] = (0.0, 0.0)
            for rep in range(args.warmup + args.reps):
                measuring = rep >= args.warmup
                if rep == args.warmup:
                    hist_start = hist_reading()
                t = clock()
                Prompt(ns, lookup_tokens)
                t_hash = clock() - t
                t = clock()
                Prompt(ns, token_list)
                t_hash_list = clock() - t
                t = clock()
                encode_header(LookupRequest(namespace_id=ns.id, hashes=b"".join(prompt.hashes), tokens=prompt.packed,
                                            lease=True).to_header())
                t_enc = clock() - t
                t = clock()
                h, _ = decode_frame(req_body)
                r = LookupRequest.from_header(h, store.limits, lambda ns_id: store.namespace(ns_id).block_tokens)
                t_parse = clock() - t
                t = clock()
                a = store.lookup(r)
                t_lookup = clock() - t
                t = clock()
                encode_frame(a.to_header())
                t_senc = clock() - t
                t = clock()
                await raw.echo(req_body, resp_view)
                t_echo = clock() - t
                t = clock()
                got = await client.lookup(prompt)
                t_rt = clock() - t
                t = clock()
                got2 = await client.lookup(lookup_tokens)
                t_e2e = clock() - t
                if not (got.ok and got2.ok and got.kv_tokens == got2.kv_tokens == S):
                    raise SystemExit(f"B={B}: a timed lookup failed or changed its answer ({dict(client.failures)})")
                if measuring:
                    for key, v in (("hash_array", t_hash), ("hash_list", t_hash_list), ("client_encode", t_enc),
                                   ("server_parse", t_parse), ("server_lookup", t_lookup), ("server_encode", t_senc),
                                   ("echo", t_echo), ("round_trip", t_rt), ("end_to_end", t_e2e)):
                        samples[key].add(v)
                    done = rep - args.warmup + 1
                    if done % max(1, args.reps // 4) == 0 or done == args.reps:
                        H.progress(f"B={B}: {done}/{args.reps} reps; so far median round trip "
                                   f"{samples['round_trip'].median * 1e3:.2f} ms, echo {samples['echo'].median * 1e3:.3f} ms")
            raw.close()
            hist_end = hist_reading()
        handler_mean_ms = ((hist_end[0] - hist_start[0]) / max(1.0, hist_end[1] - hist_start[1])) * 1e3
        echo = samples["echo"].median
        figures = {key: {**samples[key].summary_ms(), "ratio_to_echo": samples[key].median / echo} for key, _ in ROWS}
        return {
            "block_tokens": B, "num_blocks": len(prompt.hashes), "tokens": N, "stored_tokens": S,
            "snapshot_boundaries": boundaries, "kv_tokens": res.kv_tokens, "state_tokens": res.state_tokens,
            "request_body_bytes": len(req_body), "answer_body_bytes": len(answer_body),
            "server_handler_mean_ms": handler_mean_ms, "figures": figures,
            "target_end_to_end_ms": TARGET_E2E_MS if B == 16 else None,
            "target_met": figures["end_to_end"]["median_ms"] < TARGET_E2E_MS if B == 16 else None,
        }


def plot(results: list[dict[str, object]], path: Path) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        figs = r["figures"]
        assert isinstance(figs, dict)
        labels = [label for _, label in ROWS]
        med = [figs[k]["median_ms"] for k, _ in ROWS]
        lo = [figs[k]["median_ms"] - figs[k]["p10_ms"] for k, _ in ROWS]
        hi = [figs[k]["p90_ms"] - figs[k]["median_ms"] for k, _ in ROWS]
        colors = ["#4c72b0"] * 3 + ["#dd8452"] * 3 + ["#55a868"] * 2 + ["#8c8c8c"]
        y = list(range(len(ROWS)))[::-1]
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=2)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlabel("ms (median, p10-p90)")
        ax.set_title(f"B={r['block_tokens']}: {r['tokens']:,} tokens, {r['num_blocks']:,} blocks", fontsize=9)
        if r.get("target_end_to_end_ms"):
            ax.axvline(TARGET_E2E_MS, color="red", ls="--", lw=1, label="target 5 ms")
            ax.legend(fontsize=7, loc="lower right")
        for yi, m, h in zip(y, med, hi):
            ax.text(m + h, yi, f"  {m:.2f}", va="center", fontsize=7)
        ax.margins(x=0.2)
    fig.suptitle("prefixstore lookup latency (in-process store, loopback)", fontsize=10)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.progress(f"lookup benchmark: {args.tokens:,} tokens, stored {args.stored_tokens:,}, "
               f"B in {args.block_sizes}, {args.reps} reps (+{args.warmup} warm-up), tier={args.tier}")
    tokens = np.random.default_rng(args.seed).integers(0, 50000, args.tokens, dtype=np.uint32)
    results = [await bench_block_size(B, args, tokens) for B in args.block_sizes]
    rows = []
    for r in results:
        figs = r["figures"]
        assert isinstance(figs, dict)
        for key, label in ROWS:
            f = figs[key]
            rows.append([r["block_tokens"], label, f["median_ms"], f["p10_ms"], f["p90_ms"], f"{f['ratio_to_echo']:.1f}x"])
    table = H.print_table("Lookup latency (ms, median over reps; ratio to the raw echo of the same bytes)",
                          ["B", "what", "median ms", "p10 ms", "p90 ms", "vs echo"], rows)
    for r in results:
        print(f"B={r['block_tokens']}: request {r['request_body_bytes']:,} B, answer {r['answer_body_bytes']:,} B, "
              f"server handler mean (histogram) {r['server_handler_mean_ms']:.2f} ms"
              + (f"; target end-to-end < {TARGET_E2E_MS} ms: {'MET' if r['target_met'] else 'NOT MET'}"
                 if r["target_met"] is not None else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "lookup.png")
    H.write_json(args.out, "lookup", {
        "benchmark": "lookup", "argv": sys.argv[1:], "machine": H.machine_note(),
        "settings": {"tokens": args.tokens, "stored_tokens": args.stored_tokens, "block_sizes": args.block_sizes,
                     "snapshots": args.snapshots, "reps": args.reps, "warmup": args.warmup, "tier": args.tier,
                     "quick": args.quick, "store": "in-process (aiohttp AppRunner/TCPSite, same event loop)"},
        "results": results, "table_markdown": table,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

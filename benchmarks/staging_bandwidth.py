"""Gather / scatter bandwidth between paged KV and store payloads, as a ratio to a plain copy.

The reference model's KV layout (2 attention layers x 2 KV heads x 64 dims,
float32: 2 KiB per token) over a sequence of N tokens, cut into store blocks
of B tokens. Each operation moves the same bytes as the baseline::

    copy            dst.copy_(src): one contiguous copy of the sequence's KV bytes (the baseline)
    gather          pages -> staging, every block's payload (all layers, layer-major): the save path
    scatter         staging -> pages, all layers at once
    scatter/layer   staging -> pages, one attention layer at a time, as the layer-wise load does

Figures are the median and the best (minimum time) over --reps runs,
operations interleaved rep by rep; on a shared machine the best run is the
one least disturbed by other processes, for the baseline as for the rest. Bandwidth counts the payload bytes once (a copy reads and writes them).
Baseline and operations run on the same number of torch threads (--threads).

    python benchmarks/staging_bandwidth.py             # N = 16384
    python benchmarks/staging_bandwidth.py --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import _harness as h
from prefixstore.gpu_staging import ModelConfig, PagedKVCache, Span, StagingBuffer

TARGET_RATIO = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="30 (quick: 3)", warmup="3 (quick: 1)")
    p.add_argument("--tokens", type=int, default=None, help="Sequence length N. Default: 16384 (quick: 2048).")
    p.add_argument("--block-tokens", type=int, default=16, help="Store block size B in tokens. Default: 16.")
    p.add_argument("--page-tokens", default="16,64,7",
                   help="Comma-separated engine page sizes to measure. Default: 16,64,7.")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the copies (0: torch's default, one per core). Default: 1: "
                        "the engine scatters on its event-loop thread while the model computes on the others, "
                        "and one thread keeps OpenMP barrier stalls on a busy machine out of both sides.")
    args = p.parse_args(argv)
    args.tokens = args.tokens or (2048 if args.quick else 16384)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.page_tokens = [int(x) for x in args.page_tokens.split(",") if x.strip()]
    return args


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(args: argparse.Namespace, page_tokens: int) -> dict[str, dict[str, float]]:
    cfg = ModelConfig()
    N, B = args.tokens, args.block_tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = PagedKVCache.for_model(cfg, num_pages=-(-N // page_tokens) * 2 + 4, page_tokens=page_tokens,
                                   device=device)
    cache.allocate(3)  # the sequence's pages are not the first ones, nor (after the shuffle) in order
    seq = cache.sequence()
    seq.reserve(N)
    g = torch.Generator().manual_seed(args.seed)
    seq.pages = [seq.pages[i] for i in torch.randperm(len(seq.pages), generator=g).tolist()]
    seq._table = torch.tensor(seq.pages, dtype=torch.long, device=cache.device)
    cache.data.normal_(generator=g) if device == "cpu" else cache.data.normal_()
    layers = cache.num_layers
    nbytes = N * layers * 2 * cache.row_bytes
    staging = StagingBuffer(nbytes, device)
    spans = [(a, min(a + B, N)) for a in range(0, N, B)]
    slots = staging.carve([(b - a) * layers * 2 * cache.row_bytes for a, b in spans])
    rows = staging.rows(slots[0], slots[-1], cache.row_elems, cache.data.dtype)
    src = torch.empty_like(rows).normal_()
    dst = torch.empty_like(rows)
    layer_spans = [Span(a, b - a, b - a) for a, b in spans]
    per_layer = N * 2 * cache.row_bytes
    layer_rows = [staging.region[i * per_layer : (i + 1) * per_layer].view(cache.data.dtype).view(-1, cache.row_elems)
                  for i in range(layers)]

    ops: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(src),
        "gather": lambda: seq.gather(rows, spans),
        "scatter": lambda: seq.scatter(rows, layer_spans),
        "scatter/layer": lambda: [seq.scatter(layer_rows[i], layer_spans, i, i + 1) for i in range(layers)],
    }
    # Correctness first: scatter(gather(x)) into a second sequence reproduces x.
    seq.gather(rows, spans)
    check = cache.sequence()
    check.reserve(N)
    check.scatter(rows, layer_spans)
    for layer in range(layers):
        k1, v1 = seq.read(layer, N)
        k2, v2 = check.read(layer, N)
        assert torch.equal(k1, k2) and torch.equal(v1, v2), "gather/scatter round trip differs"
    check.release()

    samples = {name: h.Samples(name) for name in ops}
    for rep in range(args.warmup + args.reps):
        for name, fn in ops.items():
            t = timed(fn)
            if rep >= args.warmup:
                samples[name].add(t)
    copy = samples["copy"]
    out: dict[str, dict[str, float]] = {}
    for name, s in samples.items():
        out[name] = {**s.summary_ms(), "gb_per_s": nbytes / s.median / 1e9, "ratio_to_copy": copy.median / s.median,
                     "best_gb_per_s": nbytes / min(s.values) / 1e9,
                     "best_ratio_to_copy": min(copy.values) / min(s.values), "bytes": nbytes}
    return out


def plot(out: dict[str, object], path: Path) -> None:
    plt = h.pyplot()
    results = out["results"]
    assert isinstance(results, dict)
    pages = list(results)
    ops = list(next(iter(results.values())))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(ops)
    for i, op in enumerate(ops):
        xs = [j + (i - (len(ops) - 1) / 2) * width for j in range(len(pages))]
        ax.bar(xs, [results[p][op]["gb_per_s"] for p in pages], width, label=op)
    ax.set_xticks(range(len(pages)), [f"page {p} tokens" for p in pages])
    ax.set_ylabel("GB/s (payload bytes)")
    cfg = out["config"]
    assert isinstance(cfg, dict)
    ax.set_title(f"Paged KV <-> store payloads, {cfg['tokens']} tokens, block {cfg['block_tokens']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    h.progress(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for page_tokens in args.page_tokens:
        h.progress(f"page size {page_tokens} tokens: {args.tokens} tokens, block {args.block_tokens}")
        results[str(page_tokens)] = r = measure(args, page_tokens)
        h.progress("  " + ", ".join(f"{k} {v['gb_per_s']:.2f} GB/s ({v['ratio_to_copy']:.0%})" for k, v in r.items()))
    rows = [[p, op, v["median_ms"], v["gb_per_s"], f"{v['ratio_to_copy']:.0%}", v["min_ms"], v["best_gb_per_s"],
             f"{v['best_ratio_to_copy']:.0%}"] for p, r in results.items() for op, v in r.items()]
    nbytes = next(iter(results.values()))["copy"]["bytes"]
    table = h.print_table(f"gather / scatter of {args.tokens} tokens ({nbytes / 2**20:.0f} MiB), "
                          f"median and best of {args.reps}", ["page tokens", "operation", "median ms", "GB/s",
                                                               "of copy", "best ms", "best GB/s", "best of copy"], rows)
    worst = min(v["ratio_to_copy"] for r in results.values() for op, v in r.items() if op != "copy")
    worst_best = min(v["best_ratio_to_copy"] for r in results.values() for op, v in r.items() if op != "copy")
    out: dict[str, object] = {
        "benchmark": "staging_bandwidth",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": h.machine_note(),
        "config": {"tokens": args.tokens, "block_tokens": args.block_tokens, "page_tokens": args.page_tokens,
                   "reps": args.reps, "warmup": args.warmup, "seed": args.seed, "quick": args.quick,
                   "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "results": results,
        "worst_ratio_to_copy": worst,
        "worst_best_ratio_to_copy": worst_best,
        "target_ratio": TARGET_RATIO,
        "target_met": worst >= TARGET_RATIO,
        "target_met_best": worst_best >= TARGET_RATIO,
        "table": table,
    }
    h.write_json(args.out, "staging_bandwidth", out)
    plot(out, args.out / "staging_bandwidth.png")
    h.progress(f"worst ratio to a plain copy: {worst:.0%} of medians, {worst_best:.0%} of best runs; target >= "
               f"{TARGET_RATIO:.0%}: {'met' if worst >= TARGET_RATIO else 'NOT met'} (medians), "
               f"{'met' if worst_best >= TARGET_RATIO else 'NOT met'} (best runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first token of the reference hybrid model on CPU: a long prompt whose prefix is in the store
against full prefill of the same prompt, in the same run.

What is measured (``Engine.generate(prompt, 1)``: lookup, load, prefill, first token)::

    full    no store: prefill all P tokens                                      (the baseline)
    exact   lookup; load KV [0, P-U) + the snapshot at P-U, layer by layer;
            prefill the last U tokens, overlapped with the load
    replay  lookup; load KV [0, P-U); rebuild the state by replaying R = f(P-U) tokens; prefill U

The store holds the prefix because a first request for prompt[:P-U] saved
it (retention: the prompt end). Measured requests do not save, so every rep
sees the same store. Modes run interleaved rep by rep (full, exact, replay,
full, ...) so machine noise hits all of them. Each exact rep's logits are
checked against the full rep's (max abs diff, recorded).

    python benchmarks/ttft.py                      # P = 16384, U = 1024
    python benchmarks/ttft.py --quick              # smoke run (P = 2048, U = 256)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

import _harness as h
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.gpu_staging import Engine, EngineConfig, HybridModel, ModelConfig, RequestResult

TARGET_SPEEDUP = 5.0
MODES = ("full", "exact", "replay")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="3 (quick: 1)", warmup="1 (quick: 0)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="Prompt length P. Default: 16384 (quick: 2048).")
    p.add_argument("--uncached-tokens", type=int, default=None,
                   help="Tokens U at the end of the prompt that are not in the store. Default: 1024 (quick: 256).")
    p.add_argument("--block-tokens", type=int, default=16, help="Store block size B in tokens. Default: 16.")
    p.add_argument("--page-tokens", type=int, default=16, help="Engine page size in tokens. Default: 16.")
    p.add_argument("--chunk-tokens", type=int, default=2048,
                   help="Longest prefill chunk of the engine (both modes). Default: 2048.")
    p.add_argument("--replay-fraction", type=float, default=0.1,
                   help="Tail-Replay budget R as a fraction of the cached prefix, for the replay mode. Default: 0.1.")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"Comma-separated modes to run, of {', '.join(MODES)}. Default: all.")
    p.add_argument("--store", choices=("subprocess", "inprocess"), default="subprocess",
                   help="Run the store in its own process (as deployed; default) or in this event loop.")
    p.add_argument("--tier", choices=("lmdb", "ram"), default="lmdb",
                   help="lmdb: RAM arena + write-through LMDB in a temp dir (the product default); ram: RAM only.")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default, one per core). Default: 0.")
    args = p.parse_args(argv)
    args.prompt_tokens = args.prompt_tokens or (2048 if args.quick else 16384)
    args.uncached_tokens = args.uncached_tokens or (256 if args.quick else 1024)
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in MODES:
            p.error(f"--modes: unknown mode {m!r}; choose from {', '.join(MODES)}")
    if not 0 < args.uncached_tokens < args.prompt_tokens:
        p.error("--uncached-tokens: must be between 0 and --prompt-tokens")
    return args


async def run(args: argparse.Namespace) -> dict[str, object]:
    if args.threads:
        torch.set_num_threads(args.threads)
    P, U = args.prompt_tokens, args.uncached_tokens
    cached = P - U
    model = HybridModel(ModelConfig())
    ns = model.config.namespace(block_tokens=args.block_tokens)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (P,), generator=g).tolist()
    kv_bytes = ns.kv.payload_bytes(P)
    ram = max(256 << 20, 2 * kv_bytes + (64 << 20))
    h.progress(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; prompt {P} tokens, "
               f"{cached} cached, {U} computed; KV {kv_bytes / 2**20:.0f} MiB, snapshot "
               f"{ns.state.snapshot_bytes / 2**10:.0f} KiB; torch threads {torch.get_num_threads()}")
    async with h.serve_store(args.store, ram_bytes=ram, page_bytes=64 << 10, tier=args.tier,
                             disk_bytes=4 * ram) as store:
        async with PrefixClient(ns, ClientConfig(url=store.url, timeout_s=120.0)) as client:
            base = dict(page_tokens=args.page_tokens, num_pages=-(-P // args.page_tokens) + 8,
                        prefill_chunk_tokens=args.chunk_tokens, staging_bytes=max(32 << 20, kv_bytes // 2))
            engines = {
                "full": Engine(model, client, EngineConfig(**base)),
                "exact": Engine(model, client, EngineConfig(mode="exact", **base)),
                "replay": Engine(model, client, EngineConfig(mode="replay", replay_fraction=args.replay_fraction,
                                                             **base)),
            }
            h.progress(f"seeding the store: a request for the first {cached} tokens")
            seed = await engines["exact"].generate(prompt[:cached], 1)
            assert seed.save is not None
            h.progress(f"stored {seed.save.stored} entries, {seed.save.stored_bytes / 2**20:.1f} MiB "
                       f"({seed.ttft_s:.2f} s to first token)")

            samples: dict[str, list[RequestResult]] = {m: [] for m in args.modes}
            diffs: list[float] = []
            for rep in range(args.warmup + args.reps):
                measured = rep >= args.warmup
                reference: RequestResult | None = None
                for mode in args.modes:
                    r = await engines[mode].generate(prompt, 1, use_store=mode != "full", save=False)
                    if mode != "full" and (r.fallback or r.plan.kv_tokens != cached):
                        raise RuntimeError(f"{mode}: expected to reuse {cached} tokens, got {r.plan} "
                                           f"(fallback: {r.fallback})")
                    if mode == "full":
                        reference = r
                    elif mode == "exact" and reference is not None:
                        diffs.append(float((r.logits[0] - reference.logits[0]).abs().max()))
                    if measured:
                        samples[mode].append(r)
                    h.progress(f"{'rep' if measured else 'warmup'} {rep - args.warmup + 1 if measured else rep + 1}: "
                               f"{mode:6s} TTFT {r.ttft_s * 1e3:8.1f} ms (load {r.load_s * 1e3:.0f} ms, "
                               f"compute waited {r.load_wait_s * 1e3:.0f} ms)")

    results: dict[str, dict[str, float]] = {}
    full_ms = statistics.median(r.ttft_s for r in samples["full"]) * 1e3 if "full" in samples else None
    for mode, rs in samples.items():
        ttft = h.Samples(mode, [r.ttft_s for r in rs])
        row: dict[str, float] = {**ttft.summary_ms(),
                                 "lookup_ms": statistics.median(r.lookup_s for r in rs) * 1e3,
                                 "load_ms": statistics.median(r.load_s for r in rs) * 1e3,
                                 "load_wait_ms": statistics.median(r.load_wait_s for r in rs) * 1e3,
                                 "loaded_mib": rs[0].loaded_bytes / 2**20,
                                 "computed_tokens": rs[0].computed_tokens,
                                 "replayed_tokens": rs[0].plan.replay_tokens}
        if full_ms:
            row["speedup"] = full_ms / row["median_ms"]
        results[mode] = row

    rows = [[m, r["median_ms"], r["p10_ms"], r["p90_ms"], f"{r.get('speedup', 0):.2f}x", int(r["computed_tokens"]),
             int(r["replayed_tokens"]), r["loaded_mib"], r["load_ms"], r["load_wait_ms"]] for m, r in results.items()]
    table = h.print_table(f"TTFT, P={P} tokens, {cached} cached (median of {args.reps})",
                          ["mode", "TTFT ms", "p10", "p90", "speedup", "computed", "replayed", "loaded MiB",
                           "load ms", "compute waited ms"], rows)
    exact_speedup = results.get("exact", {}).get("speedup")
    out: dict[str, object] = {
        "benchmark": "ttft",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": h.machine_note(),
        "config": {"prompt_tokens": P, "uncached_tokens": U, "block_tokens": args.block_tokens,
                   "page_tokens": args.page_tokens, "chunk_tokens": args.chunk_tokens,
                   "replay_fraction": args.replay_fraction, "store": args.store, "tier": args.tier,
                   "reps": args.reps, "warmup": args.warmup, "seed": args.seed, "quick": args.quick,
                   "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                   "model": {"params": sum(p.numel() for p in model.parameters()),
                             "layers": list(model.config.layers), "hidden": model.config.hidden_size}},
        "results": results,
        "exact_vs_full_max_abs_logit_diff": max(diffs) if diffs else None,
        "target_speedup": TARGET_SPEEDUP,
        "target_met": None if exact_speedup is None else exact_speedup >= TARGET_SPEEDUP,
        "table": table,
    }
    return out


def plot(out: dict[str, object], path: Path) -> None:
    plt = h.pyplot()
    results = out["results"]
    assert isinstance(results, dict)
    modes = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    medians = [results[m]["median_ms"] / 1e3 for m in modes]
    waits = [results[m]["load_wait_ms"] / 1e3 for m in modes]
    lookups = [results[m]["lookup_ms"] / 1e3 for m in modes]
    compute = [max(0.0, t - w - lk) for t, w, lk in zip(medians, waits, lookups)]
    ax.bar(modes, lookups, label="lookup", color="#999999")
    ax.bar(modes, waits, bottom=lookups, label="waiting for loaded layers", color="#e6a23c")
    ax.bar(modes, compute, bottom=[a + b for a, b in zip(lookups, waits)], label="compute (prefill, replay)",
           color="#409eff")
    for i, m in enumerate(modes):
        speed = results[m].get("speedup")
        ax.text(i, medians[i], f"{medians[i]:.2f} s" + (f"\n{speed:.1f}x" if speed and m != "full" else ""),
                ha="center", va="bottom", fontsize=9)
    cfg = out["config"]
    assert isinstance(cfg, dict)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"Reference hybrid model on CPU: P={cfg['prompt_tokens']}, "
                 f"{cfg['prompt_tokens'] - cfg['uncached_tokens']} cached")
    ax.set_ylim(0, max(medians) * 1.25)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    h.progress(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out = asyncio.run(run(args))
    h.write_json(args.out, "ttft", out)
    plot(out, args.out / "ttft.png")
    h.progress(f"done in {time.perf_counter() - started:.0f} s; exact speedup target >= {TARGET_SPEEDUP}x: "
               f"{'met' if out['target_met'] else 'NOT met' if out['target_met'] is False else 'not measured'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

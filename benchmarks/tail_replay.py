"""Tail-Replay quality against full recompute: how wrong is a state rebuilt from the last R tokens?

For each prompt (random tokens, --prompts of them) and each prefix length K:
a first request stores KV [0, K) and the snapshot at K; then requests for
the prefix plus a continuation of C tokens reuse the KV of [0, K) and
rebuild the state by replaying the last R = ceil(f * K) tokens from a zero
state (``EngineConfig(mode="replay")``). Their logits at the C continuation
positions are compared with a full recompute of the same tokens:

    mean |dlogit|   mean absolute logit error over every position and vocabulary entry
    max |dlogit|    the largest one
    top-1           fraction of positions whose argmax agrees with full recompute

f = 0 (no replay: a zero state) and f = 1 (replay everything: exact) bound
the scale. Measured, not asserted: the reference model's heads have decay
time scales from about 10 to 10,000 tokens, so the slow heads remember more
than a short replay can rebuild.

    python benchmarks/tail_replay.py                   # K in {1024, 4096}, C = 64, 3 prompts
    python benchmarks/tail_replay.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

import torch

import _harness as h
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.gpu_staging import Engine, EngineConfig, HybridModel, ModelConfig, recompute_logits

FRACTIONS = (0.0, 0.05, 0.10, 0.25, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_common_args(p, reps="1 (a quality measurement: more prompts, not more reps)", warmup="0")
    p.add_argument("--prefix-tokens", default=None,
                   help="Comma-separated prefix lengths K. Default: 1024,4096 (quick: 256).")
    p.add_argument("--continuation-tokens", type=int, default=None,
                   help="Tokens C after the prefix whose logits are compared. Default: 64 (quick: 16).")
    p.add_argument("--prompts", type=int, default=None, help="Random prompts per prefix length. Default: 3 (quick: 1).")
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS),
                   help="Comma-separated replay budgets f (R = ceil(f * K)). Default: 0,0.05,0.1,0.25,1.")
    p.add_argument("--block-tokens", type=int, default=16, help="Store block size B in tokens. Default: 16.")
    args = p.parse_args(argv)
    args.prefix_tokens = [int(x) for x in (args.prefix_tokens or ("256" if args.quick else "1024,4096")).split(",")]
    args.continuation_tokens = args.continuation_tokens or (16 if args.quick else 64)
    args.prompts = args.prompts or (1 if args.quick else 3)
    args.fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    for f in args.fractions:
        if not 0.0 <= f <= 1.0:
            p.error(f"--fractions: {f} is not in [0, 1]")
    return args


async def run(args: argparse.Namespace) -> dict[str, object]:
    model = HybridModel(ModelConfig())
    ns = model.config.namespace(block_tokens=args.block_tokens)
    C = args.continuation_tokens
    longest = max(args.prefix_tokens) + C
    # per (K, f): accumulated absolute error sum, max, agreements, positions, replay TTFTs
    acc: dict[tuple[int, float], dict[str, float]] = {}
    async with h.serve_store("inprocess", ram_bytes=512 << 20, page_bytes=64 << 10, tier="ram") as store:
        async with PrefixClient(ns, ClientConfig(url=store.url, timeout_s=120.0)) as client:
            base = dict(page_tokens=16, num_pages=-(-longest // 16) + 8)
            seeder = Engine(model, client, EngineConfig(**base))
            engines = {f: Engine(model, client, EngineConfig(mode="replay", replay_fraction=f, **base))
                       for f in args.fractions}
            for K in args.prefix_tokens:
                for n in range(args.prompts):
                    g = torch.Generator().manual_seed(args.seed + 1000 * n + K)
                    prompt = torch.randint(0, model.config.vocab_size, (K + C,), generator=g).tolist()
                    await seeder.generate(prompt[:K], 1)  # stores KV [0, K) and the snapshot at K
                    reference = recompute_logits(model, prompt, all_logits=True)[K:]
                    for f in args.fractions:
                        r = await engines[f].generate(prompt, 1, save=False, all_logits=True)
                        if r.plan.kv_tokens != K or r.fallback:
                            raise RuntimeError(f"K={K} f={f}: expected to reuse {K} tokens, got {r.plan} "
                                               f"({r.fallback})")
                        assert r.prefill_logits is not None
                        err = (r.prefill_logits - reference).abs()
                        a = acc.setdefault((K, f), {"abs_sum": 0.0, "max": 0.0, "agree": 0.0, "positions": 0.0,
                                                    "elements": 0.0, "ttft_s": 0.0, "replayed": r.plan.replay_tokens})
                        a["abs_sum"] += float(err.sum())
                        a["elements"] += err.numel()
                        a["max"] = max(a["max"], float(err.max()))
                        a["agree"] += float((r.prefill_logits.argmax(-1) == reference.argmax(-1)).sum())
                        a["positions"] += C
                        a["ttft_s"] += r.ttft_s
                    h.progress(f"K={K} prompt {n + 1}/{args.prompts}: " + ", ".join(
                        f"f={f:g}: {acc[(K, f)]['abs_sum'] / acc[(K, f)]['elements']:.2e}" for f in args.fractions))
    results = []
    for (K, f), a in acc.items():
        results.append({"prefix_tokens": K, "fraction": f, "replay_tokens": int(a["replayed"]),
                         "expected_replay_tokens": min(K, math.ceil(f * K)),
                         "mean_abs_logit_error": a["abs_sum"] / a["elements"], "max_abs_logit_error": a["max"],
                         "top1_agreement": a["agree"] / a["positions"], "positions": int(a["positions"]),
                         "ttft_ms": a["ttft_s"] / args.prompts * 1e3})
    rows = [[r["prefix_tokens"], f"{r['fraction']:.0%}", r["replay_tokens"], f"{r['mean_abs_logit_error']:.2e}",
             f"{r['max_abs_logit_error']:.2e}", f"{r['top1_agreement']:.1%}", r["ttft_ms"]] for r in results]
    table = h.print_table(f"Tail-Replay vs full recompute ({args.prompts} prompts x {C} continuation positions)",
                          ["prefix K", "replay f", "R tokens", "mean |dlogit|", "max |dlogit|", "top-1 agree",
                           "TTFT ms"], rows)
    return {
        "benchmark": "tail_replay",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": h.machine_note(),
        "config": {"prefix_tokens": args.prefix_tokens, "continuation_tokens": C, "prompts": args.prompts,
                   "fractions": args.fractions, "block_tokens": args.block_tokens, "seed": args.seed,
                   "quick": args.quick, "torch": torch.__version__},
        "results": results,
        "table": table,
    }


def plot(out: dict[str, object], path: Path) -> None:
    plt = h.pyplot()
    results = out["results"]
    assert isinstance(results, list)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8))
    for K in sorted({r["prefix_tokens"] for r in results}):
        rs = sorted((r for r in results if r["prefix_tokens"] == K), key=lambda r: r["fraction"])
        xs = [r["fraction"] * 100 for r in rs]
        # A log axis has no 0: exact budgets (error 0) are left out of the error plot and named in its title.
        nonzero = [r for r in rs if r["mean_abs_logit_error"] > 0]
        ax1.plot([r["fraction"] * 100 for r in nonzero], [r["mean_abs_logit_error"] for r in nonzero], marker="o",
                 label=f"K = {K}")
        ax2.plot(xs, [r["top1_agreement"] * 100 for r in rs], marker="o", label=f"K = {K}")
    ax1.set_yscale("log")
    exact = sorted({r["fraction"] for r in results if r["mean_abs_logit_error"] == 0})
    if exact:
        ax1.set_title("error 0 (exact) at f = " + ", ".join(f"{f:.0%}" for f in exact), fontsize=9)
    ax1.set_xlabel("replay budget (% of the prefix)")
    ax1.set_ylabel("mean |logit error| vs recompute")
    ax2.set_xlabel("replay budget (% of the prefix)")
    ax2.set_ylabel("top-1 agreement (%)")
    ax2.set_ylim(0, 105)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Tail-Replay on the reference hybrid model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    h.progress(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    out = asyncio.run(run(args))
    h.write_json(args.out, "tail_replay", out)
    plot(out, args.out / "tail_replay.png")
    h.progress(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`prefixstore simulate`, `prefixstore trace` and `prefixstore plan`."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path

from prefixstore.admission import MODEL_PRESETS, IntervalTuner, crossover_tokens, get_model, optimal_interval
from prefixstore.store.config import ConfigError, parse_size
from . import plot
from .engine import DEFAULT_POLICY, POLICIES, SimResult, get_policy, simulate
from .request import TraceError
from .traces import RATED_WORKLOADS, WORKLOADS, generate, read_trace, write_trace


def _models_help() -> str:
    return ", ".join(sorted(MODEL_PRESETS))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written (pre-wrapped paragraphs and lists), defaults shown, but no
    "(default: None)" on options that have none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def _described(intro: str, entries: dict[str, str]) -> str:
    """An intro paragraph, then one wrapped, indented entry per name: whole texts, never first lines."""
    out = [textwrap.fill(intro, 79)]
    for name, text in entries.items():
        out.append(textwrap.fill(f"{name}: {' '.join(text.split())}", 79, initial_indent="  ", break_on_hyphens=False,
                                 subsequent_indent="    "))
    return "\n".join(out)


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "simulate", help="replay a trace through the store's own policies; report hit rates",
        description=_described(
            "Replay a JSONL trace (session_id, input_tokens, output_tokens, optional ts) through the store's "
            "index, admission and eviction code in-process, with page accounting but no payload bytes, and "
            "report, per policy and capacity (a table; --out also writes a JSON and a PNG):", {
                "token hit": "share of input tokens reused exactly (KV and state), per token",
                "kv-only": "share of input tokens whose KV was stored, per token",
                "state hit": "share of requests that found a snapshot, per request",
                "FLOPs saved": "share of prefill FLOPs not recomputed, per FLOP",
                "kv GiB, state GiB": "bytes held in RAM by kind at the end of the replay",
                "secs": "wall time of the replay"}) + "\n\n" + _described(
            "Policies and baselines (--policy):", {p.name: p.description for p in POLICIES.values()}),
        formatter_class=_HelpFormatter)
    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="JSONL trace file to replay")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="replay a synthetic workload instead of a file")
    sim.add_argument("--requests", type=int, default=1000, help="requests of the synthetic workload")
    sim.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    sim.add_argument("--session-rate", type=float, default=None,
                     help="sessions per minute, for workloads whose sessions arrive at a rate ("
                          + ", ".join(RATED_WORKLOADS) + "; default 8)")
    sim.add_argument("--capacity", default="4GiB",
                     help="store byte budget; a comma-separated list compares several (e.g. 2GiB,8GiB,32GiB)")
    sim.add_argument("--model", default="mamba2-hybrid-7b", help=f"model preset: {_models_help()}")
    sim.add_argument("--policy", default=DEFAULT_POLICY,
                     help=f"policy or baseline (listed above), or a comma-separated list, or 'all': "
                          f"{', '.join(POLICIES)}")
    sim.add_argument("--block-tokens", type=int, default=16, help="store block size in tokens")
    sim.add_argument("--out", type=Path, default=None,
                     help="directory for simulate.json and simulate.png (bars for one capacity, lines over a "
                          "log capacity axis for several; the figure needs matplotlib, the 'plot' extra: without "
                          "it the JSON is written and the command exits 1)")
    sim.set_defaults(run=cmd_simulate)

    trace = commands.add_parser(
        "trace", help="write a synthetic workload as a JSONL trace",
        description=_described("Generate a seeded synthetic trace (JSON lines: session_id, input_tokens, "
                               "output_tokens, ts) of one of these workloads:",
                               {name: fn.__doc__ or "" for name, fn in WORKLOADS.items()}),
        formatter_class=_HelpFormatter)
    trace.add_argument("workload", choices=sorted(WORKLOADS), help="workload shape")
    trace.add_argument("-o", "--output", type=Path, required=True, help="trace file to write")
    trace.add_argument("--requests", type=int, default=1000, help="number of requests")
    trace.add_argument("--seed", type=int, default=0, help="generator seed")
    trace.add_argument("--session-rate", type=float, default=None,
                       help="sessions per minute, for workloads whose sessions arrive at a rate ("
                            + ", ".join(RATED_WORKLOADS) + "; default 8)")
    trace.set_defaults(run=cmd_trace)

    plan = commands.add_parser(
        "plan", help="size memory and pick a snapshot interval for a model",
        description="Per-token KV bytes, snapshot bytes, the crossover length (a snapshot costs as much as the KV "
                    "of this many tokens) and the optimal snapshot interval I* = sqrt(2*T*S*alpha/beta) for a "
                    "context of T tokens, snapshot size S, storage price alpha (per byte held) and recompute "
                    "price beta (per token).",
        formatter_class=_HelpFormatter)
    plan.add_argument("--model", default="mamba2-hybrid-7b", help=f"model preset: {_models_help()}, or 'all'")
    plan.add_argument("--context-tokens", type=int, default=32768, help="T: typical context length")
    plan.add_argument("--storage-price", type=float, default=0.01,
                      help="alpha: cost of holding one GiB for the life of a cached context (any currency unit)")
    plan.add_argument("--recompute-price", type=float, default=0.05,
                      help="beta: cost of prefilling one million tokens, same unit")
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(run=cmd_plan)


def _progress(label: str) -> "callable":  # type: ignore[valid-type]
    started = time.perf_counter()

    def report(done: int, total: int) -> None:
        rate = done / max(1e-9, time.perf_counter() - started)
        print(f"  {label}: {done}/{total} requests ({rate:.0f}/s)", file=sys.stderr, flush=True)

    return report


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        model = get_model(args.model)
        names = list(POLICIES) if args.policy == "all" else args.policy.split(",")
        policies = [get_policy(n) for n in names]
        capacities = [parse_size(c.strip(), "capacity") for c in args.capacity.split(",")]
        if args.trace and args.session_rate is not None:
            raise ValueError("--session-rate applies to --workload, not to a trace file")
        requests = list(read_trace(args.trace)) if args.trace else \
            generate(args.workload, args.requests, args.seed, args.session_rate)
    except (ValueError, ConfigError, TraceError, OSError) as err:
        print(f"prefixstore simulate: error: {err}", file=sys.stderr)
        return 2
    print(f"{len(requests)} requests, {sum(len(r.input_tokens) for r in requests)} input tokens, model {model.name}",
          file=sys.stderr)
    results = []
    for cap in capacities:
        for pol in policies:
            r = simulate(requests, model, cap, pol, args.block_tokens, _progress(f"{pol.name} @ {cap / 2**30:.1f}GiB"))
            results.append(r)
    # Two header lines: the names, then what each one is a share of (per token, per request, ...).
    print(f"{'policy':12s} {'capacity':>9s} {'token hit':>9s} {'kv-only':>9s} {'state hit':>9s} "
          f"{'FLOPs saved':>11s} {'kv GiB':>7s} {'state GiB':>9s} {'secs':>5s}")
    print(f"{'':12s} {'':>9s} {'per token':>9s} {'per token':>9s} {'per req':>9s} "
          f"{'of prefill':>11s} {'in RAM':>7s} {'in RAM':>9s} {'wall':>5s}")
    for r in results:
        print(f"{r.policy:12s} {r.capacity_bytes / 2**30:8.1f}G {r.token_hit_rate:9.3f} {r.kv_hit_rate:9.3f} "
              f"{r.state_hit_rate:9.3f} {r.flops_saved_fraction:10.1%} {r.bytes_held.get('kv', 0) / 2**30:7.2f} "
              f"{r.bytes_held.get('state', 0) / 2**30:9.2f} {r.seconds:5.1f}")
    print("what each policy chose:")
    for r in results:
        print(f"  {r.policy} @ {r.capacity_bytes / 2**30:.1f}G: {explain(r)}")
    if args.out:
        source = f"trace {args.trace.name}" if args.trace else f"workload {args.workload}"
        title = f"{source}: {len(requests)} requests, model {model.name}, {args.block_tokens}-token blocks"
        args.out.mkdir(parents=True, exist_ok=True)
        # The results first: minutes of simulation are never lost to a missing plotting library.
        (args.out / "simulate.json").write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
        try:
            plot.save(results, title, args.out / "simulate.png")
        except ImportError as err:
            print(f"wrote {args.out / 'simulate.json'}; the figure was not drawn: it needs matplotlib ({err}), "
                  f"which the 'plot' extra installs: pip install -c constraints.txt '.[plot]' from a checkout",
                  file=sys.stderr)
            return 1
        print(f"wrote {args.out / 'simulate.json'} and {args.out / 'simulate.png'}", file=sys.stderr)
    return 0


def explain(r: SimResult) -> str:
    """One line: the periodic interval and why, snapshots admitted / offered by origin, the eviction weight."""
    parts = [r.retention_note] if r.retention_note else []
    snaps = ", ".join(f"{o} {c['admitted']}/{c['offered']}" for o, c in sorted(r.snapshots.items()))
    if snaps:
        parts.append(f"snapshots admitted/offered: {snaps}")
    if r.eviction_weight is not None:
        parts.append(f"FLOP-aware weight w = {r.eviction_weight:.2f}")
    return "; ".join(parts) or "nothing to explain"


def cmd_trace(args: argparse.Namespace) -> int:
    try:
        requests = generate(args.workload, args.requests, args.seed, args.session_rate)
        write_trace(args.output, requests)
    except (ValueError, OSError) as err:
        print(f"prefixstore trace: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(requests)} requests to {args.output}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        models = list(MODEL_PRESETS.values()) if args.model == "all" else [get_model(args.model)]
        if min(args.context_tokens, args.storage_price, args.recompute_price) <= 0:
            raise ValueError("--context-tokens, --storage-price and --recompute-price must be positive")
    except ValueError as err:
        print(f"prefixstore plan: error: {err}", file=sys.stderr)
        return 2
    alpha = args.storage_price / 2**30  # per byte
    beta = args.recompute_price / 1e6  # per token
    rows = []
    for m in models:
        row: dict[str, object] = {"model": m.name, "kv_bytes_per_token": m.kv_bytes_per_token,
                                  "snapshot_bytes": m.state_bytes,
                                  "prefill_tflops_per_1k_tokens": round(m.prefill_flops(1000) / 1e12, 2)}
        if m.state_bytes:
            row["crossover_tokens"] = round(crossover_tokens(m.state_bytes, m.kv_bytes_per_token))
            row["optimal_interval_tokens"] = round(optimal_interval(args.context_tokens, m.state_bytes, alpha, beta))
            row["kv_bytes_of_context"] = m.kv_bytes_per_token * args.context_tokens
            # What the default policy (adaptive) does instead of a fixed interval: IntervalTuner.
            tuner = IntervalTuner(m.state_bytes, m.kv_bytes_per_token)
            row["default_interval_prior_tokens"] = tuner.interval_for(args.context_tokens)
            row["default_interval_one_resume_tokens"] = round(
                optimal_interval(args.context_tokens, m.state_bytes, 1 / m.kv_bytes_per_token, 1.0))
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"model {row['model']}")
        print(f"  KV per token:          {row['kv_bytes_per_token']:>14,} bytes")
        print(f"  snapshot:              {row['snapshot_bytes']:>14,} bytes")
        print(f"  prefill:               {row['prefill_tflops_per_1k_tokens']:>14} TFLOP per 1k tokens")
        if "crossover_tokens" in row:
            print(f"  crossover:             {row['crossover_tokens']:>14,} tokens (a snapshot = the KV of this many)")
            print(f"  KV of a {args.context_tokens}-token context: {row['kv_bytes_of_context']:>10,} bytes")
            print(f"  optimal interval I*:   {row['optimal_interval_tokens']:>14,} tokens "
                  f"(storage {args.storage_price}/GiB, recompute {args.recompute_price}/Mtok)")
            print("  the default policy (adaptive) chooses its interval online, from the same formula with")
            print("  T = new tokens per mid-context resume (measured) and a byte priced as KV (1 / KV bytes")
            print(f"  per token): {row['default_interval_one_resume_tokens']:,} tokens if each "
                  f"{args.context_tokens}-token context is resumed once mid-way,")
            print(f"  {row['default_interval_prior_tokens']:,} (the crossover) before any traffic is seen, and "
                  "none when every resume lands")
            print("  on a prompt or generation end (conversations); `prefixstore simulate` shows what it chose.")
        else:
            print("  no recurrent state: KV only, no snapshots to plan")
    return 0

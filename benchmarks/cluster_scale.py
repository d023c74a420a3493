"""Nodes contacted per cluster lookup, and per-node lookup load, as the cluster grows.

    python benchmarks/cluster_scale.py [--nodes 4,8,16,32,64] [--requests 600] [--quick]

For each N and each workload (multi-turn conversations; Zipf-picked system prompts, see
benchmarks/_cluster.py), starts a cluster -- real ``prefixstore serve`` processes up to
``--max-processes`` nodes, in-process store applications above -- and drives the engine's loop
through the real cluster client (lookup, read and verify, save what was missing with its end
snapshot). The first third of the requests warms the cache; over the rest it records, per lookup,
the nodes whose probe answers it used (``ClusterClient.last_walk``) and the probes it sent, and per
node the probes it answered.

Baseline in the same run: the nodes the previous placement (every level on the owner of
``level_key(parent, first token)``) spreads the same prompts' levels over, computed from the same
prompts with the same rendezvous function -- the nodes such a lookup must ask.

Target (issue 16): mean <= 2 and p99 <= 4 nodes per lookup, flat in N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path

import numpy as np

from _cluster import WORKLOADS, client_config, drive, hit_rate, namespace, running_cluster, workload
from _harness import DEFAULT_OUT, machine_note, print_table, progress, pyplot, save_figure

from prefixstore.client import PrefixClient, Prompt
from prefixstore.protocol.placement import level_key, rank


def level_owners(members: list[str], p: Prompt) -> int:
    """Distinct owners of a prompt's levels under the previous, per-level placement."""
    B, n = p.block_tokens, len(p.hashes)
    owners = {rank(members, level_key(p.parent_of_block(j), p.tokens(j * B, j * B + 1)))[0]
              for j in range(n + (1 if p.num_tokens > n * B else 0))}
    return len(owners)


async def run_one(n: int, name: str, args: argparse.Namespace) -> dict[str, object]:
    ns = namespace(args.block_tokens)
    reqs = workload(name, args.seed, args.requests)
    warm = len(reqs) // 3
    async with running_cluster(n, args.max_processes, "prefixstore-scale-") as cluster:
        urls = cluster.urls
        async with PrefixClient(ns, client_config(urls)) as client:
            progress(f"N={n} {name}: warm-up, {warm} requests")
            await drive(client, ns, reqs[:warm], args.concurrency)
            progress(f"N={n} {name}: measuring {len(reqs) - warm} requests")
            outs = await drive(client, ns, reqs[warm:], args.concurrency)
    nodes = np.array([o.nodes for o in outs], dtype=float)
    probes = np.array([o.probes for o in outs], dtype=float)
    load = Counter(u for o in outs for u in o.asked)
    per_node = [load.get(u, 0) for u in urls]
    before = np.array([level_owners(urls, Prompt(ns, r.tokens)) for r in reqs[warm:]], dtype=float)
    return {
        "nodes": n, "workload": name, "requests": len(outs),
        "nodes_mean": round(float(nodes.mean()), 3), "nodes_p99": float(np.percentile(nodes, 99)),
        "probes_mean": round(float(probes.mean()), 3), "probes_p99": float(np.percentile(probes, 99)),
        "load_max_over_mean": round(max(per_node) / (sum(per_node) / n), 2) if sum(per_node) else 0.0,
        "load_per_node": per_node,
        "previous_nodes_mean": round(float(before.mean()), 2), "previous_nodes_p99": float(np.percentile(before, 99)),
        "token_hit_rate": round(hit_rate(outs), 4),
        "errors": sum(1 for o in outs if o.error), "wrong_bytes": sum(o.wrong_bytes for o in outs),
        "mean_prompt_tokens": round(float(np.mean([o.tokens for o in outs])), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="4,8,16,32,64", help="cluster sizes, comma-separated. Default: 4,8,16,32,64.")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"workloads, comma-separated, from {', '.join(WORKLOADS)}. Default: all.")
    parser.add_argument("--requests", type=int, default=600,
                        help="requests per (N, workload); the first third warms the cache. Default: 600.")
    parser.add_argument("--block-tokens", type=int, default=16, help="store block size B. Default: 16.")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight. Default: 8.")
    parser.add_argument("--max-processes", type=int, default=8,
                        help="largest N run as real processes; larger clusters run in-process. Default: 8.")
    parser.add_argument("--seed", type=int, default=7, help="workload seed. Default: 7.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for cluster_scale.json and cluster_scale.png. Default: benchmarks/out.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 4 and 16, 150 requests.")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.requests = "4,16", 150
    sizes = [int(x) for x in args.nodes.split(",")]
    names = [w for w in args.workloads.split(",") if w]
    runs = [asyncio.run(run_one(n, w, args)) for w in names for n in sizes]
    rows = [[r["workload"], r["nodes"], r["nodes_mean"], r["nodes_p99"], r["probes_mean"], r["probes_p99"],
             r["load_max_over_mean"], r["previous_nodes_mean"], r["previous_nodes_p99"], r["token_hit_rate"],
             r["errors"], r["wrong_bytes"]] for r in runs]
    print_table("nodes per cluster lookup (branch placement; previous: per-level placement, same prompts)",
                ["workload", "N", "nodes mean", "nodes p99", "probes mean", "probes p99", "probe load max/mean",
                 "previous nodes mean", "previous p99", "token hit rate", "errors", "wrong bytes"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_scale.json").write_text(json.dumps(
        {"machine": machine_note(), "args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=2))
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        rs = [r for r in runs if r["workload"] == w]
        xs = [r["nodes"] for r in rs]
        ax.plot(xs, [r["nodes_mean"] for r in rs], "o-", label="branch placement, mean")
        ax.plot(xs, [r["nodes_p99"] for r in rs], "s--", label="branch placement, p99")
        ax.plot(xs, [r["previous_nodes_mean"] for r in rs], "^:", color="gray", label="per-level placement, mean")
        ax.axhline(2, color="green", linewidth=0.8, linestyle="--")
        ax.axhline(4, color="red", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("nodes in the cluster (N)")
        ax.set_ylabel("nodes contacted per lookup")
        ax.set_title(f"{w}: nodes per lookup")
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, args.out / "cluster_scale.png")
    progress(f"wrote {args.out / 'cluster_scale.json'} and {args.out / 'cluster_scale.png'}")


if __name__ == "__main__":
    main()

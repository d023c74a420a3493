"""What one lost node costs: token hit rate before and after a node of N dies under load.

    python benchmarks/node_loss.py [--nodes 8,16,32] [--requests 1500] [--quick]

For each N and workload (benchmarks/_cluster.py: multi-turn conversations; Zipf-picked system
prompts), starts a cluster -- real ``prefixstore serve`` processes up to ``--max-processes``
nodes (the node is lost to ``kill -9``), in-process store applications above (the node's listener
and connections are cut: the simulated loss) -- and drives the engine's loop through the real
cluster client: look up, read and verify every reusable byte, save what was missing.

Requests in three equal parts: warm-up; **before** (measured); the victim is killed; **after**
(measured, the requests that follow the loss, cold start of the lost branches included). The
victim is the node that answered the most probes during "before" (the worst one to lose).

Reported: token hit rate before and after, their ratio, the target (issue 16: after >= before *
(N-1)/N - 3 points), errors that reached the engine (exceptions out of the client: must be 0) and
wrong bytes read (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from pathlib import Path

from _cluster import WORKLOADS, client_config, drive, hit_rate, namespace, running_cluster, workload
from _harness import DEFAULT_OUT, machine_note, print_table, progress, pyplot, save_figure

from prefixstore.client import PrefixClient


async def run_one(n: int, name: str, args: argparse.Namespace) -> dict[str, object]:
    ns = namespace(args.block_tokens)
    reqs = workload(name, args.seed, args.requests)
    third = len(reqs) // 3
    async with running_cluster(n, args.max_processes, "prefixstore-loss-") as cluster:
        urls, mode = cluster.urls, cluster.mode
        async with PrefixClient(ns, client_config(urls)) as client:
            progress(f"N={n} {name}: warm-up, {third} requests")
            await drive(client, ns, reqs[:third], args.concurrency)
            progress(f"N={n} {name}: before the loss, {third} requests")
            before = await drive(client, ns, reqs[third:2 * third], args.concurrency)
            load = Counter(u for o in before for u in o.asked)
            victim = max(urls, key=lambda u: load.get(u, 0))
            progress(f"N={n} {name}: {mode} of {victim} (answered {load.get(victim, 0)} probes), "
                     f"then {len(reqs) - 2 * third} requests")
            await cluster.kill(victim)
            after = await drive(client, ns, reqs[2 * third:], args.concurrency)
    hb, ha = hit_rate(before), hit_rate(after)
    target = hb * (n - 1) / n - 0.03
    return {"nodes": n, "workload": name, "mode": mode, "hit_before": round(hb, 4), "hit_after": round(ha, 4),
            "kept": round(ha / hb, 3) if hb else 0.0, "target_after": round(target, 4), "met": ha >= target,
            "errors": sum(1 for o in before + after if o.error), "wrong_bytes": sum(o.wrong_bytes for o in before + after),
            "victim_probe_share": round(load.get(victim, 0) / max(1, sum(load.values())), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="8,16,32", help="cluster sizes, comma-separated. Default: 8,16,32.")
    parser.add_argument("--workloads", default="multiturn,sysprompt",
                        help=f"workloads, comma-separated, from {', '.join(WORKLOADS)}. Default: multiturn,sysprompt.")
    parser.add_argument("--requests", type=int, default=1500,
                        help="requests per (N, workload): warm-up, before, after, a third each. Default: 1500.")
    parser.add_argument("--block-tokens", type=int, default=16, help="store block size B. Default: 16.")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight. Default: 8.")
    parser.add_argument("--max-processes", type=int, default=8,
                        help="largest N run as real processes (kill -9); larger clusters run in-process "
                             "(simulated loss). Default: 8.")
    parser.add_argument("--seed", type=int, default=11, help="workload seed. Default: 11.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for node_loss.json and node_loss.png. Default: benchmarks/out.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: N = 4, 300 requests.")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.requests = "4", 300
    sizes = [int(x) for x in args.nodes.split(",")]
    names = [w for w in args.workloads.split(",") if w]
    runs = [asyncio.run(run_one(n, w, args)) for w in names for n in sizes]
    rows = [[r["workload"], r["nodes"], r["mode"], r["hit_before"], r["hit_after"], r["kept"], r["target_after"],
             "yes" if r["met"] else "NO", r["victim_probe_share"], r["errors"], r["wrong_bytes"]] for r in runs]
    print_table("token hit rate before and after losing the busiest node",
                ["workload", "N", "loss", "hit before", "hit after", "after/before", "target after", "met",
                 "victim's probe share", "errors", "wrong bytes"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "node_loss.json").write_text(json.dumps(
        {"machine": machine_note(), "args": vars(args) | {"out": str(args.out)}, "runs": runs}, indent=2))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(names), figsize=(5.2 * len(names), 3.8), squeeze=False)
    for ax, w in zip(axes[0], names):
        rs = [r for r in runs if r["workload"] == w]
        xs = range(len(rs))
        ax.bar([x - 0.2 for x in xs], [r["hit_before"] for r in rs], 0.4, label="before the loss")
        ax.bar([x + 0.2 for x in xs], [r["hit_after"] for r in rs], 0.4, label="after the loss")
        ax.scatter([x + 0.2 for x in xs], [r["target_after"] for r in rs], marker="_", s=400, color="red",
                   label="target: before*(N-1)/N - 3 pts", zorder=3)
        ax.set_xticks(list(xs), [f"N={r['nodes']}\n({r['mode']})" for r in rs])
        ax.set_ylim(0, 1)
        ax.set_ylabel("token hit rate")
        ax.set_title(f"{w}: one node lost")
        ax.legend(fontsize=8, loc="lower left")
    save_figure(fig, args.out / "node_loss.png")
    progress(f"wrote {args.out / 'node_loss.json'} and {args.out / 'node_loss.png'}")


if __name__ == "__main__":
    main()

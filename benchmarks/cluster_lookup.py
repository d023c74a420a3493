"""Latency of a long-prompt lookup on a 4-node cluster against one node, in the same run.

    python benchmarks/cluster_lookup.py [--tokens 32768] [--nodes 4] [--reps 60] [--quick]

Starts one single ``prefixstore serve`` process and a cluster of ``--nodes`` processes (static
membership), stores the same data in both and times ``lookup`` (with its lease, then released;
the prompt's hashes computed once, outside the timing), interleaved single / cluster rep by rep so
machine noise hits both. Two prompts:

* ``one branch``: one ``--tokens``-token conversation (one node answers every level);
* ``two branches``: the same length, forking after a ``--system-tokens`` system prompt that three
  other conversations share (the walk asks the system prompt's node, then the conversation's).

Target (issue 16): cluster median <= 1.5 x the single node's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter
import time
from pathlib import Path

import numpy as np

from _cluster import VOCAB, client_config, namespace, payload, rolling, start_processes, stop_processes, tmpdir
from _harness import DEFAULT_OUT, machine_note, print_table, progress, pyplot, save_figure

from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol.placement import rank


async def fill(client: PrefixClient, ns, seqs: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    for tokens in seqs:
        values = rolling(tokens)
        p = client.prompt(tokens)
        res = await client.lookup(p)
        await client.release(res.lease_id)
        start = res.kv_tokens - res.kv_tokens % ns.block_tokens
        saved = await client.save(p, len(tokens), lambda a, b, v=values: payload(ns, v, a, b), start=start)
        if saved.dropped or saved.rejected:
            reasons = Counter(r.text for _, r in saved.results if r.reason)
            raise SystemExit(f"the store did not take the prompt: {saved.stored} stored, {saved.rejected} rejected, "
                             f"{saved.dropped} dropped: {dict(reasons)}")


async def run(args: argparse.Namespace) -> dict[str, object]:
    ns = namespace(args.block_tokens, state=False)
    rng = np.random.default_rng(args.seed)
    system = [int(t) for t in rng.integers(1, VOCAB, args.system_tokens)]
    one = [int(t) for t in rng.integers(1, VOCAB, args.tokens)]
    convs = [system + [int(t) for t in rng.integers(1, VOCAB, args.tokens - args.system_tokens)] for _ in range(8)]
    ram = f"{max(64, (args.tokens * 5 * ns.kv.token_bytes >> 20) * 4 + 64)}MiB"
    with tmpdir("prefixstore-clookup-") as tmp:
        single_urls, single_procs = await asyncio.to_thread(start_processes, 1, ["--ram-bytes", ram], Path(tmp) / "one")
        urls, procs = await asyncio.to_thread(start_processes, args.nodes, ["--ram-bytes", ram], Path(tmp) / "cluster")
        # The two-branch prompt: a conversation whose fork head's branch node is not the system prompt's
        # (ports, hence placement, differ run to run; on the same node the walk is one hop), stored
        # after the others, so it forks (the first conversation stored continues the system prompt's branch).
        fork = args.system_tokens // ns.block_tokens
        def hashes(t: list[int]) -> list[bytes]:
            return Prompt(ns, t[: (fork + 1) * ns.block_tokens]).hashes
        away = [c for c in convs[1:] if rank(urls, hashes(c)[fork])[0] != rank(urls, hashes(c)[0])[0]]
        if away:
            convs = [c for c in convs if c is not away[-1]][:3] + [away[-1]]
        else:
            convs = convs[:4]
        prompts = {"one branch": one, "two branches": convs[-1]}
        try:
            async with PrefixClient(ns, ClientConfig(url=single_urls[0], data_path="http")) as single, \
                    PrefixClient(ns, client_config(urls)) as cluster:
                progress(f"storing {len(convs) + 1} prompts of {args.tokens} tokens in both")
                for c in (single, cluster):
                    await fill(c, ns, [one, *convs])
                times: dict[str, dict[str, list[float]]] = {k: {"single": [], "cluster": []} for k in prompts}
                nodes: dict[str, int] = {}
                for name, tokens in prompts.items():
                    ps = {"single": single.prompt(tokens), "cluster": cluster.prompt(tokens)}
                    for rep in range(args.warmup + args.reps):
                        for who, c in (("single", single), ("cluster", cluster)):
                            t0 = time.perf_counter()
                            res = await c.lookup(ps[who])
                            dt = time.perf_counter() - t0
                            await c.release(res.lease_id)
                            if res.kv_tokens != len(tokens):
                                raise SystemExit(f"{who} {name}: kv_tokens {res.kv_tokens} != {len(tokens)}")
                            if rep >= args.warmup:
                                times[name][who].append(dt)
                        if rep % 20 == 0:
                            progress(f"{name}: rep {rep}/{args.warmup + args.reps}")
                    walk = cluster.impl.last_walk  # type: ignore[attr-defined]
                    nodes[name] = len(walk.nodes)
        finally:
            stop_processes(single_procs + procs)
    out: dict[str, object] = {}
    for name, t in times.items():
        s, c = statistics.median(t["single"]), statistics.median(t["cluster"])
        out[name] = {"single_ms": round(s * 1e3, 3), "cluster_ms": round(c * 1e3, 3), "ratio": round(c / s, 3),
                     "nodes": nodes[name], "single_all_ms": [round(x * 1e3, 3) for x in t["single"]],
                     "cluster_all_ms": [round(x * 1e3, 3) for x in t["cluster"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length in tokens. Default: 32768.")
    parser.add_argument("--system-tokens", type=int, default=8192,
                        help="shared system prompt of the two-branch prompt. Default: 8192.")
    parser.add_argument("--nodes", type=int, default=4, help="cluster nodes (real processes). Default: 4.")
    parser.add_argument("--block-tokens", type=int, default=16, help="store block size B. Default: 16.")
    parser.add_argument("--reps", type=int, default=60, help="timed lookups per prompt and side. Default: 60.")
    parser.add_argument("--warmup", type=int, default=5, help="untimed lookups first. Default: 5.")
    parser.add_argument("--seed", type=int, default=5, help="token seed. Default: 5.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="directory for cluster_lookup.json and cluster_lookup.png. Default: benchmarks/out.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4096 tokens, 10 reps.")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.system_tokens, args.reps = 4096, 1024, 10
    res = asyncio.run(run(args))
    rows = [[name, r["nodes"], r["single_ms"], r["cluster_ms"], r["ratio"], "yes" if r["ratio"] <= 1.5 else "NO"]  # type: ignore[index]
            for name, r in res.items()]
    print_table(f"lookup of a {args.tokens}-token prompt: {args.nodes}-node cluster vs one node (medians, same run)",
                ["prompt", "nodes asked", "single node (ms)", "cluster (ms)", "cluster / single", "<= 1.5x"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_lookup.json").write_text(json.dumps(
        {"machine": machine_note(), "args": vars(args) | {"out": str(args.out)}, "results": res}, indent=2))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(res)
    data = []
    for name in names:
        data += [res[name]["single_all_ms"], res[name]["cluster_all_ms"]]  # type: ignore[index]
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(data) + 1), [f"{n}\n{w}" for n in names for w in ("single", f"{args.nodes} nodes")])
    ax.set_ylabel("lookup latency (ms)")
    ax.set_title(f"{args.tokens}-token lookup: cluster vs one node")
    save_figure(fig, args.out / "cluster_lookup.png")


if __name__ == "__main__":
    main()

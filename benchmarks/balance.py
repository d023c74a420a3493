"""Load balance of a store cluster under a skewed workload, with and without hot-prefix replication.

    python benchmarks/balance.py [--nodes 6] [--requests 3000] [--quick]

Starts N real ``prefixstore serve`` processes on loopback (static membership),
then drives the same request stream twice, once per configuration, each on a
fresh cluster:

* ``no replication``: ``replication_max_replicas = 1``;
* ``replication``: ``replication_max_replicas = N``, threshold and half-life
  scaled to the run (``--threshold``, ``--half-life``).

Workload: every request is a prompt = one of S system prompts (Zipf(1.1), a few
of them hot) + one of U user prefixes (Zipf(1.1)) + a fresh question. The
engine side per request: look up, read every reusable KV entry, save what was
missing. Requests served per node are read from each node's
``prefixstore_requests_total`` (the server's own counter) before and after a
measured window that follows a warm-up; the figure is max/mean over nodes, for
reads (``/v1/get``, the bytes-moving load a hot system prompt concentrates) and
for all requests. Replicas' cost: bytes pushed, from
``prefixstore_replication_bytes_total``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from _cluster import start_processes
from _harness import DEFAULT_OUT, machine_note, print_table, progress

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Namespace, StateLayout



def start_cluster(n: int, knobs: list[str], tmp: Path) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    return start_processes(n, knobs, tmp, page="64KiB")


def counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {"get": 0.0, "all": 0.0, "replication_bytes": 0.0, "stored_bytes": 0.0}
    for m in re.finditer(r'^prefixstore_requests_total\{endpoint="([^"]*)",status="[^"]*"\} (\S+)$', text, re.M):
        out["all"] += float(m.group(2))
        if m.group(1) in ("/v1/get", "/v1/nixl/get"):  # reads on the HTTP or the NIXL data path
            out["get"] += float(m.group(2))
    m = re.search(r"^prefixstore_replication_bytes_total (\S+)$", text, re.M)
    out["replication_bytes"] = float(m.group(1)) if m else 0.0
    m = re.search(r'^prefixstore_stored_bytes\{kind="kv",tier="disk"\} (\S+)$', text, re.M)
    out["stored_bytes"] = float(m.group(1)) if m else 0.0
    return out


def workload(seed: int, requests: int, systems: int, users: int, B: int, system_blocks: int,
             user_blocks: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)

    def zipf_weights(k: int) -> np.ndarray:
        w = 1.0 / np.arange(1, k + 1) ** 1.1
        return w / w.sum()

    sys_prompts = [list(rng.integers(1, 50000, system_blocks * B)) for _ in range(systems)]
    user = [list(rng.integers(1, 50000, user_blocks * B)) for _ in range(users)]
    s_idx = rng.choice(systems, requests, p=zipf_weights(systems))
    u_idx = rng.choice(users, requests, p=zipf_weights(users))
    return [[int(t) for t in sys_prompts[s] + user[u] + list(rng.integers(1, 50000, B // 2))]
            for s, u in zip(s_idx, u_idx)]


async def drive(urls: list[str], ns: Namespace, prompts: list[list[int]], concurrency: int) -> None:
    B = ns.block_tokens
    async with PrefixClient(ns, ClientConfig(urls=tuple(urls), timeout_s=10.0, data_path="http")) as client:
        queue: asyncio.Queue[list[int]] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        token_bytes = ns.kv.token_bytes

        async def worker() -> None:
            while not queue.empty():
                tokens = queue.get_nowait()
                res = await client.lookup(tokens)
                if res.kv_tokens:
                    reads = res.kv_reads(res.kv_tokens)
                    bufs = [bytearray(B * token_bytes) for _ in reads]
                    await client.read([it for it, _, _ in reads], bufs)
                    await client.release(res.lease_id)
                if res.kv_tokens < len(tokens):
                    p = client.prompt(tokens)
                    await client.save(p, len(tokens), lambda a, b: bytes((b - a) * token_bytes),
                                      start=res.kv_tokens - res.kv_tokens % B)

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def run_config(name: str, knobs: list[str], args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, object]:
    ns = Namespace(model="balance", kv=KVLayout(num_layers=2, num_heads=2, head_dim=64), state=StateLayout(),
                   block_tokens=args.block_tokens)
    with tempfile.TemporaryDirectory(prefix="prefixstore-balance-") as tmp:
        urls, procs = start_cluster(args.nodes, knobs, Path(tmp))
        try:
            warm = len(prompts) // 3
            progress(f"{name}: warm-up, {warm} requests on {args.nodes} nodes")
            asyncio.run(drive(urls, ns, prompts[:warm], args.concurrency))
            before = {u: counters(u) for u in urls}
            progress(f"{name}: measuring {len(prompts) - warm} requests")
            started = time.perf_counter()
            asyncio.run(drive(urls, ns, prompts[warm:], args.concurrency))
            seconds = time.perf_counter() - started
            after = {u: counters(u) for u in urls}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(20)
    per_node = {k: [after[u][k] - before[u][k] for u in urls] for k in ("get", "all")}
    result: dict[str, object] = {"config": name, "seconds": round(seconds, 2)}
    for k, v in per_node.items():
        result[f"{k}_per_node"] = v
        result[f"{k}_max_over_mean"] = round(max(v) / (sum(v) / len(v)), 3)
    result["replication_bytes"] = sum(after[u]["replication_bytes"] for u in urls)
    result["stored_bytes"] = sum(after[u]["stored_bytes"] for u in urls)  # KV held, replicas included
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=6, help="store processes (4-8 for the target). Default: 6.")
    parser.add_argument("--requests", type=int, default=3000, help="requests per configuration (a third warms up).")
    parser.add_argument("--systems", type=int, default=8, help="system prompts (Zipf(1.1) over them). Default: 8.")
    parser.add_argument("--users", type=int, default=400, help="user prefixes (Zipf(1.1)). Default: 400.")
    parser.add_argument("--block-tokens", type=int, default=64, help="store block size B. Default: 64.")
    parser.add_argument("--system-blocks", type=int, default=1,
                        help="blocks of each system prompt. Default: 1 (a short hot prefix: the case that "
                             "concentrates load; a long prompt's levels spread over every node anyway).")
    parser.add_argument("--user-blocks", type=int, default=1, help="blocks of each user prefix. Default: 1.")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight. Default: 8.")
    parser.add_argument("--threshold", type=float, default=2.0,
                        help="replication_threshold, reads/s, of the replication run. Default: 2.")
    parser.add_argument("--half-life", type=float, default=2.0,
                        help="replication_half_life_s of the replication run. Default: 2.")
    parser.add_argument("--seed", type=int, default=1234, help="workload seed. Default: 1234.")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for balance.json and balance.png.")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 nodes, 300 requests.")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.requests = 4, 300
    prompts = workload(args.seed, args.requests, args.systems, args.users, args.block_tokens, args.system_blocks,
                       args.user_blocks)
    runs = [
        run_config("no replication", ["--replication-max-replicas", "1"], args, prompts),
        run_config("replication", ["--replication-max-replicas", str(args.nodes), "--replication-threshold",
                                   str(args.threshold), "--replication-half-life-s", str(args.half_life)],
                   args, prompts),
    ]
    rows = [[r["config"], r["get_max_over_mean"], r["all_max_over_mean"], int(r["replication_bytes"]) >> 10,  # type: ignore[operator]
             int(r["stored_bytes"]) >> 10, r["seconds"]] for r in runs]  # type: ignore[operator]
    print_table(f"load balance, {args.nodes} nodes, {args.requests} requests (max/mean of requests served per node)",
                ["config", "reads max/mean", "all requests max/mean", "replica bytes pushed (KiB)",
                 "KV stored, all nodes (KiB)", "seconds"], rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "balance.json").write_text(json.dumps({"machine": machine_note(), "args": vars(args) | {"out": str(args.out)},
                                                      "runs": runs}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    x = np.arange(args.nodes)
    for ax, kind, title in ((axes[0], "get", "reads (/v1/get) per node"), (axes[1], "all", "all requests per node")):
        for k, r in enumerate(runs):
            v = np.array(r[f"{kind}_per_node"], dtype=float)  # type: ignore[arg-type]
            ax.bar(x + (k - 0.5) * 0.4, v / v.mean(), 0.4,
                   label=f"{r['config']} (max/mean {r[f'{kind}_max_over_mean']})")
        ax.axhline(1.3, color="gray", linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("node")
        ax.set_ylabel("served / mean")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "balance.png", dpi=110)
    progress(f"wrote {args.out / 'balance.json'} and {args.out / 'balance.png'}")


if __name__ == "__main__":
    main()

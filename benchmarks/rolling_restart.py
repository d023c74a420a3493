"""What ``helm upgrade`` does to a cluster: a rolling restart under a multi-turn load.

    python benchmarks/rolling_restart.py [--nodes 4] [--conversations 1200] [--quick]

Starts N real ``prefixstore serve`` processes (static membership, each with its own LMDB data
directory, write-behind durability: the defaults) and drives the engine's loop through the real
cluster client (benchmarks/_cluster.py: multi-turn conversations; every request is looked up,
every reusable byte read and verified against what was saved, and what was missing saved), with
``--concurrency`` requests in flight throughout. Requests are labelled by the phase in which they
started:

* **warm-up** (``--warmup`` requests), **before** (``--before``): all N nodes up;
* **during**: the roll. As a StatefulSet's rolling update does (highest ordinal first), each node
  in turn gets SIGTERM (a graceful stop: in-flight requests finish, the write-behind drains into
  LMDB), is started again on its own data directory with the same arguments, and is waited for
  (``/readyz``); then ``--gap-s`` seconds before the next one;
* **after** (``--after``): all N nodes back.

Reported: the token hit rate of each phase and the targets (during >= (N-1)/N of before: a node
is out of the cluster at most one at a time; after >= 95% of before: a restarted node serves what
it committed), errors that reached the engine (exceptions out of the client: must be 0), wrong
bytes read (must be 0), and per node how long its stop and its start took and the entries it held
before the stop and after the start. A JSON file, a PNG (hit rate over time with the restarts
marked; the phases against their targets), a table, and exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import _harness as H
from _cluster import Outcome, client_config, free_ports, hit_rate, multiturn, namespace, serve_request, start_node

from prefixstore.client import PrefixClient

PHASES = ("warm-up", "before", "during", "after")


@dataclass
class Timed:
    phase: str
    started_s: float
    outcome: Outcome


@dataclass
class Restart:
    url: str
    stop_s: float = 0.0  # SIGTERM -> exited
    exit_status: int | None = None
    start_s: float = 0.0  # started -> /readyz 200
    down_at_s: float = 0.0  # since the load started
    up_at_s: float = 0.0
    entries_before: int = 0
    entries_after: int = 0


@dataclass
class Run:
    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    tmp: Path
    args: argparse.Namespace
    t0: float = field(default_factory=time.monotonic)

    def node(self, i: int) -> subprocess.Popen[bytes]:
        return start_node(self.urls[i], self.urls, self.args.serve_flag, self.tmp, ram=self.args.ram,
                          log=self.tmp / f"node-{i}.log")


def ready(url: str, deadline: float) -> None:
    """Poll /readyz (the LMDB tier loaded, the arena mapped) until it answers 200."""
    while True:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"node {url} did not come back")
        time.sleep(0.02)


def entries(url: str) -> int:
    """Committed entries a node holds: those in LMDB plus those still behind the write-behind (an
    entry in RAM and on disk is counted by /v1/stats under both tiers)."""
    with urllib.request.urlopen(url + "/v1/stats", timeout=5) as r:
        stats = json.loads(r.read())
    on_disk = sum(n for key, n in stats["entries"].items() if key.endswith("/disk"))
    return int(on_disk + stats["disk"]["behind"]["entries"])


async def roll(run: Run, restarts: list[Restart]) -> None:
    for i in reversed(range(len(run.urls))):  # a StatefulSet rolls its highest ordinal first
        url = run.urls[i]
        r = Restart(url)
        restarts.append(r)
        r.entries_before = await asyncio.to_thread(entries, url)
        r.down_at_s = time.monotonic() - run.t0
        t = time.monotonic()
        run.procs[i].send_signal(signal.SIGTERM)
        r.exit_status = await asyncio.to_thread(run.procs[i].wait, 60)
        r.stop_s = time.monotonic() - t
        t = time.monotonic()
        run.procs[i] = run.node(i)
        await asyncio.to_thread(ready, url, time.monotonic() + 120)
        r.start_s = time.monotonic() - t
        r.up_at_s = time.monotonic() - run.t0
        r.entries_after = await asyncio.to_thread(entries, url)
        H.progress(f"node {i} ({url}): stopped in {r.stop_s:.2f} s (exit {r.exit_status}), back in "
                   f"{r.start_s:.2f} s, {r.entries_before} entries before, {r.entries_after} after")
        await asyncio.sleep(run.args.gap_s)


async def drive(run: Run, restarts: list[Restart]) -> list[Timed]:
    """The load, phase by phase (module docstring); the roll runs beside it during 'during'."""
    args = run.args
    ns = namespace(args.block_tokens)
    stream = multiturn(args.seed, args.conversations, args.turns)
    it = iter(stream)
    out: list[Timed] = []
    phase = ["warm-up"]
    started = [0]
    stop = asyncio.Event()
    async with PrefixClient(ns, client_config(run.urls)) as client:

        async def worker() -> None:
            for req in it:
                if stop.is_set():
                    return
                label, t = phase[0], time.monotonic() - run.t0
                started[0] += 1
                out.append(Timed(label, t, await serve_request(client, ns, req)))

        async def until(n: int) -> None:
            while started[0] < n:
                if all(w.done() for w in workers):
                    raise SystemExit(f"the stream ran out after {started[0]} requests: raise --conversations")
                await asyncio.sleep(0.01)

        run.t0 = time.monotonic()
        workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        H.progress(f"warm-up: {args.warmup} requests")
        await until(args.warmup)
        phase[0] = "before"
        H.progress(f"before: {args.before} requests")
        await until(args.warmup + args.before)
        phase[0] = "during"
        H.progress(f"during: rolling {len(run.urls)} nodes, one at a time")
        await roll(run, restarts)
        phase[0] = "after"
        mark = started[0]
        H.progress(f"after: {args.after} requests")
        await until(mark + args.after)
        stop.set()
        await asyncio.gather(*workers)
        failures = client.failures
    H.progress(f"client failures turned into misses: {dict(failures) or 'none'}")
    return out


def summarize(timed: list[Timed], restarts: list[Restart], n: int) -> dict[str, object]:
    by = {p: [t.outcome for t in timed if t.phase == p] for p in PHASES}
    rates = {p: hit_rate(by[p]) for p in PHASES}
    before = rates["before"]
    return {
        "nodes": n, "requests": {p: len(by[p]) for p in PHASES},
        "hit_rate": {p: round(rates[p], 4) for p in PHASES},
        "target_during": round(before * (n - 1) / n, 4), "target_after": round(0.95 * before, 4),
        "during_over_before": round(rates["during"] / before, 4) if before else 0.0,
        "after_over_before": round(rates["after"] / before, 4) if before else 0.0,
        "met_during": rates["during"] >= before * (n - 1) / n, "met_after": rates["after"] >= 0.95 * before,
        "errors": sum(1 for t in timed if t.outcome.error),
        "error_examples": sorted({t.outcome.error for t in timed if t.outcome.error})[:5],
        "wrong_bytes": sum(t.outcome.wrong_bytes for t in timed),
        "restarts": [vars(r) for r in restarts],
    }


def plot(timed: list[Timed], restarts: list[Restart], summary: dict[str, object], path: Path) -> None:
    plt = H.pyplot()
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1]})
    end = max(t.started_s for t in timed)
    width = max(1.0, end / 80)
    xs, ys = [], []
    t = 0.0
    while t < end:
        window = [x.outcome for x in timed if t <= x.started_s < t + width]
        if window:
            xs.append(t + width / 2)
            ys.append(hit_rate(window))
        t += width
    ax.plot(xs, ys, lw=1.2)
    for r in restarts:
        ax.axvspan(r.down_at_s, r.up_at_s, color="red", alpha=0.15)
    for phase in ("before", "during", "after"):  # where each phase began
        ax.axvline(min((x.started_s for x in timed if x.phase == phase), default=0.0), color="grey", ls=":", lw=0.8)
    ax.set_xlabel("seconds (dotted: before, during, after begin; red: a node stopped and starting again)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"rolling restart of {summary['nodes']} nodes under a multi-turn load")
    rates = summary["hit_rate"]
    assert isinstance(rates, dict)
    names = ["before", "during", "after"]
    bars.bar(names, [rates[p] for p in names], color=["tab:blue", "tab:orange", "tab:green"])
    bars.scatter(["during", "after"], [summary["target_during"], summary["target_after"]], marker="_", s=600,
                 color="red", zorder=3, label="target")
    bars.set_ylim(0, 1)
    bars.legend(fontsize=8, loc="lower right")
    bars.set_title("token hit rate by phase")
    H.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/rolling_restart.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4, help="Store processes in the cluster. Default: 4.")
    p.add_argument("--conversations", type=int, default=1200,
                   help="Conversations in the stream (each --turns requests); it must outlast the run. Default: 1200.")
    p.add_argument("--turns", type=int, default=5, help="Turns per conversation. Default: 5.")
    p.add_argument("--warmup", type=int, default=800, help="Requests before 'before' starts. Default: 800.")
    p.add_argument("--before", type=int, default=1000, help="Requests measured before the roll. Default: 1000.")
    p.add_argument("--after", type=int, default=1000, help="Requests measured after the roll. Default: 1000.")
    p.add_argument("--gap-s", type=float, default=2.0,
                   help="Seconds between one node being back and the next one's SIGTERM. Default: 2.")
    p.add_argument("--concurrency", type=int, default=8, help="Requests in flight. Default: 8.")
    p.add_argument("--block-tokens", type=int, default=16, help="Store block size B. Default: 16.")
    p.add_argument("--ram", default="64MiB", help="ram_bytes of each node. Default: 64MiB.")
    p.add_argument("--serve-flag", action="append", default=[], metavar="FLAG",
                   help="A flag passed to every prefixstore serve as it is (repeat it; e.g. "
                        "--serve-flag=--durability=sync). Default: none.")
    p.add_argument("--seed", type=int, default=11, help="Workload seed. Default: 11.")
    p.add_argument("--out", type=Path, default=H.DEFAULT_OUT,
                   help="Directory for rolling_restart.json and rolling_restart.png. Default: benchmarks/out.")
    p.add_argument("--quick", action="store_true",
                   help="A smoke run: 4 nodes, 500 conversations, 150/200/200 requests, no gap. Figures are not "
                        "meaningful.")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.warmup, args.before, args.after, args.gap_s = 500, 150, 200, 200, 0.0
    with tempfile.TemporaryDirectory(prefix="prefixstore-roll-") as tmp_name:
        tmp = Path(tmp_name)
        urls = [f"http://127.0.0.1:{port}" for port in free_ports(args.nodes)]
        run = Run(urls, [], tmp, args)
        run.procs = [run.node(i) for i in range(args.nodes)]
        restarts: list[Restart] = []
        try:
            for url in urls:
                ready(url, time.monotonic() + 180)
            H.progress(f"{args.nodes} nodes up: {', '.join(urls)}")
            timed = asyncio.run(drive(run, restarts))
        finally:
            for proc in run.procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in run.procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    summary = summarize(timed, restarts, args.nodes)
    rates = summary["hit_rate"]
    assert isinstance(rates, dict)
    H.print_table(f"token hit rate through a rolling restart of {args.nodes} nodes",
                  ["phase", "requests", "hit rate", "/ before", "target", "met"],
                  [["before", summary["requests"]["before"], rates["before"], 1.0, "", ""],  # type: ignore[index]
                   ["during", summary["requests"]["during"], rates["during"], summary["during_over_before"],  # type: ignore[index]
                    summary["target_during"], "yes" if summary["met_during"] else "NO"],
                   ["after", summary["requests"]["after"], rates["after"], summary["after_over_before"],  # type: ignore[index]
                    summary["target_after"], "yes" if summary["met_after"] else "NO"]])
    H.print_table("each node's restart", ["node", "stop s", "exit", "start s", "entries before", "entries after"],
                  [[r.url, r.stop_s, r.exit_status, r.start_s, r.entries_before, r.entries_after] for r in restarts])
    H.progress(f"errors reaching the engine: {summary['errors']} {summary['error_examples'] or ''}; "
               f"wrong bytes: {summary['wrong_bytes']}")
    H.write_json(args.out, "rolling_restart", {"benchmark": "rolling_restart", "machine": H.machine_note(),
                                               "args": {k: (str(v) if isinstance(v, Path) else v)
                                                        for k, v in vars(args).items()},
                                               "results": [summary]})
    plot(timed, restarts, summary, args.out / "rolling_restart.png")
    ok = summary["met_during"] and summary["met_after"] and not summary["errors"] and not summary["wrong_bytes"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

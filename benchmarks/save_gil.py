"""What a connector's saves cost the engine thread beside them, over NIXL and over HTTP, interleaved.

An engine connector's saves run on the client's event loop, a thread of the engine's own process;
the engine thread releases and retakes the GIL around every torch op, so the client's Python
work competes with it for the GIL. This runs, in one process, an "engine" thread doing small
torch matmuls back to back (each releases the GIL) and counts how many it completes while a
client on the main thread saves fresh chains to a store child process back to back. Modes,
interleaved rep by rep:

* ``alone``: the engine thread with nothing else running (its reference rate);
* ``nixl``: saves over NIXL (reserve, one WRITE, commit), the default data path;
* ``http``: the same saves over HTTP (one POST /v1/put);
* ``http-child``: the same HTTP saves from a child process: the same CPU work on the same cores,
  no GIL shared with the engine thread (the control that tells the GIL from the CPU).

Modes run in a shuffled order each rep, each after the same short pause. Figures: the engine's
matmuls a second in each (and as a share of ``alone``), saves a second, the engine's time each
save took from it ((alone - beside) / alone / saves a second), and the polls a NIXL transfer took (``check_xfer_state`` calls: 0 where the WRITE completes inside its
post call, as UCX's loopback copy does; client/nixl_path.py paces them where it does not).
Writes save_gil.json and save_gil.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from nixl_transfer import Chains, make_namespace

MODES = ("alone", "nixl", "http", "http-child")
PAUSE_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/save_gil.py",
        description="An engine-like thread's torch op rate while a client beside it saves to a store over NIXL "
                    "and over HTTP, interleaved.")
    p.add_argument("--window-s", type=float, default=None,
                   help="Seconds each mode runs per rep. Default: 2 (0.3 with --quick).")
    p.add_argument("--payload-size", type=H.parse_size, default=H.parse_size("64KiB"),
                   help="Payload (block) size of each saved item. Default: 64KiB.")
    p.add_argument("--items", type=int, default=None, help="Items per save. Default: 64 (8 with --quick).")
    p.add_argument("--switch-interval-s", type=float, default=0.0,
                   help="sys.setswitchinterval for the run (what the connector's switch_interval_s sets in a "
                        "worker); 0: Python's default (5 ms). Default: 0.")
    p.add_argument("--matrix", type=int, default=128,
                   help="Side of the engine thread's square float32 matmul (one op). Default: 128.")
    H.add_common_args(p, reps="5 (1 with --quick)", warmup="1 (0 with --quick)")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    args.window_s = args.window_s or (0.3 if args.quick else 2.0)
    args.items = args.items or (8 if args.quick else 64)
    return args


class Engine:
    """A thread doing matmuls back to back while ``running``; ``ops`` counts them."""

    def __init__(self, side: int) -> None:
        import torch

        torch.set_num_threads(1)
        self._a = torch.rand(side, side)
        self._b = torch.rand(side, side)
        for _ in range(200):  # torch's first calls are slower: not in any mode's window
            torch.mm(self._a, self._b)
        self.ops = 0
        self.running = threading.Event()
        self.stopped = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch

        while not self.stopped:
            if not self.running.wait(0.05):
                continue
            torch.mm(self._a, self._b)
            self.ops += 1

    def stop(self) -> None:
        self.stopped = True
        self._thread.join()


class CountedPolls:
    """Wraps the client agent's ``check_xfer_state`` to count polls."""

    def __init__(self, agent: object) -> None:
        self.n = 0
        original = agent.check_xfer_state  # type: ignore[attr-defined]

        def counted(handle: object) -> str:
            self.n += 1
            return str(original(handle))
        agent.check_xfer_state = counted  # type: ignore[attr-defined]


def _child_saves(url: str, payload_size: int, items: int, seed: int, go: Any, stop: Any, count: Any) -> None:
    """``http-child``: HTTP saves back to back, in a process of its own, while ``go`` is set."""
    async def run() -> None:
        ns = make_namespace(payload_size, model="bench-save-gil")
        async with PrefixClient(ns, ClientConfig(url=url, data_path="http", timeout_s=60)) as client:
            chains = Chains(client, items, payload_size, seed)
            while not stop.is_set():
                if not go.wait(0.05):
                    continue
                _, batch = chains.fresh()
                results = await client.put(batch)
                if any(r.status != "ok" for r in results):
                    raise SystemExit(f"a save from the child failed: {[r.status for r in results][:4]}")
                with count.get_lock():
                    count.value += 1
    asyncio.run(run())


class Child:
    """The ``http-child`` process and its switches."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        ctx = mp.get_context("spawn")
        self.go, self.stop, self.count = ctx.Event(), ctx.Event(), ctx.Value("q", 0)
        self.proc = ctx.Process(target=_child_saves, daemon=True,
                                args=(url, args.payload_size, args.items, args.seed + 7, self.go, self.stop, self.count))
        self.proc.start()

    def close(self) -> None:
        self.stop.set()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


async def run_mode(mode: str, engine: Engine, clients: dict[str, PrefixClient], chains: dict[str, Chains],
                   window_s: float, polls: CountedPolls, child: Child) -> dict[str, float]:
    saves = 0
    polls.n = 0
    if mode == "http-child":
        child.go.set()  # the child starts first; its first save is not in the window
        before_child = child.count.value
        while child.count.value == before_child:
            await asyncio.sleep(0.005)
        before_child = child.count.value
    before = engine.ops
    engine.running.set()
    started = time.perf_counter()
    try:
        if mode in ("alone", "http-child"):
            await asyncio.sleep(window_s)
        else:
            while time.perf_counter() - started < window_s:
                _, items = chains[mode].fresh()
                results = await clients[mode].put(items)
                if any(r.status != "ok" for r in results):
                    raise SystemExit(f"a save over {mode} failed: {[r.status for r in results][:4]}")
                saves += 1
    finally:
        engine.running.clear()
        took = time.perf_counter() - started
        if mode == "http-child":
            saves = child.count.value - before_child
            child.go.clear()
    return {"engine_ops_per_s": (engine.ops - before) / took, "saves_per_s": saves / took,
            "polls_per_save": polls.n / saves if saves and mode == "nixl" else 0.0}


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.progress(f"machine: {H.machine_note()}")
    if args.switch_interval_s > 0:
        sys.setswitchinterval(args.switch_interval_s)
    H.progress(f"switch interval {sys.getswitchinterval() * 1e3:g} ms")
    ns = make_namespace(args.payload_size, model="bench-save-gil")
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    engine = Engine(args.matrix)
    try:
        async with H.serve_store("subprocess", ram_bytes=max(256 << 20, 8 * args.items * args.payload_size),
                                 page_bytes=64 << 10, tier="ram", nixl="on") as rs:
            async with PrefixClient(ns, ClientConfig(url=rs.url, data_path="nixl", timeout_s=60)) as nixl, \
                    PrefixClient(ns, ClientConfig(url=rs.url, data_path="http", timeout_s=60)) as http:
                clients = {"nixl": nixl, "http": http}
                chains = {name: Chains(c, args.items, args.payload_size, args.seed + i)
                          for i, (name, c) in enumerate(clients.items())}
                for name, c in clients.items():
                    _, items = chains[name].fresh()
                    await c.put(items)  # connects (the NIXL path: metadata, registration)
                channel = getattr(getattr(nixl.impl, "data", None), "channel", None)
                if channel is None or nixl.impl.data.name != "nixl":
                    raise SystemExit("the NIXL client did not take the NIXL path: is nixl installed?")
                polls = CountedPolls(channel.path.agent)
                child = Child(rs.url, args)
                shuffle = np.random.default_rng(args.seed)
                try:
                    for rep in range(args.warmup + args.reps):
                        line = []
                        for mode in [MODES[i] for i in shuffle.permutation(len(MODES))]:
                            await asyncio.sleep(PAUSE_S)
                            got = await run_mode(mode, engine, clients, chains, args.window_s, polls, child)
                            if rep >= args.warmup:
                                for k, v in got.items():
                                    samples[mode].setdefault(k, []).append(v)
                            line.append(f"{mode} {got['engine_ops_per_s']:.0f} ops/s, {got['saves_per_s']:.1f} saves/s")
                        H.progress(f"rep {rep + 1}/{args.warmup + args.reps}: " + "; ".join(line))
                finally:
                    child.close()
    finally:
        engine.stop()
    med = {m: {k: float(np.median(v)) for k, v in samples[m].items()} for m in MODES}
    alone = med["alone"]["engine_ops_per_s"]
    for m in MODES:  # the engine's time each save took from it
        saves = med[m]["saves_per_s"]
        med[m]["engine_ms_per_save"] = (alone - med[m]["engine_ops_per_s"]) / alone / saves * 1e3 if saves else 0.0
    rows = [[m, round(med[m]["engine_ops_per_s"]), f"{med[m]['engine_ops_per_s'] / alone:.0%}",
             round(med[m]["saves_per_s"], 1), round(med[m]["engine_ms_per_save"], 2),
             round(med[m]["polls_per_save"], 1)] for m in MODES]
    table = H.print_table(f"engine thread beside saves of {args.items} x {args.payload_size >> 10} KiB "
                          f"(medians of {args.reps} reps, {args.window_s:g} s each; {os.cpu_count()} CPUs)",
                          ["mode", "engine matmuls/s", "of alone", "saves/s", "engine ms per save", "polls/save"],
                          rows)
    ratio = {m: med[m]["engine_ops_per_s"] / alone for m in MODES[1:]}
    print("engine rate beside saves, of alone: " + ", ".join(f"{m} {r:.2f}x" for m, r in ratio.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(MODES, [med[m]["engine_ops_per_s"] for m in MODES], color=["#8c8c8c", "#4c72b0", "#55a868", "#a1c9f4"])
    axes[0].set_ylabel("engine matmuls / s (median)")
    axes[0].set_title("the engine thread", fontsize=9)
    axes[1].bar(MODES[1:], [med[m]["saves_per_s"] for m in MODES[1:]], color=["#4c72b0", "#55a868", "#a1c9f4"])
    axes[1].set_ylabel("saves / s (median)")
    axes[1].set_title(f"saves of {args.items} x {args.payload_size >> 10} KiB", fontsize=9)
    fig.suptitle("an engine thread beside a client's saves", fontsize=10)
    H.save_figure(fig, args.out / "save_gil.png")
    H.write_json(args.out, "save_gil", {"benchmark": "save_gil", "argv": sys.argv[1:], "machine": H.machine_note(),
                                         "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                         "medians": med, "samples": samples, "engine_rate_of_alone": ratio,
                                         "table_markdown": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

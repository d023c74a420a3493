"""An engine's first save, with the data path set up at start (``PrefixClient.prepare``) and without.

A client imports nixl and makes its NIXL agent when it first needs it. Done at the first save or
load, that transfer pays for the set-up (about half a second here, mostly UCX's start-up), and
the import holds the GIL long enough to stall the process's other threads: in an engine, the
forward pass of every request then running. The vLLM worker now calls ``prepare()`` as the
engine starts (client/vllm/worker.py), so the first save finds the agent made.

Each sample is a fresh process (an agent is made once a process), against one store process:
a "forward pass" thread sleeps 1 ms at a time and records the longest gap between its wake-ups,
while the main thread makes a client, in mode ``prepared`` calls ``prepare()`` (then waits
``--settle-s``, off the clock), and times its first save of ``--items`` payloads. Modes
alternate in a shuffled order each rep. Figures (medians over reps): the first save's time, the
longest stall of the other thread during it, and, for ``prepared``, what ``prepare()`` itself
took at start and the longest stall during it (the stall moves to the engine's start, where no
request is running; it does not go away). Writes first_transfer.json and first_transfer.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from nixl_transfer import Chains, make_namespace

MODES = ("lazy", "prepared")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/first_transfer.py",
        description="A fresh client's first save over NIXL, with its data path set up beforehand (prepare) "
                    "and without, each in a fresh process, interleaved.")
    p.add_argument("--payload-size", type=H.parse_size, default=H.parse_size("16KiB"),
                   help="Payload (block) size of each saved item. Default: 16KiB.")
    p.add_argument("--items", type=int, default=20, help="Items in the first save. Default: 20.")
    p.add_argument("--settle-s", type=float, default=0.5,
                   help="Seconds between prepare() and the first save (an engine's start-up). Default: 0.5.")
    p.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)  # one sample (internal)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    H.add_common_args(p, reps="7 (2 with --quick)", warmup="1 (0 with --quick)")
    args = p.parse_args(argv)
    args.reps = args.reps or (2 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    return args


class Ticker:
    """A thread that sleeps 1 ms at a time: the longest gap between its wake-ups since ``reset``."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def reset(self) -> None:
        self.longest = 0.0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def one_sample(args: argparse.Namespace) -> dict[str, float]:
    """In a fresh process: a client's first save, prepared or not."""
    import torch  # noqa: F401 -- an engine's process has torch loaded (nixl looks for it as it loads)

    ticker = Ticker()
    ns = make_namespace(args.payload_size, model="bench-first-transfer")
    out: dict[str, float] = {}
    try:
        async with PrefixClient(ns, ClientConfig(url=args.url, timeout_s=60)) as client:
            chains = Chains(client, args.items, args.payload_size, args.seed)  # a seed of its own: new keys
            _, items = chains.fresh()
            if args.child == "prepared":
                ticker.reset()
                started = time.perf_counter()
                if not await client.prepare():
                    raise SystemExit("prepare() found no NIXL path: is nixl installed, does the store serve it?")
                out["prepare_ms"] = (time.perf_counter() - started) * 1e3
                out["prepare_stall_ms"] = ticker.longest * 1e3
                await asyncio.sleep(args.settle_s)
            ticker.reset()
            started = time.perf_counter()
            results = await client.put(items)
            out["first_save_ms"] = (time.perf_counter() - started) * 1e3
            out["longest_stall_ms"] = ticker.longest * 1e3
            if any(r.status != "ok" for r in results) or client.data_path != "nixl":
                raise SystemExit(f"the first save failed or took {client.data_path}: {[r.status for r in results][:4]}")
    finally:
        ticker.stop()
    return out


def run_child(mode: str, url: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--url", url,
           "--payload-size", str(args.payload_size), "--items", str(args.items), "--settle-s", str(args.settle_s),
           "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} sample failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(await one_sample(args)))
        return 0
    H.progress(f"machine: {H.machine_note()}")
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    shuffle = np.random.default_rng(args.seed)
    async with H.serve_store("subprocess", ram_bytes=256 << 20, page_bytes=16 << 10, tier="ram", nixl="on") as rs:
        for rep in range(args.warmup + args.reps):
            line = []
            for i in shuffle.permutation(len(MODES)):
                mode = MODES[i]
                got = await asyncio.to_thread(run_child, mode, rs.url, args.seed + 10 * rep + int(i), args)
                if rep >= args.warmup:
                    for k, v in got.items():
                        samples[mode].setdefault(k, []).append(v)
                line.append(f"{mode}: first save {got['first_save_ms']:.1f} ms, longest stall "
                            f"{got['longest_stall_ms']:.1f} ms")
            H.progress(f"rep {rep + 1}/{args.warmup + args.reps}" + (" (warm-up)" if rep < args.warmup else "")
                       + ": " + "; ".join(line))
    med = {m: {k: float(np.median(v)) for k, v in samples[m].items()} for m in MODES}
    rows = [[m, round(med[m]["first_save_ms"], 1), round(med[m]["longest_stall_ms"], 1),
             round(med[m]["prepare_ms"], 1) if "prepare_ms" in med[m] else "-",
             round(med[m]["prepare_stall_ms"], 1) if "prepare_stall_ms" in med[m] else "-"] for m in MODES]
    table = H.print_table(f"a fresh process's first save of {args.items} x {args.payload_size >> 10} KiB over NIXL "
                          f"(medians of {args.reps} reps)",
                          ["mode", "first save ms", "longest stall of another thread ms", "prepare() at start ms",
                           "longest stall during prepare() ms"],
                          rows)
    ratios = {"first_save_lazy_over_prepared": med["lazy"]["first_save_ms"] / med["prepared"]["first_save_ms"],
              "stall_lazy_over_prepared": med["lazy"]["longest_stall_ms"] / med["prepared"]["longest_stall_ms"]}
    print("lazy / prepared: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, key, label in ((axes[0], "first_save_ms", "first save (ms, median)"),
                           (axes[1], "longest_stall_ms", "longest stall of another thread (ms)")):
        ax.bar(MODES, [med[m][key] for m in MODES], color=["#c44e52", "#4c72b0"])
        ax.set_ylabel(label)
    fig.suptitle("a fresh client's first save: agent made at the save (lazy) or at start (prepared)", fontsize=9)
    H.save_figure(fig, args.out / "first_transfer.png")
    H.write_json(args.out, "first_transfer", {
        "benchmark": "first_transfer", "argv": sys.argv[1:], "machine": H.machine_note(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "medians": med, "samples": samples, "ratios": ratios, "table_markdown": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

"""A save's round trips: ``client.save`` with and without an offer first, over NIXL and HTTP, interleaved.

Modes, each saving fresh chains of ``--blocks`` blocks of ``--payload-size`` (the default, 20 x 16
KiB, is a tiny-model save in benchmarks/vllm_serving.py) to one store child process, back to back:

* ``nixl-offered``: offer, then the wanted items over NIXL (reserve, WRITE, commit): what a save
  did before, and what client code calling ``offer`` and ``put`` itself does;
* ``nixl-reserve``: ``client.save`` over NIXL with ``small_save_bytes`` 1 (every batch above it):
  no offer, the reserve decides each item before any byte moves (client/node.py
  ``NodeClient.save``);
* ``small-put``: ``client.save`` from the same kind of NIXL client with ``small_save_bytes`` 1 MiB
  (the vLLM connector's setting): a save up to 1 MiB is one HTTP put, no offer;
* ``http-offered``: ``client.save`` over HTTP (``data_path=http``): offer, then one HTTP put.

Modes run in a shuffled order each rep, each after the same pause. Figures per mode (medians over
reps): wall time of one save, the client's CPU time per save (this process), and the store's (its
``process_cpu_seconds_total``): on a machine whose cores the engine also needs, the CPU is what a
save takes from decoding. Ratios against ``nixl-offered``. Writes save_offer.json and
save_offer.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import time

import aiohttp
import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol.errors import ItemStatus
from nixl_transfer import make_namespace

MODES = ("nixl-offered", "nixl-reserve", "small-put", "http-offered")
BASELINE = "nixl-offered"
SMALL_SAVE_BYTES = 1 << 20
PAUSE_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/save_offer.py",
        description="A save's round trips: client.save with and without an offer first, over NIXL and HTTP, "
                    "interleaved: wall time and client / store CPU per save.")
    p.add_argument("--payload-size", type=H.parse_size, default=16 << 10,
                   help="Bytes of each saved block. Default: 16KiB.")
    p.add_argument("--blocks", type=int, default=20, help="Blocks per save. Default: 20.")
    p.add_argument("--saves", type=int, default=None, help="Saves per mode per rep. Default: 200 (20 with --quick).")
    H.add_common_args(p, reps="7 (1 with --quick)", warmup="1")
    args = p.parse_args(argv)
    args.saves = args.saves or (20 if args.quick else 200)
    args.reps = args.reps or (1 if args.quick else 7)
    args.warmup = 1 if args.warmup is None else args.warmup
    return args


class Saver:
    """Fresh chains (new tokens, so new keys), payloads sliced from one region, as an engine's
    saves slice a staging buffer."""

    def __init__(self, client: PrefixClient, blocks: int, payload_size: int, seed: int) -> None:
        self.client = client
        self.rng = np.random.default_rng(seed)
        self.B = client.namespace.block_tokens
        self.blocks = blocks
        self.source = self.rng.integers(0, 256, blocks * payload_size, dtype=np.uint8)
        self.size = payload_size

    def payload(self, a: int, b: int) -> memoryview:
        return self.source.data[a // self.B * self.size : b // self.B * self.size]

    async def save(self, offered: bool) -> None:
        tokens = [int(t) for t in self.rng.integers(0, 1 << 30, self.blocks * self.B)]
        prompt = self.client.prompt(tokens)
        if offered:
            specs = prompt.kv_items(len(tokens))
            decisions = await self.client.offer([s for s, _, _ in specs])
            wanted = [(s, self.payload(a, b)) for (s, a, b), d in zip(specs, decisions) if d.status is ItemStatus.WANT]
            stored = sum(r.status is ItemStatus.OK for r in await self.client.put(wanted))
        else:
            stored = (await self.client.save(prompt, len(tokens), self.payload)).stored
        if stored != self.blocks:
            raise SystemExit(f"a save stored {stored} of {self.blocks} blocks")


async def store_cpu_s(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(r"^process_cpu_seconds_total (\S+)$", text, re.MULTILINE)
    if m is None:
        raise SystemExit("the store's /metrics has no process_cpu_seconds_total")
    return float(m.group(1))


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.progress(f"machine: {H.machine_note()}")
    ns = make_namespace(args.payload_size, model="bench-save-offer")
    samples: dict[str, dict[str, list[float]]] = {m: {"wall_ms": [], "client_cpu_ms": [], "store_cpu_ms": []}
                                                  for m in MODES}
    ram = max(256 << 20, 4 * args.saves * args.blocks * args.payload_size)
    async with H.serve_store("subprocess", ram_bytes=ram, page_bytes=16 << 10, tier="ram", nixl="on") as rs, \
            aiohttp.ClientSession() as session:
        configs = {"nixl-offered": ("nixl", 0), "nixl-reserve": ("nixl", 1), "small-put": ("nixl", SMALL_SAVE_BYTES),
                   "http-offered": ("http", 0)}
        async with contextlib.AsyncExitStack() as stack:
            savers: dict[str, Saver] = {}
            for i, (mode, (path, small)) in enumerate(configs.items()):
                client = await stack.enter_async_context(PrefixClient(ns, ClientConfig(
                    url=rs.url, data_path=path, small_save_bytes=small, timeout_s=60)))
                savers[mode] = Saver(client, args.blocks, args.payload_size, args.seed + i)
                client.register_buffer(savers[mode].source)  # as an engine registers its staging region
                await client.prepare()
                await savers[mode].save(offered=False)  # connects (metadata, registration)
                if client.data_path != path:
                    raise SystemExit(f"{mode}: the client took {client.data_path}, not {path}: is nixl installed?")
            shuffle = np.random.default_rng(args.seed + 1)
            for rep in range(args.warmup + args.reps):
                line = []
                for mode in [MODES[i] for i in shuffle.permutation(len(MODES))]:
                    await asyncio.sleep(PAUSE_S)
                    store0, cpu0 = await store_cpu_s(session, rs.url), time.process_time()
                    walls = []
                    for _ in range(args.saves):
                        t = time.perf_counter()
                        await savers[mode].save(offered=mode == "nixl-offered")
                        walls.append(time.perf_counter() - t)
                    client_s = time.process_time() - cpu0
                    store = await store_cpu_s(session, rs.url) - store0
                    got = {"wall_ms": float(np.median(walls)) * 1e3, "client_cpu_ms": client_s / args.saves * 1e3,
                           "store_cpu_ms": store / args.saves * 1e3}
                    if rep >= args.warmup:
                        for k, v in got.items():
                            samples[mode][k].append(v)
                    line.append(f"{mode} {got['wall_ms']:.2f} ms, cpu {got['client_cpu_ms']:.2f} + "
                                f"{got['store_cpu_ms']:.2f} ms")
                H.progress(f"rep {rep + 1}/{args.warmup + args.reps}: " + "; ".join(line))
            paths = {m: dict(sv.client.path_bytes) for m, sv in savers.items()}  # which road each mode's bytes took
    med = {m: {k: float(np.median(v)) for k, v in samples[m].items()} for m in MODES}
    rows = [[m, round(med[m]["wall_ms"], 3), round(med[m]["client_cpu_ms"], 3), round(med[m]["store_cpu_ms"], 3),
             round(med[m]["client_cpu_ms"] + med[m]["store_cpu_ms"], 3)] for m in MODES]
    table = H.print_table(f"one save of {args.blocks} x {args.payload_size >> 10} KiB "
                          f"(medians of {args.reps} reps of {args.saves} saves)",
                          ["mode", "wall ms", "client CPU ms", "store CPU ms", "CPU ms in all"], rows)
    cpu = {m: med[m]["client_cpu_ms"] + med[m]["store_cpu_ms"] for m in MODES}
    ratios = {m: {"wall": med[m]["wall_ms"] / med[BASELINE]["wall_ms"], "cpu": cpu[m] / cpu[BASELINE]}
              for m in MODES if m != BASELINE}
    print(f"against {BASELINE}: " + "; ".join(f"{m} wall {r['wall']:.2f}x, CPU {r['cpu']:.2f}x"
                                             for m, r in ratios.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].bar(MODES, [med[m]["wall_ms"] for m in MODES], color=["#4c72b0", "#8c8c8c", "#55a868", "#a1c9f4"])
    axes[0].set_ylabel("ms per save (median)")
    axes[0].set_title("wall time", fontsize=9)
    axes[1].bar(MODES, [med[m]["client_cpu_ms"] for m in MODES], color="#4c72b0", label="client")
    axes[1].bar(MODES, [med[m]["store_cpu_ms"] for m in MODES], bottom=[med[m]["client_cpu_ms"] for m in MODES],
                color="#dd8452", label="store")
    axes[1].set_ylabel("CPU ms per save")
    axes[1].set_title("CPU", fontsize=9)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"one save of {args.blocks} x {args.payload_size >> 10} KiB, with and without an offer first",
                 fontsize=10)
    H.save_figure(fig, args.out / "save_offer.png")
    H.write_json(args.out, "save_offer", {
        "machine": H.machine_note(), "args": {k: str(v) for k, v in vars(args).items()},
        "medians": med, "ratios": ratios, "path_bytes": paths, "samples": samples, "table_markdown": table})
    H.progress(f"wrote {args.out / 'save_offer.png'} and save_offer.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

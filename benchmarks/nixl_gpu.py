"""NIXL READs straight into GPU memory, against the host path and HTTP, in one run (needs CUDA).

Against one store child process (NIXL on, RAM tier), per payload size (default 1 MiB and
64 KiB, batches of ``--batch-bytes``), the median over ``--reps`` of, interleaved rep by rep:

================  ======================================================================
vram GET          ``PrefixClient.read_device``: POST /v1/nixl/get, one READ of the batch
                  into a CUDA region registered once as VRAM, POST /v1/release (the bytes
                  are proven by the lease; client/device.py: a client with
                  verify_checksums=False, as READs into GPU memory require)
host GET + H2D    ``PrefixClient.read`` over NIXL into a pinned host region registered once
                  (xxh3 verified), then one copy of the batch to the GPU
http GET + H2D    the same over HTTP (POST /v1/get streamed into the pinned region), then
                  the copy to the GPU
raw READ -> VRAM  two bare agents: one READ of one contiguous host region of the batch's
                  size into GPU memory, nothing else
raw READ -> host  the same into host memory (the CPU benchmark's baseline)
================  ======================================================================

Then the full load of a ``--prefix-tokens`` prefix into a GPU staging region
(``StagingBuffer.receive``: lookup, reads, release) three ways: NIXL READs into the device slots
(``device_reads=True``), NIXL READs into the pinned host mirror plus one copy up (the default),
and HTTP into the mirror plus the copy, in milliseconds. Every path's bytes are checked
against what was stored before timing starts. Writes nixl_gpu.json and nixl_gpu.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from pathlib import Path


import _harness as H
import nixl_transfer as NT
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.device import DeviceBuffer
from prefixstore.protocol import Kind, make_entry_key
from prefixstore.protocol.wire import GetItem

OPS = ["vram_get", "host_get_h2d", "http_get_h2d", "raw_vram", "raw_host"]
LABELS = {"vram_get": "NIXL READ -> VRAM", "host_get_h2d": "NIXL -> host + H2D", "http_get_h2d": "HTTP + H2D",
          "raw_vram": "raw READ -> VRAM", "raw_host": "raw READ -> host"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/nixl_gpu.py",
        description="NIXL GET straight into GPU memory vs NIXL into host memory plus a copy to the GPU vs\n"
                    "HTTP plus the copy, with raw agent-to-agent READs into VRAM and host memory as\n"
                    "baselines, and the full load of a long prefix into a GPU staging region; one store\n"
                    "child process, one run. Needs CUDA (torch with a GPU) and nixl.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    NT.add_batch_args(p, "Payload bytes per GET (one batch) and the raw READs' region size")
    p.add_argument("--prefix-tokens", type=int, default=131_072,
                   help=f"Tokens of the prefix whose load into GPU staging is timed (4 KiB a token, blocks of "
                        f"{NT.PREFIX_BLOCK_TOKENS}); 8,192 with --quick; 0 skips it. Default: 131072.")
    p.add_argument("--device", default="0",
                   help="CUDA device index, or 'cpu': host memory stands in for GPU memory (the same calls, "
                        "DeviceBuffer(memory='DRAM'); checks the script on machines without a GPU, figures "
                        "meaningless). Default: 0.")
    H.add_common_args(p, reps="9 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix_tokens = min(args.prefix_tokens, 8192)
    NT.finish_batch_args(p, args)
    if args.prefix_tokens % NT.PREFIX_BLOCK_TOKENS:
        p.error(f"--prefix-tokens: must be a multiple of {NT.PREFIX_BLOCK_TOKENS}")
    if args.device != "cpu" and not args.device.isdigit():
        p.error(f"--device: a CUDA device index or 'cpu', got {args.device!r}")
    return args


class Device:
    """The GPU under test, or host memory standing in for it (--device cpu)."""

    def __init__(self, arg: str) -> None:
        import torch

        self.torch = torch
        self.cuda = arg != "cpu"
        self.index = int(arg) if self.cuda else None
        self.dev = torch.device(f"cuda:{arg}" if self.cuda else "cpu")

    def buffer(self, tensor) -> DeviceBuffer:  # type: ignore[no-untyped-def]
        if self.cuda:
            return DeviceBuffer.of(tensor)
        return DeviceBuffer(int(tensor.data_ptr()), tensor.numel() * tensor.element_size(), memory="DRAM")

    def host(self, nbytes: int):  # type: ignore[no-untyped-def]
        return self.torch.zeros(nbytes, dtype=self.torch.uint8, pin_memory=self.cuda)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    def name(self) -> str:
        return self.torch.cuda.get_device_name(self.dev) if self.cuda else "cpu (host memory standing in)"


async def bench_size(url: str, size: int, args: argparse.Namespace, raw_vram: NT.RawNixl,
                     raw_host: NT.RawNixl) -> dict[str, object]:
    import torch

    device = Device(args.device)
    dev = device.dev
    ns = NT.make_namespace(size)
    n = args.batch_bytes // size
    total = n * size
    H.progress(f"{size >> 10} KiB: {n} x {size >> 10} KiB = {total / 2**20:.0f} MiB a batch")
    # READs into GPU memory are proven by their lease alone: only a client that turned hashing off
    # may make them (ClientConfig.device_reads, docs/nixl.md). The host paths hash as always.
    async with PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl",
                                             verify_checksums=False)) as trusting, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="http")) as http:
        chains = NT.Chains(http, n, size, args.seed)
        _, get_set = chains.fresh()
        if any(r.status != "ok" for r in await http.put(get_set)):
            raise SystemExit(f"{size}: set-up put failed ({dict(http.failures)})")
        items = [GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec, _ in get_set]
        gpu = torch.zeros(total, dtype=torch.uint8, device=dev)
        host = device.host(total)
        whole = device.buffer(gpu)
        trusting.register_buffer(whole)
        nixl.register_buffer(host.numpy())
        dev_outs = [whole.slice(j * size, size) for j in range(n)]
        host_outs = [host.numpy()[j * size : (j + 1) * size] for j in range(n)]
        source = torch.from_numpy(chains.source)

        async def vram() -> list[int]:
            return await trusting.read_device(items, dev_outs)

        async def via_host(client: PrefixClient) -> list[int]:
            got = await client.read(items, host_outs)
            gpu.copy_(host)  # blocking: the batch is on the GPU when this returns
            return got

        for name, call in (("vram", vram), ("nixl host", lambda: via_host(nixl)), ("http", lambda: via_host(http))):
            gpu.zero_()
            got = await call()
            if got != [size] * n or not torch.equal(gpu.cpu(), source):
                raise SystemExit(f"{size}: {name} read-back failed ({dict(nixl.failures)} {dict(http.failures)})")
        samples = {op: H.Samples(op) for op in OPS}
        clock = time.perf_counter
        gc.collect()
        for rep in range(args.warmup + args.reps):
            times: dict[str, float] = {}
            for op, call in (("vram_get", vram), ("host_get_h2d", lambda: via_host(nixl)),
                             ("http_get_h2d", lambda: via_host(http))):
                device.sync()
                t = clock()
                got = await call()
                device.sync()
                times[op] = clock() - t
                if got != [size] * n:
                    raise SystemExit(f"{size}: {op} failed ({dict(nixl.failures)} {dict(http.failures)})")
            times["raw_vram"] = await raw_vram.read()
            times["raw_host"] = await raw_host.read()
            if rep >= args.warmup:
                for op, v in times.items():
                    samples[op].add(v)
                H.progress(f"{size >> 10} KiB rep {rep - args.warmup + 1}/{args.reps}: "
                           + ", ".join(f"{LABELS[op]} {total / v / 1e9:.2f}" for op, v in times.items()) + " GB/s")
        for client in (nixl, trusting):
            if client.failures:
                raise SystemExit(f"a NIXL client counted failures: {dict(client.failures)}")
    figures = {op: {"median_gbps": total / s.median / 1e9, "p10_gbps": total / s.quantile(0.9) / 1e9,
                    "p90_gbps": total / s.quantile(0.1) / 1e9, "median_ms": s.median * 1e3, "n": len(s.values)}
               for op, s in samples.items()}
    med = {op: s.median for op, s in samples.items()}
    ratios = {"vram_to_raw_vram": med["raw_vram"] / med["vram_get"],
              "vram_to_host_h2d": med["host_get_h2d"] / med["vram_get"],
              "vram_to_http_h2d": med["http_get_h2d"] / med["vram_get"],
              "raw_vram_to_raw_host": med["raw_host"] / med["raw_vram"]}
    return {"payload_bytes": size, "batch_items": n, "batch_bytes": total, "figures": figures, "ratios": ratios}


async def bench_prefix(url: str, args: argparse.Namespace) -> dict[str, object]:
    import torch

    from prefixstore.gpu_staging.staging import StagingBuffer

    device = Device(args.device)
    dev = device.dev
    ns = NT.prefix_namespace()
    num_blocks = args.prefix_tokens // NT.PREFIX_BLOCK_TOKENS
    total = num_blocks * ns.block_bytes
    H.progress(f"prefix: {args.prefix_tokens} tokens = {num_blocks} blocks = {total / 2**20:.0f} MiB into GPU staging")
    result: dict[str, object] = {"tokens": args.prefix_tokens, "blocks": num_blocks, "bytes": total}
    async with PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl", device_reads=True,
                                             verify_checksums=False)) as vram, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="http")) as http:
        chains = NT.Chains(http, num_blocks, ns.block_bytes, args.seed + 1, NT.PREFIX_BLOCK_TOKENS)
        tokens, stored = chains.fresh()
        if any(r.status != "ok" for r in await http.put(stored)):
            raise SystemExit(f"prefix: set-up put failed ({dict(http.failures)})")
        source = torch.from_numpy(chains.source)
        clients = {"vram": vram, "nixl": nixl, "http": http}
        staging = {name: StagingBuffer(total, device=dev) for name in clients}
        samples = {name: H.Samples(name) for name in clients}
        for rep in range(args.warmup + args.reps):
            for name, client in clients.items():
                buf = staging[name]
                buf.register_with(client)
                device.sync()
                t = time.perf_counter()
                looked = await client.lookup(tokens)
                reads = looked.kv_reads(looked.kv_tokens)
                slots = buf.carve([ns.block_bytes] * len(reads))
                filled = await buf.receive(client, [r[0] for r in reads], slots)
                await client.release(looked.lease_id)
                device.sync()
                elapsed = time.perf_counter() - t
                if looked.kv_tokens != args.prefix_tokens or not all(filled):
                    raise SystemExit(f"prefix: {name} load incomplete ({dict(client.failures)})")
                if rep == 0 and not torch.equal(buf.region.cpu(), source):
                    raise SystemExit(f"prefix: {name} loaded other bytes")
                if rep >= args.warmup:
                    samples[name].add(elapsed)
            H.progress(f"prefix rep {rep + 1}/{args.warmup + args.reps}: "
                       + ", ".join(f"{n} {s.values[-1] * 1e3:.0f} ms" for n, s in samples.items() if s.values))
        for name in ("vram", "nixl"):
            if clients[name].path_bytes["http"]:
                raise SystemExit(f"prefix: the {name} client read {clients[name].path_bytes['http']} bytes over HTTP")
    for path, s in samples.items():
        result[path] = {**s.summary_ms(), "gbps": total / s.median / 1e9}
    result["speedup"] = samples["http"].median / samples["nixl"].median
    result["vram_speedup"] = samples["http"].median / samples["vram"].median
    return result


def plot(results: list[dict[str, object]], prefix: dict[str, object] | None, path: Path, gpu: str) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 2 if prefix else 1, figsize=(12 if prefix else 8, 4), squeeze=False)
    ax = axes[0][0]
    colors = {"vram_get": "#4c72b0", "host_get_h2d": "#9db4d8", "http_get_h2d": "#c44e52",
              "raw_vram": "#555555", "raw_host": "#aaaaaa"}
    width = 0.8 / len(OPS)
    for i, op in enumerate(OPS):
        xs = [k + (i - (len(OPS) - 1) / 2) * width for k in range(len(results))]
        fs = [r["figures"][op] for r in results]  # type: ignore[index]
        ys = [f["median_gbps"] for f in fs]
        ax.bar(xs, ys, width, color=colors[op], label=LABELS[op],
               yerr=[[f["median_gbps"] - f["p10_gbps"] for f in fs], [f["p90_gbps"] - f["median_gbps"] for f in fs]],
               capsize=2)
        if op == "vram_get":
            for x, y, r in zip(xs, ys, results):
                q = r["ratios"]  # type: ignore[index]
                ax.text(x, y, f"{q['vram_to_raw_vram']:.0%} raw\n{q['vram_to_http_h2d']:.1f}x http",
                        ha="center", va="bottom", fontsize=7, fontweight="bold")
    ax.set_xticks(range(len(results)), [f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}"  # type: ignore[call-overload]
                                        for r in results], fontsize=8)
    ax.set_ylabel("GB/s (median, p10-p90)")
    ax.set_title("batched GET into GPU memory", fontsize=9)
    ax.legend(fontsize=7)
    if prefix:
        ax = axes[0][1]
        ms = [prefix[p]["median_ms"] for p in ("vram", "nixl", "http")]  # type: ignore[index]
        ax.bar([0, 1, 2], ms, color=[colors["vram_get"], colors["host_get_h2d"], colors["http_get_h2d"]])
        for x, v in zip([0, 1, 2], ms):
            ax.text(x, v, f"{v:.0f} ms", ha="center", va="bottom", fontsize=8, fontweight="bold")
        ax.set_xticks([0, 1, 2], ["NIXL -> VRAM", "NIXL -> host -> VRAM", "HTTP -> host -> VRAM"], fontsize=8)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"load of a {int(prefix['tokens']):,}-token prefix into GPU staging\n"  # type: ignore[call-overload]
                     f"({int(prefix['bytes']) / 2**20:.0f} MiB, lookup included)", fontsize=9)  # type: ignore[call-overload]
    fig.suptitle(f"prefixstore NIXL into GPU memory ({gpu}; store in a child process, UCX on one host)", fontsize=10)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("UCX_MODULES", "^ib")
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/nixl_gpu.py needs a CUDA device (torch.cuda.is_available() is False; "
                         "--device cpu checks the script without one); "
                         "benchmarks/nixl_transfer.py measures the host path")
    gpu = Device(args.device).name()
    note = {**H.machine_note(), "gpu": gpu, "torch": torch.__version__}
    H.progress(f"machine: {note}")
    ram = NT.ram_bytes_for(args)
    raw_vram = NT.RawNixl(args.batch_bytes, device=None if args.device == "cpu" else int(args.device))
    raw_host = NT.RawNixl(args.batch_bytes)
    results: list[dict[str, object]] = []
    prefix = None
    try:
        async with H.serve_store("subprocess", ram_bytes=ram, page_bytes=64 << 10, tier="ram",
                                 eviction="lru", nixl="on") as rs:
            H.progress(f"store child on {rs.url} (ram={ram >> 20} MiB, nixl=on)")
            for size in args.payload_sizes:
                results.append(await bench_size(rs.url, size, args, raw_vram, raw_host))
            if args.prefix_tokens:
                prefix = await bench_prefix(rs.url, args)
    finally:
        raw_vram.close()
        raw_host.close()
    rows = []
    for r in results:
        f, q = r["figures"], r["ratios"]  # type: ignore[index]
        rows.append([f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}",  # type: ignore[call-overload]
                     *(f[op]["median_gbps"] for op in OPS),
                     f"{q['vram_to_raw_vram']:.0%}", f"{q['vram_to_host_h2d']:.2f}x", f"{q['vram_to_http_h2d']:.2f}x"])
    H.print_table("GB/s, median (payload bytes / wall time of the call, GPU synchronized)",
                  ["batch", *(LABELS[op] for op in OPS), "VRAM/raw", "VRAM vs host+H2D", "VRAM vs HTTP+H2D"], rows)
    if prefix:
        H.print_table(f"full load of a {prefix['tokens']:,}-token prefix into GPU staging, ms",
                      ["path", "median", "p10", "p90", "GB/s"],
                      [[p, prefix[p]["median_ms"], prefix[p]["p10_ms"], prefix[p]["p90_ms"], prefix[p]["gbps"]]  # type: ignore[index]
                       for p in ("vram", "nixl", "http")])
    out = Path(args.out)
    H.write_json(out, "nixl_gpu", {"args": {k: v for k, v in vars(args).items() if k != "out"}, "machine": note,
                                   "results": results, "prefix": prefix})
    plot(results, prefix, out / "nixl_gpu.png", gpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

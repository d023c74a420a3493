"""Clusters and workloads of the cluster benchmarks (cluster_scale.py, node_loss.py, cluster_lookup.py,
balance.py). Not a benchmark itself.

Nodes
-----
``processes``: N real ``prefixstore serve`` processes on loopback with a static ``--peers`` list
(what an operator runs); SIGKILL is a real node loss.

``inprocess``: N aiohttp applications (``create_app``, the real store, HTTP plane and cluster code)
served by ``TCPSite`` s on loopback inside the benchmark's event loop: how 16 to 64 nodes fit on a
2-core machine. A "kill" closes the node's listening site and drops its open connections, which a
client sees exactly as a dead peer (connection refused / reset).

Workloads (lists of :class:`Request`; every request is looked up, its reusable bytes read, then
what was missing saved with the snapshot at its end, as an engine does at prefill)
---------
``multiturn``: C conversations of T turns; turn k's prompt is the whole previous turn (prompt and
answer) plus a new user message; conversations arrive one after the other and their turns follow
at random gaps, so every window of the stream mixes first and later turns.

``sysprompt``: S system prompts, picked by Zipf(1.1) (a few hot), each followed by a fresh user
question: many conversations fork at the end of one shared prefix.

``multiturn-bos``: ``multiturn`` with one common first token (a tokenizer's BOS): the namespace's
root level then has one home, which every brand-new conversation's lookup and save reaches.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol import KVLayout, Namespace, StateLayout

VOCAB = 50000


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_healthy(url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"node {url} did not start")
        time.sleep(0.05)


def start_node(url: str, urls: Sequence[str], knobs: Sequence[str], tmp: Path, ram: str = "64MiB",
               page: str = "4KiB", log: Path | None = None) -> subprocess.Popen[bytes]:
    """One member of a static cluster (``urls``), its LMDB tier in ``tmp/PORT``: started again with
    the same arguments, it comes back on its own data directory. ``log``: where its output goes
    (appended; default: discarded)."""
    port = url.rsplit(":", 1)[1]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "prefixstore", "serve", "--port", port, "--node-url", url,
             "--peers", ",".join(urls), "--data-dir", str(tmp / port), "--ram-bytes", ram, "--page-bytes", page,
             "--log-level", "WARNING", "--nixl", "off", *knobs], stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]  # the child holds its own descriptor


def start_processes(n: int, knobs: Sequence[str], tmp: Path, ram: str = "64MiB", page: str = "4KiB"
                    ) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    """N ``prefixstore serve`` processes, every one listing all (static membership); ready on return.
    Small pages: the benchmarks' entries are a few KiB (``knobs`` given later win)."""
    urls = [f"http://127.0.0.1:{p}" for p in free_ports(n)]
    procs = [start_node(url, urls, knobs, tmp, ram, page) for url in urls]
    deadline = time.monotonic() + 180  # a loaded 2-core machine starts 8 processes slowly
    for url in urls:
        wait_healthy(url, deadline)
    return urls, procs


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], sig: int = signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    for p in procs:
        p.wait(20)


@dataclass
class InProcessCluster:
    """N store applications in this event loop (module docstring)."""

    n: int
    knobs: dict[str, object] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)
    runners: list[object] = field(default_factory=list)
    sites: dict[str, object] = field(default_factory=dict)

    async def start(self) -> None:
        from aiohttp import web

        from prefixstore.store.config import StoreConfig
        from prefixstore.store.server import create_app

        ports = free_ports(self.n)
        self.urls = [f"http://127.0.0.1:{p}" for p in ports]
        for port, url in zip(ports, self.urls):
            config = StoreConfig(port=port, node_url=url, peers=",".join(self.urls), data_dir="none",
                                 nixl="off", **self.knobs)
            runner = web.AppRunner(create_app(config), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", port)
            await site.start()
            self.runners.append(runner)
            self.sites[url] = site

    async def kill(self, url: str) -> None:
        """The node stops answering: its listener closes and its connections are cut."""
        runner = self.runners[self.urls.index(url)]
        await runner.cleanup()  # type: ignore[attr-defined]

    async def close(self) -> None:
        for r in self.runners:
            try:
                await r.cleanup()  # type: ignore[attr-defined]
            except Exception:  # already killed
                pass


@dataclass
class RunningCluster:
    """A started cluster of either kind; ``kill`` is a real kill -9 or the in-process cut."""

    urls: list[str]
    procs: list[subprocess.Popen[bytes]]
    inprocess: InProcessCluster | None

    @property
    def mode(self) -> str:
        return "simulated" if self.inprocess is not None else "kill -9"

    async def kill(self, url: str) -> None:
        if self.inprocess is not None:
            await self.inprocess.kill(url)
        else:
            self.procs[self.urls.index(url)].send_signal(signal.SIGKILL)


@asynccontextmanager
async def running_cluster(n: int, max_processes: int, prefix: str) -> AsyncIterator[RunningCluster]:
    """N real processes up to ``max_processes`` nodes, in-process applications above; stopped on exit."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        cluster: InProcessCluster | None = None
        procs: list[subprocess.Popen[bytes]] = []
        if n <= max_processes:
            urls, procs = await asyncio.to_thread(start_processes, n, ["--ram-bytes", "64MiB"], Path(tmp))
        else:
            cluster = InProcessCluster(n, {"ram_bytes": 16 << 20, "page_bytes": 4 << 10})
            await cluster.start()
            urls = cluster.urls
        try:
            yield RunningCluster(urls, procs, cluster)
        finally:
            if cluster is not None:
                await cluster.close()
            stop_processes(procs)


def namespace(block_tokens: int, state: bool = True) -> Namespace:
    """A small hybrid layout: the payload sizes do not matter to placement, only to memory."""
    return Namespace(model="cluster-bench", kv=KVLayout(num_layers=2, num_heads=1, head_dim=4, dtype="float32"),
                     state=StateLayout(num_layers=1, shapes=((16,),), dtype="float32") if state else StateLayout(),
                     block_tokens=block_tokens)


@dataclass
class Request:
    tokens: list[int]  # the prompt looked up
    save: list[int]  # what the engine saves after it (the prompt, or the prompt and its answer)


def multiturn(seed: int, conversations: int, turns: int, user: tuple[int, int] = (32, 256),
              answer: tuple[int, int] = (32, 256)) -> list[Request]:
    rng = np.random.default_rng(seed)
    convs: list[list[Request]] = []
    for _ in range(conversations):
        history: list[int] = []
        reqs = []
        for _ in range(turns):
            prompt = history + [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(*user)))]
            reply = [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(*answer)))]
            reqs.append(Request(prompt, prompt + reply))
            history = prompt + reply
        convs.append(reqs)
    # A steady stream: conversation c starts at time c, its turns follow after exponential gaps
    # (mean ``gap`` starts), so any window holds first turns and later turns in proportion (about
    # 1/turns of the requests are first turns), not a burst of first turns at the start.
    gap = 10.0
    timed = []
    for c, reqs in enumerate(convs):
        t = float(c)
        for k, r in enumerate(reqs):
            timed.append((t, c, k, r))
            t += float(rng.exponential(gap))
    timed.sort(key=lambda x: (x[0], x[1], x[2]))
    return [r for _, _, _, r in timed]


def sysprompt(seed: int, requests: int, systems: int, system_tokens: int = 1024,
              question: tuple[int, int] = (32, 256)) -> list[Request]:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, systems + 1) ** 1.1
    prompts = [[int(t) for t in rng.integers(1, VOCAB, system_tokens)] for _ in range(systems)]
    out = []
    for s in rng.choice(systems, requests, p=w / w.sum()):
        tokens = prompts[s] + [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(*question)))]
        out.append(Request(tokens, tokens))
    return out


WORKLOADS = ("multiturn", "sysprompt", "multiturn-bos")


def workload(name: str, seed: int, requests: int) -> list[Request]:
    if name == "multiturn-bos":  # every prompt starts with the same token, as a tokenizer's BOS makes it
        return [Request([1, *r.tokens], [1, *r.save]) for r in workload("multiturn", seed, requests)]
    if name == "multiturn":
        turns = 5
        return multiturn(seed, max(1, requests // turns), turns)
    if name == "sysprompt":
        return sysprompt(seed, requests, systems=16)
    raise ValueError(f"workload: {name!r} is not one of {WORKLOADS}")


@dataclass
class Outcome:
    """One request as the engine saw it."""

    tokens: int
    hit: int
    nodes: int  # nodes that answered its lookup's probes
    probes: int
    asked: list[str]
    error: str = ""
    wrong_bytes: int = 0


def rolling(tokens: Sequence[int]) -> list[int]:
    """A value per position derived from every token up to it: an entry of another prefix never
    reads as right."""
    v, out = 0, []
    for t in tokens:
        v = (v * 1000003 + t + 1) & 0xFFFFFFFF
        out.append(v)
    return out


def payload(ns: Namespace, values: Sequence[int], a: int, b: int) -> bytes:
    """Deterministic KV bytes of tokens [a, b) (``values``: :func:`rolling` of the sequence), token-major."""
    reps = ns.kv.token_bytes // 4
    return b"".join(v.to_bytes(4, "little") * reps for v in values[a:b])


def snapshot(ns: Namespace, values: Sequence[int], t: int) -> bytes:
    return values[t - 1].to_bytes(4, "little") * (ns.state.snapshot_bytes // 4)


async def serve_request(client: PrefixClient, ns: Namespace, req: Request, verify: bool = True) -> Outcome:
    """Look up, read and verify every reusable byte, save what was missing (with its end snapshot).
    A store failure is a miss, never an exception: any exception here is counted as an error."""
    impl = client.impl
    try:
        res = await client.lookup(req.tokens)
        walk = impl.last_walk if isinstance(impl, ClusterClient) else None
        out = Outcome(len(req.tokens), res.kv_tokens, len(walk.nodes) if walk else 1, walk.probes if walk else 1,
                      [u for u, _ in walk.answered] if walk else [])
        values = rolling(req.save)  # req.tokens is a prefix of req.save
        if res.kv_tokens and verify:
            reads = res.kv_reads(res.kv_tokens)
            per = ns.kv.token_bytes
            bufs = [bytearray(ns.kv.payload_bytes(ns.block_tokens)) for _ in reads]
            got = await client.read([it for it, _, _ in reads], bufs)
            for (_, a0, b0), buf, size in zip(reads, bufs, got):
                if size < 0:
                    out.hit = min(out.hit, a0)  # a read miss: reuse ends there (the engine recomputes)
                    break
                # payload() is token-major: the first tokens of an entry are the first bytes of it.
                if size < (b0 - a0) * per or bytes(buf[: (b0 - a0) * per]) != payload(ns, values, a0, b0):
                    out.wrong_bytes += 1
        if res.lease_id is not None:
            await client.release(res.lease_id)
        p = client.prompt(req.save)
        start = out.hit - out.hit % ns.block_tokens
        if start < len(req.save):
            snaps = {len(req.save): snapshot(ns, values, len(req.save))} if ns.has_state else None
            await client.save(p, len(req.save), lambda a, b: payload(ns, values, a, b), start=start,
                              snapshots=snaps)
        return out
    except Exception as err:  # noqa: BLE001 -- counted: the benchmark's "0 errors reach the engine"
        return Outcome(len(req.tokens), 0, 0, 0, [], error=f"{type(err).__name__}: {err}")


def client_config(urls: Sequence[str], **kw: object) -> ClientConfig:
    base: dict[str, object] = dict(urls=tuple(urls), timeout_s=5.0, connect_timeout_s=0.5, retry_after_s=0.5,
                                   max_retry_after_s=2.0, data_path="http")
    base.update(kw)
    return ClientConfig(**base)


async def drive(client: PrefixClient, ns: Namespace, reqs: Sequence[Request], concurrency: int,
                on_done: object = None) -> list[Outcome]:
    """Serve the requests with ``concurrency`` in flight, in order of issue; outcomes in request order."""
    out: list[Outcome | None] = [None] * len(reqs)
    it = iter(range(len(reqs)))

    async def worker() -> None:
        for i in it:
            out[i] = await serve_request(client, ns, reqs[i])
            if callable(on_done):
                on_done(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o for o in out if o is not None]


def hit_rate(outcomes: Sequence[Outcome]) -> float:
    total = sum(o.tokens for o in outcomes)
    return sum(o.hit for o in outcomes) / total if total else 0.0


def tmpdir(prefix: str) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix=prefix)


__all__ = ["WORKLOADS", "InProcessCluster", "RunningCluster", "running_cluster", "Outcome", "Request", "client_config", "drive", "free_ports",
           "hit_rate", "multiturn", "namespace", "payload", "rolling", "serve_request", "snapshot", "start_node", "start_processes",
           "stop_processes", "sysprompt", "tmpdir", "wait_healthy", "workload"]

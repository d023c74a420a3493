"""``prefixstore bench URL [URL ...]``: a load generator for a running store or cluster, in the
manner of ``redis-benchmark``.

Each request is what an engine does for one turn of a conversation: look the prompt up (the
conversation so far plus a new message), read what the lookup found (KV, and the snapshot on a
hybrid model), release the lease, then save the prompt and the answer (only what the store does
not hold moves). Conversations run under a shared system prompt, so a first turn finds the
system prompt and every later turn its whole history: the hit rates are those of a multi-turn
workload, and the reusable share (what a perfect cache would find) is reported beside them.

``--concurrency`` workers run at once (each its own client, as engines are), at most ``--rate``
requests a second when given. Payloads are made from the tokens, so every byte read back is
checked: a wrong byte is an error, never a statistic. The report: per operation (lookup, read,
save) the count, errors, p50, p99 and max latency and the payload throughput; the token hit
rates; the client's failures. ``--json`` prints it as one JSON object. A progress line goes to
stderr while it runs.

The URLs are seeds: one node, or any members of a cluster (the client finds the rest). A store
with tenants needs a tenant's token in ``$PREFIXSTORE_TOKEN`` (never a flag: flags show in
process lists) and that tenant's name in ``--tenant``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from .flags import human_bytes
from prefixstore.protocol import KVLayout, Namespace, StateLayout
from prefixstore.store.config import ENV_PREFIX

TOKEN_ENV = ENV_PREFIX + "TOKEN"
OPS = ("lookup", "read", "save")
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    urls: tuple[str, ...]
    requests: int = 1000
    duration_s: float = 0.0  # > 0: run this long instead of a number of requests
    concurrency: int = 8
    rate: float = 0.0  # requests per second at most; 0: as fast as the workers go
    conversations: int = 64
    shared_tokens: int = 256
    turn_tokens: int = 128
    answer_tokens: int = 32
    max_tokens: int = 4096
    block_tokens: int = 16
    layers: int = 2
    heads: int = 4
    head_dim: int = 64
    state_bytes: int = 65536  # 0: a plain transformer
    tenant: str = "default"
    token: str = ""
    ca_file: str = ""
    seed: int = 0

    def namespace(self) -> Namespace:
        state = StateLayout(num_layers=1, shapes=((self.state_bytes,),), dtype="uint8") if self.state_bytes \
            else StateLayout()
        return Namespace(model="prefixstore-bench", kv=KVLayout(num_layers=self.layers, num_heads=self.heads,
                                                                head_dim=self.head_dim),
                         state=state, block_tokens=self.block_tokens, tenant=self.tenant)


@dataclass
class OpStats:
    seconds: list[float] = field(default_factory=list)
    errors: int = 0
    num_bytes: int = 0

    def report(self, elapsed_s: float) -> dict[str, object]:
        ms = np.array(self.seconds) * 1e3 if self.seconds else np.zeros(0)
        pct: Callable[[float], float | None] = lambda q: round(float(np.percentile(ms, q)), 3) if len(ms) else None
        return {"count": len(self.seconds), "errors": self.errors, "p50_ms": pct(50), "p99_ms": pct(99),
                "max_ms": round(float(ms.max()), 3) if len(ms) else None,
                "mean_ms": round(float(ms.mean()), 3) if len(ms) else None, "bytes": self.num_bytes,
                "mb_per_s": round(self.num_bytes / elapsed_s / 1e6, 2) if elapsed_s > 0 and self.num_bytes else None}


@dataclass
class Totals:
    ops: dict[str, OpStats] = field(default_factory=lambda: {op: OpStats() for op in OPS})
    requests: int = 0
    prompt_tokens: int = 0
    kv_tokens: int = 0
    state_tokens: int = 0
    reusable_tokens: int = 0  # what a cache that kept everything would find
    wrong_bytes: int = 0


# ---------------------------------------------------------------- payloads made from the tokens


def kv_bytes(ns: Namespace, tokens: np.ndarray, a: int, b: int) -> bytes:
    """Layer-major KV of tokens [a, b): each token's bytes depend on its id, its layer and position in
    the row, so a read of the wrong entry or offset shows."""
    row = ns.kv.layer_token_bytes
    t = tokens[a:b].astype(np.uint32)[None, :, None]
    layer = np.arange(ns.kv.num_layers, dtype=np.uint32)[:, None, None]
    col = np.arange(row, dtype=np.uint32)[None, None, :]
    return ((t * 2654435761 + layer * 40503 + col) >> 7).astype(np.uint8).tobytes()


def state_bytes(ns: Namespace, tokens: np.ndarray, n: int) -> bytes:
    """The snapshot after tokens [0, n): seeded by them."""
    seed = int.from_bytes(hashlib.blake2b(tokens[:n].astype(np.uint32).tobytes(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8).tobytes()


# ---------------------------------------------------------------- the load


class Bench:
    def __init__(self, config: BenchConfig, progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.ns = config.namespace()
        self.totals = Totals()
        self.failures: dict[str, int] = {}
        self._progress = progress
        rng = np.random.default_rng(config.seed)
        self._rng = rng
        self._system = rng.integers(1, 1 << 20, config.shared_tokens, dtype=np.int64)
        self._next_first = 1 << 21  # first token of a new conversation's first message: unique
        self._started = 0
        self._t0 = 0.0

    def _new_history(self) -> np.ndarray:
        return self._system.copy()

    def _message(self, n: int) -> np.ndarray:
        self._next_first += 1
        msg = self._rng.integers(1, 1 << 20, n, dtype=np.int64)
        msg[0] = self._next_first  # no two messages start alike: a new turn forks where it should
        return msg

    def _claim(self) -> bool:
        """Whether another request may start (count or duration), and wait for its slot under --rate."""
        c = self.config
        if c.duration_s > 0:
            if time.perf_counter() - self._t0 >= c.duration_s:
                return False
        elif self._started >= c.requests:
            return False
        self._started += 1
        return True

    async def _pace(self, index: int) -> None:
        if self.config.rate > 0:
            delay = self._t0 + index / self.config.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

    async def _request(self, client: PrefixClient, history: np.ndarray) -> np.ndarray:
        """One turn: lookup, read and check, release, save; returns the conversation after it."""
        c, ns, t = self.config, self.ns, self.totals
        prompt = np.concatenate([history, self._message(c.turn_tokens)])
        n = len(prompt)
        started = time.perf_counter()
        res = await client.lookup(prompt)
        t.ops["lookup"].seconds.append(time.perf_counter() - started)
        if not res.ok:
            t.ops["lookup"].errors += 1
        t.prompt_tokens += n
        t.kv_tokens += res.kv_tokens
        t.state_tokens += res.state_tokens
        t.reusable_tokens += len(history)
        reads = res.kv_reads(res.kv_tokens)
        items = [item for item, _, _ in reads]
        buffers = [bytearray(ns.kv.payload_bytes(e - s)) for _, s, e in reads]
        expected = [kv_bytes(ns, prompt, s, e) for _, s, e in reads]
        snapshot = res.state_read()
        if snapshot is not None:
            items.append(snapshot)
            buffers.append(bytearray(ns.state.snapshot_bytes))
            expected.append(state_bytes(ns, prompt, res.state_tokens))
        if items:
            started = time.perf_counter()
            got = await client.read(items, buffers)
            t.ops["read"].seconds.append(time.perf_counter() - started)
            for g, buf, want in zip(got, buffers, expected):
                if g < 0:
                    t.ops["read"].errors += 1  # the lookup promised it under a lease
                elif g != len(want) or bytes(buf) != want:
                    t.wrong_bytes += len(want)
                else:
                    t.ops["read"].num_bytes += g
        await client.release(res.lease_id)
        after = np.concatenate([prompt, self._message(c.answer_tokens)])
        end = len(after) - 1  # the last sampled token was never fed through the model (DESIGN §6)
        snapshots = {end: memoryview(state_bytes(ns, after, end))} if ns.has_state else None
        sent = [0]

        def payload(a: int, b: int) -> memoryview:
            data = kv_bytes(ns, after, a, b)
            sent[0] += len(data)
            return memoryview(data)

        started = time.perf_counter()
        saved = await client.save(client.prompt(after), end, payload, snapshots)
        t.ops["save"].seconds.append(time.perf_counter() - started)
        t.ops["save"].num_bytes += sent[0] + (ns.state.snapshot_bytes if snapshots and saved.stored else 0)
        if saved.dropped:
            t.ops["save"].errors += 1
        t.requests += 1
        return after if len(after) + c.turn_tokens + c.answer_tokens <= c.max_tokens else self._new_history()

    async def _worker(self, queue: asyncio.Queue[np.ndarray]) -> None:
        c = self.config
        async with PrefixClient(self.ns, ClientConfig(urls=c.urls, token=c.token, tls_ca_file=c.ca_file)) as client:
            while self._claim():
                index = self._started - 1
                await self._pace(index)
                history = await queue.get()
                try:
                    history = await self._request(client, history)
                finally:
                    queue.put_nowait(history)
            for op, count in client.failures.items():
                self.failures[op] = self.failures.get(op, 0) + count

    async def _report_progress(self) -> None:
        while self._progress is not None:
            await asyncio.sleep(0.5)
            self._progress(self.progress_line())

    def progress_line(self) -> str:
        t, c = self.totals, self.config
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        goal = f"{elapsed:.0f}/{c.duration_s:g}s" if c.duration_s > 0 else f"{t.requests}/{c.requests} requests"
        lookups = t.ops["lookup"].seconds[-2000:]
        p50 = f"{np.percentile(lookups, 50) * 1e3:.2f}" if lookups else "-"
        errors = sum(s.errors for s in t.ops.values())
        hit = f"{t.kv_tokens / t.prompt_tokens:.1%}" if t.prompt_tokens else "-"
        return (f"bench: {goal}, {t.requests / elapsed:.0f} req/s, lookup p50 {p50} ms, KV hit {hit}, "
                f"errors {errors}, wrong bytes {t.wrong_bytes}")

    async def run(self) -> dict[str, object]:
        c = self.config
        queue: asyncio.Queue[np.ndarray] = asyncio.Queue()
        for _ in range(c.conversations):
            queue.put_nowait(self._new_history())
        self._t0 = time.perf_counter()
        ticker = asyncio.ensure_future(self._report_progress())
        try:
            await asyncio.gather(*(self._worker(queue) for _ in range(c.concurrency)))
        finally:
            ticker.cancel()
        return self.report(time.perf_counter() - self._t0)

    def report(self, elapsed_s: float) -> dict[str, object]:
        t, c = self.totals, self.config
        share: Callable[[int], float | None] = lambda n: n / t.prompt_tokens if t.prompt_tokens else None
        config = dataclasses.asdict(c)
        config.pop("token")
        return {"config": config, "seconds": round(elapsed_s, 3), "requests": t.requests,
                "requests_per_s": round(t.requests / elapsed_s, 1) if elapsed_s > 0 else None,
                "ops": {op: s.report(elapsed_s) for op, s in t.ops.items()},
                "tokens": {"looked_up": t.prompt_tokens, "kv_hit": t.kv_tokens, "state_hit": t.state_tokens,
                           "reusable": t.reusable_tokens},
                "hit_rates": {"kv": share(t.kv_tokens), "state": share(t.state_tokens) if self.ns.has_state else None,
                              "reusable": share(t.reusable_tokens)},
                "wrong_bytes": t.wrong_bytes, "failures": dict(sorted(self.failures.items()))}


# ---------------------------------------------------------------- output


def _ms(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else "-"


def format_report(report: dict[str, object]) -> str:
    ops = report["ops"]
    assert isinstance(ops, dict)
    head = ("op", "count", "errors", "p50 ms", "p99 ms", "max ms", "MB/s")
    rows: list[tuple[str, ...]] = [head]
    for op, s in ops.items():
        rows.append((op, str(s["count"]), str(s["errors"]), _ms(s["p50_ms"]), _ms(s["p99_ms"]), _ms(s["max_ms"]),
                     f"{s['mb_per_s']:.1f}" if isinstance(s["mb_per_s"], float) else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    config, tokens, rates = report["config"], report["tokens"], report["hit_rates"]
    assert isinstance(config, dict) and isinstance(tokens, dict) and isinstance(rates, dict)
    rate: Callable[[object], str] = lambda v: f"{v:.1%}" if isinstance(v, float) else "-"
    lines += ["",
              f"{report['requests']} requests in {report['seconds']} s: {report['requests_per_s']} req/s, "
              f"concurrency {config['concurrency']}{', rate ' + str(config['rate']) + '/s' if config['rate'] else ''}",
              f"{tokens['looked_up']} tokens looked up: KV hit {rate(rates['kv'])}, state hit {rate(rates['state'])} "
              f"(reusable by this workload: {rate(rates['reusable'])})",
              f"wrong bytes: {report['wrong_bytes']}; client failures: {report['failures'] or 'none'}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = commands.add_parser(
        "bench", help="load a running store or cluster like redis-benchmark: lookups, reads, saves; p50/p99, "
                      "hit rates",
        description=__doc__.split("\n\n", 1)[1].replace("``", "'"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("urls", metavar="URL", nargs="*", default=["http://127.0.0.1:8077"],
                       help="the store, or seeds of a cluster (default: http://127.0.0.1:8077)")
    bench.add_argument("-n", "--requests", type=int, default=1000, metavar="N",
                       help="requests (conversation turns) in all (default: 1000)")
    bench.add_argument("--duration", type=float, default=0.0, metavar="SECONDS",
                       help="run this long instead of --requests (default: 0, use --requests)")
    bench.add_argument("-c", "--concurrency", type=int, default=8, metavar="N",
                       help="requests in flight, one client each (default: 8)")
    bench.add_argument("--rate", type=float, default=0.0, metavar="PER_S",
                       help="start at most this many requests a second (default: 0, as fast as they go)")
    bench.add_argument("--conversations", type=int, default=64, metavar="N",
                       help="conversations the requests take turns of (default: 64)")
    bench.add_argument("--shared-tokens", type=int, default=256, metavar="N",
                       help="tokens of the system prompt every conversation starts with (default: 256)")
    bench.add_argument("--turn-tokens", type=int, default=128, metavar="N",
                       help="new tokens each turn's prompt adds (default: 128)")
    bench.add_argument("--answer-tokens", type=int, default=32, metavar="N",
                       help="tokens of each answer, saved with the prompt (default: 32)")
    bench.add_argument("--max-tokens", type=int, default=4096, metavar="N",
                       help="a conversation that would grow past this starts over (default: 4096)")
    bench.add_argument("--block-tokens", type=int, default=16, metavar="N", help="store block size B (default: 16)")
    bench.add_argument("--layers", type=int, default=2, metavar="N", help="attention layers of the KV (default: 2)")
    bench.add_argument("--heads", type=int, default=4, metavar="N", help="KV heads per layer (default: 4)")
    bench.add_argument("--head-dim", type=int, default=64, metavar="N",
                       help="head dimension, float16 (default: 64: with the defaults 2 KiB of KV a token)")
    bench.add_argument("--state-bytes", default="64KiB", metavar="SIZE",
                       help="bytes of a recurrent-state snapshot, saved at each answer's end; 0: a plain "
                            "transformer, no state (default: 64KiB)")
    bench.add_argument("--tenant", default="default", metavar="NAME",
                       help=f"tenant of the benchmark's namespace: the one ${TOKEN_ENV} belongs to (default: default)")
    bench.add_argument("--ca-file", default="", metavar="FILE", help="PEM CA of an https store (default: the system's)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the tokens (default: 0)")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object")
    bench.set_defaults(run=cmd_bench)


def config_of(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig the flags describe; raises ValueError naming the flag."""
    from prefixstore.store.knobs import parse_size

    for flag in ("requests", "concurrency", "conversations", "turn_tokens", "block_tokens", "layers", "heads",
                 "head_dim"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    for flag in ("duration", "rate", "shared_tokens", "answer_tokens"):
        if getattr(args, flag) < 0 or not math.isfinite(getattr(args, flag)):
            raise ValueError(f"--{flag.replace('_', '-')}: must be 0 or more, got {getattr(args, flag)}")
    if args.max_tokens < args.shared_tokens + args.turn_tokens + args.answer_tokens:
        raise ValueError("--max-tokens: smaller than one turn (--shared-tokens + --turn-tokens + --answer-tokens)")
    urls = tuple(u if "://" in u else "http://" + u for u in args.urls)
    return BenchConfig(urls=urls, requests=args.requests, duration_s=args.duration, concurrency=args.concurrency,
                       rate=args.rate, conversations=max(args.conversations, args.concurrency),
                       shared_tokens=args.shared_tokens, turn_tokens=args.turn_tokens,
                       answer_tokens=args.answer_tokens, max_tokens=args.max_tokens, block_tokens=args.block_tokens,
                       layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                       state_bytes=parse_size(args.state_bytes, "--state-bytes") if args.state_bytes != "0" else 0,
                       tenant=args.tenant, token=os.environ.get(TOKEN_ENV, ""), ca_file=args.ca_file, seed=args.seed)


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        config = config_of(args)
        config.namespace()
    except ValueError as err:
        print(f"prefixstore bench: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    tty = sys.stderr.isatty()
    last = [0.0]

    def progress(line: str) -> None:
        if tty:
            print(f"\r{line}\x1b[K", end="", file=sys.stderr, flush=True)
        elif time.monotonic() - last[0] >= 5.0:  # a log, not a terminal: a line every 5 s
            last[0] = time.monotonic()
            print(line, file=sys.stderr, flush=True)

    kv_token = config.namespace().kv.token_bytes
    print(f"prefixstore bench: {', '.join(config.urls)}: "
          f"{f'{config.duration_s:g} s' if config.duration_s else f'{config.requests} requests'}, concurrency "
          f"{config.concurrency}, KV {human_bytes(kv_token)}/token, snapshot {human_bytes(config.state_bytes)}",
          file=sys.stderr, flush=True)
    bench = Bench(config, progress)
    report = asyncio.run(bench.run())
    if tty:
        print(file=sys.stderr)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    ops = report["ops"]
    assert isinstance(ops, dict)
    looked_up = ops["lookup"]["count"]
    failed = report["wrong_bytes"] or not looked_up or ops["lookup"]["errors"] == looked_up
    return EXIT_FAILURE if failed else EXIT_OK


__all__ = ["Bench", "BenchConfig", "add_commands", "format_report", "kv_bytes", "state_bytes"]


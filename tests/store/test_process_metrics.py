"""The store's registry carries the process and platform collectors: a real node's /metrics
reports its own resident memory, in bytes, agreeing with what the kernel says of that process."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..serve_process import StartServe, http_get, serving

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process metrics come from /proc")


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def _samples(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def _kernel_rss_bytes(pid: int) -> int:
    """VmRSS of /proc/PID/status (kB there)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_metrics_report_the_store_process_resident_memory(serve: StartServe) -> None:
    proc = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "64MiB")
    assert proc.url is not None
    status, body = http_get(proc.url + "/metrics")
    assert status == 200
    samples = _samples(body.decode())
    kernel = _kernel_rss_bytes(proc.proc.pid)
    rss = samples["process_resident_memory_bytes"]
    # The same process, a moment apart: the same order of magnitude (not pages, not kB, not another pid).
    assert kernel / 2 <= rss <= kernel * 2, (rss, kernel)
    assert rss > 16 << 20  # an interpreter with numpy and aiohttp loaded is larger than this
    assert samples["process_virtual_memory_bytes"] >= 64 << 20  # the arena is mapped
    assert samples["process_open_fds"] >= 3  # at least the listening socket and stdio
    assert samples["process_max_fds"] >= samples["process_open_fds"]
    assert "python_info" in {f.name for f in text_string_to_metric_families(body.decode())}

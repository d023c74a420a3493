"""`prefixstore bench` against real stores: a 3-node cluster (its report agrees token for token with
what the nodes counted), one plain node, and a dead URL."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .serve_process import StartServe, http_get, run_cli, serving


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def counted(urls: list[str]) -> dict[str, float]:
    """Lookups and lookup tokens the nodes counted, summed over them."""
    out: dict[str, float] = {}
    for url in urls:
        status, body = http_get(url + "/metrics")
        assert status == 200
        for family in text_string_to_metric_families(body.decode()):
            for s in family.samples:
                if s.name == "prefixstore_lookups_total":
                    out["lookups"] = out.get("lookups", 0) + s.value
                elif s.name == "prefixstore_lookup_tokens_total":
                    key = f"{s.labels['kind']}_{s.labels['result']}"
                    out[key] = out.get(key, 0) + s.value
    return out


def test_bench_against_a_three_node_cluster(serve: StartServe) -> None:
    urls = [f"http://127.0.0.1:{p}" for p in free_ports(3)]
    nodes = [serve("--port", u.rsplit(":", 1)[1], "--node-url", u, "--peers", ",".join(urls), "--data-dir", "none",
                   "--state-admission", "always", ready=False) for u in urls]
    for node in nodes:
        node.wait_ready()
    out = run_cli(["bench", urls[1], "-n", "120", "-c", "6", "--conversations", "12", "--json"], timeout_s=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith(f"prefixstore bench: {urls[1]}: 120 requests, concurrency 6"), out.stderr
    report = json.loads(out.stdout)
    ops = report["ops"]
    assert report["requests"] == ops["lookup"]["count"] == ops["save"]["count"] == 120
    assert 0 < ops["read"]["count"] <= 120 and ops["read"]["bytes"] > 0 and ops["save"]["bytes"] > 0
    for op in ("lookup", "read", "save"):
        s = ops[op]
        assert s["errors"] == 0, (op, s)
        assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"], (op, s)
    assert report["wrong_bytes"] == 0 and report["failures"] == {}
    tokens, rates = report["tokens"], report["hit_rates"]
    # 12 conversations of 10 turns: every turn after a conversation's first finds its whole history.
    assert 0 < tokens["state_hit"] <= tokens["kv_hit"] <= tokens["reusable"] < tokens["looked_up"]
    assert rates["kv"] == tokens["kv_hit"] / tokens["looked_up"] and rates["kv"] > 0.5
    # What the bench saw is what the cluster counted (each lookup reported to the node owning it).
    assert counted(urls) == {"lookups": 120, "kv_hit": tokens["kv_hit"], "kv_miss": tokens["looked_up"] - tokens["kv_hit"],
                             "state_hit": tokens["state_hit"],
                             "state_miss": tokens["looked_up"] - tokens["state_hit"]}


def test_bench_table_against_one_node_of_a_plain_transformer(serve: StartServe) -> None:
    node = serve("--port", "0", "--data-dir", "none")
    assert node.url is not None
    out = run_cli(["bench", node.url, "-n", "30", "-c", "3", "--rate", "200", "--state-bytes", "0"], timeout_s=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["op", "count", "errors", "p50", "ms", "p99", "ms", "max", "ms", "MB/s"], out.stdout
    assert lines[1].split()[:3] == ["lookup", "30", "0"] and lines[3].split()[:3] == ["save", "30", "0"]
    assert "30 requests in" in out.stdout and "rate 200.0/s" in out.stdout
    assert "state hit -" in out.stdout and "wrong bytes: 0; client failures: none" in out.stdout
    assert counted([node.url])["lookups"] == 30


def test_bench_against_a_dead_store_reports_failures_and_exits_1() -> None:
    (port,) = free_ports(1)
    out = run_cli(["bench", f"http://127.0.0.1:{port}", "-n", "5", "-c", "1", "--json"], timeout_s=120)
    assert out.returncode == 1, out.stdout
    report = json.loads(out.stdout)
    assert report["ops"]["lookup"]["errors"] == 5 and report["failures"].get("lookup") == 5
    assert "Traceback" not in out.stderr


def test_bench_refuses_bad_flags_naming_them() -> None:
    for args, flag in ((["-c", "0"], "--concurrency"), (["--rate", "-1"], "--rate"),
                       (["--max-tokens", "100"], "--max-tokens"), (["--state-bytes", "lots"], "--state-bytes")):
        out = run_cli(["bench", "http://127.0.0.1:1", *args])
        assert out.returncode == 2 and f"prefixstore bench: error: {flag}" in out.stderr, (args, out.stderr)

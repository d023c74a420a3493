"""examples/ run as written against real store processes, and the READMEs show their code verbatim.

Each example is a file a user runs (``python examples/NAME.py URL``); here it runs
the same way, in a subprocess, against ``prefixstore serve`` on a free port (two
nodes for the cluster example). The README's code blocks must be excerpts of
these files, so the README's code is code that ran.
"""

from __future__ import annotations

import ast
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..serve_process import StartServe, clean_env, serving

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PUBLIC_API = {"prefixstore.client", "prefixstore.protocol", "prefixstore.gpu_staging"}


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def run_example(name: str, *urls: str, status: int = 0) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *urls], env=clean_env(), capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == status, f"{name} exited {out.returncode}, not {status}:\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout


def test_quickstart_async_saves_looks_up_and_reads_back_exactly(serve: StartServe) -> None:
    store = serve("--port", "0", "--data-dir", "none")
    assert store.url is not None
    out = run_example("quickstart_async.py", store.url)
    assert "saved 8 entries (0 already stored, 0 rejected)" in out  # 6 blocks, a tail, a snapshot
    assert "lookup: kv_tokens=100 state_tokens=100" in out
    assert "exact: True; snapshot exact: True" in out
    assert "failures: none" in out
    again = run_example("quickstart_async.py", store.url)  # the store has it all now: nothing is sent twice
    assert "saved 0 entries (8 already stored, 0 rejected)" in again


def test_quickstart_sync_releases_its_lease(serve: StartServe) -> None:
    store = serve("--port", "0", "--data-dir", "none")
    assert store.url is not None
    out = run_example("quickstart_sync.py", store.url)
    assert "lookup: kv_tokens=64 of 67" in out and "read 4 KV entries, exact: True" in out
    import json
    import urllib.request

    with urllib.request.urlopen(store.url + "/v1/stats", timeout=5) as resp:
        stats = json.loads(resp.read())
    assert stats["leases"] == 0, stats["leases"]  # the example released what it leased


def test_quickstart_async_against_no_store_says_it_failed() -> None:
    """A dead store is a miss for the client, never an exception: the example must not call that
    success (it printed 'exact: True' over zero entries read, and exited 0)."""
    (port,) = _free_ports(1)  # nothing listens there
    out = run_example("quickstart_async.py", f"http://127.0.0.1:{port}", status=1)
    assert "saved 0 entries" in out and "exact: False" in out, out
    failures = out.split("failures: ")[1].strip()
    assert "offer" in failures and "lookup" in failures, out  # the save's offer, the lookup


def test_quickstart_sync_refused_by_a_tenanted_store_says_it_failed(serve: StartServe, tmp_path: Path) -> None:
    from ..security.helpers import write_tenants

    store = serve("--port", "0", "--data-dir", "none", "--tenants-file", str(write_tenants(tmp_path / "t.toml")))
    assert store.url is not None
    out = run_example("quickstart_sync.py", store.url, status=1)  # no token: every call is a 401
    assert "saved 0 entries" in out and "exact: False" in out, out
    assert out.split("failures: ")[1].strip() != "none", out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_cluster_client_keeps_conversations_together_and_spreads_them(serve: StartServe) -> None:
    urls = [f"http://127.0.0.1:{p}" for p in _free_ports(2)]
    nodes = [serve("--port", url.rsplit(":", 1)[1], "--node-url", url, "--peers", ",".join(urls),
                   "--data-dir", "none", ready=False) for url in urls]
    for node in nodes:
        node.wait_ready()
    out = run_example("cluster_client.py", urls[0])  # one seed is enough
    assert "saved 16 conversations" in out
    assert "every conversation whole and exact: True" in out and "failures: none" in out
    most = int(out.split("most nodes asked by one lookup: ")[1].split()[0])
    assert 1 <= most <= 2, out  # the system prompt's node, then the conversation's: never more
    import json
    import urllib.request

    held = []
    for url in urls:
        with urllib.request.urlopen(url + "/v1/stats", timeout=5) as resp:
            held.append(sum(json.loads(resp.read())["entries"].values()))
    assert min(held) > 0, held  # conversations forked onto both nodes (all 16 on one: 2^-16)


def test_cluster_client_against_one_plain_node_counts_every_lookup(serve: StartServe) -> None:
    """docs/cluster.md: a cluster client works unchanged against a single `prefixstore serve`. It
    did answer, but its lookups were probes that count nothing and their reports were refused (a
    lone node takes none): /metrics counted 3 lookups of 16."""
    store = serve("--port", "0", "--data-dir", "none")
    assert store.url is not None
    out = run_example("cluster_client.py", store.url)
    assert "every conversation whole and exact: True" in out and "failures: none" in out, out
    from prometheus_client.parser import text_string_to_metric_families

    from ..serve_process import http_get

    status, body = http_get(store.url + "/metrics")
    assert status == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    assert samples[("prefixstore_lookups_total", ())] == 16  # one per conversation looked up
    hits = samples[("prefixstore_lookup_tokens_total", (("kind", "kv"), ("result", "hit")))]
    assert hits == 16 * (64 + 448)  # every token of every conversation was found


def test_gpu_staging_load_reuses_the_first_turn_and_matches_a_recompute(serve: StartServe) -> None:
    pytest.importorskip("torch")
    store = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "64MiB")
    assert store.url is not None
    out = run_example("gpu_staging_load.py", store.url)
    assert "first:  computed 300 of 300 prompt tokens" in out
    m = re.search(r"second: kv_tokens=(\d+) state_tokens=(\d+), loaded (\d+) bytes, computed (\d+) of (\d+)", out)
    assert m, out
    kv_tokens, state_tokens, loaded, computed, prompt = map(int, m.groups())
    assert kv_tokens == state_tokens == 315  # the first turn's prompt + answer less its last token
    assert loaded > 0 and computed == prompt - state_tokens
    assert "same tokens as a full recompute: True" in out


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_examples_use_only_the_public_client_api(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prefixstore"):
            assert node.module in PUBLIC_API, f"{path.name}: imports {node.module}"
            for alias in node.names:
                assert not alias.name.startswith("_"), f"{path.name}: imports private {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("prefixstore") or alias.name in PUBLIC_API, alias.name


def _python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), re.S)


@pytest.mark.parametrize("readme", ["README.md", "gpu_staging/README.md"])
def test_readme_code_is_the_examples_code(readme: str) -> None:
    """Every Python block of the README is a verbatim run of lines of one example file."""
    blocks = _python_blocks(ROOT / readme)
    assert blocks, f"{readme}: no python block"
    sources = {p.name: p.read_text() for p in EXAMPLES.glob("*.py")}
    for block in blocks:
        found = [name for name, text in sources.items() if block in text and (text.startswith(block) or
                                                                              f"\n{block}" in text)]
        assert found, f"{readme}: this block is in no examples/*.py file:\n{block}"


def test_every_example_is_tested_here() -> None:
    tested = set(re.findall(r'run_example\("([a-z_]+\.py)"', Path(__file__).read_text()))
    assert tested == {p.name for p in EXAMPLES.glob("*.py")}


def test_pd_proxy_takes_the_flow_of_vllms_disaggregation_examples() -> None:
    """examples/pd_proxy.py between a stand-in prefill and decode instance (vLLM's own is run by
    tests/vllm/test_disagg_serving.py through the same functions): the prefill gets the request
    with max_tokens=1 and do_remote_decode, the decode gets the original request with the
    prefill's kv_transfer_params, and the client gets the decode's answer."""
    import asyncio
    import json
    import time
    import urllib.request

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    assert "--prefill" in run_example("pd_proxy.py", "--help")
    seen: dict[str, dict[str, object]] = {}

    async def prefill(request: web.Request) -> web.Response:
        seen["prefill"] = await request.json()
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": {
            "do_remote_prefill": True, "prefixstore": {"namespace": "ab", "kv_tokens": 9, "state_tokens": 9}}})

    async def decode(request: web.Request) -> web.Response:
        seen["decode"] = await request.json()
        return web.json_response({"choices": [{"text": "the answer"}]})

    async def main() -> tuple[int, dict[str, object], str]:
        servers = []
        for handler in (prefill, decode):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            server = TestServer(app, host="127.0.0.1")
            await server.start_server()
            servers.append(server)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proxy = subprocess.Popen([sys.executable, str(EXAMPLES / "pd_proxy.py"), "--port", str(port),
                                  "--prefill", str(servers[0].make_url("")).rstrip("/"),
                                  "--decode", str(servers[1].make_url("")).rstrip("/")], env=clean_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:  # poll its health endpoint, never a fixed sleep
                try:
                    await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{port}/health", None, 2)
                    break
                except OSError:
                    assert proxy.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                    await asyncio.sleep(0.1)
            body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "min_tokens": 2,
                               "stream": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with await asyncio.to_thread(urllib.request.urlopen, req, None, 30) as r:
                return r.status, json.loads(r.read()), r.headers.get("x-prefill-seconds", "")
        finally:
            proxy.terminate()
            proxy.wait(30)
            for server in servers:
                await server.close()

    status, answer, prefill_s = asyncio.run(main())
    assert status == 200 and answer == {"choices": [{"text": "the answer"}]} and float(prefill_s) >= 0
    p, d = seen["prefill"], seen["decode"]
    assert p["max_tokens"] == 1 and "min_tokens" not in p and p["stream"] is False
    assert p["kv_transfer_params"]["do_remote_decode"] is True  # type: ignore[index]
    assert d["max_tokens"] == 8 and d["min_tokens"] == 2 and d["prompt"] == [1, 2, 3]
    assert d["kv_transfer_params"] == {"do_remote_prefill": True,
                                       "prefixstore": {"namespace": "ab", "kv_tokens": 9, "state_tokens": 9}}

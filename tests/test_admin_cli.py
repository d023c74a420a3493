"""The operators' commands (prefixstore/admin_cli.py) against real store processes with tenants on:
stats, namespaces, flush, delete, config; over TLS; over a cluster (--cluster)."""

from __future__ import annotations

import importlib.metadata
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixstore.client import ClientConfig, SyncPrefixClient
from prefixstore.protocol import KVLayout, Namespace
from prefixstore.protocol import checksums, hashing

from .security.helpers import ADMIN_TOKEN, TOKENS, make_pki, write_tenants
from .serve_process import StartServe, clean_env, run_cli, serving

BLOCK_TOKENS = 16
TOKENS_PER_PROMPT = 64  # 4 blocks


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def namespace_of(tenant: str) -> Namespace:
    return Namespace(model="admin-test", kv=KVLayout(num_layers=2, num_heads=2, head_dim=16),
                     block_tokens=BLOCK_TOKENS, tenant=tenant)


def fill(url: str, tenant: str, ca_file: str | None = None, urls: tuple[str, ...] = ()) -> int:
    """Save one 64-token prompt as ``tenant`` and look it up once; the tokens the lookup found."""
    ns = namespace_of(tenant)
    kv = np.arange(ns.kv.num_layers * TOKENS_PER_PROMPT * ns.kv.layer_token_bytes, dtype=np.uint32).astype(np.uint8)
    kv = kv.reshape(ns.kv.num_layers, TOKENS_PER_PROMPT, ns.kv.layer_token_bytes)
    tokens = list(range(100, 100 + TOKENS_PER_PROMPT))
    config = ClientConfig(urls=urls, token=TOKENS[tenant], tls_ca_file=ca_file or "") if urls else \
        ClientConfig(url=url, token=TOKENS[tenant], tls_ca_file=ca_file or "")
    with SyncPrefixClient(ns, config) as client:
        saved = client.save(client.prompt(tokens), len(tokens), lambda a, b: kv[:, a:b].tobytes())
        assert saved.stored == TOKENS_PER_PROMPT // BLOCK_TOKENS, client.failures
        return lookup(client, tokens)


def lookup(client: SyncPrefixClient, tokens: list[int]) -> int:
    res = client.lookup(tokens)
    client.release(res.lease_id)
    return res.kv_tokens


def found(url: str, tenant: str) -> int:
    with SyncPrefixClient(namespace_of(tenant), ClientConfig(url=url, token=TOKENS[tenant])) as client:
        return lookup(client, list(range(100, 100 + TOKENS_PER_PROMPT)))


def admin(*args: str, token: str | None = ADMIN_TOKEN) -> tuple[int, str, str]:
    env = clean_env(PREFIXSTORE_ADMIN_TOKEN=token) if token else clean_env()
    out = run_cli(list(args), env=env)
    return out.returncode, out.stdout, out.stderr


def admin_json(*args: str) -> dict[str, object]:
    code, stdout, stderr = admin(*args, "--json")
    assert code == 0, stderr
    body = json.loads(stdout)
    assert isinstance(body, dict)
    return body


def by_tenant(listed: object) -> dict[str, dict[str, int]]:
    assert isinstance(listed, dict)
    rows = listed["namespaces"]
    assert isinstance(rows, list)
    return {row["tenant"]: row["entries"] for row in rows}


def test_every_admin_command_against_a_store_with_tenants(tmp_path: Path, serve: StartServe) -> None:
    tenants = write_tenants(tmp_path / "tenants.toml")
    proc = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"), "--ram-bytes", "4MiB", "--page-bytes", "4096",
                 "--tenants-file", str(tenants))
    url = proc.url
    assert url is not None
    assert fill(url, "alpha") == TOKENS_PER_PROMPT and fill(url, "beta") == TOKENS_PER_PROMPT
    payload = namespace_of("alpha").kv.payload_bytes(BLOCK_TOKENS)

    # Every command needs the admin token; a tenant's is refused too.
    for command in (["stats", url], ["namespaces", url], ["flush", url, "--yes"], ["config", url],
                    ["delete", url, "--tenant", "alpha", "--yes"]):
        for token in (None, TOKENS["alpha"]):
            code, stdout, stderr = admin(*command, token=token)
            assert code == 1 and "401" in stderr and len(stderr.strip().splitlines()) == 1, (command, stderr)
            assert "Traceback" not in stderr
    assert found(url, "alpha") == TOKENS_PER_PROMPT  # the refused delete deleted nothing

    # stats: hit rates by kind, occupancy, uptime, version, native extensions.
    stats = admin_json("stats", url)
    assert stats["version"] == importlib.metadata.version("prefixstore")
    assert stats["native"] == {"hash_chain": hashing.NATIVE, "checksums": checksums.NATIVE}
    assert isinstance(stats["uptime_s"], float) and stats["uptime_s"] > 0
    lookups = stats["lookups"]
    assert isinstance(lookups, dict)
    assert lookups["answered"] == 3  # two fills and the check above
    assert lookups["kv"] == {"hit_tokens": 3 * TOKENS_PER_PROMPT, "miss_tokens": 0, "rate": 1.0}
    assert lookups["state"] == {"hit_tokens": 0, "miss_tokens": 0, "rate": None}  # no namespace has state
    assert stats["entries"] == {"kv/disk": 8, "kv/ram": 8}
    code, text, _ = admin("stats", url)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    assert code == 0 and rows["lookups.kv.rate"] == ["100.0%"] and rows["version"] == [stats["version"]]
    assert rows["arena.capacity_bytes"] == ["4194304", "(4", "MiB)"]

    # namespaces: one per tenant, entries and bytes each.
    listed = admin_json("namespaces", url)
    assert by_tenant(listed) == {"alpha": {"kv": 4, "state": 0, "bytes": 4 * payload, "fork_records": 0},
                                 "beta": {"kv": 4, "state": 0, "bytes": 4 * payload, "fork_records": 0}}
    code, text, _ = admin("namespaces", url)
    assert code == 0 and namespace_of("alpha").id.hex() in text and "2 namespace(s)" in text

    # delete --tenant: that tenant's entries, nobody else's; --yes is required.
    code, _, stderr = admin("delete", url, "--tenant", "alpha")
    assert code == 2 and "--yes" in stderr
    assert found(url, "alpha") == TOKENS_PER_PROMPT
    code, stdout, stderr = admin("delete", url, "--tenant", "alpha", "--yes")
    assert code == 0, stderr
    assert "deleted 4 entries of 1 namespace(s)" in stdout
    assert found(url, "alpha") == 0 and found(url, "beta") == TOKENS_PER_PROMPT
    assert by_tenant(admin_json("namespaces", url))["alpha"] == {"kv": 0, "state": 0, "bytes": 0, "fork_records": 0}
    code, _, stderr = admin("delete", url, "--tenant", "gamma", "--yes")
    assert code == 1 and "404" in stderr and "no tenant 'gamma'" in stderr

    # delete --namespace: by id.
    code, _, stderr = admin("delete", url, "--namespace", "xyz", "--yes")
    assert code == 2 and "16 hex digits" in stderr
    code, stdout, stderr = admin("delete", url, "--namespace", namespace_of("beta").id.hex(), "--yes")
    assert code == 0 and "deleted 4 entries" in stdout, stderr
    assert found(url, "beta") == 0

    # flush: everything.
    assert fill(url, "alpha") == TOKENS_PER_PROMPT  # saved again
    code, stdout, stderr = admin("flush", url, "--yes")
    assert code == 0 and "flushed 4 entries" in stdout, stderr
    assert found(url, "alpha") == 0

    # config: each knob's effective value and where it came from.
    knobs = admin_json("config", url)
    assert knobs["ram_bytes"] == {"value": 4 << 20, "source": "flag --ram-bytes"}
    assert knobs["tenants_file"] == {"value": str(tenants), "source": "flag --tenants-file"}
    assert knobs["nixl"] == {"value": "off", "source": "env PREFIXSTORE_NIXL"}  # clean_env sets it
    assert knobs["lease_ttl_s"] == {"value": 30.0, "source": "default"}
    code, text, _ = admin("config", url)
    assert code == 0 and any(line.split() == ["ram_bytes", "4MiB", "flag", "--ram-bytes"] for line in text.splitlines())
    assert proc.stop() == 0


def test_admin_commands_over_tls(tmp_path: Path, serve: StartServe) -> None:
    pki = make_pki(tmp_path)
    tenants = write_tenants(tmp_path / "tenants.toml")
    proc = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "4MiB", "--page-bytes", "4096",
                 "--tenants-file", str(tenants), "--tls-cert-file", str(pki.server_cert),
                 "--tls-key-file", str(pki.server_key), "--tls-client-ca-file", str(pki.ca), ca_file=str(pki.ca),
                 client_cert=(str(pki.client_cert), str(pki.client_key)))
    url = proc.url
    assert url is not None and url.startswith("https://")
    tls = ("--ca-file", str(pki.ca), "--cert-file", str(pki.client_cert), "--key-file", str(pki.client_key))
    stats = admin_json("stats", url, *tls)
    assert stats["disk"] == {"enabled": False, "budget_bytes": 4 << 30, "payload_bytes": 0, "path": None,
                             "durability": "write-behind", "full": False,
                             "behind": {"bytes": 0, "entries": 0, "lag_s": 0.0}}
    assert admin_json("namespaces", url, *tls) == {"namespaces": []}
    assert admin_json("config", url, *tls)["tls_client_ca_file"] == {"value": str(pki.ca),
                                                                     "source": "flag --tls-client-ca-file"}
    code, stdout, stderr = admin("flush", url, "--yes", *tls)
    assert code == 0 and "flushed 0 entries" in stdout, stderr
    code, _, stderr = admin("stats", url)  # the store's certificate is not the system's CAs'
    assert code == 1 and "CERTIFICATE_VERIFY_FAILED" in stderr
    code, _, stderr = admin("stats", url, "--ca-file", str(pki.ca))  # no client certificate: mutual TLS refuses
    assert code == 1 and "cannot reach" in stderr and "Traceback" not in stderr
    assert proc.stop() == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cluster_wide_stats_and_delete(tmp_path: Path, serve: StartServe) -> None:
    """Two nodes: --cluster asks every member and sums the cluster's totals; a delete without it says
    it did one node's share; a member that stops answering is named and fails the command."""
    tenants = write_tenants(tmp_path / "tenants.toml")
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [serve("--port", str(port), "--data-dir", "none", "--ram-bytes", "4MiB", "--page-bytes", "4096",
                   "--tenants-file", str(tenants), "--peers", ",".join(urls), "--node-url", node)
             for port, node in zip(ports, urls)]
    ns = namespace_of("alpha")
    num_prompts = 12  # branches placed by rendezvous: all 12 on one node has odds 1 in 2048
    with SyncPrefixClient(ns, ClientConfig(urls=tuple(urls), token=TOKENS["alpha"])) as client:
        for base in range(num_prompts):
            tokens = list(range(1000 * base, 1000 * base + TOKENS_PER_PROMPT))
            saved = client.save(client.prompt(tokens), len(tokens), lambda a, b: bytes(ns.kv.payload_bytes(b - a)))
            assert saved.stored == 4, client.failures
    answer = admin_json("stats", urls[0], "--cluster")
    members = answer["members"]
    assert isinstance(members, dict) and set(members) == set(urls)
    held = [sum(v for k, v in members[u]["entries"].items() if k.endswith("/ram")) for u in urls]
    assert sum(held) == 4 * num_prompts and min(held) > 0
    assert answer["total"] == {"entries.kv/ram": 4 * num_prompts, "stored_bytes.kv/ram":
                               4 * num_prompts * ns.kv.payload_bytes(BLOCK_TOKENS), "lookups.answered": 0,
                               "lookups.kv.hit_tokens": 0, "lookups.kv.miss_tokens": 0,
                               "lookups.state.hit_tokens": 0, "lookups.state.miss_tokens": 0}
    code, text, _ = admin("stats", urls[0], "--cluster")
    assert code == 0 and "total (2 of 2 answered)" in text and all(u in text for u in urls)

    code, stdout, stderr = admin("delete", urls[0], "--tenant", "alpha", "--yes")
    assert code == 0 and f"{urls[0]}: deleted {held[0]} entries " in stdout
    assert "one of 2 members" in stderr and "--cluster" in stderr
    code, stdout, stderr = admin("delete", urls[0], "--tenant", "alpha", "--yes", "--cluster")
    assert code == 0, stderr
    assert f"{urls[0]}: deleted 0 entries of 1" in stdout and f"{urls[1]}: deleted {held[1]} entries " in stdout
    listed = admin_json("namespaces", urls[0], "--cluster")
    assert by_tenant(listed) == {"alpha": {"kv": 0, "state": 0, "bytes": 0, "fork_records": 0}}

    assert procs[1].stop() == 0
    code, text, stderr = admin("stats", urls[0], "--cluster")
    assert code == 1 and "1 of 2 members did not answer" in stderr
    assert "total (1 of 2 answered)" in text
    assert any(line.startswith(urls[1] + " ") and "error: cannot reach" in line for line in text.splitlines())


def test_config_without_url_says_what_serve_would_use(tmp_path: Path) -> None:
    config = tmp_path / "store.toml"
    config.write_text('disk_bytes = "8GiB"\nram_bytes = "1GiB"\n')
    out = run_cli(["config", "--config", str(config), "--ram-bytes", "64MiB", "--json"],
                  env=clean_env(PREFIXSTORE_PORT="9100"))
    assert out.returncode == 0, out.stderr
    knobs = json.loads(out.stdout)
    assert knobs["ram_bytes"] == {"value": 64 << 20, "source": "flag --ram-bytes"}  # the flag beats the file
    assert knobs["disk_bytes"] == {"value": 8 << 30, "source": f"file {config}"}
    assert knobs["port"] == {"value": 9100, "source": "env PREFIXSTORE_PORT"}
    assert knobs["lease_ttl_s"] == {"value": 30.0, "source": "default"}
    bad = run_cli(["config", "--ram-bytes", "lots"])
    assert bad.returncode == 2 and "ram_bytes" in bad.stderr and "flag --ram-bytes" in bad.stderr
    both = run_cli(["config", "http://127.0.0.1:1", "--ram-bytes", "64MiB"])
    assert both.returncode == 2 and "--ram-bytes" in both.stderr


def test_serve_writes_json_log_lines_with_access_fields(serve: StartServe) -> None:
    proc = serve("--port", "0", "--data-dir", "none", "--log-format", "json", "--access-log")
    assert proc.url is not None
    code, _, stderr = admin("stats", proc.url, token=None)
    assert code == 0, stderr
    assert proc.stop() == 0
    lines = [json.loads(line) for line in proc.lines if line.startswith("{")]
    assert len(lines) == len([line for line in proc.lines if line.strip()])  # every line is JSON
    assert any(line["message"].startswith("prefixstore serving on ") for line in lines)
    stats = [line for line in lines if line.get("endpoint") == "/v1/stats"]
    assert stats and stats[0]["status"] == 200 and stats[0]["logger"] == "prefixstore.access"


def test_a_refused_admin_token_names_the_variable_it_comes_from(tmp_path: Path, serve: StartServe) -> None:
    proc = serve("--port", "0", "--data-dir", "none", "--tenants-file", str(write_tenants(tmp_path / "t.toml")))
    assert proc.url is not None
    code, _, stderr = admin("stats", proc.url, token=None)
    assert code == 1 and "401" in stderr and "$PREFIXSTORE_ADMIN_TOKEN: it is not set" in stderr, stderr
    code, _, stderr = admin("stats", proc.url, token=TOKENS["alpha"])  # a tenant's token is not the admin's
    assert code == 1 and "$PREFIXSTORE_ADMIN_TOKEN: the one set was refused" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1


def test_output_into_a_closed_pipe_ends_quietly(serve: StartServe) -> None:
    """`prefixstore stats --cluster --json | head`: the reader leaves early; no traceback."""
    import subprocess
    import sys

    proc = serve("--port", "0", "--data-dir", "none")
    assert proc.url is not None
    for args in (["stats", "--cluster", "--json", proc.url], ["config", "--json"]):
        child = subprocess.Popen([sys.executable, "-m", "prefixstore", *args], env=clean_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()  # the reader is gone before the first line is written
        stderr = child.stderr.read().decode()
        assert child.wait(timeout=30) == 141, stderr  # as a process SIGPIPE ended: 128 + 13
        assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr

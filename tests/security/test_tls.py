"""TLS on the HTTP plane: a real store served with a test CA's certificate; the client verifies by default."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.node import NodeClient
from prefixstore.store import StoreConfig, StoreRunner, create_app
from prefixstore.store.config import ConfigError

from ..factories import kv_payload, make_namespace
from ..serve_process import clean_env, http_get, run_cli, serving
from .helpers import ADMIN_TOKEN, TOKENS, Pki, make_pki, write_tenants

pytest.importorskip("cryptography")

TOKENS_LIST = list(range(40, 58))  # 4 full blocks of 4 and a tail of 2

Serve = Callable[[StoreConfig], Awaitable[str]]


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
async def serve_tls() -> AsyncIterator[Serve]:
    """Factory: serve a StoreConfig the way `prefixstore serve` does (TCPSite with its ssl_context); yields the URL."""
    runners: list[web.AppRunner] = []

    async def start(config: StoreConfig) -> str:
        runner = StoreRunner(create_app(config), config)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=config.ssl_context())
        await site.start()
        port = runner.addresses[0][1]
        return f"https://127.0.0.1:{port}"

    yield start
    for r in runners:
        await r.cleanup()


def tls_config(tmp_path: Path, pki: Pki, **extra: str) -> StoreConfig:
    return StoreConfig(port=0, data_dir="none", ram_bytes=4 << 20, page_bytes=4096,
                       tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key), **extra)


async def round_trip(url: str, **client: str) -> tuple[PrefixClient, int]:
    """Save, look up and read back (control calls and the bulk GET path).

    Returns the closed client (for its failure counters) and the KV tokens the lookup found. A
    lookup that found anything came over the control channel, over the same TLS (its certificate
    checks, its client certificate): where the channel could not be opened this raises."""
    ns = make_namespace(tenant=client.pop("tenant", "default"))
    c = PrefixClient(ns, ClientConfig(url=url, timeout_s=5.0, **client))
    async with c:
        prompt = c.prompt(TOKENS_LIST)
        saved = await c.save(prompt, len(TOKENS_LIST), lambda a, b: kv_payload(ns, TOKENS_LIST, a, b))
        found = await c.lookup(TOKENS_LIST)
        if found.kv_tokens:
            channel = c.impl.control if isinstance(c.impl, NodeClient) else None
            assert channel is not None and channel.carried >= 1, "the lookup went as a POST: no channel over TLS"
        if saved.stored and found.kv_tokens:
            reads = found.kv_reads(found.kv_tokens)
            outs = [bytearray(1 << 12) for _ in reads]
            sizes = await c.read([item for item, _, _ in reads], outs)
            for (_, a, b), out, n in zip(reads, outs, sizes):
                assert n > 0 and bytes(out[:n]) == kv_payload(ns, TOKENS_LIST, a, b)
    return c, found.kv_tokens


async def test_tls_round_trip_verifies_the_store(serve_tls: Serve, pki: Pki, tmp_path: Path) -> None:
    url = await serve_tls(tls_config(tmp_path, pki))
    c, kv_tokens = await round_trip(url, tls_ca_file=str(pki.ca))
    assert c.failures == {} and kv_tokens == len(TOKENS_LIST)
    # Without the CA the certificate does not verify: every call is a miss or a dropped save, nothing raises.
    c, kv_tokens = await round_trip(url)
    assert kv_tokens == 0 and c.failures["offer"] >= 1 and c.failures["lookup"] >= 1
    # A different CA (the rogue self-signed certificate) does not verify it either.
    c, kv_tokens = await round_trip(url, tls_ca_file=str(pki.rogue_cert))
    assert kv_tokens == 0 and c.failures["lookup"] >= 1


async def test_tls_bulk_put_and_get_over_http(serve_tls: Serve, pki: Pki, tmp_path: Path) -> None:
    """Payloads large enough for the direct socket sends (transport/sockets.py) both ways, over TLS:
    those must go through the TLS transports (the sockets carry ciphertext), byte for byte."""
    config = StoreConfig(port=0, data_dir="none", ram_bytes=64 << 20, page_bytes=64 << 10,
                         tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key), nixl="off")
    url = await serve_tls(config)
    ns = make_namespace(block_tokens=16, num_layers=256, with_state=False, model="tls-bulk")  # 64 KiB blocks
    tokens = list(range(64 * 16))
    async with PrefixClient(ns, ClientConfig(url=url, tls_ca_file=str(pki.ca), data_path="http")) as c:
        saved = await c.save(c.prompt(tokens), len(tokens), lambda a, b: kv_payload(ns, tokens, a, b))
        assert saved.stored == 64 and c.failures == {}
        found = await c.lookup(tokens)
        reads = found.kv_reads(found.kv_tokens)
        outs = [bytearray(ns.block_bytes) for _ in reads]
        assert await c.read([item for item, _, _ in reads], outs) == [ns.block_bytes] * 64
        assert [bytes(o) for o in outs] == [kv_payload(ns, tokens, a, b) for _, a, b in reads]
        assert c.failures == {}


async def test_tls_with_tenants_sends_the_token_on_every_path(serve_tls: Serve, pki: Pki, tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "tenants.toml")
    url = await serve_tls(tls_config(tmp_path, pki, tenants_file=str(tenants)))
    c, kv_tokens = await round_trip(url, tls_ca_file=str(pki.ca), token=TOKENS["alpha"], tenant="alpha")
    assert c.failures == {} and kv_tokens == len(TOKENS_LIST)


async def test_mutual_tls_needs_a_client_certificate_from_the_ca(serve_tls: Serve, pki: Pki, tmp_path: Path) -> None:
    url = await serve_tls(tls_config(tmp_path, pki, tls_client_ca_file=str(pki.ca)))
    c, kv_tokens = await round_trip(url, tls_ca_file=str(pki.ca), tls_cert_file=str(pki.client_cert),
                         tls_key_file=str(pki.client_key))
    assert c.failures == {} and kv_tokens == len(TOKENS_LIST)
    for extra in ({}, {"tls_cert_file": str(pki.rogue_cert), "tls_key_file": str(pki.rogue_key)}):
        c, kv_tokens = await round_trip(url, tls_ca_file=str(pki.ca), **extra)
        assert kv_tokens == 0 and c.failures["lookup"] >= 1


def test_tls_knobs_fail_at_start_up_naming_the_knob(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tls_key_file"):
        StoreConfig(tls_cert_file=str(pki.server_cert))
    with pytest.raises(ConfigError, match="tls_client_ca_file"):
        StoreConfig(tls_client_ca_file=str(pki.ca))
    with pytest.raises(ConfigError, match="tls_cert_file"):  # a key that does not match the certificate
        StoreConfig(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.client_key))
    with pytest.raises(ConfigError, match="tls_key_file"):
        StoreConfig(tls_cert_file=str(pki.server_cert), tls_key_file=str(tmp_path / "absent.key"))
    context = tls_config(tmp_path, pki, tls_client_ca_file=str(pki.ca)).ssl_context()
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    assert StoreConfig().ssl_context() is None


def test_serve_help_documents_the_security_knobs() -> None:
    out = run_cli(["serve", "--help"], env=clean_env())
    assert out.returncode == 0
    for flag in ("--tenants-file", "--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"):
        assert flag in out.stdout
    assert "/healthz and /metrics stay open" in out.stdout


def test_prefixstore_serve_with_tls_and_tenants(pki: Pki, tmp_path: Path) -> None:
    """The real command: https ready line, open /healthz, admin-only stats through `prefixstore stats`."""
    tenants = write_tenants(tmp_path / "tenants.toml")
    with serving() as serve:
        proc = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "4MiB", "--page-bytes", "4096",
                     "--tenants-file", str(tenants), "--tls-cert-file", str(pki.server_cert),
                     "--tls-key-file", str(pki.server_key), ca_file=str(pki.ca))
        assert proc.url is not None and proc.url.startswith("https://")
        assert http_get(proc.url + "/healthz", ca_file=str(pki.ca))[0] == 200
        assert http_get(proc.url + "/v1/stats", ca_file=str(pki.ca))[0] == 401
        out = run_cli(["stats", proc.url, "--ca-file", str(pki.ca), "--json"],
                      env=clean_env(PREFIXSTORE_ADMIN_TOKEN=ADMIN_TOKEN))
        assert out.returncode == 0, out.stderr
        assert '"tenants"' in out.stdout
        out = run_cli(["stats", proc.url, "--ca-file", str(pki.ca)], env=clean_env())
        assert out.returncode == 1 and "401" in out.stderr
        out = run_cli(["stats", proc.url], env=clean_env(PREFIXSTORE_ADMIN_TOKEN=ADMIN_TOKEN))
        assert out.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in out.stderr
        assert proc.stop() == 0

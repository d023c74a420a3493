"""/readyz states (lmdb, arena, membership), liveness beside it, the access and slow-request logs
(what they name and what they never do), the JSON log format, and the per-tenant and FLOPs-saved
series."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
from pathlib import Path

import aiohttp
import pytest

from prefixstore.admission import MODEL_PRESETS
from prefixstore.logs import JsonFormatter, handler
from prefixstore.protocol import KVLayout, Namespace
from prefixstore.store import Store, StoreConfig, create_app
from prefixstore.store.membership import DnsResolver

from ..conftest import RunningStore
from ..factories import make_namespace
from ..security.helpers import ADMIN_TOKEN, TOKENS, raw_post, write_tenants


async def get(url: str, path: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as resp:
            return resp.status, await resp.json()


def config(tmp_path: Path, **extra: object) -> StoreConfig:
    values: dict[str, object] = {"port": 0, "data_dir": str(tmp_path / "lmdb"), "ram_bytes": 4 << 20,
                                 "page_bytes": 4096, "disk_bytes": 64 << 20, "nixl": "off"}
    return StoreConfig(**(values | extra))  # type: ignore[arg-type]


async def test_a_store_is_ready_once_open_and_mapped(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    running: RunningStore = await start_store(config(tmp_path))
    status, body = await get(running.url, "/readyz")
    if status == 503:  # the prefault may still run: then /readyz says so, naming it (the store's flag
        # is not read instead: the prefault may end between the answer and the read)
        assert "being mapped in" in body["checks"]["arena"]  # type: ignore[index]
        status, body = await wait_arena(running.url)
    assert status == 200
    assert body == {"ready": True, "checks": {"lmdb": "ok", "arena": "ok", "membership": "ok"}}
    assert await get(running.url, "/healthz") == (200, {"status": "ok"})


async def test_arena_is_not_ready_until_its_prefault_finished(tmp_path: Path) -> None:
    store = Store(config(tmp_path, data_dir="none"))
    assert not store.arena_ready  # mapped, not yet populated: not ready
    await store.start()
    try:
        for _ in range(2000):  # a poll bound, not a timing claim
            if store.arena_ready:
                break
            await asyncio.sleep(0.005)
        assert store.arena_ready
    finally:
        await store.close()


class FlakyDns:
    """DNS that does not answer (EAI_AGAIN) until told to, then answers ``records``."""

    def __init__(self) -> None:
        self.error: int | None = socket.EAI_AGAIN
        self.records = ["127.0.0.9"]

    async def addresses(self, host: str) -> list[str]:
        if self.error is not None:
            raise socket.gaierror(self.error, "Temporary failure in name resolution")
        return self.records

    async def name_of(self, address: str) -> str | None:
        return None


async def start_dns_store(tmp_path: Path, dns: FlakyDns) -> tuple[aiohttp.test_utils.TestServer, str]:
    from aiohttp.test_utils import TestServer

    cfg = config(tmp_path, data_dir="none", peers_dns="prefixstore-headless:8077")
    server = TestServer(create_app(cfg, resolver=DnsResolver(addresses=dns.addresses, name_of=dns.name_of)),
                        host="127.0.0.1")
    await server.start_server()
    return server, str(server.make_url("")).rstrip("/")


async def wait_arena(url: str) -> tuple[int, dict[str, object]]:
    for _ in range(2000):  # a poll bound, not a timing claim: the arena is 4 MiB
        status, body = await get(url, "/readyz")
        if body["checks"]["arena"] == "ok":  # type: ignore[index]
            return status, body
        await asyncio.sleep(0.005)
    raise AssertionError("the arena never became ready")


async def test_a_dns_member_is_not_ready_until_dns_answered(tmp_path: Path) -> None:
    from prefixstore.store.cluster import MEMBERSHIP

    dns = FlakyDns()
    server, url = await start_dns_store(tmp_path, dns)
    try:
        status, body = await wait_arena(url)
        assert status == 503 and body["ready"] is False
        checks = body["checks"]
        assert isinstance(checks, dict)
        assert "peers_dns=prefixstore-headless:8077 has not answered" in checks["membership"]
        assert checks["lmdb"] == "ok" and checks["arena"] == "ok"
        assert (await get(url, "/healthz"))[0] == 200  # liveness does not care
        membership = server.app[MEMBERSHIP]
        dns.error = None
        assert await membership.refresh()
        status, body = await get(url, "/readyz")
        assert status == 200 and body["ready"] is True
        dns.error = socket.EAI_AGAIN  # DNS goes away later: the last good view stays, and so does readiness
        assert not await membership.refresh()
        assert (await get(url, "/readyz"))[0] == 200
    finally:
        await server.close()


async def test_no_such_name_is_an_answer_the_first_pod_starts_alone(tmp_path: Path) -> None:
    """A fresh StatefulSet: the headless Service has no ready pod, so DNS says 'no such name'. That
    is an answer (the node is alone), or no pod would ever become ready and enter DNS."""
    dns = FlakyDns()
    dns.error = socket.EAI_NONAME
    server, url = await start_dns_store(tmp_path, dns)
    try:
        status, body = await wait_arena(url)
        assert status == 200 and body["checks"] == {"lmdb": "ok", "arena": "ok", "membership": "ok"}
    finally:
        await server.close()


@pytest.fixture
def access_records() -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("prefixstore.access")
    keep = Keep(level=logging.DEBUG)
    logger.addHandler(keep)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(keep)
    logger.setLevel(old)


async def test_access_log_names_route_tenant_status_sizes_never_tokens_or_payloads(
        start_store, tmp_path: Path, access_records: list[logging.LogRecord]) -> None:  # type: ignore[no-untyped-def]
    tenants = write_tenants(tmp_path / "tenants.toml")
    running: RunningStore = await start_store(config(tmp_path, tenants_file=str(tenants), access_log=True))
    ns = make_namespace(tenant="alpha", block_tokens=16, with_state=False)
    async with running.client(ns, token=TOKENS["alpha"]) as client:
        tokens = list(range(7000, 7000 + 2 * ns.block_tokens))
        payload = bytes(range(256)) * (ns.kv.payload_bytes(ns.block_tokens) // 256 + 1)
        saved = await client.save(client.prompt(tokens), len(tokens),
                                  lambda a, b: payload[: ns.kv.payload_bytes(b - a)])
        assert saved.stored == 2
        reads = (await client.lookup(tokens)).kv_reads(len(tokens))
        outs = [bytearray(ns.kv.payload_bytes(ns.block_tokens)) for _ in reads]
        assert await client.read([item for item, _, _ in reads], outs) == [len(o) for o in outs]
    assert (await raw_post(running.url, "/v1/lookup", {}, "not-a-token")).status == 401
    async with aiohttp.ClientSession() as s:
        async with s.get(running.url + "/v1/members?key=00ff", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}):
            pass
    lines = [r.access for r in access_records]  # type: ignore[attr-defined]
    puts = [f for f in lines if f["endpoint"] == "/v1/put"]
    assert len(puts) == 1
    assert puts[0]["tenant"] == "alpha" and puts[0]["status"] == 200 and puts[0]["method"] == "POST"
    assert puts[0]["bytes_in"] > 2 * ns.kv.payload_bytes(ns.block_tokens)  # the body, payloads included
    assert isinstance(puts[0]["ms"], float) and puts[0]["peer"] == "127.0.0.1"
    gets = [f for f in lines if f["endpoint"] == "/v1/get"]
    # The payloads leave past aiohttp's response (store/sendbody.py) and are counted all the same.
    assert len(gets) == 1 and gets[0]["bytes_out"] > 2 * ns.kv.payload_bytes(ns.block_tokens), gets
    refused = [f for f in lines if f["status"] == 401]
    assert refused == [{**refused[0], "endpoint": "/v1/lookup", "tenant": "-"}]
    members = [f for f in lines if f["endpoint"] == "/v1/members"]
    assert [f["tenant"] for f in members] == ["alpha", "(admin)"]  # the client's, then the admin's
    text = "\n".join(r.getMessage() for r in access_records)
    for secret in (*TOKENS.values(), ADMIN_TOKEN, "not-a-token", "00ff"):  # tokens, and a query string's key
        assert secret not in text and secret not in json.dumps(lines)
    assert all(r.levelno == logging.INFO for r in access_records)
    assert "POST /v1/put tenant=alpha status=200" in text


async def test_slow_request_log_without_the_access_log(start_store, tmp_path: Path,
                                                        access_records: list[logging.LogRecord]) -> None:  # type: ignore[no-untyped-def]
    running: RunningStore = await start_store(config(tmp_path, slow_request_s=1e-9))  # everything is slow
    assert (await get(running.url, "/healthz"))[0] == 200
    assert [r.levelno for r in access_records] == [logging.WARNING]
    assert access_records[0].getMessage().startswith("slow request: GET /healthz tenant=default status=200")
    quiet: RunningStore = await start_store(config(tmp_path / "quiet", slow_request_s=3600.0))
    assert (await get(quiet.url, "/healthz"))[0] == 200
    assert len(access_records) == 1  # neither slow nor access-logged: nothing


def test_json_log_lines_carry_the_access_fields() -> None:
    out = io.StringIO()
    logger = logging.getLogger("prefixstore.test-json")
    h = handler("json", out)
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        logger.warning("disk %s", "full", extra={"access": {"endpoint": "/v1/put", "status": 413}})
        logger.info("plain")
    finally:
        logger.removeHandler(h)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["message"] == "disk full" and first["level"] == "WARNING" and first["logger"] == "prefixstore.test-json"
    assert first["endpoint"] == "/v1/put" and first["status"] == 413 and first["ts"].endswith("Z")
    assert second["message"] == "plain" and "endpoint" not in second
    assert isinstance(handler("text").formatter, logging.Formatter)
    assert not isinstance(handler("text").formatter, JsonFormatter)


def test_log_knobs_are_validated() -> None:
    from prefixstore.store.config import ConfigError

    with pytest.raises(ConfigError, match="log_format"):
        StoreConfig(log_format="xml")
    with pytest.raises(ConfigError, match="slow_request_s"):
        StoreConfig(slow_request_s=-1.0)


async def test_tenant_usage_and_flops_saved_series(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tenants = write_tenants(tmp_path / "tenants.toml", quotas={"alpha": 1 << 20})
    running: RunningStore = await start_store(config(tmp_path, tenants_file=str(tenants)))
    shape = MODEL_PRESETS["transformer-7b"]  # a preset named by the namespace's model: its FLOP model
    ns = Namespace(model=shape.name, kv=KVLayout(num_layers=2, num_heads=2, head_dim=16), block_tokens=16,
                   tenant="alpha")
    tokens = list(range(3 * 16))
    async with running.client(ns, token=TOKENS["alpha"]) as client:
        saved = await client.save(client.prompt(tokens), len(tokens), lambda a, b: bytes(ns.kv.payload_bytes(b - a)))
        assert saved.stored == 3
        res = await client.lookup(tokens + [1, 2])
        await client.release(res.lease_id)
        assert res.kv_tokens == len(tokens)
    registry = running.store.metrics.registry
    assert registry.get_sample_value("prefixstore_prefill_flops_saved_total") == shape.prefill_flops(len(tokens))
    held = running.store.ledger.bytes_of("alpha")
    assert held > 3 * ns.kv.payload_bytes(16)
    assert registry.get_sample_value("prefixstore_tenant_stored_bytes", {"tenant": "alpha"}) == held
    assert registry.get_sample_value("prefixstore_tenant_quota_bytes", {"tenant": "alpha"}) == 1 << 20
    assert registry.get_sample_value("prefixstore_tenant_quota_bytes", {"tenant": "beta"}) is None

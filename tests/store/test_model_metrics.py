"""Hit rates per model (store/model_metrics.py): exact values per (tenant, model) in /metrics and
/v1/stats, and the bound on the model label a tenant can mint.

Two tenants each run a hybrid model and a plain transformer through a real store (with a tenants
file); the script's answers are worked out in the comments. The namespace (tests/factories.py):
B = 4 tokens.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prefixstore.protocol import Namespace
from prefixstore.store import StoreConfig
from prefixstore.store.model_metrics import OTHER_MODELS

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload
from ..security.helpers import ADMIN_TOKEN, TOKENS, write_tenants

A = list(range(1, 13))  # 12 tokens: 3 blocks


def config(tmp_path: Path, per_tenant: int = 16) -> StoreConfig:
    return StoreConfig(port=0, data_dir="none", ram_bytes=4 << 20, page_bytes=4096, nixl="off",
                       state_admission="always", tenants_file=str(write_tenants(tmp_path / "tenants.toml")),
                       model_metrics_per_tenant=per_tenant)


async def save_and_look_up(running: RunningStore, ns: Namespace, tenant: str, lookups: int = 1) -> None:
    """Save A (KV, and a snapshot at 8 on a hybrid), then look up A + 4 new tokens ``lookups`` times:
    KV hit 12 of 16 tokens each time; state hit 8 of 16 on a hybrid."""
    async with running.client(ns, token=TOKENS[tenant]) as c:
        snapshots = {8: state_payload(ns, A, 8)} if ns.has_state else None
        saved = await c.save(c.prompt(A), 12, lambda a, b: kv_payload(ns, A, a, b), snapshots)
        assert saved.stored == 3 + (1 if ns.has_state else 0), c.failures
        for _ in range(lookups):
            res = await c.lookup(A + [90, 91, 92, 93])
            assert (res.kv_tokens, res.state_tokens) == (12, 8 if ns.has_state else 0)
            await c.release(res.lease_id)


async def scrape(running: RunningStore) -> dict[tuple[str, str, str, str], float]:
    async with aiohttp.ClientSession() as s, s.get(running.url + "/metrics") as r:
        text = await r.text()
    return {(x.labels["tenant"], x.labels["model"], x.labels["kind"], x.labels["result"]): x.value
            for f in text_string_to_metric_families(text) for x in f.samples
            if x.name == "prefixstore_model_lookup_tokens_total"}


async def stats(running: RunningStore) -> dict[str, object]:
    async with aiohttp.ClientSession() as s, \
            s.get(running.url + "/v1/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        body = await r.json()
    assert isinstance(body, dict)
    return body


async def test_hit_rates_per_tenant_and_model(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    running = await start_store(config(tmp_path))
    hybrid = make_namespace(model="hybrid-7b", tenant="alpha")
    plain = make_namespace(model="plain-8b", tenant="alpha", with_state=False)
    await save_and_look_up(running, hybrid, "alpha", lookups=2)
    await save_and_look_up(running, plain, "alpha", lookups=1)
    await save_and_look_up(running, make_namespace(model="hybrid-7b", tenant="beta"), "beta", lookups=3)
    assert await scrape(running) == {
        # 2 lookups of 16 tokens: 24 KV hits, 8 misses; 16 state hits, 16 misses.
        ("alpha", "hybrid-7b", "kv", "hit"): 24.0, ("alpha", "hybrid-7b", "kv", "miss"): 8.0,
        ("alpha", "hybrid-7b", "state", "hit"): 16.0, ("alpha", "hybrid-7b", "state", "miss"): 16.0,
        # A plain transformer has no state series.
        ("alpha", "plain-8b", "kv", "hit"): 12.0, ("alpha", "plain-8b", "kv", "miss"): 4.0,
        # The same model id under another tenant is its own series.
        ("beta", "hybrid-7b", "kv", "hit"): 36.0, ("beta", "hybrid-7b", "kv", "miss"): 12.0,
        ("beta", "hybrid-7b", "state", "hit"): 24.0, ("beta", "hybrid-7b", "state", "miss"): 24.0,
    }
    models = (await stats(running))["lookups"]["models"]  # type: ignore[index]
    assert models[0] == {"tenant": "alpha", "model": "hybrid-7b",
                         "kv": {"hit_tokens": 24, "miss_tokens": 8, "rate": 0.75},
                         "state": {"hit_tokens": 16, "miss_tokens": 16, "rate": 0.5}}
    assert models[1] == {"tenant": "alpha", "model": "plain-8b",
                         "kv": {"hit_tokens": 12, "miss_tokens": 4, "rate": 0.75}}
    assert [(m["tenant"], m["model"]) for m in models] == [("alpha", "hybrid-7b"), ("alpha", "plain-8b"),
                                                           ("beta", "hybrid-7b")]


async def test_a_tenant_minting_model_names_moves_only_its_own_other_series(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    running = await start_store(config(tmp_path, per_tenant=2))
    await save_and_look_up(running, make_namespace(model="beta-model", tenant="beta"), "beta")
    for k in range(6):  # alpha registers and looks up six models; only its first two get series
        await save_and_look_up(running, make_namespace(model=f"alpha-{k}", tenant="alpha"), "alpha")
    series = await scrape(running)
    assert {(t, m) for t, m, _, _ in series} == {("beta", "beta-model"), ("alpha", "alpha-0"), ("alpha", "alpha-1"),
                                                 ("alpha", OTHER_MODELS)}
    assert series[("alpha", OTHER_MODELS, "kv", "hit")] == 4 * 12  # alpha-2 .. alpha-5, one lookup each
    assert series[("alpha", OTHER_MODELS, "state", "miss")] == 4 * 8
    assert series[("beta", "beta-model", "kv", "hit")] == 12  # untouched by alpha's names

"""A bounded two-tenant fuzz run against a real ``prefixstore serve``: 0 cross-tenant answers, 0 5xx,
RSS under budget.

Alpha and beta save prompts drawn from one small token alphabet, so they often save the very same
prompts. Each tenant's lookups must equal the reference model of *its own* saves (DESIGN §5's
specification, tests/store/test_index_model.py), its reads must return its own bytes, and an
attacker (beta replaying alpha's hash chains, plus oversized and flooding requests) must learn
nothing and move no number it cannot move with its own data.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.prompt import Prompt
from prefixstore.protocol import Namespace

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import StartServe, http_get, serving
from ..store.test_index_model import Model
from .helpers import TOKENS, raw_post, write_tenants

RAM_BYTES = 32 << 20
RSS_BUDGET_BYTES = RAM_BYTES + (200 << 20)  # the arena + the interpreter, aiohttp, numpy, lmdb
STEPS = 400


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert m is not None
    return int(m.group(1)) << 10


def metric_sum(url: str, name: str, label: str = "") -> float:
    _, body = http_get(url + "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_two_tenants_under_fuzz_never_see_each_other(serve: StartServe, tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "t.toml")
    proc = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"), "--ram-bytes", str(RAM_BYTES),
                 "--page-bytes", "4096", "--tenants-file", str(tenants), "--state-admission", "always",
                 "--max-offers-per-tenant", "512", "--max-leases-per-tenant", "64")
    url = proc.url
    assert url is not None
    rng = random.Random(20261201)
    spaces: dict[str, Namespace] = {t: make_namespace(tenant=t, block_tokens=4) for t in ("alpha", "beta")}
    models = {t: Model() for t in spaces}
    sequences: list[list[int]] = [[]]
    clients = {t: PrefixClient(ns, ClientConfig(url=url, token=TOKENS[t])) for t, ns in spaces.items()}
    cross = 0
    try:
        for c in clients.values():
            await c.lookup([0])  # registers its namespace
        for _ in range(STEPS):
            tenant = rng.choice(("alpha", "beta"))
            c, ns, model = clients[tenant], spaces[tenant], models[tenant]
            other = "beta" if tenant == "alpha" else "alpha"
            op = rng.random()
            base = rng.choice(sequences)
            tokens = base[: rng.randint(0, len(base))] + [rng.randint(0, 2) for _ in range(rng.randint(1, 12))]
            if op < 0.35:  # save (both tenants draw from the same pool: identical prompts are common)
                sequences.append(tokens)
                kv_upto = rng.randint(1, len(tokens))
                snaps = sorted({rng.randint(1, kv_upto) for _ in range(rng.randint(0, 2))})
                res = await c.save(c.prompt(tokens), kv_upto, lambda a, b, t=tokens, n=ns: kv_payload(n, t, a, b),
                                   snapshots={t: state_payload(ns, tokens, t) for t in snaps})
                assert res.dropped == 0 and res.rejected == 0, res
                model.save(tokens, kv_upto, snaps)
            elif op < 0.75:  # lookup and read, checked against this tenant's model and bytes
                res = await c.lookup(tokens)
                assert (res.kv_tokens, res.state_tokens) == (model.kv_tokens(tokens), model.state_tokens(tokens))
                if res.kv_tokens:
                    reads = res.kv_reads(res.kv_tokens)
                    outs = [bytearray(ns.block_bytes) for _ in reads]
                    got = await c.read([item for item, _, _ in reads], outs)
                    per = ns.kv.layer_token_bytes
                    for (_, a, b), out, n in zip(reads, outs, got):
                        stored = n // (ns.kv.num_layers * per)
                        mine = b"".join(bytes(out[layer * stored * per: layer * stored * per + (b - a) * per])
                                        for layer in range(ns.kv.num_layers))
                        assert mine == kv_payload(ns, tokens, a, b)
                    await c.release(res.lease_id)
            else:  # the attacker: replay the other tenant's chain of a prompt under its own namespace
                p = Prompt(spaces[other], tokens)
                answer = await raw_post(url, "/v1/lookup", {"ns": ns.id, "hashes": b"".join(p.hashes),
                                                            "tokens": p.packed, "lease": True}, TOKENS[tenant])
                assert answer.status == 200
                # No full block of the other's chain matches in its namespace; what the tokens match
                # inside its own root's children is its own data, within its own model.
                if answer.body["matched_blocks"] > 0 or answer.body["kv_tokens"] > model.kv_tokens(tokens):
                    cross += 1
                if answer.body["lease"]:
                    await raw_post(url, "/v1/release", {"lease": answer.body["lease"]}, TOKENS[tenant])
        assert cross == 0
        for c in clients.values():
            assert c.failures == {}, c.failures
    finally:
        await asyncio.gather(*(c.close() for c in clients.values()))
    assert metric_sum(url, "prefixstore_requests_total", 'status="5xx"') == 0
    assert proc.proc.pid and rss_bytes(proc.proc.pid) < RSS_BUDGET_BYTES
    assert proc.stop() == 0

"""One cache for every tensor-parallel size (issue 32): the connector against vLLM's real classes.

A TP=2 engine is two Engines of the harness (tests/vllm/harness.py), one per rank, each with its
share of the model's KV heads and state channels, driven with the same plans in two threads and
joined by a group whose gather is a barrier (the seam ``PrefixStoreWorker.tp``; in vLLM it is the
engine's own tensor-parallel group, client/vllm/tp.py). A TP=1 engine reads what the TP=2 one
saved, and the reverse, byte for byte what vLLM's own cache kernel would have written; and the
store holds the canonical layout, checked against the KV and state cut here by hand.
"""

from __future__ import annotations

import threading

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from prefixstore.client import SyncPrefixClient  # noqa: E402
from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta  # noqa: E402

from ..serve_process import ServeProcess  # noqa: E402
from .harness import ATTN, CONV_CHANNELS, HEADS, MAMBA, PROMPT, Engine, random_kv, request  # noqa: E402


class ThreadGroup:
    """A tensor-parallel group of threads: gather and agree through a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._slots: list[object] = [None] * size
        self.gathers = 0

    def member(self, rank: int) -> Member:
        return Member(self, rank)


class Member:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, value: object) -> list[object]:
        self.group._slots[self.rank] = value
        self.group._barrier.wait()
        out = list(self.group._slots)
        self.group._barrier.wait()
        return out

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._exchange(local.clone())
        if self.rank == 0:
            self.group.gathers += 1
        return [p for p in parts if isinstance(p, torch.Tensor)] if self.rank == 0 else None

    def all_agree(self, ok: bool) -> bool:
        return all(self._exchange(ok))


def tp_engines(store: ServeProcess, model_id: str, *, hybrid: bool, size: int = 2) -> list[Engine]:
    group = ThreadGroup(size)
    engines: list[Engine] = []
    threads = [threading.Thread(target=lambda r=r: engines.append(Engine(
        store.url, model_id, hybrid=hybrid, state="short_conv", tensor_parallel_size=size, tp=group.member(r))))
        for r in range(size)]  # every rank registers at once: they agree on refusing in a collective
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(engines) == size
    engines.sort(key=lambda e: e.worker.worker_side.tp.rank)  # type: ignore[union-attr]
    return engines


def tp_step(engines: list[Engine]) -> None:
    """One step of a TP engine: rank 0's scheduler plans, every rank's worker runs the plans."""
    meta = engines[0].scheduler.build_connector_meta(SchedulerOutput.make_empty())
    errors: list[BaseException] = []

    def run(e: Engine) -> None:
        try:
            e.worker.bind_connector_metadata(meta)
            e.worker.start_load_kv(None)  # type: ignore[arg-type]
            for name in ATTN:
                e.worker.wait_for_layer_load(name)
            e.worker.wait_for_save()
            e.worker.drain()
        except BaseException as err:  # noqa: BLE001 -- re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    metas = [e.worker.build_connector_worker_meta() for e in engines]
    merged = PrefixStoreWorkerMeta()
    for m in metas:
        if m is not None:
            merged.aggregate(m)
    engines[0].scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=merged))


def conv_state(seed: int) -> torch.Tensor:
    """The model's whole conv state of one layer: [channels, window] (the canonical orientation)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CONV_CHANNELS, 3, generator=g).to(torch.float16)


def write_state(e: Engine, block: int, full: dict[str, torch.Tensor], rank: int, size: int) -> None:
    """Rank ``rank``'s channels of each layer's conv state into Mamba block ``block``, in vLLM's orientation."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    per = CONV_CHANNELS // size
    for name in MAMBA:
        local = full[name][rank * per : (rank + 1) * per]
        local = local if is_conv_state_dim_first() else local.T
        e.views[name][block].view(-1).view(torch.uint8)[: local.numel() * 2].copy_(
            local.contiguous().view(-1).view(torch.uint8))


def read_state(e: Engine, block: int, rank: int, size: int) -> dict[str, torch.Tensor]:
    """The conv state a rank's Mamba block holds, as its channels x window."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    per = CONV_CHANNELS // size
    out = {}
    for name in MAMBA:
        raw = e.views[name][block].view(-1).view(torch.uint8)[: per * 3 * 2].clone().view(torch.float16)
        out[name] = raw.view(per, 3) if is_conv_state_dim_first() else raw.view(3, per).T
    return out


def heads_of(kv: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    per = HEADS // size
    return {name: t[:, :, rank * per : (rank + 1) * per] for name, t in kv.items()}


def store_bytes(store: ServeProcess, e: Engine, tokens: list[int], upto: int) -> tuple[bytes, bytes | None]:
    """The KV payload of tokens [0, upto) as the store holds it (one block of 16 and what follows) and
    the snapshot at ``upto``, read with a plain client of the engine's namespace."""
    side = e.scheduler.scheduler_side
    assert side is not None
    from prefixstore.client.vllm.plans import namespace_for

    ns = namespace_for(e.config, side.groups, side.settings)
    with SyncPrefixClient(ns, side.settings.client) as c:
        res = c.lookup(c.prompt(tokens))
        assert res.kv_tokens >= upto
        reads = res.kv_reads(upto)
        outs = [bytearray(ns.kv.payload_bytes(16)) for _ in reads]
        assert all(n > 0 for n in c.read([item for item, _, _ in reads], outs))
        state = None
        if ns.has_state and res.state_tokens == upto:
            item = res.state_read()
            assert item is not None
            out = bytearray(ns.state.snapshot_bytes)
            assert c.read([item], [out]) == [len(out)]
            state = bytes(out)
        c.release(res.lease_id)
    return bytes(outs[0]), state


def canonical_kv(kv: dict[str, torch.Tensor], start: int, end: int) -> bytes:
    """The store's layout by hand: per layer, K then V, each head's tokens of ``head_dim``."""
    return b"".join(kv[name][:, start:end].permute(0, 2, 1, 3).contiguous().view(torch.uint8).numpy().tobytes()
                    for name in ATTN)


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_cross_tp_a_tp2_save_loads_at_tp1_byte_for_byte(store: ServeProcess, closing: list[Engine],
                                                         hybrid: bool) -> None:
    """TP=2 saves (each rank copies its head and its channels; rank 0 writes the whole entry); a
    TP=1 engine of the same model finds it in one lookup and loads it into its own blocks: exactly
    what vLLM's kernel would have written there with the whole KV, and the whole conv state."""
    model = f"cross-tp-2to1-{hybrid}"
    ranks = tp_engines(store, model, hybrid=hybrid)
    closing.extend(ranks)
    kv = random_kv(seed=21)
    full = {name: conv_state(31 + i) for i, name in enumerate(MAMBA)}
    for r, e in enumerate(ranks):
        e.write([3, 7, 9], heads_of(kv, r, 2), 0, 40)
        if hybrid:
            write_state(e, 5, full, r, 2)  # the running state after 40 tokens: Mamba block (40 - 1) // 16 = 2
    done = ranks[0].scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40),
                                                          ([3, 7, 9], [0, 0, 5]) if hybrid else ([3, 7, 9],))
    assert done == (True, None)
    tp_step(ranks)
    group = ranks[0].worker.worker_side.tp.group  # type: ignore[union-attr]
    assert group.gathers == 1  # one gather for the save, not one per payload

    # The store holds the canonical layout: every head of block 0, head-major; the whole state.
    block0, state = store_bytes(store, ranks[0], PROMPT, 40)
    assert block0 == canonical_kv(kv, 0, 16)
    if hybrid:
        assert state == b"".join(full[name].contiguous().view(torch.uint8).numpy().tobytes() for name in MAMBA)

    one = Engine(store.url, model, hybrid=hybrid, state="short_conv")
    closing.append(one)
    r = request("a", PROMPT + [1, 2])
    assert one.scheduler.get_num_new_matched_tokens(r, 0) == (40, hybrid)
    tables = ([2, 4, 6], [0, 0, 8]) if hybrid else ([2, 4, 6],)
    one.load(r, 0, 40, tables)
    if hybrid:
        one.worker.get_finished(set())
    expected = one.expected([2, 4, 6], kv, 40)
    assert all(torch.equal(one.blocks([2, 4, 6])[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in ATTN)
    if hybrid:
        got = read_state(one, 8, 0, 1)
        assert all(torch.equal(got[name], full[name]) for name in MAMBA)
    stats = one.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookups"] == 1


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
def test_cross_tp_a_tp1_save_loads_at_tp2_each_rank_its_heads(store: ServeProcess, closing: list[Engine],
                                                              hybrid: bool) -> None:
    """The reverse: TP=1 saves; each rank of a TP=2 engine reads exactly its heads and channels
    (ranged reads by head) and its blocks are what the kernel would have written there."""
    model = f"cross-tp-1to2-{hybrid}"
    one = Engine(store.url, model, hybrid=hybrid, state="short_conv")
    closing.append(one)
    kv = random_kv(seed=22)
    full = {name: conv_state(41 + i) for i, name in enumerate(MAMBA)}
    one.write([3, 7, 9], kv, 0, 40)
    if hybrid:
        write_state(one, 5, full, 0, 1)
    one.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9], [0, 0, 5]) if hybrid else ([3, 7, 9],))
    block0, state = store_bytes(store, one, PROMPT, 40)
    assert block0 == canonical_kv(kv, 0, 16)

    ranks = tp_engines(store, model, hybrid=hybrid)
    closing.extend(ranks)
    r = request("a", PROMPT + [1, 2])
    assert ranks[0].scheduler.get_num_new_matched_tokens(r, 0) == (40, hybrid)
    tables = ([2, 4, 6], [0, 0, 8]) if hybrid else ([2, 4, 6],)
    blocks = KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in ids] for ids in tables))
    ranks[0].scheduler.update_state_after_alloc(r, blocks, 40)
    tp_step(ranks)
    for rank, e in enumerate(ranks):
        if hybrid:
            assert e.worker.get_finished(set())[1] == {"a"}
        expected = e.expected([2, 4, 6], heads_of(kv, rank, 2), 40)
        assert all(torch.equal(e.blocks([2, 4, 6])[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in ATTN)
        if hybrid:
            got = read_state(e, 8, rank, 2)
            per = CONV_CHANNELS // 2
            assert all(torch.equal(got[name], full[name][rank * per : (rank + 1) * per]) for name in MAMBA)
        assert e.worker.get_kv_connector_stats().data["load_failures"] == 0  # type: ignore[union-attr]


def test_cross_tp_one_lookup_per_request_whatever_the_tp(store: ServeProcess, closing: list[Engine]) -> None:
    """The scheduler of a TP=2 engine asks the store once per request (one namespace for both
    ranks), and counts it: the store's own lookup counter moves by one per request."""
    from ..nixl.helpers import metric

    assert store.url is not None
    ranks = tp_engines(store, "cross-tp-lookups", hybrid=True)
    closing.extend(ranks)
    before = metric(store.url, "prefixstore_lookups_total", "")
    for i in range(3):
        r = request(f"q{i}", [900 + i] * 40)
        assert ranks[0].scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        ranks[0].scheduler.update_state_after_alloc(r, KVCacheBlocks(blocks=([], [])), 0)
    assert metric(store.url, "prefixstore_lookups_total", "") - before == 3
    stats = ranks[0].scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookups"] == 3


def test_cross_tp_ranks_refuse_together(store: ServeProcess, closing: list[Engine]) -> None:
    """A rank that cannot map its views makes every rank refuse (a save's slices are gathered: one
    rank saving while another does not would leave it waiting in the gather)."""
    from prefixstore.client.vllm import worker as worker_module

    real = worker_module.PrefixStoreWorker._token_layout
    calls = {"n": 0}

    def second_rank_fails(self, names):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if self.tp is not None and self.tp.rank == 1:
            raise worker_module.LayoutUnsupported("planted: rank 1's views")
        return real(self, names)

    worker_module.PrefixStoreWorker._token_layout = second_rank_fails  # type: ignore[method-assign]
    try:
        ranks = tp_engines(store, "cross-tp-refuse", hybrid=False)
    finally:
        worker_module.PrefixStoreWorker._token_layout = real  # type: ignore[method-assign]
    closing.extend(ranks)
    assert calls["n"] == 2
    assert all(e.worker.worker_side is not None and e.worker.worker_side.refused for e in ranks)


def test_heads_of_a_save_are_assembled_from_every_rank(store: ServeProcess, closing: list[Engine]) -> None:
    """The whole entry comes from both ranks: with rank 1's head zeroed the store's block differs
    from the canonical bytes exactly in head 1's rows (guards the assembly, not just rank 0)."""
    ranks = tp_engines(store, "cross-tp-assembly", hybrid=False)
    closing.extend(ranks)
    kv = random_kv(seed=23)
    ranks[0].write([3, 7, 9], heads_of(kv, 0, 2), 0, 40)  # rank 1's blocks stay zero
    ranks[0].scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],))
    tp_step(ranks)
    block0, _ = store_bytes(store, ranks[0], PROMPT, 40)
    got = np.frombuffer(block0, np.uint8).reshape(len(ATTN), 2, HEADS, -1)
    want = np.frombuffer(canonical_kv(kv, 0, 16), np.uint8).reshape(len(ATTN), 2, HEADS, -1)
    assert np.array_equal(got[:, :, 0], want[:, :, 0]) and not got[:, :, 1].any()

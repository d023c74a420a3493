"""Drive a real :class:`Store` core (index, arena, LMDB tier) synchronously, without HTTP.

The same offer -> put -> commit -> lookup -> get sequence the server runs, so
property tests can take thousands of steps quickly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import Namespace
from prefixstore.protocol.match import lean_levels, span_tokens
from prefixstore.protocol.wire import STATUS_OK, WANT, GetItem, ItemSpec, LookupRequest
from prefixstore.store import Store, StoreConfig

from ..factories import kv_payload, state_payload


class CoreHarness:
    def __init__(self, config: StoreConfig, ns: Namespace, clock: list[float] | None = None) -> None:
        self.config = config
        self.ns = ns
        self.loop = asyncio.new_event_loop()
        self.now = clock if clock is not None else [1000.0]
        self.store = self._open()

    def _open(self) -> Store:
        store = Store(self.config, clock=lambda: self.now[0])

        async def start() -> None:
            await store.start()
            await store.register_namespace(self.ns)

        self.loop.run_until_complete(start())
        return store

    def run(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def restart(self) -> None:
        self.run(self.store.close())
        self.store = self._open()

    def drain(self) -> None:
        """Wait for the write-behind to have written every committed entry to LMDB."""
        self.run(self.store.drain_writes())

    def close(self) -> None:
        self.run(self.store.close())
        self.loop.close()

    # ------------------------------------------------------------ operations

    def save(self, tokens: list[int], kv_upto: int, snapshots: Mapping[int, bytes] | None = None,
             extra_keys: list[bytes] | None = None) -> dict[str, int]:
        """Offer, put and commit KV [0, kv_upto) and the given snapshots; count outcomes."""
        keys, counts = self.stage(tokens, kv_upto, snapshots, extra_keys)
        results = self.run(self.store.commit(self.ns.id, keys))
        return {**counts, "committed": sum(r.status == STATUS_OK for r in results)}

    def stage(self, tokens: list[int], kv_upto: int, snapshots: Mapping[int, bytes] | None = None,
              extra_keys: list[bytes] | None = None) -> tuple[list[bytes], dict[str, int]]:
        """:meth:`save` up to its commit: the wire keys to commit, and the offer's counts."""
        p = Prompt(self.ns, tokens, extra_keys)
        kv = p.kv_items(kv_upto)
        specs: list[ItemSpec] = [s for s, _, _ in kv]
        payloads: list[bytes] = [kv_payload(self.ns, tokens, a, b) for _, a, b in kv]
        for t in sorted(snapshots or {}):
            specs.append(p.state_item(t, kv_upto))
            payloads.append((snapshots or {})[t])
        decisions = self.store.offer(self.ns.id, specs)
        wanted = [(with_payload(s, pl), pl) for s, pl, d in zip(specs, payloads, decisions) if d.status == WANT]
        plan = self.store.plan_put(self.ns.id, [s for s, _ in wanted])
        for target, (_, pl) in zip(plan.targets, wanted):
            fill_target(target, pl)
        self.store.verify_put(plan)
        return plan.keys, {"offered": len(specs), "wanted": len(wanted),
                           "have": sum(d.status == "have" for d in decisions)}

    def lookup(self, tokens: list[int], lease: bool = True, extra_keys: list[bytes] | None = None):  # type: ignore[no-untyped-def]
        p = Prompt(self.ns, tokens, extra_keys)
        req = LookupRequest(namespace_id=self.ns.id, hashes=b"".join(p.hashes), tokens=p.packed, lease=lease,
                            extras=tuple((j, x) for j, x in enumerate(p.extra_keys) if x))
        return p, self.store.lookup(req)

    def lean_lookup(self, tokens: list[int], window: int, lease: bool = True,  # type: ignore[no-untyped-def]
                    extra_keys: list[bytes] | None = None):
        """A lean lookup as the node client makes it (client/node.py): tokens of level 0 and of the last
        ``window`` tokens, then of each level the store names. Returns the prompt, the answer and the
        levels the store asked for."""
        p = Prompt(self.ns, tokens, extra_keys)
        B = self.ns.block_tokens
        needed: list[int] = []
        while True:
            spans = lean_levels(-(-p.num_tokens // B), B, window, needed)
            req = LookupRequest(namespace_id=self.ns.id, hashes=p.hash_bytes, tokens=span_tokens(p.packed, B, spans),
                                spans=spans, total_tokens=p.num_tokens, lease=lease,
                                extras=tuple((j, x) for j, x in enumerate(p.extra_keys) if x))
            ans = self.store.lookup(LookupRequest.from_header(req.to_header(), self.store.limits, lambda _: B))
            if ans.need_level is None:
                return p, ans, needed
            assert ans.need_level not in needed, (ans.need_level, needed)  # no write raced it here
            needed.append(ans.need_level)

    def read(self, items: list[GetItem]) -> list[bytes | None]:
        plan = self.run(self.store.prepare_get(self.ns.id, items))
        try:
            return [b"".join(bytes(v) for v in self.store.payload_views(s)) if s.status == STATUS_OK else None
                    for s in plan.slots]
        finally:
            self.store.finish_get(plan)

    def read_prefix(self, tokens: list[int], answer, upto: int) -> tuple[bytes | None, bytes | None]:  # type: ignore[no-untyped-def]
        """KV bytes of tokens [0, upto) in per-layer order concatenated over entries, and the snapshot."""
        from prefixstore.client.results import LookupResult

        p = Prompt(self.ns, tokens)
        res = LookupResult(prompt=p, kv_tokens=answer.kv_tokens, state_tokens=answer.state_tokens,
                           matched_blocks=answer.matched_blocks, child=answer.child, snapshot=answer.snapshot)
        reads = res.kv_reads(upto)
        items = [it for it, _, _ in reads]
        if res.snapshot is not None:
            items.append(GetItem(key=res.snapshot.key))
        got = self.read(items)
        kv_parts = []
        for (it, a, b), data in zip(reads, got):
            if data is None:
                return None, None
            kv_parts.append(_first_tokens(self.ns, data, b - a))
        snap = got[-1] if res.snapshot is not None else None
        return b"".join(kv_parts), snap


def fill_target(target: Sequence[memoryview] | None, payload: bytes) -> None:
    """Copy a payload into a put's reserved views (the store's arena pages), as a client's body would."""
    pos = 0
    for view in target or ():
        view[:] = payload[pos : pos + len(view)]
        pos += len(view)


def _first_tokens(ns: Namespace, payload: bytes, n: int) -> bytes:
    """Cut the first n tokens out of a layer-major payload (keeping layer-major order per entry)."""
    per = ns.kv.layer_token_bytes
    total = len(payload) // (ns.kv.num_layers * per)
    return b"".join(payload[layer * total * per : layer * total * per + n * per] for layer in range(ns.kv.num_layers))


def expected_prefix_bytes(ns: Namespace, tokens: list[int], upto: int, block_tokens: int) -> bytes:
    """What read_prefix must return for a correct store: per-entry slices of the true payloads."""
    parts = []
    for a in range(0, upto, block_tokens):
        b = min(a + block_tokens, upto)
        parts.append(kv_payload(ns, tokens, a, b))
    return b"".join(parts)


__all__ = ["CoreHarness", "expected_prefix_bytes", "state_payload"]

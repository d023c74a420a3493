"""Lean probes (protocol/probe.py, client/node.py ``ask_lean``): a cluster lookup's hops carry the
tokens of their first level and of their last ``lookup_token_window`` tokens only; a node whose run
stops where a hop carried none answers ``need_level`` and the client asks that node again with it.
The answers are the whole probes' (tests/cluster/test_fanout_model.py holds them to the model)."""

from __future__ import annotations

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.hashing import TOKEN_BYTES
from prefixstore.protocol.placement import rank

from ..factories import kv_payload, make_namespace, state_payload


async def test_lean_probes_answer_as_whole_ones_and_ask_again_for_the_level_named(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--state-admission", "always")
    ns = make_namespace(block_tokens=4)
    system = list(range(1, 13))  # 3 blocks every conversation shares
    first = system + list(range(100, 122))  # 34 tokens: 8 blocks and 2
    async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls), lookup_token_window=8)) as lean, \
            PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls), lookup_token_window=None)) as whole:
        # The second forks after the system prompt. Its fork head's branch node is not the first's
        # (where they are the same node, 1 in 3, the chain is kept whole there and the walk takes one hop).
        home = rank(cluster.urls, lean.prompt(first).hashes[0])[0]
        second = next(s for k in range(200, 2000, 100) if rank(cluster.urls, lean.prompt(
            s := system + list(range(k, k + 22))).hashes[3])[0] != home)
        for turn in (first, second):  # the second forks after the system prompt: its blocks on another branch
            saved = await lean.save(lean.prompt(turn), len(turn), lambda a, b, t=turn: kv_payload(ns, t, a, b),
                                    {len(turn): state_payload(ns, turn, len(turn))})
            assert saved.dropped == 0 and saved.rejected == 0, saved
        assert isinstance(lean.impl, ClusterClient)
        probes: list[tuple[str, dict[str, object], dict[str, object]]] = []
        for node in lean.impl.nodes():
            async def observe(path: str, req: dict[str, object], ans: dict[str, object], url: str = node.config.url) -> None:
                if path == "/v1/probe":
                    probes.append((url, req, ans))
            node.observers.append(observe)

        # Each conversation's next turn, 40 tokens on: its match stops at level 8, inside neither the
        # first level of a hop nor the last 8 tokens of the prompt.
        for turn in (first, second):
            nxt = turn + list(range(500, 540))
            probes.clear()
            got, ref = await lean.lookup(nxt), await whole.lookup(nxt)
            assert (got.kv_tokens, got.state_tokens, got.checkpoint_hint) == \
                (ref.kv_tokens, ref.state_tokens, ref.checkpoint_hint) == (34, 34, 0)
            assert all(r.get("spans") is not None for _, r, _ in probes), "every hop asked lean"
            total = len(nxt)
            for _, r, _ in probes:
                start = r["start"]
                assert isinstance(start, int)
                carried = len(r["tokens"]) // TOKEN_BYTES  # type: ignore[arg-type]
                assert r["total_tokens"] == total - 4 * start and carried < total - 4 * start
            # The level a node named is carried by the very next probe to it (relative to the hop's
            # first level), which it then answers: one more trip per named level, never a third.
            named = [(url, a["need_level"], r["start"]) for url, r, a in probes if a.get("need_level") is not None]
            assert named, "the stop fell outside what was carried: a node named it"
            for url, level, start in named:
                assert isinstance(level, int) and isinstance(start, int)
                after = [(r, a) for u, r, a in probes if u == url and r["start"] == start]
                carries = [r for r, a in after if [level - start, 1] in r["spans"]  # type: ignore[operator]
                           or any(f <= level - start < f + c for f, c in r["spans"])]  # type: ignore[union-attr]
                assert carries and carries[-1] is after[-1][0] and after[-1][1].get("need_level") is None
            assert len(named) <= len({(u, r["start"]) for u, r, _ in probes})
            assert await lean.release(got.lease_id) and await whole.release(ref.lease_id)
        hops = {r["start"] for _, r, _ in probes}
        assert any(isinstance(s, int) and s > 0 for s in hops), f"the second turn's walk forked: {hops}"

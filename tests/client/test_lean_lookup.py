"""The node client's lean lookup over a real store (client/node.py): what it carries, the second
round trip when the match stops where it carried no tokens, and the whole-prompt request it falls
back to (``lookup_token_window=None``, and every client before lean lookups)."""

from __future__ import annotations

from prefixstore.client.node import NodeClient

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload


async def test_lean_lookups_answer_as_whole_ones_and_carry_few_tokens(running: RunningStore) -> None:
    ns = make_namespace(block_tokens=4)
    lean = running.client(ns, lookup_token_window=8)
    whole = running.client(ns, lookup_token_window=None)
    try:
        node = lean.impl
        assert isinstance(node, NodeClient)
        sent: list[dict[str, object]] = []

        async def observe(path: str, req: dict[str, object], ans: dict[str, object]) -> None:
            if path == "/v1/lookup":
                sent.append(req)
        node.observers.append(observe)

        turn = list(range(100, 122))  # 22 tokens: 5 blocks and a tail of 2, state at 22
        saved = await lean.save(lean.prompt(turn), 22, lambda a, b: kv_payload(ns, turn, a, b),
                                {22: state_payload(ns, turn, 22)})
        assert saved.stored == 7
        # Next turn, 40 tokens on: the match stops at level 5, outside level 0 and the last 8 tokens.
        nxt = turn + list(range(500, 540))
        got, ref = await lean.lookup(nxt), await whole.lookup(nxt)
        assert (got.kv_tokens, got.state_tokens, got.checkpoint_hint) == \
            (ref.kv_tokens, ref.state_tokens, ref.checkpoint_hint) == (22, 22, 0)
        assert [r.get("spans") for r in sent] == [[[0, 1], [14, 2]], [[0, 1], [5, 1], [14, 2]]]
        assert len(sent[0]["tokens"]) == 4 * (4 + 4 + 2)  # type: ignore[arg-type]  # of 62 tokens
        # The turn itself, held to its tail: one trip, tokens of level 0 and the last 8 only.
        sent.clear()
        got = await lean.lookup(turn)
        assert (got.kv_tokens, got.state_tokens) == (22, 22) and len(sent) == 1
        # The answer reads the right bytes.
        reads = got.kv_reads(got.kv_tokens)
        outs = [bytearray(4 * ns.kv.token_bytes) for _ in reads]
        assert await lean.read([it for it, _, _ in reads], outs) == [256] * 5 + [128]
    finally:
        await lean.close()
        await whole.close()

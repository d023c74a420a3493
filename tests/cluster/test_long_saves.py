"""A cluster save of more items than one call takes (``max_items``: 4,096 blocks, 65,536 tokens at
B = 16) reaches each home in chunks, and a home decides a chunk's items without the chunks before
it. The chain must stay whole all the same (client/saves.py ``follows``): every block and snapshot
of it where a walk finds it, whether it starts a branch or forks from a shared prefix."""

from __future__ import annotations

from prefixstore.client import ClientConfig, PrefixClient

from ..factories import kv_payload, make_namespace, state_payload
from .verified import read_verified


async def test_a_save_of_more_items_than_one_call_takes_is_found_whole(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--state-admission", "always")
    ns = make_namespace(block_tokens=4)
    first = list(range(1, 4 * 40 + 3))  # 40 blocks and a tail of 2: 11 calls of 4 items
    # A second conversation sharing the first's 12 blocks, then 30 of its own: it forks at level 12.
    second = first[:48] + list(range(1000, 1000 + 4 * 30))
    for n, tokens in enumerate((first, second)):
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls), max_items=4)) as small:
            snaps = [29, 64, 101, len(tokens)]  # in chunks after the first, one at the end
            saved = await small.save(small.prompt(tokens), len(tokens), lambda a, b, t=tokens: kv_payload(ns, t, a, b),
                                     {t: state_payload(ns, tokens, t) for t in snaps})
            assert saved.dropped == 0 and saved.rejected == 0, [r for r in saved.results if r[1].status.value != "ok"]
            # The second's 12 shared blocks and its snapshot at 29 are the first's: already stored.
            assert (saved.stored, saved.already) == ((41 + 4, 0) if n == 0 else (30 + 3, 12 + 1)), saved
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as fresh:
            for upto in (len(tokens), 101, 64, 29):
                got = await fresh.lookup(tokens[:upto] + [7, 7, 7])
                assert (got.kv_tokens, got.state_tokens) == (upto, upto), (n, upto, got)
                assert await read_verified(fresh, ns, tokens[:upto] + [7, 7, 7], got) == 0
                await fresh.release(got.lease_id)

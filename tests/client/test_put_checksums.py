"""A put's checksums (client/prompt.py with_payloads, protocol/checksums.py digests): the batch is
hashed in one native call (in a thread when large), and every item carries exactly the xxh3-64 and
size a per-item hash gives."""

from __future__ import annotations

import os

import xxhash

from prefixstore.client.prompt import OFF_LOOP_BYTES, Prompt, with_payload, with_payloads
from prefixstore.protocol import checksums

from ..factories import make_namespace


def test_digests_are_xxh3_64_of_each_view() -> None:
    """Plant: the native digests read big-endian -> red."""
    views = [memoryview(os.urandom(n)) for n in (0, 1, 7, 4096, 65536, 65537)]
    assert checksums.digests(views) == [xxhash.xxh3_64_intdigest(v) for v in views]
    assert checksums.digests([]) == []


async def test_with_payloads_matches_the_per_item_checksum_small_and_large() -> None:
    ns = make_namespace()
    p = Prompt(ns, list(range(64)))
    specs = [spec for spec, _, _ in p.kv_items(64)]
    for each in (100, OFF_LOOP_BYTES // len(specs) + 1):  # inline, then over the thread threshold
        payloads = [os.urandom(each) for _ in specs]
        got = await with_payloads(specs, [memoryview(x) for x in payloads])
        assert got == [with_payload(s, x) for s, x in zip(specs, payloads)]

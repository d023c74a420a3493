"""Membership from DNS (injected resolver, and the real system resolver on 'localhost')."""

from __future__ import annotations

import asyncio

import pytest

from prefixstore.protocol.placement import owner, rank, score
from prefixstore.store.config import ConfigError, StoreConfig
from prefixstore.store.membership import DnsResolver, Membership


def test_rendezvous_moves_only_the_keys_of_a_changed_member() -> None:
    members = [f"http://pod-{i}.svc:8077" for i in range(5)]
    keys = [i.to_bytes(16, "little") for i in range(2000)]
    before = {k: owner(members, k) for k in keys}
    after = {k: owner(members[:4], k) for k in keys}  # pod-4 leaves
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == members[4] for k in moved)
    assert all(rank(members, k)[0] == before[k] for k in keys[:50])
    assert score("ab", b"c") != score("a", b"bc")


def test_dns_membership_maps_addresses_to_stable_names() -> None:
    records = {"prefixstore-headless": ["10.0.0.7", "10.0.0.9"]}
    names = {"10.0.0.7": "prefixstore-0.prefixstore-headless.default.svc.cluster.local", "10.0.0.9": None}

    async def addresses(host: str) -> list[str]:
        if host not in records:
            raise OSError("NXDOMAIN")
        return records[host]

    async def name_of(address: str) -> str | None:
        return names[address]

    config = StoreConfig(port=0, data_dir="none", peers_dns="prefixstore-headless:8077",
                         node_url="http://prefixstore-0.prefixstore-headless.default.svc.cluster.local:8077")
    membership = Membership(config, DnsResolver(addresses=addresses, name_of=name_of))

    async def run() -> None:
        assert await membership.refresh()
        assert membership.members == ("http://10.0.0.9:8077",  # no PTR name: the address
                                      "http://prefixstore-0.prefixstore-headless.default.svc.cluster.local:8077")
        assert membership.self_url in membership.members
        epoch = membership.view.epoch
        # The pod restarts on a new IP: same name, same member, no change.
        records["prefixstore-headless"] = ["10.0.0.8", "10.0.0.9"]
        names["10.0.0.8"] = names["10.0.0.7"]
        assert not await membership.refresh()
        # DNS down or empty: the last good view stays.
        records.pop("prefixstore-headless")
        assert not await membership.refresh()
        assert len(membership.members) == 2 and membership.view.epoch == epoch
        # A scale-out: a new epoch, and the previous list kept for the owner grace window.
        records["prefixstore-headless"] = ["10.0.0.8", "10.0.0.9", "10.0.0.10"]
        names["10.0.0.10"] = "prefixstore-2.prefixstore-headless.default.svc.cluster.local"
        assert await membership.refresh()
        assert membership.view.epoch == epoch + 1 and len(membership.view.previous) == 2
        assert membership.describe()["previous"] == list(membership.view.previous)

    asyncio.run(run())


def test_dns_membership_with_the_system_resolver_on_localhost() -> None:
    membership = Membership(StoreConfig(port=0, data_dir="none", peers_dns="localhost:8077"))
    members = asyncio.run(membership.resolve_dns())
    assert members and all(m.startswith("http://") and m.endswith(":8077") for m in members)


def test_bad_cluster_knobs_name_the_knob() -> None:
    with pytest.raises(ConfigError, match="peers_dns"):
        StoreConfig(peers_dns="no-port")
    with pytest.raises(ConfigError, match="peers"):
        StoreConfig(peers="ftp://x")


def test_the_previous_members_count_until_owner_grace_s_and_not_past_it() -> None:
    """docs/cluster.md: the previous member list is kept for owner_grace_s after a change."""
    now = [100.0]
    records = {"prefixstore-headless": ["10.0.0.1", "10.0.0.2"]}

    async def addresses(host: str) -> list[str]:
        return records[host]

    async def name_of(address: str) -> str | None:
        return None

    config = StoreConfig(port=0, data_dir="none", peers_dns="prefixstore-headless:8077", owner_grace_s=60.0,
                         node_url="http://10.0.0.1:8077")
    membership = Membership(config, DnsResolver(addresses=addresses, name_of=name_of), clock=lambda: now[0])

    async def run() -> None:
        await membership.refresh()
        records["prefixstore-headless"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        now[0] = 200.0
        assert await membership.refresh()  # the change, at t = 200
        now[0] = 259.99
        assert membership.in_grace()
        now[0] = 260.0
        assert not membership.in_grace()

    asyncio.run(run())

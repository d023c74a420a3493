"""Hot-prefix replication's numbers (store/replication.py, docs/cluster.md), each pinned on both
sides of its boundary: copies per read rate (one more per ``replication_threshold`` reads a second,
up to ``replication_max_replicas``), the owner's estimate of the total rate (its own times the
copies), shrinking only below half the thresholds (hysteresis), and the decayed rate's half-life.

A real store core and a real static membership; the node under test is the first in rendezvous
order of the branch used (the owner), and the clock is held still unless a test moves it."""

from __future__ import annotations

import math

import pytest

from prefixstore.protocol.placement import rank
from prefixstore.store import StoreConfig
from prefixstore.store.index import Entry
from prefixstore.store.membership import Membership
from prefixstore.store.replication import Replicator, copies_for

from ..factories import make_namespace
from .harness import CoreHarness

ME = "http://node-0:8077"
PEERS = (ME, "http://node-1:8077", "http://node-2:8077", "http://node-3:8077")
T = 10.0  # replication_threshold, reads a second


@pytest.mark.parametrize(("rate", "copies"), [
    (0.0, 1), (9.99, 1), (10.0, 2), (19.99, 2), (20.0, 3), (29.99, 3), (30.0, 4), (1000.0, 4)])
def test_one_more_copy_per_threshold_of_reads_up_to_the_most(rate: float, copies: int) -> None:
    assert copies_for(rate, T, 4) == copies


def test_no_copies_when_replication_is_off() -> None:
    assert copies_for(1000.0, T, 1) == 1 and copies_for(25.0, T, 2) == 2


class Owner:
    """A store that owns one branch in a four-node cluster, with one entry on it."""

    def __init__(self, half_life_s: float, max_replicas: int = 4) -> None:
        config = StoreConfig(port=0, data_dir="none", ram_bytes=64 * 256, page_bytes=256, peers=",".join(PEERS),
                             node_url=ME, replication_threshold=T, replication_max_replicas=max_replicas,
                             replication_half_life_s=half_life_s)
        self.harness = CoreHarness(config, make_namespace(block_tokens=4))
        self.harness.save([1, 2, 3, 4], 4)
        self.entry: Entry = next(iter(self.harness.store.index.entries.values()))
        self.entry.branch = next(k for k in (i.to_bytes(16, "little") for i in range(1000))
                                 if rank(PEERS, k)[0] == ME)  # placed here by a branch this node owns
        self.order = rank(PEERS, self.entry.branch)
        self.membership = Membership(config, clock=lambda: self.harness.now[0])
        self.rep = Replicator(self.harness.store, self.membership, clock=lambda: self.harness.now[0])

    def read(self, n: int) -> None:
        for _ in range(n):
            self.rep.on_reads([self.entry])

    def plan(self) -> tuple[list[str], list[str]]:
        pushes, drops = self.rep.plan()
        return [u for _, us in pushes for u in us], [u for _, us in drops for u in us]

    def close(self) -> None:
        self.harness.close()


@pytest.fixture
def owner():  # type: ignore[no-untyped-def]
    made: list[Owner] = []

    def make(half_life_s: float, max_replicas: int = 4) -> Owner:
        made.append(Owner(half_life_s, max_replicas))
        return made[-1]

    yield make
    for o in made:
        o.close()


def test_the_decayed_rate_halves_every_half_life(owner) -> None:  # type: ignore[no-untyped-def]
    o = owner(half_life_s=4.0)
    o.harness.now[0] = 3.0  # a clock whose readings are not multiples of one another
    o.read(8)
    key, now = o.entry.key, o.harness.now[0]
    assert o.rep.rate(key, now) == pytest.approx(8 * math.log(2) / 4.0)
    assert o.rep.rate(key, now + 4.0) == pytest.approx(4 * math.log(2) / 4.0)
    assert o.rep.rate(key, now + 8.0) == pytest.approx(2 * math.log(2) / 4.0)
    o.harness.now[0] += 4.0
    o.read(1)  # the count decays to 4, then one more read
    assert o.rep.rate(key, o.harness.now[0]) == pytest.approx(5 * math.log(2) / 4.0)


def test_copies_grow_at_each_threshold(owner) -> None:  # type: ignore[no-untyped-def]
    """rate = reads x ln2 / half_life: with half_life = ln 2 the held clock makes the rate the read count."""
    o = owner(half_life_s=math.log(2))
    o.read(9)
    assert o.plan() == ([], [])  # 9 reads/s < T: one copy
    o.read(1)
    assert o.plan() == (o.order[1:2], [])  # 10 = T: a second copy, on the next node in rendezvous order
    o.read(10)
    assert o.plan() == (o.order[1:3], [])  # 20 = 2T: three copies


def test_the_owner_counts_its_own_share_times_the_copies(owner) -> None:  # type: ignore[no-untyped-def]
    """Clients spread reads over the copies: with one replica out, the owner's 6 reads/s stand for 12
    (two copies: no change) and its 10 for 20 (a third copy)."""
    o = owner(half_life_s=math.log(2))
    o.rep.pushed[o.entry.key] = (o.order[1],)
    o.read(6)
    assert o.plan() == ([], [])
    o.read(4)
    assert o.plan() == ([o.order[2]], [])


def test_copies_shrink_only_below_half_the_threshold(owner) -> None:  # type: ignore[no-untyped-def]
    """Two copies, grown at T. With half_life = 2 ln 2 the rate is half the read count: 5 reads make
    2.5/s here, 5/s in all (T/2: kept, though below T); 4 make 4/s in all (below T/2: dropped)."""
    o = owner(half_life_s=2 * math.log(2))
    o.rep.pushed[o.entry.key] = (o.order[1],)
    o.read(5)
    assert o.plan() == ([], [])
    other = owner(half_life_s=2 * math.log(2))
    other.rep.pushed[other.entry.key] = (other.order[1],)
    other.read(4)
    assert other.plan() == ([], [other.order[1]])


def test_copies_stop_at_the_most(owner) -> None:  # type: ignore[no-untyped-def]
    o = owner(half_life_s=math.log(2), max_replicas=2)
    o.read(100)  # 10 T
    assert o.plan() == (o.order[1:2], [])


def test_pushes_share_one_seconds_worth_of_replication_bytes_per_s() -> None:
    """store/replication.py: a token bucket of ``replication_bytes_per_s``, bursts up to one second's
    worth; a push larger than the bucket waits for a full one."""
    from prefixstore.store.replication import TokenBucket

    now = [0.0]
    bucket = TokenBucket(100.0, clock=lambda: now[0])
    assert bucket.delay(100) == 0.0  # a full second's worth at once
    bucket.take(60)
    assert bucket.delay(40) == 0.0 and bucket.delay(41) == pytest.approx(0.01)
    now[0] = 10.0  # idle for long: never more than one second's worth
    assert bucket.delay(100) == 0.0 and bucket.tokens == 100.0
    bucket.take(250)  # larger than the bucket: taken, and later pushes wait it off
    assert bucket.delay(1) == pytest.approx(1.51) and bucket.delay(1000) == pytest.approx(2.5)


def test_an_entry_is_forgotten_once_its_decayed_count_falls_under_a_twentieth(owner) -> None:  # type: ignore[no-untyped-def]
    """FORGET_BELOW = 0.05 decayed reads: one read is tracked for 4 half-lives (1/16) and not 5 (1/32)."""
    o = owner(half_life_s=1.0)
    o.read(1)
    o.harness.now[0] += 4.0
    o.plan()
    assert o.rep.tracked == 1
    o.harness.now[0] += 1.0
    o.plan()
    assert o.rep.tracked == 0 and o.rep.rate(o.entry.key) == 0.0


def test_replicas_on_nodes_that_left_are_forgotten(owner) -> None:  # type: ignore[no-untyped-def]
    o = owner(half_life_s=math.log(2))
    o.rep.pushed[o.entry.key] = (o.order[1], "http://gone:8077")
    o.read(6)  # 6 reads/s on the owner: 12 with its one live replica, so two copies stay
    assert o.plan() == ([], [])
    assert o.rep.replicas_of()[o.entry.key] == (o.order[1],)

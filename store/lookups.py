"""Lookups: the longest token-exact match of a prompt (DESIGN §5), a cluster node's per-level
probe, and what both teach the policies and the metrics.

A lookup's *answer* depends only on what is stored (store/index.py ``Index.match``; a lease pins
what it reports); it never changes what a later lookup returns. What it *teaches* goes through
one function, :meth:`LookupService.learn`, used by single-node lookups and by the cluster's
lookup reports alike (a cluster client reports to the junction's owner what a single node would
have counted): hits (the KV entry and the snapshot served), the junction sighting behind
``checkpoint_hint`` (cache-on-second-sighting), and misses (the first missing block, the
missing junction snapshot), plus ``prefixstore_lookup_tokens_total{kind,result}``.

Probes (``/v1/probe``) are one hop of a cluster lookup's walk (protocol/probe.py): the levels
of the prompt from some level s on, answered in order, each exactly as the single-node match
restricted to one parent hash h_j computes it, until one ends this node's part:

* ``held``: block h_{j+1} is indexed here under h_j; the walk goes on to level j+1 here, unless
  it is a fork record (``fork``): the prompt continues on h_{j+1}'s branch node; stop;
* else ``child``: of the (most recent ``max_child_scan``) children of h_j with the prompt's extra
  keys, the one whose tokens agree longest with the level's tokens; stop;
* ``snapshot``: of the snapshots registered under h_j, the largest boundary b with
  ``b - jB <= agreement of its container`` (B for the prompt's own block h_{j+1}) and
  ``b <= jB + B`` when h_{j+1} is held here, ``b <= jB + child's usable tokens`` when it is not;
* ``exact``: whether this node is the level's home (it holds the whole level): for the first
  level asked, the root level's home (``root_home``) or holding h_s in its own right (not a fork
  record, not a hot copy: ``copies``); for the levels after it, their parent is a block held
  here in its own right, so yes unless it is a copy.

so the client's merge (first level not held; best snapshot of levels <= m) is the single-node
answer. Probes teach nothing themselves; the client's report does.

**Reports are bounded by rate** (:class:`ReportAllowance`). One report counts at most one
lookup's tokens, but nothing paced them: 2,000 reports in 0.5 s added 4.19e9 miss tokens to the
counters behind every tenant's hit-rate panels (issue 30). A tenant's reports now spend an
allowance in tokens that refills at ``max_lookup_tokens`` a second and grows by the tokens each
of its probes carries here, or finds held here (a lean probe carries few; a real walk probes the
node it reports to, so its reports pay for themselves), up to a few lookups' worth banked. A report past it is answered like any other
(a refusal would open the client's breaker on this node) but teaches nothing, and is counted
(``prefixstore_lookup_reports_dropped_total``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from prefixstore.admission import AdmissionPolicy, EvictionPolicy
from prefixstore.protocol.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash, tail_hash
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.placement import root_branch
from prefixstore.protocol.match import merge
from prefixstore.protocol.probe import TIER_ELSEWHERE, LookupReport, ProbeAnswer, ProbeRequest, StopLevel
from prefixstore.protocol.wire import EntryRef, LookupAnswer, LookupRequest, split_hashes
from .config import StoreConfig
from .index import Entry, Index, ScanBudget, store_key
from .leases import Leases
from .ledger import TenantLedger
from .metrics import StoreMetrics
from .namespaces import Namespaces


def entry_ref(e: Entry, usable: int) -> EntryRef:
    """How an answer names an entry: its wire key (never the store's scoped key), sizes, tier
    (``elsewhere`` for a fork record: its payload is on its branch node)."""
    tier = TIER_ELSEWHERE if e.record else "ram" if e.pages is not None else "disk"
    return EntryRef(key=e.wire_key, num_tokens=e.num_tokens, usable_tokens=usable, size=e.size, tier=tier)


REPORT_BANK_LOOKUPS = 4
"""Most lookups' worth of tokens (``max_lookup_tokens`` each) a tenant's report allowance banks."""


@dataclass(slots=True)
class _Allowance:
    tokens: float
    at_s: float


class ReportAllowance:
    """Tokens each owner's lookup reports may still count (module docstring)."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate  # tokens a second, and the unit of the bank
        self._bank = REPORT_BANK_LOOKUPS * rate
        self._clock = clock
        self._owners: dict[str, _Allowance] = {}

    def _now(self, owner: str) -> _Allowance:
        now = self._clock()
        a = self._owners.get(owner)
        if a is None:
            a = self._owners[owner] = _Allowance(self._rate, now)
        else:
            a.tokens = min(self._bank, a.tokens + (now - a.at_s) * self._rate)
            a.at_s = now
        return a

    def earn(self, owner: str, tokens: int) -> None:
        a = self._now(owner)
        a.tokens = min(self._bank, a.tokens + tokens)

    def spend(self, owner: str, tokens: int) -> bool:
        """Whether a report of ``tokens`` may count (and if so, it is paid for); a report of none
        still costs one, so reports cannot move the lookup counter for free."""
        a = self._now(owner)
        cost = max(1, tokens)
        if a.tokens < cost:
            return False
        a.tokens -= cost
        return True


class LookupService:
    def __init__(self, config: StoreConfig, index: Index, namespaces: Namespaces, leases: Leases,
                 ledger: TenantLedger, admission: Mapping[Kind, AdmissionPolicy], eviction: EvictionPolicy,
                 metrics: StoreMetrics, clock: Callable[[], float]) -> None:
        self._config = config
        self._index = index
        self._namespaces = namespaces
        self._leases = leases
        self._ledger = ledger
        self._admission = admission
        self._eviction = eviction
        self._metrics = metrics
        self._clock = clock
        self.reports = ReportAllowance(float(config.max_lookup_tokens), clock)

    # ------------------------------------------------------------ answers

    def lookup(self, req: LookupRequest, defer: Callable[[Callable[[], None]], object] | None = None) -> LookupAnswer:
        """Longest token-exact match (DESIGN §5): one run from level 0, merged (protocol/match.py).
        Creates a lease when asked; teaches the policies.

        ``defer``: how the lessons (:meth:`learn`) run; None: before this returns. The HTTP routes
        pass the event loop's ``call_soon``, so they run right after the answer is sent: they feed
        policies and metrics, never an answer, and took 0.04 ms of a lookup after an idle pause
        here (docs/benchmarks.md, issue 33)."""
        ns = self._namespaces.get(req.namespace_id)
        root = self._namespaces.root(ns.id)
        assert root is not None
        now = self._clock()
        self._leases.expire(now)
        scan = self._config.max_child_scan
        found = self._index.run(ns.id, req.levels(ns.block_tokens, root), scan=scan, budget=ScanBudget(scan),
                                whole=True)
        if found.needs is not None:  # a lean request stopped where it carried no tokens: ask for them
            return LookupAnswer(num_tokens=req.num_tokens, matched_blocks=0, kv_tokens=0, state_tokens=0,
                                checkpoint_hint=0, block_bytes=ns.block_bytes, need_level=found.needs)
        m = merge([found.run], block_tokens=ns.block_tokens, num_blocks=req.num_blocks, has_state=ns.has_state)
        child = m.child.entry if m.child is not None else None
        snapshot = m.snapshot.entry if m.snapshot is not None else None
        junction = self._junction(ns, req, m.kv_tokens) if m.checkpoint_hint else None
        missing = req.hashes[m.matched * HASH_BYTES : (m.matched + 1) * HASH_BYTES] \
            if m.matched < req.num_blocks else None
        served = (child or found.last, snapshot)
        (defer or _now)(lambda: self.learn(ns, req.num_tokens, m.kv_tokens, m.state_tokens, self.still_held(served),
                                      junction, missing, now))
        lease_id = None
        if req.lease and m.kv_tokens:
            held: list[Entry] = []
            for e in (found.last, child, snapshot):
                if e is not None and e not in held:
                    held.append(e)
            if snapshot is not None:
                c = self._index.get(snapshot.container or b"")
                if c is not None and c not in held:
                    held.append(c)
            lease_id = self._leases.grant(held, now, self._config.lease_ttl_s, owner=self._ledger.owner_of(ns))
        tiers = None
        if req.locations and m.matched:
            tiers = bytes(0 if (e := self._index.get_block(ns.id, h)) is not None and e.pages is not None else 1
                          for h in split_hashes(req.hashes[: m.matched * HASH_BYTES]))
        return LookupAnswer(
            num_tokens=req.num_tokens, matched_blocks=m.matched, kv_tokens=m.kv_tokens,
            state_tokens=m.state_tokens, checkpoint_hint=m.checkpoint_hint, block_bytes=ns.block_bytes,
            child=entry_ref(child, m.child.tokens) if m.child is not None and child is not None else None,
            snapshot=entry_ref(snapshot, m.state_tokens) if snapshot is not None else None,
            lease_id=lease_id, lease_ttl_s=self._config.lease_ttl_s if lease_id else 0.0, block_tiers=tiers,
        )

    def _junction(self, ns: Namespace, req: LookupRequest, kv_tokens: int) -> BlockHash:
        """p(kv_tokens) of the prompt: the key a snapshot at the junction would have."""
        B = ns.block_tokens
        j = kv_tokens // B
        if kv_tokens % B == 0:
            return BlockHash(req.hashes[(j - 1) * HASH_BYTES : j * HASH_BYTES])
        root = self._namespaces.root(ns.id)
        assert root is not None
        parent = BlockHash(req.hashes[(j - 1) * HASH_BYTES : j * HASH_BYTES]) if j else root
        seg = req.levels(B, root).segment(j)
        assert seg is not None, "a match that ends inside level j compared the level's tokens"
        return tail_hash(parent, seg[: (kv_tokens - j * B) * TOKEN_BYTES], dict(req.extras).get(j, b""))

    def probe(self, req: ProbeRequest, replicas_of: Mapping[bytes, tuple[str, ...]] | None = None,
              root_home: Callable[[bytes], bool] = lambda key: True,
              copies: Collection[bytes] = frozenset()) -> ProbeAnswer:
        """One hop of a walk (module docstring): this index's run from the level asked, and whether
        this node is the home of what it answers. Leases what it reports, as a lookup does (the
        deepest held block -- its ancestors here are not leaves, so eviction spares them -- the
        child, the snapshots and their containers). ``root_home(key)``: whether this node is the
        home of the root level with branch key ``key``; ``copies``: store keys of entries held as
        hot copies of another node's."""
        ns = self._namespaces.get(req.namespace_id)
        ns_id = ns.id  # every key probed below is scoped by the request's namespace (store/index.py)
        root = self._namespaces.root(ns_id)
        assert root is not None
        B = ns.block_tokens
        index = self._index
        now = self._clock()
        self._leases.expire(now)
        scan = self._config.max_child_scan
        found = index.run(ns_id, req.levels(B), scan=scan, budget=ScanBudget(scan), copies=copies)
        if found.needs is not None:  # a lean probe stopped where it carried no tokens: ask for them
            return ProbeAnswer(start=req.start, need_level=found.needs)
        run = found.run
        # Earned once per answered probe (a lean probe's first trip, answered need_level, earns
        # nothing), by the tokens it carries and those of the blocks it found held here: a lean probe
        # of made-up hashes earns what it sent, not the length it claims.
        self.reports.earn(self._ledger.owner_of(ns),
                          min(req.num_tokens, len(req.tokens) // TOKEN_BYTES + B * run.held))
        # The first level is this node's (exact) when it is the root level's home, or when its parent
        # block is held here in its own right (not a fork record, not a copy); a later level is, unless
        # the run entered it through a copy (Index.run).
        if req.parent == root:
            exact = root_home(root_branch(root, req.tokens))
        else:
            p = index.get_block(ns_id, req.parent)
            exact = p is not None and not p.record and p.key not in copies
        inexact = ([] if exact else [req.start]) + found.copied
        child = run.child.entry if run.child is not None else None
        snapshots = [h.entry for h in run.snapshots.values()]
        leased = snapshots + ([child] if child is not None and not child.record else [])
        if found.last is not None:
            leased.append(found.last)
        for snap in snapshots:
            container = index.get(snap.container or b"")
            if container is not None and not container.record:
                leased.append(container)
        lease_id = None
        if req.lease and leased:
            unique: dict[bytes, Entry] = {e.key: e for e in leased}
            lease_id = self._leases.grant(list(unique.values()), now, self._config.lease_ttl_s,
                                          owner=self._ledger.owner_of(ns))
        replicas: dict[bytes, tuple[str, ...]] = {}
        if replicas_of:
            reported = self._held_with_copies(req, B, run.held, replicas_of) + \
                [e for e in ([child] if child is not None and not child.record else []) + snapshots]
            for e in reported:
                where = replicas_of.get(e.key)
                if where:
                    replicas[e.wire_key] = where
        return ProbeAnswer(start=req.start, held=run.held,
                           stop=StopLevel(fork=run.fork, child=entry_ref(child, run.child.tokens)
                                          if child is not None and run.child is not None else None)
                           if run.stopped else None,
                           inexact=tuple(inexact), snapshots={j: entry_ref(h.entry, h.tokens) for j, h in run.snapshots.items()},
                           lease_id=lease_id, lease_ttl_s=self._config.lease_ttl_s if lease_id else 0.0,
                           replicas=replicas)

    def _held_with_copies(self, req: ProbeRequest, block_tokens: int, held: int,
                          replicas_of: Mapping[bytes, tuple[str, ...]]) -> list[Entry]:
        """The blocks of the run's held levels that have copies on other nodes (the client spreads its
        hops and reads over them): found from the few entries with copies, not the run's many levels."""
        out: list[Entry] = []
        entries = self._index.entries
        for key in replicas_of:
            e = entries.get(key)
            if e is None or e.kind is not Kind.BLOCK:
                continue
            x = e.start // block_tokens - req.start
            if 0 <= x < held and req.hashes[x * HASH_BYTES : (x + 1) * HASH_BYTES] == e.hash:
                out.append(e)
        return out

    def report(self, report: LookupReport) -> bool:
        """A cluster client's account of a lookup it merged: taught as a single node's lookup would,
        within its tenant's allowance (module docstring); False when it was not."""
        ns = self._namespaces.get(report.namespace_id)
        if not self.reports.spend(self._ledger.owner_of(ns), report.num_tokens):
            self._metrics.lookup_reports_dropped.inc()
            return False
        self.learn(ns, report.num_tokens, report.kv_tokens, report.state_tokens, (),
                   BlockHash(report.junction) if report.junction is not None and ns.has_state else None,
                   report.missing_block, self._clock())
        return True

    # ------------------------------------------------------------ teaching (the one place)

    def still_held(self, entries: tuple[Entry | None, ...]) -> tuple[Entry | None, ...]:
        """Those of ``entries`` the index still holds (a deferred lesson must not count a hit on an
        entry evicted since the answer: its eviction already told the policies it was never used)."""
        get = self._index.get
        return tuple(e if e is not None and get(e.key) is e else None for e in entries)

    def learn(self, ns: Namespace, num_tokens: int, kv_tokens: int, state_tokens: int,
              served: tuple[Entry | None, ...], junction: BlockHash | None, missing_block: bytes | None,
              now: float) -> None:
        """What policies and metrics learn from a lookup: hits, the junction sighting, misses, token
        counts. It only feeds future admission and eviction decisions, never an answer."""
        for e in served:
            if e is not None:
                self._admission[e.kind].on_hit(e.kind, e.key, e.num_hits == 0, now, e.origin)
                self._eviction.on_hit(e, now)
                e.num_hits += 1
        if junction is not None:
            self._admission[Kind.STATE].on_sighting(Kind.STATE, store_key(ns.id, Kind.STATE, junction), now)
            self._eviction.on_miss(Kind.STATE, ns.id + junction, now)
        if missing_block is not None:
            self._eviction.on_miss(Kind.BLOCK, ns.id + missing_block, now)
        m = self._metrics
        m.lookups.inc()
        m.lookup_tokens.labels("kv", "hit").inc(kv_tokens)
        m.lookup_tokens.labels("kv", "miss").inc(num_tokens - kv_tokens)
        tenant = self._ledger.owner_of(ns)
        m.model_hits.count(tenant, ns.model, "kv", kv_tokens, num_tokens - kv_tokens)
        if ns.has_state:
            m.lookup_tokens.labels("state", "hit").inc(state_tokens)
            m.lookup_tokens.labels("state", "miss").inc(num_tokens - state_tokens)
            m.model_hits.count(tenant, ns.model, "state", state_tokens, num_tokens - state_tokens)
        shape = self._namespaces.shape_of(ns.id)
        if shape is not None:  # exact reuse: KV and state on a hybrid model, KV on a plain one
            m.prefill_flops_saved.inc(shape.prefill_flops(state_tokens if ns.has_state else kv_tokens))


def _now(lesson: Callable[[], None]) -> None:
    lesson()


__all__ = ["LookupService", "ReportAllowance", "entry_ref"]

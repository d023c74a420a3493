"""The in-memory index of committed entries, and the runs of levels a match is made of (protocol/match.py).

Structure (all keyed by fixed-width bytes, never tuples)::

    entries       store key (kind || ns || hash) -> Entry
    children      ns || parent hash h_j (or root h_0) -> {store key of each block/tail under it}
    snaps_under   ns || parent hash h_j -> {store key of each snapshot whose container is under h_j}

**Every key is scoped by its namespace** (:func:`store_key`, :func:`scope`). Hashes
chain from the namespace root, but a namespace id is the hash of public
fields (model, layout, tenant name), so another tenant can compute any
tenant's chain for a guessed prompt. Scoping makes such hashes useless: a
request only ever reaches keys built from its own namespace id, which the
server checked belongs to the authenticated tenant, so no lookup, offer,
probe, read or commit can find, collide with or squat on another
namespace's entry. The wire keeps the 17-byte entry key (kind || hash) of
protocol/keys.py; requests name their namespace beside it.

Invariants (verified by :meth:`Index.check`, which the tests call):

1. Prefix closure: the parent of every block or tail is the namespace root or
   a committed block. So "h_j is stored" implies h_1..h_{j-1} are stored, and
   the longest matched run of a prompt's blocks is found by binary search.
2. A snapshot's container (the block or tail whose token range (start, end]
   holds its boundary) is stored; a container is never removed while it holds
   snapshots, and a block never while it has children. Deletion is therefore
   leaf-first, and a snapshot never outlives the KV it accompanies.
3. ``num_children`` / ``num_snapshots`` of every entry equal what the maps say,
   and the byte/entry counters equal the sums over entries.

Only committed entries live here; pending puts are invisible to lookups.

In a cluster (protocol/placement.py) a level's home also holds **fork records**: entries of a
fork head block with its tokens and extra keys but no payload (``Entry.record``; size 0, in no
payload tier, persisted with its record). They are children of their parent like any block, so
partial matches and snapshot containers at the level stay exact; they are never read (the block
itself lives on its branch node). ``continuation`` names, per parent, the block child (not a
record) this node took first: the continuation a fork decision is made against.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from prefixstore.protocol.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash
from prefixstore.protocol.keys import ENTRY_KEY_BYTES, Kind
from prefixstore.protocol.match import Hit, Levels, Run
from prefixstore.protocol.namespace import NAMESPACE_ID_BYTES

_BLOCK = bytes((Kind.BLOCK,))
STORE_KEY_BYTES = 1 + NAMESPACE_ID_BYTES + HASH_BYTES
ENTRY_OVERHEAD_BYTES = 512
"""What an entry costs beside its payload, tokens and extra keys: its record in the index (the
Entry, its dict slots, its queue items) and in LMDB. Charged to the tenant's quota and to the disk
budget with the entry, so a tenant storing millions of one-byte entries pays for them."""


def entry_charge(size: int, tokens: bytes, extra: bytes) -> int:
    """Bytes an entry of this payload size, tokens and extra keys is charged (quota, disk budget)."""
    return size + len(tokens) + len(extra) + ENTRY_OVERHEAD_BYTES


def store_key(namespace_id: bytes, kind: Kind, h: bytes) -> bytes:
    """The store's key of an entry: kind || namespace id || hash (25 bytes). The kind leads so
    that a policy's ``kind byte + rest`` keys (admission/eviction.py) are store keys too."""
    return bytes((kind,)) + namespace_id + h


def scope(namespace_id: bytes, entry_key: bytes) -> bytes:
    """A wire entry key (kind || hash, protocol/keys.py) of a request's namespace, as a store key."""
    assert len(entry_key) == ENTRY_KEY_BYTES, "a wire entry key is kind || hash"
    return entry_key[:1] + namespace_id + entry_key[1:]


def unscope(key: bytes) -> bytes:
    """A store key's wire entry key (kind || hash), for answers."""
    return key[:1] + key[1 + NAMESPACE_ID_BYTES :]


def node_key(namespace_id: bytes, h: bytes) -> bytes:
    """The ``children`` / ``snaps_under`` key of a parent hash in a namespace."""
    return namespace_id + h


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes  # store key (store_key): kind || namespace id || hash
    kind: Kind
    hash: BlockHash
    namespace_id: bytes
    parent: BlockHash | None  # blocks and tails: h of the block before (or the root)
    start: int  # blocks and tails: first token position; snapshots: 0
    tokens: bytes  # blocks and tails: packed token ids
    extra: bytes  # blocks and tails: per-block extra keys that entered the hash
    container: bytes | None  # snapshots: store key of the block or tail holding the boundary
    boundary: int  # snapshots: the token count the state has consumed
    size: int
    checksum: int
    pages: list[int] | None = None  # RAM arena pages when resident in RAM
    on_disk: bool = False
    committed: bool = False
    dead: bool = False  # removed from the index; pages freed when the last pin drops
    num_children: int = 0
    num_snapshots: int = 0
    pins: int = 0  # leases and in-flight reads; a pinned entry is never evicted
    last_access_s: float = 0.0
    num_hits: int = 0  # lookups that served this entry
    priority: float = 0.0  # eviction priority as of its last store or read
    origin: int = 0  # snapshots: protocol.keys.Origin
    expires_s: float = 0.0  # pending entries: reclaimed after this time
    record: bool = False  # a cluster's fork record: tokens and extra keys, no payload (module docstring)
    branch: bytes = b""  # cluster: the branch key that placed it here (protocol/placement.py)
    anchor: Entry | None = None  # pending entries: the parent or container this one pins until it commits

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def charge(self) -> int:
        """Bytes charged for this entry: its payload and its record (entry_charge)."""
        return entry_charge(self.size, self.tokens, self.extra)

    @property
    def wire_key(self) -> bytes:
        """The entry key clients use (kind || hash); valid only beside this entry's namespace."""
        return unscope(self.key)

    @property
    def parent_key(self) -> bytes | None:
        """Store key of the block this block or tail hangs from (None for a snapshot)."""
        return None if self.parent is None else _BLOCK + self.namespace_id + self.parent

    @property
    def node(self) -> bytes | None:
        """``children`` key of this entry's parent (blocks and tails)."""
        return None if self.parent is None else self.namespace_id + self.parent

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def position(self) -> int:
        """Tokens consumed at the entry's end: a KV entry's end, a snapshot's boundary."""
        return self.boundary if self.kind is Kind.STATE else self.start + self.num_tokens

    @property
    def metric_kind(self) -> str:
        return self.kind.metric_kind

    @property
    def is_leaf(self) -> bool:
        return self.num_children == 0 and self.num_snapshots == 0


def lcp_tokens(a: bytes, b: bytes) -> int:
    """Number of leading tokens two packed token strings share."""
    n = min(len(a), len(b)) // TOKEN_BYTES
    if a[: n * TOKEN_BYTES] == b[: n * TOKEN_BYTES]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi] (in tokens)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * TOKEN_BYTES] == b[: mid * TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid
    return lo


SCAN_BUDGET_PER_SCAN = 8
"""A lookup or probe compares at most this many times ``max_child_scan`` stored children and
snapshots in all. Each level is bounded by ``max_child_scan``, but a prompt has thousands of
levels: without a total, a tenant that stored many snapshots under many of its own levels made
one lookup (or one probe naming those levels) compare millions of entries and freeze the loop.
A budget spent ends the search with what was found so far: the answer may be lower, never wrong
(DESIGN §5 allows eviction to lower answers, and this is the same kind of loss)."""


class ScanBudget:
    """Comparisons left to one lookup or probe (SCAN_BUDGET_PER_SCAN)."""

    __slots__ = ("left",)

    def __init__(self, max_child_scan: int) -> None:
        self.left = SCAN_BUDGET_PER_SCAN * max_child_scan

    def take(self, want: int) -> int:
        n = min(want, self.left)
        self.left -= n
        return n


@dataclass(frozen=True, slots=True)
class IndexRun:
    """:meth:`Index.run`'s answer: the run (protocol/match.py) over this index's entries, the deepest
    block held (its ancestors here are not leaves, so a lease on it keeps the run), and the levels
    entered through a hot copy (their home is another node)."""

    run: Run[Entry]
    last: Entry | None
    copied: list[int]
    needs: int | None = None  # the stop level, whose tokens the request did not carry and a comparison needs


class IndexInvariantError(AssertionError):
    pass


@dataclass(slots=True)
class Index:
    entries: dict[bytes, Entry] = field(default_factory=dict)
    children: dict[bytes, dict[bytes, None]] = field(default_factory=dict)
    snaps_under: dict[bytes, dict[bytes, None]] = field(default_factory=dict)
    # (metric kind, tier) -> bytes / entries; tier in {"ram", "disk"}
    stored_bytes: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    stored_entries: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    snapshots_per_ns: dict[bytes, int] = field(default_factory=lambda: defaultdict(int))
    disk_records: int = 0  # record bytes (charge - payload) of entries on disk
    continuation: dict[bytes, bytes] = field(default_factory=dict)  # parent node key -> its first block child here
    fork_records: int = 0  # entries that are fork records

    def get(self, key: bytes) -> Entry | None:
        return self.entries.get(key)

    def get_block(self, namespace_id: bytes, h: bytes) -> Entry | None:
        return self.entries.get(_BLOCK + namespace_id + h)

    # ------------------------------------------------------------ mutation

    def insert(self, e: Entry) -> None:
        """Make a committed entry visible. The caller has checked its parent/container."""
        assert e.key not in self.entries, "insert of a key already indexed"
        self.entries[e.key] = e
        e.committed = True
        if e.kind is Kind.STATE:
            assert e.container is not None
            c = self.entries[e.container]
            c.num_snapshots += 1
            assert c.node is not None
            self.snaps_under.setdefault(c.node, {})[e.key] = None
            self.snapshots_per_ns[e.namespace_id] += 1
        else:
            assert e.node is not None and e.parent_key is not None
            self.children.setdefault(e.node, {})[e.key] = None
            p = self.entries.get(e.parent_key)
            if p is not None:
                p.num_children += 1
            if e.kind is Kind.BLOCK:
                # In a cluster a child may be committed before its parent arrives
                # on the same node (its parent was another node's then): adopt it.
                e.num_children = len(self.children.get(e.namespace_id + e.hash, ()))
                if not e.record:
                    self.continuation.setdefault(e.node, e.key)
        self._count(e, +1)

    def remove(self, e: Entry) -> Entry | None:
        """Drop a leaf from the index. Returns the entry that may have become a leaf."""
        if not e.is_leaf:
            raise IndexInvariantError(f"remove of {e.key.hex()} with children or snapshots (deletion is leaf-first)")
        del self.entries[e.key]
        e.committed = False
        e.dead = True
        self._count(e, -1)
        if e.kind is Kind.STATE:
            assert e.container is not None
            c = self.entries[e.container]
            c.num_snapshots -= 1
            assert c.node is not None
            _discard(self.snaps_under, c.node, e.key)
            self.snapshots_per_ns[e.namespace_id] -= 1
            return c
        assert e.node is not None and e.parent_key is not None
        _discard(self.children, e.node, e.key)
        if self.continuation.get(e.node) == e.key:
            del self.continuation[e.node]
        p = self.entries.get(e.parent_key)
        if p is not None:
            p.num_children -= 1
        return p

    def subtree(self, e: Entry) -> list[Entry]:
        """``e`` and everything that depends on it, leaves first (a safe removal order)."""
        out: list[Entry] = []
        stack: list[tuple[Entry, bool]] = [(e, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.append(node)
                continue
            stack.append((node, True))
            if node.kind is Kind.STATE:
                continue
            assert node.node is not None
            for sk in list(self.snaps_under.get(node.node, {})):
                s = self.entries[sk]
                if s.container == node.key:
                    stack.append((s, False))
            if node.kind is Kind.BLOCK:
                for ck in list(self.children.get(node.namespace_id + node.hash, {})):
                    stack.append((self.entries[ck], False))
        return out

    def set_tier(self, e: Entry, pages: list[int] | None, on_disk: bool) -> None:
        """Move an indexed entry between tiers, keeping the counters true."""
        self._count(e, -1)
        e.pages = pages
        e.on_disk = on_disk
        self._count(e, +1)

    def _count(self, e: Entry, sign: int) -> None:
        if e.record:  # no payload in any tier; its record counts toward the disk budget
            self.fork_records += sign
            if e.on_disk:
                self.disk_records += sign * e.charge
            return
        mk = e.metric_kind
        if e.pages is not None:
            self.stored_bytes[(mk, "ram")] += sign * e.size
            self.stored_entries[(mk, "ram")] += sign
        if e.on_disk:
            self.stored_bytes[(mk, "disk")] += sign * e.size
            self.stored_entries[(mk, "disk")] += sign
            self.disk_records += sign * (e.charge - e.size)

    def disk_bytes(self) -> int:
        """Payload bytes on disk."""
        return self.stored_bytes.get(("kv", "disk"), 0) + self.stored_bytes.get(("state", "disk"), 0)

    def disk_charge(self) -> int:
        """What the disk budget counts: payloads and records on disk."""
        return self.disk_bytes() + self.disk_records

    # ------------------------------------------------------------ queries (no side effects)

    def run(self, namespace_id: bytes, q: Levels, *, scan: int, budget: ScanBudget,
            copies: Collection[bytes] = (), whole: bool = False) -> IndexRun:
        """What this index knows of the prompt's levels from ``q.start`` on, as a run
        (protocol/match.py). Pure: changes nothing.

        1. The held run: blocks of the prompt stored here, each under the one before. Where this
           node holds no hot ``copies`` (store keys of entries held as another node's copies), its
           blocks are prefix-closed (invariant 1; copies arrive one by one) and a fork record can
           only end a run (nothing is ever stored under a record on the node that keeps it:
           WritePath answers such an item ``elsewhere``), so a binary search finds the run in
           O(log n) dict probes, not a walk over 8,192 blocks. With copies, level by level.
        2. The stop level (the level after the run, when the prompt has it): whether its next
           block is a fork record, and the best child (``best_child``; a fork's own record skipped).
        3. Snapshots: the stop level's (up to what its KV reaches), then the deepest held level's,
           searched from the top down and stopping at the first level that has one: level j holds
           boundaries in (jB, (j+1)B], so no lower level can beat it. ``whole`` (a single node's
           lookup: this run is the whole answer): held levels are not searched when the stop level
           has one. Otherwise (a cluster probe) both are reported: the merge may find the stop
           level's child beaten or unconfirmed and need the one below.

        ``budget`` bounds the comparisons in all (ScanBudget): a budget spent answers lower."""
        entries = self.entries
        H, B = HASH_BYTES, q.block_tokens
        blocks = _BLOCK + namespace_id  # every key probed below is this namespace's (module docstring)
        hashes, start = q.hashes, q.start
        k, levels = q.num_blocks, q.num_levels
        last: Entry | None = None
        record: Entry | None = None  # the stop level's next block, held here as a fork record
        copied: list[int] = []
        if not copies:
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if (blocks + hashes[(mid - 1) * H : mid * H]) in entries:
                    lo = mid
                else:
                    hi = mid - 1
            held = lo
            if held:
                last = entries[blocks + hashes[(held - 1) * H : held * H]]
                if last.record:
                    record, held = last, held - 1
                    last = entries[blocks + hashes[(held - 1) * H : held * H]] if held else None
        else:
            held, parent = 0, q.parent
            while held < k:
                e = entries.get(blocks + hashes[held * H : (held + 1) * H])
                if e is None or e.parent != parent:
                    break
                if e.record:
                    record = e
                    break
                if e.key in copies and held + 1 < levels:
                    copied.append(start + held + 1)  # that level's parent is a copy here: not its home
                last, parent = e, e.hash
                held += 1
        stop = start + held
        child: Entry | None = None
        usable = 0
        snapshots: dict[int, Hit[Entry]] = {}
        snaps_under = self.snaps_under if self.snapshots_per_ns.get(namespace_id) else None
        if held < levels:
            node = namespace_id + q.parent_of(held)
            seg = q.segment(held)
            extra = q.extra(stop)
            if seg is None:
                if self.children.get(node) or (snaps_under is not None and snaps_under.get(node)):
                    # A lean request that did not carry the stop level: say so, answer nothing.
                    return IndexRun(run=Run(start=start, held=held), last=last, copied=copied, needs=stop)
                seg = b""  # nothing stored under it to compare: no child, no snapshot
            child, usable = self.best_child(node, seg, extra, scan, budget, skip=record)
            if snaps_under is not None and snaps_under.get(node):
                snap = self.best_snapshot_under(
                    node, seg, stop * B, B, own_next=record.hash if record is not None else None, extra=extra,
                    limit=stop * B + (B if record is not None else usable), scan=scan, budget=budget)
                if snap is not None:
                    snapshots[stop] = Hit(snap, snap.boundary)
        if snaps_under is not None and not (whole and snapshots):
            # Thousands of levels may be passed over: h_{start+x} is sliced here, not asked of q.
            first = namespace_id + q.parent
            for x in range(held - 1, -1, -1):
                node = namespace_id + hashes[(x - 1) * H : x * H] if x else first
                if not snaps_under.get(node):  # probe before slicing tokens: most levels have none
                    continue
                if budget.left <= 0:
                    break
                j = start + x
                # A held level's tokens are its stored block's (equal hashes: protocol/match.py), so a
                # lean request need not carry them.
                held_seg = q.segment(x)
                if held_seg is None:
                    own = entries.get(blocks + q.next_hash(x))
                    if own is None:
                        # The binary search trusts the hashes to be a chain (an honest client's are);
                        # a request that is not one may name a level "held" whose block is absent. It
                        # answers for nothing there (no snapshot), rather than raise.
                        continue
                    held_seg = own.tokens
                snap = self.best_snapshot_under(node, held_seg, j * B, B, own_next=q.next_hash(x),
                                                extra=q.extra(j), limit=j * B + B, scan=scan, budget=budget)
                if snap is not None:
                    snapshots[j] = Hit(snap, snap.boundary)
                    break
        run = Run(start=start, held=held, stopped=held < levels, fork=record is not None,
                  child=Hit(child, usable, child.record) if child is not None else None, snapshots=snapshots)
        return IndexRun(run=run, last=last, copied=copied)

    def best_child(self, parent: bytes, seg: bytes, extra: bytes, scan: int,
                   budget: ScanBudget, skip: Entry | None = None) -> tuple[Entry | None, int]:
        """Of the (``scan`` most recent) blocks and tails under ``parent`` (a :func:`node_key`)
        stored with extra keys ``extra``, the one whose tokens agree longest with the prompt's
        ``seg`` (packed), and how many tokens agree; (None, 0) if none does; ``skip`` is not
        considered. Used by :meth:`run` at a run's stop level."""
        child, usable = None, 0
        kids = self.children.get(parent)
        if not kids or not seg:
            return None, 0
        scan = budget.take(min(len(kids), scan))
        entries = self.entries
        for n, ck in enumerate(reversed(kids)):
            if n >= scan:
                break
            c = entries[ck]
            if c.extra != extra or c is skip:
                continue
            a = lcp_tokens(c.tokens, seg)
            if a > usable:
                child, usable = c, a
        return child, usable

    def best_snapshot_under(self, parent: bytes, seg: bytes, start: int, block_tokens: int, *,
                            own_next: bytes | None, extra: bytes, limit: int, scan: int,
                            budget: ScanBudget) -> Entry | None:
        """The snapshot registered under ``parent`` (a :func:`node_key`; level start ``start``) with the largest
        boundary <= ``limit`` whose container agrees with the prompt's tokens ``seg`` (packed,
        from ``start``) at least up to that boundary; None if there is none.

        ``own_next`` is the prompt's own next block hash: a container that is that block agrees
        for the whole block. A container stored under other extra keys (LoRA, image) never
        agrees. The ``scan`` most recent snapshots are compared. Used by :meth:`run`."""
        entries = self.entries
        best: Entry | None = None
        agree: dict[bytes, int] = {}
        bucket = self.snaps_under.get(parent, {})
        scan = budget.take(min(len(bucket), scan))
        for n, sk in enumerate(reversed(bucket)):
            if n >= scan:
                break
            s = entries[sk]
            assert s.container is not None
            known = agree.get(s.container)
            if known is None:
                c = entries[s.container]
                if own_next is not None and c.kind is Kind.BLOCK and c.hash == own_next:
                    known = block_tokens  # the prompt's own block
                elif c.extra != extra:
                    known = 0  # stored under another LoRA / image: not this prompt's
                else:
                    known = lcp_tokens(c.tokens, seg)
                agree[s.container] = known
            b = s.boundary
            if b - start <= known and b <= limit and (best is None or b > best.boundary):
                best = s
        return best

    # ------------------------------------------------------------ verification

    def check(self, roots: set[bytes], foreign_parents: bool = False) -> None:
        """Verify every invariant in the module docstring; raise naming the broken one.

        ``roots`` are the :func:`node_key` of every namespace's root h_0.

        ``foreign_parents`` (a cluster node): a block or tail may name a parent held by
        another node, so invariant 1 holds across the cluster, not within this index."""
        num_children: dict[bytes, int] = defaultdict(int)
        num_snaps: dict[bytes, int] = defaultdict(int)
        sb: dict[tuple[str, str], int] = defaultdict(int)
        se: dict[tuple[str, str], int] = defaultdict(int)
        records = 0
        for key, e in self.entries.items():
            if key != store_key(e.namespace_id, e.kind, e.hash) or not e.committed or e.dead:
                raise IndexInvariantError(f"entry {key.hex()}: key (scoped by its namespace)/committed/dead "
                                          "flags inconsistent")
            if e.record and (e.kind is not Kind.BLOCK or e.size != 0 or e.pages is not None):
                raise IndexInvariantError(f"entry {key.hex()}: a fork record is a block with no payload")
            if e.pages is None and not e.on_disk and not e.record:
                raise IndexInvariantError(f"entry {key.hex()}: in no tier")
            if e.kind is Kind.STATE:
                c = self.entries.get(e.container or b"")
                if c is None:
                    raise IndexInvariantError(f"snapshot {key.hex()}: container missing (snapshot outlived its KV)")
                if c.namespace_id != e.namespace_id:
                    raise IndexInvariantError(f"snapshot {key.hex()}: its container is another namespace's")
                if not c.start < e.boundary <= c.end:
                    raise IndexInvariantError(f"snapshot {key.hex()}: boundary outside its container's range")
                num_snaps[c.key] += 1
                assert c.parent is not None
                if key not in self.snaps_under.get(c.node or b"", {}):
                    raise IndexInvariantError(f"snapshot {key.hex()}: not registered under its container's parent")
            else:
                assert e.parent is not None
                assert e.parent_key is not None
                if e.node not in roots:
                    p = self.entries.get(e.parent_key)
                    if p is None and not foreign_parents:
                        raise IndexInvariantError(f"entry {key.hex()}: parent missing (prefix closure broken)")
                    if p is not None and p.end != e.start:
                        raise IndexInvariantError(f"entry {key.hex()}: starts at {e.start}, parent ends at {p.end}")
                    if p is not None:
                        num_children[p.key] += 1
                elif e.start != 0:
                    raise IndexInvariantError(f"entry {key.hex()}: child of a root must start at 0")
                if key not in self.children.get(e.node or b"", {}):
                    raise IndexInvariantError(f"entry {key.hex()}: not registered under its parent")
            if e.record:
                records += 1
                continue
            mk = e.metric_kind
            if e.pages is not None:
                sb[(mk, "ram")] += e.size
                se[(mk, "ram")] += 1
            if e.on_disk:
                sb[(mk, "disk")] += e.size
                se[(mk, "disk")] += 1
        for key, e in self.entries.items():
            if e.num_children != num_children.get(key, 0) or e.num_snapshots != num_snaps.get(key, 0):
                raise IndexInvariantError(f"entry {key.hex()}: child/snapshot counts are stale")
        for mapping, name in ((self.children, "children"), (self.snaps_under, "snaps_under")):
            for parent, keys in mapping.items():
                for k in keys:
                    if k not in self.entries:
                        raise IndexInvariantError(f"{name}[{parent.hex()}] names a removed entry {k.hex()}")
        if records != self.fork_records:
            raise IndexInvariantError("fork record counter is off")
        for n, k in self.continuation.items():
            c = self.entries.get(k)
            if c is None or c.node != n or c.record or c.kind is not Kind.BLOCK:
                raise IndexInvariantError(f"continuation[{n.hex()}] does not name a block child of it")
        for label in set(sb) | set(self.stored_bytes):
            if sb.get(label, 0) != self.stored_bytes.get(label, 0) or se.get(label, 0) != self.stored_entries.get(label, 0):
                raise IndexInvariantError(f"stored bytes/entries counter {label} is off")


def _discard(mapping: dict[bytes, dict[bytes, None]], parent: bytes, key: bytes) -> None:
    bucket = mapping.get(parent)
    if bucket is not None:
        bucket.pop(key, None)
        if not bucket:
            del mapping[parent]

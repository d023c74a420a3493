"""Lookup against a plain reference model (DESIGN §5's specification), with Hypothesis.

The model is the definition: with nothing evicted, ``kv_tokens`` is the
longest common prefix of the prompt with any stored sequence, and
``state_tokens`` the largest boundary b of a stored snapshot whose sequence
agrees with the prompt for b tokens. Eviction may only lower them, never
raise them or return other bytes. Every step ends with ``Store.check()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixstore.admission import ADMISSION_POLICIES, EVICTION_POLICIES
from prefixstore.client.prompt import Prompt
from prefixstore.protocol.hashing import TOKEN_BYTES
from prefixstore.protocol.match import Hit, Run, merge
from prefixstore.protocol.probe import ProbeRequest
from prefixstore.protocol.wire import EntryRef
from prefixstore.store import StoreConfig

from ..factories import make_namespace, state_payload
from .harness import CoreHarness, expected_prefix_bytes

ALPHABET = st.integers(0, 2)  # few distinct tokens: prompts share prefixes and diverge mid-block


def lcp(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Model:
    def __init__(self) -> None:
        self.kv: set[tuple[int, ...]] = set()
        self.states: set[tuple[int, ...]] = set()

    def save(self, tokens: list[int], kv_upto: int, snaps: list[int]) -> None:
        if kv_upto:
            self.kv.add(tuple(tokens[:kv_upto]))
        for t in snaps:
            self.states.add(tuple(tokens[:t]))

    def kv_tokens(self, prompt: list[int]) -> int:
        return max((lcp(prompt, s) for s in self.kv), default=0)

    def state_tokens(self, prompt: list[int]) -> int:
        return max((len(s) for s in self.states if tuple(prompt[: len(s)]) == s), default=0)


class StoreMachine(RuleBasedStateMachine):
    """Saves, lookups, reads, restarts. ``exact`` stores never evict (big RAM or LMDB)."""

    block_tokens = 4
    tmp: Path
    memory_only = False
    # Exact runs admit everything (the model stores everything); evicting runs
    # may use any registered policy pair: the invariants must hold under each.
    state_admission = "always"
    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.sequences: list[list[int]] = [[]]
        self.harness: CoreHarness | None = None
        self.evicting = False

    @initialize(block=st.sampled_from([1, 3, 4]), small_ram=st.booleans())
    def setup(self, block: int, small_ram: bool) -> None:
        import tempfile

        self.ns = make_namespace(block_tokens=block)
        data_dir = "none" if self.memory_only else tempfile.mkdtemp(dir=self.tmp)
        # Small RAM: with LMDB, entries get demoted (still exact); RAM-only, they get deleted.
        ram = 64 * 256 if small_ram else 4 << 20
        # Lossy runs (deleting eviction, or admission that may refuse) may only lower answers.
        self.evicting = (self.memory_only and small_ram) or self.state_admission != "always"
        cfg = StoreConfig(port=0, data_dir=data_dir, ram_bytes=ram, page_bytes=256, disk_bytes=1 << 30,
                          state_admission=self.state_admission, eviction=self.eviction)
        self.harness = CoreHarness(cfg, self.ns)

    def teardown(self) -> None:
        if self.harness is not None:
            self.harness.close()

    @rule(base=st.integers(0, 50), keep=st.floats(0, 1), suffix=st.lists(ALPHABET, max_size=14),
          kv_frac=st.floats(0, 1), snaps=st.lists(st.floats(0, 1), max_size=3))
    def save(self, base: int, keep: float, suffix: list[int], kv_frac: float, snaps: list[float]) -> None:
        assert self.harness is not None
        parent = self.sequences[base % len(self.sequences)]
        tokens = parent[: int(len(parent) * keep)] + suffix
        assume(tokens)
        self.sequences.append(tokens)
        kv_upto = max(1, round(len(tokens) * kv_frac))
        boundaries = sorted({max(1, round(kv_upto * f)) for f in snaps})
        result = self.harness.save(tokens, kv_upto, {t: state_payload(self.ns, tokens, t) for t in boundaries})
        if not self.evicting:
            assert result["committed"] == result["wanted"] == result["offered"] - result["have"], result
        self.model.save(tokens, kv_upto, boundaries)

    @rule(base=st.integers(0, 50), keep=st.floats(0, 1), suffix=st.lists(ALPHABET, max_size=10),
          split=st.floats(0, 1), window=st.one_of(st.none(), st.integers(0, 6)))
    def lookup_and_read(self, base: int, keep: float, suffix: list[int], split: float, window: int | None) -> None:
        assert self.harness is not None
        parent = self.sequences[base % len(self.sequences)]
        prompt = parent[: int(len(parent) * keep) + 1] + suffix
        # The same answer from the runs a walk would gather (two probes meeting at level s), merged by
        # the one merge: the rule is written once (protocol/match.py). Probes teach nothing: before
        # the lookup, so the lookup's answer is the one compared.
        p = Prompt(self.ns, prompt)
        levels = len(p.hashes) + (p.num_tokens > len(p.hashes) * self.ns.block_tokens)
        walked = self.probe_merge(p, min(levels - 1, int(split * levels))) if levels else (0, 0, 0, 0)
        # The whole prompt's tokens, or a lean request (tokens of level 0, the last `window` tokens and
        # the levels the store names): the same answer either way, against the same model.
        if window is None:
            _, ans = self.harness.lookup(prompt)
        else:
            _, ans, needed = self.harness.lean_lookup(prompt, window)
            assert len(needed) <= 1, needed  # at most one more round trip: the stop level
        assert walked == (ans.matched_blocks, ans.kv_tokens, ans.state_tokens, ans.checkpoint_hint), (prompt, split)
        want_kv, want_state = self.model.kv_tokens(prompt), self.model.state_tokens(prompt)
        if self.evicting:
            assert ans.kv_tokens <= want_kv and ans.state_tokens <= want_state
        else:
            assert (ans.kv_tokens, ans.state_tokens) == (want_kv, want_state), (prompt, self.model.kv, self.model.states)
        assert ans.state_tokens <= ans.kv_tokens
        if ans.kv_tokens:
            kv, snap = self.harness.read_prefix(prompt, ans, ans.kv_tokens)
            assert kv == expected_prefix_bytes(self.ns, prompt, ans.kv_tokens, self.ns.block_tokens)
            if ans.snapshot is not None:
                assert snap == state_payload(self.ns, prompt, ans.state_tokens)
            if ans.lease_id:
                assert self.harness.store.release(ans.lease_id)

    def probe_merge(self, p: Prompt, s: int) -> tuple[int, int, int, int]:
        """Levels [0, s] asked of the node, then levels s.. (a cluster walk's two hops), merged."""
        assert self.harness is not None
        store = self.harness.store
        B, n = self.ns.block_tokens, len(p.hashes)
        runs: list[Run[EntryRef]] = []
        for start, stop in ((0, s + 1), (s, n + (p.num_tokens > n * B))):
            end_tok = min(stop * B, p.num_tokens)
            req = ProbeRequest(namespace_id=self.ns.id, start=start, parent=p.parent_of_block(start),
                               hashes=p.hash_bytes[start * 16:min(stop, n) * 16],
                               tokens=p.packed[start * B * TOKEN_BYTES:end_tok * TOKEN_BYTES], lease=False)
            a = store.probe(req)
            # Level by level (as where hot copies are held) finds what the binary search finds.
            assert store.probe(req, copies=frozenset({b"no such key"})) == a
            child = a.stop.child if a.stop is not None else None
            runs.append(Run(start=start, held=a.held, stopped=a.stop is not None,
                            fork=a.stop is not None and a.stop.fork,
                            child=Hit(child, child.usable_tokens) if child is not None else None,
                            snapshots={j: Hit(ref, ref.usable_tokens) for j, ref in a.snapshots.items()}))
        m = merge(runs, block_tokens=B, num_blocks=n, has_state=self.ns.has_state)
        return m.matched, m.kv_tokens, m.state_tokens, m.checkpoint_hint

    @precondition(lambda self: not self.memory_only)
    @rule()
    def restart(self) -> None:
        assert self.harness is not None
        self.harness.restart()

    @rule(seconds=st.floats(0, 100))
    def time_passes(self, seconds: float) -> None:
        assert self.harness is not None
        self.harness.now[0] += seconds
        self.harness.store.sweep()

    @invariant()
    def invariants_hold(self) -> None:
        if self.harness is not None:
            self.harness.store.check()


@pytest.fixture
def machine_tmp(tmp_path: Path):  # type: ignore[no-untyped-def]
    StoreMachine.tmp = tmp_path
    yield


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_lookup_matches_model_with_lmdb(machine_tmp: None) -> None:
    StoreMachine.memory_only = False
    StoreMachine.TestCase.settings = SETTINGS
    StoreMachine.TestCase().runTest()


@pytest.mark.parametrize("state_admission", sorted(ADMISSION_POLICIES))
@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_lookup_under_eviction_only_lowers(machine_tmp: None, eviction: str, state_admission: str) -> None:
    """The policy conformance suite: every admission x eviction pair keeps every invariant."""

    class RamOnly(StoreMachine):
        memory_only = True

    RamOnly.state_admission = state_admission
    RamOnly.eviction = eviction
    RamOnly.TestCase.settings = settings(SETTINGS, max_examples=15)
    RamOnly.TestCase().runTest()

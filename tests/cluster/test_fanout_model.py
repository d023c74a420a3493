"""A fan-out lookup over three store processes equals the single-node answer (DESIGN §5's specification).

The same reference model and rules as tests/store/test_index_model.py: with
nothing evicted, ``kv_tokens`` is the longest common prefix of the prompt with
any stored sequence and ``state_tokens`` the largest stored snapshot boundary
the prompt agrees with; every read returns exactly the true bytes. Here the
entries are spread over three real nodes by rendezvous placement and each
lookup is one parallel probe per node.
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from prefixstore.client import ClientConfig, PrefixClient

from ..factories import kv_payload, make_namespace, state_payload
from ..store.harness import expected_prefix_bytes
from ..store.test_index_model import ALPHABET, Model

_names = itertools.count()


class ClusterMachine(RuleBasedStateMachine):
    urls: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.sequences: list[list[int]] = [[]]
        self.loop = asyncio.new_event_loop()
        self.client: PrefixClient | None = None

    @initialize(block=st.sampled_from([1, 3, 4]))
    def setup(self, block: int) -> None:
        # A fresh namespace per example: the nodes' earlier entries are invisible to it.
        self.ns = make_namespace(block_tokens=block, model=f"fanout-{next(_names)}")
        self.client = PrefixClient(self.ns, ClientConfig(urls=tuple(self.urls)))

    def teardown(self) -> None:
        if self.client is not None:
            assert self.client.failures.total() == 0, self.client.failures
            self.loop.run_until_complete(self.client.close())
        self.loop.close()

    @rule(base=st.integers(0, 50), keep=st.floats(0, 1), suffix=st.lists(ALPHABET, max_size=14),
          kv_frac=st.floats(0, 1), snaps=st.lists(st.floats(0, 1), max_size=3))
    def save(self, base: int, keep: float, suffix: list[int], kv_frac: float, snaps: list[float]) -> None:
        assert self.client is not None
        parent = self.sequences[base % len(self.sequences)]
        tokens = parent[: int(len(parent) * keep)] + suffix
        assume(tokens)
        self.sequences.append(tokens)
        kv_upto = max(1, round(len(tokens) * kv_frac))
        boundaries = sorted({max(1, round(kv_upto * f)) for f in snaps})
        p = self.client.prompt(tokens)
        result = self.loop.run_until_complete(self.client.save(
            p, kv_upto, lambda a, b: kv_payload(self.ns, tokens, a, b),
            snapshots={t: state_payload(self.ns, tokens, t) for t in boundaries}))
        assert result.rejected == 0 and result.dropped == 0, result
        self.model.save(tokens, kv_upto, boundaries)

    @rule(base=st.integers(0, 50), keep=st.floats(0, 1), suffix=st.lists(ALPHABET, max_size=10))
    def lookup_and_read(self, base: int, keep: float, suffix: list[int]) -> None:
        assert self.client is not None
        parent = self.sequences[base % len(self.sequences)]
        prompt = parent[: int(len(parent) * keep) + 1] + suffix
        res = self.loop.run_until_complete(self.client.lookup(prompt))
        want = (self.model.kv_tokens(prompt), self.model.state_tokens(prompt))
        assert (res.kv_tokens, res.state_tokens) == want, (prompt, self.model.kv, self.model.states)
        assert res.checkpoint_hint == (res.kv_tokens if res.kv_tokens > res.state_tokens else 0)
        if res.kv_tokens:
            reads = res.kv_reads(res.kv_tokens)
            items = [it for it, _, _ in reads]
            bufs = [bytearray(self.ns.kv.payload_bytes(self.ns.block_tokens)) for _ in reads]
            if res.snapshot is not None:
                items.append(res.state_read())  # type: ignore[arg-type]
                bufs.append(bytearray(self.ns.state.snapshot_bytes))
            got = self.loop.run_until_complete(self.client.read(items, bufs))
            assert all(g > 0 for g in got), got
            per = self.ns.kv.layer_token_bytes
            parts = []
            for (it, a, b), buf, size in zip(reads, bufs, got):
                stored = size // (self.ns.kv.num_layers * per)  # tokens the entry holds
                parts.append(b"".join(bytes(buf[layer * stored * per: layer * stored * per + (b - a) * per])
                                      for layer in range(self.ns.kv.num_layers)))
            assert b"".join(parts) == expected_prefix_bytes(self.ns, prompt, res.kv_tokens, self.ns.block_tokens)
            if res.snapshot is not None:
                assert bytes(bufs[-1]) == state_payload(self.ns, prompt, res.state_tokens)
            assert self.loop.run_until_complete(self.client.release(res.lease_id))


def test_fanout_lookup_matches_single_node_model(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--state-admission", "always", "--ram-bytes", "16MiB",
                           "--max-namespaces-per-tenant", "4096")  # a namespace per example
    ClusterMachine.urls = cluster.urls
    ClusterMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None,
                                                derandomize=True,
                                                suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.filter_too_much])
    ClusterMachine.TestCase().runTest()

"""Who the cluster's members are, as one client sees them, and the one handle per member it calls.

:class:`Membership` holds the member list (first the seeds, then what ``/v1/members`` answers), the
cluster's settings that come with it (``replicas``, ``owner_grace_s``), the previous list for
``owner_grace_s`` after a change, and one :class:`Node` per member met: its node client
(client/node.py) behind the wrapper every call to it goes through (requests in flight, smoothed
latency, circuit breaker). Placement questions that need only these -- a key's owners in
rendezvous order, a branch's live homes, which of several copies to ask -- are answered here.

A node that errors or times out opens its breaker (``retry_after_s``, doubling to
``max_retry_after_s``); while it is open the node is skipped (the next member in rendezvous order
takes its new saves; its branches are misses) and then tried again. Failures are counted, never
raised (client/failures.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from prefixstore.protocol.errors import StoreError
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.placement import normalize_url, rank

from .config import ClientConfig
from .datapath import Buffer
from .device import DeviceBuffer
from .failures import Failures
from .node import NodeClient

T = TypeVar("T")


class Node:
    """One member, as the cluster client uses it: its node client and the one wrapper every call
    to it goes through (requests in flight, smoothed latency, circuit breaker)."""

    def __init__(self, url: str, client: NodeClient, config: ClientConfig, failures: Failures) -> None:
        self.url = url
        self.client = client
        self._config = config
        self._failures = failures
        self.inflight = 0
        self.latency_s = 0.002  # smoothed (EWMA) latency of its answers
        self.failures_in_row = 0
        self.closed_until = 0.0  # circuit open until then

    def usable(self, now: float) -> bool:
        return self.closed_until <= now

    def succeeded(self, seconds: float) -> None:
        self.failures_in_row = 0
        self.closed_until = 0.0
        self.latency_s += 0.2 * (seconds - self.latency_s)

    def failed(self, op: str, err: BaseException | str) -> None:
        self.failures_in_row += 1
        backoff = min(self._config.max_retry_after_s, self._config.retry_after_s * 2 ** (self.failures_in_row - 1))
        self.closed_until = time.monotonic() + backoff
        self._failures.record(op, f"{self.url}: {err} (skipped for {backoff:g}s)")

    async def run(self, op: str, fn: Callable[[NodeClient], Awaitable[T]],
                  unanswered: Callable[[T], bool] = lambda result: False) -> T | None:
        """Call the node. A StoreError (a node call that raises) or an ``unanswered`` result that
        came with new failures on the node client (an engine-facing call that turned a dead store
        into misses) opens its breaker; None for the former."""
        before = self.client.failures.total()
        self.inflight += 1
        started = time.monotonic()
        try:
            result = await fn(self.client)
        except StoreError as err:
            self.failed(op, err)
            return None
        finally:
            self.inflight -= 1
        if self.client.failures.total() > before and unanswered(result):
            self.failed(op, f"{op} failed")
        else:
            self.succeeded(time.monotonic() - started)
        return result


class Membership:
    """The member list and the nodes met (module docstring)."""

    def __init__(self, namespace: Namespace, config: ClientConfig, failures: Failures) -> None:
        self._namespace = namespace
        self._config = config
        self._failures = failures
        self._nodes: dict[str, Node] = {}
        self.seeds = tuple(normalize_url(u) for u in config.urls)
        self.members: tuple[str, ...] = self.seeds
        self.previous: tuple[str, ...] = ()  # the list before the last change (owner_grace_s)
        self.epoch = 0  # 0 until a member answered; then one more per change
        self.owner_grace_s = config.owner_grace_s if config.owner_grace_s is not None else 300.0
        self.replicas = 1  # copies of every branch (the cluster's ``replicas``, from /v1/members)
        self.standalone: str | None = None  # the seed that answered, when it is a node of no cluster
        self._changed_at = -math.inf
        self._asked_at = -math.inf
        self._refresh: asyncio.Task[bool] | None = None
        self._buffers: list[Buffer | DeviceBuffer] = []  # staging buffers registered by the engine (NIXL)

    # ------------------------------------------------------------ nodes

    def node(self, url: str) -> Node:
        """The member's handle, made on first use (its staging buffers registered)."""
        node = self._nodes.get(url)
        if node is None:
            cfg = dataclasses.replace(self._config, url=url, urls=())
            node = self._nodes[url] = Node(url, NodeClient(self._namespace, cfg), self._config, self._failures)
            for buf in self._buffers:
                node.client.register_buffer(buf)
        return node

    def nodes(self) -> list[Node]:
        """The nodes met so far."""
        return list(self._nodes.values())

    def usable(self, url: str, now: float) -> bool:
        """Not behind an open breaker (a node never called is usable)."""
        node = self._nodes.get(url)
        return node is None or node.usable(now)

    def pick(self, candidates: Sequence[str], now: float) -> str | None:
        """One of the usable candidates: two random choices, the one with fewer requests in flight."""
        live = list(dict.fromkeys(u for u in candidates if self.usable(u, now)))
        if len(live) <= 1:
            return live[0] if live else None
        # Even when all are idle, steered away from a busy copy. Always taking the least loaded sends
        # a sequential caller's every read to one copy (tests/cluster/test_replication.py caught it);
        # latency is not used because it is measured over every kind of request and puts are slow.
        a, b = random.sample(live, 2)
        return a if self.node(a).inflight <= self.node(b).inflight else b

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> None:
        """A staging buffer for every node's data path, now and for the nodes met later."""
        self._buffers.append(buf)
        for node in self._nodes.values():
            node.client.register_buffer(buf)

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        self._buffers = [b for b in self._buffers if b is not buf]
        return any([node.client.unregister_buffer(buf) for node in self._nodes.values()])

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for node in self._nodes.values():
            await node.client.close()

    # ------------------------------------------------------------ placement by the member list

    def owners(self, key: bytes) -> list[str]:
        """The members in rendezvous order of a placement key (the owner first)."""
        return rank(self.members, key)

    def owner(self, key: bytes) -> str | None:
        """The primary of a placement key, as this client sees the members."""
        return rank(self.members, key)[0] if self.members else None

    def holders(self, branch: bytes) -> list[str]:
        """The members a branch is placed on (its first ``replicas``), live or not."""
        return rank(self.members, branch)[: self.replicas]

    def homes(self, branch: bytes) -> list[str]:
        """The live nodes a branch is placed on: its first ``replicas`` members in rendezvous order
        (the primary first); while all of those are down, the next live member, which takes the
        branch's new saves meanwhile."""
        now = time.monotonic()
        order = rank(self.members, branch)
        live = [u for u in order[: self.replicas] if self.usable(u, now)]
        if not live:
            live = [u for u in order[self.replicas :] if self.usable(u, now)][:1]
        return live

    def in_grace(self) -> bool:
        """Within ``owner_grace_s`` of a change: a hop also asks the branch's previous owner."""
        return bool(self.previous) and time.monotonic() - self._changed_at < self.owner_grace_s

    def previous_holders(self, branch: bytes) -> list[str]:
        """The members the branch was placed on before the last change."""
        return rank(self.previous, branch)[: self.replicas]

    # ------------------------------------------------------------ the member list

    async def refresh(self, ask: Sequence[str] | None = None) -> bool:
        """Ask a live member or seed (or the first of ``ask`` that answers) for the member list; True
        when it changed."""
        self._asked_at = time.monotonic()
        candidates = list(ask) if ask is not None else list(dict.fromkeys([*self.members, *self.seeds]))
        if ask is None:
            random.shuffle(candidates)
        for url in candidates:
            if not self.usable(url, time.monotonic()):
                continue
            node = self.node(url)
            try:
                body = await node.client.members()
                listed = body["members"]
                if not isinstance(listed, list):
                    raise TypeError("members: expected a list")
                members = tuple(sorted(normalize_url(str(u)) for u in listed))
                grace = body.get("owner_grace_s")
                replicas = body.get("replicas", 1)
            except (StoreError, KeyError, TypeError, ValueError) as err:
                node.failed("members", err)
                continue
            # A plain `prefixstore serve` (no peers) says so, and stays so: PrefixClient then talks to
            # it as a node client, through the URL this client reached it at.
            self.standalone = url if body.get("cluster") is False and len(members) == 1 else None
            if self._config.owner_grace_s is None and isinstance(grace, (int, float)):
                self.owner_grace_s = float(grace)
            if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1:
                self.replicas = replicas
            if members and members != self.members:
                if self.epoch:  # the first answer replaces the seed list; later ones are changes
                    self.previous = self.members
                    self._changed_at = time.monotonic()
                self.members = members
                self.epoch += 1
                return True
            self.epoch = max(self.epoch, 1)
            return False
        return False

    async def ensure(self) -> None:
        """Ask for the member list once, then again every ``membership_refresh_s`` (in the background)."""
        now = time.monotonic()
        if self._asked_at == -math.inf:
            await self.refresh()
        elif now - self._asked_at >= self._config.membership_refresh_s and (
                self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self.refresh())

    # ------------------------------------------------------------ totals over the nodes

    def failures(self, own: Failures) -> collections.Counter[str]:
        """The cluster client's own failures plus every node's."""
        total: collections.Counter[str] = collections.Counter(own.counts)
        for node in self._nodes.values():
            total.update(node.client.failures)
        return total

    def path_bytes(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter()
        for node in self._nodes.values():
            total.update(node.client.path_bytes)
        return total


__all__ = ["Membership", "Node"]

"""The one client interface engines program against, and the entry point that picks its shape.

:class:`StoreClient` is the interface (a Protocol): a node client (client/node.py) and a cluster
client (client/cluster.py, which composes node clients) both implement it, with the same results,
so an engine moves from one node to a cluster by configuration alone. :class:`PrefixClient` is
what engines construct: ``PrefixClient(ns, ClientConfig(url=...))`` talks to one node,
``ClientConfig(urls=(...))`` to a cluster through its seed list; it holds one of the two
(``impl``) and forwards to it. No method raises because of the store: failures are misses or
dropped saves, counted in ``failures``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from prefixstore.protocol.errors import StoreError
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec
from .cluster import ClusterClient
from .config import ClientConfig
from .datapath import Buffer
from .device import DeviceBuffer
from .node import NodeClient
from .prompt import Prompt
from .results import LookupResult, SaveResult

log = logging.getLogger(__name__)


class StoreClient(Protocol):
    """What an engine can ask of the store, one node or a cluster."""

    namespace: Namespace
    config: ClientConfig

    @property
    def failures(self) -> collections.Counter[str]: ...
    @property
    def path_bytes(self) -> collections.Counter[str]: ...
    @property
    def data_path(self) -> str: ...
    @property
    def reads_device(self) -> bool: ...

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt: ...
    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult: ...
    async def prepare(self) -> bool: ...
    async def release(self, lease_id: bytes | None) -> bool: ...
    async def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]: ...
    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]: ...
    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]: ...
    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]: ...
    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
                   origins: Mapping[int, int] | None = None) -> SaveResult: ...
    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool: ...
    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool: ...
    async def close(self) -> None: ...


def connect(namespace: Namespace, config: ClientConfig | None = None) -> StoreClient:
    """The client ``config`` describes: a cluster client for seed ``urls``, else a node client."""
    config = config or ClientConfig()
    return ClusterClient(namespace, config) if config.urls else NodeClient(namespace, config)


class PrefixClient:
    """The async client engines embed (see the module docstring); every method is ``impl``'s.

    A single ``url`` that names one node of a larger cluster (a Kubernetes Service in front of the
    pods, say) is found out on the first call: the node's ``/v1/members`` lists more than itself.
    The client then talks to the cluster through it (``impl`` becomes a cluster client seeded with
    that URL, warned once), because one node answers only for its own branches: its lookups would
    be silently partial (DESIGN §8), and the node refuses them (409)."""

    def __init__(self, namespace: Namespace, config: ClientConfig | None = None) -> None:
        self.impl: StoreClient = connect(namespace, config)
        self.namespace = namespace
        self.config = self.impl.config
        self._shape_known = False
        self._shape_asked = -math.inf
        self._buffers: list[Buffer | DeviceBuffer] = []

    async def _shape(self) -> None:
        """Once (retried every membership_refresh_s while no store answers): is the one node this
        client was pointed at part of a larger cluster? Are the seeds of a cluster client one node
        that is part of none?"""
        if self._shape_known or time.monotonic() - self._shape_asked < self.config.membership_refresh_s:
            return
        self._shape_asked = time.monotonic()
        if isinstance(self.impl, ClusterClient):
            await self._shape_of_seeds(self.impl)
            return
        node = self.impl
        assert isinstance(node, NodeClient)
        try:
            listed = (await node.members()).get("members")
        except StoreError:
            return  # down: its calls are misses; asked again later
        self._shape_known = True
        if isinstance(listed, list) and len(listed) > 1:
            log.warning("prefixstore: %s is one node of a %d-node cluster; talking to the cluster through it "
                        "(configure ClientConfig(urls=...) with the members or the headless Service to say so)",
                        self.config.url, len(listed))
            self.impl = ClusterClient(self.namespace, dataclasses.replace(self.config, urls=(self.config.url,)))
            for buf in self._buffers:
                self.impl.register_buffer(buf)
            await node.close()

    async def _shape_of_seeds(self, cluster: ClusterClient) -> None:
        """A cluster client's seeds that are one plain node (``cluster: false`` in /v1/members):
        talk to it as a node client. Its lookups then count themselves there; as a cluster's they
        were probes, which teach nothing, and lookup reports, which a node of no cluster refuses,
        so its hit rates and policies learned nothing (docs/cluster.md)."""
        members = cluster.membership
        await members.refresh()
        if not members.epoch:
            return  # no seed answered: its calls are misses; asked again later
        self._shape_known = True
        if members.standalone is None:
            return
        log.info("prefixstore: %s is a single node, not a cluster; talking to it as one", members.standalone)
        self.impl = NodeClient(self.namespace, dataclasses.replace(self.config, url=members.standalone, urls=()))
        for buf in self._buffers:
            self.impl.register_buffer(buf)
        await cluster.close()

    async def __aenter__(self) -> PrefixClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def failures(self) -> collections.Counter[str]:
        """Store failures by operation, each a miss or a dropped save."""
        return self.impl.failures

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved, by data path ('nixl', 'http'): which path the data actually took."""
        return self.impl.path_bytes

    @property
    def data_path(self) -> str:
        """'nixl' or 'http': the path payloads take now ('undecided' before the first transfer)."""
        return self.impl.data_path

    @property
    def reads_device(self) -> bool:
        """Whether GPU staging should READ into device memory (``read_device``)."""
        return self.impl.reads_device

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return self.impl.prompt(tokens, extra_keys)

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """The reusable KV and state lengths of a prompt, and a lease on them (one round trip on a node)."""
        await self._shape()
        return await self.impl.lookup(prompt, lease)

    async def release(self, lease_id: bytes | None) -> bool:
        return await self.impl.release(lease_id)

    async def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]:
        """Payloads into caller buffers; per item bytes written, or -1 for a miss."""
        return await self.impl.read(items, outs)

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]:
        """Payloads straight into device memory over NIXL (client/node.py says when)."""
        return await self.impl.read_device(items, outs)

    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        await self._shape()
        return await self.impl.offer(items)

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        await self._shape()
        return await self.impl.put(items, commit)

    async def prepare(self) -> bool:
        """Set the data path up now rather than at the first transfer (an engine calls it as it
        starts): on NIXL, import nixl, make this process's agent and load the store's. That takes
        about half a second here (nixl 1.5.1 over UCX); the import holds the GIL for about 30 ms
        of it (the agent's making mostly lets go of it). Done at the first save or load, it delays
        that transfer and stalls every other thread of the process meanwhile, an engine's forward
        pass among them (benchmarks/first_transfer.py). Returns whether payloads will take NIXL
        now; never raises. A store that cannot be reached now gets the agent made all the same, and
        is asked again at a later transfer."""
        await self._shape()
        return await self.impl.prepare()

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
                   origins: Mapping[int, int] | None = None) -> SaveResult:
        """Offer KV [start, kv_upto) and the snapshots, then put what the store wants (or, with
        ``small_save_bytes`` above 0, put with no offer where the store can decide each item from
        the put itself: NodeClient.save); ``origins`` says why each snapshot was taken (boundary ->
        protocol.keys.Origin; absent: unknown)."""
        await self._shape()
        return await self.impl.save(prompt, kv_upto, kv_payload, snapshots, start, origins)

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a staging buffer with the NIXL agent once (a no-op, False, on the HTTP path)."""
        self._buffers.append(buf)
        return self.impl.register_buffer(buf)

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        self._buffers = [b for b in self._buffers if b is not buf]
        return self.impl.unregister_buffer(buf)

    async def close(self) -> None:
        await self.impl.close()


__all__ = ["Buffer", "PrefixClient", "StoreClient", "connect"]

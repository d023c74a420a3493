"""Who is in the cluster: a static list, or the DNS of a Kubernetes headless Service.

A cache needs no consensus (DESIGN §8): every node and client ranks members by
rendezvous hashing (protocol/placement.py), so parties that see the same list
agree on every key's owner, and a brief disagreement while a change spreads
costs misses, never wrong bytes (every entry is named by the hash of its
content's prefix).

Members are named by URL. With ``peers_dns = HOST:PORT`` the node resolves
HOST's A/AAAA records and maps each address to a **stable name** by reverse
lookup: CoreDNS answers PTR queries for the pods of a StatefulSet behind a
headless Service with ``pod-N.<svc>.<ns>.svc.<domain>``, which stays the same
when the pod restarts on a new IP. So a restarted pod that keeps its LMDB
volume keeps owning its keys. Where no PTR name exists the address itself is
the name. The chart sets each pod's ``node_url`` to the same
``http://$(POD_NAME).<svc>.<ns>.svc.<domain>:<port>``, so a node finds itself
in the list DNS gives.

The view is re-resolved every ``membership_refresh_s``. A change bumps the
epoch and keeps the previous member list, which clients use for
``owner_grace_s`` to retry misses on a key's previous owner (client/cluster.py).
Resolution failures keep the last good view: an empty member list would turn
the whole cache into misses for as long as DNS is down.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prefixstore.protocol.placement import normalize_url, rank
from .config import StoreConfig
from .tasks import stop_task

log = logging.getLogger(__name__)


async def system_addresses(host: str) -> list[str]:
    """HOST's A and AAAA records through the system resolver (getaddrinfo)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


async def system_name_of(address: str) -> str | None:
    """The PTR name of an address, or None when it has none."""
    try:
        name, _ = await asyncio.get_running_loop().getnameinfo((address, 0), socket.NI_NAMEREQD)
    except (socket.gaierror, socket.herror, OSError):
        return None
    return name.rstrip(".") or None


@dataclass(frozen=True, kw_only=True)
class DnsResolver:
    """The two lookups DNS membership needs; tests pass their own functions."""

    addresses: Callable[[str], Awaitable[list[str]]] = system_addresses
    name_of: Callable[[str], Awaitable[str | None]] = system_name_of


@dataclass(frozen=True, kw_only=True)
class View:
    members: tuple[str, ...]
    epoch: int
    previous: tuple[str, ...] = ()
    changed_s: float = 0.0  # clock() when the members last changed


def _host_for_url(name: str) -> str:
    return f"[{name}]" if ":" in name else name


# getaddrinfo's answers that DNS itself gave: the name has no records (a headless Service with no
# ready pod). EAI_AGAIN (no answer) and the rest say nothing about the cluster.
_NO_SUCH_NAME = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name))


PLACEMENT = "branch"
"""How this node places entries (protocol/placement.py), served in /v1/members so that a client of
another placement can refuse to mix with it."""


class Membership:
    """The member list this node serves to clients and ranks keys with."""

    def __init__(self, config: StoreConfig, resolver: DnsResolver | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.resolver = resolver or DnsResolver()
        self.clock = clock
        self.self_url = normalize_url(config.node_url) if config.node_url else ""
        self.view = View(members=tuple(sorted(config.peer_urls)), epoch=1, changed_s=clock())
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[View], None]] = []
        self._last_warning = -1e18
        # DNS membership is known once DNS has answered: with members, or with "no such name" (no
        # pod is ready yet: this node starts alone). A node that never heard from DNS (it times
        # out, refuses) does not know its cluster, and /readyz keeps it out of traffic.
        self.known = not config.peers_dns

    @property
    def members(self) -> tuple[str, ...]:
        """The current members; a single node with no peers configured is a cluster of itself."""
        if self.view.members:
            return self.view.members
        return (self.self_url,) if self.self_url else ()

    @property
    def is_cluster(self) -> bool:
        return bool(self.config.peer_urls or self.config.peers_dns)

    def on_change(self, listener: Callable[[View], None]) -> None:
        self._listeners.append(listener)

    def set_self_url(self, url: str) -> None:
        """The URL this node was found to listen on (``serve`` calls it once bound) unless node_url is set."""
        if not self.self_url:
            self.self_url = normalize_url(url)
        if self.config.peer_urls and self.self_url not in self.config.peer_urls:
            log.warning("this node (%s) is not in peers %s: it will own no keys; set node_url to the URL "
                        "the peers list names it by", self.self_url, ",".join(self.config.peer_urls))

    def rank(self, key: bytes) -> list[str]:
        return rank(self.members, key)

    def is_owner(self, key: bytes) -> bool:
        members = self.members
        return bool(members) and rank(members, key)[0] == self.self_url

    def in_grace(self) -> bool:
        """Within owner_grace_s of a change of members (the previous list still counts)."""
        return bool(self.view.previous) and self.clock() - self.view.changed_s < self.config.owner_grace_s

    def is_home(self, key: bytes) -> bool:
        """Whether this node holds what ``key`` places (one of its first ``replicas`` members in
        rendezvous order, now or, within owner_grace_s, before the last change)."""
        r = self.config.replicas
        if self.self_url in rank(self.members, key)[:r]:
            return True
        return self.in_grace() and self.self_url in rank(self.view.previous, key)[:r]

    def _adopt(self, members: tuple[str, ...]) -> bool:
        if members == self.view.members:
            return False
        old = self.view
        self.view = View(members=members, epoch=old.epoch + 1, previous=old.members, changed_s=self.clock())
        log.info("cluster membership epoch %d: %d members (%s)", self.view.epoch, len(members), ", ".join(members))
        for listener in self._listeners:
            listener(self.view)
        return True

    async def resolve_dns(self) -> tuple[str, ...]:
        """The member URLs peers_dns resolves to now. Raises OSError when DNS does not answer."""
        host, _, port = self.config.peers_dns.rpartition(":")
        scheme = "https" if self.config.tls_cert_file else "http"
        addresses = await self.resolver.addresses(host)
        names = await asyncio.gather(*(self.resolver.name_of(a) for a in addresses))
        urls = {f"{scheme}://{_host_for_url(name or addr)}:{port}" for addr, name in zip(addresses, names)}
        return tuple(sorted(urls))

    async def refresh(self) -> bool:
        """Re-read DNS membership (static lists never change). True when the members changed."""
        if not self.config.peers_dns:
            return False
        try:
            members = await self.resolve_dns()
        except (OSError, UnicodeError) as err:
            if isinstance(err, socket.gaierror) and err.errno in _NO_SUCH_NAME:
                self.known = True  # an answer: nobody is ready yet
            self._warn(f"cannot resolve peers_dns={self.config.peers_dns}: {err}; keeping {len(self.members)} members")
            return False
        self.known = True
        if not members:
            self._warn(f"peers_dns={self.config.peers_dns} resolved to no address; keeping the last members")
            return False
        return self._adopt(members)

    def _warn(self, message: str) -> None:
        now = self.clock()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning("%s", message)

    async def start(self) -> None:
        """Resolve once (a failure is logged, not fatal), then refresh every membership_refresh_s."""
        if self.config.peers_dns:
            await self.refresh()
            self._task = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.membership_refresh_s)
            try:
                await self.refresh()
            except Exception:  # housekeeping must survive anything
                log.exception("membership refresh failed")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    def describe(self) -> dict[str, object]:
        """What ``GET /v1/members`` answers (clients start from this)."""
        view = self.view
        return {"members": list(self.members), "epoch": view.epoch, "self": self.self_url,
                "previous": list(view.previous), "changed_s_ago": max(0.0, self.clock() - view.changed_s),
                "owner_grace_s": self.config.owner_grace_s, "refresh_s": self.config.membership_refresh_s,
                "replicas": self.config.replicas, "placement": PLACEMENT,
                # False: a node started without peers (a plain `prefixstore serve`), one for good: it
                # answers /v1/lookup itself and takes no lookup reports (store/cluster.py), so a
                # cluster client given it talks to it as a node client (client/client.py).
                "cluster": self.is_cluster}


__all__ = ["PLACEMENT", "DnsResolver", "Membership", "View", "system_addresses", "system_name_of"]

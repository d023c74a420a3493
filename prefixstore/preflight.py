"""What ``serve`` refuses beyond StoreConfig's own validation, checked the same way by ``serve``
and by ``config`` (which must not call a configuration good that ``serve`` would refuse):

* a budget allocated at start (the RAM arena, the sighting filter) larger than the memory this
  process may use (the machine's, or its container's limit): mmap refuses it, or the kernel kills
  the process later;
* a ``node_url`` naming a host the bound address cannot serve: ``--host 127.0.0.1`` (the default)
  with ``--node-url http://10.0.0.1:8077`` starts, reports ready, and every peer that follows the
  URL gets connection refused, so that node's share of the cluster is silent misses.

Both need the machine (its memory, its resolver), which is why they are not StoreConfig's: the
config tree stays a pure function of its sources.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Callable, Sequence

from .flags import format_size, human_bytes
from prefixstore.store.config import ConfigError, StoreConfig

# Budgets the store allocates at start: the RAM arena (prefaulted, so resident), and the
# sighting filter. Either larger than the memory this process may use is a configuration error.
ALLOCATED_AT_START = ("ram_bytes", "sighting_filter_bytes")

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Hosts that listen on every address of the machine: any node_url naming this machine is served."""

Resolver = Callable[[str], Sequence[str]]
"""A host name or address -> the addresses it stands for (raises OSError when it does not resolve)."""


def memory_limit_bytes() -> int | None:
    """The memory this process may use: physical memory, or the cgroup's limit when lower (a container)."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # cgroup v2, v1
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            limits.append(int(text))
    positive = [n for n in limits if n > 0]
    return min(positive) if positive else None


def check_memory(config: StoreConfig, limit_bytes: int | None) -> None:
    """Raise ConfigError, naming the knob, when a budget allocated at start exceeds ``limit_bytes``."""
    if limit_bytes is None:
        return
    for knob in ALLOCATED_AT_START:
        value = getattr(config, knob)
        if value > limit_bytes:
            raise ConfigError(f"{knob}: {format_size(value)} is more than the {human_bytes(limit_bytes)} of memory "
                              "this process may use (it is allocated at start)")
    total = sum(getattr(config, knob) for knob in ALLOCATED_AT_START)
    if total > limit_bytes:
        raise ConfigError(f"ram_bytes: {format_size(config.ram_bytes)} plus sighting_filter_bytes "
                          f"{format_size(config.sighting_filter_bytes)} is more than the {human_bytes(limit_bytes)} "
                          "of memory this process may use (both are allocated at start)")


def resolve(host: str) -> list[str]:
    """The addresses ``host`` stands for, by the system's resolver (/etc/hosts, DNS)."""
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})


def _addresses(host: str, resolver: Resolver) -> set[str]:
    try:
        return {a.split("%", 1)[0] for a in resolver(host)}  # an IPv6 zone does not change the address
    except (OSError, UnicodeError):
        return set()


def check_node_url(config: StoreConfig, resolver: Resolver = resolve) -> None:
    """Raise ConfigError, naming node_url, when it names a host whose addresses the bound ``host``
    does not listen on. Only what can be shown is refused: a wildcard host serves every address,
    and a name that does not resolve here may resolve where the peers are (their /etc/hosts)."""
    if not config.node_url or config.host in WILDCARD_HOSTS:
        return
    node_host = urllib.parse.urlsplit(config.node_url).hostname or ""
    bound, named = _addresses(config.host, resolver), _addresses(node_host, resolver)
    if not bound or not named or bound & named:
        return
    loopback = all(ipaddress.ip_address(a).is_loopback for a in bound)
    shown = node_host if named == {node_host} else f"{node_host} ({', '.join(sorted(named))})"
    raise ConfigError(
        f"node_url: {config.node_url} names {shown}, an address this node does not listen on: host={config.host} "
        f"{'serves this machine only' if loopback else 'listens on ' + ', '.join(sorted(bound)) + ' only'}, so "
        f"other nodes and clients would get connection refused. Set host to 0.0.0.0 (every interface) or to "
        f"{node_host}")


def check(config: StoreConfig, resolver: Resolver = resolve, limit_bytes: int | None = None) -> None:
    """Every check above (``limit_bytes``: the memory limit, default this process's)."""
    check_memory(config, memory_limit_bytes() if limit_bytes is None else limit_bytes)
    check_node_url(config, resolver)


__all__ = ["ALLOCATED_AT_START", "check", "check_memory", "check_node_url", "memory_limit_bytes", "resolve"]

"""Admission and eviction policy interfaces, with the baseline policies.

Pure policy: no I/O, no clocks (``now`` is passed in), imports protocol only.
The store asks an :class:`AdmissionPolicy` whether to take an offered entry,
and orders eviction candidates by an :class:`EvictionPolicy`'s priority
(lowest first). Policies are found by name in the registries below; an
unknown name raises ``ValueError`` listing the choices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from ..protocol.keys import Kind


T = TypeVar("T")


class EntryView(Protocol):
    """What a policy may read of an entry (the store's Entry satisfies it)."""

    @property
    def kind(self) -> Kind: ...
    @property
    def size(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def last_access_s(self) -> float: ...
    @property
    def num_hits(self) -> int: ...


class AdmissionPolicy(Protocol):
    name: str

    def admit(self, kind: Kind, key: bytes, size: int, now: float) -> bool:
        """Decide whether to take an offered entry. May count a sighting of ``key``."""
        ...


class EvictionPolicy(Protocol):
    name: str

    def priority(self, entry: EntryView, now: float) -> float:
        """Lower is evicted first. Called when an entry is stored or read."""
        ...


class AlwaysAdmit:
    """Take every valid offer (the baseline, and the right choice for KV)."""

    name = "always"

    def admit(self, kind: Kind, key: bytes, size: int, now: float) -> bool:
        return True


class LRU:
    """Least recently used first: priority is the time of the last store or read."""

    name = "lru"

    def priority(self, entry: EntryView, now: float) -> float:
        return entry.last_access_s


ADMISSION_POLICIES: dict[str, Callable[[], AdmissionPolicy]] = {"always": AlwaysAdmit}
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU}


def _make(registry: dict[str, Callable[[], T]], name: str, what: str) -> T:
    try:
        factory = registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} policy {name!r}; choose one of {sorted(registry)}") from None
    return factory()


def make_admission(name: str) -> AdmissionPolicy:
    return _make(ADMISSION_POLICIES, name, "admission")


def make_eviction(name: str) -> EvictionPolicy:
    return _make(EVICTION_POLICIES, name, "eviction")

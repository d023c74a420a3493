"""Policy protocols and registries. Policies are found by name; an unknown name
raises ``ValueError`` listing the choices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from prefixstore.protocol.keys import Kind
from .admission import Adaptive, AlwaysAdmit, SecondHit
from .eviction import LRU, EntryView, FlopAware, PolicyContext

T = TypeVar("T")


class AdmissionPolicy(Protocol):
    name: str

    def admit(self, kind: Kind, key: bytes, size: int, now: float, origin: int = 0) -> bool: ...
    def on_sighting(self, kind: Kind, key: bytes, now: float) -> None: ...
    def on_hit(self, kind: Kind, key: bytes, first: bool, now: float, origin: int = 0) -> None: ...
    def on_evict(self, kind: Kind, num_hits: int, now: float, origin: int = 0) -> None: ...


class EvictionPolicy(Protocol):
    name: str

    def priority(self, entry: EntryView, now: float) -> float: ...
    def on_store(self, entry: EntryView, now: float) -> None: ...
    def on_hit(self, entry: EntryView, now: float) -> None: ...
    def on_evict(self, entry: EntryView, priority: float, now: float) -> None: ...
    def on_miss(self, kind: Kind, key: bytes, now: float) -> None: ...


ADMISSION_POLICIES: dict[str, Callable[[PolicyContext], AdmissionPolicy]] = {
    "always": lambda ctx: AlwaysAdmit(),
    "second-hit": lambda ctx: SecondHit(ctx.filter_bytes, seed=ctx.hash_seed),
    "adaptive": lambda ctx: Adaptive(ctx.filter_bytes, seed=ctx.hash_seed),
}
EVICTION_POLICIES: dict[str, Callable[[PolicyContext], EvictionPolicy]] = {
    "lru": LRU,
    "flop-aware": FlopAware,
}


def _make(registry: dict[str, Callable[[PolicyContext], T]], name: str, what: str, ctx: PolicyContext | None) -> T:
    try:
        factory = registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} policy {name!r}; choose one of {sorted(registry)}") from None
    return factory(ctx or PolicyContext())


def make_admission(name: str, ctx: PolicyContext | None = None) -> AdmissionPolicy:
    return _make(ADMISSION_POLICIES, name, "admission", ctx)


def make_eviction(name: str, ctx: PolicyContext | None = None) -> EvictionPolicy:
    return _make(EVICTION_POLICIES, name, "eviction", ctx)

"""The client's one configuration record (what an engine connector maps its settings onto)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    url: str = "http://127.0.0.1:8077"
    """Base URL of the store (one node; the cluster issue adds a member list)."""
    timeout_s: float = 5.0
    """Whole-request deadline; past it the request counts as a miss or a dropped save."""
    connect_timeout_s: float = 1.0
    """Deadline to open a connection: a dead store turns into misses this fast."""
    lease: bool = True
    """Ask lookups for a lease, so the matched entries cannot be evicted before they are read."""
    verify_checksums: bool = True
    """Check the xxh3-64 of every payload received; a mismatch is a miss, never wrong bytes."""
    max_get_bytes: int = 256 << 20
    """Split reads into batches of at most this many payload bytes."""
    max_items: int = 4096
    """Split offers and puts into batches of at most this many items."""
    warn_interval_s: float = 30.0
    """At most one warning per this interval per kind of failure; counters count them all."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://, got {self.url!r}")
        for name in ("timeout_s", "connect_timeout_s", "max_get_bytes", "max_items"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")

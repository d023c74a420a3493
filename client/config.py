"""The client's one configuration record (what an engine connector maps its settings onto)."""

from __future__ import annotations

import ssl
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
    token: str = ""
    """Bearer token of this client's tenant, sent on every request (control calls and the bulk
    read path). Empty: no Authorization header (an open store)."""
    tls_ca_file: str = ""
    """PEM CA bundle that signs the store's certificate (https URLs). Empty: the system trust
    store. The certificate and host name are always verified; there is no switch to turn that off."""
    tls_cert_file: str = ""
    """PEM client certificate for a store that requires mutual TLS (with tls_key_file)."""
    tls_key_file: str = ""
    """PEM private key of tls_cert_file."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://, got {self.url!r}")
        for name in ("timeout_s", "connect_timeout_s", "max_get_bytes", "max_items"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.token and not (self.token.isascii() and self.token.isprintable() and " " not in self.token):
            raise ValueError("token: must be printable ASCII without spaces")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_key_file: tls_cert_file and tls_key_file are set together or not at all")

    @property
    def authorization(self) -> str | None:
        """The Authorization header value, or None without a token."""
        return f"Bearer {self.token}" if self.token else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A verifying TLS context for an https URL (None for http)."""
        if not self.url.startswith("https://"):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file or None)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

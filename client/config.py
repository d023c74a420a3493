"""The client's one configuration record (what an engine connector maps its settings onto)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    url: str = "http://127.0.0.1:8077"
    """Base URL of the store when it is one node (ignored when ``urls`` is set)."""
    urls: tuple[str, ...] = ()
    """Seed URLs of a cluster (client/cluster.py): any live one tells the client the member list
    (GET /v1/members), which it then refreshes. Set, ``PrefixClient(ns, config)`` is a cluster client
    with the same methods. A comma-separated string is accepted too."""
    membership_refresh_s: float = 10.0
    """Cluster: seconds between refreshes of the member list."""
    retry_after_s: float = 1.0
    """Cluster: a node that failed is skipped (its keys are misses) for this long, doubling on every
    further failure up to ``max_retry_after_s``; then it is tried again."""
    max_retry_after_s: float = 30.0
    """Cluster: the longest a failed node is skipped before it is tried again."""
    owner_grace_s: float | None = None
    """Cluster: after a membership change, misses are retried on a key's previous owner for this
    long. None: the cluster's own owner_grace_s (served with the member list)."""
    timeout_s: float = 5.0
    """Whole-request deadline; past it the request counts as a miss or a dropped save."""
    connect_timeout_s: float = 1.0
    """Deadline to open a connection: a dead store turns into misses this fast."""
    lease: bool = True
    """Ask lookups for a lease, so the matched entries cannot be evicted before they are read."""
    lookup_token_window: int | None = 1024
    """Lean lookups, and a cluster lookup's probes: a request carries the prompt's block hashes, but
    tokens only for its first level and its last this-many tokens (where a cold prompt and a conversation's next
    turn stop matching); a match that stops elsewhere costs one more round trip that carries the
    one level it needs (docs/design.md). None: carry every token (the request before lean lookups;
    one round trip always, about 5x the bytes at 16-token blocks)."""
    control_channel: bool = True
    """Send lookups and cluster probes over one WebSocket per node (``/v1/control``,
    protocol/control.py) instead of one HTTP request each: the same frames and answers, a few
    hundred microseconds less per call. Where the channel cannot be opened (an older store, a proxy
    without WebSockets) the calls go as POSTs; False: always POSTs."""
    verify_checksums: bool = True
    """Check the xxh3-64 of every payload received; a mismatch is a miss, never wrong bytes."""
    max_get_bytes: int = 256 << 20
    """Split reads into batches of at most this many payload bytes."""
    max_items: int = 4096
    """Split offers and puts into batches of at most this many items. A block and the snapshots
    after it go in one batch (a store decides a snapshot against its container in the same offer):
    below their count the snapshots are refused (``container_missing``)."""
    small_save_bytes: int = 0
    """0 (the default): every save offers each batch and sends only what the store wants. Above 0,
    a save sends no offer where the store can decide each item from the put itself: a batch (up to
    ``max_items`` items) of at most this many payload bytes goes as one HTTP put, even where NIXL
    is in use, and a larger one over NIXL goes straight to the reserve, which decides before any
    byte moves. One round trip is saved either way. The store still decides each item (have,
    rejected, stored), but what a small put carries that the store holds or refuses travels for
    nothing, and ``kv_payload`` is called for every item. Pays for a caller whose saves rarely
    carry what the store holds: the vLLM connector's start where the store's match ends, and it
    sets 1 MiB (client/vllm/settings.py). Keep it under the store's ``max_body_bytes``. On this
    project's 2-core machine a 320 KiB save as one HTTP put took 34% less CPU than offered over
    NIXL, a 1.25 MiB one 27% less, a 5 MiB one 7% more (docs/benchmarks.md, "A save's round
    trips")."""
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
    data_path: str = "auto"
    """How payloads move: 'auto' (NIXL READs/WRITEs of the store's arena when nixl is importable
    here and the store serves it, HTTP otherwise), 'nixl' (the same, but not getting NIXL is
    counted as a failure and warned about), 'http' (never NIXL). Either way the API and results
    are the same, and any NIXL failure falls back to HTTP; one log line says which path is in use."""
    device_reads: bool = False
    """GPU staging regions: NIXL READs land straight in GPU memory (``read_device``) instead of
    the pinned host mirror plus one copy up. Needs ``verify_checksums=False``: the client cannot
    hash GPU memory, so those bytes are proven by their lease alone (docs/nixl.md). Pays where UCX
    reaches GPU memory directly (an RDMA fabric with GPUDirect: enable UCX's ib transports by
    setting UCX_MODULES yourself). Without that, UCX stages such a READ through host memory in
    small pieces: on an H200 over TCP and shared memory it measured 3x slower than the host READ
    plus copy (docs/benchmarks.md), hence off."""

    def __post_init__(self) -> None:
        if self.device_reads and self.verify_checksums:
            raise ValueError("device_reads: READs into GPU memory cannot be checked against their xxh3 here; "
                             "set verify_checksums=False to trust their leases instead (docs/nixl.md)")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://, got {self.url!r}")
        if isinstance(self.urls, str):
            object.__setattr__(self, "urls", tuple(u.strip() for u in self.urls.split(",") if u.strip()))
        object.__setattr__(self, "urls", tuple(u.strip().rstrip("/") for u in self.urls))
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"urls: expected http:// or https:// URLs, got {u!r}")
        for name in ("membership_refresh_s", "retry_after_s", "max_retry_after_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        for name in ("timeout_s", "connect_timeout_s", "max_get_bytes", "max_items"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.small_save_bytes < 0:
            raise ValueError("small_save_bytes: must be >= 0 (0: every save offers first)")
        if self.lookup_token_window is not None and self.lookup_token_window < 0:
            raise ValueError("lookup_token_window: must be >= 0, or None to carry every token")
        if self.token and not (self.token.isascii() and self.token.isprintable() and " " not in self.token):
            raise ValueError("token: must be printable ASCII without spaces")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_key_file: tls_cert_file and tls_key_file are set together or not at all")
        if self.data_path not in ("auto", "nixl", "http"):
            raise ValueError(f"data_path: {self.data_path!r} is not one of 'auto', 'nixl', 'http'")

    @property
    def authorization(self) -> str | None:
        """The Authorization header value, or None without a token."""
        return f"Bearer {self.token}" if self.token else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """A verifying TLS context for an https URL (None for http)."""
        if not self.url.startswith("https://") and not any(u.startswith("https://") for u in self.urls):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file or None)
        if self.tls_cert_file:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

"""The store's one configuration tree.

Every knob is a field of :class:`StoreConfig`, documented where it is declared;
that text is what ``prefixstore serve --help`` prints. CLI flags
(``--ram-bytes``), environment variables (``PREFIXSTORE_RAM_BYTES``) and a
TOML config file (``ram_bytes = "1GiB"``) all map onto these fields, with the
precedence flag > environment > file > default. A bad value fails at start-up
naming the knob; nothing silently falls back.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .knobs import ConfigError, parse_size

ENV_PREFIX = "PREFIXSTORE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")

def default_data_dir() -> Path:
    """A per-user data directory: $XDG_DATA_HOME/prefixstore or ~/.local/share/prefixstore."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "prefixstore"


def _doc(text: str, kind: str = "") -> dict[str, str]:
    return {"help": text, "kind": kind}


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    host: str = field(default="127.0.0.1", metadata=_doc(
        "Address to listen on. The default serves this machine only; use 0.0.0.0 in a cluster."))
    port: int = field(default=8077, metadata=_doc("TCP port of the HTTP plane (0: pick a free port)."))
    ram_bytes: int = field(default=256 << 20, metadata=_doc(
        "Hard byte budget of the RAM arena (preallocated at start). Accepts units: 256MiB, 4GiB.", "size"))
    page_bytes: int = field(default=64 << 10, metadata=_doc(
        "Size of one arena page; an entry occupies ceil(size / page_bytes) pages.", "size"))
    data_dir: str = field(default="", metadata=_doc(
        "Directory of the LMDB capacity tier. Empty: a per-user data directory "
        "($XDG_DATA_HOME/prefixstore). 'none': RAM only, nothing survives a restart."))
    disk_bytes: int = field(default=4 << 30, metadata=_doc(
        "Byte budget of payloads in the LMDB tier; beyond it the least valuable entries are deleted.", "size"))
    keep_damaged_lmdb: bool = field(default=False, metadata=_doc(
        "A damaged or foreign-format LMDB environment is set aside and the tier starts empty (it is only "
        "cache). Off, its files are deleted; on, they are moved to DATA_DIR/quarantine/ for inspection "
        "(one set at most; it takes disk space outside disk_bytes)."))
    lmdb_sync: bool = field(default=False, metadata=_doc(
        "fsync every LMDB commit. Off, a killed process loses nothing (the OS holds the pages); "
        "on, a power loss loses nothing either, at a large write cost."))
    durability: str = field(default="write-behind", metadata=_doc(
        "When a committed entry reaches the LMDB tier. 'write-behind': a commit makes it visible once it is "
        "in RAM and checksummed, and a writer persists committed entries behind it, many per LMDB "
        "transaction, at most write_behind_s and write_behind_bytes behind (a commit waits while the "
        "writer is over either bound); a killed process loses what was behind, never more, and never "
        "returns wrong bytes. 'sync': a commit returns once its entries are in LMDB (a killed process "
        "loses nothing acknowledged), at the cost of waiting on the disk in every put."))
    write_behind_s: float = field(default=1.0, metadata=_doc(
        "durability=write-behind: most seconds the oldest committed entry may wait for LMDB before "
        "commits wait on the writer (the window a kill -9 can lose)."))
    write_behind_bytes: int = field(default=256 << 20, metadata=_doc(
        "durability=write-behind: most bytes of committed entries not yet in LMDB before commits wait on "
        "the writer; at most half of ram_bytes is used (the entries behind hold RAM pages, which are never "
        "demoted before they are written).", "size"))
    heap_keep_bytes: int = field(default=16 << 20, metadata=_doc(
        "Freed C-heap memory the store process keeps mapped for the next request instead of returning it "
        "to the kernel (glibc's malloc trim and mmap thresholds; store/heap.py): a lookup's request buffers "
        "are then reused rather than faulted in again page by page. Bounds what RSS keeps beyond its peak "
        "use; payloads never come from this heap. 0: the C library's own behaviour.", "size"))
    lease_ttl_s: float = field(default=30.0, metadata=_doc(
        "Lifetime of a lookup's lease: leased entries are not evicted until it expires or is released. "
        "Lookups never renew leases."))
    pending_ttl_s: float = field(default=60.0, metadata=_doc(
        "How long a put that was not committed keeps its pages before they are reclaimed."))
    kv_admission: str = field(default="always", metadata=_doc(
        "Admission policy for KV blocks and tails. KV is small per token and any prefix of it "
        "is reusable, so 'always' suits it."))
    state_admission: str = field(default="adaptive", metadata=_doc(
        "Admission policy for state snapshots: 'always'; 'second-hit' (admit on the second sighting); "
        "'adaptive' (second-hit while reuse is heavy-tailed and space is short, always otherwise)."))
    eviction: str = field(default="flop-aware", metadata=_doc(
        "Eviction priority for both tiers: 'flop-aware' (recency plus recompute FLOPs saved per byte, "
        "weight tuned online) or 'lru'."))
    sighting_filter_bytes: int = field(default=1 << 20, metadata=_doc(
        "Memory of the aging sighting filter behind second-hit / adaptive admission.", "size"))
    max_body_bytes: int = field(default=1 << 30, metadata=_doc(
        "Largest request body accepted (put); larger ones get 413.", "size"))
    max_header_bytes: int = field(default=8 << 20, metadata=_doc(
        "Largest msgpack header of one frame; a lookup of N tokens at block B needs about 4N + 16N/B bytes.", "size"))
    max_items: int = field(default=4096, metadata=_doc(
        "Most items (entries) in one offer, put, commit or get request."))
    max_lookup_tokens: int = field(default=1 << 21, metadata=_doc(
        "Most prompt tokens in one lookup."))
    max_get_bytes: int = field(default=1 << 30, metadata=_doc(
        "Most payload bytes one get may return; ask in several batches beyond it.", "size"))
    read_buffer_bytes: int = field(default=64 << 20, metadata=_doc(
        "Most bytes the store holds outside the RAM arena for gets of disk-only entries when no arena page "
        "can be freed for them (every page pinned): those ranges are read into buffers of their own until "
        "the answer is sent. A get item past it is answered as a miss. Bounds what gets add to the process's "
        "memory beyond ram_bytes (docs/operations.md).", "size"))
    max_entries: int = field(default=1 << 20, metadata=_doc(
        "Most entries the store indexes (RAM and disk together); beyond it the least valuable leaves are "
        "deleted, as for disk_bytes. The index's memory grows with entries, not only with payload bytes "
        "(about 1.5 KiB each), so tiny entries are bounded by count. With a tenants_file each tenant may "
        "hold max_entries / the number of tenants (more is refused as over its quota), so one tenant's "
        "entries never push another's out."))
    max_namespaces_per_tenant: int = field(default=256, metadata=_doc(
        "Most namespaces one tenant may register (every store without a tenants file counts as one "
        "tenant). Each is kept in memory and on disk and charged to the tenant's quota_bytes."))
    max_offers_per_tenant: int = field(default=32768, metadata=_doc(
        "Most offered-and-wanted items the store remembers per tenant until their put (pending_ttl_s), and "
        "apart from them, most admission decisions it keeps of puts refused whole over the tenant's quota "
        "for the offer that follows; beyond either the tenant's oldest are forgotten, and admission is "
        "asked again."))
    max_leases_per_tenant: int = field(default=8192, metadata=_doc(
        "Most lookup leases one tenant may hold at once; beyond it the tenant's oldest lease ends early."))
    model_metrics_per_tenant: int = field(default=16, metadata=_doc(
        "Most models per tenant whose lookups get their own series of "
        "prefixstore_model_lookup_tokens_total{tenant,model,kind,result} (per-model hit rates in /metrics, "
        "`prefixstore stats` and the dashboard): the first ones the tenant's lookups name; the lookups of any "
        "further model count under model=\"(other)\", so a tenant minting model names cannot multiply the "
        "series. 0: every model under (other)."))
    max_leased_share: float = field(default=0.25, metadata=_doc(
        "Most of the RAM arena one tenant's leases may pin at once, as a share of ram_bytes (0 < share <= 1), "
        "counting each leased entry's payload bytes whatever its tier. A lease past it ends the tenant's "
        "oldest leases first, and NIXL placements are handed out only within it (the rest is read over "
        "HTTP); a pinned entry is never evicted, so without it one tenant's leases could pin the whole arena "
        "and every other tenant's saves would be refused. Only with a tenants_file: an open store's clients "
        "are one tenant."))
    max_child_scan: int = field(default=1024, metadata=_doc(
        "Most stored children of one block a lookup compares token by token (most recent first)."))
    request_timeout_s: float = field(default=60.0, metadata=_doc(
        "Most seconds a client may take to send a request body, or to take a get's answer off the wire. "
        "A client that stalls longer is answered 408 (or disconnected mid-answer) and the arena pages its "
        "put reserved, or the entries its get pinned, are released at once; without it a stalled client "
        "holds them for as long as it keeps the connection open."))
    max_connections: int = field(default=1024, metadata=_doc(
        "Most client connections held open at once; a connection beyond it is closed at once, before "
        "anything is read from it, so a flood cannot exhaust file descriptors or memory."))
    header_timeout_s: float = field(default=10.0, metadata=_doc(
        "Most seconds a client may take to send a request's HTTP head (request line and headers); a "
        "client that dribbles it byte by byte (slowloris) is disconnected. Idle keep-alive connections "
        "are closed after the same time."))
    nixl: str = field(default="auto", metadata=_doc(
        "GPU-direct data path: 'auto' (serve NIXL READs/WRITEs of the arena when the nixl package imports, "
        "HTTP only otherwise), 'on' (refuse to start without nixl), 'off' (HTTP only)."))
    nixl_map_txns: int = field(default=64, metadata=_doc(
        "Most LMDB read transactions the NIXL path holds open to let clients READ LMDB-resident entries "
        "straight from LMDB's memory map (one per /v1/nixl/get that asks for disk entries, until its lease "
        "ends); beyond it disk entries are promoted into the RAM arena first. 0: always promote. At most 192 "
        "(LMDB's reader table has 256 slots)."))
    node_url: str = field(default="", metadata=_doc(
        "URL that clients and other nodes reach this node at; it is the node's identity in placement. "
        "Empty: http(s)://host:port of this process (a wildcard host is replaced by the host name)."))
    peers: str = field(default="", metadata=_doc(
        "Static cluster membership: comma-separated node URLs, this node included. Empty (and no "
        "peers_dns): a single-node store."))
    peers_dns: str = field(default="", metadata=_doc(
        "Membership from DNS, as HOST:PORT: HOST is a Kubernetes headless Service (one record per ready "
        "pod of the StatefulSet), re-resolved every membership_refresh_s; PORT is the nodes' HTTP port."))
    membership_refresh_s: float = field(default=10.0, metadata=_doc(
        "Seconds between refreshes of DNS membership (and of the member list served to clients)."))
    replication_threshold: float = field(default=20.0, metadata=_doc(
        "Decayed reads per second of one entry above which its owner pushes replicas to the next nodes in "
        "rendezvous order; the replica count grows with the rate (one more copy per threshold of reads/s)."))
    replication_max_replicas: int = field(default=3, metadata=_doc(
        "Most copies of a hot entry, the primary included (1: no replication)."))
    replication_half_life_s: float = field(default=30.0, metadata=_doc(
        "Half-life of the decayed read rate; a cooled entry loses replicas after about this long."))
    replication_bytes_per_s: int = field(default=256 << 20, metadata=_doc(
        "Most bytes per second one node pushes to replicas (token bucket); pushes beyond it wait.", "size"))
    owner_grace_s: float = field(default=300.0, metadata=_doc(
        "After a membership change, how long a miss on a key whose owner changed is retried on its "
        "previous owner, so a scale-out does not flush the cache."))
    replicas: int = field(default=1, metadata=_doc(
        "Copies of every branch a cluster stores (1: each on one node), on the first members in its "
        "rendezvous order: capacity traded for survival (a node lost costs nothing while a copy lives). "
        "Cluster clients learn it from /v1/members; hot-prefix replication adds copies on top."))
    log_level: str = field(default="INFO", metadata=_doc("Logging level of `prefixstore serve`."))
    log_format: str = field(default="text", metadata=_doc(
        "Format of `prefixstore serve`'s log lines on stderr: 'text' (one readable line each) or 'json' (one "
        "JSON object a line: ts, level, logger, message, and an access line's fields), for log collectors."))
    access_log: bool = field(default=False, metadata=_doc(
        "Log one line per HTTP request (logger prefixstore.access, level INFO): method, endpoint (the route, "
        "never a query string), tenant, status, bytes in and out, milliseconds. Never tokens, keys or "
        "payloads. Off by default: a busy node answers thousands of requests a second, and "
        "prefixstore_requests_total counts them by endpoint and status anyway."))
    slow_request_s: float = field(default=0.0, metadata=_doc(
        "Log (level WARNING, logger prefixstore.access, the access line's fields) every request that took "
        "longer than this many seconds, whether access_log is on or not: a slow-request log like Redis's "
        "SLOWLOG. 0: off."))
    tenants_file: str = field(default="", metadata=_doc(
        "TOML (or .json) file of tenants: [tenants.NAME] token_sha256 = sha256 hex of its bearer token, "
        "optional quota_bytes; optional top-level admin_token_sha256. Set: every /v1/* request needs "
        "'Authorization: Bearer TOKEN' (401 otherwise), a tenant reaches only namespaces whose tenant field "
        "is its name, and /v1/stats and /v1/admin/* need the admin token; /healthz and /metrics stay open "
        "(they carry no cache contents). Empty: open store, one trusted tenant."))
    cluster_token_file: str = field(default="", metadata=_doc(
        "File holding the bearer token this node presents to other nodes (replica pushes) when the cluster "
        "has tenants; its sha256 is the tenants file's cluster_token_sha256. Empty: pushes carry no token "
        "(fine on an open cluster; refused by nodes that have a tenants file)."))
    tls_cert_file: str = field(default="", metadata=_doc(
        "PEM certificate chain of the HTTP plane. Set together with tls_key_file: the store serves https only."))
    tls_key_file: str = field(default="", metadata=_doc("PEM private key matching tls_cert_file."))
    tls_client_ca_file: str = field(default="", metadata=_doc(
        "PEM CA bundle for mutual TLS: set, every client must present a certificate it signed."))

    def __post_init__(self) -> None:
        positive = ("ram_bytes", "page_bytes", "sighting_filter_bytes", "disk_bytes", "max_body_bytes", "max_header_bytes",
                    "max_items", "max_lookup_tokens", "max_get_bytes", "max_child_scan", "max_connections",
                    "max_namespaces_per_tenant", "max_offers_per_tenant", "max_leases_per_tenant", "max_entries",
                    "replication_max_replicas", "replication_bytes_per_s", "replicas", "write_behind_bytes",
                    "read_buffer_bytes")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)!r}")
        if self.model_metrics_per_tenant < 0:
            raise ConfigError(f"model_metrics_per_tenant: must be 0 or more, got {self.model_metrics_per_tenant!r}")
        if not 0 < self.max_leased_share <= 1:
            raise ConfigError(f"max_leased_share: must be a share of ram_bytes in (0, 1], got {self.max_leased_share!r}")
        if self.heap_keep_bytes < 0:
            raise ConfigError(f"heap_keep_bytes: must be 0 (off) or positive, got {self.heap_keep_bytes!r}")
        if self.ram_bytes < self.page_bytes:
            raise ConfigError(f"ram_bytes: {self.ram_bytes} is smaller than one page (page_bytes={self.page_bytes})")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port} is not a TCP port")
        if self.durability not in ("sync", "write-behind"):
            raise ConfigError(f"durability: {self.durability!r} is not one of 'sync', 'write-behind'")
        for name in ("write_behind_s", "lease_ttl_s", "pending_ttl_s", "request_timeout_s", "header_timeout_s",
                     "membership_refresh_s", "replication_half_life_s", "owner_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be positive seconds, got {getattr(self, name)!r}")
        # Policy names are checked against the registries here, at start-up.
        from prefixstore.admission import ADMISSION_POLICIES, EVICTION_POLICIES

        for knob in ("kv_admission", "state_admission"):
            if getattr(self, knob) not in ADMISSION_POLICIES:
                raise ConfigError(f"{knob}: unknown policy {getattr(self, knob)!r}; "
                                  f"choose one of {sorted(ADMISSION_POLICIES)}")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(f"eviction: unknown policy {self.eviction!r}; choose one of {sorted(EVICTION_POLICIES)}")
        if self.tenants_file:
            from .tenants import load_tenants

            load_tenants(self.tenants_file)  # fail at start-up, naming the knob
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_key_file: tls_cert_file and tls_key_file are set together or not at all")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("tls_client_ca_file: mutual TLS needs tls_cert_file and tls_key_file too")
        if self.cluster_token_file:
            self.cluster_token()  # unreadable or empty: fail at start-up, naming the knob
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            if getattr(self, name) and not os.path.isfile(getattr(self, name)):
                raise ConfigError(f"{name}: {getattr(self, name)!r} is not a readable file")
        if self.tls_cert_file:
            self.ssl_context()  # a certificate that does not load fails at start-up, naming the knob
        if self.nixl not in ("auto", "on", "off"):
            raise ConfigError(f"nixl: {self.nixl!r} is not one of 'auto', 'on', 'off'")
        if not 0 <= self.nixl_map_txns <= 192:
            raise ConfigError(f"nixl_map_txns: {self.nixl_map_txns!r} is not between 0 and 192")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format: {self.log_format!r} is not one of {', '.join(map(repr, LOG_FORMATS))}")
        if self.slow_request_s < 0:
            raise ConfigError(f"slow_request_s: must be 0 (off) or positive seconds, got {self.slow_request_s!r}")
        if self.replication_threshold <= 0:
            raise ConfigError(f"replication_threshold: must be positive reads per second, got {self.replication_threshold!r}")
        if self.peers and self.peers_dns:
            raise ConfigError("peers_dns: set peers (a static list) or peers_dns, not both")
        for url in self.peer_urls:
            if not re.match(r"^https?://[^/\s:]+(:\d+)?/?$", url):
                raise ConfigError(f"peers: {url!r} is not a node URL like http://10.0.0.7:8077")
        if self.node_url and not re.match(r"^https?://[^/\s:]+(:\d+)?/?$", self.node_url):
            raise ConfigError(f"node_url: {self.node_url!r} is not a URL like http://10.0.0.7:8077")
        if self.peers_dns and not re.match(r"^[A-Za-z0-9.-]+:\d+$", self.peers_dns):
            raise ConfigError(f"peers_dns: {self.peers_dns!r} is not HOST:PORT")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not a level; choose one of {list(LOG_LEVELS)}")

    @property
    def lmdb_path(self) -> Path | None:
        if self.data_dir.lower() == "none":
            return None
        return Path(self.data_dir) if self.data_dir else default_data_dir()

    def effective(self, name: str) -> object:
        """Knob ``name``'s value as the store uses it (``prefixstore config``, /v1/admin/config):
        data_dir resolved, as its empty default names the per-user directory; the others as set."""
        if name == "data_dir":
            return str(self.lmdb_path) if self.lmdb_path is not None else "none"
        return getattr(self, name)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server-side TLS context the tls_* knobs describe, or None (plain http)."""
        if not self.tls_cert_file:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(f"tls_cert_file: cannot load {self.tls_cert_file} with {self.tls_key_file}: {err}") from err
        if self.tls_client_ca_file:
            try:
                context.load_verify_locations(cafile=self.tls_client_ca_file)
            except (OSError, ssl.SSLError) as err:
                raise ConfigError(f"tls_client_ca_file: cannot load {self.tls_client_ca_file}: {err}") from err
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def cluster_token(self) -> str | None:
        """The token of cluster_token_file (its first line), or None when the knob is unset."""
        if not self.cluster_token_file:
            return None
        try:
            with open(self.cluster_token_file, encoding="utf-8") as fh:
                token = fh.readline().strip()
        except OSError as err:
            raise ConfigError(f"cluster_token_file: cannot read {self.cluster_token_file}: {err}") from err
        if not token or " " in token or not token.isprintable():
            raise ConfigError(f"cluster_token_file: {self.cluster_token_file} must hold one token (printable, no spaces)")
        return token

    @property
    def peer_urls(self) -> list[str]:
        """The static member list, normalised (no trailing slash, no blanks)."""
        return [u.strip().rstrip("/") for u in self.peers.split(",") if u.strip()]

    @property
    def num_pages(self) -> int:
        return self.ram_bytes // self.page_bytes

    @classmethod
    def knobs(cls) -> list[dataclasses.Field[Any]]:
        return list(fields(cls))

    @classmethod
    def from_sources(
        cls,
        overrides: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> StoreConfig:
        """Merge default < file < environment < overrides, converting and validating each value."""
        values: dict[str, object] = {}
        if config_file:
            try:
                with open(config_file, "rb") as fh:
                    raw = tomllib.load(fh)
            except (OSError, tomllib.TOMLDecodeError) as err:
                raise ConfigError(f"config file {config_file}: {err}") from err
            known = {knob.name for knob in fields(cls)}
            unknown = sorted(set(raw) - known)
            if unknown:
                raise ConfigError(f"config file {config_file}: unknown knob(s) {unknown}; known: {sorted(known)}")
            values.update(raw)
        env = os.environ if env is None else env
        for knob in fields(cls):
            key = ENV_PREFIX + knob.name.upper()
            if key in env:
                values[knob.name] = env[key]
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = value
        converted: dict[str, Any] = {name: _convert(cls, name, value) for name, value in values.items()}
        return cls(**converted)

    @classmethod
    def sources(
        cls,
        overrides: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> dict[str, str]:
        """Where :meth:`from_sources` takes each knob's value from, by the same precedence: 'flag',
        'env PREFIXSTORE_X', 'file PATH' or 'default' (``prefixstore config``, /v1/admin/config).
        An unreadable file is read as setting nothing: from_sources is the one that reports it."""
        in_file: set[str] = set()
        if config_file:
            try:
                with open(config_file, "rb") as fh:
                    in_file = set(tomllib.load(fh))
            except (OSError, tomllib.TOMLDecodeError):
                pass
        env = os.environ if env is None else env
        out: dict[str, str] = {}
        for knob in fields(cls):
            key = ENV_PREFIX + knob.name.upper()
            if (overrides or {}).get(knob.name) is not None:
                out[knob.name] = "flag"
            elif key in env:
                out[knob.name] = f"env {key}"
            elif knob.name in in_file:
                out[knob.name] = f"file {config_file}"
            else:
                out[knob.name] = "default"
        return out


def _convert(cls: type[StoreConfig], name: str, value: object) -> object:
    f = {f.name: f for f in fields(cls)}.get(name)
    if f is None:
        raise ConfigError(f"{name}: unknown knob")
    default = f.default
    try:
        if f.metadata.get("kind") == "size":
            return parse_size(value if isinstance(value, (int, str)) else str(value), name)
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{name}: {value!r} is not a boolean (true/false)")
        if isinstance(default, int):
            return int(str(value))
        if isinstance(default, float):
            return float(str(value))
        return str(value)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{name}: {value!r} is not a valid {type(default).__name__}") from err


__all__ = ["ENV_PREFIX", "LOG_FORMATS", "LOG_LEVELS", "ConfigError", "StoreConfig", "default_data_dir", "parse_size"]

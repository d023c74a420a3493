"""Tenants, their bearer tokens and byte quotas (DESIGN §11).

The tenants file (``StoreConfig.tenants_file``) is TOML, or JSON when its name
ends in ``.json``::

    admin_token_sha256 = "<64 hex digits>"      # optional: /v1/stats, /v1/admin/*
    cluster_token_sha256 = "<64 hex digits>"    # optional: node-to-node replica pushes

    [tenants.team-a]
    token_sha256 = "<64 hex digits>"            # sha256(token).hexdigest()
    quota_bytes = "8GiB"                        # optional: payload bytes it may hold

Only SHA-256 digests of tokens are stored, so the file (or a Helm secret
holding it) does not hand out usable tokens. A presented token is hashed and
compared with ``hmac.compare_digest`` against every tenant's digest, never
stopping early, so neither the comparison nor the scan leaks which prefix or
which tenant came close. Tokens are random secrets of at least 128 bits, so
an unsalted hash is enough (no password stretching needed).

The cluster token is what nodes present to each other (``cluster_token_file``
holds it in plain text on every node): it may register any tenant's namespace
and push replicas into it (``/v1/namespaces``, ``/v1/put``,
``/v1/replica/drop``), and nothing else -- no lookups, no reads.

Without a tenants file the store is open: no token is asked for and every
namespace is served whatever its ``tenant`` field says (one trusted tenant).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .knobs import ConfigError, parse_size

KNOB = "tenants_file"
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Tenant:
    name: str
    token_sha256: bytes
    quota_bytes: int | None = None  # None: no quota


@dataclass(frozen=True, kw_only=True)
class Tenants:
    tenants: tuple[Tenant, ...]
    admin_token_sha256: bytes | None = None
    cluster_token_sha256: bytes | None = None

    def authenticate(self, token: str) -> Tenant | None:
        """The tenant whose token this is, or None. Constant time in the token's content."""
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: Tenant | None = None
        for t in self.tenants:  # no early exit: the scan takes as long for every token
            if hmac.compare_digest(digest, t.token_sha256):
                found = t
        return found

    def is_admin(self, token: str) -> bool:
        if self.admin_token_sha256 is None:
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(digest, self.admin_token_sha256)

    def is_peer(self, token: str) -> bool:
        """True for the cluster token (a node pushing replicas)."""
        if self.cluster_token_sha256 is None:
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(digest, self.cluster_token_sha256)

    def has(self, name: str) -> bool:
        """Whether the tenants file lists a tenant of this name."""
        return any(t.name == name for t in self.tenants)

    def quota_of(self, name: str) -> int | None:
        for t in self.tenants:
            if t.name == name:
                return t.quota_bytes
        return None


def token_sha256(token: str) -> str:
    """The hex digest to write into a tenants file for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _digest(value: object, where: str) -> bytes:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ConfigError(f"{KNOB}: {where} must be 64 hex digits (sha256 of the token), got {value!r}")
    return bytes.fromhex(value)


def load_tenants(path: str | Path) -> Tenants:
    """Parse and validate a tenants file; every error names ``tenants_file`` and the entry."""
    try:
        with open(path, "rb") as fh:
            raw_bytes = fh.read()
        raw = json.loads(raw_bytes) if str(path).endswith(".json") else tomllib.loads(raw_bytes.decode("utf-8"))
    except (OSError, ValueError) as err:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{KNOB}: cannot read {path}: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{KNOB}: {path} must hold a table")
    unknown = sorted(set(raw) - {"tenants", "admin_token_sha256", "cluster_token_sha256"})
    if unknown:
        raise ConfigError(f"{KNOB}: {path}: unknown key(s) {unknown}; "
                          "known: ['admin_token_sha256', 'cluster_token_sha256', 'tenants']")
    table = raw.get("tenants")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{KNOB}: {path} must list at least one tenant under [tenants.NAME]")
    tenants: list[Tenant] = []
    for name, spec in table.items():
        where = f"tenants.{name}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{KNOB}: {where} must be a table")
        extra = sorted(set(spec) - {"token_sha256", "quota_bytes"})
        if extra:
            raise ConfigError(f"{KNOB}: {where}: unknown key(s) {extra}; known: ['quota_bytes', 'token_sha256']")
        quota = None
        if "quota_bytes" in spec:
            quota = parse_size(spec["quota_bytes"], f"{KNOB}: {where}.quota_bytes")
            if quota < 0:
                raise ConfigError(f"{KNOB}: {where}.quota_bytes must not be negative")
        tenants.append(Tenant(name=str(name), token_sha256=_digest(spec.get("token_sha256"), f"{where}.token_sha256"),
                              quota_bytes=quota))
    digests = [t.token_sha256 for t in tenants]
    admin = _digest(raw["admin_token_sha256"], "admin_token_sha256") if "admin_token_sha256" in raw else None
    peer = _digest(raw["cluster_token_sha256"], "cluster_token_sha256") if "cluster_token_sha256" in raw else None
    special = [d for d in (admin, peer) if d is not None]
    if len(set(digests + special)) != len(digests) + len(special):
        raise ConfigError(f"{KNOB}: {path}: two tenants (or a tenant, the admin and the cluster) share a token")
    return Tenants(tenants=tuple(tenants), admin_token_sha256=admin, cluster_token_sha256=peer)

"""``--hicache-storage-backend-extra-config`` -> the backend's settings and the client's one config.

SGLang hands a dynamic storage backend the extra-config JSON (less the keys
SGLang's cache controller consumes itself: ``prefetch_threshold``,
``prefetch_timeout_*``, ``hicache_storage_pass_prefix_keys``, ``tp_lcm_size``).
It is validated once, when SGLang builds the backend: every key is SGLang's own
loader key (``LOADER_KEYS``), a :class:`~prefixstore.client.config.ClientConfig`
field (store address, tenant token, TLS files, data path, timeouts), or one of
the backend's own keys below. An unknown key or a bad value raises
``ValueError`` naming it; SGLang then refuses to start with that message.

Imports nothing of SGLang or torch: the mapping is testable without either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import ClientConfig

LOADER_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys SGLang's dynamic backend loader reads and leaves in the dict it hands the backend."""


@dataclass(frozen=True, kw_only=True)
class BackendSettings:
    """What the backend itself needs beside the client config."""

    client: ClientConfig
    """Where the store is and how to talk to it (every ClientConfig field may appear in the JSON)."""
    model_id: str = ""
    """Name the namespace gives the model; empty: SGLang's served model name (``--served-model-name``,
    else the model path). SGLang instances share cache only if their namespaces are equal."""
    tenant: str = "default"
    """Tenant named in the namespace (must match the token's tenant on a store with tenants)."""
    revision: str = ""
    """Model revision recorded in the namespace (weights that differ under one name must differ here)."""
    max_pending_states: int = 64
    """Hybrid models: Mamba states SGLang hands over before the KV pages they end (its backup writes
    side pools first) wait here, copied, until those pages are saved; beyond this many the oldest is
    dropped (a future miss)."""

    def __post_init__(self) -> None:
        for name in ("model_id", "tenant", "revision"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")
        value = self.max_pending_states
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"max_pending_states: must be a non-negative integer, got {value!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> BackendSettings:
        """Split ``extra`` between the client config and the backend's own keys."""
        extra = dict(extra or {})
        if extra.get("interface_v1") not in (1, True, "1"):
            raise ValueError("interface_v1: set \"interface_v1\": 1 in --hicache-storage-backend-extra-config "
                             "(the backend reads and writes host pages in place; SGLang's copying "
                             "batch_get/batch_set path is not implemented)")
        own = {f.name for f in dataclasses.fields(cls)} - {"client"}
        client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
        client_kwargs: dict[str, object] = {}
        own_kwargs: dict[str, object] = {}
        for key, value in extra.items():
            if key in LOADER_KEYS:
                continue
            if key in own:
                own_kwargs[key] = value
            elif key in client_fields:
                client_kwargs[key] = tuple(value) if key == "urls" and isinstance(value, list) else value
            else:
                raise ValueError(f"hicache-storage-backend-extra-config: unknown key {key!r}; choose from "
                                 f"{sorted(own | client_fields | LOADER_KEYS)}")
        try:
            client = ClientConfig(**client_kwargs)  # type: ignore[arg-type]
        except TypeError as err:  # a value of the wrong type for a field
            raise ValueError(f"hicache-storage-backend-extra-config: {err}") from err
        return cls(client=client, **own_kwargs)  # type: ignore[arg-type]


__all__ = ["LOADER_KEYS", "BackendSettings"]

"""LMCache's ``extra_config`` -> the connector's settings and the client's one config.

LMCache names a remote plugin's own keys ``remote_storage_plugin.<plugin>.<key>``
in its ``extra_config`` (it reads ``module_path`` and ``class_name`` from there
itself). Every other ``<key>`` under this plugin's prefix is validated here
when LMCache creates the connector: a
:class:`~prefixstore.client.config.ClientConfig` field (store address, tenant
token, TLS files, data path, timeouts) or one of the connector's own keys. An
unknown key or a bad value raises ``ValueError`` naming it.

Imports nothing of LMCache or torch: the mapping is testable without either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import ClientConfig

LOADER_KEYS = frozenset({"module_path", "class_name"})
"""Keys LMCache's plugin loader reads itself."""


def plugin_prefix(plugin_name: str) -> str:
    return f"remote_storage_plugin.{plugin_name}."


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """What the connector itself needs beside the client config."""

    client: ClientConfig
    """Where the store is and how to talk to it."""
    model_id: str = ""
    """Name the namespace gives the model; empty: LMCache's model name (its metadata)."""
    tenant: str = "default"
    """Tenant named in the namespace (must match the token's tenant on a store with tenants)."""
    revision: str = ""
    """Model revision recorded in the namespace."""

    def __post_init__(self) -> None:
        for name in ("model_id", "tenant", "revision"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None, plugin_name: str) -> ConnectorSettings:
        """The keys under ``remote_storage_plugin.<plugin_name>.``, split between client and connector."""
        prefix = plugin_prefix(plugin_name)
        own = {f.name for f in dataclasses.fields(cls)} - {"client"}
        client_fields = {f.name for f in dataclasses.fields(ClientConfig)}
        client_kwargs: dict[str, object] = {}
        own_kwargs: dict[str, object] = {}
        for full_key, value in (extra or {}).items():
            if not full_key.startswith(prefix):
                continue
            key = full_key[len(prefix):]
            if key in LOADER_KEYS:
                continue
            if key in own:
                own_kwargs[key] = value
            elif key in client_fields:
                client_kwargs[key] = tuple(value) if key == "urls" and isinstance(value, list) else value
            else:
                raise ValueError(f"extra_config: unknown key {full_key!r}; choose from "
                                 f"{sorted(prefix + k for k in own | client_fields | LOADER_KEYS)}")
        try:
            client = ClientConfig(**client_kwargs)  # type: ignore[arg-type]
        except TypeError as err:
            raise ValueError(f"extra_config ({prefix}*): {err}") from err
        return cls(client=client, **own_kwargs)  # type: ignore[arg-type]


__all__ = ["LOADER_KEYS", "ConnectorSettings", "plugin_prefix"]

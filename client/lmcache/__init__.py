"""LMCache remote storage plugin: LMCache uses prefixstore as its remote tier (docs/lmcache.md).

``connector.py`` imports LMCache and torch and is imported only by LMCache
itself (``remote_storage_plugin.<name>.module_path``); ``settings.py`` and
``keys.py`` import neither, so ``import prefixstore.client.lmcache`` works
without LMCache.
"""

from .keys import KEYSPACE, chunk_prompt
from .settings import LOADER_KEYS, ConnectorSettings, plugin_prefix

ADAPTER_MODULE = "prefixstore.client.lmcache.connector"
ADAPTER_CLASS = "PrefixStoreConnectorAdapter"

__all__ = ["ADAPTER_CLASS", "ADAPTER_MODULE", "KEYSPACE", "LOADER_KEYS", "ConnectorSettings", "chunk_prompt",
           "plugin_prefix"]

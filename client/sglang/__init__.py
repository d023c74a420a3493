"""SGLang HiCache storage backend: SGLang uses prefixstore as its L3 tier (docs/sglang.md).

``backend.py`` imports SGLang and torch and is imported only by SGLang itself
(``module_path`` in ``--hicache-storage-backend-extra-config``); ``settings.py``
(the extra-config mapping) and ``keys.py`` (page keys -> the store's chain)
import neither, so ``import prefixstore.client.sglang`` works without SGLang.
"""

from .keys import KEYSPACE, page_prompt
from .settings import LOADER_KEYS, BackendSettings

BACKEND_MODULE = "prefixstore.client.sglang.backend"
BACKEND_CLASS = "PrefixStoreHiCache"

__all__ = ["BACKEND_CLASS", "BACKEND_MODULE", "KEYSPACE", "LOADER_KEYS", "BackendSettings", "page_prompt"]

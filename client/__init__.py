"""What engines embed: hashing, lookup, reads into caller buffers, offers and saves.

Imports protocol (and admission for retention planning). Never imports store,
lmdb or aiohttp.web.
"""

from .client import PrefixClient
from .config import ClientConfig
from .prompt import Prompt
from .results import LookupResult, SaveResult
from .sync import SyncPrefixClient

__all__ = ["ClientConfig", "LookupResult", "PrefixClient", "Prompt", "SaveResult", "SyncPrefixClient"]

"""What engines embed: hashing, lookup, reads into caller buffers, offers and saves.

Imports protocol (and admission for retention planning: the engine decides which
boundaries to snapshot, and reaches the planner through here). Never imports store,
lmdb or aiohttp.web.
"""

from prefixstore.admission.retention import RetentionPlanner
from .client import PrefixClient
from .config import ClientConfig
from .prompt import Prompt
from .results import LookupResult, SaveResult
from .sync import SyncPrefixClient

__all__ = ["ClientConfig", "LookupResult", "PrefixClient", "Prompt", "RetentionPlanner", "SaveResult",
           "SyncPrefixClient"]

"""The store service: index, RAM arena, LMDB tier, leases, metrics, HTTP plane."""

from .config import StoreConfig
from .core import Store
from .runner import StoreRunner
from .server import STORE, create_app

__all__ = ["STORE", "Store", "StoreConfig", "StoreRunner", "create_app"]

"""Engine side of the data path: paged KV, staging buffers, layer-wise load, the reference engine and model.

Imports client, protocol, admission (the retention planner) and torch. The
store and the client never import this package, so neither needs torch;
without torch, importing it says how to install it instead of a bare
ImportError deep in a traceback.
"""

try:
    import torch  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised only on machines without torch
    raise ImportError("prefixstore.gpu_staging needs torch; its CPU build is enough (PyPI's default build pulls "
                      "gigabytes of CUDA libraries): pip install torch==2.13.0 "
                      "--index-url https://download.pytorch.org/whl/cpu") from err

from .engine import REUSE_MODES, Engine, EngineConfig, RequestResult, ReuseMode, ReusePlan, SaveStats, recompute_logits
from .loader import LayerwiseLoad, LoadFailed
from .paged_kv import CacheFull, PagedKVCache, SequenceKV, Span
from .reference_model import HybridModel, ModelConfig, RecurrentState
from .staging import Slot, StagingBuffer, StagingFull

__all__ = [
    "REUSE_MODES", "CacheFull", "Engine", "EngineConfig", "HybridModel", "LayerwiseLoad", "LoadFailed",
    "ModelConfig", "PagedKVCache", "RecurrentState", "RequestResult", "ReuseMode", "ReusePlan", "SaveStats",
    "SequenceKV", "Slot", "Span", "StagingBuffer", "StagingFull", "recompute_logits",
]

"""Pure policy: retention planning, admission, eviction priority, cost model.

Imports protocol only. No I/O, no clocks (time is passed in)."""

from .admission import Adaptive, AlwaysAdmit, SecondHit
from .eviction import LRU, EntryView, FlopAware, PolicyContext, flops_saved
from .model_shape import MODEL_PRESETS, ModelShape, get_model
from .policy import (
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    AdmissionPolicy,
    EvictionPolicy,
    make_admission,
    make_eviction,
)
from .retention import INTERVAL_GRANULE, IntervalChoice, IntervalTuner, RetentionPlanner, crossover_tokens, optimal_interval
from .sighting import SightingFilter

__all__ = [
    "ADMISSION_POLICIES", "EVICTION_POLICIES", "INTERVAL_GRANULE", "IntervalChoice", "IntervalTuner", "LRU", "MODEL_PRESETS", "Adaptive", "AdmissionPolicy",
    "AlwaysAdmit", "EntryView", "EvictionPolicy", "FlopAware", "ModelShape", "PolicyContext",
    "RetentionPlanner", "SecondHit", "SightingFilter", "crossover_tokens", "flops_saved", "get_model",
    "make_admission", "make_eviction", "optimal_interval",
]

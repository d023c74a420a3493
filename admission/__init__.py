"""Pure policy: retention planning, admission, eviction priority, cost model."""

from .policy import (
    ADMISSION_POLICIES,
    EVICTION_POLICIES,
    LRU,
    AdmissionPolicy,
    AlwaysAdmit,
    EntryView,
    EvictionPolicy,
    make_admission,
    make_eviction,
)

__all__ = [
    "ADMISSION_POLICIES", "EVICTION_POLICIES", "LRU", "AdmissionPolicy", "AlwaysAdmit",
    "EntryView", "EvictionPolicy", "make_admission", "make_eviction",
]

"""The namespaces a store knows: their records, chain roots and model shapes.

A namespace is tenant-supplied input kept for good (in memory and in LMDB) and consulted on
every request, so each registration is bounded (protocol/namespace.py bounds every field; here:
what this store can hold of it, at most ``max_namespaces_per_tenant`` per owner, and its record
charged to the tenant's quota, store/ledger.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from prefixstore.admission import MODEL_PRESETS, ModelShape
from prefixstore.protocol.errors import Problem
from prefixstore.protocol.hashing import BlockHash, root_hash
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import WireError
from .config import StoreConfig
from .index import node_key
from .ledger import TenantLedger, namespace_charge
from .validate import check_namespace


def unknown(ns_id: bytes) -> WireError:
    """The one answer to a namespace this caller cannot see (unregistered, or another tenant's)."""
    return WireError("ns", f"unknown namespace {ns_id.hex()}; register it with POST /v1/namespaces", Problem.UNKNOWN)


class Namespaces:
    def __init__(self, config: StoreConfig, ledger: TenantLedger) -> None:
        self._config = config
        self._ledger = ledger
        self._by_id: dict[bytes, Namespace] = {}
        self._roots: dict[bytes, BlockHash] = {}  # namespace id -> h_0
        self._shapes: dict[bytes, ModelShape | None] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Namespace]:
        return iter(list(self._by_id.values()))

    def __contains__(self, ns_id: bytes) -> bool:
        return ns_id in self._by_id

    def get(self, ns_id: bytes) -> Namespace:
        """The namespace; raises the unknown-namespace error (404) when it is not registered."""
        ns = self._by_id.get(ns_id)
        if ns is None:
            raise unknown(ns_id)
        return ns

    def find(self, ns_id: bytes) -> Namespace | None:
        return self._by_id.get(ns_id)

    def root(self, ns_id: bytes) -> BlockHash | None:
        return self._roots.get(ns_id)

    def root_nodes(self) -> set[bytes]:
        """The index's ``children`` key of every namespace's root."""
        return {node_key(ns_id, h) for ns_id, h in self._roots.items()}

    def shape_of(self, ns_id: bytes) -> ModelShape | None:
        """The model shape FLOP-aware eviction ranks by: a preset named by the namespace's model,
        else one derived from its layouts."""
        if ns_id not in self._shapes:
            ns = self._by_id.get(ns_id)
            if ns is None:
                return None  # not cached: a namespace registered later has its shape
            shape = MODEL_PRESETS.get(ns.model) or ModelShape(
                name=ns.model, hidden_size=max(1, ns.kv.num_heads * ns.kv.head_dim),
                num_attention_layers=ns.kv.num_layers, num_linear_layers=ns.state.num_layers,
                num_kv_heads=ns.kv.num_heads, head_dim=ns.kv.head_dim, kv_components=ns.kv.num_components,
                kv_dtype=ns.kv.dtype, state_bytes_per_layer=ns.state.layer_bytes,
                linear_flops_per_token=8 * max(1, ns.kv.num_heads * ns.kv.head_dim) ** 2)
            self._shapes[ns_id] = shape
        return self._shapes[ns_id]

    def admit(self, ns: Namespace) -> None:
        """Refuse a new namespace this store must not take (raises WireError naming why)."""
        check_namespace(ns, self._config.max_body_bytes)
        owner = self._ledger.owner_of(ns)
        held = self._ledger.namespaces_of(owner)
        if held >= self._config.max_namespaces_per_tenant:
            raise WireError("namespace", f"tenant {owner!r} already has {held} namespaces, "
                            f"max_namespaces_per_tenant={self._config.max_namespaces_per_tenant}", Problem.FORBIDDEN)
        charge = namespace_charge(ns)
        if self._ledger.over_quota(ns, charge):
            raise WireError("quota", f"tenant {ns.tenant!r} would exceed its quota of {self._ledger.quota_of(ns)} "
                            f"bytes with this namespace's record ({charge} bytes)", Problem.QUOTA)

    def add(self, ns: Namespace) -> None:
        self._by_id[ns.id] = ns
        self._roots[ns.id] = root_hash(ns)
        self._ledger.add_namespace(ns)

    def remove(self, ns: Namespace) -> None:
        del self._by_id[ns.id]
        del self._roots[ns.id]
        self._shapes.pop(ns.id, None)
        self._ledger.remove_namespace(ns)


__all__ = ["Namespaces", "unknown"]

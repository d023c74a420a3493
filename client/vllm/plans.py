"""What the connector's two roles share: which cache groups it moves, the namespace both key
entries under, and the plans the scheduler side hands the worker side each step
(``PrefixStoreMetadata``, vLLM's ``KVConnectorMetadata``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from prefixstore.protocol.namespace import KVLayout, Namespace, StateLayout
from ..results import LookupResult
from .layout import DTYPE_NAMES, LayoutUnsupported
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True, kw_only=True)
class CacheGroups:
    """Which KV cache groups the connector moves: attention groups (KV) and Mamba groups (state)."""

    attention: tuple[tuple[int, tuple[str, ...], int], ...]
    """(group id, layer names, block size) of every full-attention group."""
    mamba: tuple[tuple[int, tuple[str, ...], int], ...] = ()
    """(group id, layer names, block size) of every Mamba group."""
    kv: KVLayout
    state: StateLayout

    @property
    def hybrid(self) -> bool:
        return bool(self.mamba)

    @property
    def max_block_tokens(self) -> int:
        """The largest of vLLM's block sizes over the groups moved (its prefix cache's grain)."""
        return max(bs for _, _, bs in (*self.attention, *self.mamba))

    @property
    def state_block_tokens(self) -> int:
        """The Mamba groups' block size in vLLM (the grid its own prefix cache keeps states on)."""
        return self.mamba[0][2] if self.mamba else 0

    def state_index(self, t: int) -> int:
        """Position, in a request's Mamba block table, of the block that holds the state after
        ``t`` tokens while ``t`` is the request's computed length: vLLM's ``mamba_cache_mode="align"``
        keeps the running state in block ``cdiv(t, block_size) - 1`` (v1/worker/mamba_utils.py
        ``preprocess_mamba``: a new request's initial state is read from
        ``(num_computed_tokens - 1) // block_size``), on the grid (``t / block_size - 1``) or not."""
        return (t - 1) // self.state_block_tokens

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CacheGroups:
        """Raises LayoutUnsupported for caches this connector does not move (it then stays idle)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

        attention: list[tuple[int, tuple[str, ...], int]] = []
        mamba: list[tuple[int, tuple[str, ...], int]] = []
        att_spec: Any = None
        state_bytes: set[int] = set()
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            names = tuple(group.layer_names)
            if isinstance(spec, MambaSpec):
                mamba.append((gid, names, spec.block_size))
                state_bytes.add(spec.num_heads * spec.get_num_kernel_states(spec.block_size)
                                * spec.state_content_size_bytes)
            elif (isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec)
                  and getattr(spec, "sliding_window", None) is None and spec.head_size == spec.head_size_v):
                if att_spec is not None and (spec.num_kv_heads, spec.head_size, spec.dtype) != (
                        att_spec.num_kv_heads, att_spec.head_size, att_spec.dtype):
                    raise LayoutUnsupported("attention groups of different head shapes or dtypes")
                att_spec = spec
                attention.append((gid, names, spec.block_size))
            else:
                raise LayoutUnsupported(f"KV cache group {gid} holds {type(spec).__name__} "
                                        "(only full attention and Mamba state are moved)")
        if att_spec is None:
            raise LayoutUnsupported("no full-attention layer")
        if att_spec.dtype not in DTYPE_NAMES:
            raise LayoutUnsupported(f"KV dtype {att_spec.dtype}")
        if mamba:
            if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "align":
                raise LayoutUnsupported("a hybrid model's state is moved only with mamba_cache_mode='align' "
                                        "(vLLM keeps no per-block state otherwise)")
            if len(state_bytes) != 1 or len({bs for _, _, bs in mamba}) != 1:
                raise LayoutUnsupported("Mamba groups of different state sizes or block sizes")
        num_state_layers = sum(len(names) for _, names, _ in mamba)
        return cls(
            attention=tuple(attention), mamba=tuple(mamba),
            kv=KVLayout(num_layers=sum(len(names) for _, names, _ in attention), num_heads=att_spec.num_kv_heads,
                        head_dim=att_spec.head_size, dtype=DTYPE_NAMES[att_spec.dtype]),
            state=StateLayout(num_layers=num_state_layers, shapes=((state_bytes.pop(),),), dtype="uint8")
            if mamba else StateLayout())


def namespace_for(vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings,
                  tp_rank: int) -> Namespace:
    """The namespace both roles key entries under (they must build the same one)."""
    import vllm

    model = vllm_config.model_config
    name = settings.model_id or (str(model.model) if model is not None else "")
    if not name:
        raise ValueError("model_id: vLLM names no model here; set model_id in kv_connector_extra_config")
    revision = str(getattr(model, "revision", None) or "")
    if groups.hybrid:
        # Snapshot bytes are vLLM's own state blocks: their meaning changes with vLLM's kernels.
        revision += f"|state:vllm-{vllm.__version__}"
    return Namespace(model=name, revision=revision, kv=groups.kv,
                     state=groups.state, tp_rank=tp_rank, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                     block_tokens=settings.block_tokens, tenant=settings.tenant)


# ---------------------------------------------------------------- plans (scheduler -> worker)


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    req_id: str
    lookup: LookupResult
    start: int
    """First token to write (the engine's local hit ends here)."""
    end: int
    block_ids: tuple[list[int], ...]
    state_index: int | None = None
    """Position of the Mamba block the snapshot at ``end`` goes to (hybrid only)."""
    is_async: bool = False


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    req_id: str
    save_id: str
    """Names this save in the worker's report that it is done (``PrefixStoreWorkerMeta``)."""
    tokens: list[int]
    """The tokens whose KV the request computed."""
    start: int
    """Store-block-aligned start: the blocks before it came from the store."""
    block_ids: tuple[list[int], ...]
    snapshots: tuple[int, ...] = ()
    """Boundaries of the snapshots to save, each from the Mamba block at
    ``CacheGroups.state_index(t)``: the running state (t = the request's computed length when the
    worker reads the blocks) or a state vLLM keeps on its grid (t a multiple of its block size)."""
    origins: dict[int, int] = field(default_factory=dict)
    """Why each snapshot was taken (boundary -> protocol.keys.Origin), offered with it: the store's
    adaptive admission learns per origin which snapshots get reused (in multi-turn chat the
    generation end is, the prompt end seldom) and stops admitting a dead origin at first sight."""
    extra_keys: list[bytes] = field(default_factory=list)
    hold: bool = False
    """The request finished and vLLM keeps its blocks until the worker reports it (get_finished);
    a prompt-end save runs in the step that computed the prompt, while the request still owns them."""


@dataclass
class PrefixStoreMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    idle: bool = False
    """The step computes no token: the engine only waits (for transfers, for new requests). The
    worker then waits for its loads and saves in flight rather than let the loop spin against
    them (ConnectorSettings.idle_wait_s)."""
    num_reqs: int = 0
    """Requests the step computes tokens for."""
    num_tokens: int = 0
    """Tokens the step computes (equal to ``num_reqs``: every request decodes one token)."""


@dataclass
class PrefixStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: the saves whose offer and put have ended (stored, refused or
    dropped), with how many workers (tensor-parallel ranks) report each. The scheduler holds back a
    lookup that a save in flight would lengthen until every rank's save of it has ended."""

    saves_done: dict[str, int] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    """Why workers refuse to move anything (PrefixStoreWorker.refused), one entry per such worker:
    the scheduler then stops planning loads and saves."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PrefixStoreWorkerMeta)
        for save_id, n in other.saves_done.items():
            self.saves_done[save_id] = self.saves_done.get(save_id, 0) + n
        self.refused.extend(other.refused)
        return self


__all__ = ["CacheGroups", "LoadPlan", "PrefixStoreMetadata", "PrefixStoreWorkerMeta", "SavePlan", "namespace_for"]

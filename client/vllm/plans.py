"""What the connector's two roles share: which cache groups it moves, the namespace both key
entries under, and the plans the scheduler side hands the worker side each step
(``PrefixStoreMetadata``, vLLM's ``KVConnectorMetadata``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from prefixstore.protocol.namespace import KVLayout, Namespace, StateLayout
from ..client import PrefixClient
from ..heads import HeadGroup, StateShards, StateTensor, gated_delta_net_shards, kv_heads, uniform_shards
from ..pagekeys import KEYSPACE, SALT_PREFIX, keyed_prompt
from ..prompt import Prompt
from ..results import LookupResult
from .costs import CostFigures
from .layout import DTYPE_NAMES, LayoutUnsupported
from .settings import ConnectorSettings, KeySpace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True, kw_only=True)
class CacheGroups:
    """Which KV cache groups the connector moves: attention groups (KV) and Mamba groups (state),
    and the canonical layout they go to the store in (client/heads.py): all of the model's KV
    heads, and its state by head units, whatever this engine's tensor-parallel size."""

    attention: tuple[tuple[int, tuple[str, ...], int], ...]
    """(group id, layer names, block size) of every full-attention group."""
    mamba: tuple[tuple[int, tuple[str, ...], int], ...] = ()
    """(group id, layer names, block size) of every Mamba group."""
    kv: KVLayout
    """Canonical: ``num_heads`` is the model's KV head count."""
    state: StateLayout
    tp_size: int = 1
    state_shards: StateShards | None = None
    """How one Mamba layer's state splits over ranks; None: an opaque state (TP=1 only)."""
    state_tensors: tuple[tuple[tuple[int, ...], str, bool], ...] = ()
    """One rank's state tensors of a Mamba layer as vLLM packs them in a block: (shape, dtype,
    transposed), ``transposed`` for a conv state vLLM keeps as (window, channels) (its SD layout)."""

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
        mamba_specs: list[Any] = []
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            names = tuple(group.layer_names)
            if isinstance(spec, MambaSpec):
                mamba.append((gid, names, spec.block_size))
                mamba_specs.append(spec)
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
        tp = vllm_config.parallel_config.tensor_parallel_size
        model = vllm_config.model_config
        total_heads = model.get_total_num_kv_heads() if model is not None else att_spec.num_kv_heads * tp
        try:
            kv_heads(0, tp, total_heads)
        except ValueError as err:
            raise LayoutUnsupported(f"KV heads: {err}") from None
        if att_spec.num_kv_heads != max(1, total_heads // tp):
            raise LayoutUnsupported(f"{att_spec.num_kv_heads} KV heads per rank, not {total_heads} over {tp} ranks")
        kv = KVLayout(num_layers=sum(len(names) for _, names, _ in attention), num_heads=total_heads,
                      head_dim=att_spec.head_size, dtype=DTYPE_NAMES[att_spec.dtype])
        if not mamba:
            return cls(attention=tuple(attention), kv=kv, state=StateLayout(), tp_size=tp)
        if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "align":
            raise LayoutUnsupported("a hybrid model's state is moved only with mamba_cache_mode='align' "
                                    "(vLLM keeps no per-block state otherwise)")
        first = mamba_specs[0]
        if any((s.shapes, s.dtypes, s.mamba_type) != (first.shapes, first.dtypes, first.mamba_type)
               for s in mamba_specs) or len({bs for _, _, bs in mamba}) != 1:
            raise LayoutUnsupported("Mamba groups of different state shapes or block sizes")
        if any(dt not in DTYPE_NAMES for dt in first.dtypes):
            raise LayoutUnsupported(f"Mamba state dtypes {first.dtypes}")
        num_state_layers = sum(len(names) for _, names, _ in mamba)
        shards, transposed = state_shards_of(first, model.hf_text_config if model is not None else None, tp)
        tensors = tuple((tuple(shape), DTYPE_NAMES[dt], tr) for shape, dt, tr in zip(first.shapes, first.dtypes,
                                                                                     transposed))
        if shards is None:
            if tp > 1:
                raise LayoutUnsupported(f"the state of {first.mamba_type} layers is not known to split by heads, "
                                        f"so it cannot be moved at tensor-parallel size {tp}")
            state_bytes = first.state_content_size_bytes
            state = StateLayout(num_layers=num_state_layers, shapes=((state_bytes,),), dtype="uint8")
        else:
            state = shards.layout(num_state_layers)
        return cls(attention=tuple(attention), mamba=tuple(mamba), kv=kv, state=state, tp_size=tp,
                   state_shards=shards, state_tensors=tensors)


def state_shards_of(spec: Any, hf_config: Any, tp_size: int) -> tuple[StateShards | None, tuple[bool, ...]]:
    """How a vLLM Mamba layer's state splits over ranks (client/heads.py), from its spec (one rank's
    shapes and dtypes, its mamba type) and the model's config; None for a state this connector does
    not know to split (it is then moved as opaque bytes, at TP=1 only). Also, per tensor, whether
    vLLM keeps it transposed (a conv state in its SD layout: window x channels)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    shapes = [tuple(s) for s in spec.shapes]
    dtypes = [DTYPE_NAMES.get(dt, "") for dt in spec.dtypes]
    kind = spec.mamba_type
    transposed = [False] * len(shapes)
    if getattr(spec, "tp_replicated", False) or getattr(spec, "num_speculative_blocks", 0):
        return None, tuple(transposed)
    conv_first = is_conv_state_dim_first()
    # Which tensor is a (channels, window) conv state vLLM may keep transposed.
    conv_index = {Kind.SHORT_CONV: 0, Kind.MAMBA1: 0, Kind.MAMBA2: 0, Kind.GDN_ATTN: 0}.get(kind)
    canonical = list(shapes)
    if conv_index is not None and not conv_first and len(shapes[conv_index]) == 2:
        transposed[conv_index] = True
        canonical[conv_index] = shapes[conv_index][::-1]

    def total(rows: int) -> int:
        return rows * tp_size

    try:
        if kind == Kind.SHORT_CONV and len(canonical) == 1:
            (c, w), = canonical
            return uniform_shards(total(c), [((total(c), w), dtypes[0])]), tuple(transposed)
        if kind == Kind.MAMBA1 and len(canonical) == 2:
            (c, w), (i, n) = canonical
            units = total(i)
            return uniform_shards(units, [((total(c), w), dtypes[0]), ((units, n), dtypes[1])]), tuple(transposed)
        if kind == Kind.LINEAR and len(canonical) == 1 and len(canonical[0]) == 3:
            (h, d1, d2), = canonical
            return uniform_shards(total(h), [((total(h), d1, d2), dtypes[0])]), tuple(transposed)
        if kind == Kind.GDN_ATTN and len(canonical) == 2 and hf_config is not None:
            nk, nv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
            dk, dv = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
            (c, w), (hv, v, k) = canonical
            if (c, hv, v, k) != ((2 * nk * dk + nv * dv) // tp_size, nv // tp_size, dv, dk):
                return None, tuple(transposed)
            return gated_delta_net_shards(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv,
                                          conv_width=w + 1, conv_dtype=dtypes[0],
                                          state_dtype=dtypes[1]), tuple(transposed)
        if kind == Kind.MAMBA2 and len(canonical) == 2 and hf_config is not None:
            groups = getattr(hf_config, "n_groups", None) or getattr(hf_config, "mamba_n_groups", None)
            (c, w), (h, p, n) = canonical
            if not isinstance(groups, int) or groups % tp_size or c != (total(h) * p + 2 * groups * n) // tp_size:
                return None, tuple(transposed)
            conv = StateTensor(groups=(HeadGroup(num_heads=total(h), rows_per_head=p),
                                       HeadGroup(num_heads=groups, rows_per_head=n),
                                       HeadGroup(num_heads=groups, rows_per_head=n)), rest=(w,), dtype=dtypes[0])
            ssm = StateTensor(groups=(HeadGroup(num_heads=total(h), rows_per_head=1),), rest=(p, n), dtype=dtypes[1])
            return StateShards(units=groups, tensors=(conv, ssm)), tuple(transposed)
    except (ValueError, AttributeError, TypeError):
        return None, tuple(transposed)
    return None, tuple(transposed)


def namespace_for(vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings) -> Namespace:
    """The namespace both roles key entries under (they must build the same one); every rank of
    every tensor-parallel size of the model builds the same one (no rank in it), and so does
    SGLang's backend for the same model, dtype and page size when ``keys`` is ``sglang-pages``."""
    import vllm

    model = vllm_config.model_config
    name = settings.model_id or (str(model.model) if model is not None else "")
    if not name:
        raise ValueError("model_id: vLLM names no model here; set model_id in kv_connector_extra_config")
    revision = str(getattr(model, "revision", None) or "")
    if settings.keys == "sglang-pages":
        revision += "|" + KEYSPACE
    if groups.hybrid and groups.state_shards is None:
        # Opaque snapshot bytes are vLLM's own state blocks: their meaning changes with vLLM's kernels.
        revision += f"|state:vllm-{vllm.__version__}"
    return Namespace(model=name, revision=revision, kv=groups.kv, state=groups.state,
                     block_tokens=settings.block_tokens, tenant=settings.tenant)


def store_prompt(client: PrefixClient, keys: KeySpace, tokens: Sequence[int], extra_keys: list[bytes]) -> Prompt:
    """The store's view of ``tokens`` in the connector's keyspace (settings ``keys``): the one place
    both roles build a prompt, so a lookup, a load's relookup and a save key the same chain."""
    if keys == "tokens":
        return client.prompt(tokens, extra_keys)
    salt = next((k[len(SALT_PREFIX):].decode() for k in extra_keys if k.startswith(SALT_PREFIX)), None)
    return keyed_prompt(client.namespace, tokens, salt)


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
    tokens: tuple[int, ...] = ()
    """The request's tokens [0, end): the worker keys its own lookup of them (in SGLang's keyspace
    the scheduler's prompt holds page keys, not tokens)."""
    commit_wait: bool = False
    """Prefill/decode: the prefill instance said it saved [0, end) and the store did not hold it
    yet; the worker's lookup waits up to ``commit_wait_s`` for the commit (an asynchronous load)."""


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
    costs: CostFigures | None = None
    """What loads and recomputing cost on this engine, when the worker's figures changed
    (costs.py): the scheduler makes a load only where it beats recomputing."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PrefixStoreWorkerMeta)
        for save_id, n in other.saves_done.items():
            self.saves_done[save_id] = self.saves_done.get(save_id, 0) + n
        self.refused.extend(other.refused)
        if other.costs is not None:
            self.costs = other.costs if self.costs is None else self.costs.worst(other.costs)
        return self


__all__ = ["CacheGroups", "LoadPlan", "PrefixStoreMetadata", "PrefixStoreWorkerMeta", "SavePlan", "namespace_for",
           "store_prompt"]

"""``kv_connector_extra_config`` -> the connector's settings and the client's one config.

vLLM hands a connector a free-form dict. It is validated once, here, at
engine start-up: every key is either a :class:`~prefixstore.client.config.ClientConfig`
field (store address, tenant token, TLS files, data path, timeouts -- whatever
the installed client declares, so knobs added to the client later are
accepted without touching this file) or one of the connector's own keys
below. An unknown key or a bad value raises ``ValueError`` naming it; nothing
silently falls back to a default.

Imports nothing of vLLM or torch: the mapping is testable without either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from ..config import ClientConfig

ReuseMode = Literal["exact", "replay"]
REUSE_MODES: tuple[ReuseMode, ...] = ("exact", "replay")
KeySpace = Literal["tokens", "sglang-pages"]
KEY_SPACES: tuple[KeySpace, ...] = ("tokens", "sglang-pages")
LoadPolicy = Literal["when_faster", "always"]
LOAD_POLICIES: tuple[LoadPolicy, ...] = ("when_faster", "always")


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """What the connector itself needs beside the client config."""

    client: ClientConfig
    """Where the store is and how to talk to it (every ClientConfig field may appear in the JSON)."""
    mode: ReuseMode = "exact"
    """Hybrid models only. exact: load KV and state up to the store's state boundary (state_tokens).
    replay: load KV up to kv_tokens and let the engine rebuild the state by replaying a recent suffix
    (Tail-Replay). vLLM cannot replay recurrent state, so the vLLM connector refuses 'replay' on a
    hybrid model at start-up rather than hand the engine KV without its state."""
    block_tokens: int = 16
    """Store block size B in tokens (part of the namespace; independent of vLLM's --block-size)."""
    tenant: str = "default"
    """Tenant named in the namespace (must match the token's tenant on a store with tenants)."""
    model_id: str = ""
    """Name the namespace gives the model; empty: vLLM's --model. Engines share cache only if
    their namespaces are equal, so set it when the same weights are served under different paths."""
    staging_bytes: int = 64 << 20
    """Staging region for loads (gpu_staging.StagingBuffer), allocated once per worker."""
    load: bool = True
    """Look up and load prefixes from the store."""
    load_policy: LoadPolicy = "when_faster"
    """when_faster: load only where the engine's measured figures say a load (and the step that
    reports it) beats recomputing the same tokens (client/vllm/costs.py; a small model recomputes
    a short hit faster than a hybrid load returns); skipped loads are counted (``loads_skipped``),
    and one in ``scheduler.REMEASURE_EVERY`` is made anyway so the figures are measured again
    (``loads_remeasured``). A request that no load could pay for, not even one of every token it
    lacks locally, is not looked up, nor saved (``lookups_skipped``, ``saves_skipped``; one in
    ``REMEASURE_EVERY`` is, docs/vllm.md "Requests no load would pay for").
    A decode instance's load of what its prefill instance saved (``commit_wait_s``) is made under
    either: recomputing it would undo the split; a prefill instance's hand-off is always saved.
    always: look up, load and save every request."""
    save: bool = True
    """Offer finished requests' KV (and snapshots) to the store."""
    save_wait_s: float = 2.0
    """Longest a new request's lookup is held back (vLLM asks again next step) while a save of this
    engine that shares more of its prompt than vLLM holds locally is still being offered: the next
    turn of a conversation arrives as the previous turn's save leaves. Within it, a request waits no
    longer than loading what the save adds would gain it against recomputing (the engine's measured
    costs, client/vllm/costs.py). 0: never wait."""
    lookup_timeout_s: float = 0.25
    """Longest a new request waits for its lookup: a store slower than this is a miss for that
    request (counted ``lookup_timeouts``), never a stalled engine. A lookup sent while the engine
    is running requests holds nobody back (``lookup_block_s``) and is given longer: as long as
    recomputing the tokens it could bring would take (the engine's measured prefill cost), up to
    2 s. A lookup takes about a millisecond on a healthy store (docs/benchmarks.md)."""
    lookup_block_s: float = 0.003
    """Longest vLLM's scheduler (and so every request of the engine) waits for lookups in one step
    while the engine is running requests, all waiting requests' lookups together. A lookup not
    answered by then goes on in the background; the
    request is asked again next step (counted ``lookups_deferred``) while the others take theirs.
    An idle engine waits up to ``lookup_timeout_s``: it holds nobody back."""
    save_timeout_s: float = 30.0
    """Longest a save's offer and put may take on the worker. Past it the save is dropped: counted
    (``saves_dropped``), logged, and reported ended, so the scheduler stops holding lookups back for
    it. A finished request's blocks never wait for this: they are released once copied."""
    load_timeout_s: float = 30.0
    """Longest a load may take. Past it the load fails as a whole and vLLM recomputes the request:
    a request waiting for its remote KV, or a forward pass waiting for a layer, never waits longer."""
    commit_wait_s: float = 5.0
    """Prefill/decode disaggregation, on the decode instance: longest a load waits for the prefill
    instance's save to be committed (its response, through vLLM's ``kv_transfer_params``, says
    what it saved; it returns while that save may still be on its way). Past it the load fails
    and vLLM recomputes; the waits are counted (``commit_waits``, ``commit_wait_timeouts``,
    ``commit_wait_ms``). 0: never wait (a request arriving before the commit recomputes)."""
    keys: KeySpace = "tokens"
    """How blocks are keyed. tokens: by their token ids (every vLLM engine of the namespace shares
    them, matches end at any token). sglang-pages: by SGLang's page keys (SHA-256 over token ids,
    computed here), the keyspace SGLang's HiCache backend stores in, so vLLM and SGLang engines of
    the same model, dtype and page size share one cache (``block_tokens`` must be SGLang's
    ``--page-size``; docs/sglang.md); matches still end at any token among vLLM engines."""
    idle_wait_s: float = 0.005
    """Longest an engine step that computes nothing waits for a load or save of the worker's in
    flight to end. Such a step is vLLM's engine loop spinning while a request waits for its remote
    KV; the connector's loads and saves run on its own thread in the same process, and every
    hand-off of the GIL between the two can wait up to Python's switch interval (5 ms), so a
    spinning loop slows a load several times over (docs/vllm.md, "Loads and the engine loop").
    Waiting lets the transfer run uncontended, and a load that ends within the wait is reported
    in that same step. The cost: a request arriving at an otherwise idle engine is scheduled up
    to this much later. 0: never wait."""

    switch_interval_s: float = 0.0
    """When above 0, the worker process's Python switch interval (``sys.setswitchinterval``; Python's
    default is 5 ms). The connector's loads run on its own thread beside vLLM's engine thread, and
    while the engine runs Python every hand-off of the GIL to the load waits up to this interval:
    under concurrent load a 25 ms load took 0.3-0.5 s (docs/benchmarks.md, "vLLM serving"). A
    shorter interval hands over sooner, at the price of more switches for the engine. 0: leave it."""

    def __post_init__(self) -> None:
        if self.mode not in REUSE_MODES:
            raise ValueError(f"mode: {self.mode!r} is not one of {list(REUSE_MODES)}")
        if self.keys not in KEY_SPACES:
            raise ValueError(f"keys: {self.keys!r} is not one of {list(KEY_SPACES)}")
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy: {self.load_policy!r} is not one of {list(LOAD_POLICIES)}")
        for name in ("block_tokens", "staging_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        for name in ("save_wait_s", "commit_wait_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 600:
                raise ValueError(f"{name}: must be a number of seconds in [0, 600], got {value!r}")
        if (not isinstance(self.lookup_block_s, (int, float)) or isinstance(self.lookup_block_s, bool)
                or not 0 <= self.lookup_block_s <= 1):
            raise ValueError(f"lookup_block_s: must be a number of seconds in [0, 1], got {self.lookup_block_s!r}")
        for name in ("lookup_timeout_s", "save_timeout_s", "load_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 3600:
                raise ValueError(f"{name}: must be a number of seconds in (0, 3600], got {value!r}")
        if (not isinstance(self.idle_wait_s, (int, float)) or isinstance(self.idle_wait_s, bool)
                or not 0 <= self.idle_wait_s <= 1):
            raise ValueError(f"idle_wait_s: must be a number of seconds in [0, 1], got {self.idle_wait_s!r}")
        if (not isinstance(self.switch_interval_s, (int, float)) or isinstance(self.switch_interval_s, bool)
                or not 0 <= self.switch_interval_s <= 0.1):
            raise ValueError(f"switch_interval_s: must be a number of seconds in [0, 0.1], got {self.switch_interval_s!r}")
        for name in ("load", "save"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        for name in ("tenant", "model_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}: must be a string, got {getattr(self, name)!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object]) -> ConnectorSettings:
        """Split ``extra`` between the client config and the connector's own keys."""
        own = {f.name for f in dataclasses.fields(cls)} - {"client"}
        client_fields = {f.name: f for f in dataclasses.fields(ClientConfig)}
        client_kwargs: dict[str, object] = {}
        own_kwargs: dict[str, object] = {}
        for key, value in extra.items():
            if key in own:
                own_kwargs[key] = value
            elif key in client_fields:
                client_kwargs[key] = value
            else:
                raise ValueError(f"kv_connector_extra_config: unknown key {key!r}; choose from "
                                 f"{sorted(own | set(client_fields))}")
        _urls(client_kwargs, client_fields)
        client_kwargs.setdefault("small_save_bytes", SMALL_SAVE_BYTES)
        try:
            client = ClientConfig(**client_kwargs)  # type: ignore[arg-type]
        except TypeError as err:  # a value of the wrong type for a field
            raise ValueError(f"kv_connector_extra_config: {err}") from err
        return cls(client=client, **own_kwargs)  # type: ignore[arg-type]


SMALL_SAVE_BYTES = 1 << 20
"""The connector's ``small_save_bytes`` where the config names none (the client's own default is
0: every save offered first). A save here starts where the store's match (or this engine's load)
ends, so it rarely carries what the store holds: each batch of at most 1 MiB goes as one HTTP put
with no offer, and a larger one over NIXL straight to the reserve, one round trip fewer either way
(ClientConfig.small_save_bytes)."""


def _urls(kwargs: dict[str, object], fields: Mapping[str, dataclasses.Field[object]]) -> None:
    """Accept ``url`` as one address or a list of seeds.

    A list goes to the client's member-list field when the installed client
    has one (the cluster work adds it); its first entry also becomes ``url``.
    Without such a field a list of more than one address is an error."""
    url = kwargs.get("url")
    if not isinstance(url, (list, tuple)):
        return
    seeds = [str(u) for u in url]
    if not seeds:
        raise ValueError("url: an empty list names no store")
    kwargs["url"] = seeds[0]
    list_field = next((name for name in ("seeds", "seed_urls", "urls", "members") if name in fields), None)
    if list_field is not None:
        kwargs.setdefault(list_field, tuple(seeds))
    elif len(seeds) > 1:
        raise ValueError("url: this client takes one store address; a list of several needs a client "
                         "with a member list (ClientConfig has none)")


__all__ = ["KEY_SPACES", "LOAD_POLICIES", "REUSE_MODES", "SMALL_SAVE_BYTES", "ConnectorSettings", "KeySpace", "LoadPolicy", "ReuseMode"]

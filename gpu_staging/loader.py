"""Layer-by-layer loading of a lookup's KV (and snapshot) into a sequence, overlapped with compute.

::

    event loop (this class)                     compute thread (the model)
    read snapshot -> state           ready L0,L1,L3,L4 (linear layers)
    read KV layer 0 -> scatter       ready L2    layer 0, 1 run ... wait_for_layer(2)
    read KV layer 1 -> scatter       ready L5    layer 2, 3, 4 run ... wait_for_layer(5)

Each attention layer's payloads are read as one layer range of every entry
(``GetItem(layer_start=a, layer_end=a+1)``; the store lays KV out
layer-major, so that is one contiguous byte range per entry), landed in the
staging region and scattered into the pages, then the layer is released to
the model. The model calls :meth:`LayerwiseLoad.wait_for_layer` before each
layer, so it computes the linear layers and the earlier attention layers
while later ones are still in flight.

Failure: the store is best effort. A read that misses or fails (the client
turns every store error into -1) fails the load; every later
``wait_for_layer`` raises :class:`LoadFailed` and the engine recomputes the
prefix instead. Staging bytes the failed transfer did not cover are zeroed
(:meth:`StagingBuffer.land`), and nothing of a failed round is scattered.
"""

from __future__ import annotations

import logging
import threading
import time

from prefixstore.client.client import PrefixClient
from prefixstore.client.results import LookupResult
from .paged_kv import SequenceKV, Span
from .reference_model import ModelConfig, RecurrentState
from .staging import StagingBuffer

log = logging.getLogger(__name__)


class LoadFailed(RuntimeError):
    """The store could not deliver what the lookup promised; recompute instead."""


class LayerwiseLoad:
    """Loads KV [0, kv_tokens) of ``lookup`` (and its snapshot when ``state`` is given)."""

    def __init__(self, client: PrefixClient, lookup: LookupResult, *, kv_tokens: int, seq: SequenceKV,
                 state: RecurrentState | None, staging: StagingBuffer, config: ModelConfig) -> None:
        if kv_tokens > lookup.kv_tokens:
            raise ValueError(f"kv_tokens={kv_tokens} exceeds the lookup's kv_tokens={lookup.kv_tokens}")
        if state is not None and lookup.state_tokens != kv_tokens:
            raise ValueError(f"exact reuse loads KV up to the snapshot ({lookup.state_tokens}), not {kv_tokens}")
        self.client, self.lookup, self.kv_tokens = client, lookup, kv_tokens
        self.seq, self.state, self.staging, self.config = seq, state, staging, config
        self._ready = [threading.Event() for _ in config.layers]
        self.failure: str | None = None
        self.loaded_bytes = 0
        self.layer_ready_s: dict[int, float] = {}
        """Model layer -> perf_counter() when it became ready."""
        self.load_s = 0.0
        """Wall time of :meth:`run`."""
        self.wait_s = 0.0
        """Time the compute thread spent blocked in :meth:`wait_for_layer`: the part of the load
        that compute did not hide."""

    # ------------------------------------------------------------ compute side

    def wait_for_layer(self, layer: int) -> None:
        """Block until model layer ``layer``'s KV (attention) or state (linear) is in place.

        Raises :class:`LoadFailed` once the load failed, at any layer: KV loaded for some layers
        but not others (or without its snapshot) is not a usable prefix, so the engine recomputes."""
        if not self._ready[layer].is_set():
            blocked = time.perf_counter()
            self._ready[layer].wait()
            self.wait_s += time.perf_counter() - blocked
        if self.failure is not None:
            raise LoadFailed(self.failure)

    def cancel(self, reason: str = "cancelled") -> None:
        """Fail the load and wake every waiter (safe to call at any time, from any thread)."""
        if self.failure is None:
            self.failure = reason
        for event in self._ready:
            event.set()

    # ------------------------------------------------------------ event-loop side

    async def run(self) -> bool:
        """Load everything; True on success. Never raises: a failure is recorded and wakes the waiters."""
        started = time.perf_counter()
        try:
            # Pages are reserved by the engine before the load and the compute
            # start: two threads must never grow one page table.
            if self.seq.capacity_tokens < self.kv_tokens:
                raise LoadFailed(f"the sequence reserves {self.seq.capacity_tokens} tokens, the load needs "
                                 f"{self.kv_tokens}")
            self.staging.register_with(self.client)  # once per client: NIXL READs land in it directly
            if self.state is not None:
                await self._load_state()
            self._set_ready(self.config.linear_layers)
            for kv_layer, model_layer in enumerate(self.config.attention_layers):
                await self._load_layer(kv_layer)
                self._set_ready([model_layer])
        except LoadFailed as err:
            self.cancel(str(err))
        except Exception as err:  # noqa: BLE001 -- best effort: any error is a miss, never a failed request
            log.warning("prefixstore load failed, recomputing: %s: %s", type(err).__name__, err)
            self.cancel(f"{type(err).__name__}: {err}")
        finally:
            if not self._complete():  # cancelled, or failed: never leave the compute thread waiting
                self.cancel("the load stopped before every layer was in place")
            self.load_s = time.perf_counter() - started
        return self.failure is None

    def _complete(self) -> bool:
        return len(self.layer_ready_s) == len(self.config.layers)

    def _set_ready(self, layers: list[int]) -> None:
        now = time.perf_counter()
        for layer in layers:
            self.layer_ready_s[layer] = now
            self._ready[layer].set()

    async def _load_state(self) -> None:
        item = self.lookup.state_read()
        assert self.state is not None
        if item is None:
            raise LoadFailed("the lookup named no snapshot")
        [slot] = self.staging.carve([self.state.num_bytes])
        if not (await self.staging.receive(self.client, [item], [slot]))[0]:
            raise LoadFailed(f"snapshot at {self.lookup.state_tokens} could not be read")
        self.state.load_payload_(self.staging.region[slot.offset : slot.end])
        self.loaded_bytes += slot.nbytes

    async def _load_layer(self, kv_layer: int) -> None:
        lookup = self.lookup
        B = lookup.prompt.block_tokens
        reads = lookup.kv_reads(self.kv_tokens, kv_layer, kv_layer + 1)
        spans: list[Span] = []
        for item, start, end in reads:
            child = lookup.child
            payload_tokens = child.num_tokens if child is not None and item.key == child.key else B
            spans.append(Span(start=start, tokens=end - start, payload_tokens=payload_tokens))
        layer_token_bytes = lookup.prompt.namespace.kv.layer_token_bytes
        sizes = [s.payload_tokens * layer_token_bytes for s in spans]
        cache = self.seq.cache
        for batch in self.staging.rounds(sizes):
            slots = self.staging.carve([sizes[i] for i in batch])
            filled = await self.staging.receive(self.client, [reads[i][0] for i in batch], slots)
            if not all(filled):
                raise LoadFailed(f"KV layer {kv_layer}: {filled.count(False)} of {len(filled)} payloads "
                                 "could not be read")
            src = self.staging.rows(slots[0], slots[-1], cache.row_elems, cache.data.dtype)
            self.seq.scatter(src, [spans[i] for i in batch], kv_layer, kv_layer + 1)
            self.loaded_bytes += sum(s.nbytes for s in slots)


__all__ = ["LayerwiseLoad", "LoadFailed"]

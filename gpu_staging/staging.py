"""Staging buffers: one region allocated (and, with NIXL, registered) once per engine.

Every transfer between the store and the pages goes through it::

    load:  store --HTTP body / NIXL READ--> staging slot --scatter--> pages
    save:  pages --gather--> staging slot --HTTP body / NIXL WRITE--> store

A transfer round carves slots from the start of the region (a bump
allocator, reset per round), so consecutive requests reuse the same bytes. A
slot is sized for what the round expects to receive; when a transfer does
not fill it (a miss, an error, a short payload) the part it did not cover
still holds whatever an earlier request left there. :meth:`StagingBuffer.land`
therefore zeroes every byte of a round the transfer did not cover before
anything reads the round, so no byte of
request A can reach request B (DESIGN §9).

Memory: on a machine with a GPU the region is device memory (what a NIXL
agent registers and one-sided READs land in) plus a pinned host mirror that
the HTTP path fills; on CPU machines the host region is the region.

A load round on a GPU (:meth:`StagingBuffer.receive`)::

    NIXL READ -> device slots            (no host copy; proven by the lease, client/device.py)
    what it did not deliver -> host slots (HTTP or NIXL) -> copied up, slot by slot
    what nothing delivered  -> zeroed on the host and on the device
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from prefixstore.client.device import DeviceBuffer

if TYPE_CHECKING:
    from prefixstore.client.client import PrefixClient
    from prefixstore.protocol.wire import GetItem

class StagingFull(ValueError):
    """A round asked for more bytes than the region holds; the message names the knob."""


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class StagingBuffer:
    """A fixed region of ``capacity_bytes``, carved into slots per transfer round."""

    def __init__(self, capacity_bytes: int, device: torch.device | str | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging_bytes: must be positive, got {capacity_bytes}")
        self.device = torch.device(device) if device is not None else default_device()
        self.capacity_bytes = capacity_bytes
        on_gpu = self.device.type == "cuda"
        # The host region is what HTTP bodies are read into and sent from.
        self.host = torch.zeros(capacity_bytes, dtype=torch.uint8, pin_memory=on_gpu)
        self.region = torch.zeros(capacity_bytes, dtype=torch.uint8, device=self.device) if on_gpu else self.host
        self.zeroed_bytes = 0
        """Bytes zeroed by :meth:`land` so far (a transfer that did not cover its slot)."""
        self._registered_with: set[int] = set()

    @property
    def on_gpu(self) -> bool:
        return self.region is not self.host

    def register_with(self, client: PrefixClient) -> bool:
        """Register the regions with ``client``'s NIXL agent, once per client, so no READ of a
        load needs a per-call registration (a no-op on the HTTP path): the device region, which
        NIXL READs land in (:meth:`receive`), and the host region, which saves send from and
        reads the device path did not deliver land in."""
        if id(client) in self._registered_with:
            return False
        self._registered_with.add(id(client))
        if self.on_gpu:
            client.register_buffer(DeviceBuffer.of(self.region))
        return client.register_buffer(self.host.numpy())

    # ------------------------------------------------------------ carving

    def carve(self, sizes: Sequence[int]) -> list[Slot]:
        """Slots for one round, back to back from the start of the region.

        No padding between slots: a round of KV payloads is then one run of
        rows, gathered or scattered with one index op (paged_kv.py)."""
        slots: list[Slot] = []
        offset = 0
        for size in sizes:
            slots.append(Slot(offset, size))
            offset += size
        if slots and slots[-1].end > self.capacity_bytes:
            raise StagingFull(f"staging_bytes: a round needs {slots[-1].end} bytes, the region holds "
                              f"{self.capacity_bytes}")
        return slots

    def rounds(self, sizes: Sequence[int]) -> list[list[int]]:
        """Split items (by index) into consecutive rounds that each fit the region."""
        out: list[list[int]] = []
        used = 0
        for i, size in enumerate(sizes):
            if size > self.capacity_bytes:
                raise StagingFull(f"staging_bytes: one payload of {size} bytes exceeds the region "
                                  f"({self.capacity_bytes} bytes)")
            if not out or used + size > self.capacity_bytes:
                out.append([])
                used = 0
            out[-1].append(i)
            used += size
        return out

    # ------------------------------------------------------------ views

    def host_view(self, slot: Slot) -> np.ndarray:
        """The slot's host bytes as a numpy array (what the client reads into or sends)."""
        return self.host[slot.offset : slot.end].numpy()

    def device_buffer(self, slot: Slot) -> DeviceBuffer:
        """The slot's device bytes, as a NIXL READ destination (GPU regions only)."""
        if not self.on_gpu:
            raise ValueError("device_buffer: this staging region lives in host memory")
        return DeviceBuffer.of(self.region).slice(slot.offset, slot.nbytes)

    def rows(self, first: Slot, last: Slot, row_elems: int, dtype: torch.dtype) -> Tensor:
        """Slots first..last (back to back) as a device tensor of rows of ``row_elems`` elements."""
        return self.region[first.offset : last.end].view(dtype).view(-1, row_elems)

    # ------------------------------------------------------------ transfers

    async def receive(self, client: PrefixClient, items: Sequence[GetItem], slots: Sequence[Slot]) -> list[bool]:
        """Read one round (item i into slot i) and :meth:`land` it; per slot, whether it was filled.

        On a GPU region the client first READs over NIXL straight into the device slots
        (``read_device``); whatever that did not deliver -- no NIXL path, a payload the store
        serves over HTTP, a failed or unproven transfer -- is read into the host slots and copied
        up. Either way a slot nothing filled is zero on both sides afterwards."""
        if len(items) != len(slots):
            raise ValueError("receive: one slot per item")
        received = [-1] * len(slots)
        on_device = [False] * len(slots)
        if self.on_gpu and client.reads_device:
            got = await client.read_device(items, [self.device_buffer(s) for s in slots])
            for i, size in enumerate(got):
                if size >= 0:
                    received[i], on_device[i] = size, True
        rest = [i for i, size in enumerate(received) if size < 0]
        if rest:
            got = await client.read([items[i] for i in rest], [self.host_view(slots[i]) for i in rest])
            for i, size in zip(rest, got):
                received[i] = size
        return self.land(slots, received, on_device)

    def land(self, slots: Sequence[Slot], received: Sequence[int], on_device: Sequence[bool] | None = None
             ) -> list[bool]:
        """Finish a round: zero what the transfer did not cover, then make the round visible on
        the device. ``received[i]`` is the bytes written into slot i (-1: none); ``on_device[i]``
        says they were written straight into the device region (default: into the host region).

        Returns, per slot, whether the transfer filled it exactly. A slot
        that was not filled is all zeros afterwards, on the host and on the
        device: partly written bytes are not trusted either (a payload that
        failed its checksum was written before it was checked, and a READ
        into device memory that was not proven may have landed in part)."""
        if len(slots) != len(received):
            raise ValueError("land: one received count per slot")
        device_side = list(on_device) if on_device is not None else [False] * len(slots)
        if len(device_side) != len(slots):
            raise ValueError("land: one on_device flag per slot")
        full: list[bool] = []
        for slot, got in zip(slots, received):
            ok = got == slot.nbytes
            if not ok:
                self._zero(slot.offset, slot.end)
            full.append(ok)
        if not slots or not self.on_gpu:
            return full
        if not any(device_side):
            span = slice(slots[0].offset, slots[-1].end)
            # Blocking: the next round overwrites the host bytes this copy reads.
            self.region[span].copy_(self.host[span])
            return full
        for slot, ok, direct in zip(slots, full, device_side):
            if not direct or not ok:  # host-delivered, or failed: the host slot (zeroed if failed) goes up
                self.region[slot.offset : slot.end].copy_(self.host[slot.offset : slot.end])
        return full

    def to_host(self, slots: Sequence[Slot]) -> None:
        """After a gather on the device: bring the round into the host region (no-op on CPU)."""
        if slots and self.region is not self.host:
            span = slice(slots[0].offset, slots[-1].end)
            self.host[span].copy_(self.region[span])

    def _zero(self, start: int, end: int) -> None:
        self.host[start:end].zero_()
        self.zeroed_bytes += end - start


__all__ = ["Slot", "StagingBuffer", "StagingFull", "default_device"]

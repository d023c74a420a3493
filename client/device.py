"""Buffers the client cannot touch with Python: GPU memory, as a NIXL READ destination.

A :class:`DeviceBuffer` is an address, a length and a CUDA device; the client
never imports torch or a CUDA library, so it cannot hash, zero or copy such
memory. What it can do is hand the address to its NIXL agent (registered as
``VRAM``) and let a one-sided READ land there (``PrefixClient.read_device``).

Trust without hashing. A READ into host memory is verified by each payload's
xxh3. Bytes in GPU memory cannot be hashed here, so they are proven another
way: the store pins every entry a lease names (store/leases.py: never evicted,
never overwritten), and ``/v1/release`` answers whether the lease was still
held when it was released. A READ that completed before a release that found
its lease held read pages that did not change; any other READ is reported as
not delivered (-1). Bytes the client reports as not delivered are undefined
(possibly a partial READ): the caller must not use them, and zeroes them
before anything else can (gpu_staging's ``StagingBuffer.land`` does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MEMORY_KINDS = ("VRAM", "DRAM")


@dataclass(frozen=True, slots=True)
class DeviceBuffer:
    """``nbytes`` of memory at ``address`` that the client may only READ into, never read itself.

    ``memory`` is the NIXL memory type: ``VRAM`` (GPU memory of CUDA device ``device``) or
    ``DRAM`` (host memory treated the same way: no hashing, lease proof only; what CPU tests
    use to exercise this path)."""

    address: int
    nbytes: int
    device: int = 0
    memory: str = "VRAM"

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_KINDS:
            raise ValueError(f"memory: {self.memory!r} is not one of {MEMORY_KINDS}")
        if self.nbytes < 0 or self.address <= 0 or self.device < 0:
            raise ValueError(f"a device buffer needs a positive address and a non-negative length and device, "
                             f"got address={self.address:#x}, nbytes={self.nbytes}, device={self.device}")

    @classmethod
    def of(cls, array: Any) -> DeviceBuffer:
        """The buffer behind a contiguous CUDA array (a torch tensor, a CuPy array: anything with
        ``__cuda_array_interface__`` and a ``device``), without importing its library."""
        iface = getattr(array, "__cuda_array_interface__", None)
        if iface is None:
            raise TypeError(f"{type(array).__name__} is not a CUDA array (no __cuda_array_interface__)")
        strides = iface.get("strides")
        shape = tuple(iface["shape"])
        itemsize = int(iface["typestr"][2:])
        if strides is not None:
            expected = itemsize
            for dim, stride in zip(reversed(shape), reversed(strides)):
                if dim > 1 and stride != expected:
                    raise ValueError("a device buffer must be contiguous")
                expected *= dim
        nbytes = itemsize
        for dim in shape:
            nbytes *= dim
        device = getattr(array, "device", None)
        index = getattr(device, "index", None)  # torch.device
        if index is None:
            index = getattr(device, "id", 0)  # cupy.cuda.Device
        return cls(address=int(iface["data"][0]), nbytes=nbytes, device=int(index or 0))

    def slice(self, offset: int, nbytes: int) -> DeviceBuffer:
        """Bytes [offset, offset + nbytes) of this buffer."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"slice [{offset}, {offset + nbytes}) is outside a {self.nbytes}-byte buffer")
        return DeviceBuffer(self.address + offset, nbytes, self.device, self.memory)


__all__ = ["MEMORY_KINDS", "DeviceBuffer"]

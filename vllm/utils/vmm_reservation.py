"""An address reservation and the driver allocations mapped in it (ExtensibleTensor's chunks).

    Reservation     va .. va + size, reserved once (a multiple of the granularity g)
    Chunk           granules [first, first + count): ONE driver allocation
                    (create -> map -> set_access), released as a whole
    tensor_over     a uint8 tensor over an address range that keeps its owner
                    (the Reservation) alive: DLPack on a device, a ctypes
                    buffer on the host

    |    g0    |    g1    |    g2    |    g3    |    g4    | ...
    [ chunk (first=0, count=2) ][  chunk (first=3, count=2)  ]

Nothing here decides which granules to map or when: `ExtensibleTensor`
(extensible_tensor.py) does, per segment.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from vllm.device_allocator.vmm import VmmDriver
from vllm.logger import init_logger
from vllm.utils.dlpack import dlpack_tensor

logger = init_logger(__name__)


@dataclass
class Chunk:
    """One driver allocation mapped at granules [first, first + count)."""

    segment: int  # the segment whose growth mapped it
    first: int  # granule index from the base
    count: int  # granules
    handle: Any


class Reservation:
    """The address range and its mapped chunks; what tensors over it keep alive."""

    def __init__(self, driver: VmmDriver, size: int) -> None:
        self.driver = driver
        self.size = size  # bytes, a multiple of the granularity
        self.va = driver.reserve(size)
        self.chunks: list[Chunk] = []  # mutated in place: the finalizer holds this list


def unmap_chunks(driver: VmmDriver, va: int, g: int, chunks: list[Chunk]) -> None:
    """Unmap and release `chunks` (last first), removing each from the list once done."""
    while chunks:
        chunk = chunks[-1]
        driver.unmap(va + chunk.first * g, chunk.count * g)
        chunks.pop()  # unmapped: no longer backs anything, even if release fails
        driver.release(chunk.handle)


def release_reservation(driver: VmmDriver, va: int, size: int, chunks: list[Chunk]) -> None:
    """Finalizer body: drop every page and the address range. Never raises."""
    try:
        driver.synchronize()
        unmap_chunks(driver, va, driver.granularity, chunks)
        driver.free_reservation(va, size)
    except Exception as e:  # a finalizer must not raise; say what leaked
        logger.warning("ExtensibleTensor: releasing reservation %#x (%d bytes) failed: %s",
                       va, size, e)


def map_chunk(driver: VmmDriver, va: int, g: int, chunk: Chunk) -> None:
    """Back `chunk` with a new allocation at `va + chunk.first * g`; sets `chunk.handle`.

    Raises:
        VmmError: the driver failed (what this call did is undone first).
    """
    addr, size = va + chunk.first * g, chunk.count * g
    handle = driver.create(size)
    try:
        driver.map(addr, size, handle)
    except BaseException:
        driver.release(handle)
        raise
    try:
        driver.set_access(addr, size)
    except BaseException:
        driver.unmap(addr, size)
        driver.release(handle)
        raise
    chunk.handle = handle


def tensor_over(va: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """uint8 tensor `[nbytes]` at address `va` on `device`, keeping `owner` alive."""
    if device.type == "cpu":
        return _host_tensor(va, nbytes, owner)
    return dlpack_tensor(va, nbytes, device, owner)


def _host_tensor(va: int, nbytes: int, owner: object) -> torch.Tensor:
    # A subclass so the buffer can carry `_owner`; torch.frombuffer keeps the
    # buffer object alive for the tensor's lifetime. No byte is read here.
    buf_type = type("_HostBytes", (ctypes.c_uint8 * nbytes,), {})
    buf = buf_type.from_address(va)
    buf._owner = owner
    return torch.frombuffer(buf, dtype=torch.uint8)

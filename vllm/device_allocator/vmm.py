"""Virtual memory management drivers: reserve address space, back it with pages later.

One small interface, three thin, checked backends:

    VmmDriver            probe / granularity / reserve / create / map /
       |                 set_access / unmap / release / free_reservation
       +-- CudaVmmDriver   cuMem* from `cuda.bindings.driver`   (gpu_vmm.py)
       +-- HipVmmDriver    hipMem* from hip-python              (gpu_vmm.py)
       +-- HostVmmDriver   mmap(PROT_NONE) / mprotect / madvise (host_vmm.py)

This module is the interface and the helpers every backend shares; it imports
none of the backends (they import it).

The life of a range of bytes (sizes and addresses in bytes, multiples of
`granularity`):

    va = reserve(size)              address range, no memory behind it
    h = create(n)                   n bytes of physical memory (a handle)
    map(va + off, n, h)             back [va+off, va+off+n) with h
    set_access(va + off, n)         let this device read/write it
    ... use ...
    unmap(va + off, n)              drop the backing (the range stays reserved)
    release(h)                      return the physical memory
    free_reservation(va, size)      return the address range

Drivers know nothing about tensors, segments or KV blocks; `ExtensibleTensor`
(vllm/utils/extensible_tensor.py) builds on them. Driver bindings are imported
lazily, so constructing a driver never fails; `probe()` says whether it is usable.

Sources: CUDA Driver API, "Virtual Memory Management" (cuMemAddressReserve,
cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
cuMemAddressFree, cuMemGetAllocationGranularity); HIP runtime API, "Virtual
memory management" (the hipMem* equivalents); Linux man pages mmap(2),
mprotect(2), madvise(2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

MIN_GRANULARITY = 2 << 20
"""Commits happen in units of at least 2 MiB, even where a driver reports less.

Why: driver cost is per call (on the H200, cuMemCreate + cuMemMap + cuMemSetAccess
takes ~50 us for 2 MiB but only ~100-360 us for 1-8 GiB), and some drivers (HIP)
report granularities as small as a 4 KiB page; committing that finely would
multiply calls and mappings. 2 MiB is what CUDA reports on current NVIDIA GPUs,
so nothing is lost there.
"""

HIP_MIN_RUNTIME_VERSION = (7, 12)
"""HIP runtimes older than this reject `hipMemSetAccess` on a reservation that
holds several differently sized allocations, which is exactly what growth makes."""


class VmmError(RuntimeError):
    """A driver call failed; the message names the call, the driver's error and the sizes."""


class VmmDriver(ABC):
    """Reserve / create / map / set access / unmap / release, for one device.

    Attributes:
        device: the torch device whose memory this driver manages.
        fresh_pages_zeroed: True when newly mapped memory is guaranteed to read
            zero (host pages), so callers can skip zeroing it.
    """

    device: torch.device
    fresh_pages_zeroed: bool = False

    @abstractmethod
    def probe(self) -> str | None:
        """None when this driver can be used here, else a human-readable reason. Never raises."""

    @property
    @abstractmethod
    def granularity(self) -> int:
        """Commit unit in bytes (>= 2 MiB); every size and offset passed in is a multiple."""

    @abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space aligned to `granularity`; returns its address."""

    @abstractmethod
    def create(self, size: int) -> Any:
        """Allocate `size` bytes of physical memory; returns an opaque handle."""

    @abstractmethod
    def map(self, va: int, size: int, handle: Any) -> None:
        """Back `[va, va + size)` (inside a reservation, unmapped) with `handle`."""

    @abstractmethod
    def set_access(self, va: int, size: int) -> None:
        """Grant this device read/write access to the mapped range `[va, va + size)`."""

    @abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Remove the backing of `[va, va + size)`, exactly as it was mapped."""

    @abstractmethod
    def release(self, handle: Any) -> None:
        """Free the physical memory of `handle` (after it is unmapped everywhere)."""

    @abstractmethod
    def free_reservation(self, va: int, size: int) -> None:
        """Return the address range reserved at `va` with `size` bytes."""

    def synchronize(self) -> None:  # noqa: B027 - deliberately a no-op by default
        """Wait for all device work that may touch mapped memory (before unmapping)."""

    def _check_aligned(self, call: str, **values: int) -> None:
        g = self.granularity
        for name, value in values.items():
            if value < 0 or value % g:
                raise VmmError(
                    f"{call}: {name}={value} is not a non-negative multiple of the "
                    f"granularity {g} bytes"
                )


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= `value` (both in bytes)."""
    return -(-value // multiple) * multiple


def effective_granularity(driver_granularity: int) -> int:
    """The driver's granularity raised to a multiple of itself that is >= MIN_GRANULARITY."""
    if driver_granularity <= 0:
        raise VmmError(f"driver reported a granularity of {driver_granularity} bytes")
    return round_up(MIN_GRANULARITY, driver_granularity)

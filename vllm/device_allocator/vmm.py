"""Virtual memory management drivers: reserve address space, back it with pages later.

One small interface, three thin, checked backends:

    VmmDriver            probe / granularity / reserve / create / map /
       |                 set_access / unmap / release / free_reservation
       +-- CudaVmmDriver   cuMem* from `cuda.bindings.driver`   (gpu_vmm.py)
       +-- HipVmmDriver    hipMem* from hip-python              (gpu_vmm.py)
       +-- HostVmmDriver   mmap(PROT_NONE) / mprotect / madvise (this file)

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

import ctypes
import ctypes.util
import mmap
import os
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


_PROT_NONE = 0  # <sys/mman.h>; the mmap module does not export it


class HostPages:
    """Handle of `HostVmmDriver.create`: host pages have no separate physical object.

    The pages come into existence when the range is first touched after `map`
    (which makes it readable and writable) and go away at `unmap`.
    """

    __slots__ = ("mapped_at", "released", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.mapped_at: int | None = None
        self.released = False

    def __repr__(self) -> str:
        return f"HostPages(size={self.size}, mapped_at={self.mapped_at}, released={self.released})"


class HostVmmDriver(VmmDriver):
    """The CPU platform's backend: real address ranges, real pages.

    reserve = mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE): costs
    no memory and traps on any access. map = mprotect(PROT_READ | PROT_WRITE):
    the range becomes usable; pages become resident only when touched and read
    zero until written. unmap = madvise(MADV_DONTNEED) + mprotect(PROT_NONE): the
    pages are dropped (RSS falls) and the range traps again; a later map sees
    zeros. So freshly mapped memory is always zero and callers never need to
    write it (`fresh_pages_zeroed`), which keeps a large commit free of resident
    memory until it is used.

    Like the GPU drivers it refuses to map a range twice or to unmap a range
    that is not exactly a union of whole mappings, so bookkeeping bugs surface
    here, in CI, instead of on a GPU.
    """

    fresh_pages_zeroed = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._libc: Any = None
        self._reservations: dict[int, int] = {}  # va -> size
        self._mappings: dict[int, tuple[int, HostPages]] = {}  # va -> (size, handle)

    def probe(self) -> str | None:
        try:
            self._load_libc()
        except Exception as e:
            return f"host VMM unavailable: libc mmap/mprotect/madvise not usable ({e})"
        if not hasattr(mmap, "MADV_DONTNEED"):
            return "host VMM unavailable: this OS has no MADV_DONTNEED"
        return None

    @property
    def granularity(self) -> int:
        return effective_granularity(mmap.PAGESIZE)

    def _load_libc(self) -> Any:
        if self._libc is None:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                ctypes.c_int, ctypes.c_long,
            ]
            for name in ("munmap", "mprotect", "madvise"):
                fn = getattr(libc, name)
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + (
                    [] if name == "munmap" else [ctypes.c_int]
                )
            self._libc = libc
        return self._libc

    def _os_call(self, name: str, *args: Any, **sizes: int) -> None:
        if getattr(self._load_libc(), name)(*args) != 0:
            errno = ctypes.get_errno()
            detail = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise VmmError(f"{name} failed with {os.strerror(errno)} (errno {errno}; {detail})")

    def reserve(self, size: int) -> int:
        self._check_aligned("reserve", size=size)
        if size == 0:
            raise VmmError("reserve: size must be positive, got 0")
        g = self.granularity
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        # Over-reserve by one granule and trim, so the base is granule aligned
        # (huge-page friendly, and the same contract as the GPU drivers).
        raw = self._load_libc().mmap(None, size + g, _PROT_NONE, flags, -1, 0)
        if raw is None or raw == ctypes.c_void_p(-1).value:
            errno = ctypes.get_errno()
            raise VmmError(f"mmap failed with {os.strerror(errno)} (errno {errno}; size={size})")
        va = round_up(raw, g)
        if va > raw:
            self._os_call("munmap", raw, va - raw, size=va - raw)
        tail = raw + size + g - (va + size)
        if tail:
            self._os_call("munmap", va + size, tail, size=tail)
        self._reservations[va] = size
        return va

    def create(self, size: int) -> HostPages:
        self._check_aligned("create", size=size)
        return HostPages(size)

    def _reservation_of(self, call: str, va: int, size: int) -> int:
        for base, length in self._reservations.items():
            if base <= va and va + size <= base + length:
                return base
        raise VmmError(f"{call}: [{va:#x}, {va + size:#x}) is not inside a reservation")

    def map(self, va: int, size: int, handle: Any) -> None:
        self._check_aligned("map", va=va, size=size)
        if not isinstance(handle, HostPages) or handle.released or handle.mapped_at is not None:
            raise VmmError(f"map: handle {handle!r} is not a fresh HostPages handle")
        if handle.size != size:
            raise VmmError(f"map: size={size} differs from the handle's size={handle.size}")
        self._reservation_of("map", va, size)
        for start, (length, _) in self._mappings.items():
            if start < va + size and va < start + length:
                raise VmmError(
                    f"map: [{va:#x}, {va + size:#x}) overlaps the mapping "
                    f"[{start:#x}, {start + length:#x}) (size={size})"
                )
        self._os_call("mprotect", va, size, mmap.PROT_READ | mmap.PROT_WRITE, va=va, size=size)
        handle.mapped_at = va
        self._mappings[va] = (size, handle)

    def set_access(self, va: int, size: int) -> None:
        # Access came with map (mprotect); here only check the range is backed.
        covered = sum(
            length for start, (length, _) in self._mappings.items()
            if va <= start and start + length <= va + size
        )
        if covered != size:
            raise VmmError(
                f"set_access: only {covered} of [{va:#x}, +{size}) bytes are mapped (size={size})"
            )

    def unmap(self, va: int, size: int) -> None:
        inside = [s for s, (n, _) in self._mappings.items() if va <= s and s + n <= va + size]
        covered = sum(self._mappings[s][0] for s in inside)
        if covered != size:
            raise VmmError(
                f"unmap: [{va:#x}, +{size}) is not a union of whole mappings "
                f"({covered} of {size} bytes covered)"
            )
        self._os_call("madvise", va, size, mmap.MADV_DONTNEED, va=va, size=size)
        self._os_call("mprotect", va, size, _PROT_NONE, va=va, size=size)
        for start in inside:
            _, handle = self._mappings.pop(start)
            handle.mapped_at = None

    def release(self, handle: Any) -> None:
        if not isinstance(handle, HostPages) or handle.released:
            raise VmmError(f"release: {handle!r} is not a live HostPages handle")
        if handle.mapped_at is not None:
            raise VmmError(f"release: handle is still mapped at {handle.mapped_at:#x}")
        handle.released = True

    def free_reservation(self, va: int, size: int) -> None:
        if self._reservations.get(va) != size:
            raise VmmError(f"free_reservation: no reservation of size={size} at {va:#x}")
        mapped = [s for s in self._mappings if va <= s < va + size]
        if mapped:
            raise VmmError(f"free_reservation: {len(mapped)} mappings still inside {va:#x}")
        self._os_call("munmap", va, size, va=va, size=size)
        del self._reservations[va]

    @property
    def num_mappings(self) -> int:
        """Number of live mappings (for tests and leak checks)."""
        return len(self._mappings)

    @property
    def num_reservations(self) -> int:
        """Number of live reservations (for tests and leak checks)."""
        return len(self._reservations)


def __getattr__(name: str) -> Any:
    # The GPU backends live in gpu_vmm.py (imported lazily: it imports this module).
    if name in ("CudaVmmDriver", "HipVmmDriver"):
        from vllm.device_allocator import gpu_vmm

        return getattr(gpu_vmm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

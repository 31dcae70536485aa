"""The host VMM backend: real address ranges and real pages, for the CPU platform.

It makes growth, sleep/wake and stable addresses testable in CI, which has no
GPU: the same bookkeeping rules as the GPU drivers (no double map, unmap only
whole mappings) are enforced here. See vmm.py for the interface.

Sources: Linux man pages mmap(2), mprotect(2), madvise(2).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any

import torch

from vllm.device_allocator.vmm import VmmDriver, VmmError, effective_granularity, round_up

_PROT_NONE = 0  # <sys/mman.h>; the mmap module does not export it
# madvise(2): populate (prefault) page tables writable, faulting in every page
# (Linux 5.14+; older kernels answer EINVAL). Not exported by every Python.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_EINVAL = 22


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
    no memory and traps on any access. map = mprotect(PROT_READ | PROT_WRITE)
    then, with `prefault` (the default), populate: madvise(MADV_POPULATE_WRITE)
    (Linux 5.14+), or, where the kernel lacks it, a memset of the range, so
    every committed page is resident when `map` returns, as `cuMemCreate`
    memory is on a GPU. That makes a commit mean memory really taken: free
    memory read afterwards is honest, and two engines on one host see each
    other's caches (issue #18: two uncommitted-until-touched CPU engines once
    "committed" 41 GiB on a 23.5 GiB machine without either noticing); the
    elastic cache, which grows only into memory free at that moment, relies on
    it. A commit the host cannot back fails here with a VmmError (ENOMEM), and
    the caller rolls it back.

    `prefault=False` (the CPU platform's static KV cache, issue 48): map only
    makes the range accessible; each page becomes resident when first written
    and costs nothing before, so a 4 GiB cache holding 60 MiB of KV costs
    60 MiB of RSS. The commit is then a promise: free memory read afterwards
    does not drop, and a page the host cannot back when it is first written
    is the kernel's OOM killer's business, not a VmmError.

    unmap = madvise(MADV_DONTNEED) + mprotect(PROT_NONE): the pages are dropped
    (RSS falls) and the range traps again; a later map sees zeros. Freshly mapped
    memory is always zero, so callers never need to write it (`fresh_pages_zeroed`).

    Like the GPU drivers it refuses to map a range twice or to unmap a range
    that is not exactly a union of whole mappings, so bookkeeping bugs surface
    here, in CI, instead of on a GPU.
    """

    fresh_pages_zeroed = True

    def __init__(self, prefault: bool = True) -> None:
        """Args:
            prefault: make committed pages resident in `map` (see the class docstring).
        """
        self.device = torch.device("cpu")
        self.prefault = prefault
        self._libc: Any = None
        self._reservations: dict[int, int] = {}  # va -> size
        self._mappings: dict[int, tuple[int, HostPages]] = {}  # va -> (size, handle)
        # False once the kernel answered EINVAL (pre-5.14): populate by touching.
        self.populate_with_madvise = True

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
        try:
            if self.prefault:
                self._populate(va, size)
        except BaseException:
            self._load_libc().mprotect(va, size, _PROT_NONE)
            self._load_libc().madvise(va, size, mmap.MADV_DONTNEED)
            raise
        handle.mapped_at = va
        self._mappings[va] = (size, handle)

    def _populate(self, va: int, size: int) -> None:
        """Make [va, va + size) resident (see the class docstring).

        Raises:
            VmmError: the host cannot back the range (ENOMEM, EFAULT).
        """
        if self.populate_with_madvise:
            if self._load_libc().madvise(va, size, _MADV_POPULATE_WRITE) == 0:
                return
            errno = ctypes.get_errno()
            if errno != _EINVAL:
                raise VmmError(
                    f"madvise(MADV_POPULATE_WRITE) failed with {os.strerror(errno)} "
                    f"(errno {errno}; va={va:#x}, size={size}): the host cannot back the commit"
                )
            self.populate_with_madvise = False  # an older kernel: touch the pages instead
        ctypes.memset(va, 0, size)  # pages read zero already: writing zero faults them in

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

"""ExtensibleTensor: one address reservation cut into segments, each backed by a growing prefix.

The whole capacity is reserved up front; physical pages are committed only for
each segment's *committed prefix*, which grows on demand under the same base
address. Nothing here knows about KV blocks: callers hand in byte sizes.

Layout (capacities need not be multiples of the granularity `g`):

    base = full_view().data_ptr()            (never changes: not on growth,
    |                                         release, recommit or defragment)
    |<--------- segment 0 (cap0) --------->|<------ segment 1 (cap1) ------>|
    offset 0                               offset cap0           capacity = cap0 + cap1
    [### prefix 0 ###).....................[#### prefix 1 ####)............
    |    g0    |    g1    |    g2    |    g3    |    g4    |    g5    |  g6 ..
    [ mapped  ][ mapped  ]                [ mapped  ][ mapped  ]
                                          ^ g3 holds the tail of segment 0 and the
                                            head of segment 1: it is mapped once, by
                                            whichever segment needs it first, and
                                            counted once in `physical_bytes`

    prefix i   = [offset_i, offset_i + size_i)          what segment_view(i) covers
    granules i = [offset_i // g, ceil((offset_i + size_i) / g))   what must be mapped

The mapped granule ranges ("chunks", one driver allocation each) are the source
of truth for what is backed; segment sizes only say what is exposed. Rounding
costs at most one extra granule per segment.

Invariants (what captured CUDA graphs and per-layer views rely on):
  * The base address never moves, so a block at byte offset `o` of segment `i`
    lives at `base + offset_i + o` forever: graphs that address the cache through
    the base pointer and a block table keep working while it grows.
  * Growth is grow-only and maps *new* granules only; nothing already mapped is
    touched, so data written before a growth is intact after it.
  * Views are authoritative: `segment_view(i)` spans exactly the committed
    prefix, and so does its storage (`untyped_storage().nbytes()` is the
    committed prefix, upstream's contract): each call builds a tensor of its
    own at the same address. Only `full_view()` has a storage that spans the
    whole (mostly uncommitted) capacity.

Reading or writing an uncommitted byte is a bug: on the host it kills the
process with SIGSEGV (the range is PROT_NONE), on a GPU it is an illegal memory
access that poisons the CUDA context. The API makes that hard: `segment_view(i)`
covers only committed bytes, sizes beyond a segment's capacity are rejected, and
after `release_physical()` every segment view is empty. `full_view()` spans the
whole capacity and is meant only for address arithmetic (base pointer, kernels
that index through a block table); slicing it by hand is the caller's risk.

Tensors over the reservation (`vmm_reservation.tensor_over`, which also holds
the chunk bookkeeping): on CUDA/ROCm through DLPack (a capsule built with
ctypes; DLPack names the device explicitly, so no pointer query is made on a
range that may not be backed yet), on the host a ctypes buffer with
`torch.frombuffer`. Every such tensor keeps the reservation alive; the finalizer
(or `free()`) unmaps and releases everything.

Not thread-safe: one owner (the model runner) calls it.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from vllm.device_allocator.vmm import VmmDriver, round_up
from vllm.logger import init_logger
from vllm.utils.byte_ranges import merge_ranges, subtract_ranges
from vllm.utils.vmm_reservation import (
    Chunk,
    Reservation,
    map_chunk,
    release_reservation,
    tensor_over,
    unmap_chunks,
)

logger = init_logger(__name__)


class ExtensibleTensor:
    """A reservation of `capacity` bytes split into segments with growing committed prefixes.

    Args:
        segment_capacities: bytes each segment may grow to, in address order;
            segment `i` starts at `sum(segment_capacities[:i])`. Zero is allowed
            for a segment, but the total must be positive.
        driver: the VMM backend (`current_platform.get_vmm_driver()`); its
            `probe()` must have returned None.

    Raises:
        ValueError: an empty list, a negative capacity, a zero total.
        TypeError: a capacity that is not an int.
        VmmError: the driver could not reserve the address range.

    Nothing is committed at construction: `physical_bytes == 0`. Use
    `ExtensibleTensor.from_capacity(size, num_segments, driver)` for equal segments.
    """

    def __init__(self, segment_capacities: Sequence[int], driver: VmmDriver) -> None:
        caps = [_as_size("segment capacity", i, c) for i, c in enumerate(segment_capacities)]
        if not caps:
            raise ValueError("segment_capacities is empty: need at least one segment")
        if sum(caps) == 0:
            raise ValueError(f"segment_capacities {caps} sum to 0 bytes: nothing to reserve")
        self._driver = driver
        self._g = driver.granularity
        self._caps = tuple(caps)
        offsets, total = [], 0
        for c in caps:
            offsets.append(total)
            total += c
        self._offsets = tuple(offsets)
        self._capacity = total
        self._sizes = [0] * len(caps)  # committed prefix of each segment, bytes
        self._saved_sizes: list[int] | None = None  # set while released
        self._res = Reservation(driver, round_up(total, self._g))
        self._finalizer = weakref.finalize(
            self._res, release_reservation, driver, self._res.va, self._res.size,
            self._res.chunks,
        )
        self._finalizer.atexit = False  # process exit returns everything anyway
        self._freed = False
        self._full = tensor_over(self._res.va, total, driver.device, self._res)

    @classmethod
    def from_capacity(
        cls, capacity_bytes: int, num_segments: int, driver: VmmDriver
    ) -> ExtensibleTensor:
        """`num_segments` equal segments of `capacity_bytes // num_segments` bytes each.

        Raises:
            ValueError: `capacity_bytes` is not a positive multiple of `num_segments`.
        """
        capacity_bytes = _as_size("capacity_bytes", None, capacity_bytes)
        num_segments = _as_size("num_segments", None, num_segments)
        if num_segments == 0 or capacity_bytes == 0 or capacity_bytes % num_segments:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} must be a positive multiple of "
                f"num_segments={num_segments}"
            )
        return cls([capacity_bytes // num_segments] * num_segments, driver)

    # ----------------------------------------------------------------- queries

    @property
    def device(self) -> torch.device:
        return self._driver.device

    @property
    def driver(self) -> VmmDriver:
        return self._driver

    @property
    def granularity(self) -> int:
        """Commit unit in bytes."""
        return self._g

    @property
    def capacity(self) -> int:
        """Sum of the segment capacities in bytes (what `full_view()` spans)."""
        return self._capacity

    @property
    def reserved_bytes(self) -> int:
        """Address space reserved: the capacity rounded up to the granularity."""
        return self._res.size

    @property
    def base(self) -> int:
        """Address of byte 0; equals `full_view().data_ptr()` for the object's lifetime."""
        return self._res.va

    @property
    def num_segments(self) -> int:
        return len(self._caps)

    @property
    def segment_capacities(self) -> tuple[int, ...]:
        return self._caps

    @property
    def segment_offsets(self) -> tuple[int, ...]:
        """Byte offset of each segment from the base."""
        return self._offsets

    @property
    def segment_sizes(self) -> tuple[int, ...]:
        """Committed prefix of each segment in bytes (all 0 while released)."""
        return tuple(self._sizes)

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical memory mapped (whole granules; shared granules once)."""
        return sum(c.count for c in self._res.chunks) * self._g

    @property
    def num_physical_chunks(self) -> int:
        """Number of driver allocations currently mapped."""
        return len(self._res.chunks)

    def physical_chunks(self) -> list[tuple[int, int]]:
        """(byte offset from base, bytes) of each mapped allocation, in address order."""
        return sorted((c.first * self._g, c.count * self._g) for c in self._res.chunks)

    @property
    def released_bytes(self) -> int:
        """Bytes `recommit_()` maps again (0 unless released): the committed prefixes
        held at release, each rounded up to whole granules (a granule shared by two
        segments counts twice, so this may exceed the need by one granule per segment)."""
        if self._saved_sizes is None:
            return 0
        return sum(-(-size // self._g) * self._g for size in self._saved_sizes)

    @property
    def is_released(self) -> bool:
        """True between `release_physical()` and the next successful commit."""
        return self._saved_sizes is not None

    @property
    def is_freed(self) -> bool:
        return self._freed

    def full_view(self) -> torch.Tensor:
        """uint8 tensor `[capacity]` over the whole reservation; `data_ptr() == base` forever.

        For address arithmetic only: bytes outside the committed prefixes are not
        backed, and touching them is a bug (see the module docstring).
        """
        self._check_alive()
        return self._full

    def segment_view(self, index: int) -> torch.Tensor:
        """uint8 tensor `[segment_sizes[index]]` over exactly the committed prefix of a segment.

        Its storage spans that prefix too (`untyped_storage().nbytes() ==
        segment_sizes[index]`); `data_ptr()` is `base + segment_offsets[index]`
        on every call. Views taken before a growth keep their old extent: take
        new ones after `grow_segments_`.

        Raises:
            IndexError: no such segment.
        """
        self._check_alive()
        if not 0 <= index < len(self._caps):
            raise IndexError(f"segment index {index} out of range for {len(self._caps)} segments")
        start, size = self._offsets[index], self._sizes[index]
        if size == 0:
            return self._full[start:start]
        # A tensor of its own over the committed prefix, so that its storage
        # (`untyped_storage().nbytes()`) is exactly the committed bytes: code
        # that sizes memory from a storage never reaches uncommitted pages.
        # Same address every time (the base never moves).
        return tensor_over(self._res.va + start, size, self._driver.device, self._res)

    # ----------------------------------------------------------------- growth

    def grow_segments_(self, sizes: Sequence[int], zero_new: bool = True) -> None:
        """Grow each segment's committed prefix to `sizes[i]` bytes (grow-only).

        Maps the missing granules of each growing segment as ONE driver
        allocation (driver cost is per call, not per byte), then zeroes the bytes
        that became part of a prefix when `zero_new` (skipped where the driver
        guarantees fresh pages read zero, i.e. on the host, whose driver makes
        committed pages resident itself). Equal sizes are a no-op.

        On a driver failure part-way (e.g. out of memory) everything this call
        mapped is unmapped and released again, sizes are unchanged, and the
        error is re-raised: nothing leaks.

        Args:
            sizes: one byte count per segment, `committed <= sizes[i] <= capacity`.
            zero_new: zero newly exposed bytes. Without it their contents are
                undefined on GPUs (host pages are always zero).

        Raises:
            ValueError: wrong number of sizes, a negative size, a size beyond the
                segment's capacity, or a size below what is committed (shrinking).
            TypeError: a size that is not an int.
            VmmError: the driver failed (after rolling back this call).
            RuntimeError: used after `free()`.
        """
        self._check_alive()
        new = self._validate_sizes(sizes)
        old = list(self._sizes)
        plan = self._plan_growth(old, new)
        created: list[Chunk] = []
        try:
            for chunk in plan:
                map_chunk(self._driver, self._res.va, self._g, chunk)
                created.append(chunk)
        except BaseException:
            try:
                unmap_chunks(self._driver, self._res.va, self._g, created)
            except Exception as cleanup_error:  # report, but keep the original error
                logger.error("ExtensibleTensor: rollback after a failed commit failed: %s",
                             cleanup_error)
            raise
        self._res.chunks.extend(created)
        self._res.chunks.sort(key=lambda c: c.first)
        if zero_new and not self._driver.fresh_pages_zeroed:
            self._zero_ranges(old, new)
        self._sizes = new
        self._saved_sizes = None

    def _validate_sizes(self, sizes: Sequence[int]) -> list[int]:
        sizes = list(sizes)
        if len(sizes) != len(self._caps):
            raise ValueError(
                f"expected {len(self._caps)} sizes (one per segment), got {len(sizes)}"
            )
        out = []
        for i, s in enumerate(sizes):
            s = _as_size("size", i, s)
            if s > self._caps[i]:
                raise ValueError(
                    f"segment {i}: size {s} bytes exceeds its capacity {self._caps[i]} bytes"
                )
            if s < self._sizes[i]:
                raise ValueError(
                    f"segment {i}: size {s} bytes is below its committed size "
                    f"{self._sizes[i]} bytes; grow_segments_ only grows "
                    "(release_physical() drops everything)"
                )
            out.append(s)
        return out

    def _granule_span(self, segment: int, size: int) -> tuple[int, int]:
        start = self._offsets[segment]
        return start // self._g, -(-(start + size) // self._g)

    def _plan_growth(self, old: list[int], new: list[int]) -> list[Chunk]:
        """Chunks to map so every new prefix is backed, each granule mapped once."""
        mapped = merge_ranges([(c.first, c.first + c.count) for c in self._res.chunks])
        plan: list[Chunk] = []
        for i, (before, after) in enumerate(zip(old, new, strict=True)):
            if after == before or after == 0:
                continue
            lo, hi = self._granule_span(i, after)
            for a, b in subtract_ranges(lo, hi, mapped):
                plan.append(Chunk(segment=i, first=a, count=b - a, handle=None))
                mapped = merge_ranges(mapped + [(a, b)])
        return plan

    def _zero_ranges(self, old: list[int], new: list[int]) -> None:
        """Zero [offset_i + old_i, offset_i + new_i) per segment, adjacent ranges merged."""
        ranges = [
            (self._offsets[i] + o, self._offsets[i] + n)
            for i, (o, n) in enumerate(zip(old, new, strict=True)) if n > o
        ]
        for a, b in merge_ranges(ranges):
            self._full[a:b].zero_()

    def shrink_segments_(self, sizes: Sequence[int]) -> int:
        """Shrink each segment's committed prefix to `sizes[i]` bytes; release whole tail chunks.

        The elastic KV cache's shrink. Exposed sizes drop to `sizes`; a driver
        allocation ("chunk") is unmapped and released when it lies wholly in
        its segment beyond the new prefix (a chunk cannot be partly unmapped,
        on GPUs as here), so callers shrink to an earlier growth's size to
        return memory. Addresses never move; bytes below `sizes[i]` are kept.
        Waits for device work first.

        Returns:
            bytes released.

        Raises:
            ValueError: wrong number of sizes, or a size above what is committed.
            RuntimeError: released (asleep) or used after `free()`.
            VmmError: the driver failed (chunks released so far stay released).
        """
        self._check_alive()
        if self._saved_sizes is not None:
            raise RuntimeError("shrink_segments_() on a released tensor: recommit_() first")
        sizes = [_as_size("size", i, s) for i, s in enumerate(sizes)]
        if len(sizes) != len(self._caps):
            raise ValueError(
                f"expected {len(self._caps)} sizes (one per segment), got {len(sizes)}"
            )
        for i, (new, old) in enumerate(zip(sizes, self._sizes, strict=True)):
            if new > old:
                raise ValueError(
                    f"segment {i}: size {new} bytes is above its committed size {old} bytes; "
                    "shrink_segments_ only shrinks (grow_segments_ grows)"
                )
        g = self._g
        # Views shrink first, so none ever covers an unmapped byte.
        self._sizes = sizes
        doomed = [
            c for c in self._res.chunks
            if c.first * g >= self._offsets[c.segment] + sizes[c.segment]
            and (c.first + c.count) * g <= self._offsets[c.segment] + self._caps[c.segment]
        ]
        if not doomed:
            return 0
        self._driver.synchronize()
        released = 0
        for chunk in sorted(doomed, key=lambda c: -c.first):
            self._driver.unmap(self._res.va + chunk.first * g, chunk.count * g)
            self._res.chunks.remove(chunk)  # unmapped: no longer backs anything
            self._driver.release(chunk.handle)
            released += chunk.count * g
        return released

    # ------------------------------------------------------ release / recommit

    def release_physical(self) -> None:
        """Drop every physical page and keep the address range (sleep).

        Waits for device work first (nothing may touch the pages while they go).
        Afterwards every `segment_view` is empty and `physical_bytes == 0`; the
        previous sizes are remembered for `recommit_()`. A second call is a no-op.
        """
        self._check_alive()
        if self._saved_sizes is not None:
            return
        self._driver.synchronize()
        # Views shrink first, so none ever covers an unmapped byte, even if an
        # unmap fails part-way (a later recommit_ maps only what is missing).
        self._saved_sizes = self._sizes
        self._sizes = [0] * len(self._caps)
        unmap_chunks(self._driver, self._res.va, self._g, self._res.chunks)

    def recommit_(self, zero_new: bool = True) -> None:
        """Map fresh pages for the sizes held before `release_physical()` (wake).

        Same addresses, same sizes, contents zero (with `zero_new`); one driver
        allocation per non-empty segment. On failure the tensor stays released
        and the call can be retried.

        Raises:
            RuntimeError: nothing was released, or used after `free()`.
            VmmError: the driver failed (after rolling back this call).
        """
        self._check_alive()
        if self._saved_sizes is None:
            raise RuntimeError("recommit_() needs a prior release_physical(); nothing is released")
        self.grow_segments_(self._saved_sizes, zero_new=zero_new)

    def defragment_(self, zero_new: bool = True) -> None:
        """Remap each segment as a single allocation; CONTENTS ARE DISCARDED.

        For connectors that register one memory region per segment (RDMA). The
        caller must hold nothing in the tensor. Sizes and addresses are kept;
        afterwards `num_physical_chunks` is one per non-empty segment (a segment
        lying wholly inside a granule already mapped for its neighbour needs
        none). A released tensor stays released.
        """
        self._check_alive()
        if self._saved_sizes is not None:
            return
        self.release_physical()
        self.recommit_(zero_new=zero_new)

    def free(self) -> None:
        """Unmap, release and unreserve everything now. Safe to call twice.

        Every tensor obtained from this object becomes invalid (touching one is
        a use-after-free). Without `free()`, the same happens when the object
        and all tensors over it are garbage collected.
        """
        if self._freed:
            return
        self._freed = True
        self._full = None  # type: ignore[assignment]
        self._finalizer()

    def _check_alive(self) -> None:
        if self._freed:
            raise RuntimeError(
                f"ExtensibleTensor used after free() (capacity {self._capacity} bytes, "
                f"{len(self._caps)} segments)"
            )

    def __repr__(self) -> str:
        return (
            f"ExtensibleTensor(device={self.device}, capacity={self._capacity}, "
            f"segments={len(self._caps)}, sizes={list(self._sizes)}, "
            f"physical_bytes={self.physical_bytes}, chunks={self.num_physical_chunks}, "
            f"released={self.is_released}, freed={self._freed})"
        )


class ExtensibleReserve:
    """A `reserve(size, num_segments)` hook that backs an allocation with an ExtensibleTensor.

    Passed down, once, to an allocator that would otherwise `torch.zeros` its
    backing (`allocate_and_reshape_kv_cache(..., reserve=...)`): calling it
    reserves `size` bytes as `num_segments` equal segments, commits the first
    `prefix_bytes` of every segment (zeroed), and returns the `ExtensibleTensor`,
    which the allocator hands back to its caller to grow, release and free.
    Nothing here knows what the bytes hold.

    Args:
        driver: the VMM backend (probe passed).
        prefix_bytes: bytes to commit at the start of each segment (>= 0).
    """

    def __init__(self, driver: VmmDriver, prefix_bytes: int) -> None:
        self.driver = driver
        self.prefix_bytes = _as_size("prefix_bytes", None, prefix_bytes)

    def __call__(self, size: int, num_segments: int) -> ExtensibleTensor:
        """A new reservation of `size` bytes in `num_segments`, each prefix committed.

        Raises:
            ValueError / VmmError: as `ExtensibleTensor.from_capacity` and `grow_segments_`
                (nothing stays reserved then).
        """
        tensor = ExtensibleTensor.from_capacity(size, num_segments, self.driver)
        try:
            tensor.grow_segments_([self.prefix_bytes] * num_segments)
        except BaseException:
            tensor.free()
            raise
        return tensor


# ------------------------------------------------------------------ helpers


def _as_size(what: str, index: int | None, value: Any) -> int:
    where = f"segment {index}: " if index is not None else ""
    if isinstance(value, bool):
        raise TypeError(f"{where}{what} must be an int number of bytes, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{where}{what} must be an int number of bytes, got {type(value).__name__} {value!r}"
        ) from None
    if value < 0:
        raise ValueError(f"{where}{what} {value} is negative")
    return value

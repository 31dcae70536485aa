"""The KV cache object: one backing allocation, its per-layer views, and what is committed.

Every KV cache is a `KVCacheBuffers`; the worker holds one and never asks which:

    KVCacheBuffers                 views, committed_blocks, capacity_blocks,
       |                           committed_bytes, reserved_bytes, committed_spans(),
       |                           allocate, extend_kv_cache, release / recommit, free
       +-- ClassicKVCacheBuffers     torch.zeros of the final size; capacity == committed
       +-- ExtensibleKVCacheBuffers  an ExtensibleTensor reserved for the capacity;
                                     a committed prefix of every segment that grows

Allocation walks strictly downward, through the one seam:

    KVCacheBuffers.allocate(n)
      -> allocate_and_reshape_kv_cache(kv_cache_config, device, reserve=None | ExtensibleReserve)
           -> reserve(size, num_segments)          (vllm/utils/extensible_tensor.py)
                -> ExtensibleTensor -> VmmDriver   (vllm/device_allocator)
           -> reshape_kv_cache(_segments)(config, backing | its segments, n)
                                                   (vllm/v1/kv_cache_interface.py)
      <- KVCacheAllocation(backing, views)         the object keeps both

Extensible growth maps new pages at the end of every segment under the same
addresses (a block keeps its address for the engine's life), rebuilds the
per-layer views over the committed bytes (same data pointers, larger first
dimension), and so leaves CUDA graphs captured earlier valid:

    segment (layer) i:  [ blk0 | blk1 | ... | blk n-1 |..... reserved, unmapped .....]
                        ^ base + i * capacity * block_stride   (fixed forever)
                        |<--- committed: n * block_stride --->|

Which block counts to use is decided in `kv_cache_sizing.py`, never here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm.device_allocator.vmm import VmmDriver
from vllm.utils.extensible_tensor import ExtensibleReserve, ExtensibleTensor
from vllm.v1.kv_cache_interface import KVCacheConfig, reshape_kv_cache, reshape_kv_cache_segments
from vllm.v1.outputs import KVCacheMemory


class Reservation(Protocol):
    """What a `reserve` hook returns: an address range cut into equal segments, each
    backed by a committed prefix (`ExtensibleTensor`)."""

    def segment_view(self, index: int) -> torch.Tensor:
        """uint8 view of segment `index` whose storage is its committed prefix."""


# reserve(size_bytes, num_segments) -> the reservation (`ExtensibleReserve`).
ReserveFn = Callable[[int, int], Reservation]


@dataclass(frozen=True)
class KVCacheAllocation:
    """What the allocation seam returns: the memory and the per-layer views over it.

    Attributes:
        backing: the zeroed uint8 tensor [size_bytes] (no `reserve`), or the
            reservation `reserve` returned; its owner keeps it to grow,
            release and free it.
        views: layer name -> view [num_blocks, 2, block_size, num_kv_heads,
            head_size] over the first `num_blocks` blocks.
    """

    backing: torch.Tensor | Reservation
    views: dict[str, torch.Tensor]


def allocate_and_reshape_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device | str,
    reserve: ReserveFn | None = None,
    *,
    num_blocks: int | None = None,
) -> KVCacheAllocation:
    """Allocate the one backing range; return it with the per-layer views over it.

    The single allocation seam of the KV cache: the classic cache passes no
    `reserve` (a zeroed `torch.zeros`), the extensible one an
    `ExtensibleReserve` hook, so the strategy is handed down once and nothing
    below calls back up; the caller gets back both what holds the memory and
    the views, so it rebuilds nothing.

    Args:
        kv_cache_config: the placement; the allocation spans `size_bytes`.
        device: where the default allocation goes.
        reserve: `reserve(size_bytes, num_segments) -> Reservation`, whose
            segment views cover each segment's committed prefix. None: a
            plain zeroed `torch.zeros(size_bytes, dtype=uint8)`.
        num_blocks: committed blocks per layer the views cover (default: all
            `kv_cache_config.num_blocks`); with `reserve` only this prefix of
            each segment may be backed, so views must not reach past it.

    Raises:
        ValueError: `reserve` returned no reservation, or num_blocks is out of
            range (see `reshape_kv_cache`).
    """
    size = kv_cache_config.size_bytes
    n = kv_cache_config.num_blocks if num_blocks is None else num_blocks
    if reserve is None:
        backing = torch.zeros(size, dtype=torch.uint8, device=device)
        return KVCacheAllocation(backing, reshape_kv_cache(kv_cache_config, backing, n))
    num_segments = kv_cache_config.num_segments
    reservation = reserve(size, num_segments)
    if not callable(getattr(reservation, "segment_view", None)):
        raise ValueError(
            f"reserve({size}, {num_segments}) returned {type(reservation).__name__}, "
            "expected a reservation with segment_view(index)"
        )
    segments = [reservation.segment_view(i) for i in range(num_segments)]
    return KVCacheAllocation(reservation,
                             reshape_kv_cache_segments(kv_cache_config, segments, n))


def spans_of_views(views: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(base address, length in bytes) of each contiguous byte range the views cover, sorted.

    Derived from the views' data pointers, shapes and strides (a view's
    storage is its own segment's committed prefix, so storages alone would
    not say which views are adjacent). Overlapping or
    touching ranges are merged: one span for a fully backed allocation, one per
    committed segment prefix for a grown one.
    """
    ranges = []
    for view in views.values():
        if view.numel() == 0:
            continue
        itemsize = view.element_size()
        shape_strides = zip(view.shape, view.stride(), strict=True)
        last = sum((size - 1) * stride for size, stride in shape_strides)
        ranges.append((view.data_ptr(), view.data_ptr() + (last + 1) * itemsize))
    spans: list[list[int]] = []
    for start, end in sorted(ranges):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(start, end - start) for start, end in spans]


COPY_BLOCKS_TEMP_BYTES = 16 << 20  # the most one gather of `copy_kv_blocks` holds


def copy_kv_blocks(views: dict[str, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """view[dst[i]] = view[src[i]] in every layer's view (the elastic cache's block move).

    Enqueued on the current stream, so it runs after the step launched
    before it (which may still write the sources) and before the next one.
    Sources and destinations must not overlap. The gather goes through a
    temporary of at most `COPY_BLOCKS_TEMP_BYTES` per launch: the cache is
    moved when memory is short.

    Args:
        views: layer name -> [num_blocks, 2, block_size, num_kv_heads, head_size].
        src, dst: block ids, pairwise, the same length.

    Raises:
        ValueError: the lists differ in length or overlap.
    """
    if len(src) != len(dst) or set(src) & set(dst):
        raise ValueError(f"copy_kv_blocks needs pairwise disjoint ids, got {len(src)} sources "
                         f"and {len(dst)} destinations")
    if not src or not views:
        return
    device = next(iter(views.values())).device
    pin = device.type == "cuda"
    ids = torch.tensor([src, dst], dtype=torch.int64)
    ids = (ids.pin_memory() if pin else ids).to(device, non_blocking=pin)
    for view in views.values():
        block_bytes = view[0].numel() * view.element_size()
        step = max(1, COPY_BLOCKS_TEMP_BYTES // block_bytes)
        for start in range(0, len(src), step):
            s, d = ids[0, start:start + step], ids[1, start:start + step]
            view.index_copy_(0, d, view.index_select(0, s))


class KVCacheBuffers(ABC):
    """The KV cache's memory: per-layer views over the committed blocks of one allocation.

    Args:
        kv_cache_config: the layout at the *capacity* (`num_blocks` = the most
            blocks the allocation can ever commit).
        device: the device the views live on.

    Attributes:
        views: layer name -> view [committed_blocks, 2, block_size, num_kv_heads,
            head_size]; empty until `allocate`.
        committed_blocks: blocks backed by memory, counting the null block; the
            block pool may hand out ids below it.
    """

    def __init__(self, kv_cache_config: KVCacheConfig, device: torch.device) -> None:
        self.config = kv_cache_config
        self.device = device
        self.views: dict[str, torch.Tensor] = {}
        self.committed_blocks = 0

    @property
    def capacity_blocks(self) -> int:
        """The most blocks this cache can commit (its layout's `num_blocks`)."""
        return self.config.num_blocks

    @property
    @abstractmethod
    def committed_bytes(self) -> int:
        """Physical bytes backing the cache now (0 while released)."""

    @property
    @abstractmethod
    def reserved_bytes(self) -> int:
        """Address space the cache spans (== committed_bytes for a fully backed cache)."""

    @property
    @abstractmethod
    def is_released(self) -> bool:
        """True between `release()` and `recommit()` (sleep)."""

    @property
    def released_bytes(self) -> int:
        """Bytes `recommit()` maps (0 unless released; a classic cache never is)."""
        return 0

    @property
    def granularity(self) -> int:
        """Bytes each segment's commit rounds up to (1: a fully backed cache commits exactly)."""
        return 1

    @abstractmethod
    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Back the cache and commit its first `num_blocks` blocks; returns the views."""

    @abstractmethod
    def extend_kv_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Commit blocks up to `num_blocks` under the same addresses; returns the new views.

        Equal counts are a no-op. Raises ValueError past the capacity or below
        what is committed. (Releasing free tail blocks while serving, the
        elastic cache's shrink, is `ExtensibleKVCacheBuffers.release_tail_blocks`.)
        """

    @abstractmethod
    def release(self) -> None:
        """Drop the physical pages and keep every address (sleep); contents are lost."""

    @abstractmethod
    def recommit(self) -> None:
        """Fresh zeroed pages for the blocks held before `release` (wake)."""

    @abstractmethod
    def free(self) -> None:
        """Return everything now; the views become invalid. Safe to call twice."""

    def committed_spans(self) -> list[tuple[int, int]]:
        """(base address, length in bytes) of each committed region, from the views.

        What a KV connector registers: one span for a fully backed allocation,
        one per committed segment prefix for a grown one (see `spans_of_views`).
        Empty while released.
        """
        return [] if self.is_released else spans_of_views(self.views)

    @property
    def num_allocations(self) -> int:
        """Physical allocations under the committed spans (1 for the classic cache)."""
        return 1 if self.views else 0

    def defragment(self) -> None:
        """Make each segment one physical allocation; CONTENTS ARE DISCARDED.

        For connectors that register one region per segment over a transport
        that cannot span several allocations (UCX with cuMemCreate handles).
        Only while the cache holds no live KV: the worker calls it before the
        scheduler exists. A no-op for a cache that is one allocation already.
        """
        return None

    @property
    def rdma_unsupported_reason(self) -> str | None:
        """Why the pages are not GPUDirect-RDMA capable, or None (capable or not applicable)."""
        return None

    def memory(self) -> KVCacheMemory:
        """Committed blocks and their bytes (blocks x bytes per block; 0 while released),
        reserved and physical bytes, for metrics (see `KVCacheMemory`)."""
        block_bytes = self.config.block_stride * self.config.num_segments
        committed = 0 if self.is_released else self.committed_blocks * block_bytes
        return KVCacheMemory(committed, self.reserved_bytes, self.committed_blocks,
                             physical_bytes=self.committed_bytes, block_bytes=block_bytes)


class ClassicKVCacheBuffers(KVCacheBuffers):
    """vLLM's KV cache: one `torch.zeros` of the final size, allocated before warmup.

    Capacity and committed blocks are the same number; it can neither grow
    nor release its memory (sleep needs the extensible cache).
    """

    @property
    def committed_bytes(self) -> int:
        return self.config.size_bytes if self.views else 0

    @property
    def reserved_bytes(self) -> int:
        return self.committed_bytes

    @property
    def is_released(self) -> bool:
        return False

    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Allocate all `num_blocks` (== the capacity) blocks, zeroed.

        Raises:
            ValueError: num_blocks differs from the layout's capacity.
            RuntimeError: allocated already.
        """
        if self.views:
            raise RuntimeError("the KV cache is already allocated")
        if num_blocks != self.capacity_blocks:
            raise ValueError(
                f"the classic KV cache allocates its whole layout: {num_blocks} blocks asked, "
                f"the layout has {self.capacity_blocks}"
            )
        self.views = allocate_and_reshape_kv_cache(self.config, self.device).views
        self.committed_blocks = num_blocks
        return self.views

    def extend_kv_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        if num_blocks != self.committed_blocks:
            raise ValueError(
                f"the classic KV cache has a fixed size of {self.committed_blocks} blocks; "
                f"it cannot change to {num_blocks} (the extensible KV cache can grow)"
            )
        return self.views

    def release(self) -> None:
        raise RuntimeError(
            "the classic KV cache cannot release its memory: sleep needs "
            "enable_sleep_mode=True and the extensible KV cache"
        )

    def recommit(self) -> None:
        self.release()

    def free(self) -> None:
        self.views = {}
        self.committed_blocks = 0


class ExtensibleKVCacheBuffers(KVCacheBuffers):
    """The extensible KV cache: a reservation for the capacity, a growing committed prefix.

    Args:
        kv_cache_config: the layout at the capacity (the most blocks that could
            ever fit); reserving it costs address space only.
        driver: the platform's VMM driver (probe passed).
        device: the device the views live on.
    """

    def __init__(
        self, kv_cache_config: KVCacheConfig, driver: VmmDriver, device: torch.device
    ) -> None:
        super().__init__(kv_cache_config, device)
        self.driver = driver
        self.tensor: ExtensibleTensor | None = None

    @property
    def granularity(self) -> int:
        """The VMM driver's allocation granularity, bytes (2 MiB on the H200 and the host)."""
        return self.driver.granularity

    @property
    def block_stride(self) -> int:
        return self.config.block_stride

    @property
    def num_segments(self) -> int:
        return self.config.num_segments

    @property
    def committed_bytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.physical_bytes

    @property
    def reserved_bytes(self) -> int:
        """Address space reserved (the layout's bytes rounded up to the granularity)."""
        if self.tensor is not None:
            return self.tensor.reserved_bytes
        return -(-self.config.size_bytes // self.granularity) * self.granularity

    @property
    def is_released(self) -> bool:
        return self.tensor is not None and self.tensor.is_released

    @property
    def released_bytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.released_bytes

    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Reserve the capacity and commit the first `num_blocks` blocks of every segment.

        Raises:
            RuntimeError: allocated already.
            ValueError: num_blocks outside [1, capacity].
            VmmError: the driver could not reserve or commit.
        """
        if self.tensor is not None:
            raise RuntimeError("the KV cache reservation already exists")
        self._check_range(num_blocks)
        reserve = ExtensibleReserve(self.driver, num_blocks * self.block_stride)
        allocation = allocate_and_reshape_kv_cache(self.config, self.device, reserve,
                                                   num_blocks=num_blocks)
        self.tensor = allocation.backing
        self.committed_blocks = num_blocks
        self.views = allocation.views
        return self.views

    def extend_kv_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """Grow every segment to `num_blocks` blocks (new bytes zero) under the same base.

        Raises:
            ValueError: more blocks than the capacity, or fewer than committed.
            RuntimeError: not allocated, or released (asleep).
            VmmError: the driver failed (nothing from this call stays mapped).
        """
        tensor = self._allocated()
        if tensor.is_released:
            raise RuntimeError("the KV cache is released (asleep): recommit() it before growing")
        self._check_range(num_blocks)
        if num_blocks < self.committed_blocks:
            raise ValueError(
                f"extend_kv_cache only grows: {num_blocks} blocks < {self.committed_blocks} "
                f"committed"
            )
        tensor.grow_segments_([num_blocks * self.block_stride] * self.num_segments)
        self.committed_blocks = num_blocks
        self.views = self._committed_views()
        return self.views

    @property
    def num_allocations(self) -> int:
        return 0 if self.tensor is None else self.tensor.num_physical_chunks

    def defragment(self) -> None:
        self._allocated().defragment_()

    @property
    def rdma_unsupported_reason(self) -> str | None:
        return getattr(self.driver, "rdma_unsupported_reason", None)

    def release_tail_blocks(self, num_blocks: int) -> int:
        """Shrink every segment to `num_blocks` blocks; release the whole chunks beyond.

        The elastic cache's shrink: blocks `num_blocks ..` must hold nothing
        (the block pool gave them up first). Memory returns in whole driver
        allocations, so the caller shrinks to an earlier growth's count. Live
        blocks never move; the views are rebuilt at the same addresses.

        Returns:
            bytes released.

        Raises:
            ValueError: below 1 block or above what is committed.
            RuntimeError: not allocated, or released (asleep).
        """
        tensor = self._allocated()
        if not 1 <= num_blocks <= self.committed_blocks:
            raise ValueError(
                f"release_tail_blocks({num_blocks}): must be in [1, {self.committed_blocks}] "
                f"(the committed blocks)"
            )
        released = tensor.shrink_segments_([num_blocks * self.block_stride] * self.num_segments)
        self.committed_blocks = num_blocks
        self.views = self._committed_views()
        return released

    def _committed_views(self) -> dict[str, torch.Tensor]:
        """Per-layer views whose storage is their segment's committed prefix.

        Same data pointers as before every growth (the base never moves), so
        captured CUDA graphs stay valid; new tensor objects, so that
        `untyped_storage().nbytes()` of a view is the committed bytes of its
        segment (`committed_blocks x block_stride`), never the reservation.
        """
        tensor = self._allocated()
        segments = [tensor.segment_view(i) for i in range(self.num_segments)]
        return reshape_kv_cache_segments(self.config, segments, self.committed_blocks)

    def release(self) -> None:
        self._allocated().release_physical()

    def recommit(self) -> None:
        self._allocated().recommit_()

    def free(self) -> None:
        self.views = {}
        if self.tensor is not None:
            self.tensor.free()
            self.tensor = None
        self.committed_blocks = 0

    def _allocated(self) -> ExtensibleTensor:
        if self.tensor is None:
            raise RuntimeError("the KV cache is not allocated yet: allocate() first")
        return self.tensor

    def _check_range(self, num_blocks: int) -> None:
        if not 1 <= num_blocks <= self.capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} KV blocks: the reservation holds "
                f"{self.capacity_blocks} (and block 0, the null block, is always committed)"
            )

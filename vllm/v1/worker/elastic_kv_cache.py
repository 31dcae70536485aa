"""The worker side of the elastic KV cache: commit and release blocks while serving.

The policy (when to grow, when to shrink) lives in `vllm/v1/core/elastic.py`
and runs in the engine core between steps; this module only does what it is
asked, within what is true on this device now:

    grow(n)    commit up to n blocks, but only into memory free at this moment
               less a headroom (`kv_cache_sizing.elastic_growth_blocks`) and
               never past the limit (gpu_memory_utilization x total, the use
               cap, a runtime limit); returns the count it reached
    shrink(n)  release the tail blocks n.. (the block pool gave them up
               first); memory returns in whole driver allocations

    blocks:  [0 null | 1 .. floor-1 | floor .. b1-1 | b1 .. b2-1 | ........ limit)
              committed at start-up  growth 1        growth 2     never beyond
                                     (one chunk per segment each; a shrink
                                      releases the last growth's chunks)

Live blocks never move and the base address never changes, so CUDA graphs
captured at start-up stay valid (nothing is re-captured: growth and shrink
happen between steps, outside any graph).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm.device_allocator.vmm import VmmError
from vllm.logger import init_logger
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker.kv_cache import ExtensibleKVCacheBuffers
from vllm.v1.worker.memory import DeviceMemory

logger = init_logger(__name__)
GiB = sizing.GiB


@dataclass(frozen=True)
class ElasticBounds:
    """Block counts of an elastic cache, counting the null block.

    Attributes:
        floor: committed at start-up, never released.
        limit: the most it may hold (runtime-adjustable, never above `max_limit`).
        max_limit: gpu_memory_utilization x total (or kv_cache_memory_bytes),
            the use cap and the reservation, as sized after warmup.
        chunk: the least one growth adds.
    """

    floor: int
    limit: int
    max_limit: int
    chunk: int


def _alone(num_blocks: int) -> int:
    """The agreement of one rank: its own count."""
    return num_blocks


class ElasticKVCache:
    """Grows and shrinks one `ExtensibleKVCacheBuffers` within the device's free memory.

    Args:
        kv_cache: the extensible cache (allocated, warmup blocks committed).
        memory: the worker's device-memory reader (free memory now).
        max_limit: blocks the sizing after warmup allows at most.
        max_blocks_per_request: blocks one max_model_len sequence needs.
        agree: takes this rank's block count, returns the one every rank uses
            (the Worker's `agree_num_blocks`, a collective with several ranks;
            default: this rank's own). The floor and every runtime limit pass
            through it, so every rank holds the same bounds.
    """

    def __init__(
        self, kv_cache: ExtensibleKVCacheBuffers, memory: DeviceMemory, max_limit: int,
        max_blocks_per_request: int, agree: Callable[[int], int] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.memory = memory
        self.agree = agree or _alone
        config = kv_cache.config
        floor = sizing.elastic_floor_blocks(
            max_limit, max_blocks_per_request, config.block_stride, config.num_segments,
            kv_cache.granularity,
        )
        # This rank's floor fills its granules, and a granule holds a different
        # number of each rank's blocks (tensor parallelism splits the KV heads,
        # unevenly when they do not divide): the ranks agree on the smallest, as
        # on every block count. `max_limit` is agreed already, so the chunk is too.
        floor = self.agree(max(floor, kv_cache.committed_blocks))
        self.bounds = ElasticBounds(
            floor=floor, limit=max_limit, max_limit=max_limit,
            chunk=sizing.elastic_chunk_blocks(floor, max_limit),
        )

    def set_limit(self, limit_bytes: int | None) -> ElasticBounds:
        """Set the runtime limit in bytes (None: back to the start-up limit).

        Rounded down to whole blocks after granule rounding, clamped to
        [floor, max_limit], and agreed across ranks (the smallest: a rank's
        granule holds its own number of blocks). Does not shrink by itself: the
        policy releases free tail blocks above the limit when they are free.

        Raises:
            ValueError: a negative limit.
        """
        b = self.bounds
        if limit_bytes is None:
            limit = b.max_limit
        else:
            if limit_bytes < 0:
                raise ValueError(f"the KV cache limit must be >= 0 bytes, got {limit_bytes}")
            config = self.kv_cache.config
            limit = sizing.num_blocks_for_bytes(
                limit_bytes, config.block_stride, config.num_segments,
                self.kv_cache.granularity,
            )
            limit = min(max(limit, b.floor), b.max_limit)
        limit = self.agree(limit)  # every rank takes the same branch: a collective
        self.bounds = ElasticBounds(b.floor, limit, b.max_limit, b.chunk)
        logger.info("Elastic KV cache: limit set to %.2f GiB (%d blocks)",
                    self._bytes_for(limit) / GiB, limit)
        return self.bounds

    def grow(self, num_blocks: int) -> int:
        """Commit up to `num_blocks` blocks where memory is free now; returns the count reached."""
        kv = self.kv_cache
        before = kv.committed_blocks
        fits = sizing.elastic_growth_blocks(
            free=self.memory.free_bytes(), total=self.memory.total,
            committed_bytes=kv.committed_bytes, block_stride=kv.config.block_stride,
            num_segments=kv.config.num_segments, granularity=kv.granularity,
        )
        target = min(num_blocks, self.bounds.limit, kv.capacity_blocks, fits)
        if target <= before:
            return before
        bytes_before = kv.committed_bytes
        try:
            kv.extend_kv_cache(target)
        except VmmError as e:  # another process took the memory first: stay as we are
            logger.warning("Elastic KV cache: could not grow to %d blocks (%s)", target, e)
            return kv.committed_blocks
        logger.info("Elastic KV cache: grew %s (%d -> %d blocks)",
                    _change(bytes_before, kv.committed_bytes), before, target)
        return target

    def shrink(self, num_blocks: int) -> int:
        """Release blocks `num_blocks..` (free in the block pool); returns the count kept."""
        kv = self.kv_cache
        before, bytes_before = kv.committed_blocks, kv.committed_bytes
        num_blocks = max(num_blocks, self.bounds.floor)
        if num_blocks >= before:
            return before
        kv.release_tail_blocks(num_blocks)
        logger.info("Elastic KV cache: released %s (%d -> %d blocks)",
                    _change(bytes_before, kv.committed_bytes), before, num_blocks)
        return num_blocks

    def _bytes_for(self, num_blocks: int) -> int:
        config = self.kv_cache.config
        return sizing.committed_bytes_for_blocks(
            num_blocks, config.block_stride, config.num_segments, self.kv_cache.granularity
        )


def _change(before: int, after: int) -> str:
    """"0.06 -> 0.18 GiB", or what a change of blocks inside committed granules is."""
    if before == after:
        return f"{after / GiB:.2f} GiB unchanged: the blocks lie in granules already committed"
    return f"{before / GiB:.2f} -> {after / GiB:.2f} GiB"


class ElasticWorkerMixin:
    """The Worker's elastic-cache calls (reached through `collective_rpc`).

    Expects the Worker's `config`, `kv_cache`, `memory`, `model_runner`,
    `elastic`, `extend_kv_cache` and `agree_num_blocks` (every rank's bounds
    are agreed through it: the engine core's policy reads rank 0's).
    """

    def _start_elastic(self, limit: int) -> int:
        """Commit the elastic floor; `limit` (sized after warmup) bounds later growth."""
        cache = self.config.cache_config
        per_request = -(-self.config.model_config.max_model_len // cache.block_size)
        self.elastic = ElasticKVCache(
            self.kv_cache, self.memory, limit, per_request, agree=self.agree_num_blocks
        )
        floor = self.elastic.bounds.floor  # agreed across ranks
        self.extend_kv_cache(floor)
        logger.info(
            "Elastic KV cache: committed %.2f GiB (%d blocks) at start-up; grows while serving "
            "up to %d blocks, in chunks of %d blocks, into memory free at the time",
            self.kv_cache.committed_bytes / GiB, floor, limit, self.elastic.bounds.chunk,
        )
        return floor

    def elastic_kv_cache_bounds(self) -> ElasticBounds | None:
        """Floor, limit and chunk of the elastic cache; None when it is off."""
        return None if self.elastic is None else self.elastic.bounds

    def grow_kv_cache(self, num_blocks: int) -> int:
        """Commit up to `num_blocks` blocks where memory is free now; returns the count reached."""
        reached = self.elastic.grow(num_blocks)
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        return reached

    def shrink_kv_cache(self, num_blocks: int) -> int:
        """Release the (free) tail blocks `num_blocks..`; returns the count kept."""
        self.memory.synchronize()
        kept = self.elastic.shrink(num_blocks)
        self.model_runner.bind_kv_cache(self.kv_cache.views)
        return kept

    def set_kv_cache_limit(self, limit_bytes: int | None) -> ElasticBounds:
        """A runtime ceiling for the elastic cache, bytes (None: the start-up limit)."""
        if self.elastic is None:
            raise RuntimeError("a KV cache limit needs --enable-elastic-kv-cache")
        return self.elastic.set_limit(limit_bytes)

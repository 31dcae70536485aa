"""The worker side of the elastic KV cache: commit and release blocks while serving.

The policy (when to grow, when to shrink) is the scheduler's `ElasticKVPolicy`
(`vllm/v1/core/elastic.py`); the engine core carries its answer out between
steps (`EngineCore.adjust_kv_cache`). `ElasticKVCache` is a component of the
`Worker` (its `elastic` field) and only does what it is asked, within what is
true on this device now; the arithmetic of its floor, chunk and growth is here
too (the start-up sizing is kv_cache_sizing.py's):

    grow(n)    commit up to n blocks, but only into memory free at this moment
               less a headroom (`elastic_growth_blocks`) and
               never past the limit (gpu_memory_utilization x total, the use
               cap, a runtime limit); returns the count it reached
    grow_ahead(n)  the same on a helper thread (what serving uses): returns at
               once with the count usable now and whether a growth runs; the
               next call after it ended reports the new count, so the
               scheduler adopts the blocks at a step boundary and no step
               waits for the driver's create / map / set-access / zeroing;
               a growth commits one allocation per piece point it crosses
               (`growth_points`; a piece is an eighth of a chunk), so memory
               can go back a piece at a time
    shrink(n)  release the tail blocks n.. (the block pool gave them up
               first); memory returns in whole driver allocations

    blocks:  [0 null | 1 .. floor-1 | floor .. b1-1 | b1 .. b2-1 | ........ limit)
              committed at start-up  growth 1        growth 2     never beyond
                                     (one allocation per piece and segment;
                                      a shrink releases whole pieces)

Live blocks never move and the base address never changes, so CUDA graphs
captured at start-up stay valid (nothing is re-captured: growth and shrink
happen between steps, outside any graph; a background growth maps pages past
every block the scheduler hands out, and its blocks are handed out only
after it ended). Everything else (shrink, sync grow, limit, sleep) first
waits for a growth in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.device_allocator.vmm import VmmError
from vllm.logger import init_logger
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker.kv_cache import ExtensibleKVCacheBuffers
from vllm.v1.worker.memory import DeviceMemory

logger = init_logger(__name__)
GiB = sizing.GiB
MiB = sizing.MiB

# Elastic mode (docs/elastic_kv_cache.md). Growth goes only into memory that is
# free at that moment less this headroom, left for everyone else on the device
# (another engine's next step, a trainer's allocator, our own post-warmup
# allocations): 2 % of the device with a 256 MiB floor (2.8 GiB on an H200,
# ~0.5 GiB on a 24 GiB host); of an emulated device (`VLLM_EMULATED_DEVICE_GIB`,
# benchmark_elastic.py --device-gib), 2 % of its size (`memory.device_total`).
# A guess to be measured by benchmarks/benchmark_elastic.py, not a measured figure yet.
ELASTIC_HEADROOM_FRACTION = 0.02
ELASTIC_HEADROOM_FLOOR_BYTES = 256 * MiB

# The range between the floor and the limit is grown in this many chunks at
# most (a growth adds at least a chunk: few growths, each a step boundary the
# scheduler adopts).
ELASTIC_NUM_CHUNKS = 8
# Each chunk is committed in this many pieces, one driver allocation per segment
# each, and a piece is the unit a shrink returns (a driver allocation is
# released whole): a chunk of 7.7 GiB (the 8B shape's on a 58 GiB device) goes
# back in ~1 GiB steps. With whole chunks an engine holding 16 GiB could not
# release down to its 10.7 GiB fair share (its boundaries were 8.2 and 16 GiB)
# and its peer queued 23 s on an H100 (2026-12-07, issue #49). Commit cost is
# per call (~50 us per 2 MiB call, ~0.1-0.4 ms per 1-8 GiB call on the H200),
# paid on the growth's helper thread.
ELASTIC_PIECES_PER_CHUNK = 8


def growth_points(floor: int, piece: int, start: int, end: int) -> list[int]:
    """The piece points floor + k x piece strictly between `start` and `end` (block counts).

    A growth from `start` to `end` is committed in pieces ending at these points
    (each rounded up to whole granules by `ElasticKVCache`), so a
    shrink back to one of them returns the pieces above it: memory goes back a
    piece at a time, not only a whole growth (a 40 GiB burst growth could
    otherwise only go back whole).
    """
    k = max((start - floor) // piece + 1, 1)
    return list(range(floor + k * piece, end, piece))


def elastic_headroom_bytes(total: int) -> int:
    """Memory an elastic cache leaves free when it grows: max(2 % of total, 256 MiB)."""
    return max(int(ELASTIC_HEADROOM_FRACTION * total), ELASTIC_HEADROOM_FLOOR_BYTES)


def elastic_floor_blocks(
    limit: int, max_blocks_per_request: int, block_stride: int, num_segments: int,
    granularity: int,
) -> int:
    """Blocks an elastic cache commits at start-up and never releases.

    One request of `max_model_len` tokens (plus the null block) fits without
    growing, up to the end of the granules it occupies, and never more than
    `limit`:

        floor = min(limit, sizing.blocks_filling_granules(max_blocks_per_request + 1))

    This is one rank's floor: a granule holds a different number of each
    rank's blocks when tensor parallelism gives the ranks different shares of
    the KV heads, so the worker passes it through the agreement across ranks
    (the smallest, `min_across_ranks`) before committing it.
    """
    wanted = sizing.blocks_filling_granules(
        max_blocks_per_request + 1, block_stride, num_segments, granularity
    )
    return max(min(limit, wanted), sizing.WARMUP_NUM_BLOCKS)


def elastic_chunk_blocks(floor: int, limit: int) -> int:
    """Blocks one growth adds at least: ceil((limit - floor) / ELASTIC_NUM_CHUNKS), >= 1."""
    return max(-(-(limit - floor) // ELASTIC_NUM_CHUNKS), 1)


def elastic_piece_blocks(chunk: int) -> int:
    """Blocks of one driver allocation of a growth (the least a shrink returns):
    chunk // ELASTIC_PIECES_PER_CHUNK, >= 1; a piece ends on whole granules, so a
    piece smaller than a granule's blocks merges with the next."""
    return max(chunk // ELASTIC_PIECES_PER_CHUNK, 1)


def elastic_growth_blocks(
    *, free: int, total: int, committed_bytes: int, block_stride: int, num_segments: int,
    granularity: int,
) -> int:
    """The most blocks the cache may hold if it grows now into free memory less the headroom.

        blocks = sizing.num_blocks_for_bytes(committed_bytes + free - headroom)

    Args:
        free: free device memory now, bytes.
        total: device memory, bytes (sizes the headroom): `DeviceMemory.total`, an
            emulated device's size where one is set.
        committed_bytes: bytes the cache holds now (granule-rounded).

    Returns:
        blocks (counting the null block); may be below what is committed when
        memory is short (then the cache does not grow).
    """
    room = committed_bytes + free - elastic_headroom_bytes(total)
    return sizing.num_blocks_for_bytes(room, block_stride, num_segments, granularity)


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

    @property
    def piece(self) -> int:
        """Blocks of one driver allocation (see `elastic_piece_blocks`)."""
        return elastic_piece_blocks(self.chunk)


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
        thread_init: run first on the growth thread (makes the device current
            there); default: nothing.
    """

    def __init__(
        self, kv_cache: ExtensibleKVCacheBuffers, memory: DeviceMemory, max_limit: int,
        max_blocks_per_request: int, agree: Callable[[int], int] | None = None,
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.memory = memory
        self.agree = agree or _alone
        self._growth: threading.Thread | None = None
        self._blocks_before_growth = 0
        # Counts at which the driver allocations of growths end, ascending: a shrink to
        # one of them returns everything above it (the policy's boundaries).
        self.piece_ends: list[int] = []
        self.thread_init = thread_init or (lambda: None)
        config = kv_cache.config
        floor = elastic_floor_blocks(
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
            chunk=elastic_chunk_blocks(floor, max_limit),
        )

    def set_limit(self, limit_blocks: int | None) -> ElasticBounds:
        """Set the runtime limit in blocks (None: back to the start-up limit).

        The engine converts the user's bytes (blocks' bytes summed over the ranks,
        the unit /metrics and `vllm kv-top` report) into one count for every rank.
        Clamped to [floor, max_limit] and agreed across ranks (the smallest). Does
        not shrink by itself: the policy releases the blocks above the limit once
        those in use fit below.

        Raises:
            ValueError: a count that is negative or not an int.
        """
        self.wait_for_growth()
        b = self.bounds
        if limit_blocks is None:
            limit = b.max_limit
        else:
            if not isinstance(limit_blocks, int) or isinstance(limit_blocks, bool) \
                    or limit_blocks < 0:
                raise ValueError(f"a KV cache limit is a block count >= 0, got {limit_blocks!r}")
            limit = min(max(limit_blocks, b.floor), b.max_limit)
        limit = self.agree(limit)  # every rank takes the same branch: a collective
        self.bounds = ElasticBounds(b.floor, limit, b.max_limit, b.chunk)
        logger.info("Elastic KV cache: limit set to %.2f GiB (%d blocks)",
                    self._bytes_for(limit) / GiB, limit)
        return self.bounds

    def grow(self, num_blocks: int) -> int:
        """Commit up to `num_blocks` blocks where memory is free now; returns the count reached."""
        self.wait_for_growth()
        target = self._growth_target(num_blocks)
        if target is not None:
            self._extend(target)
        return self.kv_cache.committed_blocks

    def grow_ahead(self, num_blocks: int) -> tuple[int, bool]:
        """Start committing up to `num_blocks` on a helper thread, unless one runs.

        Returns:
            (blocks committed and usable now, whether a growth is in flight).
            A growth that ended since the last call is included in the count.
        """
        if self._growth is not None:
            if self._growth.is_alive():
                return self._blocks_before_growth, True
            self.wait_for_growth()
        target = self._growth_target(num_blocks)
        if target is None:
            return self.kv_cache.committed_blocks, False
        self._blocks_before_growth = self.kv_cache.committed_blocks
        self._growth = threading.Thread(target=self._grow_on_thread, args=(target,),
                                        name="elastic-kv-growth", daemon=True)
        self._growth.start()
        return self._blocks_before_growth, True

    def wait_for_growth(self) -> None:
        """Wait for a growth in flight to end (a failure was logged by it)."""
        if self._growth is not None:
            self._growth.join()
            self._growth = None

    def _grow_on_thread(self, target: int) -> None:
        try:
            self.thread_init()
            self._extend(target)
        except BaseException as e:  # reported by the log; the count stays
            logger.warning("Elastic KV cache: growth to %d blocks failed (%s)", target, e)

    def _growth_target(self, num_blocks: int) -> int | None:
        """The count to commit now (what fits into free memory, within the limits), or
        None when that is not more than what is committed."""
        kv = self.kv_cache
        fits = elastic_growth_blocks(
            free=self.memory.free_bytes(), total=self.memory.total,
            committed_bytes=kv.committed_bytes, block_stride=kv.config.block_stride,
            num_segments=kv.config.num_segments, granularity=kv.granularity,
        )
        bound = min(self.bounds.limit, kv.capacity_blocks, fits)
        # Up to the end of the granules the growth commits anyway: those blocks cost no
        # more bytes, and every growth then ends on a granule, so the shrink back to
        # it releases memory (a shrink inside a granule released nothing, issue #48).
        target = min(sizing.blocks_filling_granules(
            min(num_blocks, bound), kv.config.block_stride, kv.config.num_segments,
            kv.granularity), bound)
        return target if target > kv.committed_blocks else None

    def _extend(self, target: int) -> None:
        kv = self.kv_cache
        before, bytes_before = kv.committed_blocks, kv.committed_bytes
        start = time.perf_counter()
        config, b = kv.config, self.bounds
        # One driver allocation per piece point crossed (the policy's boundaries), so a
        # shrink can return a piece at a time; each piece ends on whole granules.
        pieces = [sizing.blocks_filling_granules(p, config.block_stride, config.num_segments,
                                                 kv.granularity)
                  for p in growth_points(b.floor, b.piece, before, target)]
        for piece in [p for p in pieces if before < p < target] + [target]:
            if piece <= kv.committed_blocks:
                continue
            try:
                kv.extend_kv_cache(piece)
            except VmmError as e:  # another process took the memory first: keep what we have
                logger.warning("Elastic KV cache: could not grow to %d blocks (%s)", piece, e)
                break
            self.piece_ends.append(piece)
        if kv.committed_blocks == before:
            return
        where = "on a helper thread" if threading.current_thread() is self._growth else "now"
        logger.info("Elastic KV cache: grew %s (%d -> %d blocks) in %.1f ms, %s",
                    _change(bytes_before, kv.committed_bytes), before, kv.committed_blocks,
                    (time.perf_counter() - start) * 1e3, where)

    def shrink(self, num_blocks: int) -> int:
        """Release blocks `num_blocks..` (free in the block pool); returns the count kept."""
        self.wait_for_growth()
        kv = self.kv_cache
        before, bytes_before = kv.committed_blocks, kv.committed_bytes
        num_blocks = max(num_blocks, self.bounds.floor)
        if num_blocks >= before:
            return before
        kv.release_tail_blocks(num_blocks)
        self.piece_ends = [e for e in self.piece_ends if e <= num_blocks]
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

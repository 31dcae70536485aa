"""The worker's elastic cache with several ranks: every rank holds the same bounds.

Two ranks of one tensor-parallel engine on real host pages, as SmolLM2's 3 KV
heads split at TP=2: rank 0 holds 2 heads, rank 1 one, so rank 0's blocks are
twice rank 1's and a 2 MiB granule holds 128 of its blocks against 256 of rank
1's. The agreement is a fake all-gather over threads (the Worker's is
`ranks.agree_on_num_blocks` over the world group).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_cache_config
from vllm.v1.worker import kv_cache_sizing as sizing
from vllm.v1.worker.elastic_kv_cache import (
    ElasticBounds,
    ElasticKVCache,
    elastic_floor_blocks,
    growth_points,
)
from vllm.v1.worker.kv_cache import ExtensibleKVCacheBuffers

MiB = 1 << 20
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
CAPACITY = 512
LIMIT = 384  # agreed after warmup (rank 0's capacity bounds it in the engine)
PER_REQUEST = 32  # max_model_len 512 / block_size 16


class FakeWorld:
    """min over every rank's count, once all of them have proposed one."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.proposals: dict[int, int] = {}
        self.rounds: list[list[int]] = []

    def agree(self, rank: int):
        def call(num_blocks: int) -> int:
            self.proposals[rank] = num_blocks
            if self.barrier.wait() == 0:
                self.rounds.append([self.proposals[r] for r in sorted(self.proposals)])
            agreed = min(self.proposals.values())
            self.barrier.wait()
            return agreed
        return call


class Memory:
    total = 64 << 30

    def free_bytes(self) -> int:
        return 32 << 30


def _cache(num_kv_heads: int) -> ExtensibleKVCacheBuffers:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=num_kv_heads, head_size=64,
                             dtype=torch.float32)
    config = get_kv_cache_config({name: spec for name in LAYERS}, CAPACITY)
    kv = ExtensibleKVCacheBuffers(config, HostVmmDriver(), torch.device("cpu"))
    kv.allocate(sizing.WARMUP_NUM_BLOCKS)
    return kv


def _on_both_ranks(fn):
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(fn, [0, 1]))


def test_ranks_with_different_block_sizes_agree_on_floor_chunk_and_limit():
    caches = [_cache(2), _cache(1)]
    try:
        own = [elastic_floor_blocks(LIMIT, PER_REQUEST, kv.config.block_stride,
                                           kv.config.num_segments, kv.granularity)
               for kv in caches]
        assert own == [128, 256]  # each rank's floor fills its own granules
        world = FakeWorld(2)
        elastic = _on_both_ranks(lambda r: ElasticKVCache(
            caches[r], Memory(), LIMIT, PER_REQUEST, agree=world.agree(r)))
        assert world.rounds == [[128, 256]]
        assert [e.bounds for e in elastic] == [ElasticBounds(128, LIMIT, LIMIT, 32)] * 2

        # A count in blocks (the engine converts the user's bytes into one count for
        # all ranks): each rank clamps what it is given to its bounds (rank 1: 384 at
        # most) and the ranks agree on the smallest.
        bounds = _on_both_ranks(lambda r: elastic[r].set_limit([256, 512][r]))
        assert world.rounds[-1] == [256, LIMIT]
        assert bounds == [ElasticBounds(128, 256, LIMIT, 32)] * 2
        bounds = _on_both_ranks(lambda r: elastic[r].set_limit(None))
        assert bounds == [ElasticBounds(128, LIMIT, LIMIT, 32)] * 2

        # Grow and shrink then move both ranks alike (the engine core asks both
        # for one count, and takes the smallest reached): asked for 160, each rank
        # grows to the end of the granules that commits (256 here: rank 0's second
        # granule, inside rank 1's first), back to the floor, never below it.
        assert [e.grow(160) for e in elastic] == [256, 256]
        assert [kv.committed_blocks for kv in caches] == [256, 256]
        assert [e.shrink(64) for e in elastic] == [128, 128]
        assert [kv.committed_blocks for kv in caches] == [128, 128]
    finally:
        for kv in caches:
            kv.free()


def test_one_rank_keeps_its_own_floor():
    kv = _cache(1)
    try:
        assert ElasticKVCache(kv, Memory(), LIMIT, PER_REQUEST).bounds.floor == 256
    finally:
        kv.free()


def test_a_growth_commits_a_piece_per_eighth_chunk_and_shrinks_back_by_pieces():
    """Issue #49: memory goes back a piece (an eighth of a chunk, whole granules) at a
    time, not only a whole growth or chunk. 64 KiB blocks (8 KV heads): a 2 MiB host
    granule holds 32 of them; the chunk is 40 blocks, a piece 5, so every granule
    the growth crosses ends a piece."""
    assert growth_points(85, 32, 85, 200) == [117, 149, 181]
    assert growth_points(85, 32, 100, 149) == [117]  # strictly between start and end
    kv = _cache(8)
    try:
        cache = ElasticKVCache(kv, Memory(), LIMIT, PER_REQUEST)
        floor, b = cache.bounds.floor, cache.bounds
        assert (floor, b.chunk, b.piece) == (64, 40, 5)
        allocations = kv.num_allocations
        assert cache.grow(LIMIT) == LIMIT
        # One piece per granule crossed: twice the chunks' count (the chunk points
        # alone, rounded to granules, would have been 8 pieces).
        assert cache.piece_ends == list(range(96, LIMIT + 1, 32))
        pieces = len(cache.piece_ends)
        assert pieces == 10 and kv.num_allocations - allocations == pieces * len(LAYERS)
        # Back to an inner piece end: the pieces above it go, the ones below stay.
        keep = cache.piece_ends[1]
        full = kv.tensor.physical_bytes
        assert cache.shrink(keep) == keep
        assert kv.num_allocations - allocations == 2 * len(LAYERS)
        assert kv.tensor.physical_bytes == full - (pieces - 2) * 2 * MiB * len(LAYERS)
        assert cache.piece_ends == [96, 128]
    finally:
        kv.free()

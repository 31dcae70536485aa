"""BlockPool: exact block ids, reference counts, eviction order, growth."""

import pytest

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import hash_block_tokens


def _ids(blocks):
    return [b.block_id for b in blocks]


def _free_ids(pool):
    return _ids(pool.free_block_queue.get_all_free_blocks())


def _hashes(n):
    """n chained block hashes over distinct content."""
    out, parent = [], None
    for i in range(n):
        parent = hash_block_tokens(parent, [i] * 4)
        out.append(parent)
    return out


def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block():
    pool = BlockPool(6, enable_caching=True)
    assert pool.num_blocks == 6 and pool.get_num_free_blocks() == 5
    blocks = pool.get_new_blocks(3)
    assert _ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert _free_ids(pool) == [4, 5]
    assert pool.get_usage() == pytest.approx(3 / 5)
    assert _ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match="cannot get 1 new blocks: only 0 are free"):
        pool.get_new_blocks(1)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    assert pool.null_block not in pool.free_block_queue


def test_free_order_is_eviction_order():
    pool = BlockPool(6, enable_caching=False)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(reversed(a))  # tail first, as KVCacheManager.free does
    assert _free_ids(pool) == [4, 5, 3, 2, 1]
    assert [b.ref_cnt for b in a] == [0, 0, 0]
    assert _ids(pool.get_new_blocks(4)) == [4, 5, 3, 2]


def test_shared_block_returns_to_queue_only_at_zero_refs():
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b not in pool.free_block_queue
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and _free_ids(pool) == [2, 3, 1]
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free_blocks([b])


def test_cache_hit_revives_free_block_from_middle_of_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    hashes = _hashes(3)
    pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_cached_block(hashes[2]) is None  # block 3 not full yet
    pool.free_blocks(reversed(blocks))
    assert _free_ids(pool) == [4, 5, 3, 2, 1]
    # A freed block keeps its hash and can be revived.
    hit = pool.get_cached_block(hashes[1])
    assert hit is blocks[1] and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and _free_ids(pool) == [4, 5, 3, 1]
    assert hit.block_hash == hashes[1]


def test_eviction_takes_least_recently_freed_and_drops_its_hash():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    hashes = _hashes(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks(reversed(blocks))  # queue: 3, 2, 1
    (evicted,) = pool.get_new_blocks(1)
    assert evicted.block_id == 3 and evicted.block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert set(pool.cached_block_hash_to_block) == {hashes[0], hashes[1]}


def test_cache_full_blocks_is_incremental_and_keeps_every_duplicate():
    pool = BlockPool(8, enable_caching=True)
    hashes = _hashes(3)
    a = pool.get_new_blocks(3)
    pool.cache_full_blocks(a, hashes, 0, 1)
    pool.cache_full_blocks(a, hashes, 1, 3)
    assert [b.block_hash for b in a] == hashes
    # Another request computed the same first block into its own block: both copies
    # are cached (vLLM's BlockHashToBlockMap), the first registered answers lookups.
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, hashes, 0, 1)
    assert b[0].block_hash == hashes[0] and pool.get_cached_block(hashes[0]) is a[0]
    assert sorted(blk.block_id for h, blk in pool.cached_block_hash_to_block.items()
                  if h == hashes[0]) == [a[0].block_id, b[0].block_id]
    with pytest.raises(ValueError, match="needs 4 blocks and hashes, got 3 blocks and 3 hashes"):
        pool.cache_full_blocks(a, hashes, 0, 4)


def test_evicting_one_copy_leaves_the_other_to_hit():
    """Two requests computed the same two blocks at once (issue 16: vLLM keeps both
    copies, so after the older copy is evicted the prefix still hits in full)."""
    pool = BlockPool(6, enable_caching=True)
    hashes = _hashes(2)
    a = pool.get_new_blocks(2)  # 1, 2
    b = pool.get_new_blocks(2)  # 3, 4
    pool.cache_full_blocks(a, hashes, 0, 2)
    pool.cache_full_blocks(b, hashes, 0, 2)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))  # queue: 5, 2, 1, 4, 3
    taken = pool.get_new_blocks(3)  # 5, then a's copies 2 and 1 are evicted
    assert [blk.block_id for blk in taken] == [5, 2, 1]
    assert [pool.get_cached_block(h) for h in hashes] == [b[0], b[1]]
    (evicted,) = pool.get_new_blocks(1)  # b's tail copy: only that hash goes
    assert evicted is b[1] and pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is b[0]
    assert list(pool.cached_block_hash_to_block) == [hashes[0]]


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, _hashes(2), 0, 2)
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in blocks)


def test_null_block_ignored_by_touch_and_free():
    pool = BlockPool(3, enable_caching=True)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and _free_ids(pool) == [1, 2]


def test_reset_prefix_cache_only_when_nothing_in_use():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = _hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert _free_ids(pool) == [3, 2, 1]  # queue order untouched


def test_grow_appends_new_blocks_at_queue_tail_and_keeps_state():
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    hashes = _hashes(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks([blocks[1]])  # queue: 4, 2 (2 cached)
    pool.touch([blocks[0]])  # block 1 ref 2
    pool.resize(8)
    assert pool.num_blocks == 8
    assert _ids(pool.blocks) == list(range(8))
    assert _free_ids(pool) == [4, 2, 5, 6, 7]
    assert [b.ref_cnt for b in blocks] == [2, 0, 1]
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.get_cached_block(hashes[1]) is blocks[1]
    assert pool.get_usage() == pytest.approx(2 / 7)
    pool.resize(8)  # same size: no-op
    assert pool.num_blocks == 8
    # Shrinking drops free tail blocks only (the elastic cache); block 3 is in use.
    with pytest.raises(ValueError, match="from 8 to 3 blocks: 1 of the tail blocks are in use "
                                         r"\(first: block 3\)"):
        pool.resize(3)
    assert pool.num_blocks == 8 and _free_ids(pool) == [4, 2, 5, 6, 7]
    assert pool.num_free_tail_blocks() == 4  # 7, 6, 5, 4
    pool.resize(6)
    assert _ids(pool.blocks) == list(range(6)) and _free_ids(pool) == [4, 2, 5]


def test_shrink_evicts_cached_tail_blocks_and_prefer_below_empties_the_tail():
    pool = BlockPool(9, enable_caching=True)
    blocks = pool.get_new_blocks(8)  # 1..8
    hashes = _hashes(8)
    pool.cache_full_blocks(blocks, hashes, 0, 8)
    pool.free_blocks(reversed(blocks))  # queue: 8, 7, ..., 1, all cached
    pool.resize(6)  # drops 6, 7, 8 and their cache entries
    assert _free_ids(pool) == [5, 4, 3, 2, 1]
    assert [pool.get_cached_block(h) is not None for h in hashes] == [True] * 5 + [False] * 3
    pool.resize(9)  # grows back: fresh blocks without hashes at the queue tail
    assert _free_ids(pool) == [5, 4, 3, 2, 1, 6, 7, 8]
    pool.free_blocks(pool.get_new_blocks(3))  # 5, 4, 3 taken and freed (evicted)
    assert _free_ids(pool) == [2, 1, 6, 7, 8, 5, 4, 3]
    # Prefer ids below 6: 6, 7, 8 are passed over (to the tail) while lower ones are free.
    pool.prefer_blocks_below(6)
    assert _ids(pool.get_new_blocks(4)) == [2, 1, 5, 4]
    assert _free_ids(pool) == [3, 6, 7, 8]
    assert _ids(pool.get_new_blocks(2)) == [3, 6]  # then higher ones, when lower run out
    assert pool.num_free_tail_blocks() == 2


def test_pool_of_only_the_null_block_grows():
    pool = BlockPool(1, enable_caching=True)
    assert pool.get_num_free_blocks() == 0 and pool.get_usage() == 0.0
    pool.resize(3)
    assert _ids(pool.get_new_blocks(2)) == [1, 2]
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(0, enable_caching=True)


def test_free_tail_count_matches_a_walk_under_random_takes_frees_touches_and_resizes():
    """num_free_tail_blocks (a lazy max-heap of taken ids, no walk over the pool)
    agrees with the definition after every operation."""
    import random

    def walk(pool):
        n = 0
        for block in reversed(pool.blocks):
            if block.is_null or block.ref_cnt:
                break
            n += 1
        return n

    rng = random.Random(7)
    pool = BlockPool(num_blocks=40, enable_caching=False)
    held: list = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and pool.get_num_free_blocks():
            held += pool.get_new_blocks(rng.randint(1, min(4, pool.get_num_free_blocks())))
        elif op < 0.65 and held:
            pool.free_blocks([held.pop(rng.randrange(len(held)))])
        elif op < 0.75 and held:  # a second reference, as a prefix-cache hit takes
            block = rng.choice(held)
            pool.touch([block])
            held.append(block)
        elif op < 0.85:
            pool.resize(pool.num_blocks + rng.randint(1, 8))
        elif op < 0.95:
            tail = pool.num_free_tail_blocks()
            pool.resize(pool.num_blocks - rng.randint(0, tail))
        else:
            pool.prefer_blocks_below(rng.choice([None, pool.num_blocks // 2]))
        assert pool.num_free_tail_blocks() == walk(pool)
    assert len(pool._taken_ids) <= 2 * pool.num_blocks + 64 + 4  # stale entries are bounded


def test_moving_blocks_below_a_count_carries_references_and_cache_entries():
    """The elastic cache empties its tail by moving: each destination (a free block below
    the count, a cached one evicted) takes its source's references and prefix-cache
    entry; each source is free, so the tail can be dropped."""
    pool = BlockPool(10, enable_caching=True)
    blocks = pool.get_new_blocks(9)  # 1..9
    hashes = _hashes(2)
    pool.cache_full_blocks([blocks[7], blocks[8]], hashes, 0, 1)  # block 8 cached
    pool.cache_full_blocks(blocks[:3], _hashes(3), 0, 3)  # 1, 2, 3 cached
    pool.touch([blocks[8]])  # block 9 shared by two holders
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])  # free below 6: 3, 1, 2 (cached)
    pool.free_blocks([blocks[5]])  # 6 free too, above the count
    moved = pool.move_blocks_below([blocks[7], blocks[8]], 6)  # 8 and 9 -> 3 and 1
    assert _ids(moved) == [3, 1]
    assert [b.ref_cnt for b in moved] == [1, 2]
    assert pool.get_cached_block(hashes[0]) is moved[0]  # the entry moved with the bytes
    assert blocks[7].block_hash is None and blocks[7].ref_cnt == 0 == blocks[8].ref_cnt
    assert pool.get_cached_block(_hashes(3)[2]) is None  # 3's own entry was evicted
    assert _free_ids(pool) == [2, 6, 8, 9]
    assert pool.num_free_tail_blocks() == 2  # 8, 9 (7 was below the count, in use)
    pool.resize(8)
    assert pool.get_num_free_blocks() == 2  # 2 and 6
    with pytest.raises(ValueError, match="only 1 free blocks lie there"):
        pool.move_blocks_below([blocks[4], blocks[6]], 5)  # 5 and 7; below 5 only 2 free
    with pytest.raises(ValueError, match=r"cannot move blocks \[2\]"):
        pool.move_blocks_below([blocks[1]], 1)  # free

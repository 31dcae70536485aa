"""KVCacheManager: allocation, prefix-cache hits, freeing order, stats and sizes."""

import pytest

from tests.v1.core.fake_runner import make_request
from vllm.v1.core.kv_cache_manager import KVCacheManager


def _ids(blocks):
    return [b.block_id for b in blocks]


def _free_ids(manager):
    return _ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def _manager(num_blocks=16, enable_caching=True, max_model_len=64):
    return KVCacheManager(
        num_blocks, block_size=4, enable_caching=enable_caching, max_model_len=max_model_len
    )


def _admit(manager, request, num_new_tokens=None):
    """What the scheduler does for a waiting request: look up, allocate, advance."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new = manager.allocate_slots(request, num_new_tokens, num_hit, hits)
    if new is not None:
        request.num_computed_tokens = num_hit + num_new_tokens
    return hits, num_hit, new


def test_allocate_prefill_then_decode_grows_at_block_boundaries():
    m = _manager()
    req = make_request("a", 10)
    _, _, new = _admit(m, req)
    assert _ids(new) == [1, 2, 3]  # 10 tokens -> 3 blocks of 4
    req.append_output_token_ids(500)  # 11 tokens, 10 computed
    assert m.allocate_slots(req, 1) == []  # position 10 still fits block 3
    req.num_computed_tokens = 11
    req.append_output_token_ids(501)
    assert m.allocate_slots(req, 1) == []  # position 11 is the last slot of block 3
    req.num_computed_tokens = 12
    req.append_output_token_ids(502)
    assert _ids(m.allocate_slots(req, 1)) == [4]  # position 12 opens block 4
    assert m.get_block_ids("a") == [1, 2, 3, 4]
    assert m.get_num_free_blocks() == 11
    assert m.usage == pytest.approx(4 / 15)


def test_not_enough_blocks_returns_none_and_changes_nothing():
    m = _manager(num_blocks=5)  # 4 usable
    a = make_request("a", 12)
    _admit(m, a)  # blocks 1, 2, 3
    b = make_request("b", 8)
    assert m.allocate_slots(b, 8) is None
    assert m.get_block_ids("b") == [] and "b" not in m.req_to_blocks
    assert m.get_num_free_blocks() == 1
    assert _ids(m.allocate_slots(b, 4)) == [4]  # one block does fit
    with pytest.raises(ValueError, match="num_new_tokens must be >= 1, got 0"):
        m.allocate_slots(b, 0)


def test_prefix_hit_shares_blocks_and_counts_references():
    m = _manager()
    a = make_request("a", list(range(10)))
    _admit(m, a)  # blocks 1, 2, 3; full blocks 1, 2 cached at allocation
    b = make_request("b", list(range(8)) + [77, 78, 79])
    hits, num_hit, new = _admit(m, b)
    assert _ids(hits) == [1, 2] and num_hit == 8
    assert _ids(new) == [4]
    assert m.get_block_ids("b") == [1, 2, 4]
    assert [blk.ref_cnt for blk in m.block_pool.blocks[1:5]] == [2, 2, 1, 1]
    stats = m.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 10 + 11, 8)
    assert stats.hit_rate == pytest.approx(8 / 21)


def test_full_hit_leaves_the_last_token_to_compute():
    m = _manager()
    a = make_request("a", list(range(8)))
    _admit(m, a)  # two full blocks, both cached
    b = make_request("b", list(range(8)))
    hits, num_hit, new = _admit(m, b)
    # At most 7 tokens may hit, so only whole blocks within 7 tokens: one block.
    assert _ids(hits) == [1] and num_hit == 4
    assert _ids(new) == [3]
    assert m.get_block_ids("b") == [1, 3]


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    m = _manager()
    _admit(m, make_request("a", list(range(12))))
    b = make_request("b", list(range(12)), prompt_logprobs=1)
    hits, num_hit, new = _admit(m, b)
    assert hits == [] and num_hit == 0 and _ids(new) == [4, 5, 6]
    assert (m.prefix_cache_stats.requests, m.prefix_cache_stats.queries) == (1, 12)


def test_hits_in_free_queue_count_against_free_blocks():
    m = _manager(num_blocks=5)  # 4 usable
    a = make_request("a", list(range(8)) + [9])
    _admit(m, a)  # blocks 1, 2 (cached), 3
    m.free(a)  # queue: 4, 3, 2, 1 with 1, 2 cached
    b = make_request("b", list(range(8)) + [50] * 9)  # 17 tokens: 5 blocks, 2 of them hits
    hits, num_hit = m.get_computed_blocks(b)
    assert _ids(hits) == [1, 2] and num_hit == 8
    # 3 new blocks needed; 4 are free but 2 of those are the hits themselves.
    assert m.allocate_slots(b, 9, num_hit, hits) is None
    assert [blk.ref_cnt for blk in hits] == [0, 0] and m.get_num_free_blocks() == 4
    assert m.prefix_cache_stats.requests == 1  # the failed attempt is not counted


def test_free_releases_tail_first_and_keeps_hashes_for_reuse():
    m = _manager(num_blocks=8)
    a = make_request("a", list(range(13)))
    _admit(m, a)  # 1, 2, 3, 4
    m.free(a)
    assert _free_ids(m) == [5, 6, 7, 4, 3, 2, 1]
    assert m.get_block_ids("a") == []
    # New unrelated work evicts the tail block 4 and the uncached ones first.
    c = make_request("c", [900] * 16)
    _, _, new = _admit(m, c)
    assert _ids(new) == [5, 6, 7, 4]
    b = make_request("b", list(range(13)))
    hits, num_hit, _ = _admit(m, b)
    assert _ids(hits) == [1, 2, 3] and num_hit == 12


def test_decode_tokens_get_cached_when_their_block_fills():
    m = _manager()
    a = make_request("a", list(range(6)))
    _admit(m, a)  # blocks 1, 2; block 1 cached
    assert m.num_cached_block["a"] == 1
    for tok in (6, 7):
        a.append_output_token_ids(tok)
        m.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    # Token 7 was appended but only computed in the step that just got scheduled; the
    # block holding positions 4..7 is full once that step runs.
    assert a.num_tokens == 8 and m.num_cached_block["a"] == 2
    b = make_request("b", list(range(8)) + [1])
    hits, num_hit = m.get_computed_blocks(b)
    assert _ids(hits) == [1, 2] and num_hit == 8


def test_caching_disabled_never_hits():
    m = _manager(enable_caching=False)
    _admit(m, make_request("a", list(range(12))))
    hits, num_hit, new = _admit(m, make_request("b", list(range(12))))
    assert hits == [] and num_hit == 0 and _ids(new) == [4, 5, 6]
    assert m.prefix_cache_stats.queries == 0


def test_slots_capped_at_max_model_len():
    m = _manager(max_model_len=10)
    req = make_request("a", 10)
    _, _, new = _admit(m, req)
    assert _ids(new) == [1, 2, 3]
    assert m.max_blocks_per_request == 3


def test_resize_and_reset_passthrough():
    m = _manager(num_blocks=3)
    a = make_request("a", list(range(8)))
    _admit(m, a)
    assert m.allocate_slots(make_request("b", 4), 4) is None
    m.resize(5)
    assert m.num_blocks == 5 and m.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match="cannot shrink the block pool from 5 to 2 blocks"):
        m.resize(2)  # block 2 belongs to a
    m.resize(3)  # 3 and 4 were free
    assert m.num_blocks == 3
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheManager(4, 0, True, 16)


def test_moving_blocks_below_rewrites_every_holder_and_keeps_foreign_holders_blocks():
    """`move_blocks_below` (the elastic cache's release without preemption): the blocks
    the listed requests hold above the count get ids below it, in place in each holder's
    list (a shared block once, for both); a block another request shares stays."""
    m = _manager(num_blocks=16)
    filler = make_request("f", list(range(500, 524)))
    _admit(m, filler)  # 1..6
    a = make_request("a", list(range(12)))
    _admit(m, a)  # 7, 8, 9
    b = make_request("b", list(range(8)) + [50, 51])
    _admit(m, b)  # hits 7, 8; new 10
    c = make_request("c", list(range(100, 106)))
    _admit(m, c)  # 11, 12
    m.free(filler)  # 1..6 free
    src, dst = m.move_blocks_below(9, ["a", "b"])
    assert src == [9, 10]
    assert m.get_block_ids("a") == [7, 8, dst[0]] and m.get_block_ids("b") == [7, 8, dst[1]]
    assert all(d < 9 for d in dst) and m.block_pool.blocks[dst[0]].ref_cnt == 1
    # Blocks 7 and 8 are below the count; c (not listed) keeps 11, 12.
    assert m.get_block_ids("c") == [11, 12]
    # A block c shares with a listed request does not move.
    d = make_request("d", list(range(100, 104)) + [9, 9])
    _admit(m, d)  # hits 11, new 13
    assert m.get_block_ids("d") == [11, 13]
    src, dst = m.move_blocks_below(11, ["d"])
    assert src == [13] and m.get_block_ids("d") == [11, dst[0]]
    assert m.num_blocks_in_use() == 16 - 1 - m.get_num_free_blocks()

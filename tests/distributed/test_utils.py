"""How heads and sizes split over tensor-parallel ranks (pure arithmetic)."""

from __future__ import annotations

import pytest

from vllm.distributed.utils import (
    HeadShard,
    divide,
    get_distributed_init_method,
    partition_attention_heads,
)


def shards(heads, kv_heads, tp):
    return [partition_attention_heads(heads, kv_heads, tp, r) for r in range(tp)]


def test_even_split_is_vllms():
    assert shards(32, 8, 4) == [HeadShard(8 * r, 8, 2 * r, 2) for r in range(4)]


def test_uneven_split_follows_kv_groups():
    # SmolLM2-135M at TP=2: 9 query heads in 3 groups of 3.
    assert shards(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]
    # 5 KV heads over 3 ranks: 2 + 2 + 1, query heads with them.
    assert shards(10, 5, 3) == [HeadShard(0, 4, 0, 2), HeadShard(4, 4, 2, 2), HeadShard(8, 2, 4, 1)]


def test_kv_heads_replicated_when_fewer_than_ranks():
    # 1 KV head, 4 ranks: every rank holds it, query heads split evenly.
    assert shards(8, 1, 4) == [HeadShard(2 * r, 2, 0, 1) for r in range(4)]
    # 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0, ranks 2-3 KV head 1.
    assert [s.kv_start for s in shards(8, 2, 4)] == [0, 0, 1, 1]


def test_every_head_held_exactly_once():
    for heads, kv, tp in [(9, 3, 2), (9, 3, 3), (12, 4, 3), (14, 7, 4), (40, 8, 3)]:
        got = shards(heads, kv, tp)
        q = [h for s in got for h in range(s.q_start, s.q_start + s.num_heads)]
        kv_ids = [h for s in got for h in range(s.kv_start, s.kv_start + s.num_kv_heads)]
        assert q == list(range(heads)) and kv_ids == list(range(kv))


def test_impossible_splits_say_why():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) is larger than "
                                         r"num_key_value_heads \(3\) but not a multiple"):
        partition_attention_heads(9, 3, 4, 0)
    with pytest.raises(ValueError, match=r"num_attention_heads \(9\) must be divisible by the "
                                         r"tensor-parallel size \(6\)"):
        partition_attention_heads(9, 3, 6, 0)
    with pytest.raises(ValueError, match=r"must be a multiple of num_key_value_heads"):
        partition_attention_heads(9, 2, 2, 0)
    with pytest.raises(ValueError, match=r"intermediate_size \(7\) must be divisible"):
        divide(7, 2, "intermediate_size")


def test_init_method():
    assert get_distributed_init_method("10.0.0.1", 29500) == "tcp://10.0.0.1:29500"
    assert get_distributed_init_method("fd00::2", 1) == "tcp://[fd00::2]:1"

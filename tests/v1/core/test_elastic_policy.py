"""The elastic KV cache's policy from given pool states (torch-free, a fake clock)."""

import pytest

from vllm.v1.core.elastic import ElasticDecision, ElasticKVPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _policy(clock, **kw):
    args = dict(committed=85, floor=85, limit=341, chunk=32, shrink_delay_s=5.0, clock=clock)
    return ElasticKVPolicy(**{**args, **kw})


def test_grows_by_a_chunk_or_the_demand_when_free_blocks_run_low():
    p = _policy(Clock())
    assert p.low_water == 8  # a quarter chunk
    assert p.decide(num_free=20, num_free_tail=20, blocks_wanted=3) is None
    # 7 free < 8: one chunk.
    assert p.decide(num_free=7, num_free_tail=0, blocks_wanted=0) == ElasticDecision("grow", 117)
    # Waiting requests want 100 blocks, 10 free: 85 + 90.
    assert p.decide(num_free=10, num_free_tail=0, blocks_wanted=100) == ElasticDecision(
        "grow", 175)
    # Never past the limit.
    assert p.decide(num_free=0, num_free_tail=0, blocks_wanted=1000) == ElasticDecision(
        "grow", 341)
    p.adopt(341)
    assert p.decide(num_free=0, num_free_tail=0, blocks_wanted=1000) is None
    assert p.num_grows == 1


def test_an_idle_engine_stays_at_a_floor_smaller_than_a_quarter_chunk():
    """The 8B shape on the H200: floor 288 blocks, chunk 7,820 (2026-12-02)."""
    clock = Clock()
    p = _policy(clock, committed=288, floor=288, limit=62848, chunk=7820)
    assert p.low_water == 144
    # At start-up: every block but the null one free, nothing waiting: no growth.
    assert p.decide(num_free=287, num_free_tail=287, blocks_wanted=0) is None
    # A burst: grow; afterwards the whole growth is free again: back to the floor.
    assert p.decide(num_free=100, num_free_tail=0, blocks_wanted=0) == ElasticDecision(
        "grow", 288 + 7820)
    p.adopt(288 + 7820)
    assert p.decide(num_free=8107, num_free_tail=7820, blocks_wanted=0) is None
    clock.now += 5
    assert p.decide(num_free=8107, num_free_tail=7820, blocks_wanted=0) == ElasticDecision(
        "shrink", 288)


def test_shrinks_to_the_last_growth_after_the_tail_stayed_free_for_the_delay():
    clock = Clock()
    p = _policy(clock)
    p.adopt(117)
    p.adopt(149)
    assert p.boundaries == [85, 117, 149] and p.shrink_target() == 117
    # Tail [117, 149) free but not for 5 s yet.
    assert p.decide(num_free=100, num_free_tail=40, blocks_wanted=0) is None
    clock.now += 4.9
    assert p.decide(num_free=100, num_free_tail=40, blocks_wanted=0) is None
    clock.now += 0.2
    assert p.decide(num_free=100, num_free_tail=40, blocks_wanted=0) == ElasticDecision(
        "shrink", 117)
    # A block of the tail taken again restarts the wait.
    assert p.decide(num_free=100, num_free_tail=31, blocks_wanted=0) is None
    clock.now += 10
    assert p.decide(num_free=100, num_free_tail=32, blocks_wanted=0) is None
    clock.now += 5
    assert p.decide(num_free=100, num_free_tail=32, blocks_wanted=0) == ElasticDecision(
        "shrink", 117)
    p.adopt(117)
    assert p.boundaries == [85, 117] and p.num_shrinks == 1
    # Not when what stays would leave fewer than the low-water mark free.
    clock.now += 100
    assert p.decide(num_free=36, num_free_tail=32, blocks_wanted=0) is None


def test_a_limit_below_what_is_committed_shrinks_at_once_when_the_tail_is_free():
    p = _policy(Clock())
    p.adopt(117)
    p.adopt(149)
    p.set_limit(120)
    assert p.shrink_target() == 117
    assert p.decide(num_free=5, num_free_tail=10, blocks_wanted=0) is None  # tail busy
    assert p.decide(num_free=40, num_free_tail=40, blocks_wanted=0) == ElasticDecision(
        "shrink", 117)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="floor"):
        ElasticKVPolicy(committed=10, floor=20, limit=40, chunk=4)

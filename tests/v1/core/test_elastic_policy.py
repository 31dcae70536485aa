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
    assert p.decide(num_free=20, blocks_wanted=3) is None
    # 7 free < 8: one chunk.
    assert p.decide(num_free=7, blocks_wanted=0) == ElasticDecision("grow", 117)
    # Waiting requests want 100 blocks, 10 free: 85 + 90.
    assert p.decide(num_free=10, blocks_wanted=100) == ElasticDecision(
        "grow", 175)
    # Never past the limit.
    assert p.decide(num_free=0, blocks_wanted=1000) == ElasticDecision(
        "grow", 341)
    p.adopt(341)
    assert p.decide(num_free=0, blocks_wanted=1000) is None
    assert p.num_grows == 1


def test_an_idle_engine_stays_at_a_floor_smaller_than_a_quarter_chunk():
    """The 8B shape on the H200: floor 288 blocks, chunk 7,820 (2026-12-02)."""
    clock = Clock()
    p = _policy(clock, committed=288, floor=288, limit=62848, chunk=7820)
    assert p.low_water == 144
    # At start-up: every block but the null one free, nothing waiting: no growth.
    assert p.decide(num_free=287, blocks_wanted=0) is None
    # A burst: grow; afterwards the whole growth is free again: back to the floor.
    assert p.decide(num_free=100, blocks_wanted=0) == ElasticDecision(
        "grow", 288 + 7820)
    p.adopt(288 + 7820)
    assert p.decide(num_free=8107, blocks_wanted=0) is None
    clock.now += 5
    assert p.decide(num_free=8107, blocks_wanted=0) == ElasticDecision(
        "shrink", 288)


def test_shrinks_to_the_last_growth_after_its_blocks_stayed_spare_for_the_delay():
    """The timer counts how many blocks are in use, not where (those above the boundary
    move below it): 32 blocks go when at least 32 + the low-water mark (8) are free."""
    clock = Clock()
    p = _policy(clock)
    p.adopt(117)
    p.adopt(149)
    assert p.boundaries == [85, 117, 149] and p.shrink_target() == 117
    # Spare for less than 5 s yet.
    assert p.decide(num_free=100, blocks_wanted=0) is None
    clock.now += 4.9
    assert p.decide(num_free=100, blocks_wanted=0) is None
    clock.now += 0.2
    assert p.decide(num_free=100, blocks_wanted=0) == ElasticDecision("shrink", 117)
    # A burst takes blocks again (39 free: the piece and the low-water mark do not fit):
    # the wait restarts.
    assert p.decide(num_free=39, blocks_wanted=0) is None
    clock.now += 10
    assert p.decide(num_free=40, blocks_wanted=0) is None
    clock.now += 5
    assert p.decide(num_free=40, blocks_wanted=0) == ElasticDecision("shrink", 117)
    # Nor while the requests' own demand would not fit.
    assert p.decide(num_free=100, blocks_wanted=70) is None
    p.adopt(117)
    assert p.boundaries == [85, 117] and p.num_shrinks == 1
    # Not when what stays would leave fewer than the low-water mark free.
    clock.now += 100
    assert p.decide(num_free=36, blocks_wanted=0) is None


def test_the_idle_timer_returns_about_a_chunk_of_fine_pieces_at_a_time():
    """Pieces (an eighth of a chunk) are what a peer may take; the timer still goes
    back about a chunk each time: to the highest boundary a chunk or more below,
    else the lowest one left."""
    clock = Clock()
    p = _policy(clock)  # floor 85, chunk 32
    p.adopt(149, boundaries=range(89, 149, 4))  # 85, 89, 93, ..., 145, 149
    assert p.shrink_target() == 117  # 149 - 117 = 32: one chunk
    assert p.decide(num_free=100, blocks_wanted=0) is None
    clock.now += 5.1
    assert p.decide(num_free=100, blocks_wanted=0) == ElasticDecision(
        "shrink", 117)
    p.adopt(117)
    assert p.shrink_target() == 85  # less than a chunk left above the floor: all of it
    # A peer's demand takes a single piece.
    assert p.reclaim_target(_Pool(117, 100, 64), blocks=3, blocks_wanted=0) == 113


def test_a_limit_below_what_is_committed_shrinks_at_once_when_the_blocks_in_use_fit():
    p = _policy(Clock())
    p.adopt(117)
    p.adopt(149)
    p.set_limit(120)
    assert p.shrink_target() == 117
    assert p.decide(num_free=5, blocks_wanted=0) is None  # 143 in use: not below 117
    # No delay, and the requests' demand does not hold a limit up: the low-water mark only.
    assert p.decide(num_free=40, blocks_wanted=500) == ElasticDecision("shrink", 117)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="floor"):
        ElasticKVPolicy(committed=10, floor=20, limit=40, chunk=4)


class _Pool:
    """What the policy reads of a KV cache manager: counts only."""

    def __init__(self, num_blocks: int, num_free: int, num_free_tail: int) -> None:
        self.num_blocks, self.num_free, self.num_free_tail = num_blocks, num_free, num_free_tail
        self.preferred = None

    def get_num_free_blocks(self) -> int:
        return self.num_free

    def num_free_tail_blocks(self) -> int:
        return self.num_free_tail

    def num_blocks_in_use(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def prefer_blocks_below(self, num_blocks) -> None:
        self.preferred = num_blocks


def test_a_timed_shrink_goes_back_to_a_growth_boundary_never_into_one():
    clock = Clock()
    p = _policy(clock, shrink_delay_s=0.0)
    p.adopt(117)
    p.adopt(149)
    # Blocks 140.. free, 139 in use: the growth 117..148 goes whole all the same (block
    # 139 is moved below 117 by the caller), never to a count inside it.
    assert p.target(_Pool(149, 60, 9), blocks_wanted=0) == 117
    # Too many in use to fit below 117 with the low-water mark: nothing goes.
    pool = _Pool(149, 39, 9)
    assert p.target(pool, blocks_wanted=0) is None
    assert pool.preferred == 117  # allocation prefers the ids below it meanwhile


def test_reclaim_target_gives_a_peer_whole_growths_at_once_and_keeps_the_low_water_mark():
    clock = Clock()
    p = _policy(clock)  # shrink_delay_s 5: reclaim does not wait for it
    for b in (117, 149, 181):
        p.adopt(b)
    assert p.boundaries == [85, 117, 149, 181]
    idle = _Pool(181, 180, 180)
    # A peer lacks 20 blocks: the last growth (32) is the least that covers it.
    assert p.reclaim_target(idle, blocks=20, blocks_wanted=0) == 149
    # It lacks 50: two growths.
    assert p.reclaim_target(idle, blocks=50, blocks_wanted=0) == 117
    # It lacks more than everything above the floor: all of it goes.
    assert p.reclaim_target(idle, blocks=500, blocks_wanted=0) == 85
    # Block 160 in use (a free tail of 20): it moves below 149, the last growth goes whole.
    assert p.reclaim_target(_Pool(181, 150, 20), blocks=20, blocks_wanted=0) == 149
    # Where the blocks in use lie does not matter, how many do: 140 in use (and the
    # low-water mark of 8) fit below 149, not below 117.
    assert p.reclaim_target(_Pool(181, 40, 0), blocks=500, blocks_wanted=0) == 149
    assert p.reclaim_target(_Pool(181, 20, 0), blocks=20, blocks_wanted=0) is None
    # Its own waiting requests want 120 blocks: it keeps them free (180 - 120 = 60 go at most).
    assert p.reclaim_target(idle, blocks=500, blocks_wanted=120) == 149
    assert p.num_shrinks == 0  # deciding changes nothing


def test_shortfall_is_the_demand_beyond_the_free_blocks_within_the_limit():
    p = _policy(Clock())  # low water 8, limit 341
    assert p.shortfall(_Pool(85, 84, 84), blocks_wanted=0) == 0
    assert p.shortfall(_Pool(85, 4, 0), blocks_wanted=0) == 4  # below the low-water mark
    assert p.shortfall(_Pool(85, 10, 0), blocks_wanted=100) == 90
    assert p.shortfall(_Pool(85, 0, 0), blocks_wanted=10_000) == 341 - 85  # the limit caps it


def test_a_growth_over_several_chunks_can_go_back_a_chunk_at_a_time():
    """The worker commits one allocation per chunk point crossed (`growth_points`), the
    policy records the same points as boundaries: a 40 GiB burst growth need not go back
    whole."""
    p = _policy(Clock())
    # The worker's pieces ended on granules (119, 170 of 85 + 32 k) and reached 200;
    # ends outside the growth are not boundaries.
    p.adopt(200, boundaries=[170, 119, 60, 200])
    assert p.boundaries == [85, 119, 170, 200] and p.num_grows == 1
    assert p.reclaim_target(_Pool(200, 199, 199), blocks=19, blocks_wanted=0) == 170


def test_preempt_target_keeps_the_fair_share_and_releases_what_the_peer_lacks():
    p = _policy(Clock())
    p.adopt(341, boundaries=range(117, 341, 32))  # boundaries 85, 117, ..., 309, 341
    # The peer lacks 50 blocks; this engine may keep no less than 200: 341 - 277 = 64.
    assert p.preempt_target(blocks=50, keep=200) == 277
    # It lacks 500: everything down to the lowest boundary at or above the share.
    assert p.preempt_target(blocks=500, keep=200) == 213
    # Never below the floor; nothing below what is committed: None.
    assert p.preempt_target(blocks=500, keep=0) == 85
    assert p.preempt_target(blocks=10, keep=341) is None
    # Preemption stops once the blocks in use fit below the target, with the low-water
    # mark (8) free: 213 - 1 - 8.
    assert p.in_use_budget(213) == 204 and p.in_use_budget(5) == 0


def _request_at(prompt: int, max_tokens: int | None, generated: int):
    from tests.v1.core.fake_runner import make_request
    request = make_request("r", prompt, max_tokens=max_tokens)
    request.append_output_token_ids([11] * generated)
    request.num_computed_tokens = prompt + generated
    return request


@pytest.mark.parametrize("prompt, max_tokens, generated, worth", [
    (2900, 128, 0, False),  # the prefill-heavy load: a long prompt, a short reply to go
    (2900, 128, 100, False),
    (450, 1024, 0, True),  # the decode-heavy load: long to go
    (450, 1024, 700, True),  # 324 to go >= a quarter of 1,150 computed
    (450, 1024, 800, False),  # 224 to go < 312: ends soon, keeps running
    (4000, None, 10, True),  # no max_tokens: how long it runs is unknown
])
def test_a_request_is_preempted_for_a_peer_only_while_its_decode_outweighs_its_recompute(
        prompt, max_tokens, generated, worth):
    from vllm.v1.core.elastic import worth_preempting_for_peer
    assert worth_preempting_for_peer(_request_at(prompt, max_tokens, generated)) is worth

"""Scheduler with a fake runner: budgets, chunked prefill, preemption, prefix hits, sizing."""

import pytest

from tests.v1.core.fake_runner import (
    FakeRunner,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)
from vllm.v1.core.elastic import ElasticKVPolicy, blocks_wanted
from vllm.v1.outputs import FinishReason
from vllm.v1.request import RequestStatus


def _prompt(n, base):
    """n distinct tokens starting at base (distinct bases never share prefix-cache blocks)."""
    return list(range(base, base + n))


def _cached(so):
    c = so.scheduled_cached_reqs
    return {
        r: (c.resumed_from_preemption[i], c.new_block_ids[i], c.num_computed_tokens[i])
        for i, r in enumerate(c.req_ids)
    }


def _steps(res):
    """num_scheduled_tokens of each step, without the final empty step that only
    delivers finished_req_ids to the runner."""
    assert res.scheduler_outputs[-1].is_empty
    return [so.num_scheduled_tokens for so in res.scheduler_outputs[:-1]]


def _new(so):
    return {n.req_id: (n.block_ids, n.num_computed_tokens) for n in so.scheduled_new_reqs}


def test_token_budget_and_chunked_prefill_exact_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    for i, name in enumerate("ABC"):
        sched.add_request(make_request(name, _prompt(10, 1000 * (i + 1)), max_tokens=3))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    so = res.scheduler_outputs[0]
    assert so.num_scheduled_tokens == {"A": 10, "B": 6}  # B's prompt is chunked
    assert _new(so) == {"A": ([1, 2, 3], 0), "B": ([4, 5], 0)}
    assert [o.request_id for o in res.engine_outputs[0]] == ["A"]  # B sampled nothing yet
    step(sched, runner, res)
    so = res.scheduler_outputs[1]
    assert so.num_scheduled_tokens == {"A": 1, "B": 4, "C": 10}
    assert _cached(so) == {"A": (False, [], 10), "B": (False, [6], 6)}
    assert _new(so) == {"C": ([7, 8, 9], 0)}
    step(sched, runner, res)
    assert res.scheduler_outputs[2].num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}
    assert res.finish_reasons == {"A": FinishReason.LENGTH}
    step(sched, runner, res)
    assert res.scheduler_outputs[3].num_scheduled_tokens == {"B": 1, "C": 1}
    assert res.scheduler_outputs[3].finished_req_ids == {"A"}
    assert {r: len(t) for r, t in res.outputs.items()} == {"A": 3, "B": 3, "C": 3}
    assert not sched.has_unfinished_requests()


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("A", _prompt(4, 1000), max_tokens=1))
    sched.add_request(make_request("B", _prompt(4, 2000), max_tokens=3))
    sched.add_request(make_request("C", _prompt(4, 3000), max_tokens=1))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"A": 4, "B": 4}
    assert sched.get_stats().num_waiting_reqs == 1
    step(sched, runner, res)  # A finished last step, so C gets its seat
    assert res.scheduler_outputs[1].num_scheduled_tokens == {"B": 1, "C": 4}


def test_long_prompt_chunked_over_steps_outputs_only_when_sampled():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("A", _prompt(20, 1000), max_tokens=2))
    runner = FakeRunner(block_size=4)
    res = run_until_done(sched, runner)
    steps = _steps(res)
    assert steps == [{"A": 8}, {"A": 8}, {"A": 4}, {"A": 1}]
    assert [len(outs) for outs in res.engine_outputs] == [0, 0, 1, 1, 0]
    assert [_cached(so).get("A", (None, None, None))[2] for so in res.scheduler_outputs[:-1]] == [
        None,
        8,
        16,
        20,
    ]


def test_long_prefill_token_threshold_caps_each_request():
    sched = make_scheduler(long_prefill_token_threshold=5)
    sched.add_request(make_request("A", _prompt(12, 1000), max_tokens=1))
    sched.add_request(make_request("B", _prompt(7, 2000), max_tokens=1))
    res = run_until_done(sched, FakeRunner(block_size=4))
    steps = _steps(res)
    assert steps == [{"A": 5, "B": 5}, {"A": 5, "B": 2}, {"A": 2}]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=32, max_model_len=32
    )
    sched.add_request(make_request("A", _prompt(20, 1000), max_tokens=2))
    sched.add_request(make_request("B", _prompt(20, 2000), max_tokens=1))
    res = run_until_done(sched, FakeRunner(block_size=4))
    steps = _steps(res)
    assert steps == [{"A": 20}, {"A": 1, "B": 20}]
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(16\) is smaller than max_model_len \(32\)"
    ):
        make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=32)
    with pytest.raises(ValueError, match="long_prefill_token_threshold .* needs chunked prefill"):
        make_scheduler(
            enable_chunked_prefill=False,
            max_num_batched_tokens=128,
            long_prefill_token_threshold=8,
        )


def _preemption_requests():
    # A finishes the step B gets preempted; C arrives last and must wait behind B.
    return [
        make_request("A", _prompt(8, 1000), max_tokens=2),
        make_request("B", _prompt(8, 2000), max_tokens=8),
        make_request("C", _prompt(4, 3000), max_tokens=1),
    ]


def test_preemption_newest_first_front_of_queue_and_resume_from_prefix_hit():
    # 5 usable blocks of 4 tokens.
    sched = make_scheduler(num_blocks=6, max_num_seqs=2)
    for req in _preemption_requests():
        sched.add_request(req)
    b = sched.requests["B"]
    runner = FakeRunner(block_size=4)

    res = step(sched, runner)  # A -> [1, 2], B -> [3, 4]; C has no seat
    assert _new(res.scheduler_outputs[0]) == {"A": ([1, 2], 0), "B": ([3, 4], 0)}

    step(sched, runner, res)  # A takes the last block; B finds none and is preempted
    so = res.scheduler_outputs[1]
    assert so.num_scheduled_tokens == {"A": 1}
    assert so.preempted_req_ids == {"B"}
    assert _cached(so) == {"A": (False, [5], 8)}
    assert [r.request_id for r in sched.waiting] == ["B", "C"]  # front of the queue
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("B") == []
    assert res.finish_reasons == {"A": FinishReason.LENGTH}

    step(sched, runner, res)  # B resumes on its two cached blocks, C is admitted
    so = res.scheduler_outputs[2]
    assert so.num_scheduled_tokens == {"B": 1, "C": 4}
    assert _cached(so) == {"B": (True, [3, 4, 5], 8)}
    assert _new(so) == {"C": ([2], 0)}
    assert so.finished_req_ids == {"A"}

    run_until_done(sched, runner)
    stats = sched.get_stats()
    assert stats.num_preemptions == 1 and b.num_preemptions == 1
    # Lookups at admission: A 8, B 8, B again at resumption with its 9 tokens, C 4.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (29, 8)


def test_preemption_and_resumption_do_not_change_outputs():
    def run(num_blocks):
        sched = make_scheduler(num_blocks=num_blocks, max_num_seqs=4)
        for i in range(4):
            sched.add_request(make_request(f"r{i}", _prompt(6 + i, 1000 * i), max_tokens=12))
        res = run_until_done(sched, FakeRunner(block_size=4))
        return res, sched.get_stats().num_preemptions

    small, num_preempted = run(num_blocks=8)
    large, none_preempted = run(num_blocks=64)
    assert num_preempted > 0 and none_preempted == 0
    assert small.outputs == large.outputs
    assert all(len(toks) == 12 for toks in small.outputs.values())
    resumed = [(r, c) for so in small.scheduler_outputs for r, c in _cached(so).items() if c[0]]
    assert resumed, "some request must have been resumed"
    for _req_id, (_, block_ids, num_computed) in resumed:
        assert len(block_ids) >= 1 and num_computed % 4 == 0


def test_newest_running_request_is_the_preemption_victim():
    # 6 usable blocks; three 8-token prompts fill them, then A needs a fifth slot block.
    sched = make_scheduler(num_blocks=7)
    for i, name in enumerate("ABC"):
        sched.add_request(make_request(name, _prompt(8, 1000 * (i + 1)), max_tokens=4))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    assert _new(res.scheduler_outputs[0]) == {
        "A": ([1, 2], 0),
        "B": ([3, 4], 0),
        "C": ([5, 6], 0),
    }
    step(sched, runner, res)
    so = res.scheduler_outputs[1]
    assert so.preempted_req_ids == {"C"}
    # C's blocks are freed tail first (6, 5), so A gets 6 and B gets 5.
    assert _cached(so) == {"A": (False, [6], 8), "B": (False, [5], 8)}
    final = run_until_done(sched, runner)
    assert set(final.finish_reasons) == {"A", "B", "C"}
    assert len(res.outputs["C"]) + len(final.outputs["C"]) == 4


def test_prefix_cache_hits_in_the_same_step_with_exact_counts():
    shared = _prompt(16, 5000)
    sched = make_scheduler()
    sched.add_request(make_request("A", shared + [1, 2, 3, 4], max_tokens=2))
    sched.add_request(make_request("B", shared + [7, 8, 9, 10, 11, 12], max_tokens=2))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    so = res.scheduler_outputs[0]
    assert so.num_scheduled_tokens == {"A": 20, "B": 6}
    assert _new(so) == {"A": ([1, 2, 3, 4, 5], 0), "B": ([1, 2, 3, 4, 6, 7], 16)}
    cached_tokens = {o.request_id: o.num_cached_tokens for o in res.engine_outputs[0]}
    assert cached_tokens == {"A": 0, "B": 16}
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20 + 22, 16)
    assert stats.prefix_cache_hit_rate == pytest.approx(16 / 42)
    assert stats.kv_cache_usage == pytest.approx(7 / 63)
    run_until_done(sched, runner, res)

    # Same outputs with prefix caching off, and no hits.
    off = make_scheduler(enable_prefix_caching=False)
    off.add_request(make_request("A", shared + [1, 2, 3, 4], max_tokens=2))
    off.add_request(make_request("B", shared + [7, 8, 9, 10, 11, 12], max_tokens=2))
    res_off = run_until_done(off, FakeRunner(block_size=4))
    assert res_off.scheduler_outputs[0].num_scheduled_tokens == {"A": 20, "B": 22}
    assert off.get_stats().prefix_cache_hits == 0
    assert res_off.outputs == res.outputs
    assert [len(v) for v in res.outputs.values()] == [2, 2]


def test_prefix_cache_survives_across_requests_and_salts_separate():
    sched = make_scheduler()
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", _prompt(13, 100), max_tokens=1))
    run_until_done(sched, runner)
    sched.add_request(make_request("B", _prompt(13, 100), max_tokens=1))
    sched.add_request(make_request("S", _prompt(13, 100), max_tokens=1, cache_salt="x"))
    res = step(sched, runner)
    hits = {n.req_id: n.num_computed_tokens for n in res.scheduler_outputs[0].scheduled_new_reqs}
    assert hits == {"B": 12, "S": 0}
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"B": 1, "S": 13}


def test_reset_prefix_cache_only_when_idle():
    sched = make_scheduler()
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("A", _prompt(9, 100), max_tokens=3))
    step(sched, runner)
    assert sched.reset_prefix_cache() is False
    run_until_done(sched, runner)
    assert sched.reset_prefix_cache() is True
    sched.add_request(make_request("B", _prompt(9, 100), max_tokens=1))
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"B": 9}


def test_impossible_requests_rejected_with_the_numbers():
    sched = make_scheduler(num_blocks=5, max_model_len=32)  # 4 usable blocks = 16 slots
    with pytest.raises(ValueError, match="is 33 tokens long, longer than .* max_model_len=32"):
        sched.add_request(make_request("long", 33))
    with pytest.raises(
        ValueError,
        match=r"'big' can never fit .* 10 prompt tokens and up to 20 tokens in total need 5 "
        r"blocks of 4 tokens, but the cache has only 4 usable blocks \(num_blocks=5",
    ):
        sched.add_request(make_request("big", 10, max_tokens=10))
    with pytest.raises(ValueError, match="'none' can never fit .* up to 32 tokens in total"):
        sched.add_request(make_request("none", 4, max_tokens=None))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("empty", []))
    sched.add_request(make_request("ok", 10, max_tokens=7))  # 17 tokens: 16 slots, 4 blocks
    with pytest.raises(ValueError, match="'ok' is already in the scheduler"):
        sched.add_request(make_request("ok", 10, max_tokens=7))
    assert sched.get_num_unfinished_requests() == 1
    res = run_until_done(sched, FakeRunner(block_size=4))
    assert len(res.outputs["ok"]) == 7


def test_growing_the_cache_unblocks_a_waiting_request():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks
    sched.add_request(make_request("A", _prompt(8, 1000), max_tokens=4))
    sched.add_request(make_request("B", _prompt(8, 2000), max_tokens=1))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"A": 8}
    assert [r.request_id for r in sched.waiting] == ["B"]
    sched.resize_kv_cache(8)
    assert sched.num_blocks == 8 and sched.get_stats().num_blocks == 8
    step(sched, runner, res)
    so = res.scheduler_outputs[1]
    assert so.num_scheduled_tokens == {"A": 1, "B": 8}
    assert _cached(so) == {"A": (False, [3], 8)}
    assert _new(so) == {"B": ([4, 5], 0)}
    run_until_done(sched, runner)


def test_the_cache_shrinks_only_over_free_tail_blocks():
    sched = make_scheduler(num_blocks=16)
    sched.add_request(make_request("A", _prompt(8, 1000), max_tokens=8))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)  # A holds blocks 1 and 2
    with pytest.raises(ValueError, match="cannot shrink the block pool from 16 to 2 blocks"):
        sched.resize_kv_cache(2)
    sched.resize_kv_cache(6)  # 6..15 were free: live blocks never move
    assert sched.num_blocks == 6
    run_until_done(sched, runner, res)


def test_requests_are_checked_against_the_elastic_limit_not_the_committed_blocks():
    sched = make_scheduler(num_blocks=4)  # 3 usable blocks of 4 tokens
    with pytest.raises(ValueError, match="can never fit"):
        sched.add_request(make_request("long", _prompt(20, 1000), max_tokens=4))
    # The elastic cache holds 4 blocks and may grow to 16.
    policy = ElasticKVPolicy(committed=4, floor=4, limit=16, chunk=4)
    elastic = make_scheduler(num_blocks=4, elastic=policy)
    assert elastic.max_num_blocks == 16 and elastic.num_blocks == 4
    elastic.add_request(make_request("long", _prompt(20, 1000), max_tokens=4))
    assert elastic.get_num_unfinished_requests() == 1


def _target(sched):
    wanted = blocks_wanted(sched.waiting, sched.running, sched.block_size)
    return sched.elastic.target(sched.kv_cache_manager, wanted)


def test_the_elastic_policy_drives_the_pool_through_one_verb():
    """The policy says what count it wants from the scheduler's requests; resize_kv_cache
    adopts a count (the pool and the policy together); a shrink target never drops a block
    in use."""
    policy = ElasticKVPolicy(committed=4, floor=4, limit=16, chunk=4, shrink_delay_s=0.0)
    sched = make_scheduler(num_blocks=4, elastic=policy)
    runner = FakeRunner(block_size=4)
    sched.add_request(make_request("a", _prompt(20, 1000), max_tokens=4))
    assert _target(sched) == 8  # 3 free blocks, 5 wanted: grow by a chunk
    sched.resize_kv_cache(8)
    assert (sched.num_blocks, policy.committed) == (8, 8)
    assert (policy.num_grows, policy.num_shrinks) == (1, 0)
    run_until_done(sched, runner)
    assert _target(sched) == 4  # all free again: back to the floor
    sched.resize_kv_cache(4)
    assert (sched.num_blocks, (policy.num_grows, policy.num_shrinks)) == (4, (1, 1))
    assert _target(sched) is None


def test_constructor_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1, got 0"):
        make_scheduler(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0, got -1"):
        make_scheduler(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        make_scheduler(num_blocks=0)


@pytest.mark.parametrize(
    "config",
    [
        dict(num_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=True),
        dict(num_blocks=12, max_num_batched_tokens=16, enable_prefix_caching=False),
        dict(
            num_blocks=10,
            max_num_batched_tokens=40,
            enable_prefix_caching=True,
            enable_chunked_prefill=False,
            max_model_len=40,
        ),
        dict(
            num_blocks=16,
            max_num_batched_tokens=24,
            enable_prefix_caching=True,
            long_prefill_token_threshold=6,
            max_num_seqs=3,
        ),
    ],
)
def test_random_workload_matches_an_unconstrained_run(config):
    """Staggered arrivals, shared prefixes and small caches: same outputs as a roomy run.

    The fake runner checks every KV position each request attends to, and the
    driver checks the block invariants after every step.
    """
    import random

    rng = random.Random(1234)
    prefixes = [[rng.randrange(10, 1000) for _ in range(9)] for _ in range(3)]
    workload = []  # (arrival step, request id, prompt, max_tokens)
    for i in range(24):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 10)]
        prompt = prompt + [rng.randrange(10, 1000) for _ in range(rng.randrange(0, 8))]
        workload.append((rng.randrange(0, 30), f"r{i}", prompt, rng.randrange(1, 14)))
    workload.sort(key=lambda w: w[0])

    def run(**overrides):
        sched = make_scheduler(**{"max_model_len": 40, **overrides})
        runner = FakeRunner(block_size=4)
        res, pending, n = None, list(workload), 0
        while pending or sched.has_requests():
            while pending and pending[0][0] <= n:
                _, req_id, prompt, max_tokens = pending.pop(0)
                sched.add_request(make_request(req_id, prompt, max_tokens=max_tokens))
            res = step(sched, runner, res)
            n += 1
            assert n < 3000
        return res, sched.get_stats()

    small, small_stats = run(**config)
    roomy, _ = run(max_num_batched_tokens=512, num_blocks=512, max_num_seqs=64)
    assert small.outputs == roomy.outputs
    assert small.finish_reasons == roomy.finish_reasons
    assert all(len(small.outputs[w[1]]) == w[3] for w in workload)
    if config["num_blocks"] <= 12:
        assert small_stats.num_preemptions > 0
    if config["enable_prefix_caching"]:
        assert small_stats.prefix_cache_hits > 0
    assert small_stats.kv_cache_usage == 0.0


def test_a_step_never_schedules_zero_tokens_of_a_request():
    """The runner's decode fast path counts on it (total == requests means one token each)."""
    from vllm.v1.core.sched.step import StepPlan

    plan = StepPlan(token_budget=8)
    plan.add(make_request("a", _prompt(4, 10)), 1)
    with pytest.raises(RuntimeError, match="request b scheduled 0 tokens"):
        plan.add(make_request("b", _prompt(4, 20)), 0)
    assert plan.num_scheduled_tokens == {"a": 1} and plan.token_budget == 7


def test_preempt_for_shrink_frees_the_tail_and_the_next_step_reports_it():
    """The elastic cache answering a peer engine: running requests are preempted (by
    recompute), newest first, until the blocks in use fit the budget; the tail is free,
    the next step names them preempted and admits nobody, and outputs do not change."""
    def run(shrink):
        sched = make_scheduler(num_blocks=16, max_num_seqs=4)
        for i, name in enumerate("ABC"):
            sched.add_request(make_request(name, _prompt(8, 1000 * (i + 1)), max_tokens=6))
        runner = FakeRunner(block_size=4)
        res = step(sched, runner)  # A [1, 2], B [3, 4], C [5, 6]
        if shrink:
            assert sched.preempt_for_shrink(3) == 2  # 6 in use: C, then B (A's 2 fit)
            assert [r.request_id for r in sched.running] == ["A"]
            assert [r.request_id for r in sched.waiting] == ["B", "C"]
            assert sched.kv_cache_manager.num_free_tail_blocks() == 16 - 3
            sched.resize_kv_cache(4)
            step(sched, runner, res)
            so = res.scheduler_outputs[1]
            assert so.preempted_req_ids == {"B", "C"}
            assert set(so.num_scheduled_tokens) == {"A"}  # nobody admitted in that step
            sched.resize_kv_cache(16)
        return run_until_done(sched, runner, res).outputs, sched

    shrunk, sched = run(shrink=True)
    plain, _ = run(shrink=False)
    assert shrunk == plain and all(len(t) == 6 for t in shrunk.values())
    assert sched.get_stats().num_preemptions == 2


def test_preempt_for_shrink_passes_over_requests_it_may_not_preempt():
    """For a peer engine only requests worth recomputing go (`may_preempt`); the newest
    that is not keeps running and an older one goes in its place."""
    sched = make_scheduler(num_blocks=16, max_num_seqs=4)
    for i, name in enumerate("ABC"):
        sched.add_request(make_request(name, _prompt(8, 1000 * (i + 1)), max_tokens=6))
    step(sched, FakeRunner(block_size=4))  # A [1, 2], B [3, 4], C [5, 6]
    assert sched.preempt_for_shrink(4, may_preempt=lambda r: r.request_id != "C") == 1
    assert [r.request_id for r in sched.running] == ["A", "C"]
    assert [r.request_id for r in sched.waiting] == ["B"]
    assert sched.preempt_for_shrink(0, may_preempt=lambda r: False) == 0


def test_the_dry_run_of_preempt_for_shrink_counts_shared_blocks_once_and_changes_nothing():
    """`blocks_in_use_after_preempting` (what the elastic controller chooses its boundary
    with) takes the victims `preempt_for_shrink` takes: a prefix block two requests share
    stays in use while one of them runs."""
    sched = make_scheduler(num_blocks=32)
    prefix = _prompt(8, 100)
    sched.add_request(make_request("A", prefix + [1, 2, 3], max_tokens=6))
    runner = FakeRunner(block_size=4)
    res = step(sched, runner)
    sched.add_request(make_request("B", prefix + [4, 5, 6], max_tokens=6))
    sched.add_request(make_request("C", _prompt(8, 200), max_tokens=6))
    step(sched, runner, res)
    kv = sched.kv_cache_manager
    held = {r.request_id: kv.get_block_ids(r.request_id) for r in sched.running}
    assert held == {"A": [1, 2, 3], "B": [1, 2, 4], "C": [5, 6]} and kv.num_blocks_in_use() == 6
    assert sched.blocks_in_use_after_preempting(3) == 3  # C frees 5, 6; B only 4
    assert sched.blocks_in_use_after_preempting(0, may_preempt=lambda r: r.request_id != "A") == 3
    assert sched.blocks_in_use_after_preempting(0) == 0
    assert [r.request_id for r in sched.running] == ["A", "B", "C"]  # nothing preempted
    assert kv.num_blocks_in_use() == 6 and sched.num_preemptions == 0
    assert sched.preempt_for_shrink(3) == 2 and kv.num_blocks_in_use() == 3
    assert [r.request_id for r in sched.waiting] == ["B", "C"]

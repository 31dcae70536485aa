"""Async scheduling in the scheduler: output placeholders, one step in flight, fake runner.

The driver below calls the scheduler the way `EngineCore._step_async` does:
step N+1 is scheduled and executed before the output of step N is applied.
Outputs must equal the synchronous loop's; a request stopped at step N may
be in step N+1 (its output dropped), a request capped by max_tokens never is.
"""

from __future__ import annotations

from collections import deque

import pytest

from tests.v1.core.fake_runner import (
    EOS,
    FakeRunner,
    RunResult,
    check_invariants,
    make_request,
    make_scheduler,
    run_until_done,
)
from vllm.v1.outputs import FinishReason


def run_async(scheduler, runner, max_steps: int = 2000, on_step=None) -> RunResult:
    """schedule(N+1) -> execute(N+1) -> update(N), as EngineCore._step_async orders them."""
    result = RunResult()
    queue: deque = deque()
    for _ in range(max_steps):
        if not scheduler.has_requests() and not queue:
            return result
        launched = False
        if scheduler.has_requests():
            so = scheduler.schedule()
            out = runner.execute_model(so)
            result.scheduler_outputs.append(so)
            if not so.is_empty:
                queue.append((so, out))
                launched = True
        if queue and not (launched and len(queue) == 1):
            so, out = queue.popleft()
            outs = scheduler.update_from_output(so, out)
            result.engine_outputs.append(outs)
            for o in outs:
                result.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    result.finish_reasons[o.request_id] = o.finish_reason
        check_invariants(scheduler)
        if on_step is not None:
            on_step(scheduler, result)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def _times_scheduled(result: RunResult, req_id: str) -> int:
    return sum(req_id in so.num_scheduled_tokens for so in result.scheduler_outputs)


def _both(requests, script=None, **sched_kwargs):
    """(sync result, async result, async scheduler) for the same requests."""
    sync = make_scheduler(**sched_kwargs)
    asyn = make_scheduler(async_scheduling=True, **sched_kwargs)
    for r in requests():
        sync.add_request(r)
    for r in requests():
        asyn.add_request(r)
    res_sync = run_until_done(sync, FakeRunner(block_size=4, script=script))
    res_async = run_async(asyn, FakeRunner(block_size=4, script=script))
    return res_sync, res_async, asyn


def test_decode_is_scheduled_before_the_sampled_token_arrives():
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(make_request("r", 8, max_tokens=4))
    runner = FakeRunner(block_size=4)
    so0 = sched.schedule()
    out0 = runner.execute_model(so0)
    request = sched.requests["r"]
    assert (so0.num_scheduled_tokens, request.num_output_placeholders) == ({"r": 8}, 1)
    so1 = sched.schedule()  # the prefill's token is not known yet
    assert so1.num_scheduled_tokens == {"r": 1}
    assert (request.num_computed_tokens, request.num_output_placeholders) == (9, 2)
    out1 = runner.execute_model(so1)
    sched.update_from_output(so0, out0)
    assert (request.num_output_tokens, request.num_output_placeholders) == (1, 1)
    sched.update_from_output(so1, out1)
    assert (request.num_output_tokens, request.num_output_placeholders) == (2, 0)


def test_eos_stop_gets_one_dropped_step_and_frees_its_blocks():
    script = {"a": [11, 12, EOS, 13, 14], "b": [21, 22, 23, 24, 25, 26]}

    def requests():
        return [make_request("a", 6, max_tokens=16), make_request("b", 5, max_tokens=6)]

    res_sync, res_async, sched = _both(requests, script)
    assert res_async.outputs == res_sync.outputs == {"a": [11, 12, EOS], "b": script["b"]}
    assert res_async.finish_reasons == {"a": FinishReason.STOP, "b": FinishReason.LENGTH}
    # "a" stopped at its third token while the step computing a fourth was already
    # launched: scheduled once more than synchronously, its output dropped.
    assert _times_scheduled(res_async, "a") == _times_scheduled(res_sync, "a") + 1
    # max_tokens is known in advance: no extra step for "b".
    assert _times_scheduled(res_async, "b") == _times_scheduled(res_sync, "b")
    kv = sched.kv_cache_manager
    assert not kv.req_to_blocks and kv.block_pool.get_num_free_blocks() == kv.num_blocks - 1


def test_max_model_len_caps_without_an_extra_step():
    def requests():
        return [make_request("r", 10, max_tokens=None)]

    res_sync, res_async, _ = _both(requests, max_model_len=16)
    assert len(res_async.outputs["r"]) == 6
    assert res_async.outputs == res_sync.outputs
    assert res_async.finish_reasons == {"r": FinishReason.LENGTH}
    assert _times_scheduled(res_async, "r") == _times_scheduled(res_sync, "r")


@pytest.mark.parametrize("num_blocks", [10, 14])
def test_preemption_with_a_step_in_flight_gives_identical_outputs(num_blocks):
    def requests():
        return [make_request(f"r{i}", 7 + i, max_tokens=14) for i in range(4)]

    res_sync, res_async, sched = _both(requests, num_blocks=num_blocks, max_num_batched_tokens=16)
    assert sched.num_preemptions > 0
    assert res_async.outputs == res_sync.outputs
    assert all(len(v) == 14 for v in res_async.outputs.values())


def test_preempted_request_that_stops_on_its_in_flight_token_leaves_the_queue():
    # 5 usable blocks of 4 tokens: both 8-token prefills take 2 each; the decode step
    # after them fits "a" only, so "b" is preempted while its prefill (which samples
    # EOS) is still in flight. The EOS must finish "b" from the waiting queue.
    script = {"a": [11, 12, 13, 14], "b": [EOS]}

    def requests():
        return [
            make_request("a", 8, max_tokens=4),
            make_request("b", list(range(300, 308)), max_tokens=4),
        ]

    res_sync, res_async, sched = _both(requests, script, num_blocks=6)
    assert sched.num_preemptions == 1
    assert res_async.outputs == res_sync.outputs == {"a": script["a"], "b": [EOS]}
    assert res_async.finish_reasons["b"] == FinishReason.STOP
    assert not sched.waiting and not sched.running and not sched.requests


def test_abort_while_its_step_is_in_flight():
    sched = make_scheduler(async_scheduling=True)
    for i in range(2):
        sched.add_request(make_request(f"r{i}", 6, max_tokens=8))

    def abort_r0(scheduler, result):
        if len(result.outputs.get("r0", [])) == 2:
            scheduler.finish_requests("r0", _aborted())

    res = run_async(sched, FakeRunner(block_size=4), on_step=abort_r0)
    assert len(res.outputs["r0"]) == 2 and len(res.outputs["r1"]) == 8
    kv = sched.kv_cache_manager
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks - 1


def _aborted():
    from vllm.v1.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED

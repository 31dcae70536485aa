"""Scheduler stop conditions, finish/abort from outside, logprobs pass-through, torch-freedom."""

import subprocess
import sys

import pytest

from tests.v1.core.fake_runner import (
    EOS,
    FakeRunner,
    make_request,
    make_scheduler,
    run_until_done,
    step,
)
from vllm.v1.core.sched.utils import check_stop
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, FinishReason
from vllm.v1.request import RequestStatus

STOP = FinishReason.STOP
LENGTH = FinishReason.LENGTH


def _run(script, max_model_len=128, **request_kwargs):
    """Run one request "r" (prompt of 8 tokens unless given) with scripted outputs."""
    request_kwargs.setdefault("prompt", 8)
    prompt = request_kwargs.pop("prompt")
    sched = make_scheduler(max_model_len=max_model_len)
    sched.add_request(make_request("r", prompt, **request_kwargs))
    res = run_until_done(sched, FakeRunner(block_size=4, script={"r": script}))
    return res.outputs["r"], res.finish_reasons["r"], res.stop_reasons["r"]


@pytest.mark.parametrize(
    "script, kwargs, expected",
    [
        # EOS stops (and is kept in the output token ids); stop_reason stays None.
        ([11, 12, EOS, 13], {}, ([11, 12, EOS], STOP, None)),
        # ignore_eos: EOS is an ordinary token; max_tokens ends it.
        (
            [11, EOS, 12, 13, 14],
            {"ignore_eos": True, "max_tokens": 4},
            ([11, EOS, 12, 13], LENGTH, None),
        ),
        # No EOS id known: nothing to stop on.
        ([EOS, EOS], {"eos_token_id": None, "max_tokens": 2}, ([EOS, EOS], LENGTH, None)),
        # A stop token id stops and is recorded as the stop_reason.
        ([11, 5, 12], {"stop_token_ids": [5, 6]}, ([11, 5], STOP, 5)),
        # min_tokens: EOS and stop ids among the first min_tokens outputs do not count.
        (
            [EOS, 5, 12, EOS, 13],
            {"min_tokens": 3, "stop_token_ids": [5]},
            ([EOS, 5, 12, EOS], STOP, None),
        ),
        ([5, EOS, 5, 13], {"min_tokens": 3, "stop_token_ids": [5]}, ([5, EOS, 5], STOP, 5)),
        # max_tokens gives LENGTH with exactly max_tokens outputs.
        ([11, 12, 13, 14], {"max_tokens": 3}, ([11, 12, 13], LENGTH, None)),
        # EOS on the last allowed token is a STOP (checked before the length limit).
        ([11, EOS], {"max_tokens": 2}, ([11, EOS], STOP, None)),
    ],
)
def test_stop_conditions(script, kwargs, expected):
    assert _run(script, **kwargs) == expected


def test_max_model_len_caps_generation():
    # 12 prompt tokens, max_model_len 16: four outputs reach 16 tokens.
    outputs, reason, _ = _run([11] * 10, max_model_len=16, prompt=12, max_tokens=None)
    assert outputs == [11] * 4 and reason == LENGTH
    # min_tokens cannot push a sequence past max_model_len.
    outputs, reason, _ = _run([11] * 10, max_model_len=16, prompt=12, max_tokens=8, min_tokens=6)
    assert len(outputs) == 4 and reason == LENGTH
    # A prompt of exactly max_model_len tokens yields one token.
    outputs, reason, _ = _run([11] * 10, max_model_len=16, prompt=16, max_tokens=None)
    assert outputs == [11] and reason == LENGTH


def test_check_stop_sets_status_and_reason():
    req = make_request("r", 4, stop_token_ids=[7], max_tokens=10)
    req.append_output_token_ids(7)
    assert check_stop(req, max_model_len=100) is True
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 7
    assert req.get_finished_reason() == STOP and str(req.get_finished_reason()) == "stop"


def test_request_status_helpers():
    unfinished = [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
    assert not any(RequestStatus.is_finished(s) for s in unfinished)
    assert [RequestStatus.get_finished_reason(s) for s in unfinished] == [None] * 3
    assert {
        s: RequestStatus.get_finished_reason(s)
        for s in RequestStatus
        if RequestStatus.is_finished(s)
    } == {
        RequestStatus.FINISHED_STOPPED: STOP,
        RequestStatus.FINISHED_LENGTH_CAPPED: LENGTH,
        RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        RequestStatus.FINISHED_IGNORED: LENGTH,
    }
    req = make_request("r", [5, 6, 7])
    req.append_output_token_ids([8, 9])
    assert list(req.all_token_ids) == [5, 6, 7, 8, 9] and req.output_token_ids == [8, 9]
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (5, 3, 2)
    assert req.num_cached_tokens == -1 and req.status == RequestStatus.WAITING


def test_abort_running_and_waiting_requests_frees_blocks():
    sched = make_scheduler(max_num_seqs=2)
    for name in "ABC":
        sched.add_request(make_request(name, 8, max_tokens=10, cache_salt=name))
    runner = FakeRunner(block_size=4)
    step(sched, runner)  # A, B running with 2 blocks each; C waiting
    kv = sched.kv_cache_manager
    assert kv.get_num_free_blocks() == 63 - 4
    sched.finish_requests(["A", "C", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert kv.get_num_free_blocks() == 63 - 2 and kv.get_block_ids("A") == []
    assert [r.request_id for r in sched.running] == ["B"] and len(sched.waiting) == 0
    assert sched.get_num_unfinished_requests() == 1
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)  # already finished: ignored
    res = step(sched, runner)
    assert res.scheduler_outputs[0].finished_req_ids == {"A", "C"}
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"B": 1}
    with pytest.raises(ValueError, match="needs a finished status, got RUNNING"):
        sched.finish_requests("B", RequestStatus.RUNNING)


def test_stop_string_finish_from_the_detokenizer():
    sched = make_scheduler()
    sched.add_request(make_request("r", 8, max_tokens=10))
    runner = FakeRunner(block_size=4)
    step(sched, runner)
    req = sched.requests["r"]
    sched.finish_requests("r", RequestStatus.FINISHED_STOPPED)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.get_finished_reason() == STOP
    assert sched.kv_cache_manager.usage == 0.0
    assert not sched.has_unfinished_requests() and sched.has_finished_requests()
    res = step(sched, runner)
    assert res.scheduler_outputs[0].finished_req_ids == {"r"}
    assert not sched.has_requests() and "r" not in runner.states


def test_abort_between_schedule_and_update_is_ignored_in_update():
    sched = make_scheduler()
    sched.add_request(make_request("A", 8, max_tokens=5))
    sched.add_request(make_request("B", 8, max_tokens=5, cache_salt="b"))
    runner = FakeRunner(block_size=4)
    so = sched.schedule()
    mro = runner.execute_model(so)
    sched.finish_requests("A", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(so, mro)
    assert [o.request_id for o in outs] == ["B"]
    assert sched.get_stats().num_running_reqs == 1
    with pytest.raises(ValueError, match="no entry for request 'B'"):
        sched.update_from_output(sched.schedule(), EMPTY_MODEL_RUNNER_OUTPUT)


def test_logprobs_and_prompt_logprobs_are_carried_through():
    sched = make_scheduler(max_num_batched_tokens=4)
    prompt = list(range(200, 210))
    sched.add_request(make_request("P", prompt, max_tokens=2, prompt_logprobs=1))
    res = run_until_done(sched, FakeRunner(block_size=4, with_logprobs=True))
    outs = [o for step_outs in res.engine_outputs for o in step_outs]
    # Prefill in chunks of 4, 4, 2: prompt logprobs arrive with every chunk.
    prompt_rows = [o.new_prompt_logprobs.logprob_token_ids for o in outs if o.new_prompt_logprobs]
    assert prompt_rows == [[[201], [202], [203], [204]], [[205], [206], [207], [208]], [[209]]]
    assert [o.new_token_ids for o in outs] == [[], [], res.outputs["P"][:1], res.outputs["P"][1:]]
    sampled_rows = [o.new_logprobs.logprob_token_ids for o in outs if o.new_logprobs]
    assert sampled_rows == [[[t]] for t in res.outputs["P"]]
    assert outs[-1].finish_reason == LENGTH and outs[-1].num_cached_tokens == 0


def test_core_imports_no_torch():
    code = (
        "import sys\n"
        "import vllm.v1.core.sched.scheduler, vllm.v1.core.kv_cache_manager, vllm.v1.request\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

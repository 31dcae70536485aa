"""Concurrent partial prefills (vLLM's --max-num-partial-prefills, --max-long-partial-prefills,
--long-prefill-token-threshold): a short prompt arriving during a long prefill is not starved.

Every number here is exact: budgets split evenly among the prefills of a step after one token
per running decode, long prompts beyond the long limit wait while shorter ones go first.
"""

import pytest

from tests.v1.core.fake_runner import FakeRunner, make_request, make_scheduler, step

BUDGET = 512
MAX_MODEL_LEN = 4096  # the default long threshold is 4 % of it: 163 tokens


def _scheduler(**overrides):
    kwargs = dict(max_num_batched_tokens=BUDGET, max_model_len=MAX_MODEL_LEN, block_size=16,
                  num_blocks=600, max_num_seqs=16)
    return make_scheduler(**{**kwargs, **overrides})


def _first_token_step(scheduler, runner, result, req_id, max_steps=40) -> int:
    """Steps until `req_id` has sampled its first token (1 = the next step)."""
    for n in range(1, max_steps + 1):
        step(scheduler, runner, result)
        if result.outputs.get(req_id):
            return n
    raise AssertionError(f"{req_id} sampled nothing in {max_steps} steps")


def _long_then_short(**overrides):
    sched = _scheduler(**overrides)
    runner = FakeRunner(block_size=16)
    sched.add_request(make_request("long", list(range(1000, 4000)), max_tokens=4))
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"long": BUDGET}  # alone: all of it
    sched.add_request(make_request("short", list(range(5000, 5030)), max_tokens=3))
    return sched, runner, res


def test_short_prompt_during_long_prefill_gets_its_first_token_next_step():
    sched, runner, res = _long_then_short(max_num_partial_prefills=4)
    assert sched.prefill_policy.long_threshold == 163
    assert _first_token_step(sched, runner, res, "short") == 1
    # The two prefills shared the step evenly; the short one needed only 30 tokens.
    assert res.scheduler_outputs[1].num_scheduled_tokens == {"long": 256, "short": 30}
    # Then the decode keeps its token and the long prefill takes the rest.
    step(sched, runner, res)
    assert res.scheduler_outputs[2].num_scheduled_tokens == {"long": 511, "short": 1}
    step(sched, runner, res)
    assert res.scheduler_outputs[3].num_scheduled_tokens == {"long": 511, "short": 1}
    assert res.outputs["short"] and len(res.outputs["short"]) == 3  # short finished meanwhile


def test_one_partial_prefill_starves_the_short_prompt_until_the_long_one_is_done():
    """vLLM's own defaults (1 partial prefill, no threshold): the behaviour issue 17 saw."""
    sched, runner, res = _long_then_short(max_num_partial_prefills=1)
    # 3000 tokens at 512 a step: the short prompt waits for all six prefill steps.
    assert _first_token_step(sched, runner, res, "short") == 5
    assert [so.num_scheduled_tokens for so in res.scheduler_outputs[1:]] == [
        {"long": 512}, {"long": 512}, {"long": 512}, {"long": 512},
        {"long": 440, "short": 30},
    ]


def test_long_prompts_beyond_the_long_limit_wait_while_short_ones_jump_ahead():
    sched, runner, res = _long_then_short(max_num_partial_prefills=4, max_long_partial_prefills=1)
    sched.waiting.clear()  # replace the short request with: a second long one, then a short one
    sched.requests.pop("short")
    sched.add_request(make_request("long2", list(range(6000, 6400)), max_tokens=1))
    sched.add_request(make_request("short2", list(range(7000, 7020)), max_tokens=1))
    step(sched, runner, res)
    # long2 (400 > 163 tokens) is skipped: one long prompt is prefilling already; the share
    # counted long + short2 only.
    assert res.scheduler_outputs[1].num_scheduled_tokens == {"long": 256, "short2": 20}
    assert [r.request_id for r in sched.waiting] == ["long2"]  # it kept its place
    # long2 starts in the step that finishes long's prefill (2488 - 256 = 2232 tokens to go;
    # the last chunk, 184 tokens, leaves nothing unfinished, so long2 is the one partial long
    # prefill and takes the rest of the budget).
    steps = []
    while "long2" not in res.scheduler_outputs[-1].num_scheduled_tokens:
        step(sched, runner, res)
        steps.append(res.scheduler_outputs[-1].num_scheduled_tokens)
    assert steps == [{"long": 512}, {"long": 512}, {"long": 512}, {"long": 512},
                     {"long": 184, "long2": 328}]


def test_long_prompts_that_fit_whole_are_admitted_together():
    """A batch of prompts over the long threshold starts in one step, as with one partial
    prefill (issue 10: admitted one a step, 32 prompts of 128 tokens took 32 mixed steps to
    start and batch-32 throughput fell 4x on the H200)."""
    sched = _scheduler(max_num_partial_prefills=4, max_num_batched_tokens=8192, max_num_seqs=32)
    runner = FakeRunner(block_size=16)
    names = [f"r{i}" for i in range(32)]
    for i, name in enumerate(names):  # 200 > 163 tokens: every prompt is long
        sched.add_request(make_request(name, list(range(1000 * i, 1000 * i + 200)), max_tokens=3))
    res = step(sched, runner)
    assert res.scheduler_outputs[0].num_scheduled_tokens == {name: 200 for name in names}
    step(sched, runner, res)  # then all 32 decode together
    assert res.scheduler_outputs[1].num_scheduled_tokens == {name: 1 for name in names}
    # Prompts that do not fit whole: the last admitted is the one partial long prefill.
    sched = _scheduler(max_num_partial_prefills=4, max_num_seqs=32)
    for i, name in enumerate(names[:4]):
        sched.add_request(make_request(name, list(range(1000 * i, 1000 * i + 200)), max_tokens=1))
    res = step(sched, FakeRunner(block_size=16))
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"r0": 200, "r1": 200, "r2": 112}


def test_partial_prefill_limit_and_even_split():
    # Three long prompts, two partial prefills at a time, both may be long.
    sched = _scheduler(max_num_partial_prefills=2, max_long_partial_prefills=2)
    runner = FakeRunner(block_size=16)
    for i, name in enumerate(("A", "B", "C")):
        sched.add_request(make_request(name, list(range(10000 * (i + 1), 10000 * (i + 1) + 600)),
                                       max_tokens=1))
    res = step(sched, runner)
    # A and B split the budget; C would be a third partial prefill: it waits.
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"A": 256, "B": 256}
    step(sched, runner, res)
    assert res.scheduler_outputs[1].num_scheduled_tokens == {"A": 256, "B": 256}
    # A and B finish their prompts (88 each, no longer partial), so C may start, with the
    # share of the two prefills counted for this step.
    step(sched, runner, res)
    assert res.scheduler_outputs[2].num_scheduled_tokens == {"A": 88, "B": 88, "C": 256}
    step(sched, runner, res)
    assert res.scheduler_outputs[3].num_scheduled_tokens == {"C": 344}


def test_explicit_threshold_caps_each_long_request_as_in_vllm_v1():
    sched = _scheduler(max_num_partial_prefills=4, long_prefill_token_threshold=100)
    sched.add_request(make_request("A", list(range(1000, 1300)), max_tokens=1))
    res = step(sched, FakeRunner(block_size=16))
    assert res.scheduler_outputs[0].num_scheduled_tokens == {"A": 100}
    assert sched.prefill_policy.long_threshold == 100


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
     r"max_long_partial_prefills \(3\) must be <= max_num_partial_prefills \(2\)"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be >= 1, got 0"),
    (dict(max_num_partial_prefills=2, long_prefill_token_threshold=5000),
     r"long_prefill_token_threshold \(5000\) must be <= max_model_len \(4096\)"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False, max_num_batched_tokens=4096),
     "max_num_partial_prefills=2 needs chunked prefill"),
])
def test_invalid_settings_are_rejected_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _scheduler(**kwargs)


def test_prefill_tokens_are_counted_as_each_chunk_is_scheduled():
    """The stats line's prompt throughput: a 3000-token prompt counts 512 prompt tokens per
    step while its prefill runs, long before its first token (then the 30-token prompt
    joins; decode tokens are never prompt tokens)."""
    sched, runner, res = _long_then_short(max_num_partial_prefills=4)
    assert sched.get_stats().num_prefill_tokens == BUDGET
    step(sched, runner, res)  # long 256 + short 30
    assert sched.get_stats().num_prefill_tokens == BUDGET + 256 + 30
    step(sched, runner, res)  # long 511 + one decode token of short
    assert sched.get_stats().num_prefill_tokens == BUDGET + 256 + 30 + 511
    assert not res.outputs.get("long")  # its prefill is still running

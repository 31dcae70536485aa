"""OutputProcessor: a stop string that ends among several tokens of one step (accepted
drafts) ends the output at the token that completes it: token ids, logprobs, counts and
the finish follow, as if the tokens had come one a step. And the other way a request
ends in the frontend: an abort, counted as finished with reason "abort"."""

from __future__ import annotations

import pytest

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.config import get_bundled_model_path
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import EngineCoreOutput, FinishReason, LogprobsLists


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(get_bundled_model_path())


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _logprobs(token_ids):
    return LogprobsLists([[t] for t in token_ids], [[-0.5] for _ in token_ids],
                         [1 for _ in token_ids])


def _run(tokenizer, params, steps, prompt="one two three four one two"):
    """Feeds `steps` (EngineCoreOutput kwargs) for one request; returns the outputs per
    step, the requests to abort and the finished requests' stats."""
    proc = OutputProcessor(tokenizer)
    proc.add_request("r", prompt, _ids(tokenizer, prompt), params, arrival_time=0.0)
    outputs, aborts, stats = [], [], []
    for step in steps:
        res = proc.process_outputs([EngineCoreOutput(request_id="r", **step)])
        outputs += res.request_outputs
        aborts += res.reqs_to_abort
        stats.append(res.stats)
    assert not proc.has_unfinished_requests()
    return outputs, aborts, stats


@pytest.mark.parametrize("include_stop", [False, True])
def test_tokens_after_the_stop_string_are_dropped(tokenizer, include_stop):
    three, four, one, two = (_ids(tokenizer, w) for w in (" three", " four", " one", " two"))
    step = three + four + one + two + three  # "four one" ends at the third token
    assert len(step) == 5
    params = SamplingParams(max_tokens=20, stop=["four one"], logprobs=0,
                            include_stop_str_in_output=include_stop)
    outs, aborts, stats = _run(tokenizer, params,
                               [dict(new_token_ids=step, new_logprobs=_logprobs(step))])
    (out,) = outs
    c = out.outputs[0]
    assert out.finished and aborts == ["r"]
    assert c.token_ids == step[:3]
    assert [next(iter(e)) for e in c.logprobs] == step[:3]
    assert c.cumulative_logprob == pytest.approx(-1.5)
    assert c.text == (" three four one" if include_stop else " three ")
    assert (c.finish_reason, c.stop_reason) == ("stop", "four one")
    assert stats[0].num_generation_tokens == 3
    assert stats[0].finished_requests[0].num_generation_tokens == 3


@pytest.mark.parametrize("core_finish", [FinishReason.LENGTH, FinishReason.STOP])
def test_stop_string_before_the_cores_own_finish_wins(tokenizer, core_finish):
    """The core finished on max_tokens (or EOS / a stop token) later in the same step:
    without speculation the stop string would have ended the request first."""
    step = _ids(tokenizer, " three four one two") + [tokenizer.eos_token_id]
    params = SamplingParams(max_tokens=len(step), stop=["four one"])
    stop_reason = tokenizer.eos_token_id if core_finish == FinishReason.STOP else None
    outs, aborts, _ = _run(tokenizer, params, [dict(new_token_ids=step, finish_reason=core_finish,
                                                    stop_reason=stop_reason)])
    c = outs[0].outputs[0]
    assert aborts == []  # the core is done with it already
    assert c.token_ids == step[:3] and c.text == " three "
    assert (c.finish_reason, c.stop_reason) == ("stop", "four one")


def test_core_finish_on_the_last_token_is_kept(tokenizer):
    """No stop string: all tokens, and the core's finish (EOS), as before."""
    step = _ids(tokenizer, " three four") + [tokenizer.eos_token_id]
    params = SamplingParams(max_tokens=20, stop=["four one"])
    outs, aborts, _ = _run(tokenizer, params, [dict(new_token_ids=step,
                                                    finish_reason=FinishReason.STOP,
                                                    stop_reason=tokenizer.eos_token_id)])
    c = outs[0].outputs[0]
    assert aborts == [] and c.token_ids == step and c.text == " three four"
    assert (c.finish_reason, c.stop_reason) == ("stop", tokenizer.eos_token_id)


def test_streamed_deltas_end_at_the_stop_string(tokenizer):
    first = _ids(tokenizer, " three")
    second = _ids(tokenizer, " four one two three")
    params = SamplingParams(max_tokens=20, stop=["four one"],
                            output_kind=RequestOutputKind.DELTA)
    outs, aborts, _ = _run(tokenizer, params, [dict(new_token_ids=first),
                                               dict(new_token_ids=second)])
    assert aborts == ["r"]
    assert [o.outputs[0].token_ids for o in outs] == [first, second[:2]]
    assert "".join(o.outputs[0].text for o in outs) == " three "
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 3  # usage.completion_tokens
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == "four one"


def test_stop_string_within_min_tokens_does_not_stop(tokenizer):
    """As vLLM: stop strings are checked once the output has more than min_tokens tokens
    (min_tokens holds back EOS, stop tokens and stop strings alike)."""
    words = [_ids(tokenizer, w) for w in (" one", " two", " one", " two")]
    assert all(len(w) == 1 for w in words)
    params = SamplingParams(max_tokens=20, stop=["two"], min_tokens=2)
    outs, aborts, _ = _run(tokenizer, params, [dict(new_token_ids=w) for w in words])
    c = outs[-1].outputs[0]
    assert aborts == ["r"]
    assert c.text == " one two one "  # the first "two" is the 2nd token: not a stop yet
    assert (c.finish_reason, c.stop_reason) == ("stop", "two")
    assert len(c.token_ids) == 4


def test_an_abort_counts_as_finished_with_reason_abort(tokenizer):
    """vLLM's request_success{finished_reason="abort"}: an aborted request is a finished
    one in the stats given (each child of a parent id); without stats it is only dropped."""
    from vllm.v1.engine.output_processor import ParentRequest
    from vllm.v1.metrics.stats import IterationStats

    proc = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=20, output_kind=RequestOutputKind.DELTA)
    ids = _ids(tokenizer, "one two")
    proc.add_request("r", "one two", ids, params, arrival_time=0.0)
    parent = ParentRequest("p", 2)
    for i in range(2):
        proc.add_request(ParentRequest.child_id(i, "p"), "one two", ids, params, 0.0, parent, i)
    proc.add_request("q", "one two", ids, params, arrival_time=0.0)
    proc.process_outputs([EngineCoreOutput(request_id="r", new_token_ids=_ids(tokenizer, " x"))])
    stats = IterationStats()
    dropped = proc.abort_requests(["r", "p", "gone"], stats)
    assert dropped == ["r", "0_p", "1_p"]
    assert stats.finished_reasons == [str(FinishReason.ABORT)] * 3 == ["abort"] * 3
    assert len(stats.e2e_latencies) == 3
    assert [f.num_generation_tokens for f in stats.finished_requests] == [1, 0, 0]
    assert all(f.num_prompt_tokens == len(ids) for f in stats.finished_requests)
    assert proc.abort_requests(["q"]) == ["q"] and not proc.has_unfinished_requests()

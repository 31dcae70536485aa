"""RequestOutput / CompletionOutput / Logprob: vLLM's fields and reprs, logprob dicts."""

import pickle

from vllm.logprobs import Logprob, make_logprobs_dict
from vllm.outputs import CompletionOutput, RequestOutput


def test_completion_output_repr_and_finished():
    c = CompletionOutput(index=0, text=" Paris.", token_ids=[7, 8], cumulative_logprob=-1.5,
                         logprobs=None, finish_reason="stop", stop_reason=None)
    assert repr(c) == (
        "CompletionOutput(index=0, text=' Paris.', token_ids=[7, 8], cumulative_logprob=-1.5, "
        "logprobs=None, finish_reason=stop, stop_reason=None)"
    )
    assert c.finished()
    assert not CompletionOutput(1, "", [], None, None).finished()


def test_request_output_repr_eq_pickle():
    c = CompletionOutput(0, "x", [1], None, None)
    r = RequestOutput("0", "hi", [5, 6], None, [c], finished=False, num_cached_tokens=0)
    assert repr(r) == (
        "RequestOutput(request_id=0, prompt='hi', prompt_token_ids=[5, 6], prompt_logprobs=None, "
        f"outputs=[{c!r}], finished=False, metrics=None, num_cached_tokens=0)"
    )
    assert pickle.loads(pickle.dumps(r)) == r
    assert r != RequestOutput("0", "hi", [5, 6], None, [c], finished=True, num_cached_tokens=0)


def test_make_logprobs_dict_orders_and_ranks():
    d = make_logprobs_dict([9, 4, 9, 2], [-2.0, -0.5, -2.0, -2.5], rank=2,
                           decoded_tokens=["a", "b", "a", "c"])
    assert list(d) == [9, 4, 2]  # sampled first, then the top-k; the duplicate kept once
    assert d[9] == Logprob(-2.0, 2, "a") and d[4] == Logprob(-0.5, 1, "b")
    assert d[2] == Logprob(-2.5, 3, "c")
    assert make_logprobs_dict([3], [-0.1], rank=1) == {3: Logprob(-0.1, 1, None)}

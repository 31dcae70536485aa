"""vLLM's semantics on the bundled model (issue 16): logprob texts follow `detokenize`."""

from __future__ import annotations

import pytest

from vllm import SamplingParams


def test_detokenize_false_leaves_logprob_texts_empty(bundled_llm):
    """vLLM: with detokenize=False neither the text nor Logprob.decoded_token is filled."""
    params = SamplingParams(max_tokens=2, temperature=0, logprobs=2, prompt_logprobs=1,
                            detokenize=False)
    out = bundled_llm.generate("The capital of France is", params, use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 2
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert entries and all(lp.decoded_token is None for e in entries for lp in e.values())
    on = bundled_llm.generate("The capital of France is",
                              SamplingParams(max_tokens=2, temperature=0, logprobs=2),
                              use_tqdm=False)[0].outputs[0]
    assert all(isinstance(lp.decoded_token, str) for e in on.logprobs for lp in e.values())


def test_logprobs_minus_one_is_capped_by_max_logprobs(bundled_llm):
    """vLLM: -1 asks for the whole vocabulary, which the default max_logprobs (20) refuses
    with vLLM's message naming both numbers; SamplingParams itself accepts -1."""
    from vllm.exceptions import VLLMValidationError

    for name in ("logprobs", "prompt_logprobs"):
        params = SamplingParams(max_tokens=1, **{name: -1})
        with pytest.raises(VLLMValidationError, match="of 49152, which is greater than max "
                                                      "allowed: 20") as e:
            bundled_llm.generate("Hi", params, use_tqdm=False)
        assert e.value.parameter == name

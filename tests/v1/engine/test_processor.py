"""Processor: prompt text validity and the engine limit on n, with the bundled tokenizer."""

from __future__ import annotations

import pytest

from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.config import get_bundled_model_path
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.processor import Processor

MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def processor() -> Processor:
    tokenizer = get_tokenizer(get_bundled_model_path())
    return Processor(tokenizer, max_model_len=256, vocab_size=len(tokenizer),
                     max_num_seqs=MAX_NUM_SEQS)


@pytest.mark.parametrize(("prompt", "code", "offset"), [
    ("\ud800", "D800", 0),
    ({"prompt": "Hello \udfff world"}, "DFFF", 6),
    ({"prompt_token_ids": [1, 2], "prompt": "a\ud8ff"}, "D8FF", 1),  # echoed in outputs
])
def test_lone_surrogate_is_a_clear_value_error(processor, prompt, code, offset):
    with pytest.raises(ValueError) as e:
        processor.tokenize(prompt)
    assert str(e.value).startswith(
        f"prompt contains a lone UTF-16 surrogate U+{code} at character {offset}")


def test_valid_unicode_still_tokenizes(processor):
    paired = "\ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16")  # one emoji
    text, ids = processor.tokenize(f"héllo {paired}")
    assert text == "héllo 😀" and ids == processor.tokenizer.encode("héllo 😀")


def test_n_up_to_max_num_seqs(processor):
    processor.validate_params(SamplingParams(n=MAX_NUM_SEQS))
    for n in (MAX_NUM_SEQS + 1, 10**20):
        with pytest.raises(ValueError) as e:
            processor.validate_params(SamplingParams(n=n))
        assert str(e.value).startswith(f"n ({n}) must be <= max_num_seqs ({MAX_NUM_SEQS})")


def test_priority_needs_the_priority_policy(processor):
    """vLLM's rule: a non-zero priority under fcfs is refused (not ignored), naming the field."""
    params = SamplingParams(max_tokens=4)
    assert processor.process_inputs("ok", "Hi", params, priority=0).children[0][0].priority == 0
    for priority, message in [(1, "Got priority 1 but priority scheduling is not enabled"),
                              (True, "priority must be an integer")]:
        with pytest.raises(ValueError, match=message) as e:
            processor.process_inputs("r", "Hi", params, priority=priority)
        assert e.value.parameter == "priority"
    tokenizer = processor.tokenizer
    prioritized = Processor(tokenizer, max_model_len=256, vocab_size=len(tokenizer),
                            max_num_seqs=MAX_NUM_SEQS, scheduling_policy="priority")
    children = prioritized.process_inputs("p", "Hi", SamplingParams(n=2), priority=-3).children
    assert [request.priority for request, _, _ in children] == [-3, -3]


def test_offline_rule_needs_only_the_prompt_to_fit(processor):
    """vLLM's engine: prompt + max_tokens may pass max_model_len (generation stops there);
    the OpenAI server's rule refuses it, naming max_tokens; a prompt of max_model_len
    tokens is refused by both (no room for one output token)."""
    prompt = {"prompt_token_ids": [28] * 250}
    params = SamplingParams(max_tokens=20)
    request = processor.process_inputs("offline", prompt, params).children[0][0]
    assert request.max_tokens == 20 and request.num_prompt_tokens == 250
    with pytest.raises(ValueError, match="plus max_tokens 20 exceeds max_model_len 256") as e:
        processor.process_inputs("server", prompt, params, require_room_for_max_tokens=True)
    assert e.value.parameter == "max_tokens"
    for room in (False, True):
        with pytest.raises(ValueError, match="prompt has 256 tokens") as e:
            processor.process_inputs("full", {"prompt_token_ids": [28] * 256}, params,
                                     require_room_for_max_tokens=room)
        assert e.value.parameter == "prompt"

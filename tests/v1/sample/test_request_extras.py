"""vLLM's sampler-side request extras on the bundled model: `allowed_token_ids`,
`bad_words`, `truncate_prompt_tokens` (issue 47, item 4). Each test first shows what
the request gives without the extra, so it fails if the extra were ignored."""

from __future__ import annotations

import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

PROMPT = "The capital of France is"


def _greedy(llm, prompt=PROMPT, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=8, **kwargs)
    return llm.generate([prompt], params, use_tqdm=False)[0]


def test_allowed_token_ids_restrict_every_sampled_token(bundled_llm):
    plain = _greedy(bundled_llm)
    tokenizer = bundled_llm.get_tokenizer()
    allowed = tokenizer.encode(" a b c", add_special_tokens=False)
    assert not set(plain.outputs[0].token_ids) <= set(allowed)
    greedy = _greedy(bundled_llm, allowed_token_ids=allowed)
    sampled = bundled_llm.generate([PROMPT], SamplingParams(
        temperature=1.0, seed=0, max_tokens=8, allowed_token_ids=allowed), use_tqdm=False)[0]
    for out in (greedy, sampled):
        assert set(out.outputs[0].token_ids) <= set(allowed)


def test_bad_words_are_never_generated(bundled_llm):
    plain = _greedy(bundled_llm)
    assert "Paris" in plain.outputs[0].text
    out = _greedy(bundled_llm, bad_words=["Paris"])
    assert "Paris" not in out.outputs[0].text
    assert out.outputs[0].text != plain.outputs[0].text
    # A multi-token word is masked only once its other tokens were generated.
    multi = _greedy(bundled_llm, bad_words=["Paris."])
    assert "Paris." not in multi.outputs[0].text


def test_truncate_prompt_tokens_keeps_the_last_tokens(bundled_llm):
    tokenizer = bundled_llm.get_tokenizer()
    ids = tokenizer.encode("Tell me a story. " + PROMPT)
    out = _greedy(bundled_llm, prompt={"prompt_token_ids": ids}, truncate_prompt_tokens=5)
    assert list(out.prompt_token_ids) == ids[-5:]
    direct = _greedy(bundled_llm, prompt={"prompt_token_ids": ids[-5:]})
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = _greedy(bundled_llm, prompt={"prompt_token_ids": ids})
    assert list(whole.prompt_token_ids) == ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**9]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_bad_extras_are_refused_naming_the_field(bundled_llm, kwargs, field):
    with pytest.raises(VLLMValidationError) as info:
        bundled_llm.generate([PROMPT], SamplingParams(**kwargs), use_tqdm=False)
    assert info.value.parameter == field

"""POST /v1/completions through the official `openai` client, against a real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.entrypoints.openai.utils import MAX_MODEL_LEN, MODEL_NAME
from vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a real engine on the bundled model

PROMPT = "The capital of France is"
# Prompts whose greedy continuations the concurrency test compares.
PROMPTS = [
    "The capital of France is",
    "One, two, three, four,",
    "The opposite of hot is",
    "Water is made of hydrogen and",
    "The first month of the year is",
    "A cat says meow and a dog says",
    "The color of the sky is",
    "Monday, Tuesday, Wednesday,",
]
MAX_TOKENS = 8


def _greedy(client, prompt: str, max_tokens: int = MAX_TOKENS, **kwargs):
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kwargs)


def test_max_tokens_left_unset_is_what_fits(client):
    """As vLLM's server: max_tokens null means max_model_len - prompt (an explicit one that
    does not fit is a 400: test_errors.py); 3 tokens here, stopped by the length."""
    completion = client.completions.create(model=MODEL_NAME, prompt=[28] * (MAX_MODEL_LEN - 3),
                                           max_tokens=None, temperature=0,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    assert completion.usage.completion_tokens == 3 and choice.finish_reason == "length"


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].owned_by == "vllm"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert models[0].created > 0


def test_greedy_matches_offline_llm(client, offline_llm):
    completion = _greedy(client, PROMPT)
    (offline,) = offline_llm.generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    choice = completion.choices[0]
    assert choice.text == offline.outputs[0].text
    assert "Paris" in choice.text
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert completion.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert completion.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert completion.usage.total_tokens == (completion.usage.prompt_tokens
                                             + completion.usage.completion_tokens)
    assert completion.model == MODEL_NAME
    assert completion.id.startswith("cmpl-")


def test_usage_and_length_finish(client, server):
    prompt = "Count: 1, 2, 3, 4, 5,"
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    tokens = httpx.post(server.url_for("tokenize"), json={"prompt": prompt}).json()
    assert completion.usage.prompt_tokens == tokens["count"]
    assert completion.usage.completion_tokens == 5
    assert completion.choices[0].finish_reason == "length"


def test_n_and_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, n=3,
                  temperature=1.0, seed=1234, extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    # The n samples draw differently (children get seed + index).
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 3 * 6


def test_logprobs(client):
    completion = _greedy(client, PROMPT, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == completion.usage.completion_tokens
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0
    for i, (token, lp, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs,
                                             logprobs.top_logprobs, strict=True)):
        assert lp <= 0.0
        assert 3 <= len(top) <= 4  # the top 3 plus the sampled token
        # Greedy: the sampled token is the most likely one.
        assert top[token] == pytest.approx(max(top.values()), abs=1e-4)
        if i:
            assert logprobs.text_offset[i] == (logprobs.text_offset[i - 1]
                                               + len(logprobs.tokens[i - 1]))


def test_stop_string(client):
    full = _greedy(client, PROMPT).choices[0].text
    assert "." in full, full  # " Paris. ..." ends its first sentence within MAX_TOKENS
    stopped = _greedy(client, PROMPT, stop=["."]).choices[0]
    assert stopped.text == full[: full.index(".")]
    assert stopped.finish_reason == "stop"
    assert stopped.model_extra["stop_reason"] == "."


def test_streaming_matches_non_streaming(client):
    full = _greedy(client, PROMPT)
    chunks = list(_greedy(client, PROMPT, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # really streamed
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens


def test_continuous_usage_stats_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far."""
    full = _greedy(client, PROMPT)
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_greedy(client, PROMPT, stream=True, stream_options=options))
    text_chunks = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in text_chunks]
    assert counts == sorted(counts) and counts[-1] == full.usage.completion_tokens
    assert {c.usage.prompt_tokens for c in text_chunks} == {full.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in text_chunks)
    assert chunks[-1].usage == full.usage
    plain = list(_greedy(client, PROMPT, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)


def test_sse_wire_format(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url_for("v1/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"


def test_several_prompts_and_echo(client):
    prompts = PROMPTS[:2]
    batch = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4,
                                      temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = _greedy(client, prompt, max_tokens=4).choices[0].text
        assert batch.choices[2 * i].text == alone
        assert batch.choices[2 * i + 1].text == alone  # greedy: both samples agree
    echoed = _greedy(client, PROMPT, max_tokens=4, echo=True).choices[0].text
    assert echoed == PROMPT + _greedy(client, PROMPT, max_tokens=4).choices[0].text


def test_token_id_prompt(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert by_ids.choices[0].text == _greedy(client, PROMPT).choices[0].text


def test_tokenize_detokenize(server):
    tokenized = httpx.post(server.url_for("tokenize"),
                           json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.url_for("detokenize"), json={"tokens": tokenized["tokens"]}).json()
    assert text["prompt"] == "Hello world"


def test_32_concurrent_clients(server, client):
    """32 requests at once finish with exactly the text each prompt gets alone."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    alone = {p: _greedy(client, p).choices[0].text for p in PROMPTS}

    async def run_all() -> list[tuple[str, str]]:
        async_client = server.get_async_client()

        async def one(i: int, prompt: str) -> tuple[str, str]:
            if i % 2:  # half of them stream
                text = ""
                stream = await async_client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                    stream=True)
                async for chunk in stream:
                    text += chunk.choices[0].text
                return prompt, text
            completion = await async_client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            return prompt, completion.choices[0].text

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await async_client.close()

    results = asyncio.run(run_all())
    assert len(results) == 32
    for prompt, text in results:
        assert text == alone[prompt], prompt


def test_prompt_logprobs_returned_like_vllm(server, offline_llm):
    """vLLM's `prompt_logprobs`: per prompt token (the first null), token id -> logprob,
    rank and text; the same numbers as the offline engine's."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    choice = httpx.post(server.url_for("v1/completions"), json=body, timeout=120).json()[
        "choices"][0]
    (offline,) = offline_llm.generate(
        [PROMPT], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2), use_tqdm=False)
    served = choice["prompt_logprobs"]
    assert len(served) == len(offline.prompt_token_ids) and served[0] is None
    for position, (got, want) in enumerate(zip(served[1:], offline.prompt_logprobs[1:],
                                               strict=True), start=1):
        assert {int(k) for k in got} == set(want)
        assert str(offline.prompt_token_ids[position]) in got  # the prompt's own token
        for token_id, lp in want.items():
            entry = got[str(token_id)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert (entry["rank"], entry["decoded_token"]) == (lp.rank, lp.decoded_token)
    # Not asked for: not returned.
    body.pop("prompt_logprobs")
    choice = httpx.post(server.url_for("v1/completions"), json=body, timeout=120).json()[
        "choices"][0]
    assert choice.get("prompt_logprobs") is None


def test_echo_with_logprobs_returns_the_prompt_logprobs(client):
    """vLLM: echo + logprobs lists the prompt's tokens first (the first with null logprobs),
    then the generated ones, with text offsets running through the echoed text."""
    echoed = _greedy(client, PROMPT, max_tokens=3, echo=True, logprobs=1).choices[0]
    alone = _greedy(client, PROMPT, max_tokens=3, logprobs=1).choices[0]
    lp = echoed.logprobs
    num_prompt = len(lp.tokens) - len(alone.logprobs.tokens)
    assert num_prompt >= 2 and echoed.text == PROMPT + alone.text
    assert "".join(lp.tokens[:num_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:num_prompt])
    assert lp.tokens[num_prompt:] == alone.logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(alone.logprobs.token_logprobs,
                                                           abs=1e-5)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3,
                                       temperature=0, echo=True, logprobs=1, stream=True)
    tokens = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert tokens == lp.tokens

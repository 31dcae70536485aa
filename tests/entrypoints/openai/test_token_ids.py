"""`return_tokens_as_token_ids` (vLLM's extra): logprobs name tokens "token_id:N" on
completions and chat, streaming or not, with the same values as the text-named ones."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.utils import MODEL_NAME

pytestmark = pytest.mark.slow  # a real engine on the bundled model

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
# Logprobs of one prompt differ in the last digits between batches (another request's
# rows, a prefix-cache hit); the names are what these tests compare.
TOL = 1e-3


def _ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def _detokenize(server, ids: list[int]) -> str:
    return httpx.post(server.url_for("detokenize"), json={"tokens": ids}, timeout=60
                      ).json()["prompt"]


@pytest.mark.parametrize("echo", [False, True])
def test_completions_tokens_as_ids(client, server, echo):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                  echo=echo)
    plain = client.completions.create(**kwargs).choices[0]
    as_ids = client.completions.create(
        **kwargs, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.text == plain.text
    ids = _ids(as_ids.logprobs.tokens)
    assert [_detokenize(server, [i]) for i in ids] == plain.logprobs.tokens
    assert _detokenize(server, ids) == as_ids.text
    assert as_ids.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs,
                                                           abs=TOL)
    assert as_ids.logprobs.text_offset == plain.logprobs.text_offset  # offsets count text
    for top_ids, top_text in zip(as_ids.logprobs.top_logprobs, plain.logprobs.top_logprobs,
                                 strict=True):
        if top_ids is None:  # the echoed prompt's first token has no context
            assert top_text is None
            continue
        assert sorted(top_ids.values()) == pytest.approx(sorted(top_text.values()), abs=TOL)
        assert {_detokenize(server, [i]) for i in _ids(list(top_ids))} == set(top_text)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_as_ids(client, server, stream):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2, stream=stream)

    def entries(reply):
        if not stream:
            return reply.choices[0].logprobs.content
        return [e for chunk in reply if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]

    plain = entries(client.chat.completions.create(**kwargs))
    as_ids = entries(client.chat.completions.create(
        **kwargs, extra_body={"return_tokens_as_token_ids": True}))
    ids = _ids([e.token for e in as_ids])
    assert [_detokenize(server, [i]) for i in ids] == [e.token for e in plain]
    assert [e.logprob for e in as_ids] == pytest.approx([e.logprob for e in plain], abs=TOL)
    for entry in as_ids:
        assert entry.bytes == list(entry.token.encode())
        _ids([top.token for top in entry.top_logprobs])
    for ids_entry, text_entry in zip(as_ids, plain, strict=True):
        assert [t.logprob for t in ids_entry.top_logprobs] == pytest.approx(
            [t.logprob for t in text_entry.top_logprobs], abs=TOL)

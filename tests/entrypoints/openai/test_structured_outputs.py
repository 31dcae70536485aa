"""Structured outputs over HTTP through the official `openai` client (issue 47).

100 concurrent chat replies with `response_format` json_schema and 100 streamed
completions with `structured_outputs` all validate (`jsonschema`); `guided_regex`
and `guided_choice` replies match; `response_format` json_object gives an
object. Bad constraints (400 naming the field) are in test_errors.py.

The server runs with `--structured-outputs-config '{"disable_any_whitespace": true}'`
(OpenAI's `response_format` has no whitespace switch): JSON replies are compact, so
a small model at temperature 1 cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from tests.entrypoints.openai.utils import DEFAULT_SERVER_ARGS, MODEL_NAME, RemoteServer
from tests.v1.structured_output.schemas import MAX_TOKENS, NUM_REPLIES, PROMPT, SCHEMA

pytestmark = pytest.mark.slow  # a real engine on the bundled model


@pytest.fixture(scope="module")
def server():
    args = [*DEFAULT_SERVER_ARGS, "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}']
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


def _async_client(server) -> openai.AsyncOpenAI:
    """100 requests at once queue behind each other on a CPU: a longer timeout than the
    shared helper's."""
    return openai.AsyncOpenAI(base_url=server.url_for("v1"), api_key="EMPTY", max_retries=0,
                              timeout=900)


async def _gather(make_coroutine, n: int) -> list:
    return await asyncio.gather(*(make_coroutine(i) for i in range(n)))


def _validate_all(texts: list[str]) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(texts) == NUM_REPLIES and len(set(texts)) > 1


def test_100_chat_replies_with_response_format_json_schema_validate(server):
    client = _async_client(server)
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

    async def one(i: int) -> str:
        completion = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], seed=i,
            temperature=1.0, max_completion_tokens=MAX_TOKENS, response_format=response_format)
        assert completion.choices[0].finish_reason == "stop"
        return completion.choices[0].message.content

    _validate_all(asyncio.run(_gather(one, NUM_REPLIES)))


def test_100_streamed_completions_with_structured_outputs_validate(server):
    client = _async_client(server)
    structured = {"json": SCHEMA}

    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, seed=i, temperature=1.0, max_tokens=MAX_TOKENS,
            stream=True, extra_body={"structured_outputs": structured})
        parts, finish = [], None
        async for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.text)
                finish = choice.finish_reason or finish
        assert finish == "stop"
        return "".join(parts)

    _validate_all(asyncio.run(_gather(one, NUM_REPLIES)))


def test_guided_regex_and_choice_over_completions(client):
    regex = r"[A-Z][a-z]{2,6}, [0-9]{4}"
    for seed in range(3):
        completion = client.completions.create(
            model=MODEL_NAME, prompt="City and year:", seed=seed, temperature=1.0,
            max_tokens=20, extra_body={"guided_regex": regex})
        assert re.fullmatch(regex, completion.choices[0].text), completion.choices[0].text
    choices = ["red", "green", "dark blue"]
    completion = client.completions.create(
        model=MODEL_NAME, prompt="A colour:", n=4, temperature=1.0, seed=1, max_tokens=10,
        extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in completion.choices)


def test_response_format_json_object_over_chat(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a JSON object."}],
        temperature=0, max_completion_tokens=40, response_format={"type": "json_object"})
    text = completion.choices[0].message.content
    assert text.lstrip().startswith("{")
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_sampler_extras_over_http(client, server):
    """allowed_token_ids, bad_words and truncate_prompt_tokens reach the engine (they were
    a 400 before issue 47): each changes what the same greedy request returns."""
    import httpx

    def complete(**extra):
        return client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                         temperature=0, max_tokens=6, extra_body=extra)

    plain = complete()
    assert "Paris" in plain.choices[0].text
    assert "Paris" not in complete(bad_words=["Paris"]).choices[0].text
    allowed = httpx.post(server.url_for("tokenize"), json={
        "prompt": " yes no", "add_special_tokens": False}).json()["tokens"]
    restricted = complete(allowed_token_ids=allowed).choices[0].text
    assert restricted and set(restricted.split()) <= {"yes", "no"}
    truncated = complete(truncate_prompt_tokens=2)
    assert truncated.usage.prompt_tokens == 2 and plain.usage.prompt_tokens > 2

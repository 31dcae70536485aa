"""Chat template variables, reasoning and tool calls over HTTP, with the official `openai`
client, against a server of the scripted model (tests/entrypoints/openai/scripted_model.py:
its greedy output is a hermes tool call when the template offers tools, a <think> block
then an answer when thinking is on, the answer after a tool result)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.scripted_model import build_scripted_model
from tests.entrypoints.openai.utils import RemoteServer, error_of

pytestmark = pytest.mark.slow  # a real server (a tiny checkpoint)

MODEL = "scripted"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = "It is sunny in Paris."
REASONING = " The user asks about the weather."
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    args = [str(model_dir), "--served-model-name", MODEL, "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--kv-cache-memory-bytes", "16MiB", "--uvicorn-log-level", "warning",
            "--disable-log-stats", "--reasoning-parser", "qwen3",
            "--default-chat-template-kwargs", json.dumps({"enable_thinking": False})]
    with RemoteServer(args) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


def _chat(client, messages=ASK, **kwargs):
    kwargs.setdefault("max_completion_tokens", 40)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          **kwargs)


def test_default_chat_template_kwargs_and_request_kwargs_win(client, server):
    # The server's default turns thinking off: the template closes <think> itself.
    message = _chat(client).choices[0].message
    assert message.content == ANSWER
    assert getattr(message, "reasoning_content", None) is None
    # The request's value wins over the default: the model thinks first.
    thinking = _chat(client, extra_body=THINK).choices[0].message
    assert (thinking.reasoning_content, thinking.content) == (REASONING, ANSWER)
    # /tokenize renders with the same variables.
    for kwargs, end in (({}, "<think></think>"),
                        ({"enable_thinking": True}, "<|think_turn|>")):
        body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs,
                "return_token_strs": True}
        response = httpx.post(server.url_for("tokenize"), json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert "".join(response.json()["token_strs"]).endswith(end)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"tokenize": True}, "chat_template_kwargs.tokenize"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    (["enable_thinking"], "chat_template_kwargs"),
])
def test_bad_chat_template_kwargs_are_400(server, kwargs, param):
    body = {"model": MODEL, "messages": ASK, "chat_template_kwargs": kwargs}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_reasoning_streams_as_reasoning_then_content_deltas(client):
    chunks = list(_chat(client, stream=True, extra_body=THINK))
    deltas = [c.choices[0].delta for c in chunks[1:] if c.choices]
    kinds = ["reasoning" if getattr(d, "reasoning_content", None) else "content"
             for d in deltas if getattr(d, "reasoning_content", None) or d.content]
    # Every reasoning delta comes before every content delta, and the tags are in none.
    assert kinds == sorted(kinds, key=lambda k: k == "content") and len(set(kinds)) == 2
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == ANSWER
    assert chunks[-1].choices[0].finish_reason == "stop"

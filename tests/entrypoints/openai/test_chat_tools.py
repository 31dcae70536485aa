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
REASONING = "<think> The user asks about the weather.</think>"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    args = [str(model_dir), "--served-model-name", MODEL, "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--kv-cache-memory-bytes", "16MiB", "--uvicorn-log-level", "warning",
            "--disable-log-stats",
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
    assert _chat(client).choices[0].message.content == ANSWER
    # The request's value wins over the default.
    thinking = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert thinking.choices[0].message.content == REASONING + ANSWER
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

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
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_scripted_model(tmp_path_factory.mktemp("scripted"))
    args = [str(model_dir), "--served-model-name", MODEL, "--max-model-len", "512",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "128",
            "--kv-cache-memory-bytes", "16MiB", "--uvicorn-log-level", "warning",
            "--disable-log-stats", "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--return-tokens-as-token-ids",
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


def test_a_grammar_constrains_only_the_content_after_the_reasoning(client):
    """--reasoning-parser qwen3 reaches the engine: the reasoning is written freely, the
    grammar (a choice) applies after </think>; with thinking off (the prompt closes
    <think></think>) it applies from the first token."""
    choices = ["It is rainy.", "Cloudy."]
    body = {"chat_template_kwargs": {"enable_thinking": True},
            "structured_outputs": {"choice": choices}}
    message = _chat(client, extra_body=body).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, "It is rainy.")
    deltas = [c.choices[0].delta for c in _chat(client, extra_body=body, stream=True)
              if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == REASONING
    assert "".join(d.content or "" for d in deltas) == "It is rainy."
    plain = _chat(client, extra_body={"structured_outputs": {"choice": choices}}).choices[0]
    assert getattr(plain.message, "reasoning_content", None) is None
    assert plain.message.content == "It is rainy."


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


def _streamed_message(chunks):
    """A streamed choice put together as the openai client's users do: content joined,
    tool calls by index (id, type and name from the first delta, arguments appended)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
                    calls[call.index] = {"id": call.id, "name": call.function.name,
                                         "arguments": "", "pieces": 0}
                calls[call.index]["arguments"] += call.function.arguments or ""
                calls[call.index]["pieces"] += bool(call.function.arguments)
            finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


@pytest.mark.parametrize("tool_choice", ["auto", "required", NAMED])
@pytest.mark.parametrize("stream", [False, True])
def test_tools_flow_call_result_answer(client, tool_choice, stream):
    """The openai client's tools flow: a call, the tool's result, the answer."""
    reply = _chat(client, tools=TOOLS, tool_choice=tool_choice, stream=stream)
    if stream:
        content, calls, finish = _streamed_message(reply)
        assert calls[0]["pieces"] >= 2  # the arguments stream as the model writes them
        tool_calls = [{"id": c["id"], "type": "function",
                       "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for c in calls]
        assistant = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
    else:
        message = reply.choices[0].message
        content, finish = message.content, reply.choices[0].finish_reason
        tool_calls = [c.model_dump() for c in message.tool_calls]
        assistant = message  # the client sends the reply back as it got it
    assert [c["function"]["name"] for c in tool_calls] == ["get_weather"]
    assert json.loads(tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert tool_calls[0]["id"].startswith("chatcmpl-tool-")
    assert not content
    # auto and required finish with "tool_calls"; a named choice with "stop" (as OpenAI's)
    assert finish == ("stop" if tool_choice is NAMED else "tool_calls")
    result = {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": "sunny, 24 C"}
    answer = _chat(client, messages=[*ASK, assistant, result], tools=TOOLS, stream=stream)
    if stream:
        content, calls, finish = _streamed_message(answer)
    else:
        content, calls = answer.choices[0].message.content, answer.choices[0].message.tool_calls
        finish = answer.choices[0].finish_reason
    assert (content, calls, finish) == (ANSWER, [], "stop")


def test_tool_choice_none_leaves_the_text_alone(client):
    reply = _chat(client, tools=TOOLS, tool_choice="none")
    message = reply.choices[0].message
    assert message.content.startswith('<tool_call>{"name": "get_weather"')
    assert not message.tool_calls and reply.choices[0].finish_reason == "stop"


def test_tool_results_reach_the_template(server):
    assistant = {"role": "assistant", "tool_calls": [{"id": "call-1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    messages = [*ASK, assistant, {"role": "tool", "tool_call_id": "call-1", "content": "24 C"}]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS}
    tokens = httpx.post(server.url_for("tokenize"), json=body, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url_for("detokenize"), json={"model": MODEL, "tokens": tokens},
                        timeout=60).json()["prompt"]
    assert '"get_weather"' in prompt  # the tools, as the template lists them
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>24 C</tool_response>" in prompt
    bad = {**assistant, "tool_calls": [{**assistant["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{not json"}}]}
    response = httpx.post(server.url_for("v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": [*ASK, bad], "tools": TOOLS})
    assert response.status_code == 400
    assert error_of(response)["param"] == "messages.1.tool_calls.0.function.arguments"


def test_parallel_tool_calls_false_allows_one_call(server):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 0, "max_completion_tokens": 40}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["message"]["tool_calls"]) == 1


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400(server, fields, param):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, **fields}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param


def test_return_tokens_as_token_ids_flag_and_request_override(client):
    """The server runs with --return-tokens-as-token-ids; a request's false wins."""
    kwargs = dict(logprobs=True, max_completion_tokens=3)
    default = [e.token for e in _chat(client, **kwargs).choices[0].logprobs.content]
    assert len(default) == 3 and all(t.startswith("token_id:") for t in default), default
    texts = _chat(client, **kwargs, extra_body={"return_tokens_as_token_ids": False})
    assert [e.token for e in texts.choices[0].logprobs.content] == ["It is", " sunny",
                                                                    " in Paris."]

"""POST /v1/chat/completions through the official `openai` client, against a real server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.utils import MODEL_NAME
from vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # a real engine on the bundled model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 10


def _chat(client, messages=MESSAGES, **kwargs):
    kwargs.setdefault("max_completion_tokens", MAX_TOKENS)
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                          **kwargs)


def test_chat_matches_offline_llm(client, server, offline_llm):
    completion = _chat(client)
    (offline,) = offline_llm.chat(
        MESSAGES, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False)
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == offline.outputs[0].text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == offline.outputs[0].finish_reason
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    # The prompt is the model's chat template applied to the messages.
    rendered = httpx.post(server.url_for("tokenize"), json={"messages": MESSAGES}).json()
    assert completion.usage.prompt_tokens == rendered["count"] == len(offline.prompt_token_ids)
    assert rendered["tokens"] == list(offline.prompt_token_ids)
    assert completion.usage.completion_tokens == len(offline.outputs[0].token_ids)


def test_chat_streaming(client):
    full = _chat(client)
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    content_chunks = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == (
        full.choices[0].message.content)
    assert content_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_continuous_usage_stats(client):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(_chat(client, stream=True, stream_options=options))
    content = [c for c in chunks[1:] if c.choices]
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens


CONTINUED = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France"}]


def test_chat_echo_prepends_the_final_assistant_message(client):
    """vLLM's chat `echo`: the reply starts with the last message when it is the
    assistant's (here continued with continue_final_message)."""
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = _chat(client, CONTINUED, extra_body=extra).choices[0].message.content
    echoed = _chat(client, CONTINUED, extra_body={**extra, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France" + plain
    chunks = list(_chat(client, CONTINUED, stream=True, extra_body={**extra, "echo": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == "The capital of France" + plain
    # A last message from the user is not echoed (vLLM: only the reply's own role).
    asked = _chat(client, extra_body={"echo": True}).choices[0].message.content
    assert asked == _chat(client).choices[0].message.content


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
])
def test_functions_are_refused_not_ignored(server, field, value):
    body = {"model": MODEL_NAME, "messages": MESSAGES, field: value}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_chat_logprobs(client):
    completion = _chat(client, logprobs=True, top_logprobs=2)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    text = completion.choices[0].message.content
    tokens = "".join(entry.token for entry in content)
    # As in vLLM, the EOS token that ended the reply has an entry too (not in the text).
    assert tokens == text or (completion.choices[0].finish_reason == "stop"
                              and tokens.startswith(text) and len(content[-1].token) > 1
                              and content[-1].token not in text)
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.bytes == list(entry.token.encode("utf-8"))
    plain = _chat(client)
    assert plain.choices[0].logprobs is None


def test_chat_n_streaming(client):
    chunks = list(_chat(client, n=2, stream=True, max_completion_tokens=4))
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert finished == {0, 1}
    greedy = _chat(client, max_completion_tokens=4).choices[0].message.content
    assert texts == {0: greedy, 1: greedy}


def test_chat_max_tokens_and_stop(client):
    capped = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=3,
        extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3
    assert capped.choices[0].finish_reason == "length"
    full = _chat(client).choices[0].message.content
    word = "Paris"
    assert word in full
    stopped = _chat(client, stop=[word]).choices[0]
    assert stopped.message.content == full[: full.index(word)]
    assert stopped.finish_reason == "stop"


def test_chat_multi_turn_with_system(client):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Again, please."}]},
    ]
    completion = _chat(client, messages=messages, max_completion_tokens=5)
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens > 20  # the whole conversation was rendered


def test_chat_prompt_logprobs(server):
    """vLLM's chat `prompt_logprobs`: on the response, one entry per prompt token (the
    first null), each holding the prompt's own token; refused with stream=true."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_completion_tokens": 2, "temperature": 0, "prompt_logprobs": 0}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    prompt = data["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == data["usage"]["prompt_tokens"]
    assert all(len(step) == 1 and next(iter(step.values()))["logprob"] <= 0
               for step in prompt[1:])
    streamed = httpx.post(server.url_for("v1/chat/completions"),
                          json={**body, "stream": True}, timeout=120)
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


# 40 million empty loop turns in jinja's sandbox: ~3 s of rendering on this CPU, against
# ~0.3 s for a 2-token chat; the sandbox caps one range() at 100000, so two loops nest.
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(400) %}{% endfor %}{% endfor %}"
                 "{{ messages[0]['content'] }}")


def test_a_slow_chat_template_holds_no_other_request(client, server):
    """A request whose template renders for seconds, then a small chat: the small one is
    answered first (an ordering check; before renders left the tokenizer thread, the
    small chat waited for the whole render)."""
    finished = []

    def slow() -> None:
        response = httpx.post(server.url_for("tokenize"), timeout=120,
                              json={"messages": MESSAGES, "chat_template": SLOW_TEMPLATE})
        finished.append(("slow", response.status_code, response.json().get("count")))

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)  # the slow render is under way (if not yet, the order proves less)
    completion = _chat(client, max_completion_tokens=2)
    finished.append(("small", 200, completion.usage.completion_tokens))
    thread.join(120)
    assert [f[0] for f in finished] == ["small", "slow"], finished
    assert finished[1][1] == 200 and finished[1][2] > 0


def test_text_only_model_refuses_an_image_part(server):
    """The bundled model takes no images: an image part is a 400 naming it."""
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(server.url_for("v1/chat/completions"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages.0.content.1.type", error
    assert "text-only" in error["message"]
    assert httpx.post(server.url_for("v1/chat/completions"), timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}).status_code == 200

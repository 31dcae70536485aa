"""Invalid requests get the OpenAI error body and the right status, and the server keeps
answering correctly afterwards; step failures and a dead engine (fault injection)."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.openai.utils import (
    DEFAULT_SERVER_ARGS,
    MAX_MODEL_LEN,
    MODEL_NAME,
    RemoteServer,
    error_of,
    port_is_free,
)
from vllm.sampling_params import MAX_LOGPROBS

pytestmark = pytest.mark.slow  # a real engine on the bundled model

PROMPT = "The capital of France is"
GOOD = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 4, "temperature": 0}
FAULT_WORKER = "tests.entrypoints.openai.fault_injection_serve.FaultInjectingWorker"


@pytest.fixture(scope="module")
def reference_text(server):
    """The greedy completion of PROMPT, taken before any bad request was sent."""
    response = httpx.post(server.url_for("v1/completions"), json=GOOD, timeout=120)
    assert response.status_code == 200
    return response.json()["choices"][0]["text"]


def _assert_still_serving(server, reference_text: str) -> None:
    response = httpx.post(server.url_for("v1/completions"), json=GOOD, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference_text
    assert httpx.get(server.url_for("health")).status_code == 200


def _nested_schema(depth: int) -> dict:
    """An object schema whose property nests `depth` objects deep."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_REQUESTS = [
    # (endpoint, overrides, status, param)
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"temperature": -0.5}, 400, "temperature"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"top_p": 1.5}, 400, "top_p"),
    ("completions", {"n": 0}, 400, "n"),
    ("completions", {"logprobs": MAX_LOGPROBS + 1}, 400, "logprobs"),
    ("completions", {"presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": 12}, 400, "prompt"),
    ("completions", {"max_tokens": "many"}, 400, "max_tokens"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"n": True}, 400, "n"),
    ("completions", {"stop": [""]}, 400, "stop"),
    ("completions", {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("completions", {"suffix": "!"}, 400, "suffix"),
    ("completions", {"model": "no-such-model"}, 404, "model"),
    ("chat/completions", {"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1}, 400,
     "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("chat/completions", {"model": "no-such-model"}, 404, "model"),
    # A structured-output constraint xgrammar cannot compile (or a malformed field) is a
    # 400 naming the field the client sent, decided before the engine (issue 47).
    *[(endpoint, {name: value}, 400, name)
      for endpoint in ("completions", "chat/completions")
      for name, value in [("guided_json", {"type": "foo"}), ("guided_regex", "(abc"),
                          ("guided_choice", []), ("guided_grammar", "root ::= undefined_rule"),
                          ("structured_outputs", {"json": '{"type": '}),
                          ("structured_outputs", {"choice": ["a"], "regex": "a"}),
                          ("structured_outputs", {"no_such_key": 1}),
                          ("structured_outputs", "json"),
                          ("response_format", {"type": "json_schema", "json_schema": {}}),
                          ("response_format", {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "object", "minProperties": "x"}}}),
                          ("response_format", {"type": "xml"})]],
    # A schema nested deeper than structured outputs take (a 500 from a RecursionError
    # before), and one llguidance parses but no output can satisfy, found only when the
    # engine compiles it (a 502 before): both 400s naming the field.
    *[(endpoint, {"structured_outputs": {"json": schema}}, 400, "structured_outputs")
      for endpoint in ("completions", "chat/completions")
      for schema in (_nested_schema(300), {"$ref": "#"})],
    *[("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}, 400, "response_format")
      for schema in (_nested_schema(300), {"$ref": "#"})],
    # Failing in the engine core too, the 400 names the field the client sent.
    ("completions", {"guided_json": {"$ref": "#"}}, 400, "guided_json"),
    ("chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"$ref": "#"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tools"),
    ("completions", {"guided_regex": "a+", "guided_decoding_backend": "outlines"}, 400,
     "guided_decoding_backend"),
    ("completions", {"guided_regex": "a+", "guided_whitespace_pattern": " "}, 400,
     "guided_whitespace_pattern"),
    ("completions", {"guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
     400, "guided_regex"),
    # Tools without --enable-auto-tool-choice: the default choice "auto" is refused, as
    # vLLM refuses it; malformed tools name their field.
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tool_choice"),
    ("chat/completions", {"tools": [{"type": "function"}], "tool_choice": "none"}, 400,
     "tools.0.function"),
    ("chat/completions", {"tool_choice": "required"}, 400, "tool_choice"),
    ("chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": _nested_schema(300)}}], "tool_choice": "required"}, 400,
     "tools"),
    ("chat/completions", {"functions": [{"name": "f"}]}, 400, "functions"),
    # vLLM's other request extras that are not implemented: refused when they ask for
    # something (a 200 would have ignored them).
    *[(endpoint, {name: value}, 400, name)
      for endpoint in ("completions", "chat/completions")
      for name, value in [("use_beam_search", True), ("length_penalty", 0.5), ("priority", 1),
                          ("logits_processors", ["x"]), ("return_tokens_as_token_ids", "yes"),
                          ("vllm_xargs", {"a": 1})]],
    # The sampler-side extras (issue 47): bad values are refused naming the field.
    *[(endpoint, {name: value}, 400, name)
      for endpoint in ("completions", "chat/completions")
      for name, value in [("allowed_token_ids", []), ("allowed_token_ids", [10**9]),
                          ("bad_words", [" "]),
                          ("bad_words", "Paris"), ("truncate_prompt_tokens", 0),
                          ("truncate_prompt_tokens", -2),
                          ("truncate_prompt_tokens", MAX_MODEL_LEN + 1)]],
    # As vLLM: continuing the final message and opening a new one exclude each other
    # (add_generation_prompt defaults to true); before, one was silently dropped.
    ("chat/completions", {"continue_final_message": True}, 400, "continue_final_message"),
    ("completions", {"allowed_token_ids": ["a"]}, 400, "allowed_token_ids.0"),  # the type
    ("chat/completions", {"chat_template_kwargs": 5}, 400, "chat_template_kwargs"),
    ("chat/completions", {"chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs.tokenize"),
    ("chat/completions", {"mm_processor_kwargs": {"a": 1}}, 400, "mm_processor_kwargs"),
    ("chat/completions", {"documents": [{"text": "d"}]}, 400, "documents"),
    ("completions", {"prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": -2}, 400, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": MAX_LOGPROBS + 1}, 400, "prompt_logprobs"),
    # -1 (the whole vocabulary) exceeds the default --max-logprobs 20, as in vLLM.
    ("completions", {"prompt_logprobs": -1}, 400, "prompt_logprobs"),
    # Non-finite floats (Python's JSON reads Infinity / NaN).
    ("completions", {"temperature": float("inf")}, 400, "temperature"),
    ("completions", {"top_p": float("nan")}, 400, "top_p"),
    ("completions", {"min_p": float("nan")}, 400, "min_p"),
    ("completions", {"repetition_penalty": float("inf")}, 400, "repetition_penalty"),
    ("chat/completions", {"frequency_penalty": float("-inf")}, 400, "frequency_penalty"),
    # n is bounded by --max-num-seqs (32 on the shared server).
    ("completions", {"n": 33}, 400, "n"),
    ("completions", {"n": 10**20}, 400, "n"),
    ("chat/completions", {"n": 33}, 400, "n"),
    # A lone UTF-16 surrogate in any string.
    ("completions", {"prompt": "\ud800"}, 400, "prompt"),
    ("completions", {"prompt": ["ok", "x\udfff"]}, 400, "prompt.1"),
    ("completions", {"model": "\ud800"}, 400, "model"),
    ("completions", {"stop": ["\ud800"]}, 400, "stop.0"),
    ("completions", {"logit_bias": {"\udc00": 1}}, 400, "logit_bias"),
    ("completions", {"user": "\ud800"}, 400, "user"),
    ("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400,
     "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, 400, "messages.0.content.0.text"),
    ("chat/completions", {"model": "\ud800"}, 400, "model"),
    # Content parts whose text is not a string, or that are not text at all.
    *[("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": text}]}]}, 400, "messages.0.content.0.text")
      for text in (7, None, ["a"], {"a": 1})],
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "messages.0.content.0.text"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "ok"}, "plain"]}]}, 400, "messages.0.content.1"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0.type"),
]


@pytest.mark.parametrize(("endpoint", "overrides", "status", "param"), BAD_REQUESTS,
                         ids=[f"{e}-{'-'.join(o)}-{s}" for e, o, s, _ in BAD_REQUESTS])
def test_bad_request(server, reference_text, endpoint, overrides, status, param):
    base = GOOD if endpoint == "completions" else CHAT
    response = _post_raw_json(server.url_for("v1", endpoint), {**base, **overrides})
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param, error
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    value = overrides.get(param)
    if isinstance(value, float) and not math.isfinite(value):
        assert error["message"] == f"{param} must be a finite number, got {value}", error
    if param == "n" and value > 32:  # names both numbers
        assert error["message"].startswith(f"n ({value}) must be <= max_num_seqs (32)"), error
    if "surrogate" in error["message"]:
        assert param in error["message"], error
    _assert_still_serving(server, reference_text)


def test_unsupported_extras_at_their_neutral_values_are_accepted(server, reference_text):
    """What vLLM sends by default (no beam search, no bad words, ...) asks for nothing."""
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [],
               "allowed_token_ids": None, "priority": 0, "return_tokens_as_token_ids": False}
    response = httpx.post(server.url_for("v1/completions"), json={**GOOD, **neutral}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == reference_text
    response = httpx.post(server.url_for("v1/chat/completions"),
                          json={**CHAT, **neutral, "chat_template_kwargs": {}}, timeout=120)
    assert response.status_code == 200, response.text


def _post_raw_json(url: str, body: object, timeout: float = 60) -> httpx.Response:
    """POST `body` as Python's json.dumps writes it: ASCII with \\uXXXX escapes (so lone
    surrogates travel) and Infinity / NaN, which httpx's own encoder refuses."""
    return httpx.post(url, content=json.dumps(body), timeout=timeout,
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "body", "param"), [
    ("tokenize", {"prompt": "\ud800"}, "prompt"),
    ("tokenize", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
    ("tokenize", {"model": "\ud800", "prompt": "hi"}, "model"),
    ("detokenize", {"model": "\ud800", "tokens": [1]}, "model"),
])
def test_lone_surrogate_on_tokenizer_endpoints(server, reference_text, path, body, param):
    response = _post_raw_json(server.url_for(path), body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == param
    assert error["message"].startswith(f"{param} contains a lone UTF-16 surrogate U+D")
    _assert_still_serving(server, reference_text)


BAD_TEMPLATES = [
    # (template, what the message says)
    ("{% for %}", "failed to render"),  # a syntax error
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),  # the sandbox refuses
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{{ messages[0].content + 1 }}", "can only concatenate"),  # a TypeError inside it
]


@pytest.mark.parametrize(("template", "says"), BAD_TEMPLATES)
@pytest.mark.parametrize("path", ["tokenize", "v1/chat/completions"])
def test_chat_template_that_fails_is_a_400(server, reference_text, path, template, says):
    body = {"messages": CHAT["messages"], "chat_template": template}
    if path != "tokenize":
        body = {**CHAT, **body}
    response = httpx.post(server.url_for(path), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "chat_template", error
    assert says in error["message"], error
    _assert_still_serving(server, reference_text)


@pytest.mark.parametrize("text", [7, None, ["a"], {"a": 1}])
def test_tokenize_messages_with_non_string_text_is_a_400(server, reference_text, text):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
    response = httpx.post(server.url_for("tokenize"), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == "messages.0.content.0.text", error
    assert error["message"].startswith("messages.0.content.0.text must be a string"), error
    _assert_still_serving(server, reference_text)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_prompt_plus_max_tokens_beyond_context(server, reference_text, endpoint):
    max_tokens = MAX_MODEL_LEN - 2  # any prompt of 3+ tokens overflows
    key = "max_tokens" if endpoint == "completions" else "max_completion_tokens"
    base = GOOD if endpoint == "completions" else CHAT
    response = httpx.post(server.url_for("v1", endpoint), json={**base, key: max_tokens})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert str(max_tokens) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert error["param"] == key
    _assert_still_serving(server, reference_text)


def test_prompt_longer_than_context(server, reference_text):
    response = httpx.post(server.url_for("v1/completions"),
                          json={**GOOD, "prompt": "hello " * (MAX_MODEL_LEN + 10)})
    assert response.status_code == 400
    assert str(MAX_MODEL_LEN) in error_of(response)["message"]
    _assert_still_serving(server, reference_text)


@pytest.mark.parametrize("body, content_type, says", [
    (b'{"prompt": "x", ', "application/json", "not valid JSON"),
    (b"not json", "application/json", "not valid JSON"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
    (b"", "application/json", "the request body is missing"),
    (b'{"model": "m", "prompt": "x"}', "text/plain", "Content-Type application/json"),
])
def test_malformed_json(server, reference_text, body, content_type, says):
    response = httpx.post(server.url_for("v1/completions"), content=body,
                          headers={"content-type": content_type})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "BadRequestError"
    assert says in error["message"], error
    _assert_still_serving(server, reference_text)


def test_openai_client_raises_typed_errors(client, reference_text, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=-1)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    _assert_still_serving(server, reference_text)


def test_unknown_route_and_method(server):
    assert error_of(httpx.get(server.url_for("v1/nothing")))["code"] == 404
    assert error_of(httpx.post(server.url_for("v1/models")))["code"] == 405
    # Sleep endpoints exist only with --enable-sleep-mode.
    assert httpx.get(server.url_for("is_sleeping")).status_code == 404


# ------------------------------------------------------------------ fault injection
@pytest.fixture(scope="module")
def fault_server():
    fault_file = os.path.join(tempfile.mkdtemp(prefix="vllm-fault-"), "fault")
    remote = RemoteServer([*DEFAULT_SERVER_ARGS, "--worker-cls", FAULT_WORKER,
                           "--enable-sleep-mode"],
                          env={"VLLM_TEST_FAULT_FILE": fault_file})
    remote.fault_file = fault_file
    try:
        yield remote
    finally:
        remote.close()


def _inject(server, kind: str) -> None:
    Path(server.fault_file).write_text(kind)


def test_step_failure_fails_only_that_step(fault_server):
    reference = httpx.post(fault_server.url_for("v1/completions"), json=GOOD, timeout=120)
    reference_text = reference.json()["choices"][0]["text"]
    # Non-streaming: the request's step fails -> 500 with the OpenAI body.
    _inject(fault_server, "step")
    failed = httpx.post(fault_server.url_for("v1/completions"), json=GOOD, timeout=120)
    assert failed.status_code == 500, failed.text
    assert "injected step failure" in error_of(failed)["message"]
    _assert_still_serving(fault_server, reference_text)
    # Streaming: headers are out, so the error arrives in-band, then [DONE].
    body = {**GOOD, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", fault_server.url_for("v1/completions"), json=body,
                      timeout=120) as response:
        events = []
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if len(events) == 2:
                _inject(fault_server, "step")
    assert events[-1] == "data: [DONE]"
    assert '"code":500' in events[-2] and "injected step failure" in events[-2]
    assert len(events) < 200  # it did not run to the end
    _assert_still_serving(fault_server, reference_text)


def _post(server, route: str, **params) -> httpx.Response:
    return httpx.post(server.url_for(route), params=params, timeout=120)


def _is_sleeping(server) -> bool:
    return httpx.get(server.url_for("is_sleeping")).json()["is_sleeping"]


def test_level2_wake_failing_part_way_then_retried_serves_the_same_text(fault_server):
    """After /sleep?level=2 the driver maps the weights, then fails on the KV cache: 503;
    the retry succeeds and must reload the weights (zero pages would answer garbage)."""
    log_start = len(fault_server.log())  # earlier tests' injected step faults log tracebacks
    reference_text = httpx.post(fault_server.url_for("v1/completions"), json=GOOD,
                                timeout=120).json()["choices"][0]["text"]
    assert _post(fault_server, "sleep", level=2).status_code == 200
    _inject(fault_server, "wake_map:1")
    failed = _post(fault_server, "wake_up")
    assert failed.status_code == 503, failed.text
    assert _is_sleeping(fault_server)
    assert _post(fault_server, "wake_up").status_code == 200
    assert not _is_sleeping(fault_server)
    _assert_still_serving(fault_server, reference_text)
    assert "Traceback" not in fault_server.log()[log_start:]


def test_wake_without_memory_is_503_naming_the_sizes_and_stays_asleep(fault_server):
    log_start = len(fault_server.log())  # earlier tests' injected step faults log tracebacks
    reference_text = httpx.post(fault_server.url_for("v1/completions"), json=GOOD,
                                timeout=120).json()["choices"][0]["text"]
    assert _post(fault_server, "sleep", level=1).status_code == 200
    _inject(fault_server, "wake_map:0")
    failed = _post(fault_server, "wake_up")
    assert failed.status_code == 503, failed.text
    message = error_of(failed)["message"]
    assert re.search(r"needs \d+\.\d+ GiB of device memory and \d+\.\d+ GiB is free "
                     r"\(map\(size=\d+\) failed: out of memory", message), message
    assert error_of(failed)["type"] == "ServiceUnavailableError"
    assert _is_sleeping(fault_server)
    asleep = httpx.post(fault_server.url_for("v1/completions"), json=GOOD, timeout=120)
    assert asleep.status_code == 503
    assert _post(fault_server, "wake_up").status_code == 200
    _assert_still_serving(fault_server, reference_text)
    assert "Traceback" not in fault_server.log()[log_start:]


def test_device_error_kills_engine_and_exits_nonzero(fault_server):
    _inject(fault_server, "cuda")
    failed = httpx.post(fault_server.url_for("v1/completions"), json=GOOD, timeout=120)
    assert failed.status_code == 500
    assert "CUDA error" in error_of(failed)["message"]
    try:  # the process lingers a moment so probes see the state
        health = httpx.get(fault_server.url_for("health"), timeout=5)
        assert health.status_code == 503
        assert "dead" in error_of(health)["message"]
    except httpx.ConnectError:
        pass  # already gone
    deadline = time.monotonic() + 60
    while fault_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fault_server.proc.returncode == 1
    assert port_is_free(fault_server.port)

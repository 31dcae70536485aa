"""An unknown request field is ignored with a warning naming it, as vLLM does (it was a
200 with no log line: a typo'd parameter went unnoticed)."""

from __future__ import annotations

import logging

import pytest

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)

CASES = [
    (CompletionRequest, {"model": "m", "prompt": "x"}),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
    (TokenizeRequest, {"prompt": "x"}),
]


@pytest.mark.parametrize(("model", "body"), CASES, ids=lambda v: getattr(v, "__name__", ""))
def test_an_unknown_field_is_a_warning_naming_it(model, body, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        request = model.model_validate({**body, "foo": 1, "max_tokenz": 5})
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [f"{model.__name__}: ignored unknown field(s) 'foo', 'max_tokenz'"]
    assert not hasattr(request, "foo")


def test_known_fields_and_aliases_log_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 3,
                                          "top_k": 2, "stream_options": None})
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "name": "a"}],
             "max_completion_tokens": 4})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_many_or_long_unknown_names_stay_one_short_line(caplog):
    body = {"model": "m", "prompt": "x", "k" * 1000: 1, **{f"f{i}": i for i in range(20)}}
    with caplog.at_level(logging.WARNING, logger="vllm"):
        CompletionRequest.model_validate(body)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in message and len(message) < 300 and message.endswith("and 13 more")

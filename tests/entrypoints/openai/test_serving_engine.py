"""Error bodies always encode, whatever user text their message quotes."""

from __future__ import annotations

import json

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.serving_engine import stream_error_event


def test_error_with_lone_surrogate_renders_escaped():
    error = APIError(404, "The model `\ud800x` does not exist.", "model\udc00")
    response = error.response()  # rendering used to raise UnicodeEncodeError
    body = json.loads(response.body)
    assert response.status_code == 404
    assert body["error"]["message"] == "The model `\\ud800x` does not exist."
    assert body["error"]["param"] == "model\\udc00"
    event = stream_error_event(ValueError("bad \udfff"))
    assert event.startswith("data: ") and "bad \\\\udfff" in event
    event.encode("utf-8")


def test_valid_unicode_is_kept():
    body = json.loads(APIError(400, "naïve 😀").response().body)
    assert body["error"]["message"] == "naïve 😀"


def test_validation_error_param_comes_from_the_error_not_its_message():
    from vllm.entrypoints.openai.errors import validation_error
    from vllm.exceptions import VLLMValidationError

    # The message names another field: the param is still the one the error carries.
    error = VLLMValidationError("max_tokens exceeds what the prompt leaves", parameter="prompt")
    assert validation_error(error).param == "prompt"
    # Chat renames engine fields; a message that starts with the field follows.
    renamed = validation_error(
        VLLMValidationError("logprobs must be <= 20, got 21", parameter="logprobs"),
        {"logprobs": "top_logprobs"},
    )
    assert renamed.param == "top_logprobs"
    assert renamed.message == "top_logprobs must be <= 20, got 21"
    plain = validation_error(ValueError("n (3) is odd"), default="messages")
    assert (plain.status, plain.param) == (400, "messages")

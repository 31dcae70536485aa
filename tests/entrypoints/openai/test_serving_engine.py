"""Error bodies always encode, whatever user text their message quotes."""

from __future__ import annotations

import json

from vllm.entrypoints.openai.serving_engine import APIError, stream_error_event


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

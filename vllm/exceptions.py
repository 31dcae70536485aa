"""Errors shared by every layer (torch-free, imports nothing from vllm).

`VLLMValidationError` is the one way a layer says "this request value is
wrong": it is a `ValueError` (callers that catch `ValueError` keep working)
that also names the offending request field, so the OpenAI server can fill
the error body's `param` from the error itself instead of guessing it from
the message. vLLM uses the same class name and `parameter` attribute.
"""

from __future__ import annotations

from typing import Any


class VLLMValidationError(ValueError):
    """An invalid request value; `str(error)` is the message shown to the user.

    Args:
        message: what is wrong, with the numbers.
        parameter: the request field at fault, in the engine's names
            (a `SamplingParams` field, "prompt", "messages.0.content"); None
            when the error is about no single field.
        value: the rejected value, when useful to a caller.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class DeviceBusyError(RuntimeError):
    """The device is held by other processes so that this engine cannot start (or may not).

    `str(error)` is one line naming the other processes, their memory and the
    flag to set; `vllm serve` prints it as is (no traceback).
    """

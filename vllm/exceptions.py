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


class DeviceMemoryError(RuntimeError):
    """The device could not give memory that an operation needs now (a wake after a
    sleep); the engine state is unchanged and the call can be retried. The server
    answers it with HTTP 503. Sizes in bytes.

    Args:
        message: what needed the memory, with the figures and the driver's error.
        needed_bytes: bytes the operation had to map.
        free_bytes: bytes free on the device when it failed.
    """

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes

    def __reduce__(self) -> tuple[Any, ...]:  # keyword arguments survive pickling (processes)
        return (_rebuild_device_memory_error, (str(self), self.needed_bytes, self.free_bytes))


def _rebuild_device_memory_error(message: str, needed: int, free: int) -> DeviceMemoryError:
    return DeviceMemoryError(message, needed_bytes=needed, free_bytes=free)


class DeviceBusyError(RuntimeError):
    """The device is held by other processes so that this engine cannot start (or may not).

    `str(error)` is one line naming the other processes, their memory and the
    flag to set; `vllm serve` prints it as is (no traceback).
    """


class EngineStartupError(RuntimeError):
    """The engine could not start, for a reason its configuration or the device states
    in one line; `vllm serve` prints `str(error)` and exits with `exit_code` (2: a
    configuration the engine cannot honour, e.g. a KV connector's option; 1: a
    device that cannot hold what was asked), with no traceback.
    """

    def __init__(self, message: str, *, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

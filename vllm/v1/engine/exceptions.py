"""Errors the async engine client raises to its callers (the OpenAI server maps them).

```
ValueError              invalid request (admission)           -> HTTP 400
EngineGenerateError     a step failed; this request is lost   -> HTTP 500, server stays up
EngineDeadError         unrecoverable engine failure          -> HTTP 500, /health 503, exit != 0
EngineSleepingError     engine asleep (sleep mode)            -> HTTP 503
EngineShutdownError     engine shut down / shutting down      -> HTTP 503
SleepModeUnavailableError  sleep asked of an engine without it -> HTTP 501
```
"""

from __future__ import annotations


class EngineGenerateError(RuntimeError):
    """A request failed because the engine step that computed it raised.

    The engine dropped the request (its KV blocks are freed) and keeps serving
    the others.
    """


class KVTransferError(EngineGenerateError):
    """A request failed because its KV cache could not be fetched from another instance.

    (The prefill instance died or is unreachable.) The decode instance freed the
    request's blocks; the server answers 502.
    """


class EngineDeadError(RuntimeError):
    """The engine hit an unrecoverable error and serves nothing any more.

    Raised for every in-flight and new request once the engine is dead
    (a device error such as a CUDA fault, or several step failures in a row).
    """


class EngineSleepingError(RuntimeError):
    """The engine is asleep (sleep mode): requests are rejected until `wake_up`."""


class EngineShutdownError(RuntimeError):
    """The engine was shut down (or is shutting down); the request was not served."""


class SleepModeUnavailableError(RuntimeError):
    """`sleep` / `wake_up` asked of an engine that cannot sleep (not enabled or not implemented)."""

"""Errors the async engine client raises to its callers (the OpenAI server maps them).

```
ValueError              invalid request (admission)           -> HTTP 400
EngineGenerateError     a step failed; this request is lost   -> HTTP 500, server stays up
EngineDeadError         unrecoverable engine failure          -> HTTP 500, /health 503, exit != 0
EngineSleepingError     engine asleep (sleep mode)            -> HTTP 503
EngineShutdownError     engine shut down / shutting down      -> HTTP 503
SleepModeUnavailableError  sleep asked of an engine without it -> HTTP 501
```

While an engine starts (`startup_errors`, for `vllm serve` and the offline
engine of `vllm bench`), what its configuration or the device refuses becomes
`vllm.exceptions.EngineStartupError`: the CLI prints it as one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from vllm.exceptions import DeviceBusyError, EngineStartupError


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


@contextmanager
def startup_errors() -> Iterator[None]:
    """Around building an engine: what it refuses becomes `EngineStartupError`.

    A ValueError or a missing file while it loads, sizes or warms up (a flag
    value only the engine can check, a KV connector's option) gets exit code 2;
    a KV cache the device cannot hold (`KVCacheSizingError`) gets 1.
    `DeviceBusyError` (another process holds the device) passes as it is;
    anything else propagates with its traceback. What a rank in a process of its
    own raised arrives as a `WorkerError` (the offline engine's mp executor) and
    is judged by that exception (`startup_cause`), as with one rank.

    Raises:
        EngineStartupError: carrying the message and the exit code.
    """
    try:
        yield
    except Exception as e:
        code = startup_exit_code(cause := startup_cause(e))
        if code is not None:
            raise EngineStartupError(str(cause), exit_code=code) from e
        if cause is not e and isinstance(cause, DeviceBusyError):
            raise cause from e
        raise


def startup_cause(error: BaseException) -> BaseException:
    """The exception a rank raised, for a `WorkerError` that carries it (it pickled
    back from the rank's process); else `error` itself."""
    from vllm.v1.executor.worker_wrapper import WorkerError  # torch-free

    if isinstance(error, WorkerError) and error.original is not None:
        return error.original
    return error


def startup_exit_code(cause: BaseException) -> int | None:
    """`vllm serve`'s exit code for a start-up refusal stated in one line (2: the
    configuration, 1: the KV cache does not fit the device); None: not one of those."""
    from vllm.v1.worker.kv_cache_sizing import KVCacheSizingError  # torch-free

    if isinstance(cause, ValueError | FileNotFoundError):
        return 2
    if isinstance(cause, KVCacheSizingError):
        return 1
    return None

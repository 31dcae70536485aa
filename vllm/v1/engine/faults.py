"""What a failed step means: the engine core's one fault policy.

    step raised  --is it a device fault (CUDA / HIP context unusable), a dead
                   worker, or the 3rd failure in a row?--
        no   -> fail the requests that step scheduled (they finish with the
                error, their blocks are freed); the loop goes on
        yes  -> the engine is dead: the reason goes to the frontend, every
                stream ends with EngineDeadError, `vllm serve` exits non-zero

The engine core process's loop (`core_proc.EngineCoreProc`) is the only
place a step fails while serving, so it is the only user; the offline `LLM`
steps the core from its caller's thread and lets a failure raise to it.
"""

from __future__ import annotations

from collections.abc import Iterator

from vllm.v1.executor.worker_wrapper import WorkerDiedError, WorkerError

# A step that fails this many times in a row means the engine is broken, not
# one request: a transient fault (one bad request, one OOM) clears on the next
# step, a persistent one would otherwise fail every request forever.
MAX_CONSECUTIVE_STEP_FAILURES = 3

# Exception types after which the device context cannot be trusted, by name
# (torch >= 2.8 raises CUDA / HIP faults as torch.AcceleratorError; a failed
# NCCL collective is torch.distributed.DistBackendError). Names, not imports:
# a worker's exception may arrive pickled, or only as its type's name.
DEVICE_ERROR_TYPES = frozenset({"AcceleratorError", "DistBackendError"})
# Older torch, cuBLAS and the CUDA runtime raise a plain RuntimeError: only
# its message tells (the CUDA / HIP runtime's error strings).
DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "HIP error",
    "CUBLAS_STATUS_",
    "device-side assert",
    "NCCL error",
    "cudaError",
)


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error`, its causes, and a worker error's original exception (each once)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, WorkerError):
            todo.append(e.original)


def is_device_error(error: BaseException) -> bool:
    """True for errors after which the device context cannot be trusted (CUDA / HIP faults).

    Decided by the exception's type where torch gives one (also through a
    `WorkerError` from another rank's process, whose `reason` starts with the
    type's name), else by the runtime's message on a `RuntimeError`.
    """
    for e in _chain(error):
        if type(e).__name__ in DEVICE_ERROR_TYPES:
            return True
        if isinstance(e, WorkerError) and e.reason.split(":", 1)[0] in DEVICE_ERROR_TYPES:
            return True
        if isinstance(e, RuntimeError) and any(m in str(e) for m in DEVICE_ERROR_MARKERS):
            return True
    return False


class StepFailures:
    """Counts failed steps in a row and says when the engine is dead.

    Args:
        limit: failures in a row that make the engine dead.
    """

    def __init__(self, limit: int = MAX_CONSECUTIVE_STEP_FAILURES) -> None:
        self.limit = limit
        self.consecutive = 0

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, error: BaseException, executor_failed: bool = False) -> str | None:
        """Record a failed step; the reason the engine is dead now, or None.

        None means: fail the step's requests and go on.

        Args:
            error: what the step raised.
            executor_failed: the executor reported a dead worker (also when the
                step's own error does not say so).
        """
        self.consecutive += 1
        if isinstance(error, WorkerDiedError) or executor_failed:
            return str(error)  # "worker rank 1 died (killed by SIGKILL)"
        if is_device_error(error):
            return f"the engine step failed with a device error: {error!r}"
        if self.consecutive >= self.limit:
            return f"{self.consecutive} engine steps failed in a row, the last with {error!r}"
        return None

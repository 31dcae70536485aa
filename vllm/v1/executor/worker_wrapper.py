"""One rank's worker, built by name and called through its `@rpc` methods (every
executor's far end).

    executor ---- collective_rpc(Worker.load_model) ----> WorkerWrapper.execute_method
       uni: a direct call     mp: a pipe to a process     ray: an actor method
                                                            |
                                                         worker.load_model()
                                                         (an @rpc method; see
                                                          v1/worker/worker_base.py)

The wrapper exists so that the process (or Ray actor) can be started before
the worker: environment variables (CUDA_VISIBLE_DEVICES on a Ray node) must
be set before torch initialises the device, and the worker class is imported
only in the process that runs it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm import envs
from vllm.logger import init_logger
from vllm.v1.worker.worker_base import is_rpc

logger = init_logger(__name__)

class WorkerError(RuntimeError):
    """A worker method raised on one rank.

    Attributes:
        rank: the global rank that failed.
        method: the method called ("load_model", ...).
        reason: "<ExceptionType>: <message>" of the worker's exception.
        remote_traceback: the traceback text from the worker process.

    The worker's own exception, when it could be pickled back, is the
    `__cause__`, so `except ValueError` style handling still sees its type
    through `original`.
    """

    def __init__(
        self,
        rank: int,
        method: str,
        reason: str,
        remote_traceback: str = "",
        original: BaseException | None = None,
    ) -> None:
        super().__init__(f"rank {rank} failed in {method}: {reason}")
        self.rank = rank
        self.method = method
        self.reason = reason
        self.remote_traceback = remote_traceback
        self.original = original


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) is gone.

    Attributes:
        rank: the global rank whose process died.
        detail: how it ended ("exit code 1", "killed by SIGKILL", ...).
    """

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"worker rank {rank} died ({detail})")
        self.rank = rank
        self.detail = detail


@dataclass
class RemoteFailure:
    """A worker exception in a picklable form (the exception itself may not pickle)."""

    reason: str
    traceback: str
    exception: BaseException | None

    @classmethod
    def capture(cls, error: BaseException) -> RemoteFailure:
        import pickle

        try:
            pickle.loads(pickle.dumps(error))
            picklable: BaseException | None = error
        except Exception:
            picklable = None
        return cls(f"{type(error).__name__}: {error}", traceback.format_exc(), picklable)

    def to_error(self, rank: int, method: str) -> WorkerError:
        error = WorkerError(rank, method, self.reason, self.traceback, self.exception)
        error.__cause__ = self.exception
        return error


def method_name(method: Callable[..., Any]) -> str:
    """The name a call is reported under ("load_model", a function's name)."""
    return getattr(method, "__name__", repr(method))


@dataclasses.dataclass(frozen=True)
class WorkerCall:
    """One `collective_rpc` call as every transport carries it to the ranks.

    Fields:
        method: the worker's `@rpc` method, or a function called as `fn(worker, ...)`.
        args, kwargs: its arguments, the same on every rank.
        timeout: seconds to wait for all ranks; None waits as long as they live.
        unique_reply_rank: only this rank's result comes back (None: every rank's).
    """

    method: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout: float | None = None
    unique_reply_rank: int | None = None

    @property
    def name(self) -> str:
        return method_name(self.method)

    def run(self, wrapper: WorkerWrapper) -> Any:
        """This rank's result (`wrapper.execute_method`)."""
        return wrapper.execute_method(self.method, *self.args, **self.kwargs)

    def replies(self, results: list[Any]) -> list[Any]:
        """`results` (one per rank, in rank order) as `collective_rpc` returns them."""
        if self.unique_reply_rank is not None:
            return [results[self.unique_reply_rank]]
        return results


def check_method(method: Callable[..., Any]) -> None:
    """Refuse what `collective_rpc` cannot call: a name instead of the method.

    Raises:
        TypeError: `method` is a string, not callable, or a method not marked `@rpc`.
    """
    if isinstance(method, str) or not callable(method):
        raise TypeError(
            f"collective_rpc takes the worker method itself (e.g. Worker.load_model, marked "
            f"@rpc) or a function of the worker, not {method!r}"
        )
    qualname = getattr(method, "__qualname__", "")
    if "." in qualname and "<locals>" not in qualname and not is_rpc(method):
        raise TypeError(
            f"{qualname} is not marked @rpc: a worker offers the engine only its @rpc methods"
        )


def resolve_class(qualname: str) -> type:
    """The class named "package.module.ClassName"."""
    module_name, _, class_name = qualname.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


class WorkerWrapper:
    """Holds one rank's worker once `init_worker` built it.

    Args:
        rank: the global rank this wrapper will host (for messages before the worker exists).
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.worker: Any = None

    def update_environment_variables(self, env: dict[str, str]) -> None:
        """Set variables before the worker (and torch's device context) exist."""
        for key, value in env.items():
            os.environ[key] = value
        envs.reset()  # VLLM_* variables are read again from here on

    def init_worker(self, worker_cls: str, kwargs: dict[str, Any]) -> int:
        """Build `worker_cls(**kwargs)` (kwargs: vllm_config, local_rank, rank,
        distributed_init_method, is_driver_worker). Returns this process's pid."""
        self.rank = kwargs.get("rank", self.rank)
        self.worker = resolve_class(worker_cls)(**kwargs)
        return os.getpid()

    def execute_method(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`worker.<name>(*args, **kwargs)` for an `@rpc` method (the worker's own
        attribute of that name, so a subclass's override runs), or
        `method(worker, *args, **kwargs)` for a plain function.

        Raises:
            RuntimeError: no worker yet, or the worker has no `@rpc` method of that name.
        """
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank}: the worker is not initialized")
        if not is_rpc(method):
            return method(self.worker, *args, **kwargs)
        name = method_name(method)
        fn = getattr(self.worker, name, None)
        if fn is None or not is_rpc(fn):
            raise RuntimeError(
                f"rank {self.rank}: {type(self.worker).__name__} has no @rpc method {name!r}"
            )
        return fn(*args, **kwargs)

    def shutdown(self) -> None:
        """Call the worker's `shutdown` (if any) and drop it."""
        worker, self.worker = self.worker, None
        if worker is not None and hasattr(worker, "shutdown"):
            worker.shutdown()

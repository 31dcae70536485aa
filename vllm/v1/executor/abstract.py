"""`Executor`: how the engine core reaches its workers, one per rank, through one seam.

    EngineCore ---- executor.collective_rpc(Worker.method, args, kwargs, timeout) ---+
                                                                               |
        uni   UniProcExecutor     the worker in this process (one rank)        |
        mp    MultiprocExecutor   one process per rank on this node, pipes     |
        ray   RayDistributedExecutor  one Ray actor per rank, placement group  |
                                                                               v
                         [rank 0 result, rank 1 result, ...]  (or rank `unique_reply_rank`'s)

Every stage of a worker's life goes through `collective_rpc` with the worker's
`@rpc` method itself (v1/worker/worker_base.py): init_device, load_model,
initialize_kv_cache, compile_or_warm_up_model, execute_model, sleep, wake_up.
A method that raises on any rank raises `WorkerError` naming the rank and
reason; a worker process that dies raises `WorkerDiedError` (naming the rank)
from the call in flight, and runs the callbacks of `register_failure_callback`
even when no call is in flight, so the engine can report it at once.

Which executor: `ParallelConfig.distributed_executor_backend` (vLLM's rule:
"uni" for one rank, "mp" for several on one node, "ray" when asked, when Ray
is already initialised, or when there are more ranks than local devices).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.logger import init_logger
from vllm.v1.executor.worker_wrapper import (
    WorkerCall,
    WorkerDiedError,
    WorkerError,
    check_method,
    resolve_class,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)
T = TypeVar("T")

__all__ = ["Executor", "WorkerDiedError", "WorkerError"]

EXECUTOR_CLASSES = {
    "uni": "vllm.v1.executor.uniproc_executor.UniProcExecutor",
    "mp": "vllm.v1.executor.multiproc_executor.MultiprocExecutor",
    "ray": "vllm.v1.executor.ray_executor.RayDistributedExecutor",
}


class Executor(ABC):
    """Drives `world_size` workers (one per rank) of one engine.

    Args:
        vllm_config: the engine's validated configuration
            (`parallel_config.world_size` ranks, `parallel_config.worker_cls`).

    Raises:
        WorkerError / WorkerDiedError: a rank failed to start; the message names
            it and its reason, and every rank that did start is shut down.
    """

    uses_ray: bool = False

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.world_size = self.parallel_config.world_size
        self.worker_cls = self.parallel_config.worker_cls
        self.is_failed = False
        self._failure_callbacks: list[Callable[[BaseException], None]] = []
        self._failure_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._init_executor()

    @staticmethod
    def get_class(vllm_config: VllmConfig) -> type[Executor]:
        """The executor class for the config's resolved `distributed_executor_backend`."""
        backend = vllm_config.parallel_config.distributed_executor_backend
        if backend not in EXECUTOR_CLASSES:
            raise ValueError(f"unknown distributed_executor_backend {backend!r}")
        # By name: the backends import this module, and Ray stays unimported unless asked.
        return resolve_class(EXECUTOR_CLASSES[backend])

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers (processes / actors) and build every rank's worker."""

    def collective_rpc(
        self,
        method: Callable[..., T],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[T]:
        """Call `method` on every rank's worker and wait for all of them.

        Args:
            method: a worker method marked `@rpc` (`Worker.load_model`: the
                method itself, not its name; each rank calls its own worker's
                method of that name), or a module-level function called as
                `fn(worker, *args, **kwargs)` (it must pickle by reference).
            timeout: seconds to wait for all ranks; None waits as long as they live.
            args, kwargs: the arguments, the same on every rank.
            unique_reply_rank: only this rank sends its result back (the
                others still report success or failure); the result list then
                holds that one result.

        Returns:
            each rank's return value, in rank order (or the one of `unique_reply_rank`).

        Raises:
            TypeError: `method` is a name, not the method.
            WorkerError: the method raised on a rank (the lowest failing rank is named).
            WorkerDiedError: a rank's process died before replying.
            TimeoutError: `timeout` passed (naming the ranks that did not reply).
        """
        check_method(method)
        return self._collective_rpc(
            WorkerCall(method, tuple(args), kwargs or {}, timeout, unique_reply_rank)
        )

    @abstractmethod
    def _collective_rpc(self, call: WorkerCall) -> list[Any]:
        """`collective_rpc` with its arguments checked (each executor's transport)."""

    def check_health(self) -> None:
        """Raise the failure that broke the executor (e.g. `WorkerDiedError`), if any."""
        if self._failure is not None:
            raise self._failure

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` runs once (on a monitor thread) when a worker dies unexpectedly.

        Registered after the failure, it runs at once.
        """
        with self._failure_lock:
            failure = self._failure
            if failure is None:
                self._failure_callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def _report_failure(self, error: BaseException) -> None:
        """Mark the executor failed and run the failure callbacks (first failure only)."""
        with self._failure_lock:
            if self._failure is not None:
                return
            self._failure = error
            self.is_failed = True
            callbacks = list(self._failure_callbacks)
        logger.error("Executor failed: %s", error)
        for callback in callbacks:
            try:
                callback(error)
            except Exception:
                logger.exception("executor failure callback raised")

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker and reap its process; idempotent, never raises."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def first_error(errors: dict[int, BaseException]) -> BaseException:
    """The error of the lowest rank (ranks usually fail together for the same reason)."""
    return errors[min(errors)]

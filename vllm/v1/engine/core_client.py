"""`MPEngineCoreClient`: the frontend's handle on an `EngineCoreProc` (core_proc.py).

It offers the methods of `EngineCore` that the frontend uses, so `LLMEngine`
runs unchanged over either (`LLMEngine(..., multiprocess_mode=True)`):

    add_request / abort_requests / finish_requests_stopped   -> one message, no wait
    step()          the next outputs the engine process sent (waits at most
                    `step_timeout`; [] when none yet); raises StepFailedError
                    when the engine failed a step's requests, EngineDeadError
                    when the process is dead
    sleep / wake_up / is_sleeping / reload_weights / reset_prefix_cache
                    a call: one message, wait for its result (outputs that
                    arrive meanwhile are kept for the next step())
    get_stats / kv_cache_memory   the figures sent with the latest outputs

Only one thread may use a client (ZMQ sockets are not thread-safe); the
monitor thread it starts only watches the process and its status pipe, and
runs the dead callbacks, so an idle server learns of a dead engine (or a dead
worker, which kills the engine) within a second.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.engine.core_launcher import take_launcher
from vllm.v1.engine.core_proc import EngineCoreOutputs
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.executor.multiproc_executor import describe_exit, reap

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Seconds the engine process gets to stop (it shuts its workers down) before SIGKILL.
_SHUTDOWN_GRACE_S = 30.0


class StepFailedError(RuntimeError):
    """The engine process failed a step; `request_ids` were aborted there."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class MPEngineCoreClient:
    """Starts the engine core process and talks to it (see the module docstring).

    Args:
        vllm_config: the validated configuration (sent to the process).
        step_timeout: the longest `step()` waits for outputs (seconds).

    Raises:
        whatever the engine raised while starting (its own type when it
        pickles: ValueError for a bad configuration), or EngineDeadError when
        the process died before it was ready.
    """

    def __init__(self, vllm_config: VllmConfig, step_timeout: float = 0.02) -> None:
        import zmq

        self.step_timeout = step_timeout
        self._zmq = zmq.Context()
        self._ids = itertools.count()
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._unfinished: set[str] = set()
        # Abort / finish messages the engine has not acknowledged yet: until it has, the
        # frontend keeps stepping, so the figures after them (freed blocks) are recorded.
        self._unacked = 0
        self._kv_sends_pending = False  # see EngineCoreOutputs.kv_sends_pending
        self._failed_ids: list[str] = []
        self._sleeping: bool | None = False
        self._dead_reason: str | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._lock = threading.Lock()
        self._reap_lock = threading.Lock()  # see multiproc_executor.reap
        self._closing = False
        launcher = take_launcher()
        self.process, self._status, self._paths = launcher.process, launcher.status, launcher.paths
        self._stop_state = {"asked": False}
        self._finalizer = weakref.finalize(
            self, _stop_process, self.process, self._reap_lock, self._paths, self._stop_state
        )
        self._input = self._zmq.socket(zmq.PUSH)
        self._output = self._zmq.socket(zmq.PULL)
        try:
            self._input.bind(launcher.addresses[0])
            self._output.bind(launcher.addresses[1])
            # A process that died meanwhile makes this fail: _wait_ready says how it ended.
            with contextlib.suppress(OSError):
                launcher.send_config(vllm_config)
            logger.info("Started the engine core process (pid %d); it loads the model, "
                        "profiles and warms up before serving ...", self.process.pid)
            info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = info["num_blocks"]
        self.max_model_len = info["max_model_len"]  # fitted to the KV cache
        self._scheduler_stats = info["scheduler_stats"]
        self._kv_memory = info["kv_memory"]
        self._monitor_thread = threading.Thread(
            target=self._monitor, name="vllm-core-monitor", daemon=True
        )
        self._monitor_thread.start()

    def _wait_ready(self) -> dict[str, Any]:
        """Block until the process reports ready (model loaded, KV cache sized) or failed."""
        while True:
            ready = wait([self._status, self.process.sentinel])
            if self._status in ready:
                try:
                    kind, value = self._status.recv()
                except (EOFError, OSError):
                    kind, value = "died", None
                if kind == "ready":
                    return value
                if kind == "startup_failed":
                    self._stop_state["asked"] = True  # it exits by itself: no SIGTERM
                    if value.exception is not None:
                        raise value.exception
                    raise RuntimeError(f"the engine core failed to start: {value.reason}")
            if self.process.sentinel in ready and not self._status.poll():
                raise EngineDeadError(
                    f"the engine core process died during start-up ({self._exit_detail()})"
                )

    # ---------------------------------------------------------------- liveness
    def _exit_detail(self) -> str:
        """How the engine process ended ('killed by SIGKILL', ...): it is reaped first."""
        return describe_exit(reap(self.process, self._reap_lock, 1))

    def _monitor(self) -> None:
        """Wait for a "dead" report or the process's exit; then run the dead callbacks."""
        reason = None
        while reason is None:
            ready = wait([self._status, self.process.sentinel])
            if self._status in ready:
                try:
                    kind, value = self._status.recv()
                except (EOFError, OSError):
                    kind, value = None, None
                if kind == "dead":
                    reason = str(value)
                    continue
            if self.process.sentinel in ready:
                reason = f"the engine core process died ({self._exit_detail()})"
        reason = f"the engine is dead: {reason}"
        with self._lock:
            if self._closing:
                return
            self._dead_reason = reason
            callbacks = list(self._dead_callbacks)
        logger.error("Engine core is dead: %s", reason)
        for callback in callbacks:
            try:
                callback(EngineDeadError(reason))
            except Exception:
                logger.exception("engine-dead callback raised")

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """`callback(error)` runs (on the monitor thread) when the engine process dies."""
        with self._lock:
            reason = self._dead_reason
            if reason is None:
                self._dead_callbacks.append(callback)
        if reason is not None:
            callback(EngineDeadError(reason))

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if reap(self.process, self._reap_lock, 0) is not None:
            self._monitor_thread.join(1)  # it may hold the reason the process sent first
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            raise EngineDeadError(
                f"the engine is dead: the engine core process died ({self._exit_detail()})"
            )

    # ---------------------------------------------------------------- requests
    def _send(self, kind: str, payload: Any) -> None:
        self._check_alive()
        self._input.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def add_request(self, request: Any) -> None:
        self._send("add", request)
        self._unfinished.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._unfinished]
        if ids:
            self._send("abort", ids)
            self._unfinished.difference_update(ids)
            self._unacked += 1

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if rid in self._unfinished]
        if ids:
            self._send("finish_stopped", ids)
            self._unfinished.difference_update(ids)
            self._unacked += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished) or self._unacked > 0 or self._kv_sends_pending

    def step(self) -> list[Any]:
        """The outputs of the next step the engine finished (waits up to `step_timeout`)."""
        if not self._pending:
            message = self._receive(self.step_timeout)
            if message is not None:
                self._keep(message)
        if not self._pending:
            return []
        return self._consume(self._pending.popleft())

    def _consume(self, batch: EngineCoreOutputs) -> list[Any]:
        if batch.scheduler_stats is not None:
            self._scheduler_stats = batch.scheduler_stats
            self._kv_memory = batch.kv_memory
        self._unacked = max(self._unacked - batch.acked, 0)
        self._kv_sends_pending = batch.kv_sends_pending
        for output in batch.outputs:
            if output.finished:
                self._unfinished.discard(output.request_id)
        if batch.failed:
            self._unfinished.difference_update(batch.failed)
            self._failed_ids = list(batch.failed)
            raise StepFailedError(batch.error or "the engine step failed", list(batch.failed))
        return batch.outputs

    def scheduled_request_ids(self) -> list[str]:
        """The requests of the last failed step (what `EngineCore.scheduled_request_ids` says)."""
        return list(self._failed_ids)

    def _receive(self, timeout: float | None) -> tuple[str, Any] | None:
        """The next message from the engine, or None after `timeout` seconds."""
        import zmq

        self._check_alive()
        if not self._output.poll(None if timeout is None else int(timeout * 1000), zmq.POLLIN):
            return None
        return pickle.loads(self._output.recv())

    def _keep(self, message: tuple[str, Any]) -> None:
        kind, value = message
        if kind == "outputs":
            self._pending.append(value)
            if value.scheduler_stats is not None:  # the newest figures, e.g. after a call
                self._scheduler_stats = value.scheduler_stats
                self._kv_memory = value.kv_memory
        else:
            logger.warning("engine core: unexpected message %r", kind)

    def poll_idle(self) -> bool:
        """While no request runs: take the figures the engine process sent meanwhile
        (its elastic cache shrinks while idle); True when new ones came."""
        if self._dead_reason is not None or reap(self.process, self._reap_lock, 0) is not None:
            return False  # the monitor reports the death
        received = False
        while (message := self._receive(0)) is not None:
            self._keep(message)
            received = True
        return received

    # ---------------------------------------------------------------- utility
    def call(self, method: str, *args: Any) -> Any:
        """Run an engine method in the engine process and return its result.

        Raises:
            the method's own exception when it pickles (else RuntimeError with
            its message); EngineDeadError when the process dies meanwhile.
        """
        call_id = next(self._ids)
        self._send("call", (call_id, method, args))
        while True:
            message = self._receive(1.0)
            if message is None:
                continue
            kind, value = message
            if kind == "result" and value[0] == call_id:
                _, ok, result = value
                if ok:
                    return result
                if result.exception is not None:
                    raise result.exception
                raise RuntimeError(result.reason)
            self._keep(message)

    def sleep(self, level: int = 1) -> None:
        self._sleeping = None
        self.call("sleep", level)
        self._unfinished.clear()  # the engine aborted everything it held
        self._unacked = 0

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self._sleeping = None
        return self.call("wake_up", tags)

    def is_sleeping(self) -> bool:
        """Asked of the engine only after a sleep or wake (every admission asks)."""
        if self._sleeping is None:
            self._sleeping = self.call("is_sleeping")
        return self._sleeping

    def reload_weights(self) -> None:
        self.call("reload_weights")

    def reset_prefix_cache(self) -> bool:
        return self.call("reset_prefix_cache")

    def set_kv_cache_limit(self, limit_bytes: int | None) -> int:
        return self.call("set_kv_cache_limit", limit_bytes)

    def get_stats(self) -> Any:
        return self._scheduler_stats

    def kv_cache_memory(self) -> Any:
        return self._kv_memory

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the engine process (and so its workers), reap it, close the sockets."""
        import zmq

        with self._lock:
            self._closing = True
        if reap(self.process, self._reap_lock, 0) is None:
            # Never blocking: a PUSH socket waits for a peer, and a process that is
            # ending (a failed start-up) has disconnected; the finalizer then
            # SIGTERMs it instead.
            with contextlib.suppress(Exception):
                self._input.send(pickle.dumps(("shutdown", None)), flags=zmq.NOBLOCK)
                self._stop_state["asked"] = True
        self._finalizer()
        monitor = getattr(self, "_monitor_thread", None)  # absent after a failed start-up
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5)  # it waits on the status pipe: close that only after it ends
        for socket in (self._input, self._output):
            socket.close(linger=0)
        self._zmq.term()
        self._status.close()


def _stop_process(
    process: multiprocessing.process.BaseProcess,
    lock: threading.Lock,
    paths: list[str],
    state: dict[str, bool],
) -> None:
    """Let the engine process stop (it was asked, or SIGTERM asks it), then SIGKILL; reap it.

    SIGTERM is a graceful stop for the engine process (it shuts its executor
    down), so it is the first step when nobody sent "shutdown" (interpreter exit).
    """
    if reap(process, lock, 0) is None and not state["asked"]:
        process.terminate()
    if reap(process, lock, _SHUTDOWN_GRACE_S) is None:
        logger.warning("the engine core process did not stop in %.0f s; killing it",
                       _SHUTDOWN_GRACE_S)
        process.kill()
        reap(process, lock, None)
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)

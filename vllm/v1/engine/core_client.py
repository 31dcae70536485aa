"""`AsyncMPClient`: the server frontend's handle on an `EngineCoreProc` (core_proc.py).

```
 AsyncLLM (event loop)                              engine core process
   send(ADD | ABORT | FINISH_STOPPED, ...)  --PUSH-->  input thread -> the step loop
   await call(EngineCoreUtilities.x, *args) --PUSH-->  EngineCore.x(*args)
   await recv() (the output handler task)   <--PULL--  OUTPUTS batches, RESULTs
   monitor thread: the process and its status pipe -> dead callbacks
```

The messages are `protocol.py`'s. `send` may be called from any thread (a
lock serialises the socket; a shutdown comes from a worker thread); `recv`
and `call` belong to the event loop that runs the frontend's output handler,
which hands every RESULT back through `resolve`. Start-up blocks: the
constructor returns once the engine core reports ready (model loaded, KV
cache sized) or raises what it failed with.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.logger import init_logger
from vllm.v1.engine.core_launcher import take_launcher
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.protocol import (
    EngineCoreReplyType,
    EngineCoreRequestType,
    utility_name,
)
from vllm.v1.executor import process_start
from vllm.v1.executor.multiproc_executor import describe_exit, reap

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)
T = TypeVar("T")

# Seconds the engine process gets to stop (it shuts its workers down) before SIGKILL.
_SHUTDOWN_GRACE_S = 30.0


class AsyncMPClient:
    """Starts the engine core process and talks to it (see the module docstring).

    Args:
        vllm_config: the validated configuration (sent to the process).

    Attributes:
        ready: what the engine core reported at start-up (`EngineCoreProc.ready_info`:
            num_blocks, max_model_len fitted to the KV cache, first figures).

    Raises:
        whatever the engine raised while starting (its own type when it
        pickles: ValueError for a bad configuration), or EngineDeadError when
        the process died before it was ready.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        import zmq
        import zmq.asyncio

        self._zmq = zmq.Context()
        self._azmq = zmq.asyncio.Context()
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the dead state and the callbacks
        self._reap_lock = threading.Lock()  # see multiproc_executor.reap
        self._dead_reason: str | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._closing = False
        launcher = take_launcher()
        self.process, self._status, self._paths = launcher.process, launcher.status, launcher.paths
        self._stop_state = {"asked": False}
        self._finalizer = weakref.finalize(
            self, _stop_process, self.process, self._reap_lock, self._paths, self._stop_state
        )
        self._input = self._zmq.socket(zmq.PUSH)
        self._output = self._azmq.socket(zmq.PULL)
        try:
            self._input.bind(launcher.addresses[0])
            self._output.bind(launcher.addresses[1])
            # A process that died meanwhile makes this fail: _wait_ready says how it ended.
            with contextlib.suppress(OSError):
                launcher.send_config(vllm_config)
            logger.info("Started the engine core process (pid %d); it loads the model, "
                        "profiles and warms up before serving ...", self.process.pid)
            self.ready: dict[str, Any] = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
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
                    self._stop_state["asked"] = True  # it exits by itself: no stop signal
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

    def check_alive(self) -> None:
        """Raises EngineDeadError when the engine core process is dead."""
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if reap(self.process, self._reap_lock, 0) is not None:
            self._monitor_thread.join(1)  # it may hold the reason the process sent first
            if self._dead_reason is not None:
                raise EngineDeadError(self._dead_reason)
            raise EngineDeadError(
                f"the engine is dead: the engine core process died ({self._exit_detail()})"
            )

    # -------------------------------------------------------------- messages
    def send(self, kind: EngineCoreRequestType, payload: Any = None) -> None:
        """Send one request message (any thread). Raises EngineDeadError once dead."""
        self.check_alive()
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._input.send(data)

    async def recv(self) -> tuple[EngineCoreReplyType, Any]:
        """The next message from the engine core (the output handler's only wait)."""
        return pickle.loads(await self._output.recv())

    async def call(self, method: Callable[..., T], *args: Any) -> T:
        """Run an `EngineCoreUtilities` method in the engine core and return its result.

        The output handler must be running on this loop (it delivers the result).

        Raises:
            the method's own exception when it pickles (else RuntimeError with
            its message); EngineDeadError when the process dies meanwhile;
            ValueError: `method` is not an `EngineCoreUtilities` method.
        """
        name = utility_name(method)
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self.send(EngineCoreRequestType.UTILITY, (call_id, name, args))
            return await future
        finally:
            self._calls.pop(call_id, None)

    def resolve(self, reply: tuple[int, bool, Any]) -> None:
        """Hand a RESULT to the `call` waiting for it (on the event loop)."""
        call_id, ok, result = reply
        future = self._calls.get(call_id)
        if future is None or future.done():
            return
        if ok:
            future.set_result(result)
        elif result.exception is not None:
            future.set_exception(result.exception)
        else:
            future.set_exception(RuntimeError(result.reason))

    def fail_calls(self, error: BaseException) -> None:
        """Every `call` still waiting raises `error` (on the event loop: dead or shut down)."""
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the engine process (and so its workers), reap it, close the sockets."""
        import zmq

        with self._lock:
            self._closing = True
        if reap(self.process, self._reap_lock, 0) is None:
            # Never blocking: a PUSH socket waits for a peer, and a process that is
            # ending (a failed start-up) has disconnected; the finalizer then
            # signals it instead.
            with contextlib.suppress(Exception), self._send_lock:
                self._input.send(pickle.dumps((EngineCoreRequestType.SHUTDOWN, None)),
                                 flags=zmq.NOBLOCK)
                self._stop_state["asked"] = True
        self._finalizer()
        monitor = getattr(self, "_monitor_thread", None)  # absent after a failed start-up
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5)  # it waits on the status pipe: close that only after it ends
        with self._send_lock:
            self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        self._azmq.term()
        self._status.close()


def _stop_process(
    process: multiprocessing.process.BaseProcess,
    lock: threading.Lock,
    paths: list[str],
    state: dict[str, bool],
) -> None:
    """Let the engine process stop (it was asked, or `STOP_SIGNAL` asks it), then SIGKILL;
    reap it.

    `STOP_SIGNAL` is a graceful stop for the engine process (it shuts its
    executor down), so it is the first step when nobody sent "shutdown"
    (interpreter exit). Not SIGTERM: the engine process ignores that one, which
    belongs to the process group (`process_start`).
    """
    if reap(process, lock, 0) is None and not state["asked"]:
        process_start.request_stop(process)
    if reap(process, lock, _SHUTDOWN_GRACE_S) is None:
        logger.warning("the engine core process did not stop in %.0f s; killing it",
                       _SHUTDOWN_GRACE_S)
        process.kill()
        reap(process, lock, None)
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)

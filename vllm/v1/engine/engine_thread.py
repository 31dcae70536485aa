"""EngineThread: the background thread that owns an `LLMEngine` and steps it.

```
 any thread                                   engine thread (owns LLMEngine + tokenizer)
 ----------                                   ------------------------------------------
 submit(fn) -> Future --_Command(fn, Future)-> commands: admit / abort / tokenize / sleep ...
 post(fn)  (fire and forget)                    run between steps, in arrival order
                                                engine.step() -> stream.put_nowait(out)
                                                stat loggers: record() after every step
```

`AsyncLLM` (async_llm.py) is the asyncio facade over this: it awaits the
futures `submit` returns and iterates the `RequestOutputStream`s the engine
fills. Everything that touches the engine or the tokenizer runs here, so the
event loop never blocks on a model step and HF fast tokenizers are never used
from two threads at once.

Faults: an exception inside a step fails the requests of that step
(`EngineGenerateError`, their blocks are freed) and the loop goes on. A device
error (CUDA / HIP) or `_MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row
mark the engine dead (`EngineDeadError` for everyone, dead callbacks run so
the server can exit non-zero).

Sleep (`--enable-sleep-mode`): `sleep_now` aborts the requests in flight
(each gets `EngineSleepingError`), then calls the engine's `sleep(level)`;
requests arriving while asleep are rejected. `wake_now` after a level-2 sleep
(weights discarded) reloads the weights from the checkpoint before the engine
serves again; until a reload succeeds the engine counts as asleep.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.exceptions import DeviceMemoryError
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.v1.engine.core_client import StepFailedError
from vllm.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShutdownError,
    EngineSleepingError,
    SleepModeUnavailableError,
)
from vllm.v1.engine.output_processor import ParentRequest

if TYPE_CHECKING:
    from vllm.inputs import PromptType
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerBase
    from vllm.v1.metrics.stats import IterationStats

logger = init_logger(__name__)

# A step that fails this many times in a row means the engine is broken, not
# one request: a transient fault (one bad request, one OOM) clears on the next
# step, a persistent one would otherwise fail every request forever.
_MAX_CONSECUTIVE_STEP_FAILURES = 3
# Idle engine thread: how long it blocks on the command queue before checking
# the periodic stats log (seconds). Commands wake it at once.
_IDLE_POLL_S = 1.0
# Period of the stat loggers' log() (the "Avg prompt throughput ..." line), seconds.
_LOG_STATS_INTERVAL_S = 10.0
# Messages that mark a device fault (the CUDA / HIP context is unusable after
# them); torch >= 2.8 also raises them as torch.AcceleratorError.
_DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "HIP error",
    "CUBLAS_STATUS_",
    "device-side assert",
    "NCCL error",
    "cudaError",
)
_STOP = object()  # command: leave the loop


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = None


def is_device_error(error: BaseException) -> bool:
    """True for errors after which the device context cannot be trusted (CUDA / HIP faults)."""
    if type(error).__name__ == "AcceleratorError":
        return True
    text = str(error)
    return any(marker in text for marker in _DEVICE_ERROR_MARKERS)


class RequestOutputStream:
    """The outputs of one request, handed from the engine thread to the event loop.

    The engine thread calls `put_nowait` (the `queue` of `LLMEngine.add_request`);
    the event loop iterates. Leaving the iteration early (client disconnect,
    cancellation, `aclose`) aborts the request in the engine.

    Args:
        request_id: the engine request id.
        loop: the event loop that consumes the outputs.
        abort: called (on the event loop) to abort an unfinished request.
        on_done: called (on the engine thread) once the last item is queued.
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        on_done: Callable[[str], None],
    ) -> None:
        self.request_id = request_id
        self.finished = False  # the final output or an error was taken by the consumer
        self._loop = loop
        self._abort = abort
        self._on_done = on_done
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: queue an output, or an exception that ends the request."""
        if isinstance(item, BaseException) or item.finished:
            self._on_done(self.request_id)
        # A closed loop (RuntimeError) means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get(self) -> RequestOutput:
        """The next output; raises the exception that ended the request, if any."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    async def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            if not self.finished:
                self._abort(self.request_id)


class EngineThread:
    """Steps an `LLMEngine` in a daemon thread; runs commands between steps.

    Args:
        engine: a built `LLMEngine`; from now on only this thread uses it.
        stat_loggers: receive statistics after every step.
        enable_sleep_mode: whether `sleep_now` / `wake_now` are allowed.
        log_requests: log every admitted request.
    """

    def __init__(
        self,
        engine: LLMEngine,
        stat_loggers: Iterable[StatLoggerBase],
        *,
        enable_sleep_mode: bool,
        log_requests: bool,
    ) -> None:
        self.engine: LLMEngine | None = engine
        self.stat_loggers: list[StatLoggerBase] = list(stat_loggers)
        self.enable_sleep_mode = enable_sleep_mode
        self.log_requests = log_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _accepting against the closing thread
        self._accepting = True
        self.dead_error: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._dead_callbacks_fired = False  # under _lock
        # Engine thread only:
        self._streams: dict[str, RequestOutputStream] = {}
        self._children: dict[str, list[str]] = {}  # request id -> child ids (n > 1)
        self._stop = False
        self._sleeping = False
        self._weights_stale = False  # woken after a level-2 sleep, reload not done yet
        self._consecutive_failures = 0
        self._last_log = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()
        add_dead_callback = getattr(engine.engine_core, "add_dead_callback", None)
        if add_dead_callback is not None:  # the engine core runs in a process of its own
            add_dead_callback(self.on_engine_core_dead)

    # ============================================================ any thread
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._accepting:
                self._commands.put(_Command(fn, future))
                return future
        future.set_exception(self.unavailable_error())
        return future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (ignored once the loop has stopped)."""
        with self._lock:
            if self._accepting:
                self._commands.put(_Command(partial(fn, *args)))

    def stop(self, timeout: float) -> None:
        """Stop the loop, free the engine and join (unless called from the thread itself)."""
        with self._lock:
            if self._accepting:
                self._commands.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout)

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """`callback(error)` runs (on the engine thread) when the engine dies."""
        with self._lock:
            fired = self._dead_callbacks_fired
            if not fired:
                self._dead_callbacks.append(callback)
        if fired and self.dead_error is not None:
            callback(self.dead_error)

    def unavailable_error(self) -> Exception:
        if self.dead_error is not None:
            return EngineDeadError(str(self.dead_error))
        return EngineShutdownError("the engine is shut down")

    # ============================================================ the loop
    def _run(self) -> None:
        try:
            while not self._stop:
                self._process_commands(block=not self._has_work())
                if self._stop:
                    break
                if self._has_work():
                    self._step()
                elif not self._sleeping and self.engine.adjust_kv_cache():
                    self._record_stats(None)  # the elastic cache shrank while idle
                self._maybe_log_stats()
        except BaseException as e:  # a bug in the loop itself: nothing can be trusted
            logger.exception("the engine loop crashed")
            self._mark_dead(e)
        finally:
            self._close()

    def _has_work(self) -> bool:
        return not self._sleeping and self.engine.has_unfinished_requests()

    def _process_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=_IDLE_POLL_S) if block else (self._commands.get_nowait())
            )
        except queue.Empty:
            return
        while True:
            if command is _STOP:
                self._stop = True
                return
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._record_stats(None)  # admissions and aborts change the scheduler's figures

    @staticmethod
    def _execute(command: _Command) -> None:
        future = command.future
        if future is not None and not future.set_running_or_notify_cancel():
            return  # the caller stopped waiting (cancelled): do not admit behind its back
        try:
            result = command.fn()
        except Exception as e:
            if future is None:
                logger.exception("engine command failed")
            else:
                future.set_exception(e)
        else:
            if future is not None:
                future.set_result(result)

    def _step(self) -> None:
        try:
            self.engine.step()  # every request has a stream: outputs go there
        except EngineDeadError as e:  # the engine core process is gone (its reason)
            logger.error("%s", e)
            self._mark_dead(e)
            return
        except Exception as e:
            # An engine core process counts its own failures (StepFailedError).
            self._consecutive_failures += not isinstance(e, StepFailedError)
            if is_device_error(e) or self._consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
                logger.exception("engine step failed unrecoverably; the engine is dead")
                self._mark_dead(e)
                return
            ids = self._requests_in_step()
            logger.exception("engine step failed; failing its %d request(s)", len(ids))
            message = f"the engine step failed: {e!r}"
            self._fail(ids, lambda: EngineGenerateError(message))
            self._record_stats(None)
            return
        self._consecutive_failures = 0
        self._record_stats(self.engine.last_iteration_stats)

    def _requests_in_step(self) -> list[str]:
        """Ids of the requests scheduled in the failed step (all live ones when unknown)."""
        scheduled = self.engine.get_scheduled_request_ids()
        if not scheduled:
            return list(self._streams)
        owner = {cid: rid for rid, cids in self._children.items() for cid in cids}
        ids = {owner.get(cid, cid) for cid in scheduled}
        return [rid for rid in self._streams if rid in ids]

    def _mark_dead(self, error: BaseException) -> None:
        if self.dead_error is None:
            self.dead_error = (
                error
                if isinstance(error, EngineDeadError)
                else EngineDeadError(f"the engine is dead: {error!r}")
            )
        self._stop = True

    def on_engine_core_dead(self, error: EngineDeadError) -> None:
        """The engine core process died (any thread): fail everything, stop the loop."""
        if self.dead_error is None:
            self.dead_error = error  # /health says so at once, before the loop wakes
        self.post(self._mark_dead, error)

    def _close(self) -> None:
        with self._lock:
            self._accepting = False
        while True:  # commands that will never run
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if (
                command is not _STOP
                and command.future is not None
                and command.future.set_running_or_notify_cancel()
            ):
                command.future.set_exception(self.unavailable_error())
        self._fail(list(self._streams), self.unavailable_error)
        engine, self.engine = self.engine, None
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown raised")
        del engine  # last reference: weights and KV cache are freed
        with self._lock:
            self._dead_callbacks_fired = True
            callbacks = list(self._dead_callbacks)
        if self.dead_error is not None:
            for callback in callbacks:
                try:
                    callback(self.dead_error)
                except Exception:
                    logger.exception("dead-engine callback raised")

    # ================================================ commands (engine thread)
    def admit(
        self,
        stream: RequestOutputStream,
        prompt: PromptType,
        params: SamplingParams,
        arrival: float,
    ) -> None:
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep; wake it up (POST /wake_up) first")
        rid = stream.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already running")
        self.engine.add_request(rid, prompt, params, arrival_time=arrival, queue=stream)
        self._streams[rid] = stream
        if params.n > 1:
            self._children[rid] = [ParentRequest.child_id(i, rid) for i in range(params.n)]
        if self.log_requests:
            logger.info("Received request %s: prompt: %r, params: %s", rid, prompt, params)

    def forget(self, request_id: str) -> None:
        """The stream delivered its last item (called from `RequestOutputStream.put_nowait`)."""
        self._streams.pop(request_id, None)
        self._children.pop(request_id, None)

    def abort_now(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        for rid in live:
            self._streams[rid].put_nowait(EngineGenerateError(f"request {rid} was aborted"))
        if live:
            logger.info("Aborted request(s) %s", ", ".join(live))  # a client left, or a cancel
            self.engine.abort_request(live)

    def _fail(self, request_ids: list[str], make_error: Callable[[], BaseException]) -> None:
        """Deliver an error to these requests and drop them from the engine (blocks freed)."""
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(make_error())
        if request_ids and self.engine is not None:
            try:
                self.engine.abort_request(request_ids)
            except EngineDeadError:
                pass  # a dead engine holds nothing any more: nothing to abort
            except Exception:
                logger.exception("aborting failed requests %s raised", request_ids)

    def sleep_now(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._check_sleep_mode()
        if self.is_sleeping():
            logger.info("sleep level %d: the engine is already asleep; nothing to release "
                        "(wake_up first to sleep at another level)", level)
            return
        if self._streams:
            logger.info("sleep: aborting %d in-flight request(s)", len(self._streams))
            self._fail(
                list(self._streams),
                lambda: EngineSleepingError("request aborted: the engine was put to sleep"),
            )
        self.engine.sleep(level)
        self._sleeping = True

    def wake_now(self, tags: list[str] | None) -> None:
        self._check_sleep_mode()
        # True: the weights hold nothing since a level-2 sleep (see LLMEngine.wake_up).
        try:
            if self.engine.wake_up(tags):
                self._weights_stale = True
        except DeviceMemoryError as e:
            logger.warning("%s", e)  # the caller gets a 503 with the same words
            raise
        if self._weights_stale:  # also retries a reload that failed on an earlier wake_up
            model = self.engine.vllm_config.model_config.model
            logger.info("wake_up after a level-2 sleep: reloading the weights from %s", model)
            start = time.monotonic()
            try:
                self.engine.reload_weights()
            except Exception as e:  # not the caller's input: never a 400
                raise RuntimeError(
                    f"reloading the weights after a level-2 sleep failed ({e!r}); the engine "
                    "stays asleep and the next wake_up retries"
                ) from e
            self._weights_stale = False
            logger.info("weights reloaded in %.1f s", time.monotonic() - start)
        self._sleeping = self.is_sleeping()

    def is_sleeping(self) -> bool:
        return self._weights_stale or self.engine.is_sleeping()

    def set_kv_cache_limit(self, limit_bytes: int | None) -> dict[str, int]:
        """The elastic cache's runtime limit; returns the limit in blocks and what is committed."""
        limit = self.engine.set_kv_cache_limit(limit_bytes)
        self._record_stats(None)
        memory = self.engine.get_kv_cache_memory()
        return {"limit_blocks": limit, "committed_bytes": memory.committed_bytes,
                "num_blocks": memory.num_blocks}

    def _check_sleep_mode(self) -> None:
        if not self.enable_sleep_mode:
            raise SleepModeUnavailableError(
                "sleep mode is off: start the engine with --enable-sleep-mode"
            )

    # ============================================= stats (engine thread)
    def _record_stats(self, iteration_stats: IterationStats | None) -> None:
        if not self.stat_loggers:
            return
        try:
            scheduler_stats = self.engine.get_scheduler_stats()
            kv_memory = self.engine.get_kv_cache_memory()
        except Exception:
            logger.exception("reading engine statistics failed")
            return
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats, kv_memory)
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log < _LOG_STATS_INTERVAL_S:
            return
        self._last_log = now
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.log()
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

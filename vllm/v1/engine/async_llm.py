"""AsyncLLM: the asyncio client of an `LLMEngine` whose step loop runs in a background thread.

```
 event loop (HTTP handlers)                     engine thread (owns LLMEngine + tokenizer)
 --------------------------                     ------------------------------------------
 add_request() --_Command(fn, Future)-------->  commands: admit / abort / tokenize / sleep ...
   await Future <----set_result / exception---    engine.add_request(..., queue=stream)
 async for out in stream  <--call_soon_threadsafe-- engine.step() -> stream.put_nowait(out)
                                                  stat loggers: record() after every step
```

Why a thread and a command queue: a model step takes milliseconds to seconds
and must never block the event loop, and HF fast tokenizers must not be used
from two threads at once. So *every* engine and tokenizer call (admission,
abort, tokenize, chat templates, sleep) runs on the engine thread, between
steps; the event loop only waits on futures and per-request queues.

Faults: an exception inside a step fails the requests of that step
(`EngineGenerateError`, their blocks are freed) and the loop goes on. A device
error (CUDA / HIP) or `_MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row
mark the engine dead (`EngineDeadError` for everyone, `errored` is True, dead
callbacks run so the server can exit non-zero).

Sleep (`--enable-sleep-mode`): `sleep()` runs between steps, aborts the
requests in flight (each gets `EngineSleepingError`), then calls the engine's
`sleep(level)`; requests arriving while asleep are rejected with
`EngineSleepingError`. Engines without `sleep` raise `SleepModeUnavailableError`.
`wake_up()` after a level-2 sleep (weights discarded) reloads the weights from
the checkpoint before the engine serves again, so outputs match those before
the sleep; until a reload succeeds the engine counts as asleep.
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

from vllm.inputs import check_unicode_text
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShutdownError,
    EngineSleepingError,
    SleepModeUnavailableError,
)
from vllm.v1.metrics.loggers import LoggingStatLogger, StatLoggerBase

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import PromptType
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
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


class AsyncLLM:
    """Async engine client: the step loop of an `LLMEngine` runs in a background thread.

    Args:
        engine: a built `LLMEngine`; from now on only the engine thread uses it.
        stat_loggers: receive statistics after every step (see `StatLoggerBase`).
        log_stats: add the periodic throughput log line.
        log_requests: log every admitted request.
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        stat_loggers: Iterable[StatLoggerBase] = (),
        log_stats: bool = True,
        log_requests: bool = False,
    ) -> None:
        self.engine: LLMEngine | None = engine
        self.vllm_config: VllmConfig = engine.vllm_config
        self.model_config = self.vllm_config.model_config
        self.tokenizer = engine.get_tokenizer()
        self.log_requests = log_requests
        self._stat_loggers: list[StatLoggerBase] = list(stat_loggers)
        if log_stats:
            self._stat_loggers.append(LoggingStatLogger())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _accepting against the closing thread
        self._accepting = True
        self._dead_error: EngineDeadError | None = None
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

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: Iterable[StatLoggerBase] = ()
    ) -> AsyncLLM:
        """Build the engine (loads the model, sizes the KV cache) and start the loop."""
        return cls.from_vllm_config(
            engine_args.create_engine_config(),
            stat_loggers=stat_loggers,
            log_stats=not engine_args.disable_log_stats,
            log_requests=getattr(engine_args, "enable_log_requests", False),
        )

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        *,
        stat_loggers: Iterable[StatLoggerBase] = (),
        log_stats: bool = True,
        log_requests: bool = False,
    ) -> AsyncLLM:
        """Build the engine from a validated config and start the loop."""
        from vllm.v1.engine.llm_engine import LLMEngine

        return cls(LLMEngine(vllm_config), stat_loggers=stat_loggers, log_stats=log_stats,
                   log_requests=log_requests)

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead_error is None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, for read-only attributes (eos, chat_template); encode through
        `tokenize` / `detokenize`, which run on the engine thread."""
        return self.tokenizer

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is dead or its thread has stopped."""
        if self._dead_error is not None:
            raise EngineDeadError(str(self._dead_error))
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """`callback(error)` runs (on the engine thread) when the engine dies."""
        with self._lock:
            fired = self._dead_callbacks_fired
            if not fired:
                self._dead_callbacks.append(callback)
        if fired and self._dead_error is not None:
            callback(self._dead_error)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self._post(self._stat_loggers.append, stat_logger)

    # --------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestOutputStream:
        """Admit a request; returns its output stream once the engine accepted it.

        Raises:
            ValueError: invalid prompt or parameters (the engine's own validation,
                shared with `LLM`); nothing is queued then.
            EngineSleepingError / EngineDeadError / EngineShutdownError.
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        stream = RequestOutputStream(
            request_id, asyncio.get_running_loop(), self.abort, self._forget
        )
        try:
            await self._call(self._admit, stream, prompt, params, arrival)
        except asyncio.CancelledError:
            self.abort(request_id)  # admission may have happened meanwhile
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (per `sampling_params.output_kind`) until it finishes.

        Validation errors (ValueError) are raised before the first output;
        closing or cancelling the generator aborts the request and frees its blocks.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time)
        async for output in stream:
            yield output

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (non-blocking, any thread); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._post(self._abort_now, ids)

    # -------------------------------------------------- tokenizer, on the engine thread
    async def run_in_engine_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on the engine thread between steps; returns its result."""
        return await self._call(partial(fn, *args, **kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError if it has a lone UTF-16 surrogate."""
        check_unicode_text(text, "prompt")
        return await self._call(
            lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._call(
            lambda: self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        )

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return await self._call(lambda: list(self.tokenizer.convert_ids_to_tokens(token_ids)))

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict:
        """`chat_templates.apply_chat_template` on the engine thread.

        Returns {"prompt", "prompt_token_ids"}.
        """
        from vllm.transformers_utils.chat_templates import apply_chat_template

        return await self._call(lambda: apply_chat_template(self.tokenizer, messages, **kwargs))

    # ------------------------------------------------------------------ sleep
    async def sleep(self, level: int = 1) -> None:
        """Abort in-flight requests, then put the engine to sleep (see module doc).

        Raises:
            SleepModeUnavailableError: sleep mode off or not implemented by the engine.
            ValueError: level not 1 or 2.
        """
        await self._call(self._sleep_now, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or the `tags`, e.g. ["weights"], ["kv_cache"]).

        Weights woken after a level-2 sleep are reloaded from the checkpoint
        (`LLMEngine.reload_weights`) before this returns.

        Raises:
            ValueError: an unknown tag.
            VmmError: no device memory now (the engine stays asleep; retry later).
            RuntimeError: loading the checkpoint failed (the cause is chained);
                the engine stays asleep and the next `wake_up` retries the reload.
        """
        await self._call(self._wake_now, tags)

    async def is_sleeping(self) -> bool:
        return await self._call(self._engine_is_sleeping)

    # --------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the loop (in-flight requests get EngineShutdownError), free the engine
        (its device memory returns), join the thread. Idempotent."""
        with self._lock:
            if self._accepting:
                self._commands.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", timeout)

    # ====================================================== event-loop helpers
    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._accepting:
                self._commands.put(_Command(fn, future))
                return future
        future.set_exception(self._unavailable_error())
        return future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(partial(fn, *args)))

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (ignored once the loop has stopped)."""
        with self._lock:
            if self._accepting:
                self._commands.put(_Command(partial(fn, *args)))

    def _unavailable_error(self) -> Exception:
        if self._dead_error is not None:
            return EngineDeadError(str(self._dead_error))
        return EngineShutdownError("the engine is shut down")

    # ========================================================= engine thread
    def _run(self) -> None:
        try:
            while not self._stop:
                self._process_commands(block=not self._has_work())
                if self._stop:
                    break
                if self._has_work():
                    self._step()
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

    def _admit(
        self,
        stream: RequestOutputStream,
        prompt: PromptType,
        params: SamplingParams,
        arrival: float,
    ) -> None:
        from vllm.v1.engine.output_processor import ParentRequest

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

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._children.pop(request_id, None)

    def _abort_now(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        for rid in live:
            self._streams[rid].put_nowait(EngineGenerateError(f"request {rid} was aborted"))
        if live:
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
            except Exception:
                logger.exception("aborting failed requests %s raised", request_ids)

    def _step(self) -> None:
        try:
            self.engine.step()  # every request has a stream: outputs go there
        except Exception as e:
            self._consecutive_failures += 1
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
        scheduler = getattr(getattr(self.engine, "engine_core", None), "scheduler", None)
        running = [r.request_id for r in getattr(scheduler, "running", [])]
        if not running:
            return list(self._streams)
        owner = {cid: rid for rid, cids in self._children.items() for cid in cids}
        ids = {owner.get(cid, cid) for cid in running}
        return [rid for rid in self._streams if rid in ids]

    def _mark_dead(self, error: BaseException) -> None:
        if self._dead_error is None:
            self._dead_error = EngineDeadError(f"the engine is dead: {error!r}")
        self._stop = True

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
                command.future.set_exception(self._unavailable_error())
        self._fail(list(self._streams), self._unavailable_error)
        engine, self.engine = self.engine, None
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown raised")
        del engine  # last reference: weights and KV cache are freed
        with self._lock:
            self._dead_callbacks_fired = True
            callbacks = list(self._dead_callbacks)
        if self._dead_error is not None:
            for callback in callbacks:
                try:
                    callback(self._dead_error)
                except Exception:
                    logger.exception("dead-engine callback raised")

    # ------------------------------------------------------------ sleep (engine thread)
    def _sleep_method(self, name: str) -> Callable[..., Any]:
        if not self.vllm_config.cache_config.enable_sleep_mode:
            raise SleepModeUnavailableError(
                "sleep mode is off: start the engine with --enable-sleep-mode"
            )
        method = getattr(self.engine, name, None)
        if method is None:
            raise SleepModeUnavailableError(
                f"sleep mode is not available: this engine does not implement {name}() yet"
            )
        return method

    def _sleep_now(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        sleep = self._sleep_method("sleep")
        if self._streams:
            logger.info("sleep: aborting %d in-flight request(s)", len(self._streams))
            self._fail(
                list(self._streams),
                lambda: EngineSleepingError("request aborted: the engine was put to sleep"),
            )
        sleep(level)
        self._sleeping = True

    def _wake_now(self, tags: list[str] | None) -> None:
        # True: the weights' pages are fresh after a level-2 sleep (see LLMEngine.wake_up).
        if self._sleep_method("wake_up")(tags):
            self._weights_stale = True
        if self._weights_stale:  # also retries a reload that failed on an earlier wake_up
            logger.info("wake_up after a level-2 sleep: reloading the weights from %s",
                        self.model_config.model)
            start = time.monotonic()
            try:
                self._sleep_method("reload_weights")()
            except Exception as e:  # not the caller's input: never a 400
                raise RuntimeError(
                    f"reloading the weights after a level-2 sleep failed ({e!r}); the engine "
                    "stays asleep and the next wake_up retries"
                ) from e
            self._weights_stale = False
            logger.info("weights reloaded in %.1f s", time.monotonic() - start)
        self._sleeping = self._engine_is_sleeping()

    def _engine_is_sleeping(self) -> bool:
        if self._weights_stale:
            return True
        method = getattr(self.engine, "is_sleeping", None)
        return bool(method()) if method is not None else self._sleeping

    # ------------------------------------------------------------ stats (engine thread)
    def _record_stats(self, iteration_stats: IterationStats | None) -> None:
        if not self._stat_loggers:
            return
        core = self.engine.engine_core
        try:
            scheduler_stats = core.get_stats()
            worker = getattr(core, "worker", None)
            kv_memory = worker.kv_cache_memory() if worker is not None else None
        except Exception:
            logger.exception("reading engine statistics failed")
            return
        for stat_logger in self._stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats, kv_memory)
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log < _LOG_STATS_INTERVAL_S:
            return
        self._last_log = now
        for stat_logger in self._stat_loggers:
            try:
                stat_logger.log()
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

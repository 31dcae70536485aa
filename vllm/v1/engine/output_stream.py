"""The server frontend's output path: engine core batches -> each request's stream.

```
 AsyncMPClient.recv()  --OUTPUTS-->  OutputHandler._process (one asyncio task per loop)
                                       failed ids      -> EngineGenerateError on their streams
                                       OutputProcessor -> RequestOutputStream.put_nowait
                                       stop strings    -> FINISH_STOPPED to the core
                                       figures         -> every stat logger's record()
                       --RESULT--->   AsyncMPClient.resolve (a utility call's future)
 every 10 s: every stat logger's log() ("Avg prompt throughput ...")
```

An abort (`fail(..., aborted=True)`: a client left, `AsyncLLM.abort`) reaches the
stat loggers at once, counted as finished with reason "abort", as vLLM counts it.

A batch already in the socket is read without an event-loop turn (pyzmq
hands it back at once), so a handler behind the engine drains every waiting
batch into the streams, which merge them (`RequestOutputStream`), before the
streams write: one SSE chunk per request per turn however many steps it
covers. It yields the loop at least every `HANDLER_TURN_S` of such draining,
so the streams' writes and new requests are never starved by an engine that
steps faster than the handler reads.

The handler task lives on the event loop that admits requests; when a loop
ends (tests run several `asyncio.run`s over one engine), the next admission
starts a task on the new loop, and batches wait in the socket meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
from vllm.v1.engine.protocol import EngineCoreOutputs, EngineCoreReplyType, EngineCoreRequestType
from vllm.v1.metrics.stats import IterationStats

if TYPE_CHECKING:
    from vllm.v1.engine.core_client import AsyncMPClient
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.metrics.loggers import StatLoggerBase

logger = init_logger(__name__)

# Period of the stat loggers' log() (the "Avg prompt throughput ..." line), seconds.
LOG_STATS_INTERVAL_S = 10.0
# Longest the output handler processes batches without yielding the event loop, seconds.
HANDLER_TURN_S = 0.01


class RequestOutputStream:
    """The outputs of one request, as the event loop consumes them.

    The output handler calls `put_nowait` (also any thread: a shutdown or a
    dead engine fails streams from elsewhere); the event loop iterates.
    Leaving the iteration early (client disconnect, cancellation, `aclose`)
    aborts the request in the engine.

    Outputs the consumer has not taken yet are coalesced, so a consumer that
    falls behind the engine (a busy event loop, a slow client) reads one output
    per turn whatever the number of steps since its last read: DELTA outputs
    are merged (`RequestOutput.merge`: texts and token ids appended, one delta
    that covers every step); CUMULATIVE and FINAL_ONLY ones hold everything so
    far, and the latest replaces the one waiting. An exception is delivered
    after the output waiting before it.

    Args:
        request_id: the request id (the parent's, for n > 1).
        loop: the event loop that consumes the outputs.
        abort: called (on the event loop) to abort an unfinished request.
        on_done: called once the last item is queued.
        delta: the request's outputs are DELTA ones (merged, not replaced).
    """

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[str], None],
        on_done: Callable[[str], None],
        delta: bool = False,
    ) -> None:
        self.request_id = request_id
        self.finished = False  # the final output or an error was taken by the consumer
        self.delta = delta
        self._loop = loop
        self._loop_thread = threading.get_ident()  # built on the loop's thread
        self._abort = abort
        self._on_done = on_done
        self._output: RequestOutput | None = None  # not taken yet (merged, for DELTA)
        self._error: BaseException | None = None  # ends the stream after _output
        self._waiter: asyncio.Future | None = None  # the consumer's, while nothing is ready

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """Queue an output, or an exception that ends the request."""
        if isinstance(item, BaseException) or item.finished:
            self._on_done(self.request_id)
        if threading.get_ident() == self._loop_thread:
            self._put(item)
            return
        # A closed loop (RuntimeError) means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._put, item)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._error is not None:
            return  # the request already ended with an error
        elif self._output is None or not self.delta:
            self._output = item
        else:
            self._output.merge(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        """The next output (every step since the last `get`, coalesced); raises the
        exception that ended the request, if any."""
        while self._output is None and self._error is None:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        output = self._output
        if output is None:
            self.finished = True
            raise self._error
        self._output = None
        if output.finished:
            self.finished = True
        return output

    async def __aiter__(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            if not self.finished:
                self._abort(self.request_id)


class OutputHandler:
    """Delivers engine core batches to streams and stat loggers (see the module doc).

    Args:
        client: the engine core client (its `recv`, `send`, `resolve`).
        output_processor: detokenizes and builds `RequestOutput`s.
        stat_loggers: receive `record(...)` per batch and `log()` periodically.

    Attributes:
        streams: request id -> stream of every live request.
    """

    def __init__(
        self, client: AsyncMPClient, output_processor: OutputProcessor,
        stat_loggers: Iterable[StatLoggerBase],
    ) -> None:
        self.client = client
        self.output_processor = output_processor
        self.stat_loggers = list(stat_loggers)
        self.streams: dict[str, RequestOutputStream] = {}
        self._figures: tuple[Any, Any] | None = None  # (scheduler stats, KV memory), latest
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None  # the thread that runs _loop
        self._tasks: list[asyncio.Task] = []

    # ------------------------------------------------------------- the task
    def start(self) -> None:
        """Run the handler on the current event loop (a no-op while it runs there)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._tasks and not self._tasks[0].done():
            return
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._tasks = [loop.create_task(self._run(), name="vllm-output-handler"),
                       loop.create_task(self._log_periodically(), name="vllm-stats-log")]

    async def _run(self) -> None:
        client = self.client
        turn_start = time.monotonic()  # (reset by every yield; a wait in recv counts too)
        try:
            while True:
                kind, payload = await client.recv()
                if kind is EngineCoreReplyType.RESULT:
                    client.resolve(payload)
                else:
                    self._process(payload)
                if time.monotonic() - turn_start >= HANDLER_TURN_S:
                    await asyncio.sleep(0)  # the streams write, requests come in
                    turn_start = time.monotonic()
        except asyncio.CancelledError:
            raise
        except Exception:  # a closed socket at shutdown ends it; anything else is a bug
            if self.client.dead_reason is None:
                logger.exception("the output handler stopped")

    async def _log_periodically(self) -> None:
        while True:
            await asyncio.sleep(LOG_STATS_INTERVAL_S)
            for stat_logger in self.stat_loggers:
                try:
                    stat_logger.log()
                except Exception:
                    logger.exception("stat logger %s failed", type(stat_logger).__name__)

    def stop(self, timeout: float) -> None:
        """Cancel the tasks on their loop (any thread; waits up to `timeout` s for it)."""
        loop, tasks = self._loop, self._tasks
        self._tasks = []
        if loop is None or loop.is_closed() or not tasks:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            for task in tasks:
                task.cancel()
            return
        if loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(_cancel(tasks), loop).result(timeout)

    # ---------------------------------------------------------- the batches
    def _process(self, batch: EngineCoreOutputs) -> None:
        if batch.failed:
            error = batch.error or "the engine step failed"
            self.fail(self._owners(batch.failed), lambda _rid: EngineGenerateError(error),
                      abort_in_core=False)  # the core aborted them already
        processed = self.output_processor.process_outputs(batch.outputs)
        if processed.reqs_to_abort:
            self._send(EngineCoreRequestType.FINISH_STOPPED, processed.reqs_to_abort)
        self._record(batch.scheduler_stats, processed.stats, batch.kv_memory)

    def _owners(self, child_ids: list[str]) -> list[str]:
        """The stream ids (parents for n > 1) of these core request ids."""
        owners = []
        for cid in child_ids:
            state = self.output_processor.states.get(cid)
            rid = state.parent.request_id if state is not None and state.parent else cid
            if rid in self.streams and rid not in owners:
                owners.append(rid)
        return owners

    def _record(self, scheduler_stats: Any, iteration_stats: Any, kv_memory: Any) -> None:
        if scheduler_stats is None:
            return
        self._figures = (scheduler_stats, kv_memory)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(scheduler_stats, iteration_stats, kv_memory)
            except Exception:
                logger.exception("stat logger %s failed", type(stat_logger).__name__)

    def record_ready(self, ready: dict[str, Any]) -> None:
        """The figures the engine core reported at start-up."""
        self._record(ready["scheduler_stats"], None, ready["kv_memory"])

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        """Add a logger; it gets the latest figures at once."""
        self.stat_loggers.append(stat_logger)
        if self._figures is not None:
            stat_logger.record(self._figures[0], None, self._figures[1])

    # ------------------------------------------------------------- failures
    def fail(self, request_ids: list[str], make_error: Callable[[str], BaseException],
             abort_in_core: bool = True, aborted: bool = False) -> None:
        """End these requests' streams with an error and drop them (blocks freed).

        `aborted`: a client left or cancelled them: the stat loggers count them at once
        as finished with reason "abort" (as vLLM does); failures are not counted.
        """
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is not None:
                stream.put_nowait(make_error(rid))
        stats = IterationStats() if aborted else None
        dropped = self.output_processor.abort_requests(list(request_ids), stats)
        if abort_in_core and request_ids:
            self._send(EngineCoreRequestType.ABORT, dropped + list(request_ids))
        if stats is not None and stats.finished_reasons and self._figures is not None:
            # No engine step brings these: record them with the latest figures (gauges
            # set to what they were, cumulative counters advanced by nothing).
            self._record(self._figures[0], stats, self._figures[1])

    def forget(self, request_id: str) -> None:
        """A stream delivered its last item."""
        self.streams.pop(request_id, None)

    def fail_everything(self, error: BaseException) -> None:
        """Every stream and every utility call ends with `error` (any thread)."""
        loop = self._loop
        if loop is not None and loop.is_running() and threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_everything, error)
                return
        self._fail_everything(error)

    def _fail_everything(self, error: BaseException) -> None:
        for stream in list(self.streams.values()):
            stream.put_nowait(error)
        self.output_processor.abort_requests(list(self.output_processor.states))
        self.client.fail_calls(error)

    def _send(self, kind: EngineCoreRequestType, payload: Any) -> None:
        # A dead engine holds nothing any more: the death fails every stream.
        with contextlib.suppress(EngineDeadError):
            self.client.send(kind, payload)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

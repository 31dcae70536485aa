"""AsyncLLM: the server's frontend; the engine core steps in a process of its own.

```
 event loop (HTTP handlers)                              engine core process
 --------------------------                              -------------------
 add_request: tokenizer thread -> Processor ->           the step loop (core_proc.py)
   OutputProcessor.add_request -> client.send(ADD) ---->   schedule, execute, update
 output handler (one asyncio task):                <---- OUTPUTS batches
   OutputProcessor.process_outputs -> the request's RequestOutputStream
   stop strings -> client.send(FINISH_STOPPED); figures -> stat loggers
 async for out in stream   (the steps since the last read, as one merged output)
```

Prompts are tokenized on a tokenizer thread of their own with a tokenizer of
their own (HF fast tokenizers must not be shared between threads: a copy of
the process's one, `copy_tokenizer`), so a huge prompt never delays other
requests' outputs; a prompt whose text alone proves
it longer than `max_model_len` tokens is rejected without being tokenized at
all (`transformers_utils.tokenizer.min_num_tokens`). Chat templates render on
render threads (a slow template holds no one's encode) and the rendered text
is encoded on the tokenizer thread. Detokenization runs in the output handler
on the event loop (as in vLLM V1), in one pass per engine step (a few
microseconds a token, measured: docs/benchmarks.md "Frontend"); outputs a
stream's consumer has not read yet are merged into one (`RequestOutputStream`),
so a busy loop writes one SSE chunk per request per turn, not one per step.

Faults are decided in the engine core (`faults.py`): the requests of a failed
step get `EngineGenerateError`; a dead engine ends every stream with
`EngineDeadError` and runs the dead callbacks (the server exits non-zero).
Sleep (`--enable-sleep-mode`): `sleep()` fails the requests in flight with
`EngineSleepingError`, then the core releases the memory; requests arriving
while asleep are rejected; `wake_up()` after a level-2 sleep reloads the
weights before it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from vllm.exceptions import DeviceMemoryError, VLLMValidationError
from vllm.inputs import check_unicode_text
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.engine.exceptions import (
    EngineDeadError,
    EngineGenerateError,
    EngineShutdownError,
    EngineSleepingError,
    SleepModeUnavailableError,
)
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.output_stream import OutputHandler, RequestOutputStream
from vllm.v1.engine.processor import Processor
from vllm.v1.engine.protocol import EngineCoreRequestType, EngineCoreUtilities
from vllm.v1.metrics.loggers import LoggingStatLogger, StatLoggerBase

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.config import VllmConfig
    from vllm.config.startup import StartupPlan
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import PromptType
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.stats import SchedulerStats

logger = init_logger(__name__)

__all__ = ["AsyncLLM", "RequestOutputStream"]

# Chat templates render on threads of their own (see apply_chat_template). Renders are
# pure Python under the GIL, so more threads add no throughput, only fairness: up to
# this many slow renders at once still leave a thread for a small request's render.
_RENDER_THREADS = 8
_ADD = EngineCoreRequestType.ADD


class AsyncLLM:
    """Async engine client: the engine core runs in its own process (`AsyncMPClient`).

    Args:
        vllm_config: the validated configuration; building the client starts the
            engine core process and returns once it is ready (model loaded, KV
            cache sized).
        stat_loggers: receive statistics after every step (see `StatLoggerBase`).
        log_stats: add the periodic throughput log line.
        log_requests: log every admitted request.

    Raises:
        what the engine core failed to start with (see `AsyncMPClient`).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        *,
        stat_loggers: Iterable[StatLoggerBase] = (),
        log_stats: bool = True,
        log_requests: bool = False,
    ) -> None:
        from vllm.transformers_utils.tokenizer import (
            copy_tokenizer,
            get_tokenizer,
            max_token_chars,
        )

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.log_requests = log_requests
        remote = {"trust_remote_code": self.model_config.trust_remote_code}
        self.tokenizer = get_tokenizer(self.model_config.tokenizer, **remote)
        # Input tokenization: its own tokenizer on its own thread (see the module doc), a
        # copy of the process's one (not loaded again).
        self._input_tokenizer = copy_tokenizer(self.tokenizer)
        self._token_chars = max_token_chars(self._input_tokenizer)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="vllm-tokenizer")
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            _RENDER_THREADS, thread_name_prefix="vllm-chat-render")
        loggers = list(stat_loggers) + ([LoggingStatLogger()] if log_stats else [])
        self.client = AsyncMPClient(vllm_config)
        self.plan: StartupPlan = self.client.ready["plan"]  # what start-up decided
        self.max_model_len: int = self.plan.max_model_len  # fitted to the KV cache
        self.processor = Processor.from_config(vllm_config, self.tokenizer, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._handler = OutputHandler(self.client, self.output_processor, loggers)
        self._handler.record_ready(self.client.ready)
        self._lock = threading.Lock()  # guards _closed and the dead state
        self._closed = False
        self.dead_error: EngineDeadError | None = None
        self._sleeping = False
        self._weights_stale = False  # woken after a level-2 sleep, reload not done yet
        self.client.add_dead_callback(self._on_dead)

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, stat_loggers: Iterable[StatLoggerBase] = ()
    ) -> AsyncLLM:
        """Build the engine (loads the model, sizes the KV cache) in its own process."""
        return cls(
            engine_args.create_engine_config(),
            stat_loggers=stat_loggers,
            log_stats=not engine_args.disable_log_stats,
            log_requests=getattr(engine_args, "enable_log_requests", False),
        )

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, *, stat_loggers: Iterable[StatLoggerBase] = (),
        log_stats: bool = True, log_requests: bool = False,
    ) -> AsyncLLM:
        """Build the engine from a validated config (see the class)."""
        return cls(vllm_config, stat_loggers=stat_loggers, log_stats=log_stats,
                   log_requests=log_requests)

    # ------------------------------------------------------------------ state
    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return not self._closed and self.dead_error is None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, for read-only attributes (eos, chat_template); encode through
        `tokenize` / `detokenize`, which run on the tokenizer thread."""
        return self.tokenizer

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is dead (or shut down)."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        self.client.check_alive()

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """`callback(error)` runs (on the client's monitor thread) when the engine dies,
        after every stream has been failed (at once if it is dead already); not once
        `shutdown` has begun."""
        self.client.add_dead_callback(lambda error: None if self._closed else callback(error))

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self._handler.add_stat_logger(stat_logger)

    def _unavailable_error(self) -> Exception:
        if self.dead_error is not None:
            return EngineDeadError(str(self.dead_error))
        return EngineShutdownError("the engine is shut down")

    # --------------------------------------------------------------- requests
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        require_room_for_max_tokens: bool = False,
    ) -> RequestOutputStream:
        """Admit a request; returns its output stream once the engine accepted it.

        `priority`: vLLM's; lower is scheduled first under `--scheduling-policy
        priority`, and must be 0 under fcfs. `require_room_for_max_tokens`: the
        OpenAI server's rule, prompt + max_tokens within max_model_len (the
        engine's own only needs the prompt to fit; `Processor.make_request`).

        Raises:
            ValueError: invalid prompt or parameters (the engine's own validation,
                shared with `LLM`); nothing is queued then.
            EngineSleepingError / EngineDeadError / EngineShutdownError.
        """
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._check_accepting()
        prompt = await self._tokenize_prompt(prompt)
        self._check_accepting()
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep; wake it up (POST /wake_up) first")
        if request_id in self._handler.streams:
            raise ValueError(f"request id {request_id!r} is already running")
        process = functools.partial(self.processor.process_inputs, request_id, prompt, params,
                                    priority,
                                    require_room_for_max_tokens=require_room_for_max_tokens)
        if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            # transformers' image processor takes seconds on a large image: on the
            # tokenizer thread, so the event loop keeps streaming everyone else.
            processed = await self._tokenizer_call(process)
            self._check_accepting()
            if request_id in self._handler.streams:
                raise ValueError(f"request id {request_id!r} is already running")
        else:
            processed = process()
        stream = RequestOutputStream(request_id, asyncio.get_running_loop(), self.abort,
                                     self._handler.forget,
                                     delta=params.output_kind == RequestOutputKind.DELTA)
        self._handler.start()
        self._handler.streams[request_id] = stream
        for request, parent, index in processed.children:
            self.output_processor.add_request(
                request.request_id, processed.text, processed.prompt_token_ids,
                request.sampling_params, arrival, parent, index, stream)
        try:
            for request, _, _ in processed.children:
                self.client.send(_ADD, request)
        except Exception as e:  # the engine died meanwhile: nobody will read the stream
            self._handler.fail([request_id], lambda _rid, error=e: error, abort_in_core=False)
            raise
        if self.log_requests:
            logger.info("Received request %s: prompt: %r, params: %s", request_id, prompt, params)
        return stream

    def _check_accepting(self) -> None:
        if self._closed or self.dead_error is not None:
            raise self._unavailable_error()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs (per `sampling_params.output_kind`) until it finishes.

        Validation errors (ValueError) are raised before the first output;
        closing or cancelling the generator aborts the request and frees its blocks.
        """
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time,
                                        priority)
        async for output in stream:
            yield output

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (non-blocking, on the event loop); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        live = [rid for rid in ids if rid in self._handler.streams]
        if not live:
            return
        logger.info("Aborted request(s) %s", ", ".join(live))  # a client left, or a cancel
        self._handler.fail(live, lambda rid: EngineGenerateError(f"request {rid} was aborted"),
                           aborted=True)

    # ------------------------------------------------------- tokenizer threads
    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError if it has a lone UTF-16 surrogate."""
        check_unicode_text(text, "prompt")
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def expand_images(self, prompt: dict[str, Any]) -> list[int]:
        """A tokenized prompt's ids with each image placeholder expanded to its image's
        tokens, as the engine will see them (from "prompt_token_ids" and
        "multi_modal_data"), on the tokenizer thread; errors as
        `Processor.process_multimodal` (VLLMValidationError naming the image)."""
        return (await self._tokenizer_call(lambda: self.processor.process_multimodal(
            prompt, list(prompt["prompt_token_ids"]))))[0]

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: list(tokenizer.convert_ids_to_tokens(token_ids)))

    async def _tokenize_prompt(self, prompt: PromptType) -> PromptType:
        """A text prompt as {"prompt", "prompt_token_ids"}, tokenized on the tokenizer thread
        (a prompt dict keeps its other keys, "multi_modal_data" among them).

        Raises:
            VLLMValidationError: the text alone proves the prompt longer than
                max_model_len tokens (nothing is tokenized then).
        """
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and prompt.get("prompt_token_ids") is None:
            text = prompt.get("prompt")
        else:
            return prompt
        if not isinstance(text, str) or not text:
            return prompt  # the engine's own validation says what is wrong
        self._check_prompt_chars(len(text), "prompt")
        check_unicode_text(text, "prompt")
        tokenizer = self._input_tokenizer
        token_ids = await self._tokenizer_call(lambda: list(tokenizer.encode(text)))
        if isinstance(prompt, dict):  # keeps its other keys ("multi_modal_data")
            return {**prompt, "prompt_token_ids": token_ids}
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _check_prompt_chars(self, num_chars: int, parameter: str) -> None:
        """Reject, untokenized, a text that cannot fit max_model_len tokens."""
        from vllm.transformers_utils.tokenizer import min_num_tokens

        at_least = min_num_tokens(num_chars, self._token_chars)
        if at_least >= self.max_model_len:
            raise VLLMValidationError(
                f"prompt has at least {at_least} tokens ({num_chars} characters, at most "
                f"{self._token_chars} per token), which leaves no room to generate within "
                f"max_model_len {self.max_model_len}; shorten the prompt",
                parameter=parameter,
            )

    async def _tokenizer_call(self, fn: Callable[[], Any]) -> Any:
        return await self._run_on(self._tokenizer_pool, fn)

    async def _run_on(self, pool: concurrent.futures.Executor, fn: Callable[[], Any]) -> Any:
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, fn)
        except RuntimeError:  # the pool is shut down with the engine
            raise self._unavailable_error() from None
        return await future

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict:
        """Render on a render thread, then encode on the tokenizer thread.

        A template can take seconds to render (loops are the template's own);
        rendering on one of `_RENDER_THREADS` threads, not on the tokenizer
        thread, lets other requests' renders and encodes run meanwhile (the
        GIL is shared between them, so a small render is slowed, not queued).
        Returns {"prompt", "prompt_token_ids"} (and "multi_modal_data" for image
        parts of a multimodal model, with "multi_modal_params", the part each image
        came from: `MultiModalProcessor.chat_images`); errors as
        `chat_templates.render_chat_template`, plus VLLMValidationError
        (parameter "messages") for a rendered text that cannot fit
        max_model_len tokens, found before it is encoded.
        """
        from vllm.transformers_utils.chat_templates import (
            encode_rendered_chat,
            render_chat_template,
        )

        text_chars = sum(len(m["content"]) for m in messages
                         if isinstance(m, dict) and isinstance(m.get("content"), str))
        self._check_prompt_chars(text_chars, "messages")
        images: list[Any] = []
        mm = self.processor.mm_processor
        if mm is not None:  # image parts fetched and decoded off the event loop
            messages, images, params = await self._run_on(self._render_pool,
                                                          lambda: mm.chat_images(messages))
        tokenizer = self._input_tokenizer
        text = await self._run_on(
            self._render_pool, lambda: render_chat_template(tokenizer, messages, **kwargs))
        self._check_prompt_chars(len(text), "messages")
        token_ids = await self._tokenizer_call(lambda: encode_rendered_chat(tokenizer, text))
        if images:
            return {"prompt": text, "prompt_token_ids": token_ids,
                    "multi_modal_data": {"image": images}, "multi_modal_params": params}
        return {"prompt": text, "prompt_token_ids": token_ids}

    # ---------------------------------------------------- engine core utilities
    async def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        """An `EngineCoreUtilities` call in the engine core process."""
        self._check_accepting()
        self._handler.start()  # it delivers the result
        return await self.client.call(method, *args)

    async def sleep(self, level: int = 1) -> None:
        """Fail in-flight requests, then put the engine to sleep (see the module doc).

        Raises:
            SleepModeUnavailableError: the engine was started without sleep mode.
            ValueError: level not 1 or 2.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._check_sleep_mode()
        if await self.is_sleeping():
            logger.info("sleep level %d: the engine is already asleep; nothing to release "
                        "(wake_up first to sleep at another level)", level)
            return
        live = list(self._handler.streams)
        if live:
            logger.info("sleep: aborting %d in-flight request(s)", len(live))
            self._handler.fail(live, lambda _rid: EngineSleepingError(
                "request aborted: the engine was put to sleep"))
        self._sleeping = True  # no admission from here on
        try:
            await self._call(EngineCoreUtilities.sleep, level)
        except BaseException:
            self._sleeping = await self.is_sleeping()
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or the `tags`, e.g. ["weights"], ["kv_cache"]).

        Weights woken after a level-2 sleep are reloaded from the checkpoint
        before this returns.

        Raises:
            ValueError: an unknown tag.
            DeviceMemoryError: no device memory now (names the bytes needed and
                free; the engine stays asleep; retry later).
            RuntimeError: loading the checkpoint failed (the cause is chained);
                the engine stays asleep and the next `wake_up` retries the reload.
        """
        self._check_sleep_mode()
        try:
            if await self._call(EngineCoreUtilities.wake_up, tags):
                self._weights_stale = True
        except DeviceMemoryError as e:
            logger.warning("%s", e)  # the caller gets a 503 with the same words
            raise
        if self._weights_stale:  # also retries a reload that failed on an earlier wake_up
            logger.info("wake_up after a level-2 sleep: reloading the weights from %s",
                        self.model_config.model)
            start = time.monotonic()
            try:
                await self._call(EngineCoreUtilities.reload_weights)
            except Exception as e:  # not the caller's input: never a 400
                raise RuntimeError(
                    f"reloading the weights after a level-2 sleep failed ({e!r}); the engine "
                    "stays asleep and the next wake_up retries"
                ) from e
            self._weights_stale = False
            logger.info("weights reloaded in %.1f s", time.monotonic() - start)
        self._sleeping = await self.is_sleeping()

    async def is_sleeping(self) -> bool:
        return self._weights_stale or await self._call(EngineCoreUtilities.is_sleeping)

    def _check_sleep_mode(self) -> None:
        if not self.vllm_config.cache_config.enable_sleep_mode:
            raise SleepModeUnavailableError(
                "sleep mode is off: start the engine with --enable-sleep-mode")

    async def set_kv_cache_limit(self, limit_bytes: int | None) -> dict[str, int]:
        """Cap the elastic KV cache at `limit_bytes` (None: the start-up limit).

        Blocks above the limit are released once free (between steps).

        Returns:
            {"limit_blocks", "limit_bytes", "committed_bytes", "num_blocks"} after the
            change (bytes: blocks' bytes, the unit of /metrics and `vllm kv-top`).

        Raises:
            ValueError: a negative limit.
            RuntimeError: the elastic cache is off.
        """
        limit = await self._call(EngineCoreUtilities.set_kv_cache_limit, limit_bytes)
        memory = await self._call(EngineCoreUtilities.kv_cache_memory)
        return {"limit_blocks": limit, "limit_bytes": memory.limit_bytes,
                "committed_bytes": memory.committed_bytes, "num_blocks": memory.num_blocks}

    async def get_scheduler_stats(self) -> SchedulerStats:
        """The scheduler's figures now (running, waiting, KV usage, ...)."""
        return await self._call(EngineCoreUtilities.get_stats)

    # ---------------------------------------------------------- death, shutdown
    def _on_dead(self, error: EngineDeadError) -> None:
        """The engine core died (the client's first dead callback): fail everything."""
        with self._lock:
            if self.dead_error is not None or self._closed:
                return
            self.dead_error = error  # /health says so at once
        self._handler.fail_everything(error)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the engine (in-flight requests get EngineShutdownError); its process and
        device memory go. Idempotent; any thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.dead_error is None:
            self._handler.fail_everything(EngineShutdownError("the engine is shut down"))
        self._handler.stop(timeout)
        self.client.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._render_pool.shutdown(wait=False, cancel_futures=True)

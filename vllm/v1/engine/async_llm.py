"""AsyncLLM: the asyncio client of an `LLMEngine` stepped by an `EngineThread`.

```
 event loop (HTTP handlers)                     EngineThread (engine_thread.py)
 --------------------------                     ------------------------------
 add_request() --submit(admit)--------------->  admit / abort / tokenize / sleep ...
   await Future <----set_result / exception---    between steps, in arrival order
 async for out in stream  <--call_soon_threadsafe-- engine.step() -> stream.put_nowait(out)
```

This file is the facade: every method either awaits a command run on the
engine thread or posts one. Why a thread and a command queue, how faults kill
the engine, and how sleep works: see engine_thread.py.

Prompts are tokenized before they reach the engine thread, on a tokenizer
thread of their own with a tokenizer of their own (HF fast tokenizers must
not be shared between threads), so a huge prompt never delays the outputs of
running requests; a prompt whose text alone proves it longer than
`max_model_len` tokens is rejected without being tokenized at all
(`transformers_utils.tokenizer.min_num_tokens`). Chat templates render on
render threads (a slow template holds no one's encode) and the rendered text is
encoded on the tokenizer thread. With `multiprocess_mode`
(the server) the engine core steps in a process of its own and the engine
thread only moves requests in and outputs out (core_client.py). Requests arriving
while asleep are rejected with `EngineSleepingError`; `wake_up()` after a
level-2 sleep reloads the weights before it returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs import check_unicode_text
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.v1.engine.engine_thread import EngineThread, RequestOutputStream, is_device_error
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import LoggingStatLogger, StatLoggerBase

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import PromptType
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

__all__ = ["AsyncLLM", "RequestOutputStream", "is_device_error"]

# Chat templates render on threads of their own (see apply_chat_template). Renders are
# pure Python under the GIL, so more threads add no throughput, only fairness: up to
# this many slow renders at once still leave a thread for a small request's render.
_RENDER_THREADS = 8


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
        from vllm.transformers_utils.tokenizer import get_tokenizer, max_token_chars

        self.vllm_config: VllmConfig = engine.vllm_config
        self.model_config = self.vllm_config.model_config
        self.tokenizer = engine.get_tokenizer()
        # Input tokenization: its own tokenizer on its own thread (see the module doc).
        self._input_tokenizer = get_tokenizer(self.model_config.tokenizer)
        self._token_chars = max_token_chars(self._input_tokenizer)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="vllm-tokenizer"
        )
        self._render_pool = concurrent.futures.ThreadPoolExecutor(
            _RENDER_THREADS, thread_name_prefix="vllm-chat-render"
        )
        loggers = list(stat_loggers)
        if log_stats:
            loggers.append(LoggingStatLogger())
        self._thread = EngineThread(
            engine,
            loggers,
            enable_sleep_mode=self.vllm_config.cache_config.enable_sleep_mode,
            log_requests=log_requests,
        )

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
        multiprocess_mode: bool = False,
    ) -> AsyncLLM:
        """Build the engine from a validated config and start the loop.

        `multiprocess_mode`: the engine core in a process of its own (the server's choice).
        """
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine(vllm_config, multiprocess_mode=multiprocess_mode)
        return cls(engine, stat_loggers=stat_loggers, log_stats=log_stats,
                   log_requests=log_requests)

    # ------------------------------------------------------------------ state
    @property
    def engine(self) -> LLMEngine | None:
        """The engine; only the engine thread may use it. None once shut down."""
        return self._thread.engine

    @property
    def errored(self) -> bool:
        return self._thread.dead_error is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._thread.dead_error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._thread.dead_error is None

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer, for read-only attributes (eos, chat_template); encode through
        `tokenize` / `detokenize`, which run on the tokenizer thread."""
        return self.tokenizer

    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is dead or its thread has stopped."""
        if self._thread.dead_error is not None:
            raise EngineDeadError(str(self._thread.dead_error))
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """`callback(error)` runs (on the engine thread) when the engine dies."""
        self._thread.add_dead_callback(callback)

    def add_stat_logger(self, stat_logger: StatLoggerBase) -> None:
        self._thread.post(self._thread.stat_loggers.append, stat_logger)

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
        prompt = await self._tokenize_prompt(prompt)
        stream = RequestOutputStream(
            request_id, asyncio.get_running_loop(), self.abort, self._thread.forget
        )
        try:
            await self._call(self._thread.admit, stream, prompt, params, arrival)
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
        self._thread.post(self._thread.abort_now, ids)

    # -------------------------------------------------- tokenizer, on the engine thread
    async def run_in_engine_thread(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run `fn(*args, **kwargs)` on the engine thread between steps; returns its result."""
        return await self._call(partial(fn, *args, **kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError if it has a lone UTF-16 surrogate."""
        check_unicode_text(text, "prompt")
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        )

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        )

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        tokenizer = self._input_tokenizer
        return await self._tokenizer_call(
            lambda: list(tokenizer.convert_ids_to_tokens(token_ids))
        )

    async def _tokenize_prompt(self, prompt: PromptType) -> PromptType:
        """A text prompt as {"prompt", "prompt_token_ids"}, tokenized on the tokenizer thread.

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
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _check_prompt_chars(self, num_chars: int, parameter: str) -> None:
        """Reject, untokenized, a text that cannot fit max_model_len tokens."""
        from vllm.transformers_utils.tokenizer import min_num_tokens

        max_model_len = self.model_config.max_model_len
        at_least = min_num_tokens(num_chars, self._token_chars)
        if at_least >= max_model_len:
            raise VLLMValidationError(
                f"prompt has at least {at_least} tokens ({num_chars} characters, at most "
                f"{self._token_chars} per token), which leaves no room to generate within "
                f"max_model_len {max_model_len}; shorten the prompt",
                parameter=parameter,
            )

    async def _tokenizer_call(self, fn: Callable[[], Any]) -> Any:
        return await self._run_on(self._tokenizer_pool, fn)

    async def _run_on(self, pool: concurrent.futures.Executor, fn: Callable[[], Any]) -> Any:
        try:
            future = asyncio.get_running_loop().run_in_executor(pool, fn)
        except RuntimeError:  # the pool is shut down with the engine
            raise self._thread.unavailable_error() from None
        return await future

    async def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict:
        """Render on a render thread, then encode on the tokenizer thread.

        A template can take seconds to render (loops are the template's own);
        rendering on one of `_RENDER_THREADS` threads, not on the tokenizer
        thread, lets other requests' renders and encodes run meanwhile (the
        GIL is shared between them, so a small render is slowed, not queued).
        Returns {"prompt", "prompt_token_ids"}; errors as
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
        tokenizer = self._input_tokenizer
        text = await self._run_on(
            self._render_pool, lambda: render_chat_template(tokenizer, messages, **kwargs))
        self._check_prompt_chars(len(text), "messages")
        token_ids = await self._tokenizer_call(lambda: encode_rendered_chat(tokenizer, text))
        return {"prompt": text, "prompt_token_ids": token_ids}

    # ------------------------------------------------------------------ sleep
    async def sleep(self, level: int = 1) -> None:
        """Abort in-flight requests, then put the engine to sleep (see module doc).

        Raises:
            SleepModeUnavailableError: the engine was started without sleep mode.
            ValueError: level not 1 or 2.
        """
        await self._call(self._thread.sleep_now, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine (all of it, or the `tags`, e.g. ["weights"], ["kv_cache"]).

        Weights woken after a level-2 sleep are reloaded from the checkpoint
        (`LLMEngine.reload_weights`) before this returns.

        Raises:
            ValueError: an unknown tag.
            DeviceMemoryError: no device memory now (names the bytes needed and
                free; the engine stays asleep; retry later).
            RuntimeError: loading the checkpoint failed (the cause is chained);
                the engine stays asleep and the next `wake_up` retries the reload.
        """
        await self._call(self._thread.wake_now, tags)

    async def is_sleeping(self) -> bool:
        return await self._call(self._thread.is_sleeping)

    async def set_kv_cache_limit(self, limit_bytes: int | None) -> dict[str, int]:
        """Cap the elastic KV cache at `limit_bytes` (None: the start-up limit).

        Blocks above the limit are released once free (between steps).

        Returns:
            {"limit_blocks", "committed_bytes", "num_blocks"} after the change.

        Raises:
            ValueError: a negative limit.
            RuntimeError: the elastic cache is off.
        """
        return await self._call(self._thread.set_kv_cache_limit, limit_bytes)

    # --------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop the loop (in-flight requests get EngineShutdownError), free the engine
        (its device memory returns), join the thread. Idempotent."""
        self._thread.stop(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._render_pool.shutdown(wait=False, cancel_futures=True)

    # ====================================================== event-loop helpers
    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._thread.submit(partial(fn, *args)))

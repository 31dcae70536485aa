"""What every OpenAI endpoint shares: errors, model lookup, SamplingParams, admission, streams.

```
request (pydantic, types checked) -> resolve model (404) -> SamplingParams(...) (400, param)
    -> AsyncLLM.add_request (Processor: empty prompt / lengths -> 400) -> RequestOutputStream
```

Errors travel as `APIError(status, message, param)` (errors.py); the app turns
them into the OpenAI body `{"error": {"message", "type", "param", "code"}}`.
A validation error names its own field (`VLLMValidationError.parameter`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import APIError, error_from_exception, validation_error
from vllm.entrypoints.openai.protocol import SamplingFields, UsageInfo
from vllm.entrypoints.openai.structured_outputs import structured_outputs_from_request
from vllm.logger import init_logger
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from fastapi import Request

    from vllm.entrypoints.openai.serving_models import ServedModels
    from vllm.inputs import PromptType
    from vllm.logprobs import PromptLogprobs
    from vllm.v1.engine.async_llm import AsyncLLM, RequestOutputStream

logger = init_logger(__name__)

# JSON has no -inf: logprobs of impossible tokens are clamped here (as vLLM does).
MIN_LOGPROB = -9999.0


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def stream_settings(request: SamplingFields) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage) of a completions or chat request.

    As in vLLM: `stream_options.include_usage` adds a final chunk with the usage;
    with `continuous_usage_stats` too, every chunk carries the usage so far.

    Raises:
        APIError(400, param "stream_options"): stream_options without stream=true.
    """
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    options = request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and bool(options.continuous_usage_stats)
    return bool(request.stream), include_usage, continuous


# vLLM request extras this server does not implement -> the values that ask for nothing
# (what vLLM does by default): any other value is refused, never silently ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "documents": (None, []),
}


def reject_unsupported_fields(request: SamplingFields) -> None:
    """Refuse what this server cannot honour, before any work is done.

    Raises:
        APIError(400, param = the field): a vLLM extra of
            `UNSUPPORTED_FIELDS` set to a value that asks for something, or
            `prompt_logprobs` with stream=true (vLLM's rule: they come with the
            final response).
    """
    for name, neutral in UNSUPPORTED_FIELDS.items():
        value = getattr(request, name, None)
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise APIError(400, f"{name} is not supported by this server (got {value!r:.80}); "
                           "leave it out", name)
    if request.prompt_logprobs is not None and request.stream:
        raise APIError(400, "prompt_logprobs are not available when stream=true",
                       "prompt_logprobs")


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> list | None:
    """`RequestOutput.prompt_logprobs` as vLLM's JSON: per position None or
    {token id: {"logprob", "rank", "decoded_token"}}, -inf clamped."""
    if prompt_logprobs is None:
        return None
    return [None if step is None else {
        token_id: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token}
        for token_id, lp in step.items()} for step in prompt_logprobs]


def usage_info(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    """The `usage` object: token counts and their sum."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def build_sampling_params(
    request: SamplingFields,
    stream: bool,
    vocab_size: int,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    renamed: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    backend: str = "auto",
) -> SamplingParams:
    """SamplingParams from the request's fields; SamplingParams itself checks the ranges.

    Args:
        request: the parsed request.
        stream: DELTA outputs when streaming, else FINAL_ONLY.
        vocab_size: logit_bias keys must be below it.
        max_tokens / logprobs: already resolved by the endpoint (their names differ).
        prompt_logprobs: likewise (completions with echo: the request's logprobs).
        renamed: SamplingParams field -> request field for error `param`s
            (chat: logprobs -> top_logprobs).
        defaults: the model's sampling defaults (`ModelConfig.get_diff_sampling_param`),
            used for the fields the request leaves unset, as vLLM does.
        structured_outputs: a constraint the endpoint adds (chat's tool_choice
            required / named), for a request that sets none itself.
        backend: the engine's structured-output backend (`--structured-outputs-config`),
            which parses the request's constraint.

    Raises:
        APIError(400): a value SamplingParams rejects; `param` names the request field.
    """
    kwargs = _request_sampling_kwargs(request, logprobs, prompt_logprobs)
    for name, value in (defaults or {}).items():
        kwargs.setdefault(name, value)
    # response_format / structured_outputs / guided_*: parsed and validated (400 naming
    # the field) before the engine sees the request.
    structured_outputs = structured_outputs_from_request(request, backend) or structured_outputs
    if structured_outputs is not None:
        kwargs["structured_outputs"] = structured_outputs
    if request.kv_transfer_params is not None:
        kwargs["extra_args"] = {"kv_transfer_params": request.kv_transfer_params}
    kwargs["max_tokens"] = max_tokens  # None is meaningful: "as many as fit"
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**kwargs)
        params.verify_vocab(vocab_size)
    except ValueError as e:
        raise validation_error(e, renamed or {}) from e
    except TypeError as e:
        raise APIError(400, str(e)) from e
    return params


def _request_sampling_kwargs(
    request: SamplingFields, logprobs: int | None, prompt_logprobs: int | None
) -> dict[str, Any]:
    """The SamplingParams fields the request sets (None values left out, so the
    model's defaults and SamplingParams' own fill them).

    Raises:
        APIError(400, param "logit_bias"): a logit_bias key that is not a token id.
    """
    logit_bias = None
    if request.logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in request.logit_bias.items()}
        except ValueError as e:
            raise APIError(400, f"logit_bias keys must be token ids, got {e}", "logit_bias") from e
    kwargs: dict[str, Any] = {
        "n": request.n,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "min_tokens": request.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "logit_bias": logit_bias,
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words": request.bad_words,
        "truncate_prompt_tokens": request.truncate_prompt_tokens,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


def logprob_token(token_id: int, decoded: str | None, as_token_ids: bool) -> str:
    """A token as logprobs name it: its text, or vLLM's "token_id:N" (for tokens whose
    text does not round-trip, e.g. a byte of a multi-byte character)."""
    return f"token_id:{token_id}" if as_token_ids else (decoded or "")


class OpenAIServing:
    """Base of the endpoint classes: the engine client and the served model names.

    `return_tokens_as_token_ids` (`--return-tokens-as-token-ids`): logprobs name tokens
    "token_id:N" unless a request's own `return_tokens_as_token_ids` says otherwise.
    """

    def __init__(self, engine_client: AsyncLLM, models: ServedModels, *,
                 return_tokens_as_token_ids: bool = False) -> None:
        self.engine_client = engine_client
        self.models = models
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.max_model_len = engine_client.max_model_len  # fitted to the KV cache
        self.vocab_size = engine_client.model_config.get_vocab_size()
        # --structured-outputs-config's backend: constraints are parsed by it (a 400 here).
        self.structured_outputs_backend = (
            engine_client.vllm_config.structured_outputs_config.backend)
        # The generation config's temperature, top_p, ... for fields a request leaves unset.
        self.default_sampling_params = engine_client.model_config.get_diff_sampling_param()

    def tokens_as_ids(self, request: SamplingFields) -> bool:
        """Whether this request's logprobs name tokens "token_id:N" (its field, else the
        server's flag)."""
        if request.return_tokens_as_token_ids is None:
            return self.return_tokens_as_token_ids
        return request.return_tokens_as_token_ids

    def open_request(self, request: SamplingFields) -> tuple[str, bool, bool, bool]:
        """The preamble of a completions or chat request, before any work is done:
        (served model name, stream, include_usage, continuous_usage).

        Raises:
            APIError: 404 an unknown model; 400 a field this server refuses
                (`_check_unsupported`) or stream_options without stream=true.
        """
        model_name = self.models.resolve(request.model)
        self._check_unsupported(request)
        return (model_name, *stream_settings(request))

    @staticmethod
    def _check_unsupported(request: SamplingFields) -> None:
        """Refuse the fields this server cannot honour (endpoints add their own)."""
        reject_unsupported_fields(request)

    async def admit(
        self, request_id: str, prompt: PromptType, params: SamplingParams,
        prompt_param: str = "prompt", length_param: str = "max_tokens",
        renamed: dict[str, str] | None = None, priority: int = 0,
    ) -> RequestOutputStream:
        """Hand a request to the engine; validation failures become APIError(400).

        As vLLM's server: a max_tokens the request sets must fit beside the
        prompt within max_model_len (a 400 otherwise, never clamped); one left
        unset becomes what fits. (The offline `LLM` accepts such a request and
        stops it at max_model_len.)

        `prompt_param` / `length_param` name the request fields a prompt or a
        length error is about (chat: "messages", "max_completion_tokens");
        `renamed` maps other SamplingParams fields (chat: logprobs -> top_logprobs);
        `priority` is the request's (`--scheduling-policy priority`).
        """
        try:
            return await self.engine_client.add_request(request_id, prompt, params,
                                                        priority=priority,
                                                        require_room_for_max_tokens=True)
        except ValueError as e:
            raise validation_error(e, {**(renamed or {}), "prompt": prompt_param,
                                       "max_tokens": length_param}) from e
        except Exception as e:
            raise error_from_exception(e) from e

    async def admit_all(
        self, request_id: str, prompts: list[PromptType], params: SamplingParams,
        prompt_param: str = "prompt", length_param: str = "max_tokens",
        renamed: dict[str, str] | None = None, priority: int = 0,
    ) -> list[RequestOutputStream]:
        """Admit several prompts as `{request_id}-{i}`; all or none (earlier ones aborted)."""
        streams: list[RequestOutputStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.admit(rid, prompt, params, prompt_param, length_param,
                                                renamed, priority))
        except BaseException:
            self.engine_client.abort([s.request_id for s in streams])
            raise
        return streams


async def render_chat(
    engine_client: AsyncLLM,
    messages: list[dict[str, Any]],
    *,
    request_template: str | None,
    server_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    default_chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The conversation through the chat template: {"prompt", "prompt_token_ids"}.

    `request_template` (the request's `chat_template`) wins over `server_template`
    (`--chat-template`), which wins over the model's own. `tools` is the template's
    `tools` variable; `chat_template_kwargs` (the request's) are more template
    variables, each winning over the server's `default_chat_template_kwargs`
    (`--default-chat-template-kwargs`).

    Raises:
        APIError(400): continue_final_message with add_generation_prompt (param
            "continue_final_message", refused by `render_chat_template`), a malformed
            message (param: its field), a reserved
            `chat_template_kwargs` key (param "chat_template_kwargs.KEY"), or a template that
            fails to render (param "chat_template" when the request brought the
            template, else "messages": the server's template rejected them).
        APIError(503 / 500): the engine is asleep, shut down or dead.
    """
    from vllm.transformers_utils.chat_templates import ChatTemplateError

    try:
        return await engine_client.apply_chat_template(
            messages,
            chat_template=request_template or server_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs={**(default_chat_template_kwargs or {}),
                                  **(chat_template_kwargs or {})},
        )
    except ChatTemplateError as e:
        raise APIError(400, str(e), "chat_template" if request_template else "messages") from e
    except ValueError as e:
        raise validation_error(e, default="messages") from e
    except Exception as e:
        raise error_from_exception(e) from e


async def merge_async_iterators(
    iterators: list[AsyncIterator[Any]],
) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item), in arrival order.

    Leaving early closes all of them (for request streams: aborts the unfinished).
    """
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            await _aclose(iterators[0])
        return
    pending: dict[asyncio.Future, int] = {
        asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending.keys(), return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await _aclose(it)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def final_outputs(streams: list[RequestOutputStream]) -> list[Any]:
    """The last output of each stream (non-streaming requests); errors -> APIError.

    A failure or cancellation aborts every stream still running.
    """

    async def last(stream: RequestOutputStream) -> Any:
        last_output = None
        async for output in stream:
            last_output = output
        return last_output

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, Exception):
            raise error_from_exception(e) from e
        raise


async def cancel_on_disconnect(raw_request: Request, handler: Coroutine[Any, Any, Any]) -> Any:
    """Run `handler`, cancelling it (and so aborting its requests) if the client leaves.

    Streaming responses need no help: Starlette cancels their body iterator on
    disconnect. This covers the wait before a non-streaming response.
    """
    task = asyncio.ensure_future(handler)

    async def wait_for_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return JSONResponse({}, status_code=499)  # nobody reads it
    return task.result()


def sse(payload: str) -> str:
    """One server-sent event."""
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """The HTTP response of a streaming request: `events` as text/event-stream."""
    return StreamingResponse(events, media_type="text/event-stream")


def stream_error_event(error: BaseException) -> str:
    """The error event of a stream that already sent its headers (status 200)."""
    return sse(error_from_exception(error).body().model_dump_json())

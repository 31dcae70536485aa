"""POST /v1/completions: prompts in, text out (whole, or as SSE chunks).

A request may carry several prompts (strings or token-id lists); each becomes
one engine request `{id}-{i}`, and its `n` samples are choices `i * n + j`.
Streaming sends `data: {chunk}` events as tokens arrive, an optional usage
chunk (`stream_options.include_usage`) and `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from vllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    build_sampling_params,
    clamp_logprob,
    final_outputs,
    logprob_token,
    merge_async_iterators,
    prompt_logprobs_json,
    random_id,
    reject_unsupported_fields,
    sse,
    sse_response,
    stream_error_event,
    usage_info,
)

if TYPE_CHECKING:
    from vllm.inputs import PromptType
    from vllm.logprobs import PromptLogprobs, SampleLogprobs
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import RequestOutputStream


def completion_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs | PromptLogprobs, text_offset: int,
    token_texts: list[str] | None = None, as_token_ids: bool = False,
) -> CompletionLogProbs:
    """OpenAI's completions logprobs: per token its text, logprob, char offset, and the
    top alternatives (the sampled token plus the top-k, keyed by text).

    A None step (the first prompt token under echo, which has no context) gives a
    null logprob and null top_logprobs, as in vLLM; its text comes from `token_texts`.
    `as_token_ids`: tokens (and top_logprobs keys) are "token_id:N" instead of text;
    text offsets still count the text's characters.
    """
    result = CompletionLogProbs()
    for i, (token_id, step) in enumerate(zip(token_ids, logprobs, strict=False)):
        if step is None:
            token = token_texts[i] if token_texts is not None else ""
            result.tokens.append(logprob_token(token_id, token, as_token_ids))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(text_offset)
            text_offset += len(token)
            continue
        sampled = step.get(token_id)
        token = (sampled.decoded_token if sampled is not None else None) or ""
        result.tokens.append(logprob_token(token_id, token, as_token_ids))
        result.token_logprobs.append(
            clamp_logprob(sampled.logprob) if sampled is not None else None
        )
        result.top_logprobs.append({
            logprob_token(alt_id, lp.decoded_token, as_token_ids): clamp_logprob(lp.logprob)
            for alt_id, lp in step.items()
        })
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _normalise_prompts(prompt: str | list) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint over an `AsyncLLM`."""

    async def create_completion(
        self, request: CompletionRequest
    ) -> JSONResponse | StreamingResponse:
        """Serve one completions request: one engine request per prompt, their
        choices whole or as SSE chunks.

        Raises:
            APIError: 400 invalid input, 404 unknown model, 500/503 engine failures.
        """
        model_name, stream, include_usage, continuous_usage = self.open_request(request)
        prompts = _normalise_prompts(request.prompt)
        if request.kv_transfer_params is not None and len(prompts) > 1:
            raise APIError(400, f"kv_transfer_params needs one prompt (one KV transfer), got "
                                f"{len(prompts)}; send one request per prompt",
                           "kv_transfer_params")
        # vLLM: echo with logprobs returns the prompt's logprobs too (as many top entries).
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo and request.logprobs is not None:
            prompt_logprobs = request.logprobs
        params = build_sampling_params(
            request, stream, self.vocab_size,
            max_tokens=request.max_tokens, logprobs=request.logprobs,
            defaults=self.default_sampling_params, prompt_logprobs=prompt_logprobs,
            backend=self.structured_outputs_backend,
        )
        request_id = random_id("cmpl")
        as_ids = self.tokens_as_ids(request)
        streams = await self.admit_all(request_id, prompts, params, priority=request.priority)
        if stream:
            return sse_response(self._stream(request_id, model_name, streams, params,
                                             bool(request.echo), include_usage,
                                             continuous_usage, as_ids))
        outputs = await final_outputs(streams)
        response = await self._response(request_id, model_name, outputs, params,
                                         bool(request.echo), as_ids)
        if request.prompt_logprobs is None:  # only asked-for prompt logprobs are returned
            for choice in response.choices:
                choice.prompt_logprobs = None
        return JSONResponse(response.model_dump())

    @staticmethod
    def _check_unsupported(request: CompletionRequest) -> None:
        reject_unsupported_fields(request)
        if request.suffix is not None:
            raise APIError(400, "suffix is not supported", "suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise APIError(400, f"best_of ({request.best_of}) is not supported; use n", "best_of")

    async def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return await self.engine_client.detokenize(list(output.prompt_token_ids or []))

    async def _response(
        self, request_id: str, model_name: str, outputs: list[RequestOutput],
        params: SamplingParams, echo: bool, as_ids: bool = False,
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        usage = UsageInfo()
        for i, output in enumerate(outputs):
            prefix = await self._prompt_text(output) if echo else ""
            echoed = await self._echoed_logprobs(output, as_ids) if echo else None
            usage.prompt_tokens += len(output.prompt_token_ids or [])
            for completion in sorted(output.outputs, key=lambda c: c.index):
                usage.completion_tokens += len(completion.token_ids)
                choice = self._choice(i * params.n + completion.index, prefix, completion,
                                      len(prefix), echoed, as_ids)
                choice.prompt_logprobs = prompt_logprobs_json(output.prompt_logprobs)
                choices.append(choice)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        kv_params = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params), None)
        return CompletionResponse(id=request_id, model=model_name, choices=choices, usage=usage,
                                  kv_transfer_params=kv_params)

    async def _echoed_logprobs(self, output: RequestOutput,
                               as_ids: bool = False) -> CompletionLogProbs | None:
        """Logprobs of the echoed prompt (text offsets from 0), or None if not computed."""
        if output.prompt_logprobs is None:
            return None
        token_ids = list(output.prompt_token_ids or [])
        # The first token's text (it has no logprob entry to carry it), decoded on the
        # tokenizer thread: HF fast tokenizers must not be shared across threads.
        texts = [await self.engine_client.detokenize(token_ids[:1])] if token_ids else []
        return completion_logprobs(token_ids, output.prompt_logprobs, 0, texts, as_ids)

    @staticmethod
    def _choice(
        index: int, prefix: str, completion: CompletionOutput, text_offset: int,
        echoed: CompletionLogProbs | None = None, as_ids: bool = False,
    ) -> CompletionResponseChoice:
        """One choice; `echoed` (the prompt's logprobs under echo) goes before the output's.

        With echo the output's text offsets continue after the echoed prompt text.
        """
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion_logprobs(list(completion.token_ids), completion.logprobs,
                                           text_offset, as_token_ids=as_ids)
            if echoed is not None:
                logprobs = CompletionLogProbs(
                    text_offset=echoed.text_offset + logprobs.text_offset,
                    token_logprobs=echoed.token_logprobs + logprobs.token_logprobs,
                    tokens=echoed.tokens + logprobs.tokens,
                    top_logprobs=echoed.top_logprobs + logprobs.top_logprobs,
                )
        return CompletionResponseChoice(
            index=index,
            text=prefix + completion.text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    async def _stream(
        self, request_id: str, model_name: str, streams: list[RequestOutputStream],
        params: SamplingParams, echo: bool, include_usage: bool,
        continuous_usage: bool = False, as_ids: bool = False,
    ) -> AsyncGenerator[str, None]:
        n = params.n
        offsets: dict[int, int] = {}  # choice index -> characters sent (for text_offset)
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, output in merge_async_iterators([s.__aiter__() for s in streams]):
                prompt_tokens.setdefault(i, len(output.prompt_token_ids or []))
                for completion in output.outputs:
                    index = i * n + completion.index
                    completion_tokens += len(completion.token_ids)
                    prefix = ""
                    echoed = None
                    if index not in offsets:
                        offsets[index] = 0
                        prefix = await self._prompt_text(output) if echo else ""
                        echoed = await self._echoed_logprobs(output, as_ids) if echo else None
                    if not (prefix or completion.text or completion.finish_reason
                            or completion.logprobs):
                        continue
                    choice = self._choice(index, prefix, completion, offsets[index] + len(prefix),
                                          echoed, as_ids)
                    offsets[index] += len(choice.text)
                    usage = (usage_info(sum(prompt_tokens.values()), completion_tokens)
                             if continuous_usage else None)
                    chunk = CompletionStreamResponse(id=request_id, model=model_name,
                                                     choices=[choice], usage=usage)
                    yield sse(chunk.model_dump_json())
            if include_usage:
                usage = usage_info(sum(prompt_tokens.values()), completion_tokens)
                chunk = CompletionStreamResponse(id=request_id, model=model_name, choices=[],
                                                 usage=usage)
                yield sse(chunk.model_dump_json())
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            yield stream_error_event(e)
        yield SSE_DONE

"""POST /v1/chat/completions: messages -> the model's chat template -> one engine request.

Streaming sends, per choice, a first chunk `delta: {"role": "assistant",
"content": ""}`, then content, `reasoning_content` and `tool_calls` deltas
(chat_reply.py), the finish reason, an optional usage chunk and `data: [DONE]`.
Logprobs follow the chat format: `logprobs: true` plus `top_logprobs: k` (k most
likely tokens per position).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, StreamingResponse

from vllm.entrypoints.openai.chat_reply import ReplyParser
from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    UsageInfo,
)
from vllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    build_sampling_params,
    clamp_logprob,
    final_outputs,
    logprob_token,
    prompt_logprobs_json,
    random_id,
    reject_unsupported_fields,
    render_chat,
    sse,
    sse_response,
    stream_error_event,
    usage_info,
)
from vllm.entrypoints.openai.tool_parsers import ToolParserManager
from vllm.entrypoints.openai.tool_parsers.tool_choice import (
    NamedToolParser,
    RequiredToolParser,
    ToolChoice,
    resolve_tool_choice,
    tool_choice_schema,
)
from vllm.reasoning import ReasoningParserManager
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.structured_output import validate_structured_outputs

if TYPE_CHECKING:
    from vllm.entrypoints.openai.serving_models import ServedModels
    from vllm.logprobs import SampleLogprobs
    from vllm.v1.engine.async_llm import AsyncLLM, RequestOutputStream


def _logprob_entry(token: str, logprob: float) -> ChatCompletionLogProb:
    return ChatCompletionLogProb(token=token, logprob=clamp_logprob(logprob),
                                 bytes=list(token.encode("utf-8")))


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, top_logprobs: int,
    as_token_ids: bool = False,
) -> ChatCompletionLogProbs:
    """Per token: its text, logprob, UTF-8 bytes, and the `top_logprobs` most likely tokens.

    `as_token_ids`: each token is named "token_id:N" (its bytes are that string's)."""
    content = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        sampled = step.get(token_id)
        token = logprob_token(token_id, sampled.decoded_token if sampled is not None else None,
                              as_token_ids)
        ranked = sorted(
            ((alt_id, lp) for alt_id, lp in step.items()
             if lp.rank is not None and lp.rank <= top_logprobs),
            key=lambda item: item[1].rank,
        )
        content.append(ChatCompletionLogProbsContent(
            token=token,
            logprob=clamp_logprob(sampled.logprob) if sampled is not None else -9999.0,
            bytes=list(token.encode("utf-8")),
            top_logprobs=[_logprob_entry(logprob_token(alt_id, lp.decoded_token, as_token_ids),
                                         lp.logprob)
                          for alt_id, lp in ranked[:top_logprobs]],
        ))
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint over an `AsyncLLM`.

    Args:
        chat_template: a template to use instead of the model's (`--chat-template`).
        default_chat_template_kwargs: template variables for every request
            (`--default-chat-template-kwargs`); a request's `chat_template_kwargs` win.
        reasoning_parser: `--reasoning-parser` (a `ReasoningParserManager` name):
            replies are split into `reasoning_content` and `content`.
        tool_parser: `--tool-call-parser` (a `ToolParserManager` name).
        enable_auto_tools: `--enable-auto-tool-choice`: tool_choice "auto" is served
            (with `tool_parser`), else refused with 400.
        return_tokens_as_token_ids: `--return-tokens-as-token-ids` (see `OpenAIServing`).
    """

    def __init__(
        self, engine_client: AsyncLLM, models: ServedModels, chat_template: str | None = None,
        *, default_chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_parser: str | None = None, tool_parser: str | None = None,
        enable_auto_tools: bool = False, return_tokens_as_token_ids: bool = False,
    ) -> None:
        super().__init__(engine_client, models,
                         return_tokens_as_token_ids=return_tokens_as_token_ids)
        self.chat_template = chat_template
        self.default_chat_template_kwargs = default_chat_template_kwargs
        self.reasoning_parser = (
            ReasoningParserManager.get_reasoning_parser(reasoning_parser)()
            if reasoning_parser else None)
        self.tool_parser_cls = (ToolParserManager.get_tool_parser(tool_parser)
                                if tool_parser else None)
        self.enable_auto_tools = enable_auto_tools and self.tool_parser_cls is not None

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> JSONResponse | StreamingResponse:
        """Serve one chat request: the messages through the chat template, one engine
        request, its `n` choices whole or as SSE chunks.

        Raises:
            APIError: 400 invalid input, 404 unknown model, 500/503 engine failures.
        """
        model_name, stream, include_usage, continuous_usage = self.open_request(request)
        tool_choice = resolve_tool_choice(request, self.enable_auto_tools)
        top_logprobs = request.top_logprobs or 0
        params = self._sampling_params(request, stream, tool_choice)
        prompt = await self._render(request)
        request_id = random_id("chatcmpl")
        length_param = ("max_completion_tokens" if request.max_completion_tokens is not None
                        else "max_tokens")
        (engine_stream,) = await self.admit_all(request_id, [prompt], params, "messages",
                                                length_param, {"logprobs": "top_logprobs"},
                                                request.priority)
        parsers = [self._reply_parser(request, prompt["prompt"], tool_choice)
                   for _ in range(params.n)]
        if stream:
            return sse_response(self._stream(request_id, model_name, engine_stream, parsers,
                                             top_logprobs, include_usage, continuous_usage,
                                             self.tokens_as_ids(request)))
        (output,) = await final_outputs([engine_stream])
        choices = []
        for completion in sorted(output.outputs, key=lambda c: c.index):
            logprobs = None
            if completion.logprobs is not None:
                logprobs = chat_logprobs(list(completion.token_ids), completion.logprobs,
                                         top_logprobs, self.tokens_as_ids(request))
            parser = parsers[completion.index]
            choices.append(ChatCompletionResponseChoice(
                index=completion.index,
                message=parser.message(completion.text),
                logprobs=logprobs,
                finish_reason=parser.finish_reason(completion.finish_reason),
                stop_reason=completion.stop_reason,
            ))
        prompt_tokens = len(output.prompt_token_ids or [])
        completion_tokens = sum(len(c.token_ids) for c in output.outputs)
        response = ChatCompletionResponse(id=request_id, model=model_name, choices=choices,
                                          usage=usage_info(prompt_tokens, completion_tokens),
                                          prompt_logprobs=prompt_logprobs_json(
                                              output.prompt_logprobs),
                                          kv_transfer_params=output.kv_transfer_params)
        return JSONResponse(response.model_dump())

    def _sampling_params(self, request: ChatCompletionRequest, stream: bool,
                         tool_choice: ToolChoice) -> SamplingParams:
        """The request's SamplingParams; tool_choice required / named add the schema
        structured outputs enforce (400 naming `tools` when it cannot compile)."""
        use_completion_tokens = request.max_completion_tokens is not None
        length_param = "max_completion_tokens" if use_completion_tokens else "max_tokens"
        schema = tool_choice_schema(request.tools or [], tool_choice,
                                    request.parallel_tool_calls)
        structured = None
        if schema is not None:
            try:
                structured = StructuredOutputsParams(json=schema, source_field="tools")
                validate_structured_outputs(structured, self.structured_outputs_backend)
            except ValueError as e:
                raise APIError(400, f"the tools' parameters cannot be enforced: {e}",
                               "tools") from e
        return build_sampling_params(
            request, stream, self.vocab_size,
            max_tokens=(request.max_completion_tokens if use_completion_tokens
                        else request.max_tokens),
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            renamed={"logprobs": "top_logprobs", "max_tokens": length_param},
            defaults=self.default_sampling_params,
            prompt_logprobs=request.prompt_logprobs,
            structured_outputs=structured, backend=self.structured_outputs_backend,
        )

    def _reply_parser(self, request: ChatCompletionRequest, prompt: str,
                      tool_choice: ToolChoice) -> ReplyParser:
        tool_parser = None
        if tool_choice.mode == "auto":
            tool_parser = self.tool_parser_cls(self.engine_client.tokenizer)
        elif tool_choice.mode == "required":
            tool_parser = RequiredToolParser()
        elif tool_choice.mode == "named":
            tool_parser = NamedToolParser(tool_choice.name)
        return ReplyParser(prompt, self.reasoning_parser, _echoed_text(request), tool_parser,
                           max_calls=1 if request.parallel_tool_calls is False else None,
                           calls_finish=tool_choice.mode != "named")

    @staticmethod
    def _check_unsupported(request: ChatCompletionRequest) -> None:
        reject_unsupported_fields(request)
        if request.functions:
            raise APIError(400, "functions are not supported by this server", "functions")
        if request.function_call not in (None, "none"):
            raise APIError(400, "function_call is not supported by this server",
                           "function_call")
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    async def _render(self, request: ChatCompletionRequest) -> dict:
        """The conversation as {"prompt", "prompt_token_ids"} (rendered and encoded on
        AsyncLLM's render and tokenizer threads)."""
        return await render_chat(
            self.engine_client,
            [m.model_dump(exclude_none=True) for m in request.messages],
            request_template=request.chat_template,
            server_template=self.chat_template,
            add_generation_prompt=bool(request.add_generation_prompt),
            continue_final_message=bool(request.continue_final_message),
            tools=request.tools,
            chat_template_kwargs=request.chat_template_kwargs,
            default_chat_template_kwargs=self.default_chat_template_kwargs,
        )

    async def _stream(
        self, request_id: str, model_name: str, engine_stream: RequestOutputStream,
        parsers: list[ReplyParser], top_logprobs: int, include_usage: bool,
        continuous_usage: bool = False, as_ids: bool = False,
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list[ChatCompletionResponseStreamChoice],
                  usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionStreamResponse(
                id=request_id, model=model_name, choices=choices, usage=usage).model_dump_json())

        prompt_tokens = 0
        completion_tokens = 0
        try:
            for index, parser in enumerate(parsers):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatCompletionResponseStreamChoice(index=index, delta=role)])
                if parser.echo:
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=index, delta=DeltaMessage(content=parser.echo))])
            async for output in engine_stream:
                prompt_tokens = len(output.prompt_token_ids or [])
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    if not (completion.text or completion.finish_reason or completion.logprobs):
                        continue
                    logprobs = None
                    if completion.logprobs is not None:
                        logprobs = chat_logprobs(list(completion.token_ids), completion.logprobs,
                                                 top_logprobs, as_ids)
                    delta = parsers[completion.index].feed(
                        completion.text, final=completion.finish_reason is not None)
                    if delta is None and not (completion.finish_reason or logprobs):
                        continue  # a tag held back: nothing to send yet
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=completion.index, delta=delta or DeltaMessage(), logprobs=logprobs,
                        finish_reason=parsers[completion.index].finish_reason(
                            completion.finish_reason),
                        stop_reason=completion.stop_reason,
                    )], usage_info(prompt_tokens, completion_tokens) if continuous_usage else None)
            if include_usage:
                yield chunk([], usage_info(prompt_tokens, completion_tokens))
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            yield stream_error_event(e)
        yield SSE_DONE


def _echoed_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text when it has the reply's role
    ("assistant", e.g. with continue_final_message), else nothing."""
    if not request.echo or not request.messages or request.messages[-1].role != "assistant":
        return ""
    content = request.messages[-1].content
    if isinstance(content, list):  # text parts (render_chat already checked their shape)
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""

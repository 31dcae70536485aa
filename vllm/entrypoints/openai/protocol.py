"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Field names and defaults follow the OpenAI API plus vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, ...). Models validate *types* only
(strictly: "5" is not an int, true is not an int); *ranges* are checked by
`SamplingParams` and the engine's `Processor`, the validators `LLM` uses too,
so the server and the offline API accept and reject the same values.
Unknown top-level fields of a request are ignored with a warning that names
them, as vLLM does (a typo'd parameter is visible in the log, never silently
dropped). Every string of a request
body (keys, unknown fields and nested messages included) must be valid Unicode:
a lone UTF-16 surrogate (`"\\ud800"`) is rejected before any field is read,
with `vllm.inputs.check_unicode_values`, the check the offline engine runs on
its prompts.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from vllm.inputs import InvalidUnicodeError, check_unicode_values
from vllm.logger import init_logger

logger = init_logger(__name__)
# The most characters of one unknown field name that the warning quotes.
_FIELD_NAME_CHARS = 64

# The pydantic error type of a request string that is not valid Unicode; its
# context carries "message" and "field" (the app answers 400 with param=field).
INVALID_UNICODE_ERROR = "invalid_unicode"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", protected_namespaces=())


class OpenAIRequest(OpenAIBaseModel):
    """A request body: before any field is validated, every string in it is checked."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        try:
            check_unicode_values(data)
        except InvalidUnicodeError as e:
            # "{message}" as the template: the message itself is never formatted.
            raise PydanticCustomError(INVALID_UNICODE_ERROR, "{message}",
                                      {"message": str(e), "field": e.parameter}) from None
        return data

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values()
                                             if f.alias}
            unknown = sorted(repr(k)[:_FIELD_NAME_CHARS] for k in data if k not in known)
            if unknown:  # the client's own keys: quoted and capped, so one line stays one
                more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
                logger.warning("%s: ignored unknown field(s) %s%s", cls.__name__,
                               ", ".join(unknown[:8]), more)
        return data


# ---------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    """`{"error": {"message", "type", "param", "code"}}`, the OpenAI error body."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- shared
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(OpenAIRequest):
    """Sampling fields common to completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    prompt_logprobs: int | None = None  # vLLM's: per prompt token; -1 = whole vocabulary
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (as vLLM tokenizes them)
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max len)
    # vLLM's: logprobs name tokens "token_id:N" (default: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's structured-output fields (one kind per request), parsed and checked by
    # structured_outputs.structured_outputs_from_request.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    response_format: Any = None
    # vLLM's other request extras this server does not implement: declared so a set,
    # non-neutral value is refused with HTTP 400 (serving_engine.UNSUPPORTED_FIELDS)
    # instead of being ignored.
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    # vLLM's: lower is scheduled first under --scheduling-policy priority; with the
    # default fcfs policy a non-zero value is a 400 (as vLLM refuses it).
    priority: int = 0
    # KV transfer (disaggregated prefill): passed to the KV connector as
    # SamplingParams.extra_args["kv_transfer_params"]; answered in the response.
    kv_transfer_params: dict[str, Any] | None = None


# ---------------------------------------------------------------------------- completions
class CompletionRequest(SamplingFields):
    """POST /v1/completions (https://platform.openai.com/docs/api-reference/completions)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None  # top-k per token, 0..MAX_LOGPROBS
    max_tokens: int | None = 16
    suffix: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIBaseModel):
    """One entry of vLLM's `prompt_logprobs`: keyed by token id (a string in JSON)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token (the first is null): token id -> its logprob, rank and text.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, when it has any


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat
class ChatMessage(OpenAIBaseModel):
    """One input message; extra keys (name, tool_call_id, ...) are passed to the template."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    # Parts are checked when the conversation is rendered (`chat_templates`), which names
    # the offending field and says what is wrong with it.
    content: str | list[Any] | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions (https://platform.openai.com/docs/api-reference/chat)."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # meaningful with tools only (refused above)
    functions: list[dict[str, Any]] | None = None  # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None
    # vLLM: the reply starts with the last message when it has the reply's role
    echo: bool | None = False
    # vLLM's chat template controls
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    # More variables for the chat template (e.g. {"enable_thinking": false}); they win
    # over the server's --default-chat-template-kwargs.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat extras not implemented here: refused when set (see SamplingFields).
    mm_processor_kwargs: Any = None
    documents: Any = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the reply's reasoning
    tool_calls: list[ToolCall] = Field(default_factory=list)  # [] when none, as vLLM's


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None  # from the KV connector, when it has any


class _DropNone(OpenAIBaseModel):
    """Serialised without its None fields (stream deltas send only what they carry)."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None  # in a call's first delta only
    arguments: str | None = None  # the next piece of the arguments' JSON text


class DeltaToolCall(_DropNone):
    """A piece of the tool call at `index`: its first delta carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_DropNone):
    """A stream delta; unset fields are left out (`{"content": "x"}`, not `"role": null`)."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- tokenizer
class TokenizeRequest(OpenAIRequest):
    """POST /tokenize: a `prompt`, or chat `messages` rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

"""Chat conversations -> prompts through the model's chat template (transformers).

Used by the offline `LLM.chat` and by `AsyncLLM` for the OpenAI server's chat
and tokenize endpoints (rendered on its render threads, encoded on its
tokenizer thread): one renderer, one set of errors.
Every way a conversation or a template can be wrong is a `VLLMValidationError`
(a ValueError): a malformed message names its field as its `parameter`
("messages.0.content.1.text"); a `ChatTemplateError` is the template's own
failure (a syntax error, the sandbox refusing an attribute, `raise_exception`,
a type error while it runs). The server answers both with HTTP 400.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs import check_unicode_text, check_unicode_values

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from vllm.multimodal.processing import MultiModalProcessor

# What a template's rendering raises for its own faults or the messages it was given:
# jinja2's TemplateError family (syntax, sandbox SecurityError, undefined values,
# transformers' raise_exception) and Python errors from expressions it evaluates
# (`content + 1`, `messages[5]`, `1 / 0`, runaway recursion).
_RENDER_ERRORS: tuple[type[BaseException], ...] = (
    TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError,
)


class ChatTemplateError(VLLMValidationError):
    """The chat template failed to render the conversation (its message says why).

    `parameter` is "chat_template"; the server names "messages" instead when the
    template was its own, not the request's.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, parameter="chat_template")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _normalise_content(message: dict[str, Any], index: int) -> dict[str, Any]:
    """OpenAI content parts [{"type": "text", "text": ...}] -> one string.

    Raises:
        VLLMValidationError: a part that is not an object, not of type "text",
            or whose text is missing or not a string; `parameter` names it.
    """
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        where = f"messages.{index}.content.{j}"
        if not isinstance(part, dict):
            raise VLLMValidationError(
                f"{where} must be a content part object, got {_type_name(part)}", parameter=where)
        if part.get("type") != "text":
            raise VLLMValidationError(
                f"{where}.type {part.get('type')!r} is not supported; only 'text' parts are"
                + (" (this model is text-only: it takes no images)"
                   if part.get("type") in ("image_url", "image_pil")
                   else ", and 'image_url' / 'image_pil' with a multimodal model"),
                parameter=f"{where}.type")
        text = part.get("text")
        if not isinstance(text, str):
            missing = "is required" if "text" not in part else f"got {_type_name(text)}"
            raise VLLMValidationError(f"{where}.text must be a string, {missing}",
                                      parameter=f"{where}.text")
        texts.append(text)
    return {**message, "content": "".join(texts)}


# Names `apply_chat_template` itself reads (or that would change what it returns): a
# template variable of one of these names cannot come from `chat_template_kwargs`.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


def check_chat_template_kwargs(
    kwargs: dict[str, Any] | None, parameter: str = "chat_template_kwargs"
) -> dict[str, Any]:
    """Extra template variables, checked: a dict of str keys, none of them one that
    `apply_chat_template` reads itself (`RESERVED_TEMPLATE_KWARGS`; the request's own
    fields set those). Returns a copy ({} for None).

    Raises:
        VLLMValidationError: not a dict, or a reserved key (`parameter` names it:
            "chat_template_kwargs.tokenize").
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise VLLMValidationError(f"{parameter} must be an object, got {_type_name(kwargs)}",
                                  parameter=parameter)
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise VLLMValidationError(
                f"{parameter} must not set {key!r}: it is set by the request itself",
                parameter=f"{parameter}.{key}")
    return dict(kwargs)


def _parse_tool_call_arguments(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's `tool_calls[*].function.arguments` JSON text -> its object,
    as chat templates (Qwen, Llama 3, Hermes) expect it (`arguments | tojson`).

    Raises:
        VLLMValidationError: arguments that are a string but not JSON; `parameter`
            names them ("messages.1.tool_calls.0.function.arguments").
    """
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            where = f"messages.{index}.tool_calls.{j}.function.arguments"
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise VLLMValidationError(f"{where} must be JSON text: {e}",
                                          parameter=where) from None
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def _template_errors() -> tuple[type[BaseException], ...]:
    from jinja2 import TemplateError

    return (TemplateError, *_RENDER_ERRORS)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    mm_processor: MultiModalProcessor | None = None,
) -> dict[str, Any]:
    """Render a conversation and encode it: {"prompt": text, "prompt_token_ids": ids},
    plus "multi_modal_data": {"image": [...]} and "multi_modal_params" (the part each
    image came from, "messages.0.content.1.image_url.url") when image parts were given.

    The template adds any BOS itself, so the text is encoded without special
    tokens. A multimodal model's `mm_processor` loads image parts and leaves
    its placeholder text in their place (`MultiModalProcessor.chat_images`);
    without one an image part is refused (text-only model). Errors: those of
    `render_chat_template` and `chat_images`.
    """
    images: list[Any] = []
    if mm_processor is not None:
        conversation, images, params = mm_processor.chat_images(conversation)
    text = render_chat_template(
        tokenizer, conversation, chat_template=chat_template,
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        tools=tools, chat_template_kwargs=chat_template_kwargs,
    )
    prompt = {"prompt": text, "prompt_token_ids": encode_rendered_chat(tokenizer, text)}
    if images:
        prompt["multi_modal_data"] = {"image": images}
        prompt["multi_modal_params"] = params  # the part each image came from, for errors
    return prompt


def encode_rendered_chat(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a rendered conversation (no special tokens: the template adds its own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _check_messages(conversation: list[dict[str, Any]]) -> None:
    """Raises VLLMValidationError (parameter "messages" or the field) for an empty
    conversation, a message without a role, or text that is not valid Unicode."""
    if not conversation:
        raise VLLMValidationError("messages must not be empty", parameter="messages")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise VLLMValidationError(
                f"messages[{i}] must be an object with a 'role'", parameter="messages"
            )
    check_unicode_values(conversation, "messages")


def render_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The conversation through the chat template, as text (nothing is tokenized).

    Pure Python over the tokenizer's Python-side attributes (the template and
    the special tokens' strings): safe to run on several threads at once, also
    while another thread encodes with the same tokenizer.

    Args:
        tools: the request's tool definitions (OpenAI's `{"type": "function",
            "function": {...}}` objects), the template's `tools` variable.
        chat_template_kwargs: more variables for the template (vLLM's request
            field, e.g. Qwen3's `{"enable_thinking": false}`); see
            `check_chat_template_kwargs`.

    Raises:
        VLLMValidationError: continue_final_message with add_generation_prompt
            (parameter: "continue_final_message"), an empty conversation or a
            malformed message (parameter: "messages" or the part's field), text that is not valid
            Unicode (a lone UTF-16 surrogate; parameter names the field).
        ChatTemplateError (a VLLMValidationError): the template failed to render.
        ValueError: no chat template.
    """
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    if continue_final_message and add_generation_prompt:  # as transformers refuses it
        raise VLLMValidationError(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "pass add_generation_prompt=False to continue the final message",
            parameter="continue_final_message")
    _check_messages(conversation)
    if chat_template is not None:
        check_unicode_text(chat_template, "chat_template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model has no chat template; pass chat_template or use completions"
        )
    messages = [_parse_tool_call_arguments(_normalise_content(m, i), i)
                for i, m in enumerate(conversation)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools or None,
            tokenize=False,
            **kwargs,
        )
    except _template_errors() as e:
        raise ChatTemplateError(f"the chat template failed to render: {e}") from e
    return text

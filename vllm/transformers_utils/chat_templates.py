"""Chat conversations -> prompts through the model's chat template (transformers).

Used by the offline `LLM.chat` and, on the engine thread, by `AsyncLLM` for the
OpenAI server's chat and tokenize endpoints: one renderer, one set of errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.inputs import check_unicode_text, check_unicode_values

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def _normalise_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts [{"type": "text", "text": ...}] -> one string."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise VLLMValidationError(
                    f"unsupported message content part of type {kind!r}", parameter="messages"
                )
            texts.append(part.get("text", ""))
        message = {**message, "content": "".join(texts)}
    return message


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> dict[str, Any]:
    """Render a conversation; returns {"prompt": text, "prompt_token_ids": ids}.

    The template adds any BOS itself, so the text is encoded without special
    tokens.

    Raises:
        VLLMValidationError: an empty conversation or a malformed message
            (parameter "messages"), text that is not valid Unicode (a lone UTF-16
            surrogate; parameter names the field). ValueError: no chat template.
    """
    if not conversation:
        raise VLLMValidationError("messages must not be empty", parameter="messages")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or "role" not in message:
            raise VLLMValidationError(
                f"messages[{i}] must be an object with a 'role'", parameter="messages"
            )
    check_unicode_values(conversation, "messages")
    if chat_template is not None:
        check_unicode_text(chat_template, "chat_template")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the model has no chat template; pass chat_template or use completions"
        )
    messages = [_normalise_content(m) for m in conversation]
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tokenize=False,
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return {"prompt": text, "prompt_token_ids": token_ids}

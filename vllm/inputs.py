"""Prompt types accepted by `LLM.generate` and the engines, as in vLLM, and the text
validity check every prompt and request string passes (`check_unicode_text`)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from vllm.exceptions import VLLMValidationError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt


class InvalidUnicodeError(VLLMValidationError):
    """A string with a lone UTF-16 surrogate; `parameter` names it ("messages.0.content")."""


def check_unicode_text(text: str, field: str, *, what: str | None = None) -> None:
    """Check that `text` is valid Unicode: no lone UTF-16 surrogate (U+D800..U+DFFF).

    JSON's `"\\ud800"` escape and Python strings can hold a surrogate that is
    not half of a pair; it has no UTF-8 encoding, so tokenizers reject it with
    a TypeError and JSON responses that echo it fail to encode. The offline
    engine (`Processor.tokenize`) and the OpenAI server (every request string)
    both check with this function.

    Args:
        text: the string to check.
        field: its name in the request ("prompt", "messages.0.content").
        what: how the message names it, when not `field` ("a key of logit_bias").

    Raises:
        InvalidUnicodeError (a VLLMValidationError): naming the field, the code point
            and its character offset.
    """
    if text.isascii():  # the common case, without a copy
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidUnicodeError(
            f"{what or field} contains a lone UTF-16 surrogate U+{ord(text[e.start]):04X} at "
            f"character {e.start}; text must be valid Unicode (surrogates only in pairs)",
            parameter=field or None,
        ) from None


def check_unicode_values(value: object, field: str = "") -> None:
    """`check_unicode_text` on every string inside dicts and lists (keys too).

    Nested fields are named with dots, as request validation errors name them:
    `messages.0.content`; a bad key is reported under its parent's name.
    Iterative, so deeply nested JSON cannot exhaust the recursion limit.

    Raises:
        InvalidUnicodeError (a VLLMValidationError): the first invalid string found.
    """
    stack: list[tuple[object, str]] = [(value, field)]
    while stack:
        item, name = stack.pop()
        if isinstance(item, str):
            check_unicode_text(item, name, what=name or "the value")
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                if isinstance(key, str):
                    check_unicode_text(key, name, what=f"a key of {name}" if name else "a key")
                stack.append((child, f"{name}.{key}" if name else str(key)))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{name}.{i}" if name else str(i))
                         for i, child in reversed(list(enumerate(item))))

"""Partial JSON for streamed tool calls, with `partial-json-parser` (the library vLLM uses):
a call object as far as it is written, and the part of its arguments' JSON text
that later tokens cannot change."""

from __future__ import annotations

import json
from typing import Any

import partial_json_parser
from partial_json_parser.core.options import Allow

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialCall


def parse_partial(text: str, allow: Allow = Allow.ALL) -> Any:
    """The JSON value `text` starts (open strings, arrays, objects closed); None when
    nothing is parsed yet or the text cannot be the start of a JSON value."""
    if not text.strip():
        return None
    try:
        return partial_json_parser.loads(text, allow)
    except (ValueError, partial_json_parser.MalformedJSON):
        return None


def partial_call(body: str, complete: bool, name: str | None = None) -> PartialCall | None:
    """A call `{"name": ..., "arguments" | "parameters": ...}` from its JSON text.

    `complete`: the text is all of it; one that does not then parse whole (cut
    short, malformed) is an unfinished call (`complete` False). None: a whole
    JSON value that is not a call. The name counts only once its string is closed.
    """
    if complete:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return PartialCall()
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return PartialCall(value["name"], _arguments(value), complete=True)
    value = parse_partial(body)
    if not isinstance(value, dict):
        return PartialCall()
    named = parse_partial(body, Allow.ALL & ~Allow.STR)  # no half-written strings
    name = named.get("name") if isinstance(named, dict) else None
    return PartialCall(name if isinstance(name, str) else None, _arguments(value))


def _arguments(call: dict) -> Any:
    return call.get("arguments", call.get("parameters"))


# What a partial value's JSON text may still change at its end: the closers of open
# strings, objects and arrays, and a number or literal cut short.
_UNSETTLED_TAIL = '"}] \n0123456789.eE+-truefalsn'


def settled_prefix(arguments_json: str) -> str:
    """The part of a partial value's JSON text that the rest of the value cannot change."""
    return arguments_json.rstrip(_UNSETTLED_TAIL)


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (to hold
    back until it is known whether the tag is starting)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

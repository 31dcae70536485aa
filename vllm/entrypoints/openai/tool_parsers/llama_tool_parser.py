"""`--tool-call-parser llama3_json`: Llama 3.x's JSON tool calls,
`{"name": ..., "parameters": {...}}`, several separated by `;`, optionally after
`<|python_tag|>` (vLLM's name)."""

from __future__ import annotations

import json

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialCall, ToolParser
from vllm.entrypoints.openai.tool_parsers.partial_json import held_tag_prefix, partial_call

_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    """A reply that starts with `{` (or `<|python_tag|>`) is tool calls; any other reply
    is content. Arguments are read from "parameters" (or "arguments")."""

    python_tag = "<|python_tag|>"

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        body = text.lstrip()
        tagged = body.startswith(self.python_tag)
        if tagged:
            body = body[len(self.python_tag):].lstrip()
        if not final and (not body or (
                not tagged and held_tag_prefix(body, self.python_tag) == len(body))):
            return "", []  # the reply has not shown yet whether it is a call
        if not body.startswith("{"):
            return text, []
        calls, index = [], 0
        while index < len(body):
            try:
                value, end = _DECODER.raw_decode(body, index)
            except json.JSONDecodeError:
                call = partial_call(body[index:], complete=final)
                if call is not None:
                    calls.append(call)
                break
            call = partial_call(json.dumps(value), complete=True)
            if call is not None:
                calls.append(call)
            index = end
            while index < len(body) and body[index] in " \t\n;":
                index += 1
        return "", calls

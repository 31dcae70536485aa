"""`--tool-call-parser hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
the format of Hermes 2 Pro, Qwen2.5 and Qwen3 (vLLM's name)."""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialCall, ToolParser
from vllm.entrypoints.openai.tool_parsers.partial_json import (
    held_tag_prefix,
    partial_call,
)


class Hermes2ProToolParser(ToolParser):
    """Calls in `<tool_call>` tags, one JSON object each; the text before the first
    tag is content, text between and after calls is dropped (as vLLM does)."""

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        start = text.find(self.tool_call_start_token)
        if start == -1:
            keep = 0 if final else held_tag_prefix(text, self.tool_call_start_token)
            return text[:len(text) - keep], []
        calls = []
        rest = text[start:]
        while rest.startswith(self.tool_call_start_token):
            body = rest[len(self.tool_call_start_token):]
            end = body.find(self.tool_call_end_token)
            closed = end != -1
            call = partial_call(body[:end] if closed else body, complete=closed or final)
            # A closed call that is malformed: unfinished at the end, skipped before
            # (so the calls after it stream).
            if call is not None and (final or call.complete or not closed):
                calls.append(call)
            if not closed:
                break
            rest = body[end + len(self.tool_call_end_token):]
            nxt = rest.find(self.tool_call_start_token)
            rest = rest[nxt:] if nxt != -1 else ""
        return text[:start], calls

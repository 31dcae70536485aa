"""Tool-call deltas of a streamed reply, as vLLM sends them.

Each feed re-parses the reply's text so far (`ToolParser.parse`) and sends what
is new: content before the calls; a call's first delta once its name is
written whole (`{"index", "id", "type": "function", "function": {"name"}}`), then
pieces of its arguments' JSON text (`{"index", "function": {"arguments"}}`). The
arguments are sent as far as later tokens cannot change them (`settled_prefix`),
and the rest when the call is complete, so the pieces join to exactly the
`arguments` of the non-streamed reply. A reply the parser says ends inside an
unfinished call (`ParsedReply.unfinished_call`: cut by max_tokens) sends none of
that call's text as content; a partial call already sent stands.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    PartialCall,
    ToolParser,
    arguments_json,
    random_tool_call_id,
)
from vllm.entrypoints.openai.tool_parsers.partial_json import settled_prefix


@dataclass
class _SentCall:
    id: str
    arguments: str = ""  # the arguments' JSON text sent so far


class ToolCallStream:
    """The tool-call state of one streamed choice.

    Args:
        parser: reads the calls out of the reply's content.
        max_calls: calls beyond this many are not sent (`parallel_tool_calls:
            false` -> 1); None: no limit.
    """

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self._text = ""
        self._content_sent = 0
        self._calls: list[_SentCall] = []

    @property
    def tools_called(self) -> bool:
        """A call has been sent."""
        return bool(self._calls)

    def feed(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for the next piece of the content."""
        self._text += text
        parsed = self.parser.parse(self._text, final)
        content, calls = parsed.content, parsed.calls
        # parsed.unfinished_call (max_tokens cut a call, or its JSON broke): its text
        # stays out of `content`; deltas already sent cannot be taken back, so the
        # partial call stands, as in vLLM's streams (the whole reply would be content).
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        content_delta = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        deltas = []
        for index, call in enumerate(calls):
            delta = self._call_delta(index, call)
            if delta is None:
                break  # the next calls wait for this one's name
            if delta.id is not None or delta.function.arguments:
                deltas.append(delta)
        return content_delta, deltas

    def _call_delta(self, index: int, call: PartialCall) -> DeltaToolCall | None:
        if index == len(self._calls):
            if call.name is None:
                return None
            self._calls.append(_SentCall(random_tool_call_id()))
            first = True
        else:
            first = False
        sent = self._calls[index]
        if call.complete:
            target = arguments_json(call.arguments)
        elif call.arguments is None:
            target = ""
        else:
            target = settled_prefix(json.dumps(call.arguments, ensure_ascii=False))
        piece = target[len(sent.arguments):] if target.startswith(sent.arguments) else ""
        sent.arguments += piece
        function = DeltaFunctionCall(name=call.name if first else None, arguments=piece or None)
        if first:
            return DeltaToolCall(index=index, id=sent.id, type="function", function=function)
        return DeltaToolCall(index=index, function=function)

"""One chat choice's reply text -> the message fields the API returns: `reasoning_content`
(with `--reasoning-parser`), `content` and `tool_calls`, whole (`message`) or delta by
delta (`feed`).

The reasoning parser sees the text first; what it calls content goes to the tool
parser, if the request's tool choice has one (auto: the server's
`--tool-call-parser`; required / named: the JSON the grammar forced). Both paths
run the same parser state, so a streamed choice's deltas join to the non-streamed
message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.entrypoints.openai.protocol import ChatMessageOut, DeltaMessage
from vllm.entrypoints.openai.tool_parsers.tool_call_stream import ToolCallStream

if TYPE_CHECKING:
    from vllm.entrypoints.openai.tool_parsers import ToolParser
    from vllm.reasoning import ReasoningParser


class ReplyParser:
    """The parsing state of one choice.

    Args:
        prompt: the rendered prompt text (a template that opens or closes the
            reasoning in the generation prompt decides where the reply starts).
        reasoning_parser: the server's `--reasoning-parser`, or None.
        echo: text that leads the content (chat `echo`), not parsed.
        tool_parser: reads tool calls out of the content, or None (no tools).
        max_calls: 1 with `parallel_tool_calls: false` (later calls are dropped).
        calls_finish: a reply with tool calls finishes with "tool_calls" (auto and
            required; a named choice finishes "stop", as OpenAI's does).
    """

    def __init__(self, prompt: str, reasoning_parser: ReasoningParser | None,
                 echo: str = "", tool_parser: ToolParser | None = None,
                 max_calls: int | None = None, calls_finish: bool = True) -> None:
        self._reasoning = reasoning_parser.stream(prompt) if reasoning_parser else None
        self.echo = echo
        self._tool_parser = tool_parser
        self._tools = ToolCallStream(tool_parser, max_calls) if tool_parser else None
        self._max_calls = max_calls
        self._calls_finish = calls_finish
        self._called = False

    def message(self, text: str) -> ChatMessageOut:
        """The message of a whole reply."""
        reasoning, content = self._split(text, final=True)
        tool_calls = []
        if self._tool_parser is not None:
            info = self._tool_parser.extract_tool_calls(content)
            if info.tools_called:
                tool_calls = info.tool_calls[:self._max_calls]
                content = info.content or ""
                self._called = True
        content = self.echo + content
        return ChatMessageOut(content=content if content or reasoning is None else None,
                              reasoning_content=reasoning, tool_calls=tool_calls)

    def feed(self, text: str, final: bool = False) -> DeltaMessage | None:
        """The delta of the next piece of the reply (`final`: the last piece); None when
        it adds nothing to send yet (a tag or a call's name not yet whole)."""
        reasoning, content = self._split(text, final)
        calls = None
        if self._tools is not None and (content or final):
            content, calls = self._tools.feed(content, final)
            self._called = self._tools.tools_called
        if reasoning is None and not content and not calls:
            return None
        return DeltaMessage(reasoning_content=reasoning, content=content or None,
                            tool_calls=calls or None)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's finish reason: "tool_calls" for a reply of calls that stopped."""
        if engine_reason == "stop" and self._called and self._calls_finish:
            return "tool_calls"
        return engine_reason

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning or None, content) of a piece of the reply."""
        if self._reasoning is None:
            return None, text
        delta = self._reasoning.feed(text)
        if final:
            rest = self._reasoning.finish()
            delta.reasoning += rest.reasoning
            delta.content += rest.content
        return delta.reasoning or None, delta.content

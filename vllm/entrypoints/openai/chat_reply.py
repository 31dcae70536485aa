"""One chat choice's reply text -> the message fields the API returns: `reasoning_content`
(with `--reasoning-parser`) and `content`, whole (`message`) or delta by delta (`feed`).

The reasoning parser sees the text first; what it calls content follows. Both paths
run the same parser state, so a streamed choice's deltas join to the non-streamed
message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.entrypoints.openai.protocol import ChatMessageOut, DeltaMessage

if TYPE_CHECKING:
    from vllm.reasoning import ReasoningParser


class ReplyParser:
    """The parsing state of one choice.

    Args:
        prompt: the rendered prompt text (a template that opens or closes the
            reasoning in the generation prompt decides where the reply starts).
        reasoning_parser: the server's `--reasoning-parser`, or None.
        echo: text that leads the content (chat `echo`), not parsed.
    """

    def __init__(self, prompt: str, reasoning_parser: ReasoningParser | None,
                 echo: str = "") -> None:
        self._reasoning = reasoning_parser.stream(prompt) if reasoning_parser else None
        self.echo = echo

    def message(self, text: str) -> ChatMessageOut:
        """The message of a whole reply."""
        reasoning, content = self._split(text, final=True)
        content = self.echo + content
        return ChatMessageOut(content=content if content or reasoning is None else None,
                              reasoning_content=reasoning)

    def feed(self, text: str, final: bool = False) -> DeltaMessage | None:
        """The delta of the next piece of the reply (`final`: the last piece); None when
        it adds nothing to send yet (a tag held back until it is whole)."""
        reasoning, content = self._split(text, final)
        if reasoning is None and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning, content=content or None)

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

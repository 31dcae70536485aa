"""The reasoning parser interface, its registry, and the think-tag splitter both
built-in parsers share.

A reply of a reasoning model is `<think>` reasoning `</think>` answer. The
parser splits it into `reasoning_content` and `content`, for a whole reply
(`extract_reasoning_content`) or delta by delta while it streams
(`ReasoningStream.feed`); both run the same state machine, so a streamed reply's
deltas join to exactly the non-streamed split. Where the reply starts (inside
the reasoning, or not) is read from the rendered prompt: a template that opens
`<think>` in the generation prompt (DeepSeek-R1, Qwen3 thinking models) or closes
it (`enable_thinking: false`) decides it before the model writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vllm.utils.lazy_registry import LazyRegistry


class ReasoningParserManager:
    """The registry of reasoning parsers by `--reasoning-parser` name (vLLM's name);
    imported on first use, so the CLI checks names without importing parsers."""

    registry: LazyRegistry[ReasoningParser] = LazyRegistry("reasoning parser", {
        "deepseek_r1": "vllm.reasoning.deepseek_r1_reasoning_parser:DeepSeekR1ReasoningParser",
        "qwen3": "vllm.reasoning.qwen3_reasoning_parser:Qwen3ReasoningParser",
    })
    names = staticmethod(registry.names)
    get_reasoning_parser = staticmethod(registry.get)  # KeyError lists the names


@dataclass
class ReasoningDelta:
    """What one piece of text adds to each part ("" when nothing)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits `start_token` reasoning `end_token` content.

    Subclasses set the tags and `starts_in_reasoning`: whether a reply whose prompt
    neither opens nor closes the reasoning begins inside it (DeepSeek-R1: yes, its
    reasoning never has to be opened; Qwen3: no, the model opens it with `<think>`).
    """

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = False

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A splitter for one reply to `prompt` (the rendered prompt text)."""
        return ReasoningStream(self, self._prompt_state(prompt or ""))

    def extract_reasoning_content(
        self, model_output: str, prompt: str | None = None
    ) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole reply; None for a part that is empty."""
        stream = self.stream(prompt)
        delta = stream.feed(model_output)
        rest = stream.finish()
        reasoning = delta.reasoning + rest.reasoning
        content = delta.content + rest.content
        return reasoning or None, content or None

    def _prompt_state(self, prompt: str) -> str:
        tail = prompt.rstrip()
        if tail.endswith(self.start_token):
            return _REASONING
        if tail.endswith(self.end_token):
            return _CONTENT
        return _REASONING if self.starts_in_reasoning else _BEFORE


# States of a reply: before any reasoning (a start tag may still open it), inside
# the reasoning, and after it (everything is content; tags are text).
_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


class ReasoningStream:
    """The split of one reply, fed its text delta by delta.

    A tag split across deltas is held back until it is whole (or turns out not to
    be a tag), so no delta ever carries part of a tag.
    """

    def __init__(self, parser: ReasoningParser, state: str) -> None:
        self.parser = parser
        self.state = state
        self._held = ""  # text that may be the start of a tag
        self._opened = False  # the reasoning's start tag was seen (or implied)

    @property
    def in_reasoning(self) -> bool:
        return self.state == _REASONING

    def feed(self, text: str) -> ReasoningDelta:
        """Split the next piece of the reply."""
        out = ReasoningDelta()
        text = self._held + text
        self._held = ""
        while text:
            if self.state == _CONTENT:
                out.content += text
                return out
            tag = self.parser.end_token if self.state == _REASONING else self.parser.start_token
            found = text.find(tag)
            if self.state == _REASONING and not self._opened:
                # A reply that begins inside the reasoning may still write the start tag.
                start = text.find(self.parser.start_token)
                if start != -1 and (found == -1 or start < found):
                    out.reasoning += text[:start]
                    text = text[start + len(self.parser.start_token):]
                    self._opened = True
                    continue
            if found == -1:
                keep = _partial_tag_suffix(text, self._pending_tags())
                self._emit(out, text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                return out
            self._emit(out, text[:found])
            text = text[found + len(tag):]
            self._opened = True
            self.state = _CONTENT if self.state == _REASONING else _REASONING
        return out

    def finish(self) -> ReasoningDelta:
        """The held-back text at the end of the reply (a tag that never completed)."""
        out = ReasoningDelta()
        self._emit(out, self._held)
        self._held = ""
        return out

    def _pending_tags(self) -> tuple[str, ...]:
        if self.state == _REASONING:
            return (self.parser.end_token,) + (() if self._opened else (self.parser.start_token,))
        return (self.parser.start_token,)

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self.state == _REASONING:
            out.reasoning += text
        else:
            out.content += text


def _partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best

"""The tool-call parser interface and its registry (`--tool-call-parser NAME`).

A parser reads a reply's content (after any reasoning) and finds the tool calls
the model wrote in its format. It does so in one place, `parse`, over the text
so far: the content that is certainly not part of a call, the calls as far
as they are written (`PartialCall`), and at the end whether the text stops
inside a call never finished (`ParsedReply.unfinished_call`: max_tokens cut
it). Whole replies (`extract_tool_calls`) and streams (`ToolCallStream` in
tool_call_stream.py) both use it, so the deltas of a streamed reply join to the
whole reply's calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.utils.lazy_registry import LazyRegistry

if TYPE_CHECKING:  # imported when used: the CLI reads the names without pydantic models
    from vllm.entrypoints.openai.protocol import ToolCall

class ToolParserManager:
    """The registry of tool-call parsers by `--tool-call-parser` name (vLLM's name);
    imported on first use, so the CLI reads the names without pydantic models."""

    registry: LazyRegistry[ToolParser] = LazyRegistry("tool call parser", {
        "hermes": "vllm.entrypoints.openai.tool_parsers.hermes_tool_parser:"
                  "Hermes2ProToolParser",
        "llama3_json": "vllm.entrypoints.openai.tool_parsers.llama_tool_parser:"
                       "Llama3JsonToolParser",
    })
    names = staticmethod(registry.names)
    get_tool_parser = staticmethod(registry.get)  # KeyError lists the names


@dataclass
class PartialCall:
    """A tool call as far as the model has written it.

    Attributes:
        name: the function's name, once written whole (None before).
        arguments: the arguments parsed so far (a partial JSON value: open strings,
            objects and arrays closed), None before any.
        complete: the call is written whole; `arguments` is final.
    """

    name: str | None = None
    arguments: Any = None
    complete: bool = False


@dataclass
class ParsedReply:
    """What `ToolParser.parse` read in a reply's text so far.

    Attributes:
        content: the text that is certainly not part of a call.
        calls: the calls begun so far (at `final`: the well-formed ones only).
        unfinished_call: at `final`, the text ends inside a call the format began
            and never finished well-formed (cut by max_tokens, or malformed JSON).
            A stream has sent, or held back, that call's text as a call: it is not
            content. (A whole reply with no well-formed call is all content.)
    """

    content: str
    calls: list[PartialCall]
    unfinished_call: bool = False


@dataclass
class ExtractedToolCallInformation:
    """The tool calls of a whole reply (vLLM's name).

    Attributes:
        tools_called: the reply is tool calls (False: it is all content).
        tool_calls: the calls, arguments as JSON text.
        content: the text before the calls (None when there is none).
    """

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


def random_tool_call_id() -> str:
    """A tool call's id (vLLM's form: `chatcmpl-tool-<32 hex>`)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_json(arguments: Any) -> str:
    """A call's arguments as the JSON text the API returns (`{}` when none)."""
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


class ToolParser:
    """Finds a model's tool calls in its reply's content.

    Subclasses implement `parse`. Args: tokenizer (unused by the built-in
    parsers, which read text; kept for vLLM's signature).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool) -> ParsedReply:
        """The content and calls of the reply's text so far (`final`: all of it).

        `content` is the text that is certainly not part of a call (a tag that may
        still be starting is held back until `final`); `calls` the calls begun so
        far. At `final`, a call that is not well-formed (cut, malformed) is dropped
        and reported as `unfinished_call`, its text not content; a reply in which
        the format began no call at all is all content.
        """
        content, calls = self._parse(text, final)
        if not final:
            return ParsedReply(content, calls)
        whole = [c for c in calls if c.complete and c.name is not None]
        unfinished = len(whole) < len(calls)
        if not whole and not unfinished:
            return ParsedReply(text, [])
        return ParsedReply(content, whole, unfinished)

    def _parse(self, text: str, final: bool) -> tuple[str, list[PartialCall]]:
        """`parse` in the parser's format: (content, calls). At `final`, a call begun
        but not well-formed is returned with `complete` False, not left out."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The calls of a whole reply; a reply without a well-formed call is all content
        (an unfinished call's text included: nothing was sent as a call)."""
        from vllm.entrypoints.openai.protocol import FunctionCall, ToolCall

        parsed = self.parse(model_output, final=True)
        content, calls = parsed.content, parsed.calls
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        tool_calls = [ToolCall(id=random_tool_call_id(), function=FunctionCall(
            name=c.name, arguments=arguments_json(c.arguments))) for c in calls]
        return ExtractedToolCallInformation(True, tool_calls, content or None)

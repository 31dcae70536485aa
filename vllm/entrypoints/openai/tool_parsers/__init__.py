"""Tool calling: tool-call parsers (`--tool-call-parser`), the structured-output schema of
`tool_choice` "required" / a named function, and the streaming of tool-call deltas.
See README.md."""

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCallInformation,
    PartialCall,
    ToolParser,
    ToolParserManager,
)

__all__ = ["ExtractedToolCallInformation", "PartialCall", "ToolParser", "ToolParserManager"]

"""Reasoning parsers: split a reply's `reasoning_content` from its `content` (vLLM's
`--reasoning-parser`). See README.md."""

from vllm.reasoning.abs_reasoning_parsers import (
    ReasoningParser,
    ReasoningParserManager,
    ReasoningStream,
)

__all__ = ["ReasoningParser", "ReasoningParserManager", "ReasoningStream"]

"""`--reasoning-parser deepseek_r1`: DeepSeek-R1's reasoning, closed by `</think>`
(vLLM's name)."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 always reasons first: its template opens `<think>` in the prompt,
    and a `<think>` the model writes itself is dropped. Everything up to `</think>` is
    reasoning, so a reply cut off before it is all reasoning; a prompt that already
    closed the reasoning makes the reply all content."""

    starts_in_reasoning = True

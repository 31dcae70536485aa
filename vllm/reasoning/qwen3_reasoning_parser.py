"""`--reasoning-parser qwen3`: Qwen3's `<think>...</think>` (vLLM's name)."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>` itself when it reasons; a reply without it is all content
    (`enable_thinking: false`: the template closes an empty `<think></think>` in the
    prompt). Thinking-only Qwen3 models whose template opens `<think>` in the prompt
    start inside the reasoning."""

    starts_in_reasoning = False

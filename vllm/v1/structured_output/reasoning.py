"""A reasoning model's constrained reply: free reasoning, then the grammar.

With `--reasoning-parser` (the engine's `structured_outputs_config.reasoning_parser`) a
reply is `<think>` reasoning `</think>` answer, and the grammar constrains only the
answer, as in vLLM: the runner's matcher skips the reasoning and accepts what follows
the end tag::

    prompt ... <|im_start|>assistant\n | <think> free ... </think> | {"city": "Paris"} <eos>
                                          ^ unconstrained rows        ^ grammar rows

Where a reply starts is read from the prompt's tail as vllm/reasoning's parsers read it
(`ReasoningTokens.state_after`): a prompt ending in the start tag (DeepSeek-R1's
template) starts in the reasoning, one ending in the end tag (Qwen3 with
`enable_thinking: false`) starts in the answer, and otherwise the parser decides:
DeepSeek-R1 replies start in the reasoning; a Qwen3 reply may open it with its first
token. That first token's mask is then the grammar's plus the start tag: the start tag
leads into free reasoning, any other token is the answer's first (vLLM leaves such a
reply unconstrained until an end tag that never comes; here the grammar holds the
content the parser reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.exceptions import VLLMValidationError

# --reasoning-parser name -> (start tag, end tag, whether a reply starts inside the
# reasoning when the prompt opens nothing). vllm/reasoning's parsers split replies the
# same way (tests/reasoning checks that they agree); kept here because the engine and
# the worker, below the frontend, apply grammars after the end tag.
REASONING_TAGS = {"deepseek_r1": ("<think>", "</think>", True),
                  "qwen3": ("<think>", "</think>", False)}
# A reply's states: may still open the reasoning (its first token), in it, after it.
BEFORE, REASONING, CONTENT = "before", "reasoning", "content"


@dataclass(frozen=True)
class ReasoningTokens:
    """The token ids of a reasoning parser's tags (picklable: travels with a grammar).

    Attributes:
        start_id: the start tag's token (`<think>`).
        end_id: the end tag's token (`</think>`); the grammar applies after it.
        starts_in_reasoning: a reply whose prompt opens nothing starts in the reasoning.
        whitespace_ids: tokens that decode to whitespace only (skipped at a prompt's end).
    """

    start_id: int
    end_id: int
    starts_in_reasoning: bool
    whitespace_ids: frozenset[int]

    @classmethod
    def of(cls, tags: tuple[str, str, bool], tokenizer) -> ReasoningTokens:
        """The ids of a `REASONING_TAGS` entry in an HF tokenizer's vocabulary.

        Raises:
            VLLMValidationError (parameter "structured_outputs"): a tag is not one token
                of the vocabulary (the reasoning parser does not fit this model).
        """
        vocab = tokenizer.get_vocab()
        missing = [tag for tag in tags[:2] if tag not in vocab]
        if missing:
            raise VLLMValidationError(
                f"the reasoning parser's tags {missing} are not tokens of this model's "
                "vocabulary: its grammar cannot find where the reasoning ends",
                parameter="structured_outputs")
        ids = sorted(vocab.values())
        texts = tokenizer.batch_decode([[i] for i in ids])
        blank = frozenset(i for i, text in zip(ids, texts, strict=True)
                          if text and not text.strip())
        return cls(vocab[tags[0]], vocab[tags[1]], tags[2], blank)

    def state_after(self, prompt_token_ids: Sequence[int]) -> str:
        """BEFORE, REASONING or CONTENT: where a reply to this prompt starts."""
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return REASONING
            if token == self.end_id:
                return CONTENT
            if token not in self.whitespace_ids:
                break
        return REASONING if self.starts_in_reasoning else BEFORE

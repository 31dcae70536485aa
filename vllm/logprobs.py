"""Logprob types users read from `CompletionOutput.logprobs` and `RequestOutput.prompt_logprobs`.

Shapes follow vLLM's: one dict per position, token id -> `Logprob`, holding the
sampled (or prompt) token and the top-k alternatives. Prompt logprobs start
with `None` for the first prompt token, which has no context to be scored in.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log probability of one token at one position.

    Attributes:
        logprob: natural-log probability under the model's raw distribution
            (before penalties, temperature and truncation, vLLM's default).
        rank: 1-based rank of the token in the vocabulary at this position
            (the number of tokens at least as likely), or None if unknown.
        decoded_token: the token's text, or None when not detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None.
PromptLogprobs = list[dict[int, Logprob] | None]


def make_logprobs_dict(
    token_ids: list[int],
    logprobs: list[float],
    rank: int,
    decoded_tokens: list[str | None] | None = None,
) -> dict[int, Logprob]:
    """One position's dict from a `LogprobsLists` row.

    Args:
        token_ids: [k+1]; entry 0 is the sampled / prompt token, 1..k the top-k
            in descending order.
        logprobs: [k+1] matching logprobs.
        rank: rank of entry 0 in the vocabulary (1-based).
        decoded_tokens: [k+1] texts, or None.

    Returns:
        token id -> Logprob; entry 0 carries `rank`, top-k entry i carries
        rank i. When the sampled token is also in the top-k it appears once,
        as entry 0.
    """
    if len(token_ids) != len(logprobs):
        raise ValueError(
            f"token_ids ({len(token_ids)}) and logprobs ({len(logprobs)}) differ in length"
        )
    texts = decoded_tokens if decoded_tokens is not None else [None] * len(token_ids)
    # The sampled token first, then the top-k in order, as vLLM presents them.
    out = {token_ids[0]: Logprob(logprobs[0], rank, texts[0])}
    for i in range(1, len(token_ids)):
        out.setdefault(token_ids[i], Logprob(logprobs[i], i, texts[i]))
    return out

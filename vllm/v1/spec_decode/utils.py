"""Which requests speculative decoding serves (torch-free)."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import _SAMPLING_EPS


def is_spec_decode_unsupported(params: Any) -> bool:
    """True for a request that decodes one token a step even with speculation on.

    As vLLM: penalties, min-p and logprobs are not applied by the verification
    (they depend on each accepted token in turn, or would need per-position
    logprobs), so such requests get no drafts rather than different outputs.
    logit_bias, an active min_tokens, allowed_token_ids and bad_words are excluded
    for the same reason.
    """
    return (
        params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.repetition_penalty != 1.0
        or params.min_p > _SAMPLING_EPS
        or params.logprobs is not None
        or bool(params.logit_bias)
        or params.min_tokens > 0
        or params.allowed_token_ids is not None
        or bool(params.bad_words)
    )

"""The scheduler's rules for drafts: which go into a step, how rejected ones roll back.

    schedule()            a decoding request with drafts (`Request.spec_token_ids`)
                          is scheduled for 1 + len(drafts_to_verify(...)) tokens,
                          the drafts cut to the budget, max_model_len and max_tokens
    update_from_output()  1 + k tokens computed, a + 1 emitted: settle_drafts moves
                          num_computed_tokens back by k - a, so the rejected
                          drafts' KV slots are rewritten next step, and counts them

Torch-free functions of the request (no state of their own); the runner
proposes and verifies (`vllm/v1/worker/spec_decode.py`).
"""

from __future__ import annotations

from vllm.v1.request import Request
from vllm.v1.spec_decode.metrics import SpecDecodingStats


def drafts_to_verify(
    request: Request, to_compute: int, budget: int, max_model_len: int
) -> list[int]:
    """The request's drafts that fit this step (a decode only; [] otherwise).

    Capped by the token budget (after the request's own token), by
    max_model_len (no position past it) and by max_tokens (a draft whose
    acceptance would exceed it is wasted work, and its KV slot was never
    promised by `Scheduler._check_fits_cache`).
    """
    drafts = request.spec_token_ids
    if not drafts or to_compute != 1:
        return []
    room = min(budget - 1, max_model_len - request.num_tokens)
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - request.num_output_tokens - 1)
    return drafts[: max(room, 0)]


def settle_drafts(
    request: Request, spec: dict[str, list[int]], sampled: list[int],
    stats: SpecDecodingStats | None,
) -> None:
    """Roll num_computed_tokens back past the rejected drafts; count the verification.

    A verify step computed 1 + k tokens and yields a + 1 (a accepted
    drafts plus the target's own): the KV slots of the k - a rejected
    drafts are overwritten next step.
    """
    request.spec_token_ids = []
    drafts = spec.get(request.request_id)
    if not drafts or not sampled:
        return
    num_accepted = len(sampled) - 1
    request.num_computed_tokens -= len(drafts) - num_accepted
    if stats is not None:
        stats.observe_draft(len(drafts), num_accepted)

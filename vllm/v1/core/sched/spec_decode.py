"""The scheduler side of speculative decoding: drafts in a step, rejected ones rolled back.

    schedule()            a decoding request with drafts (`Request.spec_token_ids`)
                          is scheduled for 1 + len(drafts) tokens, the drafts cut
                          to the budget, max_model_len and max_tokens
    update_from_output()  1 + k tokens computed, a + 1 emitted: num_computed_tokens
                          goes back by k - a, so the rejected drafts' KV slots are
                          rewritten next step; `SpecDecodingStats` counts them

Torch-free; the runner proposes and verifies (`vllm/v1/worker/spec_decode.py`).
"""

from __future__ import annotations

from vllm.v1.request import Request


class SpecDecodeSchedulerMixin:
    """The Scheduler's draft handling.

    Expects the Scheduler's `max_model_len` and `spec_decoding_stats`.
    """

    def _drafts_to_verify(self, request: Request, to_compute: int, budget: int) -> list[int]:
        """The request's drafts that fit this step (a decode only; [] otherwise).

        Capped by the token budget (after the request's own token), by
        max_model_len (no position past it) and by max_tokens (a draft whose
        acceptance would exceed it is wasted work, and its KV slot was never
        promised by `Scheduler._check_fits_cache`).
        """
        drafts = request.spec_token_ids
        if not drafts or to_compute != 1:
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def _settle_drafts(
        self, request: Request, spec: dict[str, list[int]], sampled: list[int]
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
        self.spec_decoding_stats.observe_draft(len(drafts), num_accepted)


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
from vllm.v1.spec_decode.utils import is_spec_decode_unsupported


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


# A draft the runner proposes on the device (async scheduling): unknown here.
DRAFT_PLACEHOLDER = -1


def spec_capable(request: Request) -> bool:
    """Whether the request takes drafts: sampling the verification serves
    (`is_spec_decode_unsupported`), no grammar (its bitmask is per draft, on the host)."""
    return request.grammar is None and not is_spec_decode_unsupported(request.sampling_params)


class SpecDecodeScheduling:
    """The scheduler's draft bookkeeping, synchronous or async.

    Synchronous: a decoding request's drafts are known (`Request.spec_token_ids`,
    proposed by the runner from the last step's tokens): `drafts_to_verify`.
    Async scheduling: the runner proposes on the device; a decoding request that
    takes drafts is scheduled for 1 + k' tokens with k' placeholder drafts
    (`DRAFT_PLACEHOLDER`) before the last step's acceptance is known, k' cut as if
    every draft in flight were accepted. `settle` corrects when the step's tokens
    arrive (docs/design.md, "Speculative decoding and async scheduling").

    Args:
        num_speculative_tokens: k.
        async_scheduling: whether drafts are the runner's device placeholders.
        max_model_len: longest sequence.

    `stats`: the cumulative counters of verifications (None without speculation).
    """

    def __init__(self, num_speculative_tokens: int, async_scheduling: bool,
                 max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.async_drafts = async_scheduling and num_speculative_tokens > 0
        self.max_model_len = max_model_len
        self.stats = SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens else None

    def drafts(self, request: Request, to_compute: int, budget: int) -> list[int] | None:
        """The drafts to schedule after the request's token, or None (no entry in the step's
        `scheduled_spec_decode_tokens`). Async: placeholders, possibly none, for every
        decoding request that takes drafts (the runner's device rows)."""
        if not self.async_drafts:
            return drafts_to_verify(request, to_compute, budget, self.max_model_len) or None
        if (to_compute != 1 or request.num_computed_tokens < request.num_prompt_tokens
                or not spec_capable(request)):
            return None
        in_flight = request.num_output_placeholders
        room = min(budget - 1, self.max_model_len - request.num_tokens - in_flight)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - in_flight - 1)
        return [DRAFT_PLACEHOLDER] * max(min(self.k, room), 0)

    def settle(self, request: Request, spec: dict[str, list[int]], sampled: list[int],
               num_drafts: int | None, preempted: bool) -> None:
        """A step's tokens arrived: drop its placeholders, roll back past rejected drafts,
        count the verification.

        Args:
            spec: the step's scheduled drafts by request id.
            sampled: the request's 0..k' + 1 tokens of the step.
            num_drafts: the drafts the runner really verified (async: <= k'), None: all.
            preempted: the request was preempted after the step was scheduled (its
                counts were reset: nothing to roll back).
        """
        drafts = spec.get(request.request_id)
        scheduled = len(sampled) if drafts is None or not sampled else 1 + len(drafts)
        request.num_output_placeholders = max(0, request.num_output_placeholders - scheduled)
        if preempted:
            request.spec_token_ids = []
            return
        settle_drafts(request, spec, sampled, None)
        verified = len(drafts or ()) if num_drafts is None else num_drafts
        if self.stats is not None and verified and sampled:
            self.stats.observe_draft(verified, len(sampled) - 1)

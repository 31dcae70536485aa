"""Stop checks applied to every sampled token (torch-free).

Stop *strings* are not checked here: they need detokenized text, so the
engine's detokenizer checks them and calls `Scheduler.finish_requests(...,
RequestStatus.FINISHED_STOPPED)`.
"""

from __future__ import annotations

from vllm.v1.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether `request` stops after its last appended output token.

    Order (as in vLLM): while fewer than `min_tokens` outputs exist, EOS and
    stop token ids do not count; then EOS (unless `ignore_eos`) and
    `stop_token_ids` finish with STOP (a stop token id is recorded as
    `stop_reason`; EOS leaves it None); then `max_tokens` outputs or
    `max_model_len` total tokens finish with LENGTH. The length limits apply
    even before `min_tokens` is reached: the sequence cannot grow past
    `max_model_len` (SamplingParams guarantees min_tokens <= max_tokens).

    Sets `request.status` (and `stop_reason`) when it returns True.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in (params.stop_token_ids or ()):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if request.num_tokens >= max_model_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False

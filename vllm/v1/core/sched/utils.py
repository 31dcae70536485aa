"""The scheduler's per-request checks (torch-free): admission and stopping.

    check_prompt       a new request's prompt: not empty, within max_model_len
    check_fits_cache   its longest possible sequence fits the cache's blocks
    check_stop         after every sampled token: EOS, stop ids, lengths

Stop *strings* are not checked here: they need detokenized text, so the
engine's detokenizer checks them and calls `Scheduler.finish_requests(...,
RequestStatus.FINISHED_STOPPED)`.
"""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.v1.request import Request, RequestStatus


def check_prompt(request: Request, max_model_len: int) -> None:
    """Raise unless the prompt is non-empty and at most `max_model_len` tokens.

    Raises:
        VLLMValidationError (parameter "prompt"): naming the numbers.
    """
    if request.num_prompt_tokens == 0:
        raise VLLMValidationError(
            f"request {request.request_id!r} has an empty prompt", parameter="prompt"
        )
    if request.num_prompt_tokens > max_model_len:
        raise VLLMValidationError(
            f"the prompt of request {request.request_id!r} is "
            f"{request.num_prompt_tokens} tokens long, longer than the maximum model "
            f"length max_model_len={max_model_len}",
            parameter="prompt",
        )


def check_fits_cache(request: Request, num_blocks: int, block_size: int, max_model_len: int,
                     num_lookahead_tokens: int = 0) -> None:
    """Raise unless the request's longest possible sequence fits `num_blocks`.

    KV slots are needed for every token but the last one sampled: a
    request stopping at L tokens needs max(prompt, L - 1) slots, with L =
    min(prompt + max_tokens, max_model_len), plus the lookahead slots of
    speculative decoding.

    Raises:
        VLLMValidationError (parameter "max_tokens"): naming the blocks needed
            and the blocks the cache has.
    """
    max_len = max_model_len
    if request.max_tokens is not None:
        max_len = min(request.num_prompt_tokens + request.max_tokens, max_len)
    num_slots = min(max(request.num_prompt_tokens, max_len - 1) + num_lookahead_tokens,
                    max_model_len)
    blocks_needed = -(-num_slots // block_size)
    usable = num_blocks - 1
    if blocks_needed > usable:
        raise VLLMValidationError(
            f"request {request.request_id!r} can never fit in the KV cache: its "
            f"{request.num_prompt_tokens} prompt tokens and up to {max_len} tokens in total "
            f"need {blocks_needed} blocks of {block_size} tokens, but the cache has "
            f"only {usable} usable blocks (num_blocks={num_blocks}, block 0 is reserved); "
            "lower max_tokens or max_model_len, or give the KV cache more memory",
            parameter="max_tokens",
        )


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


def check_positive(**values: int) -> None:
    """Raise ValueError naming the first value below 1."""
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")

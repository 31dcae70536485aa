"""Per-step statistics the frontends turn into metrics (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IterationStats:
    """What one engine step produced, measured in the frontend.

    Times are seconds (time.monotonic differences).
    """

    num_prompt_tokens: int = 0  # prompt tokens of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e_latencies: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request's phases (vLLM's meanings), seconds, and token counts.

    queue: arrival -> first scheduled; prefill: first scheduled -> first token;
    decode: first token -> last token; inference: first scheduled -> last token.
    """

    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float
    prefill_time: float
    decode_time: float
    inference_time: float


@dataclass
class RequestTimes:
    """time.monotonic() stamps of one request, seconds."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None

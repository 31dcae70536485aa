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


@dataclass
class RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None

"""Stat loggers: receive the engine's statistics after every step (torch-free).

`AsyncLLM`'s output handler (v1/engine/output_stream.py) calls `record()` on
the event loop for every batch from the engine core (a step's, with its
`IterationStats`; start-up's and a new logger's first, with None), and `log()`
periodically. The Prometheus logger of the OpenAI server lives in
`vllm/entrypoints/openai/metrics.py`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.sched.stats import SchedulerStats
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.outputs import KVCacheMemory
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

logger = init_logger(__name__)


class StatLoggerBase(Protocol):
    """Receives engine statistics on the event loop (must be thread-safe to read elsewhere)."""

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None,
        kv_cache_memory: KVCacheMemory | None,
    ) -> None:
        """For every engine core batch (a step's IterationStats) and at start (None)."""

    def log(self) -> None:
        """Periodically (every 10 s in AsyncLLM), on the event loop."""


class LoggingStatLogger:
    """The periodic "Avg prompt throughput ..." line, when the engine did something.

    Prompt throughput counts prompt tokens as steps compute them (the scheduler's
    cumulative `num_prefill_tokens`), so a long chunked prefill shows as it runs,
    not only when its first token comes out.
    """

    def __init__(self) -> None:
        self._prefill_tokens_at_last_log = 0
        self._num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._scheduler_stats: SchedulerStats | None = None
        self._was_idle = True
        self.spec_decoding_logging = SpecDecodingLogging()

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None,
        kv_cache_memory: KVCacheMemory | None,
    ) -> None:
        self._scheduler_stats = scheduler_stats
        if iteration_stats is not None:
            self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        s = self._scheduler_stats
        prefill_total = self._prefill_tokens_at_last_log if s is None else s.num_prefill_tokens
        num_prompt_tokens = max(prefill_total - self._prefill_tokens_at_last_log, 0)
        idle = (num_prompt_tokens == 0 and self._num_generation_tokens == 0
                and (s is None or s.num_running_reqs + s.num_waiting_reqs == 0))
        if not (idle and self._was_idle) and s is not None:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage * 100,
                s.prefix_cache_hit_rate * 100,
            )
        if s is not None and s.spec_decoding_stats is not None:
            self.spec_decoding_logging.log(s.spec_decoding_stats, elapsed)
        self._was_idle = idle
        self._prefill_tokens_at_last_log = prefill_total
        self._num_generation_tokens = 0
        self._last_time = now


class SpecDecodingLogging:
    """vLLM's periodic "SpecDecoding metrics: ..." line, over the drafts since the last one.

    Mean acceptance length counts the target's own token: 1 + accepted / drafts.
    Nothing is logged for an interval without drafts.
    """

    def __init__(self) -> None:
        self._last: SpecDecodingStats | None = None

    def log(self, stats: SpecDecodingStats, elapsed: float) -> str | None:
        """Log (and return) the line for the counts since the previous call."""
        delta = stats.minus(self._last)
        self._last = stats.copy()
        if delta.num_drafts == 0:
            return None
        per_pos = ", ".join(
            f"{a / delta.num_drafts:.3f}" for a in delta.num_accepted_tokens_per_pos
        )
        line = (
            f"SpecDecoding metrics: Mean acceptance length: {delta.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {delta.num_accepted_tokens / elapsed:.2f} tokens/s, "
            f"Drafted throughput: {delta.num_draft_tokens / elapsed:.2f} tokens/s, "
            f"Accepted: {delta.num_accepted_tokens} tokens, "
            f"Drafted: {delta.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {per_pos}, "
            f"Avg Draft acceptance rate: {delta.acceptance_rate * 100:.1f}%"
        )
        logger.info("%s", line)
        return line

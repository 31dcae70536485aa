"""Stat loggers: receive the engine's statistics after every step (torch-free).

`AsyncLLM` calls `record()` on the engine thread after every step (with that
step's `IterationStats`) and after processing commands (with None), and
`log()` periodically. The Prometheus logger of the OpenAI server lives in
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

logger = init_logger(__name__)


class StatLoggerBase(Protocol):
    """Receives engine statistics on the engine thread (must be thread-safe to read elsewhere)."""

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None,
        kv_cache_memory: KVCacheMemory | None,
    ) -> None:
        """After every step (with that step's IterationStats) and after commands (None)."""

    def log(self) -> None:
        """Periodically (every 10 s in AsyncLLM), on the engine thread."""


class LoggingStatLogger:
    """The periodic "Avg prompt throughput ..." line, when the engine did something."""

    def __init__(self) -> None:
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._last_time = time.monotonic()
        self._scheduler_stats: SchedulerStats | None = None
        self._was_idle = True

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None,
        kv_cache_memory: KVCacheMemory | None,
    ) -> None:
        self._scheduler_stats = scheduler_stats
        if iteration_stats is not None:
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_time, 1e-9)
        s = self._scheduler_stats
        idle = (self._num_prompt_tokens == 0 and self._num_generation_tokens == 0
                and (s is None or s.num_running_reqs + s.num_waiting_reqs == 0))
        if not (idle and self._was_idle) and s is not None:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
                s.num_running_reqs, s.num_waiting_reqs, s.kv_cache_usage * 100,
                s.prefix_cache_hit_rate * 100,
            )
        self._was_idle = idle
        self._num_prompt_tokens = self._num_generation_tokens = 0
        self._last_time = now

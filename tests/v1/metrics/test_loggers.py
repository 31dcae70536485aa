"""The periodic stats line (LoggingStatLogger), fed the engine's statistics by hand."""

from __future__ import annotations

import logging
import re

from vllm.v1.core.sched.stats import SchedulerStats
from vllm.v1.metrics.loggers import LoggingStatLogger
from vllm.v1.metrics.stats import IterationStats


def _prompt_throughput(caplog) -> list[float]:
    return [float(m.group(1)) for r in caplog.records
            if (m := re.search(r"Avg prompt throughput: ([\d.]+) tokens/s", r.getMessage()))]


def test_prompt_throughput_counts_a_long_prefill_while_it_runs(caplog):
    """Steps of a chunked prefill that has produced no token yet: the line shows their
    prompt tokens per second (before, it said 0.0 until the first token came out)."""
    caplog.set_level(logging.INFO, logger="vllm")
    stat_logger = LoggingStatLogger()
    for prefilled in (512, 1024, 1536):
        stat_logger.record(SchedulerStats(num_running_reqs=1, num_prefill_tokens=prefilled),
                           IterationStats(), None)
    stat_logger.log()
    (first,) = _prompt_throughput(caplog)
    assert first > 0
    # Only the tokens since the last line count: 512 more, and none in a quiet period.
    stat_logger.record(SchedulerStats(num_running_reqs=1, num_prefill_tokens=2048),
                       IterationStats(num_generation_tokens=1), None)
    stat_logger.log()
    stat_logger.record(SchedulerStats(num_running_reqs=1, num_prefill_tokens=2048),
                       IterationStats(num_generation_tokens=1), None)
    stat_logger.log()
    rates = _prompt_throughput(caplog)
    assert len(rates) == 3 and rates[1] > 0 and rates[2] == 0.0

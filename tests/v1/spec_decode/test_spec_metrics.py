"""vllm:spec_decode_* Prometheus counters and the SpecDecoding metrics log line."""

import logging

from vllm.entrypoints.openai.metrics import PrometheusStatLogger
from vllm.v1.core.sched.stats import SchedulerStats
from vllm.v1.metrics.loggers import LoggingStatLogger
from vllm.v1.spec_decode.metrics import SpecDecodingStats


def _value(text: str, name: str, extra: str = "") -> float:
    prefix = f'{name}{{model_name="m"{extra}}} '
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (prefix, text)
    return float(lines[0][len(prefix):])


def test_prometheus_counters_follow_cumulative_stats():
    logger = PrometheusStatLogger("m")
    spec = SpecDecodingStats(num_spec_tokens=3)
    spec.observe_draft(3, 2)
    logger.record(SchedulerStats(spec_decoding_stats=spec.copy()), None, None)
    spec.observe_draft(3, 3)
    spec.observe_draft(1, 0)
    logger.record(SchedulerStats(spec_decoding_stats=spec.copy()), None, None)
    logger.record(SchedulerStats(spec_decoding_stats=spec.copy()), None, None)  # no change
    text = logger.render().decode()
    assert _value(text, "vllm:spec_decode_num_drafts_total") == 3
    assert _value(text, "vllm:spec_decode_num_draft_tokens_total") == 7
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [
        _value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", f',position="{i}"')
        for i in range(3)
    ]
    assert per_pos == [2, 2, 1]


def test_no_spec_metrics_without_speculation():
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(), None, None)
    assert "spec_decode" not in logger.render().decode()


def test_log_line_covers_the_interval(caplog):
    stat_logger = LoggingStatLogger()
    spec = SpecDecodingStats(num_spec_tokens=2)
    spec.observe_draft(2, 2)
    spec.observe_draft(2, 1)
    stat_logger.record(SchedulerStats(num_running_reqs=1, spec_decoding_stats=spec.copy()),
                       None, None)
    with caplog.at_level(logging.INFO):
        stat_logger.log()
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    assert len(lines) == 1
    assert "Mean acceptance length: 2.50" in lines[0]
    assert "Accepted: 3 tokens, Drafted: 4 tokens" in lines[0]
    assert "Per-position acceptance rate: 1.000, 0.500" in lines[0]
    assert "Avg Draft acceptance rate: 75.0%" in lines[0]
    # The next interval had one draft, none accepted: the line says so, not the totals.
    spec.observe_draft(2, 0)
    line = stat_logger.spec_decoding_logging.log(spec.copy(), 1.0)
    assert "Mean acceptance length: 1.00" in line and "Drafted: 2 tokens" in line

"""Prometheus metrics of the server: vLLM's metric names plus the KV cache's memory.

One `CollectorRegistry` per app (two servers in one process, or a test that
builds several apps, never collide). `PrometheusStatLogger.record` runs on the
engine thread after every step; prometheus-client's metrics are thread-safe,
and `/metrics` renders the registry on the event loop.

Counters whose source is cumulative in `SchedulerStats` (preemptions, prefix
cache hits / queries, speculative-decoding drafts and acceptances) are
advanced by the difference since the last record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.stats import SchedulerStats
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.outputs import KVCacheMemory
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger"]

# Bucket bounds in seconds. TTFT spans a decode-size prefill on an idle GPU
# (~ms) to a long queue on a small CPU (minutes); ITL is one decode step.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                 60.0, 120.0, 300.0, 600.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.075, 0.1, 0.2, 0.4, 0.75, 1.0, 2.5,
                5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0,
                600.0, 1800.0, 3600.0)


class PrometheusStatLogger:
    """Feeds the engine's per-step statistics into a per-app Prometheus registry.

    Args:
        model_name: the `model_name` label (the first served model name).
        registry: where the metrics live; a new one when None.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage: fraction of usable blocks held, 0-1.")
        self.kv_cache_committed_bytes = gauge(
            "vllm:kv_cache_committed_bytes",
            "KV cache bytes backed by physical memory (committed pages).")
        self.kv_cache_reserved_bytes = gauge(
            "vllm:kv_cache_reserved_bytes",
            "KV cache virtual address space reserved, bytes (= committed on the classic path).")
        self.kv_cache_num_blocks = gauge(
            "vllm:kv_cache_num_blocks", "KV cache blocks in the pool (including the null block).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("vllm:num_preemptions", "Preemptions (by recompute).")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Tokens served from the prefix cache.")
        self._request_success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between two output tokens, seconds.",
            _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token, seconds.", _E2E_BUCKETS)
        # Cumulative scheduler figures seen at the previous record.
        self._last_preemptions = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._spec: SpecDecodingProm | None = None  # created with the first spec stats

    def record(
        self,
        scheduler_stats: SchedulerStats,
        iteration_stats: IterationStats | None,
        kv_cache_memory: KVCacheMemory | None,
    ) -> None:
        s = scheduler_stats
        self.num_requests_running.set(s.num_running_reqs)
        self.num_requests_waiting.set(s.num_waiting_reqs)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self._last_preemptions = _advance(self.num_preemptions, s.num_preemptions,
                                          self._last_preemptions)
        self._last_prefix_queries = _advance(self.prefix_cache_queries, s.prefix_cache_queries,
                                             self._last_prefix_queries)
        self._last_prefix_hits = _advance(self.prefix_cache_hits, s.prefix_cache_hits,
                                          self._last_prefix_hits)
        if kv_cache_memory is not None:
            self.kv_cache_committed_bytes.set(kv_cache_memory.committed_bytes)
            self.kv_cache_reserved_bytes.set(kv_cache_memory.reserved_bytes)
            self.kv_cache_num_blocks.set(kv_cache_memory.num_blocks)
        else:
            self.kv_cache_num_blocks.set(s.num_blocks)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)
        if s.spec_decoding_stats is not None:
            if self._spec is None:
                self._spec = SpecDecodingProm(self.registry, self._model_name,
                                              s.spec_decoding_stats.num_spec_tokens)
            self._spec.record(s.spec_decoding_stats)

    def _record_iteration(self, it: IterationStats) -> None:
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.time_to_first_token.observe(value)
        for value in it.inter_token_latencies:
            self.inter_token_latency.observe(value)
        for value in it.e2e_latencies:
            self.e2e_request_latency.observe(value)
        for reason in it.finished_reasons:
            self._request_success.labels(self._model_name, reason).inc()

    def log(self) -> None:
        """Nothing to log: Prometheus scrapes `/metrics`."""

    def render(self) -> bytes:
        """The registry in the Prometheus text format (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)


class SpecDecodingProm:
    """vLLM's `vllm:spec_decode_*` counters, fed from cumulative `SpecDecodingStats`.

    Exposed as `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
    `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total`
    (label `position`, 0 = the first draft).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, num_spec_tokens: int) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Draft verifications.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.")
        self.num_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Accepted draft tokens.")
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens, by position in the draft.",
            ["model_name", "position"], registry=registry)
        self.per_pos = [per_pos.labels(model_name, str(i)) for i in range(num_spec_tokens)]
        self._last: SpecDecodingStats | None = None

    def record(self, stats: SpecDecodingStats) -> None:
        delta = stats.minus(self._last)
        for counter, value in ((self.num_drafts, delta.num_drafts),
                               (self.num_draft_tokens, delta.num_draft_tokens),
                               (self.num_accepted_tokens, delta.num_accepted_tokens),
                               *zip(self.per_pos, delta.num_accepted_tokens_per_pos, strict=True)):
            if value > 0:
                counter.inc(value)
        self._last = stats.copy()


def _advance(counter: Counter, total: int, last: int) -> int:
    """Move `counter` to a cumulative `total`; a total that went down (reset) restarts."""
    delta = total - last if total >= last else total
    if delta > 0:
        counter.inc(delta)
    return total

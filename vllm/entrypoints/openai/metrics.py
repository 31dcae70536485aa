"""Prometheus metrics of the server: vLLM's metric names plus the KV cache's memory.

One `CollectorRegistry` per app (two servers in one process, or a test that
builds several apps, never collide). `PrometheusStatLogger.record` runs on the
engine thread after every step; prometheus-client's metrics are thread-safe,
and `/metrics` renders the registry on the event loop.

Counters whose source is cumulative in `SchedulerStats` (preemptions, prefix
cache hits / queries) are advanced by the difference since the last record.
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
        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "Tokens looked up by the KV connector (beyond the local prefix-cache hit).")
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "Tokens loaded by the KV connector (host offload or another instance).")
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
            ["model_name", "source"], registry=r)
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
        self._last_external: dict[str, int] = {}

    def _record_external(self, s: SchedulerStats) -> None:
        """KV connector counters and prompt tokens by source (cumulative in the scheduler)."""
        last = self._last_external
        pairs = [("q", self.external_prefix_cache_queries, s.external_prefix_cache_queries),
                 ("h", self.external_prefix_cache_hits, s.external_prefix_cache_hits)]
        for source, value in s.prompt_tokens_by_source.items():
            child = self.prompt_tokens_by_source.labels(model_name=self._model_name, source=source)
            pairs.append((source, child, value))
        for key, metric, value in pairs:
            last[key] = _advance(metric, value, last.get(key, 0))

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
        self._record_external(s)
        if kv_cache_memory is not None:
            self.kv_cache_committed_bytes.set(kv_cache_memory.committed_bytes)
            self.kv_cache_reserved_bytes.set(kv_cache_memory.reserved_bytes)
            self.kv_cache_num_blocks.set(kv_cache_memory.num_blocks)
        else:
            self.kv_cache_num_blocks.set(s.num_blocks)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)

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


def _advance(counter: Counter, total: int, last: int) -> int:
    """Move `counter` to a cumulative `total`; a total that went down (reset) restarts."""
    delta = total - last if total >= last else total
    if delta > 0:
        counter.inc(delta)
    return total

"""Prometheus metrics of the server: vLLM's metric names plus the KV cache's memory.

One `CollectorRegistry` per app (two servers in one process, or a test that
builds several apps, never collide). `PrometheusStatLogger.record` runs on the
event loop (AsyncLLM's output handler) for every batch from the engine core,
and `/metrics` renders the registry there too.

Counters whose source is cumulative in `SchedulerStats` (preemptions, prefix
cache hits / queries, KV connector hits, speculative-decoding drafts and
acceptances) are advanced by the difference since the last record.

Names, meanings and histogram buckets are vLLM's (vllm/v1/metrics/loggers.py),
so its Grafana dashboard and users' alerts read this server unchanged; the
registry also carries prometheus-client's `process_*` and `python_*` collectors,
as vLLM's default registry does. Our own additions: `vllm:kv_cache_committed_bytes`,
`vllm:kv_cache_reserved_bytes`, `vllm:kv_cache_physical_bytes`, `vllm:kv_cache_num_blocks`
(examples/grafana/ draws them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

if TYPE_CHECKING:
    from vllm.v1.core.sched.stats import SchedulerStats
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.outputs import KVCacheMemory
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

__all__ = ["CONTENT_TYPE_LATEST", "PrometheusStatLogger", "cache_config_info"]

# vLLM's bucket bounds (seconds), so histogram_quantile over a scrape of this server
# and of vLLM compare bucket for bucket.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
# End-to-end latency and the request phases (queue, prefill, decode, inference).
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens one engine step computed (vLLM's, spanning its CUDA graph batch sizes).
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets).

    >>> build_1_2_5_buckets(100)
    [1, 2, 5, 10, 20, 50, 100]
    """
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def _new_registry() -> CollectorRegistry:
    """A registry with what vLLM's default registry shows besides vllm:*: process_*
    (CPU, memory, fds) and python_* (GC, version); each collector belongs to one registry."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class _LabelledMetrics:
    """Creates metrics in one registry with the `model_name` label, bound to one model."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)


class PrometheusStatLogger:
    """Feeds the engine's per-step statistics into a per-app Prometheus registry.

    Args:
        model_name: the `model_name` label (the first served model name).
        registry: where the metrics live; a new one (with the process and
            Python collectors) when None.
        max_model_len: the top of the per-request token histograms' buckets.
        cache_config_info: the `vllm:cache_config_info` labels (CacheConfig's
            fields as strings); the gauge is absent when None.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 max_model_len: int = 8192,
                 cache_config_info: dict[str, str] | None = None) -> None:
        self.registry = registry if registry is not None else _new_registry()
        self._model_name = model_name
        # Created in this order, which is the order of /metrics' text.
        make = _LabelledMetrics(self.registry, model_name)
        self._add_state_metrics(make)
        self._add_token_counters(make)
        self._add_latency_histograms(make)
        self._add_request_histograms(make, max_model_len)
        if cache_config_info is not None:
            info = Gauge("vllm:cache_config_info", "Information of the engine's CacheConfig.",
                         sorted(cache_config_info), registry=self.registry)
            info.labels(**cache_config_info).set(1)
        # Cumulative scheduler figures seen at the previous record.
        self._last_preemptions = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._last_external: dict[str, int] = {}
        self._spec: SpecDecodingProm | None = None  # created with the first spec stats
        self._last_grows = 0
        self._last_shrinks = 0
        self._last_reclaims = 0

    def _add_state_metrics(self, make: _LabelledMetrics) -> None:
        """The batch and the KV cache as they are now (gauges), and the elastic cache's
        grows and shrinks."""
        self.num_requests_running = make.gauge(
            "vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = make.gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = make.gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage: fraction of usable blocks held, 0-1.")
        self.num_requests_waiting_for_remote_kvs = make.gauge(
            "vllm:num_requests_waiting_for_remote_kvs",
            "Waiting requests whose KV a connector loads in the background (included in "
            "vllm:num_requests_waiting).")
        self.kv_transfer_held_blocks = make.gauge(
            "vllm:kv_transfer_held_blocks",
            "KV blocks of finished requests held for a KV transfer (a prefill instance's "
            "blocks until a decode instance read them).")
        self.kv_cache_committed_bytes = make.gauge(
            "vllm:kv_cache_committed_bytes",
            "KV cache bytes of the committed blocks (blocks x bytes per block), the unit of "
            "vllm:kv_cache_limit_bytes, in_use_bytes and reclaimable_bytes and of vllm kv-top; "
            "the device holds them in whole granules: vllm:kv_cache_physical_bytes.")
        self.kv_cache_physical_bytes = make.gauge(
            "vllm:kv_cache_physical_bytes",
            "KV cache device memory backing the committed blocks, bytes: whole VMM granules "
            "(2 MiB on the H200) per segment, up to about one a segment above "
            "vllm:kv_cache_committed_bytes.")
        self.kv_cache_reserved_bytes = make.gauge(
            "vllm:kv_cache_reserved_bytes",
            "KV cache virtual address space reserved, bytes (= committed on the classic path).")
        self.kv_cache_num_blocks = make.gauge(
            "vllm:kv_cache_num_blocks", "KV cache blocks in the pool (including the null block).")
        self.kv_cache_elastic_grows = make.counter(
            "vllm:kv_cache_elastic_grows",
            "Times the elastic KV cache grew (more blocks) while serving.")
        self.kv_cache_elastic_shrinks = make.counter(
            "vllm:kv_cache_elastic_shrinks",
            "Times the elastic KV cache released memory (pieces above a boundary; blocks in "
            "use there moved below it first).")
        self.kv_cache_in_use_bytes = make.gauge(
            "vllm:kv_cache_in_use_bytes",
            "KV cache bytes of the blocks requests hold (blocks in use x bytes per block), "
            "with or without the elastic cache.")
        self.kv_cache_reclaimable_bytes = make.gauge(
            "vllm:kv_cache_reclaimable_bytes",
            "Elastic KV cache: bytes it could release now without preempting (whole pieces "
            "above its floor beyond what its requests use and its low-water mark); 0 for a "
            "fixed cache.")
        self.kv_cache_limit_bytes = make.gauge(
            "vllm:kv_cache_limit_bytes",
            "The most the KV cache may commit, bytes: the elastic cache's limit (POST "
            "/kv_cache/limit sets it); a fixed cache's own size (it cannot grow).")
        self.kv_cache_elastic_reclaims = make.counter(
            "vllm:kv_cache_elastic_reclaims",
            "Times the elastic KV cache released blocks because another engine on the device "
            "asked for memory.")

    def _add_token_counters(self, make: _LabelledMetrics) -> None:
        """Tokens processed, preemptions, prefix-cache and KV-connector lookups, and
        finished requests by reason."""
        self.prompt_tokens = make.counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = make.counter("vllm:generation_tokens", "Tokens generated.")
        self.num_preemptions = make.counter("vllm:num_preemptions", "Preemptions (by recompute).")
        self.prefix_cache_queries = make.counter(
            "vllm:prefix_cache_queries", "Tokens looked up in the prefix cache.")
        self.prefix_cache_hits = make.counter(
            "vllm:prefix_cache_hits", "Tokens served from the prefix cache.")
        self.external_prefix_cache_queries = make.counter(
            "vllm:external_prefix_cache_queries",
            "Tokens looked up by the KV connector (beyond the local prefix-cache hit).")
        self.external_prefix_cache_hits = make.counter(
            "vllm:external_prefix_cache_hits",
            "Tokens loaded by the KV connector (host offload or another instance).")
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
            ["model_name", "source"], registry=self.registry)
        self._request_success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        # Every finish reason exists from the start (0), as in vLLM, so dashboards and
        # alerts over it have a series before the first request finishes.
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(self._model_name, reason)

    def _add_latency_histograms(self, make: _LabelledMetrics) -> None:
        """Per-token and end-to-end latencies (seconds)."""
        self.time_to_first_token = make.histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = make.histogram(
            "vllm:inter_token_latency_seconds", "Time between two output tokens, seconds.",
            _ITL_BUCKETS)
        self.e2e_request_latency = make.histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        # vLLM's older name for the inter-token latency; the same observations.
        self.time_per_output_token = make.histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token (between two output tokens), seconds.", _ITL_BUCKETS)

    def _add_request_histograms(self, make: _LabelledMetrics, max_model_len: int) -> None:
        """Token counts of finished requests and engine steps, and each request's time
        in every phase (seconds)."""
        token_buckets = tuple(build_1_2_5_buckets(max_model_len))
        self.request_prompt_tokens = make.histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request.",
            token_buckets)
        self.request_generation_tokens = make.histogram(
            "vllm:request_generation_tokens", "Generated tokens of each finished request.",
            token_buckets)
        self.iteration_tokens = make.histogram(
            "vllm:iteration_tokens_total",
            "Tokens per engine step (prompt tokens of requests that got their first token "
            "plus generated tokens).", _ITERATION_TOKENS_BUCKETS)
        self.request_queue_time = make.histogram(
            "vllm:request_queue_time_seconds",
            "Time in the WAITING phase: arrival to first scheduled, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = make.histogram(
            "vllm:request_prefill_time_seconds",
            "Time in the PREFILL phase: first scheduled to first token, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = make.histogram(
            "vllm:request_decode_time_seconds",
            "Time in the DECODE phase: first token to last token, seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = make.histogram(
            "vllm:request_inference_time_seconds",
            "Time in the RUNNING phase: first scheduled to last token, seconds.",
            _REQUEST_LATENCY_BUCKETS)

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
        self.num_requests_waiting_for_remote_kvs.set(s.num_waiting_for_remote_kvs)
        self.kv_transfer_held_blocks.set(s.num_kv_transfer_held_blocks)
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
            self.kv_cache_physical_bytes.set(kv_cache_memory.physical_bytes)
            self.kv_cache_num_blocks.set(kv_cache_memory.num_blocks)
            self._last_grows = _advance(self.kv_cache_elastic_grows, kv_cache_memory.num_grows,
                                        self._last_grows)
            self._last_shrinks = _advance(self.kv_cache_elastic_shrinks,
                                          kv_cache_memory.num_shrinks, self._last_shrinks)
            self._last_reclaims = _advance(self.kv_cache_elastic_reclaims,
                                           kv_cache_memory.num_reclaims, self._last_reclaims)
            self.kv_cache_in_use_bytes.set(kv_cache_memory.in_use_bytes)
            self.kv_cache_reclaimable_bytes.set(kv_cache_memory.reclaimable_bytes)
            self.kv_cache_limit_bytes.set(kv_cache_memory.limit_bytes)
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
            self.time_per_output_token.observe(value)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for req in it.finished_requests:
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)
            self.request_queue_time.observe(req.queue_time)
            self.request_prefill_time.observe(req.prefill_time)
            self.request_decode_time.observe(req.decode_time)
            self.request_inference_time.observe(req.inference_time)
        for value in it.e2e_latencies:
            self.e2e_request_latency.observe(value)
        for reason in it.finished_reasons:
            self._request_success.labels(self._model_name, reason).inc()

    def log(self) -> None:
        """Nothing to log: Prometheus scrapes `/metrics`."""

    def render(self) -> bytes:
        """The registry in the Prometheus text format (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)


def cache_config_info(cache_config: Any, plan: Any = None) -> dict[str, str]:
    """`vllm:cache_config_info` labels: the CacheConfig's public fields as strings, with
    what the engine's `StartupPlan` resolved (the KV cache path, the utilization in
    force) where the user left a field to its default."""
    labels = {f.name: str(getattr(cache_config, f.name))
              for f in dataclasses.fields(cache_config) if not f.name.startswith("_")}
    if plan is not None:
        labels["enable_extensible_kv_cache"] = str(plan.extensible_kv_cache)
        labels["gpu_memory_utilization"] = str(plan.gpu_memory_utilization)
    return labels


class SpecDecodingProm:
    """vLLM's `vllm:spec_decode_*` counters, fed from cumulative `SpecDecodingStats`.

    Exposed as `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
    `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total`
    (label `position`, 0 = the first draft).
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, num_spec_tokens: int) -> None:
        counter = _LabelledMetrics(registry, model_name).counter
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

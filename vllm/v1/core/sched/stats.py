"""Scheduler figures for metrics and logging (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.spec_decode.metrics import SpecDecodingStats


@dataclass
class SchedulerStats:
    """A snapshot taken by `Scheduler.get_stats()`.

    Counts are requests; prefix-cache figures and num_prefill_tokens are
    tokens and, like num_preemptions, cumulative since the scheduler was created.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks held by requests, 0..1
    prefix_cache_queries: int = 0  # prompt(+output) tokens looked up at admission
    prefix_cache_hits: int = 0  # of which served from the prefix cache
    num_preemptions: int = 0
    # With a KV connector (tokens, cumulative): looked up beyond the local
    # prefix-cache hit, and of those loaded by the connector instead of computed.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Prompt tokens of first admissions by where their KV came from (vLLM's
    # prompt_tokens_by_source): "local_compute", "local_cache_hit", "external_kv_transfer".
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    num_blocks: int = 0  # KV cache blocks, including the null block
    # Cumulative draft / acceptance counts; None without speculative decoding.
    spec_decoding_stats: SpecDecodingStats | None = None
    # Prompt tokens scheduled for computing (chunk by chunk, recomputes after a preemption
    # included; prefix-cache hits excluded); the log line's "Avg prompt throughput".
    num_prefill_tokens: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

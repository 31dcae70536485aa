"""Scheduler figures for metrics and logging (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.spec_decode.metrics import SpecDecodingStats


@dataclass
class SchedulerStats:
    """A snapshot taken by `Scheduler.get_stats()`.

    Counts are requests; prefix-cache figures and num_prefill_tokens are
    tokens and, like num_preemptions, cumulative since the scheduler was created.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # WAITING_FOR_REMOTE_KVS included
    num_waiting_for_remote_kvs: int = 0  # waiting while a KV connector loads their KV
    # Blocks of finished requests a KV connector holds until a remote reader took
    # them (a prefill instance of 1P1D) or an aborted request's load ended.
    num_kv_transfer_held_blocks: int = 0
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

    @classmethod
    def of(cls, scheduler: Any) -> SchedulerStats:
        """The figures of `scheduler` (a `Scheduler`) now; reads only."""
        kv, connector = scheduler.kv_cache_manager, scheduler.connector
        spec = scheduler.spec_decoding_stats
        return cls(
            num_running_reqs=len(scheduler.running),
            num_waiting_reqs=len(scheduler.waiting),
            num_waiting_for_remote_kvs=len(connector.loading) if connector else 0,
            num_kv_transfer_held_blocks=connector.num_held_blocks() if connector else 0,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits,
            num_preemptions=scheduler.num_preemptions,
            num_blocks=kv.num_blocks,
            external_prefix_cache_queries=connector.external_queries if connector else 0,
            external_prefix_cache_hits=connector.external_hits if connector else 0,
            prompt_tokens_by_source=dict(scheduler.prompt_tokens_by_source),
            spec_decoding_stats=spec.copy() if spec else None,
            num_prefill_tokens=scheduler.num_prefill_tokens,
        )

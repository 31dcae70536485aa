"""`SchedulerConfig`: the per-step token budget and the most concurrent requests."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config.frozen import FrozenConfig

# Defaults when left unset: (max_num_seqs, max_num_batched_tokens) per device type.
# CUDA: vLLM V1's serving defaults (256 sequences; 8192 tokens, its API-server
# budget, also used for the offline LLM here so both size the cache alike).
# CPU: start-up runs two worst-case forwards of max_num_batched_tokens tokens
# (the memory profile and the warmup with the KV cache); on 2 cores 2048
# tokens of the 135M bundled model take ~6 s each, 512 take ~1.5 s, and
# chunked prefill keeps long prompts working at that budget. 64 sequences
# keep the sampler's warmup small while serving dozens of clients.
# `vllm serve --help` prints these numbers (EngineArgs.add_cli_args reads them).
DEFAULT_LIMITS = {"cuda": (256, 8192), "cpu": (64, 512)}
# Concurrent partial prefills (see v1/core/sched/partial_prefills.py). vLLM
# defaults to 1, with which a short request arriving during a long prefill waits
# for all of it (issue 17: 33.7 s for a chat behind a 4000-token prompt on the
# CPU). With 4, the prefills of a step share its budget, so the short prompt is
# admitted at once and samples its first token the next step; a prefill running
# alone still takes the whole budget. benchmarks/benchmark_prefill_ttft.py
# measures the TTFT with both.
DEFAULT_MAX_NUM_PARTIAL_PREFILLS = 4
# vLLM's --scheduling-policy choices (v1/core/sched/request_queue.py builds each).
SCHEDULING_POLICIES = ("fcfs", "priority")


def default_limits(device_type: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when unset, for "cuda" or "cpu" (others: cpu's)."""
    return DEFAULT_LIMITS.get(device_type, DEFAULT_LIMITS["cpu"])


def _check_positive_int(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class SchedulerConfig(FrozenConfig):
    """Scheduling limits.

    Attributes:
        max_num_seqs: most requests in one step; None = the device default
            (256 on CUDA, 64 on CPU).
        max_num_batched_tokens: tokens computed in one step (the budget shared
            by prefills and decodes); None = the device default (8192 on CUDA,
            512 on CPU), raised to max_num_seqs if that is larger, and to
            max_model_len when chunked prefill is off.
        enable_chunked_prefill: split long prompts across steps. When False
            the budget must hold a whole max_model_len prompt.
        max_num_partial_prefills: most requests mid-prefill at once; above 1
            the prefills of a step share its budget (vLLM's flag); None = 4
            (vLLM: 1), and 1 when chunked prefill is off.
        max_long_partial_prefills: most prompts longer than the threshold
            prefilled at once (<= max_num_partial_prefills).
        long_prefill_token_threshold: tokens; a longer prompt is long, and is
            computed at most this many tokens a step; 0 = 4 % of max_model_len
            counts as long (vLLM's rule), with no cap.
        max_model_len: copied from ModelConfig by `resolve` (not an argument
            users set).
        async_scheduling: schedule step N+1 while the device runs step N
            (vLLM's `--async-scheduling`; see v1/engine/README.md). None = on
            where it is correct and helps (CUDA-like device, uni executor, no
            speculative decoding); `VllmConfig` resolves it to a bool.
        policy: vLLM's `--scheduling-policy`: "fcfs" (arrival order) or "priority"
            (requests' `priority`, lower first, ties by arrival; the worst running
            request is preempted first); see v1/core/sched/request_queue.py.

    Raises:
        ValueError: limits < 1, an unknown policy, max_num_batched_tokens < max_num_seqs, or
            (chunked prefill off) max_num_batched_tokens < max_model_len.
    """

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    async_scheduling: bool | None = None
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("max_num_partial_prefills", self.max_num_partial_prefills)
        _check_positive_int("max_long_partial_prefills", self.max_long_partial_prefills)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        threshold = self.long_prefill_token_threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {threshold!r}")
        if self.max_num_partial_prefills is None:
            self.max_num_partial_prefills = (DEFAULT_MAX_NUM_PARTIAL_PREFILLS
                                             if self.enable_chunked_prefill else 1)
        if self.max_num_partial_prefills > 1 and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_partial_prefills={self.max_num_partial_prefills} needs chunked "
                "prefill, which is disabled"
            )
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )

    def resolve(self, max_model_len: int, device_type: str) -> None:
        """Fill the defaults for `device_type` ("cuda" or "cpu") and check the limits."""
        default_seqs, default_tokens = default_limits(device_type)
        self.max_model_len = max_model_len
        if self.max_num_seqs is None:
            self.max_num_seqs = default_seqs
        if self.max_num_batched_tokens is None:
            floor = self.max_num_seqs if self.enable_chunked_prefill else max(
                self.max_num_seqs, max_model_len
            )
            self.max_num_batched_tokens = max(default_tokens, floor)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token"
            )
        if self.max_num_partial_prefills > 1 and self.long_prefill_token_threshold > max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be <= "
                f"max_model_len ({max_model_len})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) with chunked prefill disabled: the longest "
                "prompt could never be scheduled; raise it or enable chunked prefill"
            )

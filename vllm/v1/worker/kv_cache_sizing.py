"""KV cache sizing arithmetic, from memory figures the worker measured.

Pure functions over plain ints (bytes), so every rule is tested from given
snapshots without a device. Two paths (DESIGN.md sections 4 and 5):

Classic (vLLM's): decided before warmup, from the profile alone.

    kv = utilization x total - (weights + activation peak + non-torch growth)

Extensible: decided after warmup and graph capture, from what is really free.

    physical = free now + KV bytes already committed
    cap      = utilization x total - what this process holds besides the KV cache
    budget   = min(physical, cap)
    buffer   = max(ACTIVATION_HEADROOM_FRACTION x activation peak, BUFFER_FLOOR_BYTES)
               + POST_WARMUP_FRACTION x budget
    kv       = budget - buffer

    |<------------------------------- total -------------------------------->|
    | others | context | weights | torch pool (act. peak, graphs) | KV | buf | free |
                                                                  ^ grows into here

Both results are turned into a whole number of blocks after granule rounding
by `num_blocks_for_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# After warmup the activation peak already sits in torch's caching allocator
# (reserved, not free), so only its variation needs headroom: batches whose
# shapes warmup did not see fragment the pool differently. 10 % of the
# profiled peak covers that with room to spare on the shapes measured by
# benchmarks/benchmark_kv_sizing.py (no OOM under the stress run).
ACTIVATION_HEADROOM_FRACTION = 0.10

# Absolute floor of that headroom: lazily created library state that no
# warmup shape triggers (cuBLAS/cuBLASLt workspaces of new GEMM shapes, a
# Triton kernel's first launch for a new specialisation, NCCL's buffers) is
# a few to tens of MiB each (torch's cuBLAS workspace is 32 MiB per
# handle); 128 MiB covers them together, under 0.1 % of an H200.
BUFFER_FLOOR_BYTES = 128 * MiB

# A share of the budget for allocations that appear only after warmup and
# grow with the engine's size (per-request host-device staging, logprob
# tensors, sampler temporaries for unusual parameter mixes). Every such
# allocation in this engine is bounded by a shape warmup already ran (prompt
# logprobs are computed in max_num_seqs-row slices), so the share is small on
# purpose: the point is to leave (almost) no idle HBM. 0.1 % of an H200 is
# ~0.14 GiB; the classic path leaves 8 % idle. Measured with
# benchmarks/benchmark_kv_sizing.py (8B shape, adversarial stress, no OOM).
POST_WARMUP_FRACTION = 0.001


class KVCacheSizingError(RuntimeError):
    """The device cannot hold the KV cache asked for (message has the numbers)."""


@dataclass(frozen=True)
class MemoryProfile:
    """What the worker measured before sizing; all bytes.

    Attributes:
        total: device memory.
        weights: bytes the model's weights took.
        activation_peak: transient peak of the worst-case forward plus the
            sampler over max_num_seqs, above the steady state after loading.
        non_torch: device memory that grew outside torch's allocator during
            the profile (library workspaces).
    """

    total: int
    weights: int
    activation_peak: int
    non_torch: int

    @property
    def non_kv(self) -> int:
        return self.weights + self.activation_peak + self.non_torch


@dataclass(frozen=True)
class SizingResult:
    kv_bytes: int  # bytes the KV cache may use
    budget_bytes: int  # before the buffer (extensible); equal to kv_bytes (classic)
    buffer_bytes: int  # held back for post-warmup allocations (0 on the classic path)


def classic_kv_cache_bytes(profile: MemoryProfile, gpu_memory_utilization: float) -> SizingResult:
    """vLLM's rule: a fraction of total minus what the profile says the engine holds.

    Raises:
        KVCacheSizingError: nothing left for the KV cache.
    """
    requested = int(gpu_memory_utilization * profile.total)
    kv = requested - profile.non_kv
    if kv <= 0:
        raise KVCacheSizingError(
            f"no memory left for the KV cache: gpu_memory_utilization "
            f"{gpu_memory_utilization} x {_gib(profile.total)} = {_gib(requested)}, but the "
            f"model needs {_gib(profile.non_kv)} (weights {_gib(profile.weights)}, activation "
            f"peak {_gib(profile.activation_peak)}, other {_gib(profile.non_torch)}); raise "
            f"--gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return SizingResult(kv_bytes=kv, budget_bytes=kv, buffer_bytes=0)


def extensible_kv_cache_bytes(
    *,
    total: int,
    free: int,
    kv_committed: int,
    held_non_kv: int,
    activation_peak: int,
    gpu_memory_utilization: float,
    budget_cap: int | None = None,
) -> SizingResult:
    """The measured rule, applied after warmup and graph capture.

    Args:
        total: device memory.
        free: free device memory now.
        kv_committed: bytes already committed to the KV cache (counted as available).
        held_non_kv: what this process holds now besides the KV cache (weights,
            torch's pool incl. the activation peak and graph pools, workspaces).
        activation_peak: the profiled transient peak.
        gpu_memory_utilization: the engine may hold at most this fraction of total.
        budget_cap: an extra upper bound of the budget (the CPU platform's default).

    Raises:
        KVCacheSizingError: the buffer leaves nothing for the KV cache; the
            message says what was available and what was held back.
    """
    physical = free + kv_committed
    cap = int(gpu_memory_utilization * total) - held_non_kv
    budget = min(physical, cap)
    if budget_cap is not None:
        budget = min(budget, budget_cap)
    buffer = max(int(ACTIVATION_HEADROOM_FRACTION * activation_peak), BUFFER_FLOOR_BYTES)
    buffer += int(POST_WARMUP_FRACTION * max(budget, 0))
    kv = budget - buffer
    if kv <= 0:
        raise KVCacheSizingError(
            f"no memory left for the KV cache after warmup: {_gib(physical)} available "
            f"({_gib(free)} free + {_gib(kv_committed)} already committed), capped at "
            f"{_gib(cap)} by gpu_memory_utilization {gpu_memory_utilization}; the buffer "
            f"for post-warmup allocations needs {_gib(buffer)}"
        )
    return SizingResult(kv_bytes=kv, budget_bytes=budget, buffer_bytes=buffer)


def num_blocks_for_bytes(
    kv_bytes: int, block_stride: int, num_segments: int, granularity: int
) -> int:
    """Whole blocks whose committed, granule-rounded bytes fit in `kv_bytes`.

    Each of `num_segments` segments commits a prefix of n * block_stride
    bytes, rounded up to `granularity`; so n is bounded by the per-segment
    share rounded *down* to the granularity:

        n = floor(floor(kv_bytes / num_segments / granularity) * granularity / block_stride)

    Returns:
        n >= 0 (blocks, counting the null block).
    """
    if block_stride <= 0 or num_segments <= 0 or granularity <= 0:
        raise ValueError(
            f"block_stride ({block_stride}), num_segments ({num_segments}) and "
            f"granularity ({granularity}) must be positive"
        )
    per_segment = max(kv_bytes, 0) // num_segments
    per_segment -= per_segment % granularity
    return per_segment // block_stride


def committed_bytes_for_blocks(
    num_blocks: int, block_stride: int, num_segments: int, granularity: int
) -> int:
    """Physical bytes `num_blocks` blocks commit: each segment rounded up to the granularity."""
    per_segment = -(-num_blocks * block_stride // granularity) * granularity
    return per_segment * num_segments


def check_min_blocks(num_blocks: int, available_bytes: int, bytes_per_block: int) -> None:
    """At least one usable block besides the null block.

    Raises:
        KVCacheSizingError: naming the bytes available and the bytes one block needs.
    """
    if num_blocks < 2:
        raise KVCacheSizingError(
            f"the device is too small for even one KV cache block: {_gib(available_bytes)} "
            f"available for the cache, one block needs {bytes_per_block} bytes "
            f"(plus the null block, rounded to the allocation granularity)"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"

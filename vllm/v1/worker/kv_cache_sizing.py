"""KV cache sizing: every rule that turns memory figures into a block count.

The one home of the arithmetic (block geometry, the reservation's capacity,
the classic budget, the post-warmup count, the buffer constants, granule
rounding, and the "minimum across ranks" agreement). Pure functions over
plain ints (bytes) and two snapshot dataclasses the worker fills from its
measurements (`MemoryProfile` before the cache exists, `MemorySnapshot`
after warmup), so every rule is tested from given snapshots without a device.
Two paths (DESIGN.md sections 4 and 5):

Classic (vLLM's): decided before warmup, from the profile alone.

    kv = utilization x total - (weights + activation peak + non-torch growth)

Extensible: decided after warmup and graph capture, from what is really free.

    physical = free now + KV bytes already committed
    cap      = utilization x total - what this process holds besides the KV cache
    budget   = min(physical, cap)
    buffer   = clamp(ACTIVATION_HEADROOM_FRACTION x activation peak,
                     BUFFER_FLOOR_BYTES, ACTIVATION_HEADROOM_CAP_BYTES)
               + POST_WARMUP_FRACTION x budget
    kv       = budget - buffer

    |<------------------------------- total -------------------------------->|
    | others | context | weights | torch pool (act. peak, graphs) | KV | buf | free |
                                                                  ^ grows into here

Both results are turned into a whole number of blocks after granule rounding
by `num_blocks_for_bytes`. The extensible cache never commits more blocks than
`max_num_seqs x max_model_len` can address (`max_useful_blocks`, applied
through the reservation's capacity). The worker calls three entry points, in order:

    classic_num_blocks(profile, ...)        classic: the final count, before warmup
    capacity_blocks(total, ...)             extensible: the reservation, before warmup
    final_num_blocks(snapshot, ...)         extensible: the count after warmup

and passes each count through `min_across_ranks` (every rank must use the
same block count; with one rank it is the identity).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# After warmup the activation peak already sits in torch's caching allocator
# (reserved, not free), so only its variation needs headroom: batches whose
# shapes warmup did not see fragment the pool differently. 10 % of the
# profiled peak covers that with room to spare on the shapes measured by
# benchmarks/benchmark_kv_sizing.py (no OOM under the stress run).
ACTIVATION_HEADROOM_FRACTION = 0.10

# ... at most this much: a large peak is a large worst case (the verify batch
# of speculative decoding: logits over max_num_seqs x (k + 1) positions), whose
# smaller variants fit the blocks it left in the pool. Measured on the H200
# (2026-12-02, benchmark_kv_sizing.py --load spec-decode --spec-method
# draft_model, 8B shape, k = 64): activation peak 39.17 GiB, 10 % = 3.92 GiB of
# headroom, and a load whose every decode verified 64 drafts left 4.03 GiB of
# HBM never in use, i.e. serving used none of it. Forward-only peaks (a few
# GiB at most) stay below the cap, so their headroom is unchanged.
ACTIVATION_HEADROOM_CAP_BYTES = 1 * GiB

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


# Blocks committed before warmup on the extensible path: the null block and
# block 1, which every warmup batch and captured graph addresses (block
# tables of dummy requests point only at it). Warmup thus commits two blocks'
# worth of pages per segment, never memory the activation peak needs.
WARMUP_NUM_BLOCKS = 2
# The fewest blocks a KV cache has: the null block 0 and one a request can use.
MIN_NUM_BLOCKS = 2


class KVCacheSizingError(RuntimeError):
    """The device cannot hold the KV cache asked for (message has the numbers)."""


@dataclass(frozen=True)
class MemoryProfile:
    """What the worker measured before sizing; all bytes.

    Attributes:
        total: device memory.
        weights: bytes the model's weights took.
        encoder_cache: bytes of the vision encoder's cache (a multimodal model; held
            for the engine's life, like the weights).
        activation_peak: transient peak of the worst-case forward plus the
            sampler over max_num_seqs, above the steady state after loading.
        non_torch: device memory that grew outside torch's allocator during
            the profile (library workspaces).
    """

    total: int
    weights: int
    activation_peak: int
    non_torch: int
    encoder_cache: int = 0

    @property
    def non_kv(self) -> int:
        return self.weights + self.encoder_cache + self.activation_peak + self.non_torch


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory after warmup and graph capture, as the worker read it; all bytes.

    Attributes:
        total: device memory.
        free: free device memory now.
        kv_committed: bytes committed to the KV cache now (counted as available:
            they are the cache's already).
        used_since_start: what this process took from the device since the
            worker started, the KV cache included.
        torch_shortfall: activation memory torch's allocator must still take
            back from the device to reach the profiled peak (`torch.cuda.graph`
            empties its cache when capture begins); 0 on the CPU.
    """

    total: int
    free: int
    kv_committed: int
    used_since_start: int
    torch_shortfall: int = 0

    @property
    def held_non_kv(self) -> int:
        """What this process holds besides the KV cache, counting the shortfall as held."""
        return max(self.used_since_start - self.kv_committed, 0) + self.torch_shortfall

    @property
    def available(self) -> int:
        """Free memory the KV cache may grow into: free now, less the shortfall."""
        return self.free - self.torch_shortfall


# Names of the limits a budget can hit (the sizing log line says which one did).
LIMIT_FREE = "free memory"
LIMIT_EXPLICIT = "kv_cache_memory_bytes"


def limit_utilization(gpu_memory_utilization: float) -> str:
    return f"gpu_memory_utilization {gpu_memory_utilization:g}"


@dataclass(frozen=True)
class SizingResult:
    kv_bytes: int  # bytes the KV cache may use
    budget_bytes: int  # before the buffer (extensible); equal to kv_bytes (classic)
    buffer_bytes: int  # held back for post-warmup allocations (0 on the classic path)
    limited_by: str = ""  # the limit that set budget_bytes (LIMIT_*, or the platform cap's name)


def _smallest(limits: list[tuple[str, int]]) -> tuple[str, int]:
    """The (name, bytes) limit that binds: the smallest; the first listed on a tie."""
    return min(limits, key=lambda limit: limit[1])


def describe_parts(total: int, parts: list[tuple[str, int]]) -> str:
    """`total` and its parts as "T GiB (a x, b y, other z)" with 2 decimals, where
    "other" is what the named parts leave and the printed figures add up exactly
    (other is computed from the rounded figures; it is negative when the named parts
    overlap, e.g. an activation peak the allocator has already returned)."""
    unit = GiB
    cents = [round(nbytes * 100 / unit) for _, nbytes in parts]
    other = round(total * 100 / unit) - sum(cents)
    shown = ", ".join(f"{name} {c / 100:.2f}" for (name, _), c in zip(parts, cents, strict=True))
    return f"{round(total * 100 / unit) / 100:.2f} GiB ({shown}, other {other / 100:.2f})"


@dataclass(frozen=True)
class KVCacheSize:
    """A block count and the bytes it came from.

    Attributes:
        num_blocks: blocks per layer, counting the null block 0.
        bytes: the budget the count was derived from.
    """

    num_blocks: int
    bytes: SizingResult


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
    return SizingResult(kv_bytes=kv, budget_bytes=kv, buffer_bytes=0,
                        limited_by=limit_utilization(gpu_memory_utilization))


def extensible_kv_cache_bytes(
    *,
    total: int,
    free: int | None,
    kv_committed: int,
    held_non_kv: int,
    activation_peak: int,
    gpu_memory_utilization: float,
    budget_cap: int | None = None,
    budget_cap_name: str = "the platform's cap",
) -> SizingResult:
    """The measured rule, applied after warmup and graph capture.

    Args:
        total: device memory.
        free: free device memory now; None: the budget is not bounded by it
            (the elastic cache's limit: it checks what is free at every growth).
        kv_committed: bytes already committed to the KV cache (counted as available).
        held_non_kv: what this process holds now besides the KV cache (weights,
            torch's pool incl. the activation peak and graph pools, workspaces).
        activation_peak: the profiled transient peak.
        gpu_memory_utilization: the engine may hold at most this fraction of total.
        budget_cap: an extra upper bound of the budget (the CPU platform's default).
        budget_cap_name: what `budget_cap` is, for `SizingResult.limited_by`.

    Raises:
        KVCacheSizingError: the buffer leaves nothing for the KV cache; the
            message says what was available and what was held back.
    """
    cap = int(gpu_memory_utilization * total) - held_non_kv
    limits = [(limit_utilization(gpu_memory_utilization), cap)]
    if free is not None:
        limits.insert(0, (LIMIT_FREE, free + kv_committed))
    if budget_cap is not None:
        limits.append((budget_cap_name, budget_cap))
    limited_by, budget = _smallest(limits)
    buffer = min(max(int(ACTIVATION_HEADROOM_FRACTION * activation_peak), BUFFER_FLOOR_BYTES),
                 ACTIVATION_HEADROOM_CAP_BYTES)
    buffer += int(POST_WARMUP_FRACTION * max(budget, 0))
    kv = budget - buffer
    if kv <= 0:
        available = "" if free is None else (
            f"{_gib(free + kv_committed)} available ({_gib(free)} free + "
            f"{_gib(kv_committed)} already committed), ")
        raise KVCacheSizingError(
            f"no memory left for the KV cache after warmup: {available}capped at "
            f"{_gib(cap)} by gpu_memory_utilization {gpu_memory_utilization}; the buffer "
            f"for post-warmup allocations needs {_gib(buffer)}"
        )
    return SizingResult(kv_bytes=kv, budget_bytes=budget, buffer_bytes=buffer,
                        limited_by=limited_by)


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


def blocks_filling_granules(
    num_blocks: int, block_stride: int, num_segments: int, granularity: int
) -> int:
    """The most blocks that commit no more bytes than `num_blocks` do (>= num_blocks).

    `num_blocks` rounds every segment up to whole granules; the blocks that fit
    in that rounding come free, so a cap of `num_blocks` is applied as this.
    E.g. 17 blocks of 24 KiB fill one 2 MiB granule per segment, which holds 85.
    """
    committed = committed_bytes_for_blocks(num_blocks, block_stride, num_segments, granularity)
    return num_blocks_for_bytes(committed, block_stride, num_segments, granularity)


def check_explicit_bytes(explicit_bytes: int | None, bytes_per_block: list[int]) -> None:
    """`kv_cache_memory_bytes` holds `MIN_NUM_BLOCKS` blocks on every path and rank: the
    one check of the flag against the block size (known once the model's layers exist).
    `bytes_per_block`: each rank's, in rank order; the largest sets the minimum (every rank
    holds every block id; 3 KV heads at TP=2 split 2 + 1). Below it the classic and elastic
    paths said "the device is too small" (exit 1), the extensible one committed two blocks.

    Raises:
        ValueError: naming the flag, the value and the minimum (a usage error, exit 2),
            and the rank whose blocks set it when the ranks' blocks differ.
    """
    largest = max(bytes_per_block)
    if explicit_bytes is None or explicit_bytes >= (minimum := MIN_NUM_BLOCKS * largest):
        return
    ranks = "" if len(set(bytes_per_block)) == 1 else (
        f" on rank {bytes_per_block.index(largest)}, whose blocks are the largest (the "
        f"ranks' blocks: {', '.join(map(str, bytes_per_block))} bytes)")
    raise ValueError(
        f"kv_cache_memory_bytes (--kv-cache-memory-bytes) {explicit_bytes} is below the "
        f"minimum of {minimum} bytes: {MIN_NUM_BLOCKS} KV cache blocks of {largest} bytes "
        f"(the null block and one for requests){ranks}")


def check_min_blocks(num_blocks: int, available_bytes: int, bytes_per_block: int) -> None:
    """At least one usable block besides the null block.

    Raises:
        KVCacheSizingError: naming the bytes available and the bytes one block needs.
    """
    if num_blocks < MIN_NUM_BLOCKS:
        raise KVCacheSizingError(
            f"the device is too small for even one KV cache block: {_gib(available_bytes)} "
            f"available for the cache, one block needs {bytes_per_block} bytes "
            f"(plus the null block, rounded to the allocation granularity)"
        )


def classic_num_blocks(
    profile: MemoryProfile,
    bytes_per_block: int,
    *,
    gpu_memory_utilization: float,
    explicit_bytes: int | None = None,
    free: int = 0,
    budget_cap: int | None = None,
    budget_cap_name: str = "the platform's cap",
) -> KVCacheSize:
    """The classic path's final block count, decided before warmup.

    Args:
        profile: the pre-warmup profile.
        bytes_per_block: bytes one block id costs across all layers.
        gpu_memory_utilization: the share of total the engine may hold.
        explicit_bytes: `kv_cache_memory_bytes`, if given: used as is.
        free: free memory now (read only with `budget_cap`).
        budget_cap: the platform's own bound on the KV cache, where it has one
            (CPU: host memory is shared with everything else; see
            `Platform.default_kv_cache_bytes_cap`). There the budget is
            `min(budget_cap, free)` instead of vLLM's profile rule.
        budget_cap_name: what `budget_cap` is, for `SizingResult.limited_by`.

    Raises:
        KVCacheSizingError: nothing left, or fewer than two blocks (the null
            block and one usable); the message has the numbers.
    """
    if explicit_bytes is not None:
        result = SizingResult(explicit_bytes, explicit_bytes, 0, LIMIT_EXPLICIT)
    elif budget_cap is not None:
        name, kv = _smallest([(budget_cap_name, budget_cap), (LIMIT_FREE, free)])
        result = SizingResult(kv, kv, 0, name)
    else:
        result = classic_kv_cache_bytes(profile, gpu_memory_utilization)
    num_blocks = result.kv_bytes // bytes_per_block
    check_min_blocks(num_blocks, result.kv_bytes, bytes_per_block)
    return KVCacheSize(num_blocks, result)


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks the engine can ever address at once, counting the null block.

    `max_num_seqs` requests of `max_model_len` tokens each need
    `ceil(max_model_len / block_size)` blocks apiece; a block beyond that can
    hold nothing a running request reads, so committing it only takes memory
    from other processes (issue #16 item 6: `max_num_seqs 1 x max_model_len
    1024` once committed 3.96 GiB for 46 MiB of possible use).

        useful = max_num_seqs x ceil(max_model_len / block_size) + 1

    Raises:
        ValueError: a count below 1.
    """
    if min(max_num_seqs, max_model_len, block_size) < 1:
        raise ValueError(
            f"max_num_seqs ({max_num_seqs}), max_model_len ({max_model_len}) and "
            f"block_size ({block_size}) must be >= 1"
        )
    return max_num_seqs * -(-max_model_len // block_size) + 1


def capacity_blocks(
    total: int,
    block_stride: int,
    num_segments: int,
    granularity: int,
    max_blocks: int | None = None,
    explicit_bytes: int | None = None,
) -> int:
    """The most blocks the extensible reservation is made for.

    Reserving address space costs nothing physical, so the capacity is what
    the whole device holds, `total / bytes_per_block`, bounded by `max_blocks`
    (`max_useful_blocks`: what `max_num_seqs x max_model_len` can use) and at
    least `WARMUP_NUM_BLOCKS`, rounded up so every segment's capacity ends on
    a granule: a granule is then never shared between two segments'
    capacities, and the blocks up to that end cost no extra memory (the
    granule holding them is committed anyway).

        align    = granularity / gcd(granularity, block_stride)
        n        = max(min(total / (block_stride x num_segments), max_blocks), WARMUP_NUM_BLOCKS)
        capacity = ceil(n / align) x align

    With an explicit `kv_cache_memory_bytes` the cache never grows past it, so
    the capacity is exactly the blocks those bytes hold (vLLM's count,
    `explicit_bytes / bytes_per_block`), unaligned: the segments then lie
    back to back, a granule at a boundary is shared (mapped once), and the
    whole committed cache costs the bytes rounded up to one granule in total,
    where aligned segments would cost up to one granule *each*:

        30 segments x 91 blocks x 24 KiB, packed:   64 MiB -> 32 granules (64 MiB)
        30 segments x 91 blocks x 24 KiB, aligned:  2 granules each      (120 MiB)
    """
    if explicit_bytes is not None:
        capacity = explicit_bytes // (block_stride * num_segments)
        if max_blocks is not None:
            capacity = min(capacity, max_blocks)
        return max(capacity, WARMUP_NUM_BLOCKS)
    align = granularity // math.gcd(granularity, block_stride)
    capacity = total // (block_stride * num_segments)
    if max_blocks is not None:
        capacity = min(capacity, max_blocks)
    capacity = max(capacity, WARMUP_NUM_BLOCKS)
    return -(-capacity // align) * align


def final_num_blocks(
    snapshot: MemorySnapshot,
    *,
    activation_peak: int,
    gpu_memory_utilization: float,
    block_stride: int,
    num_segments: int,
    granularity: int,
    capacity: int,
    explicit_bytes: int | None = None,
    budget_cap: int | None = None,
    budget_cap_name: str = "the platform's cap",
    max_blocks: int | None = None,
    bound_by_free: bool = True,
    packed_segments: bool = False,
) -> KVCacheSize:
    """The extensible path's block count after warmup, from what is really free.

    A measured budget (`extensible_kv_cache_bytes`) is a hard limit: its blocks
    are rounded down to whole granules per segment (`num_blocks_for_bytes`).
    An explicit `kv_cache_memory_bytes` is honoured within one granule in
    total (`_explicit_num_blocks`; vLLM's count with `packed_segments`).
    Either way at most `capacity` blocks, and at most the blocks that fill the
    granules `max_blocks` commit (`blocks_filling_granules`).

    Args: `snapshot` (memory after warmup), `activation_peak` (sizes the
    buffer), `gpu_memory_utilization`, the layout's `block_stride` and
    `num_segments`, `granularity` (the VMM commit unit, bytes), `capacity`
    (blocks the reservation holds), `explicit_bytes` (kv_cache_memory_bytes),
    the platform's `budget_cap` (CPU) and its name, `max_blocks`
    (`max_useful_blocks`), and `bound_by_free` (False for the elastic cache's
    limit: what it may ever hold, not what is free now; each growth checks
    that), `packed_segments` (reserved for exactly the explicit blocks).

    Raises:
        KVCacheSizingError: the explicit size exceeds what is available, the
            buffer leaves nothing, or fewer than two blocks fit.
    """
    if explicit_bytes is not None:
        result, num_blocks = _explicit_num_blocks(
            explicit_bytes, snapshot if bound_by_free else None, block_stride, num_segments,
            None if packed_segments else granularity)
    else:
        result = extensible_kv_cache_bytes(
            total=snapshot.total,
            free=snapshot.available if bound_by_free else None,
            kv_committed=snapshot.kv_committed,
            held_non_kv=snapshot.held_non_kv,
            activation_peak=activation_peak,
            gpu_memory_utilization=gpu_memory_utilization,
            budget_cap=budget_cap,
            budget_cap_name=budget_cap_name,
        )
        num_blocks = num_blocks_for_bytes(result.kv_bytes, block_stride, num_segments, granularity)
    num_blocks = min(num_blocks, capacity)
    if max_blocks is not None:
        cap = blocks_filling_granules(max_blocks, block_stride, num_segments, granularity)
        num_blocks = min(num_blocks, cap)
    check_min_blocks(num_blocks, result.kv_bytes, block_stride * num_segments)
    return KVCacheSize(num_blocks, result)


def _explicit_num_blocks(
    explicit_bytes: int, snapshot: MemorySnapshot | None, block_stride: int,
    num_segments: int, aligned_granularity: int | None,
) -> tuple[SizingResult, int]:
    """`kv_cache_memory_bytes` as blocks, committed within one granule in total.

    Packed segments (`aligned_granularity` None: the reservation holds exactly
    these blocks, `capacity_blocks(explicit_bytes=...)`): `explicit_bytes //
    bytes_per_block`, vLLM's count, which costs the bytes rounded up to one
    granule in total (64 MiB on 30 segments of 2 MiB granules: 91 blocks in
    64 MiB, as vLLM's 91). Segments aligned to `aligned_granularity` (a
    connector registers each as one allocation) each commit whole granules,
    so the count is rounded down per segment instead (85 blocks in 60 MiB,
    never 91 in 120 MiB); below one granule per segment it is the plain count
    in that one granule each.

    Raises:
        KVCacheSizingError: more than is available after warmup (`snapshot`;
            None: not checked).
    """
    if snapshot is not None:
        available = snapshot.available + snapshot.kv_committed
        if explicit_bytes > available:
            raise KVCacheSizingError(
                f"kv_cache_memory_bytes={explicit_bytes} exceeds the "
                f"{available / GiB:.2f} GiB available after warmup"
            )
    bytes_per_block = block_stride * num_segments
    num_blocks = explicit_bytes // bytes_per_block
    if aligned_granularity is not None:
        per_granules = num_blocks_for_bytes(explicit_bytes + aligned_granularity, block_stride,
                                            num_segments, aligned_granularity)
        num_blocks = min(num_blocks, per_granules or num_blocks)
    return SizingResult(explicit_bytes, explicit_bytes, 0, LIMIT_EXPLICIT), num_blocks


def fit_max_model_len(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """The context length the KV cache can hold for one request, at most `max_model_len`.

    One request may use every block but the null block 0, so the cache holds
    `(num_blocks - 1) x block_size` tokens of one sequence. A longer
    `max_model_len` fails the start-up, as in vLLM, unless it is "auto" (-1),
    which serves this fitted length (`vllm/v1/engine/startup.py`).

    Returns:
        min(max_model_len, (num_blocks - 1) x block_size), tokens.
    """
    return min(max_model_len, (num_blocks - 1) * block_size)


def min_across_ranks(num_blocks_per_rank: Iterable[int]) -> int:
    """The block count every rank uses: the smallest any rank can hold.

    Block ids mean the same tokens on every rank (the scheduler hands out one
    id per block for all of them), so each rank must have the same count, and
    only the minimum fits everywhere. With one rank this is its own count.
    The tensor-parallel engine gathers one count per rank (through the
    executor's `collective_rpc`, or an all-gather of the ranks' counts) and
    calls this with them.

    Raises:
        ValueError: no counts, or a count below 1.
    """
    counts = list(num_blocks_per_rank)
    if not counts or min(counts) < 1:
        raise ValueError(f"min_across_ranks needs one block count >= 1 per rank, got {counts}")
    return min(counts)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"

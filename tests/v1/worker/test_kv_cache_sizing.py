"""Sizing arithmetic from given memory snapshots (both paths, buffer, caps, rounding).

Expected values are literal numbers worked out by hand (the comments show the
arithmetic), never recomputed from the module's constants: changing a buffer
constant, the warmup block count or a rounding rule makes these tests fail,
and whoever changes it must update the numbers on purpose.
"""

import re

import pytest

from vllm.v1.worker.elastic_kv_cache import (
    elastic_chunk_blocks,
    elastic_floor_blocks,
    elastic_growth_blocks,
    elastic_headroom_bytes,
)
from vllm.v1.worker.kv_cache_sizing import (
    WARMUP_NUM_BLOCKS,
    GiB,
    KVCacheSizingError,
    MemoryProfile,
    MemorySnapshot,
    MiB,
    blocks_filling_granules,
    capacity_blocks,
    check_explicit_bytes,
    check_min_blocks,
    classic_kv_cache_bytes,
    classic_num_blocks,
    committed_bytes_for_blocks,
    describe_parts,
    extensible_kv_cache_bytes,
    final_num_blocks,
    max_useful_blocks,
    min_across_ranks,
    num_blocks_for_bytes,
)

TOTAL = 140 * GiB


def test_classic_subtracts_weights_peak_and_non_torch_from_utilization_share():
    profile = MemoryProfile(total=TOTAL, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB)
    result = classic_kv_cache_bytes(profile, 0.92)
    # int(0.92 x 150323855360) = 138297946931; less 19 GiB (20401094656).
    assert result.kv_bytes == int(0.92 * TOTAL) - 19 * GiB == 117896852275
    assert result.buffer_bytes == 0


def test_classic_fails_with_numbers_when_nothing_is_left():
    profile = MemoryProfile(total=10 * GiB, weights=9 * GiB, activation_peak=GiB, non_torch=0)
    with pytest.raises(KVCacheSizingError, match=r"9\.20 GiB.*10\.00 GiB"):
        classic_kv_cache_bytes(profile, 0.92)


def test_extensible_budget_is_free_plus_committed_less_buffer():
    peak = 4 * GiB
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=100 * GiB,
        kv_committed=GiB,
        held_non_kv=30 * GiB,
        activation_peak=peak,
        gpu_memory_utilization=1.0,
    )
    budget = 101 * GiB  # 108447924224
    # 10 % of the 4 GiB peak (429496729) + 0.1 % of the budget (108447924)
    assert r.budget_bytes == budget
    assert r.buffer_bytes == 537944653
    assert r.kv_bytes == budget - 537944653 == 107909979571


def test_extensible_activation_headroom_is_capped():
    """A spec-decode verify peak of 39 GiB gets 1 GiB of headroom, not 3.9 GiB."""
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=100 * GiB,
        kv_committed=0,
        held_non_kv=70 * GiB,
        activation_peak=39 * GiB,
        gpu_memory_utilization=1.0,
    )
    assert r.buffer_bytes == GiB + int(0.001 * r.budget_bytes)


def test_extensible_buffer_has_absolute_floor():
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=50 * GiB,
        kv_committed=0,
        held_non_kv=GiB,
        activation_peak=MiB,  # tiny peak: the floor applies
        gpu_memory_utilization=1.0,
    )
    # the 128 MiB floor (134217728) + 0.1 % of 50 GiB (53687091)
    assert r.buffer_bytes == 187904819


def test_extensible_never_exceeds_utilization_share_of_total():
    # Plenty free, but the engine may hold only half the device.
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=120 * GiB,
        kv_committed=0,
        held_non_kv=20 * GiB,
        activation_peak=GiB,
        gpu_memory_utilization=0.5,
    )
    assert r.budget_bytes == int(0.5 * TOTAL) - 20 * GiB
    assert r.kv_bytes + 20 * GiB <= 0.5 * TOTAL


def test_extensible_never_exceeds_what_is_free_plus_committed():
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=10 * GiB,
        kv_committed=2 * GiB,
        held_non_kv=20 * GiB,
        activation_peak=GiB,
        gpu_memory_utilization=1.0,
    )
    assert r.budget_bytes == 12 * GiB
    assert r.kv_bytes < 12 * GiB


def test_extensible_budget_cap_applies():
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=100 * GiB,
        kv_committed=0,
        held_non_kv=GiB,
        activation_peak=GiB,
        gpu_memory_utilization=1.0,
        budget_cap=4 * GiB,
    )
    assert r.budget_bytes == 4 * GiB


def test_extensible_margin_from_headroom_only_and_never_negative():
    with pytest.raises(KVCacheSizingError, match="available") as info:
        extensible_kv_cache_bytes(
            total=TOTAL,
            free=100 * MiB,
            kv_committed=0,
            held_non_kv=GiB,
            activation_peak=GiB,
            gpu_memory_utilization=1.0,
        )
    assert "0.10 GiB" in str(info.value)


@pytest.mark.parametrize(
    "kv_bytes,stride,segments,gran",
    [
        (10 * GiB, 2 * MiB, 32, 2 * MiB),
        (GiB + 12345, 24 * 1024, 30, 2 * MiB),
        (3 * MiB, 4096, 1, 2 * MiB),
    ],
)
def test_block_count_is_whole_after_granule_rounding(kv_bytes, stride, segments, gran):
    n = num_blocks_for_bytes(kv_bytes, stride, segments, gran)
    assert committed_bytes_for_blocks(n, stride, segments, gran) <= kv_bytes
    # One more block per segment would not fit once rounded, or we are at
    # the granule boundary: rounding wastes at most one granule per segment.
    assert kv_bytes - committed_bytes_for_blocks(n, stride, segments, gran) < segments * (
        gran + stride
    )


def test_block_count_examples():
    # 24 KiB blocks, 30 segments, 2 MiB granules: 1 GiB -> 34 MiB per segment
    # -> 34 granules (not 34.13) -> 1450 blocks (34 MiB / 24 KiB = 1450.67).
    assert num_blocks_for_bytes(GiB, 24 * 1024, 30, 2 * MiB) == 1450
    assert committed_bytes_for_blocks(1450, 24 * 1024, 30, 2 * MiB) == 30 * 34 * MiB
    assert num_blocks_for_bytes(0, 4096, 1, 2 * MiB) == 0
    with pytest.raises(ValueError, match="granularity"):
        num_blocks_for_bytes(GiB, 4096, 1, 0)


def test_device_too_small_for_one_block_says_how_much():
    with pytest.raises(KVCacheSizingError, match=r"0\.00 GiB available.*2097152 bytes"):
        check_min_blocks(1, 1000, 2 * MiB)
    check_min_blocks(2, 4 * MiB, 2 * MiB)


# ---- the entry points the worker calls, from snapshots ----

# An 8B-like layout on an H200-like device: 32 layers (segments) of 64 KiB
# blocks (2 x 16 tokens x 8 heads x 128 dims x 2 bytes), 2 MiB granules.
STRIDE, SEGMENTS, GRANULE = 64 * 1024, 32, 2 * MiB


def test_capacity_is_the_whole_device_rounded_to_granules():
    # 140 GiB / (64 KiB x 32) = 71680 blocks; align = 2 MiB / 64 KiB = 32 divides it.
    assert capacity_blocks(TOTAL, STRIDE, SEGMENTS, GRANULE) == 71680
    # 140 GiB / 720 KiB = 203889.8 -> 203889; align = 2 MiB / 8 KiB = 256 -> 797 x 256.
    assert capacity_blocks(TOTAL, 24 * 1024, 30, GRANULE) == 204032
    # A device smaller than the warmup blocks still reserves them.
    assert capacity_blocks(10 * MiB, 3 * MiB, 4, GRANULE) == WARMUP_NUM_BLOCKS == 2


def test_final_count_from_a_snapshot_after_warmup():
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=64 * MiB,
                              used_since_start=30 * GiB)
    size = final_num_blocks(snapshot, activation_peak=4 * GiB, gpu_memory_utilization=1.0,
                            block_stride=STRIDE, num_segments=SEGMENTS, granularity=GRANULE,
                            capacity=71680)
    # budget = min(100 GiB + 64 MiB free+committed, 140 GiB - (30 GiB - 64 MiB) held)
    #        = 107441291264; buffer = 429496729 + 107441291 = 536938020
    # kv = 106904353244 -> 3340761038 per segment -> 1592 granules -> 50944 blocks
    assert size.bytes.budget_bytes == 107441291264
    assert size.bytes.buffer_bytes == 536938020
    assert size.bytes.kv_bytes == 106904353244
    assert size.num_blocks == 50944


def test_final_count_counts_the_torch_shortfall_as_held_and_the_floor_applies():
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=64 * MiB,
                              used_since_start=30 * GiB, torch_shortfall=GiB)
    assert snapshot.held_non_kv == 31 * GiB - 64 * MiB
    assert snapshot.available == 99 * GiB
    size = final_num_blocks(snapshot, activation_peak=256 * MiB, gpu_memory_utilization=0.9,
                            block_stride=STRIDE, num_segments=SEGMENTS, granularity=GRANULE,
                            capacity=71680)
    # cap = int(0.9 x 140 GiB) - held = 135291469824 - 33218887680 = 102072582144
    # buffer = 128 MiB floor + 102072582 = 236290310
    assert size.bytes.budget_bytes == 102072582144
    assert size.bytes.buffer_bytes == 236290310
    assert size.num_blocks == 48544


def test_final_count_explicit_bytes_and_capacity_cap():
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=64 * MiB,
                              used_since_start=30 * GiB)
    common = dict(activation_peak=4 * GiB, gpu_memory_utilization=1.0, block_stride=STRIDE,
                  num_segments=SEGMENTS, granularity=GRANULE)
    # 10 GiB explicit = 5120 whole 2 MiB blocks, no granule rounding down.
    explicit = final_num_blocks(snapshot, capacity=71680, explicit_bytes=10 * GiB, **common)
    assert explicit.num_blocks == 5120 and explicit.bytes.buffer_bytes == 0
    assert final_num_blocks(snapshot, capacity=4096, **common).num_blocks == 4096
    with pytest.raises(KVCacheSizingError, match="exceeds the 100.06 GiB available"):
        final_num_blocks(snapshot, capacity=71680, explicit_bytes=101 * GiB, **common)
    # The CPU platform's cap bounds the budget: 4 GiB - 128 MiB - 4 MiB buffer.
    capped = final_num_blocks(snapshot, capacity=71680, budget_cap=4 * GiB,
                              **{**common, "activation_peak": MiB})
    assert capped.bytes.kv_bytes == 4 * GiB - 134217728 - 4294967 == 4156454601
    # 129889206 bytes per segment -> 61 granules -> 61 x 32 blocks
    assert capped.num_blocks == 1952


def test_classic_count_from_a_profile():
    profile = MemoryProfile(total=TOTAL, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB)
    # 117896852275 bytes / 2 MiB per block = 56217.4 -> 56217
    assert classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92).num_blocks == 56217
    explicit = classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92,
                                  explicit_bytes=GiB)
    assert explicit.num_blocks == 512
    # Where the platform caps the cache (CPU), the cap and free memory decide.
    cpu = classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92,
                             free=3 * GiB, budget_cap=4 * GiB)
    assert cpu.num_blocks == 1536
    with pytest.raises(KVCacheSizingError, match="too small for even one KV cache block"):
        classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92, explicit_bytes=MiB)


def test_an_explicit_size_below_two_blocks_names_the_flag_and_the_minimum():
    """`--kv-cache-memory-bytes 1`: a usage error naming the flag and two blocks' bytes (the
    null block and one for requests), the same on every path; two blocks' bytes pass."""
    check_explicit_bytes(None, [737280])
    check_explicit_bytes(2 * 737280, [737280])
    for nbytes in (1, 2 * 737280 - 1):
        with pytest.raises(ValueError) as error:
            check_explicit_bytes(nbytes, [737280])
        assert str(error.value) == (
            f"kv_cache_memory_bytes (--kv-cache-memory-bytes) {nbytes} is below the minimum "
            "of 1474560 bytes: 2 KV cache blocks of 737280 bytes (the null block and one for "
            "requests)")


def test_an_explicit_size_is_checked_against_the_largest_block_of_any_rank():
    """Ranks whose KV heads split unevenly (3 heads at TP=2) have blocks of different
    bytes; every rank holds every block, so the largest sets the minimum on every rank
    (rank 1's two blocks fit in 737280 bytes, rank 0's do not), named once."""
    check_explicit_bytes(2 * 491520, [491520, 245760])
    with pytest.raises(ValueError) as error:
        check_explicit_bytes(737280, [245760, 491520])
    assert str(error.value) == (
        "kv_cache_memory_bytes (--kv-cache-memory-bytes) 737280 is below the minimum of "
        "983040 bytes: 2 KV cache blocks of 491520 bytes (the null block and one for "
        "requests) on rank 1, whose blocks are the largest (the ranks' blocks: 245760, "
        "491520 bytes)")


def test_min_across_ranks():
    assert min_across_ranks([50944]) == 50944
    assert min_across_ranks([50944, 50912, 51008]) == 50912
    with pytest.raises(ValueError, match="one block count >= 1 per rank"):
        min_across_ranks([])
    with pytest.raises(ValueError, match="one block count >= 1 per rank"):
        min_across_ranks([4, 0])


def test_the_budget_names_the_limit_that_set_it():
    common = dict(total=TOTAL, kv_committed=0, held_non_kv=GiB, activation_peak=GiB)
    by_free = extensible_kv_cache_bytes(free=10 * GiB, gpu_memory_utilization=1.0, **common)
    assert (by_free.limited_by, by_free.budget_bytes) == ("free memory", 10 * GiB)
    by_util = extensible_kv_cache_bytes(free=100 * GiB, gpu_memory_utilization=0.5, **common)
    assert by_util.limited_by == "gpu_memory_utilization 0.5"
    assert by_util.budget_bytes == int(0.5 * TOTAL) - GiB
    by_cap = extensible_kv_cache_bytes(free=100 * GiB, gpu_memory_utilization=1.0,
                                       budget_cap=4 * GiB, budget_cap_name="VLLM_X", **common)
    assert (by_cap.limited_by, by_cap.budget_bytes) == ("VLLM_X", 4 * GiB)
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=0,
                              used_since_start=GiB)
    explicit = final_num_blocks(snapshot, activation_peak=GiB, gpu_memory_utilization=1.0,
                                block_stride=STRIDE, num_segments=SEGMENTS, granularity=GRANULE,
                                capacity=71680, explicit_bytes=GiB)
    assert explicit.bytes.limited_by == "kv_cache_memory_bytes"
    profile = MemoryProfile(total=TOTAL, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB)
    assert classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92
                              ).bytes.limited_by == "gpu_memory_utilization 0.92"
    cpu = classic_num_blocks(profile, 2 * MiB, gpu_memory_utilization=0.92, free=3 * GiB,
                             budget_cap=4 * GiB, budget_cap_name="the CPU default")
    assert cpu.bytes.limited_by == "free memory"


def test_a_breakdown_adds_up_exactly_as_printed():
    # 0.764 = 0.504 + 0.024 + 0.236: rounded separately the parts would print 0.50 + 0.02
    # and leave "other" to make 0.76 exactly.
    held, weights, peak = int(0.764 * GiB), int(0.504 * GiB), int(0.024 * GiB)
    text = describe_parts(held, [("weights", weights), ("activation peak", peak)])
    assert text == "0.76 GiB (weights 0.50, activation peak 0.02, other 0.24)"
    # Parts larger than the whole (an activation peak already returned to the OS): other < 0.
    text = describe_parts(int(0.5 * GiB), [("weights", int(0.45 * GiB)),
                                           ("activation peak", int(0.1 * GiB))])
    assert text == "0.50 GiB (weights 0.45, activation peak 0.10, other -0.05)"
    numbers = [float(x) for x in re.findall(r"-?\d+\.\d+", text)]
    assert round(sum(numbers[1:]), 2) == numbers[0]


# Issue #16 item 6: 30 segments (one per layer) of 24 KiB blocks, 2 MiB granules.
LAYER_STRIDE, LAYERS = 24 * 1024, 30


@pytest.mark.parametrize(
    "explicit, blocks",
    [
        # vLLM's count: 64 MiB / (30 x 24 KiB) = 91.02 -> 91 (rounding each segment down
        # to whole granules gave 85, issue 48).
        (64 * MiB, 91),
        # 2 GiB / 737280 = 2912.7 -> 2912 (was 2901).
        (2 * GiB, 2912),
        (60 * MiB, 85),
    ],
)
def test_explicit_bytes_give_vllms_blocks_within_one_granule_in_total(explicit, blocks):
    """The reservation holds exactly the explicit blocks, segments packed back to back,
    so committing them all maps the bytes rounded up to one granule in total (real
    pages of the host VMM: a granule shared by two segments is mapped once)."""
    from vllm.device_allocator.host_vmm import HostVmmDriver
    from vllm.utils.extensible_tensor import ExtensibleTensor

    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=0,
                              used_since_start=30 * GiB)
    capacity = capacity_blocks(TOTAL, LAYER_STRIDE, LAYERS, GRANULE, max_blocks=10**9,
                               explicit_bytes=explicit)
    assert capacity == blocks
    size = final_num_blocks(snapshot, activation_peak=GiB, gpu_memory_utilization=1.0,
                            block_stride=LAYER_STRIDE, num_segments=LAYERS,
                            granularity=GRANULE, capacity=capacity, explicit_bytes=explicit,
                            packed_segments=True)
    assert size.num_blocks == blocks
    if explicit > 64 * MiB:
        return  # the mapping check below needs only one size
    segment = blocks * LAYER_STRIDE
    driver = HostVmmDriver()
    tensor = ExtensibleTensor([segment] * LAYERS, driver)
    try:
        tensor.grow_segments_([segment] * LAYERS)
        assert tensor.physical_bytes <= explicit + driver.granularity
        assert tensor.physical_bytes == -(-blocks * LAYER_STRIDE * LAYERS
                                          // driver.granularity) * driver.granularity
    finally:
        tensor.free()


@pytest.mark.parametrize(
    "explicit, blocks, committed",
    [
        # Aligned segments (a NIXL connector registers each as one allocation): each
        # commits whole granules, so the count is rounded down per segment.
        # (64 MiB + 2 MiB) / 30 = 2306867 -> 1 granule -> 85 blocks in 60 MiB (not 91
        # blocks in 2 granules each, 120 MiB).
        (64 * MiB, 85, 62914560),
        (2 * GiB, 2901, 2139095040),
        (60 * MiB, 85, 62914560),
    ],
)
def test_explicit_bytes_on_aligned_segments_stay_within_one_granule(explicit, blocks,
                                                                    committed):
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=0,
                              used_since_start=30 * GiB)
    size = final_num_blocks(snapshot, activation_peak=GiB, gpu_memory_utilization=1.0,
                            block_stride=LAYER_STRIDE, num_segments=LAYERS,
                            granularity=GRANULE, capacity=204032, explicit_bytes=explicit)
    assert size.num_blocks == blocks
    assert committed_bytes_for_blocks(blocks, LAYER_STRIDE, LAYERS, GRANULE) == committed
    assert committed <= explicit + GRANULE


def test_capacity_never_exceeds_what_max_num_seqs_x_max_model_len_can_use():
    # 1 x ceil(1024 / 16) + 1 = 65; 256 x ceil(4096 / 16) + 1 = 65537; 3 x ceil(100/16) + 1 = 22.
    assert max_useful_blocks(1, 1024, 16) == 65
    assert max_useful_blocks(256, 4096, 16) == 65537
    assert max_useful_blocks(3, 100, 16) == 22
    with pytest.raises(ValueError, match="must be >= 1"):
        max_useful_blocks(0, 1024, 16)
    # align 32: 65 -> 96 blocks = 3 granules per segment, 32 x 6 MiB = 192 MiB in all
    # (the uncapped capacity is the whole device, 71680 blocks, 140 GiB).
    assert capacity_blocks(TOTAL, STRIDE, SEGMENTS, GRANULE, max_blocks=65) == 96
    assert committed_bytes_for_blocks(96, STRIDE, SEGMENTS, GRANULE) == 201326592
    # The cap never goes below the warmup blocks; a large cap leaves the device bound.
    assert capacity_blocks(TOTAL, STRIDE, SEGMENTS, GRANULE, max_blocks=1) == 32
    assert capacity_blocks(TOTAL, STRIDE, SEGMENTS, GRANULE, max_blocks=10**9) == 71680
    # After warmup the measured count stops at that capacity, 96 blocks, not 50944.
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=64 * MiB,
                              used_since_start=30 * GiB)
    size = final_num_blocks(snapshot, activation_peak=4 * GiB, gpu_memory_utilization=1.0,
                            block_stride=STRIDE, num_segments=SEGMENTS, granularity=GRANULE,
                            capacity=96)
    assert size.num_blocks == 96
    # 30 layers of 24 KiB blocks: 17 useful blocks fill one granule per segment, which
    # holds 85 blocks (60 MiB in all); the reservation stays granule aligned (256 blocks).
    assert blocks_filling_granules(17, LAYER_STRIDE, LAYERS, GRANULE) == 85
    assert capacity_blocks(TOTAL, LAYER_STRIDE, LAYERS, GRANULE, max_blocks=17) == 256
    size = final_num_blocks(snapshot, activation_peak=4 * GiB, gpu_memory_utilization=1.0,
                            block_stride=LAYER_STRIDE, num_segments=LAYERS,
                            granularity=GRANULE, capacity=256, max_blocks=17)
    assert size.num_blocks == 85
    assert committed_bytes_for_blocks(85, LAYER_STRIDE, LAYERS, GRANULE) == 60 * MiB


def test_explicit_bytes_under_one_granule_per_segment_still_give_blocks():
    # 4 MiB over 30 layers of 24 KiB blocks: 4194304 // 737280 = 5 blocks, although no
    # whole granule per segment fits in 4 MiB + 2 MiB; the smallest commit is one
    # granule per segment (60 MiB). Before: 0 blocks and "too small" at start-up.
    snapshot = MemorySnapshot(total=TOTAL, free=100 * GiB, kv_committed=0,
                              used_since_start=30 * GiB)
    size = final_num_blocks(snapshot, activation_peak=GiB, gpu_memory_utilization=1.0,
                            block_stride=LAYER_STRIDE, num_segments=LAYERS,
                            granularity=GRANULE, capacity=204032, explicit_bytes=4 * MiB)
    assert size.num_blocks == 5
    assert committed_bytes_for_blocks(5, LAYER_STRIDE, LAYERS, GRANULE) == 60 * MiB


# The elastic cache (issue #18): the bundled model's geometry, 30 layer segments of
# 24 KiB blocks, 2 MiB granules (85 blocks each).
ELASTIC = dict(block_stride=24 * 1024, num_segments=30, granularity=2 * MiB)


def test_elastic_headroom_is_two_percent_of_the_device_or_256_mib():
    assert elastic_headroom_bytes(140 * GiB) == 3006477107  # int(0.02 x 150323855360)
    assert elastic_headroom_bytes(4 * GiB) == 256 * MiB  # 2 % would be 82 MiB


def test_elastic_growth_goes_only_into_free_memory_less_the_headroom():
    # (60 MiB + 10 GiB - 3006477107) / 30 = 259795189 bytes a segment -> 123 granules
    # (257949696 bytes) -> 10496 blocks.
    assert elastic_growth_blocks(free=10 * GiB, total=140 * GiB, committed_bytes=60 * MiB,
                                 **ELASTIC) == 10496
    # (60 + 300 - 256) MiB / 30 = 3.47 MiB a segment -> one granule: 85 blocks, as now.
    assert elastic_growth_blocks(free=300 * MiB, total=4 * GiB, committed_bytes=60 * MiB,
                                 **ELASTIC) == 85
    # Less free than the headroom: below what is committed, so no growth.
    assert elastic_growth_blocks(free=100 * MiB, total=4 * GiB, committed_bytes=60 * MiB,
                                 **ELASTIC) == 0


def test_elastic_floor_is_one_max_model_len_request_up_to_its_granules():
    # 16 blocks of a 256-token request + the null block fill one granule a segment: 85.
    assert elastic_floor_blocks(10000, 16, **ELASTIC) == 85
    assert elastic_floor_blocks(40, 16, **ELASTIC) == 40  # never above the limit
    assert elastic_floor_blocks(1, 16, **ELASTIC) == 2  # never below the warmup blocks


def test_elastic_growth_comes_in_eighths_of_the_range():
    assert elastic_chunk_blocks(85, 10496) == 1302  # ceil(10411 / 8)
    assert elastic_chunk_blocks(85, 85) == 1

"""Sizing arithmetic from given memory snapshots (both paths, buffer, caps, rounding)."""

import pytest

from vllm.v1.worker.kv_cache_sizing import (
    ACTIVATION_HEADROOM_FRACTION,
    BUFFER_FLOOR_BYTES,
    POST_WARMUP_FRACTION,
    GiB,
    KVCacheSizingError,
    MemoryProfile,
    MiB,
    check_min_blocks,
    classic_kv_cache_bytes,
    committed_bytes_for_blocks,
    extensible_kv_cache_bytes,
    num_blocks_for_bytes,
)

TOTAL = 140 * GiB


def test_classic_subtracts_weights_peak_and_non_torch_from_utilization_share():
    profile = MemoryProfile(total=TOTAL, weights=16 * GiB, activation_peak=2 * GiB, non_torch=GiB)
    result = classic_kv_cache_bytes(profile, 0.92)
    assert result.kv_bytes == int(0.92 * TOTAL) - 19 * GiB
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
    budget = 101 * GiB
    buffer = int(ACTIVATION_HEADROOM_FRACTION * peak) + int(POST_WARMUP_FRACTION * budget)
    assert r.budget_bytes == budget
    assert r.buffer_bytes == buffer
    assert r.kv_bytes == budget - buffer


def test_extensible_buffer_has_absolute_floor():
    r = extensible_kv_cache_bytes(
        total=TOTAL,
        free=50 * GiB,
        kv_committed=0,
        held_non_kv=GiB,
        activation_peak=MiB,  # tiny peak: the floor applies
        gpu_memory_utilization=1.0,
    )
    assert r.buffer_bytes == BUFFER_FLOOR_BYTES + int(POST_WARMUP_FRACTION * 50 * GiB)


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

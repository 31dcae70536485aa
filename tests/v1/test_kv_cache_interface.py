"""KV cache layout: placement arithmetic, views over the committed prefix, the reserve hook."""

from __future__ import annotations

import pytest
import torch

from vllm.attention.layer import Attention
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.utils.extensible_tensor import ExtensibleReserve, ExtensibleTensor
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    bind_kv_cache,
    get_kv_cache_config,
    reshape_kv_cache,
)
from vllm.v1.worker.kv_cache import allocate_and_reshape_kv_cache

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
# 2 (K, V) x 16 tokens x 2 heads x 8 dims x 2 bytes = 1024 bytes per block per layer
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)


def _specs(spec: FullAttentionSpec = SPEC) -> dict[str, FullAttentionSpec]:
    return {name: spec for name in LAYERS}


def test_page_size_counts_k_and_v():
    assert SPEC.page_size_bytes == 2 * 16 * 2 * 8 * 2 == 1024
    fp32 = FullAttentionSpec(block_size=32, num_kv_heads=8, head_size=128, dtype=torch.float32)
    assert fp32.page_size_bytes == 2 * 32 * 8 * 128 * 4
    assert get_kv_cache_config(_specs(), 1).bytes_per_block == 3 * 1024


def test_layer_outermost_placement():
    config = get_kv_cache_config(_specs(), num_blocks=10)
    assert config.block_stride == 1024
    assert config.layer_stride == 10 * 1024
    assert [t.offset for t in config.kv_cache_tensors] == [0, 10240, 20480]
    assert [t.layer_name for t in config.kv_cache_tensors] == LAYERS
    assert config.size_bytes == 3 * 10 * 1024
    assert config.segment_size_bytes == 10 * 1024
    assert config.num_segments == 3
    assert config.segment_bytes_for_blocks(4) == 4 * 1024


def test_bytes_and_blocks_helpers():
    config = get_kv_cache_config(_specs(), num_blocks=10)
    assert config.bytes_per_block == 3072
    assert config.bytes_for_blocks(7) == 7 * 3072
    assert config.max_blocks_for_bytes(7 * 3072) == 7
    assert config.max_blocks_for_bytes(7 * 3072 - 1) == 6
    assert config.max_blocks_for_bytes(-5) == 0
    assert config.tensor(LAYERS[1]).offset == 10240
    with pytest.raises(KeyError, match="no KV cache tensor for layer 'nope'"):
        config.tensor("nope")


def test_views_cover_committed_prefix_and_alias_backing():
    config = get_kv_cache_config(_specs(), num_blocks=10)
    backing = torch.zeros(config.size_bytes, dtype=torch.uint8)
    views = reshape_kv_cache(config, backing, num_blocks=4)
    base = backing.data_ptr()
    committed_end = [i * 10240 + 4 * 1024 for i in range(3)]  # past each committed prefix
    for i, name in enumerate(LAYERS):
        view = views[name]
        assert view.shape == (4, 2, 16, 2, 8)
        assert view.dtype == torch.bfloat16
        assert view.data_ptr() == base + config.tensor(name).offset
        assert view.is_contiguous()
        last = view[-1, -1, -1, -1, -1:]  # highest address the view reaches
        assert last.data_ptr() + 2 <= base + committed_end[i]
        assert view.stride(0) * 2 == config.block_stride
    # Writes through a view land at (layer offset + block x block_stride) in the backing.
    views[LAYERS[2]][3, 1, 0, 0, 0] = 1.0
    layer_off = config.tensor(LAYERS[2]).offset
    byte = layer_off + 3 * config.block_stride + 16 * 2 * 8 * 2  # V half starts after K
    one = torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8)
    assert torch.equal(backing[byte : byte + 2], one)
    assert int(backing.count_nonzero()) == int(one.count_nonzero())


def test_layer_views_do_not_overlap():
    config = get_kv_cache_config(_specs(), num_blocks=5)
    backing = torch.zeros(config.size_bytes, dtype=torch.uint8)
    views = reshape_kv_cache(config, backing, num_blocks=5)
    for i, name in enumerate(LAYERS):
        views[name].view(torch.int16).fill_(0x0101 * (i + 1))  # both bytes = i + 1
    # every byte belongs to exactly one layer: none left zero, none overwritten
    assert torch.equal(backing.bincount(minlength=4)[:4], torch.tensor([0, 1, 1, 1]) * 5 * 1024)
    for i, name in enumerate(LAYERS):
        assert bool((views[name].view(torch.uint8) == i + 1).all())


def test_default_allocation_is_zeroed_and_full_size():
    config = get_kv_cache_config(_specs(), num_blocks=6)
    allocation = allocate_and_reshape_kv_cache(config, "cpu")
    views = allocation.views
    assert allocation.backing.numel() == config.size_bytes  # what holds the memory, too
    assert set(views) == set(LAYERS)
    for view in views.values():
        assert view.shape == (6, 2, 16, 2, 8)
        assert int(view.count_nonzero()) == 0
    storage = views[LAYERS[0]].untyped_storage()
    assert storage.nbytes() == config.size_bytes
    assert all(v.untyped_storage().data_ptr() == storage.data_ptr() for v in views.values())


def test_reserve_hook_called_with_size_and_segments():
    config = get_kv_cache_config(_specs(), num_blocks=8)
    calls = []

    driver = HostVmmDriver()
    prefix = 3 * config.block_stride

    def reserve(size: int, num_segments: int) -> ExtensibleTensor:
        calls.append((size, num_segments))
        return ExtensibleReserve(driver, prefix)(size, num_segments)

    allocation = allocate_and_reshape_kv_cache(config, "cpu", reserve=reserve, num_blocks=3)
    assert calls == [(3 * 8 * 1024, 3)]  # one segment per layer
    views, reservation = allocation.views, allocation.backing
    assert isinstance(reservation, ExtensibleTensor)  # handed back, not left in the hook
    assert views[LAYERS[0]].shape[0] == 3
    # the views alias the reservation's committed prefixes (its zeroed pages)
    views[LAYERS[1]].view(torch.uint8).fill_(0xAB)
    segment = reservation.segment_view(1)
    assert int((segment == 0xAB).sum()) == 3 * 1024
    reservation.free()


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match="at least one attention layer"):
        get_kv_cache_config({}, 4)
    with pytest.raises(ValueError, match="num_blocks must be an int >= 1"):
        get_kv_cache_config(_specs(), 0)
    other = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one block_size, got 16: .*; 32: "):
        get_kv_cache_config({**_specs(), "x": other}, 4)
    wide = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one page size \(bytes\), got 1024: .*; 2048: "):
        get_kv_cache_config({**_specs(), "x": wide}, 4)
    with pytest.raises(ValueError, match="head_size must be a positive int, got 0"):
        FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=0, dtype=torch.float16)

    config = get_kv_cache_config(_specs(), num_blocks=4)
    with pytest.raises(ValueError, match=f"has {config.size_bytes - 1} bytes, the config needs"):
        reshape_kv_cache(config, torch.zeros(config.size_bytes - 1, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="1-D uint8 tensor, got dtype torch.float32"):
        reshape_kv_cache(config, torch.zeros(config.size_bytes), 4)
    with pytest.raises(ValueError, match=r"num_blocks must be in \[1, 4\].*got 5"):
        reshape_kv_cache(config, torch.zeros(config.size_bytes, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="returned NoneType, expected a reservation"):
        allocate_and_reshape_kv_cache(config, "cpu", reserve=lambda size, segments: None)


def test_bind_kv_cache_sets_each_layer():
    layers = {name: Attention(4, 8, 8**-0.5, num_kv_heads=2, prefix=name) for name in LAYERS}
    config = get_kv_cache_config(
        {n: layer.get_kv_cache_spec(16, torch.bfloat16) for n, layer in layers.items()}, 5
    )
    views = allocate_and_reshape_kv_cache(config, "cpu").views
    bind_kv_cache(views, layers)
    for name, layer in layers.items():
        assert layer.kv_cache is views[name]

    with pytest.raises(ValueError, match=r"layers without a cache \['model.layers.2"):
        bind_kv_cache({n: views[n] for n in LAYERS[:2]}, layers)
    with pytest.raises(ValueError, match=r"caches without a layer \['extra'\]"):
        bind_kv_cache({**views, "extra": views[LAYERS[0]]}, layers)
    wrong = {**views, LAYERS[0]: torch.zeros(5, 2, 16, 3, 8)}
    with pytest.raises(ValueError, match=r"does not match \(num_kv_heads, head_size\) = \(2, 8\)"):
        bind_kv_cache(wrong, layers)

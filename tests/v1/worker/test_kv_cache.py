"""The KV cache object on real host pages: both implementations behind one interface.

Views over committed blocks only, growth under a fixed base, committed spans
derived from the views (what a connector registers), release / recommit, and
the errors of each implementation.
"""

from __future__ import annotations

import pytest
import torch

from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.utils.extensible_tensor import ExtensibleReserve
from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_cache_config
from vllm.v1.outputs import KVCacheMemory
from vllm.v1.worker.kv_cache import (
    ClassicKVCacheBuffers,
    ExtensibleKVCacheBuffers,
    KVCacheBuffers,
    spans_of_views,
)

MiB = 1 << 20
CPU = torch.device("cpu")
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
# 2 x 16 tokens x 4 heads x 64 dims x 4 bytes = 32 KiB per block per layer;
# 2 MiB granule = 64 blocks.
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
PAGE = SPEC.page_size_bytes


def _config(num_blocks: int):
    return get_kv_cache_config({name: SPEC for name in LAYERS}, num_blocks)


@pytest.fixture
def driver() -> HostVmmDriver:
    return HostVmmDriver()


def test_classic_is_fully_committed_and_one_span(driver):
    kv = ClassicKVCacheBuffers(_config(10), CPU)
    assert isinstance(kv, KVCacheBuffers)
    views = kv.allocate(10)
    assert kv.committed_blocks == kv.capacity_blocks == 10
    assert kv.memory() == KVCacheMemory(3 * 10 * PAGE, 3 * 10 * PAGE, 10,
                                        physical_bytes=3 * 10 * PAGE, block_bytes=3 * PAGE)
    base = views[LAYERS[0]].data_ptr()
    assert kv.committed_spans() == [(base, 3 * 10 * PAGE)]  # the layers are adjacent
    assert kv.extend_kv_cache(10) is views  # equal count: a no-op
    with pytest.raises(ValueError, match="fixed size of 10 blocks; it cannot change to 12"):
        kv.extend_kv_cache(12)
    with pytest.raises(RuntimeError, match="sleep needs"):
        kv.release()
    with pytest.raises(ValueError, match="allocates its whole layout: 8 blocks asked"):
        ClassicKVCacheBuffers(_config(10), CPU).allocate(8)
    kv.free()
    assert kv.views == {} and kv.memory() == KVCacheMemory(0, 0, 0, block_bytes=3 * PAGE)


def test_extensible_grows_under_the_same_base_with_views_over_committed_blocks(driver):
    capacity = 256  # 4 granules per layer
    kv = ExtensibleKVCacheBuffers(_config(capacity), driver, CPU)
    views = kv.allocate(2)
    base = kv.tensor.base
    assert [v.shape[0] for v in views.values()] == [2, 2, 2]
    assert views[LAYERS[0]].data_ptr() == base
    # Two blocks' bytes committed; per segment the device holds them in one 2 MiB granule.
    assert kv.memory() == KVCacheMemory(3 * 2 * PAGE, 3 * capacity * PAGE, 2,
                                        physical_bytes=3 * 2 * MiB, block_bytes=3 * PAGE)
    views[LAYERS[1]][1].fill_(7.0)
    grown = kv.extend_kv_cache(100)
    assert [v.shape[0] for v in grown.values()] == [100, 100, 100]
    assert [v.data_ptr() for v in grown.values()] == [v.data_ptr() for v in views.values()]
    assert kv.tensor.base == base
    assert bool((grown[LAYERS[1]][1] == 7.0).all())  # data written before the growth
    assert int(grown[LAYERS[2]][2:].count_nonzero()) == 0  # new blocks read zero
    # One committed span per segment (layer), each exactly its committed blocks.
    layer_stride = capacity * PAGE
    assert kv.committed_spans() == [(base + i * layer_stride, 100 * PAGE) for i in range(3)]
    with pytest.raises(ValueError, match="extend_kv_cache only grows: 50 blocks < 100"):
        kv.extend_kv_cache(50)
    with pytest.raises(ValueError, match="cannot commit 257 KV blocks: the reservation holds 256"):
        kv.extend_kv_cache(257)
    kv.free()
    assert driver.num_reservations == 0 and driver.num_mappings == 0


def test_extensible_release_and_recommit_keep_addresses(driver):
    kv = ExtensibleKVCacheBuffers(_config(128), driver, CPU)
    kv.allocate(2)
    kv.extend_kv_cache(64)
    spans = kv.committed_spans()
    committed = kv.committed_bytes
    kv.views[LAYERS[0]][5].fill_(3.0)
    kv.release()
    assert kv.is_released and kv.committed_bytes == 0 and kv.committed_spans() == []
    with pytest.raises(RuntimeError, match="released"):
        kv.extend_kv_cache(100)
    kv.recommit()
    assert not kv.is_released and kv.committed_bytes == committed
    assert kv.committed_spans() == spans
    assert int(kv.views[LAYERS[0]].count_nonzero()) == 0  # fresh pages
    kv.free()


def test_a_views_storage_is_the_committed_bytes_and_its_address_fixed(driver):
    # Issue #16 item 1: upstream's contract. Before: every view's storage spanned
    # the whole reservation (3 x 1024 blocks), whatever was committed.
    kv = ExtensibleKVCacheBuffers(_config(1024), driver, CPU)
    kv.allocate(2)
    per_segment = 2 * PAGE
    view = kv.views[LAYERS[1]]
    ptr = view.data_ptr()
    assert view.untyped_storage().nbytes() == per_segment == 65536
    grown = kv.extend_kv_cache(40)[LAYERS[1]]
    assert grown.data_ptr() == ptr  # the same address after growth
    assert grown.untyped_storage().nbytes() == 20 * per_segment
    # The whole storage can be read without touching an uncommitted page.
    whole = torch.empty(0, dtype=torch.uint8).set_(grown.untyped_storage())
    assert whole.numel() == 20 * per_segment and int(whole.count_nonzero()) == 0
    assert sum(length for _, length in kv.committed_spans()) == 3 * 40 * PAGE
    assert spans_of_views({}) == []
    kv.free()


def test_extensible_reserve_hook_commits_a_prefix_per_segment(driver):
    reserve = ExtensibleReserve(driver, 3 * MiB)
    tensor = reserve(16 * MiB, 2)  # returned to the caller, nothing kept in the hook
    assert tensor.segment_sizes == (3 * MiB, 3 * MiB)
    assert tensor.full_view().numel() == 16 * MiB
    again = reserve(16 * MiB, 2)  # one hook, any number of reservations
    assert again.base != tensor.base
    tensor.free()
    again.free()


@pytest.mark.cuda
def test_cuda_extensible_cache_grows_under_a_captured_graph_and_spans_follow():
    from vllm.platforms import current_platform

    driver = current_platform.get_vmm_driver(0)
    assert driver.probe() is None
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    config = get_kv_cache_config({name: spec for name in LAYERS}, 4096)
    kv = ExtensibleKVCacheBuffers(config, driver, torch.device("cuda", 0))
    views = kv.allocate(2)
    layer = LAYERS[1]
    # A graph that writes block 1 of a layer through an index tensor, captured
    # while only the warmup blocks are committed.
    block = torch.ones(1, dtype=torch.int64, device="cuda")
    value = torch.full(views[layer].shape[1:], 3.0, dtype=torch.bfloat16, device="cuda")
    # Through the reservation (a view's own storage ends at the committed blocks).
    page = spec.page_size_bytes
    full = kv.tensor.full_view()[4096 * page:2 * 4096 * page].view(torch.bfloat16).view(
        4096, *views[layer].shape[1:])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        full.index_copy_(0, block, value.unsqueeze(0))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        full.index_copy_(0, block, value.unsqueeze(0))

    grown = kv.extend_kv_cache(3000)
    assert grown[layer].data_ptr() == views[layer].data_ptr()
    assert int(grown[layer][2:].count_nonzero()) == 0  # new blocks were zeroed on the GPU
    block.fill_(2999)  # a block that did not exist at capture
    graph.replay()
    torch.cuda.synchronize()
    assert bool((grown[layer][2999] == 3.0).all())
    assert grown[layer].untyped_storage().nbytes() == 3000 * page
    assert kv.committed_spans() == [
        (kv.tensor.base + i * 4096 * page, 3000 * page) for i in range(len(LAYERS))
    ]
    del graph
    kv.free()

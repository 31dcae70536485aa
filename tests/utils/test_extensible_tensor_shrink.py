"""ExtensibleTensor: segment views own their committed prefix; shrinking by whole chunks.

Issue #16 item 1 (a view's storage is its committed bytes) and the elastic KV
cache's shrink (issue #18), on real host pages and, marked `cuda`, on a GPU.
"""

import pytest
import torch

from tests.utils.test_extensible_tensor import MiB, _cuda_driver, rss_bytes
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.utils.extensible_tensor import ExtensibleTensor


def _cuda_et(caps):
    return ExtensibleTensor(caps, _cuda_driver())


def test_segment_view_storage_is_the_committed_prefix_at_a_fixed_address():
    driver = HostVmmDriver()
    et = ExtensibleTensor([8 * MiB, 8 * MiB], driver)
    et.grow_segments_([3 * MiB + 17, MiB])
    view = et.segment_view(1)
    assert view.untyped_storage().nbytes() == MiB  # not the 16 MiB reservation
    assert view.data_ptr() == et.base + 8 * MiB
    et.grow_segments_([3 * MiB + 17, 5 * MiB])
    grown = et.segment_view(1)
    assert grown.data_ptr() == view.data_ptr()
    assert grown.untyped_storage().nbytes() == 5 * MiB
    assert et.segment_view(0).untyped_storage().nbytes() == 3 * MiB + 17
    assert et.full_view().untyped_storage().nbytes() == 16 * MiB  # address arithmetic only
    et.free()


def test_shrink_releases_whole_tail_chunks_and_keeps_addresses_and_data():
    driver = HostVmmDriver()
    et = ExtensibleTensor([16 * MiB, 16 * MiB], driver)
    et.grow_segments_([2 * MiB, 2 * MiB])  # chunk A per segment
    et.grow_segments_([6 * MiB, 6 * MiB])  # chunk B per segment (2 granules each)
    et.segment_view(0)[: 2 * MiB].fill_(4)
    base, before = et.base, rss_bytes()
    # Shrinking into chunk B keeps it (a chunk is released whole) ...
    assert et.shrink_segments_([5 * MiB, 5 * MiB]) == 0
    assert et.segment_sizes == (5 * MiB, 5 * MiB) and et.physical_bytes == 12 * MiB
    # ... back to chunk A's end releases both B chunks (8 MiB) and their pages.
    assert et.shrink_segments_([2 * MiB, MiB]) == 8 * MiB
    assert et.physical_bytes == 4 * MiB and et.num_physical_chunks == 2
    assert before - rss_bytes() >= 7 * MiB
    assert et.base == base and int((et.segment_view(0) != 4).sum()) == 0
    with pytest.raises(ValueError, match="only shrinks"):
        et.shrink_segments_([3 * MiB, MiB])
    # Growing again maps fresh, zeroed pages at the same addresses.
    et.grow_segments_([6 * MiB, 6 * MiB])
    assert int(et.segment_view(1)[MiB:].count_nonzero()) == 0
    et.free()
    assert driver.num_mappings == 0


@pytest.mark.cuda
def test_cuda_shrink_releases_device_memory_and_a_graph_writes_into_the_regrown_range():
    g = _cuda_driver().granularity
    et = _cuda_et([64 * g, 64 * g])
    et.grow_segments_([2 * g, 2 * g])
    et.segment_view(0).fill_(3)
    # A graph captured now writes the last byte of a 40-granule prefix of segment 0.
    index = torch.tensor([40 * g - 1], dtype=torch.int64, device="cuda")
    value = torch.full((1,), 9, dtype=torch.uint8, device="cuda")
    target = et.full_view()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target.index_copy_(0, index, value)
    torch.cuda.synchronize()
    et.grow_segments_([40 * g, 40 * g])
    free_grown = torch.cuda.mem_get_info()[0]
    assert et.shrink_segments_([2 * g, 2 * g]) == 2 * 38 * g
    assert torch.cuda.mem_get_info()[0] - free_grown >= 2 * 38 * g  # really returned
    assert et.segment_view(0).untyped_storage().nbytes() == 2 * g
    et.grow_segments_([40 * g, 40 * g])  # fresh zeroed pages, same addresses
    graph.replay()
    torch.cuda.synchronize()
    s0 = et.segment_view(0)
    assert int((s0[: 2 * g] != 3).sum()) == 0 and int(s0[40 * g - 1]) == 9
    assert int(s0[2 * g: 40 * g - 1].count_nonzero()) == 0
    del graph
    et.free()

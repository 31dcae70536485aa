"""ExtensibleTensor on real pages (HostVmmDriver) and, marked `cuda`, on a GPU."""

import gc
import random

import psutil
import pytest
import torch

from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.device_allocator.vmm import VmmDriver, VmmError
from vllm.utils.extensible_tensor import ExtensibleTensor

MiB = 1 << 20
G = 2 * MiB  # host granularity


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), bytes."""
    return psutil.Process().memory_info().rss


class CountingDriver(VmmDriver):
    """Wraps a real driver: counts calls, can fail the n-th call of one kind, tracks handles."""

    def __init__(self, inner: VmmDriver, fresh_pages_zeroed: bool | None = None):
        self.inner = inner
        self.device = inner.device
        self.fresh_pages_zeroed = (
            inner.fresh_pages_zeroed if fresh_pages_zeroed is None else fresh_pages_zeroed
        )
        self.counts: dict[str, int] = {}
        self.fail_at: dict[str, int] = {}  # call name -> fail when its count reaches this
        self.live_handles: set[int] = set()

    def _tick(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1
        if self.fail_at.get(name) == self.counts[name]:
            raise VmmError(f"{name} failed with INJECTED_OUT_OF_MEMORY")

    def probe(self):
        return self.inner.probe()

    @property
    def granularity(self):
        return self.inner.granularity

    def reserve(self, size):
        self._tick("reserve")
        return self.inner.reserve(size)

    def create(self, size):
        self._tick("create")
        h = self.inner.create(size)
        self.live_handles.add(id(h))
        return h

    def map(self, va, size, handle):
        self._tick("map")
        self.inner.map(va, size, handle)

    def set_access(self, va, size):
        self._tick("set_access")
        self.inner.set_access(va, size)

    def unmap(self, va, size):
        self._tick("unmap")
        self.inner.unmap(va, size)

    def release(self, handle):
        self._tick("release")
        self.inner.release(handle)
        self.live_handles.discard(id(handle))

    def free_reservation(self, va, size):
        self._tick("free_reservation")
        self.inner.free_reservation(va, size)

    def synchronize(self):
        self.inner.synchronize()


@pytest.fixture
def host():
    return HostVmmDriver()


def committed_granules(et: ExtensibleTensor) -> set[int]:
    """Granules that must be mapped for the current sizes (the reference model)."""
    out = set()
    for off, size in zip(et.segment_offsets, et.segment_sizes, strict=True):
        if size:
            out.update(range(off // et.granularity, -(-(off + size) // et.granularity)))
    return out


# ------------------------------------------------------------- construction


def test_construction_reserves_without_committing(host):
    before = rss_bytes()
    et = ExtensibleTensor([512 * MiB, 512 * MiB], host)
    assert rss_bytes() - before < 8 * MiB
    assert et.capacity == 1024 * MiB and et.num_segments == 2
    assert et.segment_offsets == (0, 512 * MiB)
    assert et.segment_sizes == (0, 0)
    assert et.physical_bytes == 0 and et.num_physical_chunks == 0
    assert et.device == torch.device("cpu")
    full = et.full_view()
    assert full.dtype == torch.uint8 and full.shape == (1024 * MiB,)
    assert full.data_ptr() == et.base and et.base % G == 0
    assert et.segment_view(0).numel() == 0
    et.free()


def test_from_capacity_splits_evenly(host):
    et = ExtensibleTensor.from_capacity(30 * MiB, 3, host)
    assert et.segment_capacities == (10 * MiB,) * 3
    assert et.segment_offsets == (0, 10 * MiB, 20 * MiB)
    with pytest.raises(ValueError, match="capacity_bytes=10 must be a positive multiple of "
                                         "num_segments=3"):
        ExtensibleTensor.from_capacity(10, 3, host)
    et.free()


def test_constructor_errors(host):
    with pytest.raises(ValueError, match="segment_capacities is empty"):
        ExtensibleTensor([], host)
    with pytest.raises(ValueError, match=r"segment 1: segment capacity -5 is negative"):
        ExtensibleTensor([10, -5], host)
    with pytest.raises(ValueError, match=r"sum to 0 bytes"):
        ExtensibleTensor([0, 0], host)
    with pytest.raises(TypeError, match=r"segment 0: segment capacity must be an int"):
        ExtensibleTensor([1.5], host)
    assert host.num_reservations == 0


# ------------------------------------------------------------------- growth


def test_base_stable_and_data_intact_across_growth(host):
    et = ExtensibleTensor([40 * MiB, 40 * MiB], host)
    base = et.base
    full = et.full_view()
    et.grow_segments_([3 * MiB + 17, 1 * MiB])
    et.segment_view(0).copy_(torch.arange(3 * MiB + 17, dtype=torch.int64).to(torch.uint8))
    et.segment_view(1).fill_(5)
    for sizes in ([10 * MiB, 9 * MiB], [40 * MiB, 40 * MiB]):
        et.grow_segments_(sizes)
        assert et.base == base and et.full_view() is full and full.data_ptr() == base
        seg0 = et.segment_view(0)
        assert seg0.data_ptr() == base and seg0.numel() == sizes[0]
        expect = torch.arange(3 * MiB + 17, dtype=torch.int64).to(torch.uint8)
        assert torch.equal(seg0[: 3 * MiB + 17], expect)
        assert int((et.segment_view(1)[: 1 * MiB] != 5).sum()) == 0
    et.free()


def test_new_bytes_read_zero(host):
    et = ExtensibleTensor([8 * MiB, 8 * MiB], host)
    et.grow_segments_([1 * MiB, 1 * MiB])
    et.segment_view(0).fill_(1)
    et.segment_view(1).fill_(1)
    et.grow_segments_([8 * MiB, 6 * MiB])
    assert int(et.segment_view(0)[1 * MiB:].count_nonzero()) == 0
    assert int(et.segment_view(1)[1 * MiB:].count_nonzero()) == 0
    assert int(et.segment_view(0)[: 1 * MiB].sum()) == 1 * MiB
    et.free()


def test_zeroing_on_drivers_without_zeroed_pages_covers_exposed_bytes_only(host):
    # A driver that does not promise zero pages: the tensor must zero what it exposes,
    # including bytes in a granule mapped earlier, and must not clobber live data.
    d = CountingDriver(host, fresh_pages_zeroed=False)
    et = ExtensibleTensor([3 * MiB, 3 * MiB], d)
    et.grow_segments_([1 * MiB, 0])  # maps granule 0 = [0, 2 MiB)
    et.segment_view(0).fill_(9)
    et.full_view()[1 * MiB: 2 * MiB].fill_(0xEE)  # garbage in the mapped, unexposed tail
    et.grow_segments_([2 * MiB, 3 * MiB])
    seg0 = et.segment_view(0)
    assert int((seg0[: 1 * MiB] != 9).sum()) == 0  # old data kept
    assert int(seg0[1 * MiB:].count_nonzero()) == 0  # newly exposed bytes zeroed
    assert int(et.segment_view(1).count_nonzero()) == 0
    et.free()


def test_host_commit_is_resident_and_release_returns_it(host):
    # Issue #18: committed means resident (measured free memory is honest).
    et = ExtensibleTensor([256 * MiB], host)
    before = rss_bytes()
    et.grow_segments_([256 * MiB], zero_new=True)
    assert et.physical_bytes == 256 * MiB
    assert rss_bytes() - before >= 240 * MiB  # resident without being touched
    et.release_physical()
    assert rss_bytes() - before < 16 * MiB
    et.free()


def test_one_driver_allocation_per_segment_per_growth(host):
    d = CountingDriver(host)
    et = ExtensibleTensor([64 * MiB] * 4, d)
    et.grow_segments_([10 * MiB, 20 * MiB, 0, 64 * MiB])
    assert d.counts["create"] == 3 and et.num_physical_chunks == 3
    et.grow_segments_([30 * MiB, 20 * MiB, 5 * MiB, 64 * MiB])
    assert d.counts["create"] == 5  # segments 0 and 2 grew; 1 and 3 did not
    assert d.counts["create"] == d.counts["map"] == d.counts["set_access"]
    et.grow_segments_([30 * MiB, 20 * MiB, 5 * MiB, 64 * MiB])  # no-op
    assert d.counts["create"] == 5
    assert et.physical_bytes == len(committed_granules(et)) * G
    et.free()


def test_shared_granule_is_mapped_once(host):
    # 3 MiB segments on 2 MiB granules: granule 1 holds the end of segment 0 and
    # the start of segment 1. HostVmmDriver refuses to map a range twice.
    d = CountingDriver(host)
    et = ExtensibleTensor([3 * MiB, 3 * MiB], d)
    et.grow_segments_([3 * MiB, 3 * MiB])
    assert et.physical_bytes == 6 * MiB  # 3 granules, not 4
    assert et.physical_chunks() == [(0, 4 * MiB), (4 * MiB, 2 * MiB)]
    et.segment_view(0).fill_(1)
    et.segment_view(1).fill_(2)
    assert int(et.full_view().sum(dtype=torch.int64)) == 3 * MiB * 3
    et.release_physical()
    et.recommit_()  # same sizes, mapped once again
    assert et.physical_bytes == 6 * MiB and et.num_physical_chunks == 2
    et.free()


def test_shared_granule_grown_from_the_second_segment_first(host):
    et = ExtensibleTensor([3 * MiB, 3 * MiB], host)
    et.grow_segments_([0, 1])  # segment 1 maps granule 1 (shared)
    assert et.physical_chunks() == [(2 * MiB, 2 * MiB)]
    et.grow_segments_([3 * MiB, 1])  # segment 0 needs granules 0-1: only 0 is missing
    assert et.physical_chunks() == [(0, 2 * MiB), (2 * MiB, 2 * MiB)]
    et.grow_segments_([3 * MiB, 3 * MiB])
    assert et.physical_bytes == 6 * MiB
    et.free()


def test_random_growth_matches_granule_model(host):
    rng = random.Random(1234)
    caps = [rng.randrange(1, 9 * MiB) for _ in range(7)]
    et = ExtensibleTensor(caps, host)
    sizes = [0] * len(caps)
    for _ in range(12):
        sizes = [min(c, s + rng.choice([0, 0, rng.randrange(1, 3 * MiB)]))
                 for c, s in zip(caps, sizes, strict=True)]
        et.grow_segments_(sizes)
        assert list(et.segment_sizes) == sizes
        assert et.physical_bytes == len(committed_granules(et)) * G  # each granule once
        assert host.num_mappings == et.num_physical_chunks
    for i in range(len(caps)):
        et.segment_view(i).fill_(i + 1)
    for i in range(len(caps)):
        assert int((et.segment_view(i) != i + 1).sum()) == 0  # no segment overlaps another
    et.free()


# ------------------------------------------------------------------ errors


def test_resize_errors_name_the_numbers(host):
    et = ExtensibleTensor([4 * MiB, 4 * MiB], host)
    et.grow_segments_([2 * MiB, 1000])
    with pytest.raises(ValueError, match=r"expected 2 sizes \(one per segment\), got 3"):
        et.grow_segments_([1, 2, 3])
    with pytest.raises(ValueError, match=r"segment 1: size -1 is negative"):
        et.grow_segments_([2 * MiB, -1])
    with pytest.raises(ValueError, match=rf"segment 0: size {4 * MiB + 1} bytes exceeds its "
                                         rf"capacity {4 * MiB} bytes"):
        et.grow_segments_([4 * MiB + 1, 1000])
    with pytest.raises(ValueError, match=r"segment 1: size 999 bytes is below its committed "
                                         r"size 1000 bytes"):
        et.grow_segments_([2 * MiB, 999])
    with pytest.raises(TypeError, match="segment 0: size must be an int"):
        et.grow_segments_([2.0 * MiB, 1000])
    with pytest.raises(IndexError, match="segment index 2 out of range for 2 segments"):
        et.segment_view(2)
    assert et.segment_sizes == (2 * MiB, 1000)  # nothing changed
    et.free()


@pytest.mark.parametrize(("call", "nth"), [("create", 2), ("map", 3), ("set_access", 2)])
def test_failure_part_way_rolls_back(host, call, nth):
    d = CountingDriver(host)
    et = ExtensibleTensor([8 * MiB] * 3, d)
    et.grow_segments_([1 * MiB, 0, 0])
    et.segment_view(0).fill_(3)
    before = (et.segment_sizes, et.physical_chunks(), host.num_mappings)
    d.counts.clear()
    d.fail_at[call] = nth
    with pytest.raises(VmmError, match="INJECTED_OUT_OF_MEMORY"):
        et.grow_segments_([8 * MiB, 8 * MiB, 8 * MiB])
    assert (et.segment_sizes, et.physical_chunks(), host.num_mappings) == before
    assert len(d.live_handles) == et.num_physical_chunks  # every rolled-back handle released
    assert int((et.segment_view(0) != 3).sum()) == 0
    d.fail_at.clear()
    et.grow_segments_([8 * MiB, 8 * MiB, 8 * MiB])  # a retry works
    assert et.physical_bytes == 24 * MiB
    et.free()
    assert (host.num_mappings, host.num_reservations, len(d.live_handles)) == (0, 0, 0)


def test_use_after_free_and_double_free(host):
    et = ExtensibleTensor([4 * MiB], host)
    et.grow_segments_([1 * MiB])
    et.free()
    et.free()  # safe
    assert et.is_freed and host.num_reservations == 0 and host.num_mappings == 0
    for fn in (et.full_view, lambda: et.segment_view(0), lambda: et.grow_segments_([2 * MiB]),
               et.release_physical, et.recommit_, et.defragment_):
        with pytest.raises(RuntimeError, match=r"used after free\(\)"):
            fn()


def test_recommit_without_release_is_an_error(host):
    et = ExtensibleTensor([4 * MiB], host)
    with pytest.raises(RuntimeError, match=r"needs a prior release_physical\(\)"):
        et.recommit_()
    et.free()


# ------------------------------------------------------- release / recommit


def test_release_drops_rss_and_recommit_brings_it_back(host):
    size = 96 * MiB
    et = ExtensibleTensor([size // 2, size // 2], host)
    base = et.base
    r0 = rss_bytes()
    et.grow_segments_([size // 2, size // 2 - 12345])
    et.full_view()[: size - 12345].fill_(7)
    r1 = rss_bytes()
    assert r1 - r0 >= 0.9 * size
    sizes = et.segment_sizes
    et.release_physical()
    r2 = rss_bytes()
    assert r1 - r2 >= 0.9 * size  # pages really gone
    assert et.is_released and et.physical_bytes == 0 and et.num_physical_chunks == 0
    assert et.segment_view(0).numel() == 0 and et.segment_sizes == (0, 0)
    et.release_physical()  # second call: no-op
    et.recommit_()
    assert et.base == base and et.full_view().data_ptr() == base
    assert et.segment_sizes == sizes and not et.is_released
    assert et.num_physical_chunks == 2  # one allocation per segment
    assert int(et.segment_view(0).count_nonzero()) == 0  # fresh zeroed pages
    assert rss_bytes() - r2 >= 0.9 * size  # resident again on recommit (issue #18)
    et.free()


def test_failed_recommit_stays_released_and_can_retry(host):
    d = CountingDriver(host)
    et = ExtensibleTensor([4 * MiB, 4 * MiB], d)
    et.grow_segments_([4 * MiB, 4 * MiB])
    et.release_physical()
    d.counts.clear()
    d.fail_at["map"] = 2
    with pytest.raises(VmmError):
        et.recommit_()
    assert et.is_released and et.physical_bytes == 0 and host.num_mappings == 0
    d.fail_at.clear()
    et.recommit_()
    assert et.segment_sizes == (4 * MiB, 4 * MiB) and et.physical_bytes == 8 * MiB
    et.free()


def test_release_then_commit_smaller_sizes(host):
    et = ExtensibleTensor([8 * MiB, 8 * MiB], host)
    base = et.base
    et.grow_segments_([8 * MiB, 8 * MiB])
    et.segment_view(0).fill_(1)
    et.release_physical()
    assert et.is_released and et.segment_sizes == (0, 0)
    et.grow_segments_([2 * MiB, 2 * MiB])  # smaller than before the release
    assert not et.is_released
    with pytest.raises(RuntimeError, match="needs a prior release_physical"):
        et.recommit_()  # the sizes from before the release are gone
    assert et.base == base and et.physical_bytes == 4 * MiB
    assert int(et.segment_view(0).count_nonzero()) == 0
    et.free()


def test_defragment_leaves_one_chunk_per_segment(host):
    et = ExtensibleTensor([16 * MiB] * 3, host)
    base = et.base
    for step in range(1, 5):
        et.grow_segments_([4 * MiB * step - 1] * 3)
    assert et.num_physical_chunks == 12
    et.segment_view(2).fill_(4)
    sizes = et.segment_sizes
    et.defragment_()
    assert et.num_physical_chunks == 3
    assert et.physical_chunks() == [(0, 16 * MiB), (16 * MiB, 16 * MiB), (32 * MiB, 16 * MiB)]
    assert et.segment_sizes == sizes and et.base == base
    assert int(et.segment_view(2).count_nonzero()) == 0  # contents discarded
    et.release_physical()
    et.defragment_()  # released stays released
    assert et.is_released and et.num_physical_chunks == 0
    et.free()


# --------------------------------------------------------------- lifetime


def test_finalizer_releases_when_tensor_and_views_die(host):
    et = ExtensibleTensor([4 * MiB, 4 * MiB], host)
    et.grow_segments_([4 * MiB, 1])
    view = et.segment_view(0)
    view.fill_(2)
    del et
    gc.collect()
    assert host.num_reservations == 1  # the view keeps the memory alive
    assert int(view.sum(dtype=torch.int64)) == 2 * 4 * MiB
    del view
    gc.collect()
    assert host.num_reservations == 0 and host.num_mappings == 0


# ---------------------------------------------------------------------- GPU


def _cuda_driver() -> VmmDriver:
    from vllm.platforms import current_platform

    driver = current_platform.get_vmm_driver(torch.cuda.current_device())
    assert driver.probe() is None, driver.probe()
    return driver


def _cuda_et(caps):
    return ExtensibleTensor(caps, _cuda_driver())


@pytest.mark.cuda
def test_cuda_growth_semantics():
    g = _cuda_driver().granularity
    et = _cuda_et([3 * g // 2 * 5, 3 * g // 2 * 5])  # odd segment boundaries
    base = et.base
    full = et.full_view()
    assert full.device.type == "cuda" and full.data_ptr() == base
    et.grow_segments_([g + 5, 3])
    et.segment_view(0).fill_(7)
    et.segment_view(1).fill_(8)
    et.grow_segments_(list(et.segment_capacities))
    torch.cuda.synchronize()
    assert et.base == base and et.full_view().data_ptr() == base
    s0, s1 = et.segment_view(0), et.segment_view(1)
    assert int((s0[: g + 5] != 7).sum()) == 0 and int(s0[g + 5:].count_nonzero()) == 0
    assert int((s1[:3] != 8).sum()) == 0 and int(s1[3:].count_nonzero()) == 0
    assert et.physical_bytes == len(committed_granules(et)) * g  # shared granule once
    et.release_physical()
    assert et.physical_bytes == 0
    et.recommit_()
    assert et.base == base and int(et.full_view().count_nonzero()) == 0
    et.defragment_()
    assert et.num_physical_chunks == 2
    et.free()


@pytest.mark.cuda
def test_cuda_mem_get_info_follows_commits():
    g = _cuda_driver().granularity
    commit = 2048 * MiB
    et = _cuda_et([commit + g, commit + g])
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    et.grow_segments_([commit, commit])
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    assert abs((free0 - free1) - 2 * commit) <= 32 * MiB
    et.release_physical()
    free2, _ = torch.cuda.mem_get_info()
    assert abs(free2 - free0) <= 32 * MiB
    et.recommit_()
    free3, _ = torch.cuda.mem_get_info()
    assert abs(free3 - free1) <= 32 * MiB
    et.free()
    free4, _ = torch.cuda.mem_get_info()
    assert abs(free4 - free0) <= 32 * MiB


@pytest.mark.cuda
def test_cuda_graph_captured_before_growth_writes_into_grown_region():
    # Mirrors KV writes through a slot mapping: the graph captures a scatter at
    # base + index where the index lives in a device tensor; after growth the
    # index points into pages that did not exist at capture, and the replay
    # writes there (and a captured gather reads from there).
    g = _cuda_driver().granularity
    capacity = 4096 * MiB
    et = _cuda_et([capacity])
    et.grow_segments_([g])  # small prefix at capture time
    full = et.full_view()
    index = torch.zeros(4, dtype=torch.int64, device="cuda")
    values = torch.tensor([11, 22, 33, 44], dtype=torch.uint8, device="cuda")
    out = torch.zeros(4, dtype=torch.uint8, device="cuda")
    index.copy_(torch.arange(4, device="cuda"))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside capture
            full.index_put_((index,), values)
            torch.index_select(full, 0, index, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        full.index_put_((index,), values)
        torch.index_select(full, 0, index, out=out)

    et.grow_segments_([capacity])  # grow by ~4 GiB under the captured graph
    assert et.full_view().data_ptr() == full.data_ptr() == et.base
    targets = torch.tensor([capacity - 4, capacity - 3, 3 * g + 1, g], device="cuda")
    index.copy_(targets)
    values.copy_(torch.tensor([5, 6, 7, 8], dtype=torch.uint8))
    graph.replay()
    torch.cuda.synchronize()
    assert full[targets].tolist() == [5, 6, 7, 8]
    assert out.tolist() == [5, 6, 7, 8]
    assert int(full.sum(dtype=torch.int64)) == 5 + 6 + 7 + 8 + 11 + 22 + 33 + 44
    del graph
    et.free()


@pytest.mark.cuda
def test_cuda_oom_part_way_rolls_back_and_leaks_nothing():
    _, total = torch.cuda.mem_get_info()
    g = _cuda_driver().granularity
    half = (int(total * 0.6) // g) * g
    et = _cuda_et([half, half])  # together more than the device holds
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    with pytest.raises(VmmError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        et.grow_segments_([half, half])  # segment 0 fits, segment 1 does not
    free1, _ = torch.cuda.mem_get_info()
    assert abs(free1 - free0) <= 32 * MiB
    assert et.segment_sizes == (0, 0) and et.physical_bytes == 0
    et.grow_segments_([g, g])  # still usable
    assert et.physical_bytes == 2 * g
    et.free()

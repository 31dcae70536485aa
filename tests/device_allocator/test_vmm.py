"""VmmDriver backends: the host backend with real pages, CUDA/HIP logic at their binding boundary.

The CUDA driver is checked against the *real* `cuda.bindings.driver`: each call
runs the real function (whose argument conversion rejects wrong types) and only
the missing libcuda is simulated. The HIP driver is checked against a fake `hip`
module injected where hip-python is imported. GPU tests are marked `cuda`.
"""

import ctypes
import enum
import importlib
import sys
import types

import psutil
import pytest
import torch

from vllm.device_allocator import vmm
from vllm.device_allocator.gpu_vmm import CudaVmmDriver, HipVmmDriver
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.device_allocator.vmm import MIN_GRANULARITY, VmmError

MiB = 1 << 20


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), bytes."""
    return psutil.Process().memory_info().rss


def host_bytes(va: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(va), dtype=torch.uint8)


def commit(d, size: int) -> tuple[int, object, int]:
    """Reserve `size` bytes and map fresh pages over all of it, read-write.

    Returns (va, handle, this process's RSS in bytes just before the map)."""
    va = d.reserve(size)
    h = d.create(size)
    before = rss_bytes()
    d.map(va, size, h)
    d.set_access(va, size)
    return va, h, before


def remap_reads_zero_then_free(d, va: int, size: int, h) -> None:
    """After `d.unmap(va, size)`: release `h`, map fresh pages at the same address and
    check they read zero (nothing of the old contents survives), then free it all."""
    d.release(h)
    h2 = d.create(size)
    d.map(va, size, h2)
    assert int(host_bytes(va, size).count_nonzero()) == 0
    d.unmap(va, size)
    d.release(h2)
    d.free_reservation(va, size)


def full_cycle(d, size: int) -> tuple[int, object]:
    """Every driver call once, in the order the KV cache makes them; (va, handle)."""
    va = d.reserve(size)
    h = d.create(size)
    d.map(va, size, h)
    d.set_access(va, size)
    d.synchronize()
    d.unmap(va, size)
    d.release(h)
    d.free_reservation(va, size)
    return va, h


# --------------------------------------------------------------------- host


def test_host_probe_and_granularity():
    d = HostVmmDriver()
    assert d.probe() is None
    assert d.granularity == MIN_GRANULARITY == 2 * MiB
    assert d.fresh_pages_zeroed is True
    assert d.device == torch.device("cpu")


def test_host_reserve_is_aligned_and_costs_no_memory():
    d = HostVmmDriver()
    before = rss_bytes()
    va = d.reserve(1 << 30)
    assert va % d.granularity == 0
    assert rss_bytes() - before < 8 * MiB
    d.free_reservation(va, 1 << 30)
    assert d.num_reservations == 0


@pytest.mark.parametrize("madvise", [True, False], ids=["MADV_POPULATE_WRITE", "touch"])
def test_host_map_makes_pages_resident_reads_zero_and_unmap_drops_pages(madvise):
    # Issue #18: a host commit means resident pages (before: only a protection
    # change, so RSS grew only when the pages were touched).
    d = HostVmmDriver()
    d.populate_with_madvise = madvise  # False: the pre-5.14 fallback (memset)
    size = 64 * MiB
    va, h, base_rss = commit(d, size)
    assert rss_bytes() - base_rss >= 0.9 * size  # resident on commit, untouched
    view = host_bytes(va, size)
    assert int(view.count_nonzero()) == 0  # fresh pages read zero
    view.fill_(0xAB)
    touched = rss_bytes()
    d.unmap(va, size)
    assert touched - rss_bytes() >= 0.9 * size  # MADV_DONTNEED dropped them
    remap_reads_zero_then_free(d, va, size, h)
    assert (d.num_mappings, d.num_reservations) == (0, 0)


def test_host_map_without_prefault_costs_only_the_pages_written():
    # Issue 48: the CPU's static KV cache commits lazily; a page is resident once written.
    d = HostVmmDriver(prefault=False)
    size = 64 * MiB
    va, h, base_rss = commit(d, size)
    assert rss_bytes() - base_rss < 4 * MiB  # committed, not resident
    view = host_bytes(va, size)
    view[: 8 * MiB].fill_(0xAB)
    grown = rss_bytes() - base_rss
    assert 7 * MiB <= grown < 12 * MiB  # the 8 MiB written, not the 64 committed
    assert int(view[8 * MiB:].count_nonzero()) == 0  # unwritten pages read zero
    d.unmap(va, size)
    assert rss_bytes() - base_rss < 4 * MiB  # MADV_DONTNEED dropped what was written
    remap_reads_zero_then_free(d, va, size, h)
    assert (d.num_mappings, d.num_reservations) == (0, 0)


def test_the_cpu_platform_commits_a_fixed_kv_cache_lazily_and_an_elastic_one_at_once():
    from vllm.platforms.cpu import CpuPlatform

    platform = CpuPlatform()
    assert platform.get_kv_cache_vmm_driver(0).prefault is False
    assert platform.get_kv_cache_vmm_driver(0, elastic=True) is platform.get_vmm_driver(0)
    assert platform.get_vmm_driver(0).prefault is True  # weights arena, elastic cache


def test_host_bookkeeping_errors_name_the_problem():
    d = HostVmmDriver()
    g = d.granularity
    va = d.reserve(4 * g)
    with pytest.raises(VmmError, match="not a non-negative multiple of the granularity"):
        d.reserve(g + 1)
    with pytest.raises(VmmError, match="size=100"):
        d.create(100)
    h = d.create(2 * g)
    with pytest.raises(VmmError, match="not inside a reservation"):
        d.map(va + 3 * g, 2 * g, h)
    d.map(va, 2 * g, h)
    h2 = d.create(2 * g)
    with pytest.raises(VmmError, match="overlaps the mapping"):
        d.map(va + g, 2 * g, h2)
    with pytest.raises(VmmError, match="not a fresh HostPages handle"):
        d.map(va + 2 * g, 2 * g, h)  # already mapped
    with pytest.raises(VmmError, match="only 0 of"):
        d.set_access(va + 2 * g, 2 * g)
    with pytest.raises(VmmError, match="not a union of whole mappings"):
        d.unmap(va, g)  # half a mapping
    with pytest.raises(VmmError, match="still mapped"):
        d.release(h)
    with pytest.raises(VmmError, match="mappings still inside"):
        d.free_reservation(va, 4 * g)
    with pytest.raises(VmmError, match="no reservation of size"):
        d.free_reservation(va, 2 * g)
    d.unmap(va, 2 * g)
    d.release(h)
    with pytest.raises(VmmError, match="not a live HostPages handle"):
        d.release(h)
    d.release(h2)
    d.free_reservation(va, 4 * g)


def test_host_unmap_may_cover_several_whole_mappings():
    d = HostVmmDriver()
    g = d.granularity
    va = d.reserve(3 * g)
    hs = [d.create(g) for _ in range(3)]
    for i, h in enumerate(hs):
        d.map(va + i * g, g, h)
    d.set_access(va, 3 * g)
    d.unmap(va, 3 * g)
    assert d.num_mappings == 0
    for h in hs:
        d.release(h)
    d.free_reservation(va, 3 * g)


# -------------------------------------------------- CUDA at the real bindings

cuda_driver_mod = pytest.importorskip("cuda.bindings.driver")


def _libcuda_present() -> bool:
    try:
        cuda_driver_mod.cuInit(0)
    except Exception:
        return False
    return True


needs_no_libcuda = pytest.mark.skipif(
    _libcuda_present(), reason="a CUDA driver is present; the real GPU tests cover it"
)


class ArgCheckingCuda:
    """`cuda.bindings.driver` whose functions run for real up to the missing libcuda.

    The real wrapper converts (and type-checks) every argument before it loads
    libcuda, so a wrong argument type raises TypeError here exactly as on a GPU;
    a call that gets past conversion then gets a simulated result.
    """

    def __init__(self, fail: dict | None = None):
        self._real = cuda_driver_mod
        self.calls: list[tuple[str, tuple]] = []
        self.fail = fail or {}  # function name -> CUresult to return instead
        self.current_ctx = cuda_driver_mod.CUcontext(0)
        self._next_va = 1 << 40
        self._next_handle = 1

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if not (name.startswith("cu") and callable(attr)):
            return attr  # types and enums are the real ones

        def call(*args):
            try:
                attr(*args)
            except (TypeError, ValueError, AttributeError, OverflowError) as e:
                raise AssertionError(f"real {name}{args!r} rejected its arguments: {e}") from e
            except Exception:
                pass  # reached the (missing) driver library: arguments were accepted
            self.calls.append((name, args))
            return self._result(name, args)

        return call

    def _result(self, name, args):
        d, ok = self._real, self._real.CUresult.CUDA_SUCCESS
        if name in self.fail:
            return (self.fail[name], None)
        if name == "cuGetErrorName":
            return (ok, args[0].name.encode())
        if name == "cuDeviceGet":
            return (ok, d.CUdevice(args[0]))
        if name == "cuDeviceGetCount":
            return (ok, 1)
        if name == "cuDeviceGetAttribute":
            return (ok, 1)
        if name == "cuDevicePrimaryCtxRetain":
            return (ok, d.CUcontext(0x5000))
        if name == "cuCtxGetCurrent":
            return (ok, self.current_ctx)
        if name == "cuCtxSetCurrent":
            self.current_ctx = args[0]
            return (ok,)
        if name == "cuMemGetAllocationGranularity":
            return (ok, 2 * MiB)
        if name == "cuMemAddressReserve":
            va, self._next_va = self._next_va, self._next_va + args[0] + (1 << 30)
            return (ok, d.CUdeviceptr(va))
        if name == "cuMemCreate":
            self._next_handle += 1
            return (ok, d.CUmemGenericAllocationHandle(self._next_handle))
        return (ok,)

    def names(self):
        return [n for n, _ in self.calls]


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = ArgCheckingCuda()
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    return fake


def test_arg_checker_itself_rejects_wrong_types(fake_cuda):
    with pytest.raises(AssertionError, match="rejected its arguments"):
        fake_cuda.cuMemCreate(2 * MiB, "not a prop", 0)


@needs_no_libcuda
def test_cuda_probe_here_says_no_driver():
    reason = CudaVmmDriver(0).probe()
    assert reason is not None and reason.startswith("no CUDA driver")


def test_cuda_probe_never_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # import -> ImportError
    assert "cuda-bindings (cuda-python) is not installed" in CudaVmmDriver(0).probe()
    broken = types.SimpleNamespace(cuInit=lambda flags: 1 / 0)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", broken)
    assert "ZeroDivisionError" in CudaVmmDriver(0).probe()
    weird = types.SimpleNamespace(cuInit=lambda flags: "garbage")
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", weird)
    assert CudaVmmDriver(0).probe().startswith("CUDA VMM probe failed")


@needs_no_libcuda
def test_cuda_probe_reasons_at_the_binding_boundary(fake_cuda, monkeypatch):
    ok = cuda_driver_mod.CUresult
    fake_cuda.fail["cuInit"] = ok.CUDA_ERROR_NO_DEVICE
    assert CudaVmmDriver(0).probe() == "no CUDA device: cuInit reported CUDA_ERROR_NO_DEVICE"
    del fake_cuda.fail["cuInit"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch cannot use CUDA" in CudaVmmDriver(0).probe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fake_cuda, "_result", _with(fake_cuda._result, "cuDeviceGetAttribute", 0))
    assert "does not support virtual memory management" in CudaVmmDriver(0).probe()
    monkeypatch.undo()


def _with(result_fn, name, value):
    ok = cuda_driver_mod.CUresult.CUDA_SUCCESS
    return lambda n, args: (ok, value) if n == name else result_fn(n, args)


@needs_no_libcuda
def test_cuda_probe_passes_with_a_driver_and_leaves_no_context(fake_cuda, monkeypatch):
    # The probe runs where the config is built (`vllm serve`'s API server): the
    # primary context it retains for the granularity query is released again and
    # the thread's current context restored, so that process holds no device memory.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    driver = CudaVmmDriver(0)
    assert driver.probe() is None
    names = fake_cuda.names()
    assert names.count("cuDevicePrimaryCtxRetain") == names.count("cuDevicePrimaryCtxRelease") == 1
    assert names.index("cuDevicePrimaryCtxRetain") < names.index("cuDevicePrimaryCtxRelease")
    assert int(fake_cuda.current_ctx) == 0
    # A second probe (the offline LLM probes in its config and again in its worker)
    # retains and releases once more: never a release without its retain.
    assert driver.probe() is None
    names = fake_cuda.names()
    assert names.count("cuDevicePrimaryCtxRetain") == names.count("cuDevicePrimaryCtxRelease") == 2
    # The driver still works afterwards: its next use retains the context again.
    driver.reserve(2 * MiB)
    assert fake_cuda.names().count("cuDevicePrimaryCtxRetain") == 3
    assert int(fake_cuda.current_ctx) == 0x5000
    # A probe of a driver in use (another engine of this process) releases nothing.
    assert driver.probe() is None
    names = fake_cuda.names()
    counts = names.count("cuDevicePrimaryCtxRetain"), names.count("cuDevicePrimaryCtxRelease")
    assert counts == (3, 2)
    assert int(fake_cuda.current_ctx) == 0x5000


@needs_no_libcuda
def test_cuda_driver_call_sequence_against_real_bindings(fake_cuda):
    d = CudaVmmDriver(1)
    assert d.granularity == 2 * MiB
    assert d.device == torch.device("cuda", 1)
    dev_type = cuda_driver_mod.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop, access = d._prop, d._access
    assert prop.type == cuda_driver_mod.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert (prop.location.type, prop.location.id) == (dev_type, 1)
    assert (access.location.type, access.location.id) == (dev_type, 1)
    assert access.flags == cuda_driver_mod.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert [int(a[0]) for n, a in fake_cuda.calls if n == "cuDeviceGet"] == [1]
    fake_cuda.calls.clear()
    size = 8 * MiB
    va, h = full_cycle(d, size)
    mem_calls = [(n, a) for n, a in fake_cuda.calls if n.startswith("cuMem") or n == "cuCtxSync"
                 or n == "cuCtxSynchronize"]
    assert [n for n, _ in mem_calls] == [
        "cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
        "cuCtxSynchronize", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree",
    ]
    args = dict(mem_calls)
    assert args["cuMemAddressReserve"][:2] == (size, 2 * MiB)
    assert args["cuMemCreate"][0] == size and args["cuMemCreate"][2] == 0
    assert int(args["cuMemMap"][0]) == va and args["cuMemMap"][1:3] == (size, 0)
    assert args["cuMemMap"][3] is h
    assert int(args["cuMemSetAccess"][0]) == va and args["cuMemSetAccess"][3] == 1
    assert int(args["cuMemAddressFree"][0]) == va and args["cuMemAddressFree"][1] == size


@needs_no_libcuda
def test_cuda_driver_error_names_call_error_and_sizes(fake_cuda):
    d = CudaVmmDriver(0)
    fake_cuda.fail["cuMemCreate"] = cuda_driver_mod.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(VmmError) as exc:
        d.create(64 * MiB)
    msg = str(exc.value)
    assert "cuMemCreate" in msg and "CUDA_ERROR_OUT_OF_MEMORY" in msg
    assert f"size={64 * MiB}" in msg and "device 0" in msg
    with pytest.raises(VmmError, match="not a non-negative multiple"):
        d.create(3 * MiB)


# ------------------------------------------------------- HIP with a fake hip


class HipError(enum.IntEnum):
    hipSuccess = 0
    hipErrorOutOfMemory = 2


class _HipStructWithLocation:
    """Like hip-python's structs: `location` is a read-only view, filled in place."""

    def __init__(self):
        self._location = types.SimpleNamespace(type=None, id=None)

    @property
    def location(self):
        return self._location


class FakeHip(types.ModuleType):
    """The slice of hip-python's `hip.hip` that HipVmmDriver uses; tuples (err, value)."""

    def __init__(self, version: int, granularity: int = 4096):
        super().__init__("hip.hip")
        self.version, self.gran = version, granularity
        self.calls: list[tuple[str, tuple]] = []
        self.fail: dict[str, HipError] = {}
        ns = types.SimpleNamespace
        self.hipError_t = HipError
        self.hipMemLocationType = ns(hipMemLocationTypeDevice="DEV")
        self.hipMemAllocationType = ns(hipMemAllocationTypePinned="PINNED")
        self.hipMemAccessFlags = ns(hipMemAccessFlagsProtReadWrite="RW")
        self.hipMemAllocationGranularity_flags = ns(hipMemAllocationGranularityMinimum="MIN")
        self.hipDeviceAttribute_t = ns(hipDeviceAttributeVirtualMemoryManagementSupported="VMM")
        self.hipMemAllocationProp = _HipStructWithLocation
        self.hipMemAccessDesc = _HipStructWithLocation
        for name in ("hipRuntimeGetVersion", "hipGetDeviceCount", "hipDeviceGetAttribute",
                     "hipMemGetAllocationGranularity", "hipMemAddressReserve", "hipMemCreate",
                     "hipMemMap", "hipMemSetAccess", "hipMemUnmap", "hipMemRelease",
                     "hipMemAddressFree", "hipDeviceSynchronize"):
            setattr(self, name, self._fn(name))

    def _fn(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name in self.fail:
                return (self.fail[name], None)
            value = {
                "hipRuntimeGetVersion": self.version,
                "hipGetDeviceCount": 2,
                "hipDeviceGetAttribute": 1,
                "hipMemGetAllocationGranularity": self.gran,
                "hipMemAddressReserve": 1 << 44,
                "hipMemCreate": object(),
            }.get(name)
            return (HipError.hipSuccess,) if value is None else (HipError.hipSuccess, value)

        return call


def _install_hip(monkeypatch, fake):
    pkg = types.ModuleType("hip")
    pkg.hip = fake
    monkeypatch.setitem(sys.modules, "hip", pkg)
    monkeypatch.setitem(sys.modules, "hip.hip", fake)
    assert importlib.import_module("hip.hip") is fake


def test_hip_probe_without_hip_python(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip.hip", None)
    assert "hip-python is not installed" in HipVmmDriver(0).probe()


@pytest.mark.parametrize(("version", "expected"), [
    (60_400_000, "HIP runtime 6.4 is older than 7.12"),
    (71_100_123, "HIP runtime 7.11 is older than 7.12"),
    (71_200_000, None),
    (80_000_000, None),
])
def test_hip_runtime_version_gate(monkeypatch, version, expected):
    _install_hip(monkeypatch, FakeHip(version))
    reason = HipVmmDriver(0).probe()
    if expected is None:
        assert reason is None
    else:
        assert reason.startswith(expected) and "hipMemSetAccess" in reason


def test_hip_probe_device_checks(monkeypatch):
    fake = FakeHip(71_200_000)
    _install_hip(monkeypatch, fake)
    assert "out of range: the runtime sees 2 devices" in HipVmmDriver(5).probe()
    fake.hipDeviceGetAttribute = lambda attr, dev: (HipError.hipSuccess, 0)
    assert "does not support virtual memory management" in HipVmmDriver(1).probe()


def test_hip_driver_calls_and_granularity_floor(monkeypatch):
    fake = FakeHip(71_200_000, granularity=4096)
    _install_hip(monkeypatch, fake)
    d = HipVmmDriver(1)
    assert d.granularity == 2 * MiB  # 4 KiB reported, 2 MiB used
    assert (d._prop.type, d._prop.location.type, d._prop.location.id) == ("PINNED", "DEV", 1)
    assert d._access.flags == "RW"
    fake.calls.clear()
    va, h = full_cycle(d, 4 * MiB)
    assert va == 1 << 44
    assert fake.calls == [
        ("hipMemAddressReserve", (4 * MiB, 2 * MiB, None, 0)),
        ("hipMemCreate", (4 * MiB, d._prop, 0)),
        ("hipMemMap", (va, 4 * MiB, 0, h, 0)),
        ("hipMemSetAccess", (va, 4 * MiB, d._access, 1)),
        ("hipDeviceSynchronize", ()),
        ("hipMemUnmap", (va, 4 * MiB)),
        ("hipMemRelease", (h,)),
        ("hipMemAddressFree", (va, 4 * MiB)),
    ]


def test_hip_driver_error_message(monkeypatch):
    fake = FakeHip(71_200_000)
    _install_hip(monkeypatch, fake)
    fake.fail["hipMemMap"] = HipError.hipErrorOutOfMemory
    d = HipVmmDriver(0)
    with pytest.raises(VmmError) as exc:
        d.map(6 * MiB, 2 * MiB, object())
    msg = str(exc.value)
    assert "hipMemMap failed with hipErrorOutOfMemory" in msg
    assert f"va={6 * MiB}" in msg and f"size={2 * MiB}" in msg


def test_granularity_rounding_helper():
    assert vmm.effective_granularity(4096) == 2 * MiB
    assert vmm.effective_granularity(2 * MiB) == 2 * MiB
    assert vmm.effective_granularity(3 * MiB) == 3 * MiB  # already >= 2 MiB
    assert vmm.effective_granularity(1536 * 1024) == 3 * MiB  # smallest multiple >= 2 MiB
    with pytest.raises(VmmError, match="granularity of 0"):
        vmm.effective_granularity(0)


# ----------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_driver_roundtrip_on_gpu():
    from vllm.utils.dlpack import dlpack_tensor

    torch.cuda.init()
    d = CudaVmmDriver(torch.cuda.current_device())
    assert d.probe() is None
    g = d.granularity
    assert g >= 2 * MiB and g % (2 * MiB) == 0
    size = 256 * MiB
    va = d.reserve(4 * size)
    assert va % g == 0
    # Load the fill/sum kernels first: lazily loaded modules take device memory
    # that mem_get_info would otherwise count against the mapping.
    warm = torch.zeros(4096, dtype=torch.uint8, device=d.device)
    warm.fill_(7)
    assert int(warm.sum(dtype=torch.int64)) == 7 * 4096
    del warm
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, _ = torch.cuda.mem_get_info()
    h = d.create(size)
    d.map(va + size, size, h)  # not at the base: offsets work too
    d.set_access(va + size, size)
    free1, _ = torch.cuda.mem_get_info()
    assert abs((free0 - free1) - size) <= 16 * MiB
    t = dlpack_tensor(va + size, size, d.device, None)
    t.fill_(7)
    assert t.data_ptr() == va + size and int(t.sum(dtype=torch.int64)) == 7 * size
    del t
    d.synchronize()
    d.unmap(va + size, size)
    d.release(h)
    torch.cuda.empty_cache()  # the sum above cached torch memory of its own
    free2, _ = torch.cuda.mem_get_info()
    assert abs(free2 - free0) <= 16 * MiB
    d.free_reservation(va, 4 * size)


@pytest.mark.cuda
def test_cuda_driver_reports_oom_with_names():
    d = CudaVmmDriver(torch.cuda.current_device())
    _, total = torch.cuda.mem_get_info()
    too_much = vmm.round_up(2 * total, d.granularity)
    with pytest.raises(VmmError, match=r"cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY"):
        d.create(too_much)

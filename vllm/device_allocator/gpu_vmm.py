"""The GPU VMM backends: cuMem* (cuda-python) and hipMem* (hip-python).

Thin, checked wrappers: every non-success result raises `VmmError` naming the
call, the driver's error name and the sizes involved. The bindings are imported
at call time through `_load_module`, so constructing a driver never fails and
tests can put a fake module at exactly that boundary. See vmm.py for the
interface and the life of a range of bytes.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from vllm.device_allocator.vmm import (
    HIP_MIN_RUNTIME_VERSION,
    VmmDriver,
    VmmError,
    effective_granularity,
)


def _error_name(err: Any, name_fn: Any = None) -> str:
    """The driver's symbolic name for `err` (e.g. CUDA_ERROR_OUT_OF_MEMORY)."""
    if name_fn is not None:
        try:
            res = name_fn(err)
            if isinstance(res, tuple) and len(res) == 2 and _is_success(res[0]) and res[1]:
                value = res[1]
                return value.decode() if isinstance(value, bytes) else str(value)
        except Exception:  # the name is a courtesy; fall back to the enum's own
            pass
    return getattr(err, "name", None) or str(err)


def _is_success(err: Any) -> bool:
    return int(err) == 0  # CUDA_SUCCESS and hipSuccess are both 0


class _BindingDriver(VmmDriver):
    """Shared call checking for the cuda-python / hip-python backends.

    Both bindings return a tuple `(err, *values)` from every call.
    """

    _name_fn: Any = None

    def __init__(self, device_index: int | None = None) -> None:
        self._requested_index = device_index
        self._index: int | None = None
        self._prop: Any = None  # allocation properties: pinned device memory on _index
        self._access: Any = None  # access descriptor: read/write for _index
        self._granularity: int | None = None

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._device_index())  # torch says "cuda" for HIP too

    def _device_index(self) -> int:
        if self._index is None:
            idx = self._requested_index
            self._index = torch.cuda.current_device() if idx is None else int(idx)
        return self._index

    def _call(self, fn_name: str, *args: Any, **sizes: int) -> Any:
        fn = getattr(self._mod, fn_name)
        res = fn(*args)
        if not isinstance(res, tuple):
            res = (res,)
        err, values = res[0], res[1:]
        if not _is_success(err):
            detail = ", ".join(f"{k}={v}" for k, v in sizes.items())
            name = _error_name(err, self._name_fn)
            where = f"device {self._index}" if self._index is not None else "the device"
            raise VmmError(
                f"{fn_name} failed with {name} on {where}" + (f" ({detail})" if detail else "")
            )
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    @property
    def _mod(self) -> Any:
        raise NotImplementedError


def _load_module(name: str) -> Any:
    """Import a driver binding module at call time (the boundary tests replace)."""
    return importlib.import_module(name)


class CudaVmmDriver(_BindingDriver):
    """cuMem* over `cuda.bindings.driver`, on the CUDA device torch uses.

    The primary context of the device (the one torch's runtime uses) is retained
    and made current on the calling thread before each call, so this works before
    torch has touched the device and from any thread.

    Args:
        device_index: CUDA ordinal (as torch numbers devices, i.e. after
            CUDA_VISIBLE_DEVICES); None means `torch.cuda.current_device()`.
    """

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__(device_index)
        self._drv: Any = None
        self._ctx: Any = None
        # Whether pages are created GPUDirect-RDMA capable (`enable_transfer_flags`):
        # None = not probed yet; see `rdma_unsupported_reason`.
        self.rdma_capable: bool | None = None
        self.rdma_unsupported_reason: str | None = None

    @property
    def _mod(self) -> Any:
        return self._drv

    def probe(self) -> str | None:
        try:
            return self._probe()
        except Exception as e:  # never raise: the reason is the answer
            return f"CUDA VMM probe failed: {type(e).__name__}: {e}"

    def _probe(self) -> str | None:
        try:
            drv = _load_module("cuda.bindings.driver")
        except ImportError as e:
            return f"cuda-bindings (cuda-python) is not installed: {e}"
        try:
            res = drv.cuInit(0)
        except Exception as e:
            return f"no CUDA driver: libcuda could not be loaded ({type(e).__name__}: {e})"
        err = res[0] if isinstance(res, tuple) else res
        if not _is_success(err):
            if err == drv.CUresult.CUDA_ERROR_NO_DEVICE:
                return "no CUDA device: cuInit reported CUDA_ERROR_NO_DEVICE"
            return f"no usable CUDA driver: cuInit failed with {_error_name(err)}"
        err, count = drv.cuDeviceGetCount()
        if not _is_success(err) or count == 0:
            return "no CUDA device: the driver sees 0 devices"
        if torch.version.hip is not None:
            return "torch is a ROCm build; use HipVmmDriver"
        if not torch.cuda.is_available():
            return "torch cannot use CUDA here (CPU build of torch, or no visible device)"
        index = self._device_index()
        if not 0 <= index < count:
            return f"device index {index} is out of range: the driver sees {count} devices"
        err, dev = drv.cuDeviceGet(index)
        if not _is_success(err):
            return f"cuDeviceGet({index}) failed with {_error_name(err)}"
        attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        err, supported = drv.cuDeviceGetAttribute(attr, dev)
        if not _is_success(err) or not supported:
            return (
                f"CUDA device {index} does not support virtual memory management "
                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)"
            )
        if self._prop is not None:  # in use: it holds its context; query without touching it
            _ = self.granularity
            return None
        err, previous = drv.cuCtxGetCurrent()
        if not _is_success(err):
            return f"cuCtxGetCurrent failed with {_error_name(err)}"
        self._granularity = None  # query afresh: the retain below is what gets released
        _ = self.granularity  # retains the primary context and checks the granularity query
        # Leave no context behind. The probe runs where the config is built, in
        # `vllm serve` the API server, which uses no device: the context it
        # retained held 0.5 GiB there, and the engine core took the API server
        # for another process on the device (H200, issue 10). Where torch's
        # runtime holds the primary context too, this only drops our reference.
        # Only the reference retained here is released: releasing one more (a
        # second probe of a driver whose granularity was cached, the H200 run of
        # 2026-12-02) destroyed torch's context in the offline LLM's process, and
        # its pinned host buffers with it (a segfault at the next step).
        drv.cuCtxSetCurrent(previous)
        drv.cuDevicePrimaryCtxRelease(dev)
        self._prop = self._access = self._ctx = None  # the next use retains it again
        return None

    def _init(self) -> None:
        if self._prop is not None:  # set last: a failed _init is retried whole
            return
        drv = _load_module("cuda.bindings.driver")
        self._drv = drv
        self._name_fn = drv.cuGetErrorName
        index = self._device_index()
        self._call("cuInit", 0)
        dev = self._call("cuDeviceGet", index, device_index=index)
        self._ctx = self._call("cuDevicePrimaryCtxRetain", dev, device_index=index)
        self._make_current()

        loc = drv.CUmemLocation()
        loc.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        loc.id = index
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = loc
        access = drv.CUmemAccessDesc()
        access.location = loc
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._prop, self._access = prop, access

    def enable_transfer_flags(self) -> None:
        """For KV transfer over NIXL/UCX: later allocations RDMA capable and exportable.

        Only asked for by a worker with a NIXL connector (before its KV cache is
        reserved), so other engines' allocations stay as they were. Each flag
        is probed; an unsupported one is left off (`rdma_unsupported_reason`).
        """
        drv = self._ready()
        dev = self._call("cuDeviceGet", self._device_index())
        self._request_rdma(drv, dev, self._prop, self._device_index())
        self.enable_exportable_handles()

    def enable_exportable_handles(self) -> bool:
        """Create later allocations exportable as POSIX file descriptors, where supported.

        For another process to map them (UCX's CUDA IPC transport, used by NIXL
        between two instances on one node): `CUmemAllocationProp.requestedHandleTypes
        = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, allowed when the device reports
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED. Returns
        whether it is on; allocations made before keep their handle type.
        """
        drv = self._ready()
        name = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
        dev = self._call("cuDeviceGet", self._device_index())
        err, supported = drv.cuDeviceGetAttribute(getattr(drv.CUdevice_attribute, name), dev)
        if not (_is_success(err) and supported):
            return False
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._prop.requestedHandleTypes = kind
        return True

    def _request_rdma(self, drv: Any, dev: Any, prop: Any, index: int) -> None:
        """Create pages GPUDirect-RDMA capable where the device supports it with VMM.

        `CUmemAllocationProp.allocFlags.gpuDirectRDMACapable` (CUDA driver API,
        "Virtual Memory Management"): needed for a NIC (UCX/NIXL over RDMA) to
        register cuMemCreate memory; allowed only when
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 1.
        Probed, never assumed: a device without it keeps plain pages and the
        reason is kept for the connector's error message.
        """
        try:
            name = "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"
            attr = getattr(drv.CUdevice_attribute, name)
            err, supported = drv.cuDeviceGetAttribute(attr, dev)
        except AttributeError as e:  # bindings too old to name the attribute
            supported, err = 0, None
            self.rdma_unsupported_reason = f"cuda-bindings lacks the RDMA attribute ({e})"
        if _is_success(err) and supported:
            prop.allocFlags.gpuDirectRDMACapable = 1
            self.rdma_capable = True
            return
        self.rdma_capable = False
        if self.rdma_unsupported_reason is None:
            self.rdma_unsupported_reason = (
                f"CUDA device {index} does not support GPUDirect RDMA on VMM allocations "
                "(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0)")

    def _make_current(self) -> None:
        current = self._call("cuCtxGetCurrent")
        if current is None or int(current) != int(self._ctx):
            self._call("cuCtxSetCurrent", self._ctx)

    def _ready(self) -> Any:
        self._init()
        self._make_current()
        return self._drv

    @property
    def granularity(self) -> int:
        if self._granularity is None:
            drv = self._ready()
            flag = drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            g = self._call("cuMemGetAllocationGranularity", self._prop, flag)
            self._granularity = effective_granularity(int(g))
        return self._granularity

    def reserve(self, size: int) -> int:
        drv = self._ready()
        self._check_aligned("reserve", size=size)
        ptr = self._call(
            "cuMemAddressReserve", size, self.granularity, drv.CUdeviceptr(0), 0, size=size
        )
        return int(ptr)

    def create(self, size: int) -> Any:
        self._ready()
        self._check_aligned("create", size=size)
        return self._call("cuMemCreate", size, self._prop, 0, size=size)

    def map(self, va: int, size: int, handle: Any) -> None:
        drv = self._ready()
        self._check_aligned("map", va=va, size=size)
        self._call("cuMemMap", drv.CUdeviceptr(va), size, 0, handle, 0, va=va, size=size)

    def set_access(self, va: int, size: int) -> None:
        drv = self._ready()
        self._call("cuMemSetAccess", drv.CUdeviceptr(va), size, [self._access], 1, va=va, size=size)

    def unmap(self, va: int, size: int) -> None:
        drv = self._ready()
        self._call("cuMemUnmap", drv.CUdeviceptr(va), size, va=va, size=size)

    def release(self, handle: Any) -> None:
        self._ready()
        self._call("cuMemRelease", handle)

    def free_reservation(self, va: int, size: int) -> None:
        drv = self._ready()
        self._call("cuMemAddressFree", drv.CUdeviceptr(va), size, va=va, size=size)

    def synchronize(self) -> None:
        self._ready()
        self._call("cuCtxSynchronize")


def _hip_version_tuple(version: int) -> tuple[int, int]:
    """HIP_VERSION encoding: major * 10_000_000 + minor * 100_000 + patch."""
    return version // 10_000_000, (version // 100_000) % 100


class HipVmmDriver(_BindingDriver):
    """hipMem* over hip-python (`from hip import hip`), on the ROCm device torch uses.

    Disabled (with the reason) on HIP runtimes older than `HIP_MIN_RUNTIME_VERSION`.
    Not run on AMD hardware here; its logic is tested against a fake `hip` module.

    Args:
        device_index: HIP ordinal as torch numbers devices; None = current device.
    """

    def __init__(self, device_index: int | None = None) -> None:
        super().__init__(device_index)
        self._hip: Any = None

    @property
    def _mod(self) -> Any:
        return self._hip

    def probe(self) -> str | None:
        try:
            return self._probe()
        except Exception as e:
            return f"HIP VMM probe failed: {type(e).__name__}: {e}"

    def _probe(self) -> str | None:
        try:
            hip = _load_module("hip.hip")
        except ImportError as e:
            return f"hip-python is not installed (pip install 'vllm[rocm]'): {e}"
        self._hip = hip
        try:
            version = int(self._call("hipRuntimeGetVersion"))
        except Exception as e:
            return f"no HIP runtime: {type(e).__name__}: {e}"
        major, minor = _hip_version_tuple(version)
        want = HIP_MIN_RUNTIME_VERSION
        if (major, minor) < want:
            return (
                f"HIP runtime {major}.{minor} is older than {want[0]}.{want[1]}: its "
                "hipMemSetAccess rejects a reservation that holds several differently "
                "sized allocations"
            )
        count = int(self._call("hipGetDeviceCount"))
        if count == 0:
            return "no HIP device: the runtime sees 0 devices"
        index = self._device_index()
        if not 0 <= index < count:
            return f"device index {index} is out of range: the runtime sees {count} devices"
        attr = hip.hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported
        if not int(self._call("hipDeviceGetAttribute", attr, index)):
            return f"HIP device {index} does not support virtual memory management"
        _ = self.granularity
        return None

    def _init(self) -> Any:
        if self._prop is not None:
            return self._hip
        hip = self._hip or _load_module("hip.hip")
        self._hip = hip
        index = self._device_index()
        device = hip.hipMemLocationType.hipMemLocationTypeDevice
        # hip-python's nested struct fields are read-only attributes that are
        # views into the parent: fill them in place, never assign a struct.
        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = device
        prop.location.id = index
        access = hip.hipMemAccessDesc()
        access.location.type = device
        access.location.id = index
        access.flags = hip.hipMemAccessFlags.hipMemAccessFlagsProtReadWrite
        self._prop, self._access = prop, access
        return hip

    @property
    def granularity(self) -> int:
        if self._granularity is None:
            hip = self._init()
            flag = hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityMinimum
            g = self._call("hipMemGetAllocationGranularity", self._prop, flag)
            self._granularity = effective_granularity(int(g))
        return self._granularity

    def reserve(self, size: int) -> int:
        self._init()
        self._check_aligned("reserve", size=size)
        ptr = self._call("hipMemAddressReserve", size, self.granularity, None, 0, size=size)
        return int(ptr)

    def create(self, size: int) -> Any:
        self._init()
        self._check_aligned("create", size=size)
        return self._call("hipMemCreate", size, self._prop, 0, size=size)

    def map(self, va: int, size: int, handle: Any) -> None:
        self._init()
        self._check_aligned("map", va=va, size=size)
        self._call("hipMemMap", va, size, 0, handle, 0, va=va, size=size)

    def set_access(self, va: int, size: int) -> None:
        self._init()
        self._call("hipMemSetAccess", va, size, self._access, 1, va=va, size=size)

    def unmap(self, va: int, size: int) -> None:
        self._init()
        self._call("hipMemUnmap", va, size, va=va, size=size)

    def release(self, handle: Any) -> None:
        self._init()
        self._call("hipMemRelease", handle)

    def free_reservation(self, va: int, size: int) -> None:
        self._init()
        self._call("hipMemAddressFree", va, size, va=va, size=size)

    def synchronize(self) -> None:
        self._init()
        self._call("hipDeviceSynchronize")

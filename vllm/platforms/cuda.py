"""The CUDA platform (NVIDIA): cuMem* VMM driver, NVML process query, bf16 by default.

`CudaAlikePlatform` holds what CUDA and ROCm share through torch's `torch.cuda`
API (memory figures, dtypes, synchronize); each subclass adds its VMM driver and
its process query.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from vllm.device_allocator.gpu_vmm import CudaVmmDriver
from vllm.logger import init_logger
from vllm.platforms.interface import DeviceProcess, Platform

logger = init_logger(__name__)


class CudaAlikePlatform(Platform):
    """Shared by CUDA and ROCm (torch exposes both as device type "cuda")."""

    device_type = "cuda"
    dist_backend = "nccl"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_key(self, device_index: int = 0) -> str:
        """The GPU's UUID (the same in every process, whatever CUDA_VISIBLE_DEVICES says);
        the PCI address where torch does not report it."""
        uuid, pci = torch_device_identity(device_index)
        if uuid:
            return uuid
        if pci:
            return f"pci-{pci[0]:04x}-{pci[1]:02x}-{pci[2]:02x}"
        return f"{self.device_type}-{device_index}"

    def mem_get_info(self, device_index: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(device_index)
        return int(free), int(total)

    def _bf16_supported(self) -> bool:
        return bool(torch.cuda.is_bf16_supported())

    def supported_dtypes(self) -> list[torch.dtype]:
        bf16 = [torch.bfloat16] if self._bf16_supported() else []
        return bf16 + [torch.float16, torch.float32]

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """fp16 checkpoints stay fp16; fp32, bf16 or unknown become bf16 where supported.

        fp32 is never the default on a GPU: attention kernels and CUDA graphs are
        built for 16-bit activations, and fp32 would halve the KV cache.
        """
        if config_dtype == torch.float16:
            return torch.float16
        return torch.bfloat16 if self._bf16_supported() else torch.float16

    def configure_torch_allocator(self) -> None:
        """Expandable segments for torch's caching allocator, unless the user chose.

        The extensible KV cache leaves only a small buffer free after warmup, so
        activations at runtime must fit in what warmup left in torch's pool.
        With fixed-size segments that pool fragments (seen on the H200: an OOM
        for 318 MiB with 781 MiB cached but split over segments); expandable
        segments keep each pool one growable mapping (PyTorch's documented
        remedy, "expandable_segments:True" of PYTORCH_CUDA_ALLOC_CONF).
        """
        if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
            return
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        # The variable is read when the allocator starts; if it already has,
        # apply the setting to the segments created from now on.
        settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
            torch.cuda.memory, "_set_allocator_settings", None
        )
        if settings is not None and torch.cuda.is_initialized():
            settings("expandable_segments:True")

    def init_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)
        torch.cuda.init()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def torch_device_identity(device_index: int) -> tuple[str | None, tuple[int, int, int] | None]:
    """(UUID without "GPU-"/"MIG-" prefix, (pci domain, bus, device)) of a torch device.

    Either part is None where this torch build does not report it.
    """
    props = torch.cuda.get_device_properties(device_index)
    uuid = getattr(props, "uuid", None)
    uuid_text = _normalize_uuid(str(uuid)) if uuid is not None else None
    pci = tuple(getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    return uuid_text or None, (pci if None not in pci else None)  # type: ignore[return-value]


def _normalize_uuid(text: str | bytes) -> str:
    if isinstance(text, bytes):
        text = text.decode()
    text = text.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def parse_pci_bus_id(text: str | bytes) -> tuple[int, int, int]:
    """"0000:17:00.0" or "00000000:17:00.0" -> (domain, bus, device), all ints.

    Raises:
        ValueError: not of the form domain:bus:device.function.
    """
    if isinstance(text, bytes):
        text = text.decode()
    parts = text.strip().split(":")
    if len(parts) != 3 or "." not in parts[2]:
        raise ValueError(f"not a PCI bus id: {text!r}")
    return int(parts[0], 16), int(parts[1], 16), int(parts[2].split(".")[0], 16)


def _nvml_handle_for(nvml: Any, device_index: int) -> Any | None:
    """The NVML handle of torch's `cuda:<device_index>`, or None if it cannot be matched.

    Matched by UUID, then by PCI bus id (both immune to CUDA_VISIBLE_DEVICES
    and CUDA_DEVICE_ORDER); only with neither reported, by CUDA_VISIBLE_DEVICES.
    """
    uuid, pci = torch_device_identity(device_index)
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    if uuid is not None:
        for h in handles:
            if _normalize_uuid(nvml.nvmlDeviceGetUUID(h)) == uuid:
                return h
    if pci is not None:
        for h in handles:
            if parse_pci_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId) == pci:
                return h
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return handles[device_index] if len(handles) == 1 and device_index == 0 else None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if device_index >= len(entries):
        return None
    entry = entries[device_index]
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def nvml_foreign_processes(device_index: int, own_pids: frozenset[int]) -> list[DeviceProcess]:
    """Compute and graphics processes on the device, minus `own_pids`, sorted by pid.

    Raises whatever NVML raises (the caller turns it into "unknown").
    """
    nvml = importlib.import_module("pynvml")
    nvml.nvmlInit()
    try:
        handle = _nvml_handle_for(nvml, device_index)
        if handle is None:
            raise LookupError(f"no NVML device matches torch's cuda:{device_index}")
        found: dict[int, int | None] = {}
        for query in (nvml.nvmlDeviceGetComputeRunningProcesses,
                      nvml.nvmlDeviceGetGraphicsRunningProcesses):
            for proc in query(handle):
                pid, used = int(proc.pid), getattr(proc, "usedGpuMemory", None)
                if pid in own_pids:
                    continue
                prev = found.get(pid)
                found[pid] = used if prev is None else max(prev, used or 0)
        return [DeviceProcess(pid, used, _nvml_process_name(nvml, pid))
                for pid, used in sorted(found.items())]
    finally:
        nvml.nvmlShutdown()


def _nvml_process_name(nvml: Any, pid: int) -> str:
    try:
        name = nvml.nvmlSystemGetProcessName(pid)
    except Exception:  # the name is cosmetic; a process may exit mid-query
        return ""
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


class CudaPlatform(CudaAlikePlatform):
    """NVIDIA GPUs through torch's CUDA build."""

    device_name = "cuda"

    def __init__(self) -> None:
        super().__init__()
        self._vmm: dict[int, CudaVmmDriver] = {}

    def get_vmm_driver(self, device_index: int = 0) -> CudaVmmDriver:
        if device_index not in self._vmm:
            self._vmm[device_index] = CudaVmmDriver(device_index)
        return self._vmm[device_index]

    def free_bytes_before_init(self, device_index: int = 0) -> int | None:
        """Free device memory from NVML, without creating a CUDA context (None: unknown).

        A context itself takes ~0.5 GiB: on a device another engine filled,
        creating one is what fails (an OOM traceback in `torch.cuda.set_device`).
        """
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            try:
                handle = _nvml_handle_for(nvml, device_index)
                return None if handle is None else int(nvml.nvmlDeviceGetMemoryInfo(handle).free)
            finally:
                nvml.nvmlShutdown()
        except Exception as e:  # no NVML: unknown
            logger.debug("NVML memory query failed, treating as unknown: %s", e)
            return None

    def get_foreign_device_processes(self, device_index: int = 0) -> list[DeviceProcess] | None:
        try:
            return nvml_foreign_processes(device_index, self.engine_pids())
        except Exception as e:  # no NVML, no permission, unmatched device: unknown
            logger.debug("NVML process query failed, treating as unknown: %s", e)
            return None

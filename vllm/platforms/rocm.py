"""The ROCm platform (AMD): hipMem* VMM driver through hip-python, amdsmi process query."""

from __future__ import annotations

import importlib
from typing import Any

from vllm.device_allocator.gpu_vmm import HipVmmDriver
from vllm.logger import init_logger
from vllm.platforms.cuda import CudaAlikePlatform, parse_pci_bus_id, torch_device_identity
from vllm.platforms.interface import DeviceProcess

logger = init_logger(__name__)


def _amdsmi_handle_for(amdsmi: Any, device_index: int) -> Any | None:
    """The amdsmi processor handle of torch's device, matched by PCI address."""
    handles = list(amdsmi.amdsmi_get_processor_handles())
    _, pci = torch_device_identity(device_index)
    if pci is not None:
        for h in handles:
            if parse_pci_bus_id(amdsmi.amdsmi_get_gpu_device_bdf(h)) == pci:
                return h
    return handles[0] if len(handles) == 1 and device_index == 0 else None


def _amdsmi_process_info(amdsmi: Any, handle: Any, entry: Any) -> dict:
    """amdsmi >= 6.1 lists dicts; older versions list process handles to look up."""
    if isinstance(entry, dict):
        return entry
    return amdsmi.amdsmi_get_gpu_process_info(handle, entry)


def amdsmi_foreign_processes(device_index: int, own_pids: frozenset[int]) -> list[DeviceProcess]:
    """Processes holding memory on the device, minus `own_pids`, sorted by pid.

    Raises whatever amdsmi raises (the caller turns it into "unknown").
    """
    amdsmi = importlib.import_module("amdsmi")
    amdsmi.amdsmi_init()
    try:
        handle = _amdsmi_handle_for(amdsmi, device_index)
        if handle is None:
            raise LookupError(f"no amdsmi device matches torch's cuda:{device_index}")
        found: dict[int, DeviceProcess] = {}
        for entry in amdsmi.amdsmi_get_gpu_process_list(handle):
            info = _amdsmi_process_info(amdsmi, handle, entry)
            pid = int(info["pid"])
            if pid in own_pids:
                continue
            usage = info.get("memory_usage") or {}
            used = usage.get("vram_mem", info.get("mem"))
            found[pid] = DeviceProcess(pid, int(used) if used is not None else None,
                                       str(info.get("name", "")))
        return [found[pid] for pid in sorted(found)]
    finally:
        amdsmi.amdsmi_shut_down()


class RocmPlatform(CudaAlikePlatform):
    """AMD GPUs through torch's ROCm build (torch device type "cuda")."""

    device_name = "rocm"

    def __init__(self) -> None:
        super().__init__()
        self._vmm: dict[int, HipVmmDriver] = {}

    def get_vmm_driver(self, device_index: int = 0) -> HipVmmDriver:
        if device_index not in self._vmm:
            self._vmm[device_index] = HipVmmDriver(device_index)
        return self._vmm[device_index]

    def get_foreign_device_processes(self, device_index: int = 0) -> list[DeviceProcess] | None:
        try:
            return amdsmi_foreign_processes(device_index, self.engine_pids())
        except Exception as e:
            logger.debug("amdsmi process query failed, treating as unknown: %s", e)
            return None

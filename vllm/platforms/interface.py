"""What the engine asks of a device kind; one subclass per platform.

Everything that differs between CUDA, ROCm and the CPU lives behind this
interface (memory figures, which VMM driver, which attention backend, which
processes share the device), so core logic never asks `is_rocm()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from vllm.device_allocator.vmm import VmmDriver


@dataclass(frozen=True)
class DeviceProcess:
    """A process holding memory on a device (from NVML / amdsmi)."""

    pid: int
    used_bytes: int | None  # None where the driver does not say
    name: str = ""


class Platform:
    """Base class; concrete platforms override what differs.

    Attributes:
        device_type: torch device type string ("cuda" for CUDA and ROCm, "cpu").
        device_name: human-readable name of the platform ("cuda", "rocm", "cpu").
        dist_backend: torch.distributed backend of the tensor-parallel group
            ("nccl" on CUDA and ROCm, where torch names RCCL "nccl"; "gloo" on the CPU).
    """

    device_type: str = "cpu"
    device_name: str = "cpu"
    dist_backend: str = "gloo"

    def __init__(self) -> None:
        self._engine_pids: set[int] = set()

    def register_engine_pid(self, pid: int) -> None:
        """Count `pid` as one of this engine's own processes (never "foreign")."""
        self._engine_pids.add(int(pid))

    def engine_pids(self) -> frozenset[int]:
        """This process plus every pid registered with `register_engine_pid`."""
        return frozenset(self._engine_pids | {os.getpid()})

    def is_cuda_alike(self) -> bool:
        return self.device_type == "cuda"

    def device(self, index: int = 0) -> torch.device:
        import torch

        if self.is_cuda_alike():
            return torch.device(self.device_type, index)
        return torch.device("cpu")

    def device_count(self) -> int:
        """Devices this process can see (the host counts as one device)."""
        return 1

    def device_key(self, device_index: int = 0) -> str:
        """A name of the physical device that every process sees alike ("host" for the
        CPU): what the registry of elastic engines on it is keyed by."""
        return "host"

    def get_vmm_driver(self, device_index: int = 0) -> VmmDriver:
        """The VMM driver for this platform (always returned; `probe()` says if usable)."""
        raise NotImplementedError

    def get_kv_cache_vmm_driver(self, device_index: int = 0, *, elastic: bool = False) -> VmmDriver:
        """The driver the extensible KV cache commits through: `get_vmm_driver`'s, unless
        the platform commits a cache that never grows lazily (CPU: pages resident once
        written). `elastic`: the cache grows into memory free at the moment, so its
        commits must take memory at once."""
        return self.get_vmm_driver(device_index)

    def mem_get_info(self, device_index: int = 0) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory, as the driver reports them now."""
        raise NotImplementedError

    def free_bytes_before_init(self, device_index: int = 0) -> int | None:
        """Free device memory, read without initialising the device (None: cannot tell)."""
        return None

    def get_foreign_device_processes(self, device_index: int = 0) -> list[DeviceProcess] | None:
        """Other processes holding memory on the device, excluding this engine's own.

        Returns None where the platform cannot tell (no NVML / amdsmi, or a
        query that failed); an empty list when it can tell and there are none.
        """
        return None

    def supported_dtypes(self) -> list[torch.dtype]:
        raise NotImplementedError

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        """What `--dtype auto` resolves to for a checkpoint stored in `config_dtype`."""
        raise NotImplementedError

    def default_kv_cache_bytes_cap(self) -> int | None:
        """Upper bound in bytes on the KV cache when no size is given, or None for none.

        GPUs size the cache by measurement (None here); the CPU platform bounds it
        because host memory is shared with everything else on the machine.
        """
        return None

    def default_kv_cache_cap_name(self) -> str:
        """What `default_kv_cache_bytes_cap` is, for the KV sizing log line."""
        return "the platform's cap"

    def configure_torch_allocator(self) -> None:
        """Settings for torch's device allocator, before the engine allocates anything."""

    def verify_environment(self) -> None:
        """Reject malformed platform environment variables (when the config is built).

        Raises:
            ValueError: naming the variable.
        """

    def release_freed_host_memory(self) -> None:
        """Once start-up is over: give the host memory its temporaries freed back to the OS."""

    def configure_threads(self) -> None:
        """Choose (and log) the host threads that compute, before the model loads."""

    def adjust_threads(self) -> None:
        """Before each step: let the host compute threads follow the load (CPU); cheap."""

    def init_device(self, device: torch.device) -> None:
        """Make `device` this process's current device and create its context (if any)."""

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

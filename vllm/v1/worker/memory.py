"""Device memory readings for sizing: totals, free, this process's usage, peaks.

On CUDA the figures come from the driver (`mem_get_info`) and torch's caching
allocator; on the CPU from /proc (MemAvailable, VmRSS, VmHWM).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm import envs
from vllm.platforms.interface import Platform
from vllm.v1.worker.kv_cache_sizing import MemorySnapshot


@dataclass
class PeakReading:
    torch_peak: int = 0  # bytes above the allocation level at entry (transient peak)
    non_torch_growth: int = 0  # device bytes that appeared outside torch's allocator


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def device_total(total: int) -> int:
    """The device's size for sizing (bytes): `total` as the driver reports it, or the
    emulated device's (`VLLM_EMULATED_DEVICE_GIB`) where that is smaller.

    An emulated device is the real one with another process holding the rest of
    its free memory (benchmark_elastic.py's ballast), so free memory needs no
    emulation; only the size that shares are taken of does (the elastic headroom
    was 2 % of an 80 GB H100, 1.58 GiB, on a device emulated at 58 GiB: 1.16 GiB).

    Raises:
        ValueError: the variable is not a number of GiB > 0 (naming it).
    """
    gib = envs.VLLM_EMULATED_DEVICE_GIB
    return total if gib is None else min(total, int(gib * (1 << 30)))


class DeviceMemory:
    """Memory readings of one device, relative to the moment the worker started.

    Args:
        platform: the current platform (for mem_get_info).
        device: the device measured.
    """

    def __init__(self, platform: Platform, device: torch.device) -> None:
        self.platform = platform
        self.device = device
        self.is_cuda = device.type == "cuda"
        free, total = platform.mem_get_info(device.index or 0)
        self.total = device_total(total)  # an emulated device's size, if one is set
        self.free_at_start = free
        self.rss_at_start = self._rss()

    def free_bytes(self) -> int:
        """Free device memory now (bytes); on the CPU, MemAvailable."""
        return self.platform.mem_get_info(self.device.index or 0)[0]

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.is_cuda else 0

    def used_since_start(self, free_now: int | None = None) -> int:
        """What this process took since the worker started (bytes)."""
        if self.is_cuda:
            return self.free_at_start - (self.free_bytes() if free_now is None else free_now)
        return max(self._rss() - self.rss_at_start, 0)

    def torch_shortfall(self, activation_peak: int) -> int:
        """Bytes torch must still obtain from the device to reach the activation peak.

        The runtime needs `allocated + activation_peak` from torch's caching
        allocator; what it reserves beyond `allocated` is already held. After
        warmup that is usually the whole peak, but `torch.cuda.graph` empties
        the cache when capture begins, so it may be gone; this is the part the
        KV cache must leave free. 0 on the CPU (no caching allocator).
        """
        if not self.is_cuda:
            return 0
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return max(allocated + activation_peak - reserved, 0)

    def snapshot(self, kv_committed: int, activation_peak: int) -> MemorySnapshot:
        """What sizing after warmup needs, read now (bytes).

        Args:
            kv_committed: bytes the KV cache has committed now.
            activation_peak: the profiled peak (for the torch shortfall).
        """
        free = self.free_bytes()
        return MemorySnapshot(
            total=self.total,
            free=free,
            kv_committed=kv_committed,
            used_since_start=self.used_since_start(free),
            torch_shortfall=self.torch_shortfall(activation_peak),
        )

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _rss() -> int:
        return _proc_status_kib("VmRSS") * 1024

    @contextlib.contextmanager
    def measure_peak(self) -> Iterator[PeakReading]:
        """Measure the transient peak of the enclosed work."""
        reading = PeakReading()
        if self.is_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base_alloc = torch.cuda.memory_allocated(self.device)
            base_reserved = torch.cuda.memory_reserved(self.device)
            free0 = self.free_bytes()
            yield reading
            torch.cuda.synchronize(self.device)
            reading.torch_peak = torch.cuda.max_memory_allocated(self.device) - base_alloc
            reserved_growth = torch.cuda.memory_reserved(self.device) - base_reserved
            reading.non_torch_growth = max((free0 - self.free_bytes()) - reserved_growth, 0)
            return
        # CPU: resident set high-water mark. Writing "5" to clear_refs resets
        # VmHWM to the current RSS (Linux >= 4.0); where that is refused the
        # reading is an upper bound.
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = self._rss()
        yield reading
        reading.torch_peak = max(_proc_status_kib("VmHWM") * 1024 - base, 0)

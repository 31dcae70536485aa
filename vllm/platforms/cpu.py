"""The CPU platform: host memory figures, the host VMM backend, float32 by default, and
vLLM's CPU thread rules (`cpu_threads.py`)."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm import envs
from vllm.device_allocator.host_vmm import HostVmmDriver
from vllm.logger import init_logger
from vllm.platforms.cpu_threads import (
    CpuThreadGovernor,
    apply_cpu_thread_plan,
    check_cpu_threads_env,
    plan_cpu_threads_from_env,
)
from vllm.platforms.interface import Platform

logger = init_logger(__name__)

GiB = 1 << 30

DEFAULT_CPU_KV_CACHE_BYTES = 4 * GiB
"""Default KV budget on the CPU: 4 GiB (vLLM's historical CPU default), never more
than the memory available now. Host memory is shared with the model weights, the
tokenizer and everything else on the machine, so "all free memory" is not a sane
default there. `VLLM_CPU_KVCACHE_SPACE` (GiB, as in vLLM) overrides it."""

_UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a huge number near 2**63


@dataclass(frozen=True)
class HostMemory:
    """Host memory as this process may use it, in bytes."""

    available: int  # what can be allocated now without swapping
    total: int  # what this process could ever hold (cgroup limit or physical RAM)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _read_kv(path: Path) -> dict[str, int]:
    """Parse `key value [kB]` lines (/proc/meminfo, memory.stat); values in bytes."""
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            scale = 1024 if len(parts) > 2 and parts[2] == "kB" else 1
            out[parts[0]] = int(parts[1]) * scale
    return out


def _cgroup_dir(cgroup_root: Path, proc_self_cgroup: Path) -> tuple[Path, bool] | None:
    """(directory holding this process's memory controller files, is_v2), if any."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if "memory" in controllers.split(","):
            base, v2 = cgroup_root / "memory", False
        elif controllers == "" and (cgroup_root / "cgroup.controllers").exists():
            base, v2 = cgroup_root, True
        else:
            continue
        # Inside a container the controller is often mounted at the container's
        # own cgroup, so the path from /proc/self/cgroup does not exist under it.
        for candidate in (base / rel, base):
            limit_file = "memory.max" if v2 else "memory.limit_in_bytes"
            if (candidate / limit_file).exists():
                return candidate, v2
    return None


def read_host_memory(
    proc_meminfo: str | Path = "/proc/meminfo",
    cgroup_root: str | Path = "/sys/fs/cgroup",
    proc_self_cgroup: str | Path = "/proc/self/cgroup",
) -> HostMemory:
    """Available and total host memory, honouring a cgroup (v1 or v2) memory limit.

    available = min(MemAvailable, limit - (usage - inactive file cache)),
    total = min(MemTotal, limit). Inactive file cache is reclaimable, so it does
    not count as used. Source: proc(5) for /proc/meminfo; the kernel's cgroup v1
    memory and cgroup v2 documentation for the controller files.

    Raises:
        RuntimeError: /proc/meminfo lacks MemTotal or MemAvailable.
    """
    info = _read_kv(Path(proc_meminfo))
    if "MemTotal" not in info or "MemAvailable" not in info:
        raise RuntimeError(f"{proc_meminfo} has no MemTotal/MemAvailable lines")
    total, available = info["MemTotal"], info["MemAvailable"]
    found = _cgroup_dir(Path(cgroup_root), Path(proc_self_cgroup))
    if found is not None:
        directory, v2 = found
        if v2:
            limit = _read_int(directory / "memory.max")
            usage = _read_int(directory / "memory.current")
            inactive = _read_kv(directory / "memory.stat").get("inactive_file", 0)
        else:
            limit = _read_int(directory / "memory.limit_in_bytes")
            usage = _read_int(directory / "memory.usage_in_bytes")
            inactive = _read_kv(directory / "memory.stat").get("total_inactive_file", 0)
        if limit is not None and limit < min(total, _UNLIMITED):
            used = max(0, (usage or 0) - inactive)
            total = limit
            available = min(available, max(0, limit - used))
    return HostMemory(available=available, total=total)


class CpuPlatform(Platform):
    """Runs the engine on the host: torch reference attention, host VMM backend."""

    device_type = "cpu"
    device_name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self._vmm: HostVmmDriver | None = None
        self._lazy_vmm: HostVmmDriver | None = None
        self._governor: CpuThreadGovernor | None = None

    def get_vmm_driver(self, device_index: int = 0) -> HostVmmDriver:
        if self._vmm is None:
            self._vmm = HostVmmDriver()
        return self._vmm

    def get_kv_cache_vmm_driver(self, device_index: int = 0, *,
                                elastic: bool = False) -> HostVmmDriver:
        """A KV cache of fixed size commits lazily: its pages become resident when a block
        is first written, so the default 4 GiB costs what it holds (issue 48: a default
        server held ~5 GB at idle). The elastic cache keeps prefaulted commits."""
        if elastic:
            return self.get_vmm_driver(device_index)
        if self._lazy_vmm is None:
            self._lazy_vmm = HostVmmDriver(prefault=False)
        return self._lazy_vmm

    def mem_get_info(self, device_index: int = 0) -> tuple[int, int]:
        mem = read_host_memory()
        return mem.available, mem.total

    def get_foreign_device_processes(self, device_index: int = 0) -> None:
        return None  # host memory is shared by design; nothing to refuse on

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def default_dtype(self, config_dtype: torch.dtype | None) -> torch.dtype:
        return torch.float32  # the reference kernels are fastest and exact in fp32

    def verify_environment(self) -> None:
        """VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU are well formed.

        Raises:
            ValueError: naming the variable.
        """
        check_cpu_threads_env()

    def configure_threads(self) -> None:
        """The CPU thread rules (`cpu_threads.py`): an OpenMP team of one thread per
        physical core this process may use, bound; with no reserve set, as many compute
        as other processes leave idle (`adjust_threads` between steps); logged."""
        plan = plan_cpu_threads_from_env()
        self._governor = apply_cpu_thread_plan(plan)
        threads = torch.get_num_threads()
        if plan.cpus is None or plan.num_threads < 2:  # one thread: the caller's own
            logger.info("CPU threads: %d compute thread(s), not bound (%s)", threads,
                        plan.description)
        else:
            now = ""
            if self._governor is not None:
                now = (f", {threads} computing now: other processes kept "
                       f"{self._governor.others_cores:.2f} core(s) busy")
            logger.info("CPU threads: OpenMP team of %d bound to CPUs %s%s (%s)",
                        plan.num_threads, ",".join(map(str, plan.cpus)), now, plan.description)

    @property
    def thread_governor(self) -> CpuThreadGovernor | None:
        """The governor of an adaptive thread plan (None: a fixed count)."""
        return self._governor

    def adjust_threads(self) -> None:
        """Before a step: the compute threads follow the idle cores (at most once a second)."""
        if self._governor is not None:
            self._governor.adjust()

    def release_freed_host_memory(self) -> None:
        """glibc's `malloc_trim(0)`: the heap pages start-up freed (the GGUF dequantisation,
        the profile and warmup batches) go back to the OS instead of waiting in malloc's
        free lists (~115 MiB of the bundled model's engine; malloc_trim(3)). Nothing where
        the C library is not glibc."""
        try:
            ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            return

    def default_kv_cache_bytes_cap(self) -> int:
        """`VLLM_CPU_KVCACHE_SPACE` GiB if set and > 0, else min(4 GiB, available memory).

        As in vLLM, 0 (or unset) means the default.

        Raises:
            ValueError: `VLLM_CPU_KVCACHE_SPACE` is negative or not a number.
        """
        gib = envs.VLLM_CPU_KVCACHE_SPACE
        if gib > 0:
            return int(gib * GiB)
        available, _ = self.mem_get_info()
        return min(DEFAULT_CPU_KV_CACHE_BYTES, available)

    def default_kv_cache_cap_name(self) -> str:
        """"VLLM_CPU_KVCACHE_SPACE=<GiB>" when set (> 0), else the default and how to change it."""
        gib = envs.VLLM_CPU_KVCACHE_SPACE
        if gib > 0:
            return f"VLLM_CPU_KVCACHE_SPACE={gib:g} GiB"
        return (f"the CPU default min({DEFAULT_CPU_KV_CACHE_BYTES / GiB:g} GiB, available "
                f"memory); set VLLM_CPU_KVCACHE_SPACE (GiB) to change it")

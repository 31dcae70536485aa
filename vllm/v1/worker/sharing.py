"""Sharing a device with other processes: refuse early, with one line (DESIGN.md 5, #18 item 5).

    check_device_fits   before the device is initialised: a device others
                        filled cannot even hold a CUDA context (that used to be
                        an OOM traceback in `torch.cuda.set_device`)
    check_sharing       after: on the default utilization, refuse to share
                        unless the engine is elastic (it grows only into free
                        memory); with an explicit utilization, warn

The platform's queries (NVML / amdsmi; nothing on the CPU) are the seam tests replace.
"""

from __future__ import annotations

import torch

from vllm.config import CacheConfig
from vllm.exceptions import DeviceBusyError
from vllm.logger import init_logger
from vllm.platforms.interface import Platform

logger = init_logger(__name__)
GiB = 1 << 30

# Below this much free memory a device cannot even hold a CUDA context (~0.5
# GiB on the H200) plus cuBLAS workspaces: start-up is refused with a message
# instead of an OOM traceback.
MIN_FREE_BYTES_TO_START = 1 * GiB


def check_device_fits(platform: Platform, device: torch.device) -> None:
    """Refuse a device others filled, before touching it (issue #18 item 5).

    Runs before the device is initialised: creating a CUDA context on a
    device another engine filled is what used to fail, with an OOM
    traceback in `torch.cuda.set_device`.

    Raises:
        DeviceBusyError: one line naming the other processes, their memory
            and the flag to set.
    """
    index = device.index or 0
    free = platform.free_bytes_before_init(index)
    if free is None or free >= MIN_FREE_BYTES_TO_START:
        return
    others = platform.get_foreign_device_processes(index)
    held = f"held by {_describe(others)}" if others else "held by processes NVML cannot list"
    raise DeviceBusyError(
        f"cannot start on {device}: only {free / GiB:.1f} GiB free, {held}; start the "
        f"other engine(s) with --enable-elastic-kv-cache (they then return unused KV "
        f"memory) or a lower --gpu-memory-utilization"
    )


def check_sharing(platform: Platform, device: torch.device, cache: CacheConfig) -> None:
    """Refuse to share the device on the default utilization (DESIGN.md section 5).

    Elastic engines share without tuning (they grow only into free memory).

    Raises:
        DeviceBusyError: one line naming the processes and the flags to set.
    """
    others = platform.get_foreign_device_processes(device.index or 0)
    if not others:
        return
    desc = _describe(others)
    if cache.enable_elastic_kv_cache:
        logger.info("Sharing %s with %s: the elastic KV cache grows only into free memory",
                    device, desc)
        return
    if not cache.gpu_memory_utilization_explicit:
        raise DeviceBusyError(
            f"another process holds memory on {device} ({desc}) and "
            f"--gpu-memory-utilization was left to its default (all of the device on the "
            f"extensible path): set --gpu-memory-utilization to the share "
            f"of the device this engine may use, or start every engine on the device "
            f"with --enable-elastic-kv-cache"
        )
    logger.warning(
        "Sharing %s with %s; this engine keeps to gpu_memory_utilization=%s",
        device,
        desc,
        cache.gpu_memory_utilization,
    )


def _describe(others: list) -> str:
    """`pid 123 python (4.0 GiB), pid 456 ...` for an error or log line."""
    return ", ".join(
        f"pid {p.pid}" + (f" {p.name}" if p.name else "")
        + (f" ({p.used_bytes / GiB:.1f} GiB)" if p.used_bytes else "")
        for p in others
    )

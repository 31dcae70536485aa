"""Platforms: one `Platform` per device kind; `current_platform` is chosen once, lazily.

    current_platform  ->  CudaPlatform  (torch CUDA build, a device visible)
                          RocmPlatform  (torch ROCm build, a device visible)
                          CpuPlatform   (everything else)

Core code asks `current_platform` for memory figures, the VMM driver and the
processes sharing the device; it never asks which platform it is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.platforms.interface import Platform

__all__ = ["current_platform", "detect_platform"]

_current: Platform | None = None


def detect_platform() -> Platform:
    """A new Platform for this process's torch build and devices."""
    import torch

    if torch.cuda.is_available():
        if torch.version.hip is not None:
            from vllm.platforms.rocm import RocmPlatform

            return RocmPlatform()
        from vllm.platforms.cuda import CudaPlatform

        return CudaPlatform()
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform()


def __getattr__(name: str) -> Any:
    # Lazy so that importing vllm does not initialise CUDA; chosen once.
    global _current
    if name == "current_platform":
        if _current is None:
            _current = detect_platform()
        return _current
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

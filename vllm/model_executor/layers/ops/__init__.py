"""Fused Triton kernels for the elementwise parts of a decoder layer.

One launch each for RMSNorm (with the residual add), rotary embedding (query
and key together) and SiLU-and-mul. Under a captured CUDA graph every kernel
is a node that costs a few microseconds however few bytes it moves, so the
~30 small torch ops per layer these replace cost more than their traffic
(`benchmarks/benchmark_fused_ops.py` measures both).

This module imports no Triton: it only answers whether a layer should use the
kernels. The kernel modules (`rms_norm`, `rotary`, `activation`) import
Triton and are imported by the layers only for CUDA tensors, so CPU runs never
import Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

FUSED_OPS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def fused_ops_unavailable_reason() -> str | None:
    """Why the Triton kernels cannot run in this process, or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
    except Exception as e:  # a broken install: report it, the torch path still works
        return f"triton failed to import: {e!r}"
    return None


def use_fused_ops(tensor: torch.Tensor) -> bool:
    """Whether a layer should run its Triton kernel on `tensor`.

    True for CUDA tensors (NVIDIA or ROCm builds of torch) of a dtype in
    `FUSED_OPS_DTYPES` when Triton imports; everything else takes the layer's
    torch path (`forward_native`).
    """
    return (
        tensor.is_cuda
        and tensor.dtype in FUSED_OPS_DTYPES
        and fused_ops_unavailable_reason() is None
    )


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on", "y")


def triton_launches_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on `device` in this process: CUDA (or the CPU under
    TRITON_INTERPRET=1), with Triton importable."""
    return ((device.type == "cuda" or interpreting())
            and fused_ops_unavailable_reason() is None)


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors share one device that Triton can launch on.

    Args:
        op: the launcher's name, for the message.
        tensors: name -> tensor.
    """
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"{op}: tensors must be on one device, got {devices}")
    device = next(iter(devices.values()))
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{op}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before "
            f"triton is imported), got device {device}"
        )


def check_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError unless `tensor` has one of `FUSED_OPS_DTYPES`."""
    if tensor.dtype not in FUSED_OPS_DTYPES:
        raise ValueError(f"{op}: {name} must be one of {FUSED_OPS_DTYPES}, got {tensor.dtype}")


def check_last_dim_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError if a non-empty tensor's last dim has a stride other than 1."""
    for name, t in tensors.items():
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"{op}: {name} must have a contiguous last dim, got strides {t.stride()}"
            )


def check_norm_inputs(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, k: int
) -> None:
    """Raise ValueError unless residual is None or matches x, and norm_weight is [k] in x's dtype
    (the fused norm + projection launchers)."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{op}: residual must match x ({x.dtype} {tuple(x.shape)}), got "
            f"{residual.dtype} {tuple(residual.shape)}"
        )
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"{op}: norm_weight must be [{k}] {x.dtype}, got {norm_weight.dtype} "
            f"{tuple(norm_weight.shape)}"
        )


def gate_up_width(op: str, x: torch.Tensor) -> int:
    """K of x = [gate | up] ([M, 2K], the fused SiLU-and-mul launchers); ValueError if odd."""
    two_k = x.shape[-1] if x.dim() == 2 else -1
    if two_k % 2:
        raise ValueError(f"{op}: x's last dim must be even (gate | up), got {tuple(x.shape)}")
    return two_k // 2

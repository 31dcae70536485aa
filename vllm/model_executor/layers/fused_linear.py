"""Norm -> projection and activation -> projection, fused for launch-bound decode batches.

A decoder layer on a small model spends its decode step launching kernels
(SmolLM2-135M: ~1 ms of graph replay for 0.06 ms of weights on an H200). Two
elementwise kernels per layer can ride along with the projection that follows
them:

    norm_and_project(norm, linear, x, residual)   = linear(norm(x + residual)), x + residual
    act_and_project(act, linear, x)               = linear(act(x))

Two fused implementations, chosen by the batch's row count:
  * **one row** (a batch-1 decode step; on by default): the one-row Triton
    GEMV with the norm or SiLU as its prologue (`ops/gemv.py`
    `gemv_rms_norm`, `gemv_silu_and_mul`), for weights of at most
    `FUSED_GEMV_MAX_WEIGHT_BYTES`: there the projection is a launch, not a
    weight stream, and the separate norm / SiLU launch is what the fusion
    saves. H200, 2026-12-04, one launch in a CUDA graph, weights from HBM
    (`benchmarks/benchmark_gemv.py --prologue`): SmolLM2-135M qkv 2.91 us
    fused against 4.11 for norm + GEMV, gate_up 3.80 / 4.95, down 4.26 /
    5.65; its batch-1 engine step 0.746 ms against 0.865. Above the limit it
    loses (Llama-3-8B down 44.9 / 33.3 us: hundreds of programs each redo
    the prologue over K = 14336). Taken only when the projection itself
    would take the GEMV (`linear.takes_gemv`).
  * **2..`FUSED_LINEAR_MAX_TOKENS` rows** (off: 0): the 16-row tl.dot
    kernels of `ops/norm_linear.py`. They lose on the H200 (2026-12-03, per
    launch in a CUDA graph, SmolLM2 shapes, 16 rows: qkv cuBLAS 3.72 us +
    norm 1.55 against 5.54 fused, down 5.11 + SiLU 2.18 against 42.99; one
    row through them made the SmolLM2 forward graph 4.99 ms against 0.97), so
    they stay off; `benchmark_decode_kernels.py`'s "fused" variant turns
    them on (`FUSED_LINEAR_MAX_TOKENS = MAX_ROWS`).
Both need: CUDA tensors the fused ops handle (`use_fused_ops`), 2-D, the
norm weight in the activations' dtype (no promotion), and no tensor-parallel
collective in between (a column-parallel layer that does not gather, a
row-parallel layer with tp_size 1). Otherwise the two modules run one after
the other.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import takes_gemv
from vllm.model_executor.layers.ops import use_fused_ops

FUSED_LINEAR_MAX_TOKENS = 0  # off (see above); at most ops/norm_linear.MAX_ROWS = 16
FUSED_LINEAR_MAX_WEIGHT_BYTES = 8 << 20
# One row: weights up to this take the GEMV with its prologue (SmolLM2-135M's
# largest, gate_up, is 3.4 MiB; Llama-3-8B's smallest, o_proj, 32 MiB).
FUSED_GEMV_MAX_WEIGHT_BYTES = 8 << 20


def _fusion(x: torch.Tensor, linear: nn.Module, *, row_parallel: bool) -> str | None:
    """"gemv" (one row, `ops/gemv.py`), "dot" (`ops/norm_linear.py`) or None (unfused)."""
    weight = linear.weight
    if not (
        use_fused_ops(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
        and (linear.bias is None or linear.bias.dtype == x.dtype)
        and (linear.tp_size == 1 if row_parallel else not getattr(linear, "gather_output", False))
    ):
        return None
    weight_bytes = weight.numel() * weight.element_size()
    if x.shape[0] == 1 and takes_gemv(x, weight, linear.bias):
        return "gemv" if weight_bytes <= FUSED_GEMV_MAX_WEIGHT_BYTES else None
    if x.shape[0] <= FUSED_LINEAR_MAX_TOKENS and weight_bytes <= FUSED_LINEAR_MAX_WEIGHT_BYTES:
        return "dot"
    return None


def norm_and_project(
    norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(norm(x + residual)), x + residual); without a residual (linear(norm(x)), None).

    norm: an `RMSNorm`; linear: a column-parallel linear (qkv_proj, gate_up_proj).
    x, residual: [T, hidden]. One launch for small CUDA batches (see the module
    docstring), else `norm` then `linear`.
    """
    fusion = None
    if norm.weight.dtype == x.dtype and (residual is None or residual.stride(-1) == 1):
        fusion = _fusion(x, linear, row_parallel=False)
    if fusion == "gemv":
        from vllm.model_executor.layers.ops.gemv import gemv_rms_norm

        return gemv_rms_norm(
            x, residual, norm.weight, norm.variance_epsilon, linear.weight, linear.bias
        )
    if fusion == "dot":
        from vllm.model_executor.layers.ops.norm_linear import rms_norm_linear

        return rms_norm_linear(
            x, residual, norm.weight, norm.variance_epsilon, linear.weight, linear.bias
        )
    if residual is None:
        return linear(norm(x)), None
    h, residual = norm(x, residual)
    return linear(h), residual


def act_and_project(act: nn.Module, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(act(x)) for a `SiluAndMul` act and a row-parallel linear (down_proj).

    x: [T, 2 * intermediate]. One launch for small CUDA batches without bias
    (see the module docstring), else `act` then `linear`.
    """
    fusion = _fusion(x, linear, row_parallel=True) if isinstance(act, SiluAndMul) else None
    if fusion == "gemv":
        from vllm.model_executor.layers.ops.gemv import gemv_silu_and_mul

        return gemv_silu_and_mul(x, linear.weight, linear.bias)
    if fusion == "dot" and linear.bias is None:
        from vllm.model_executor.layers.ops.norm_linear import silu_and_mul_linear

        return silu_and_mul_linear(x, linear.weight)
    return linear(act(x))

"""Norm -> projection and activation -> projection, fused for launch-bound decode batches.

A decoder layer on a small model spends its decode step launching kernels
(SmolLM2-135M: ~1 ms of graph replay for 0.06 ms of weights on an H200). Two
elementwise kernels per layer can ride along with the projection that follows
them (`ops/norm_linear.py`):

    norm_and_project(norm, linear, x, residual)   = linear(norm(x + residual)), x + residual
    act_and_project(act, linear, x)               = linear(act(x))

Both take the fused kernel only when it pays and is exact in structure:
  * CUDA tensors the fused ops handle (`use_fused_ops`), 2-D, at most
    `FUSED_LINEAR_MAX_TOKENS` rows (decode batches; prefills use cuBLAS);
  * a weight of at most `FUSED_LINEAR_MAX_WEIGHT_BYTES`: below it the GEMM
    is a launch (8 MiB streams in ~2 us at the H200's ~4 TB/s, about one
    kernel launch), above it a bandwidth-bound GEMV where cuBLAS's tuned
    kernels win (Llama-3-8B: 117 MiB down_proj);
  * no tensor-parallel collective in between: a column-parallel layer that
    does not gather, a row-parallel layer with tp_size 1;
  * the norm weight in the activations' dtype (no promotion).
Otherwise the two modules run one after the other, as before.

**Off by default** (`FUSED_LINEAR_MAX_TOKENS = 0`): it does not pay on the
H200. Engine step (2026-12-02, `benchmarks/benchmark_throughput.py`): the
SmolLM2-135M shape's batch-1 decode step took 5.65 ms with it against 1.33 ms
without. Graph replay of the forward (2026-12-03,
`benchmarks/benchmark_decode_kernels.py --shapes smollm2 llama3_8b
--batch-sizes 1 32`): SmolLM2 batch 1 4.99 ms fused (214 kernels) against
0.97 ms (304 kernels); batch 32 and the Llama-3-8B shape (above the row or
weight limit, so unfused either way) equal. Per launch inside a CUDA graph,
weights read from HBM (2026-12-03; SmolLM2 shapes, one row): qkv cuBLAS
3.70 us + norm 1.35 us against 5.02 us fused; gate_up 4.10 + 1.54 against
6.94; down 5.11 + SiLU 2.11 against 140.7. A rewrite (the K loop unrolled,
weight tiles read along K, one row unpadded), tried over 18 tile / warp
configurations, was no better except for down (best 6.26, 6.69, 8.86 us), so
it did not land: these fused kernels (16-column tl.dot tiles) are 1-3 us
slower than cuBLAS, more than the launch they save. A plain one-row GEMV with
8-column tiles and 8 warps is faster than cuBLAS (2.3-3.4 against 3.6-5.1 us,
`ops/gemv.py`); the engine uses that one for batch-1 projections
(`linear.py`), with the norm and SiLU still launched apart. Setting
`FUSED_LINEAR_MAX_TOKENS = MAX_ROWS` (16) turns it on;
`benchmark_decode_kernels.py` does for its "fused" variant.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.ops import use_fused_ops

FUSED_LINEAR_MAX_TOKENS = 0  # off (see above); at most ops/norm_linear.MAX_ROWS = 16
FUSED_LINEAR_MAX_WEIGHT_BYTES = 8 << 20


def _fuses(x: torch.Tensor, linear: nn.Module, *, row_parallel: bool) -> bool:
    weight = linear.weight
    if not (
        use_fused_ops(x)
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.shape[0] <= FUSED_LINEAR_MAX_TOKENS
        and weight.dtype == x.dtype
        and (linear.bias is None or linear.bias.dtype == x.dtype)
        and weight.numel() * weight.element_size() <= FUSED_LINEAR_MAX_WEIGHT_BYTES
    ):
        return False
    if row_parallel:
        return linear.tp_size == 1
    return not getattr(linear, "gather_output", False)


def norm_and_project(
    norm: nn.Module, linear: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(norm(x + residual)), x + residual); without a residual (linear(norm(x)), None).

    norm: an `RMSNorm`; linear: a column-parallel linear (qkv_proj, gate_up_proj).
    x, residual: [T, hidden]. One launch for small CUDA batches (see the module
    docstring), else `norm` then `linear`.
    """
    if (
        norm.weight.dtype == x.dtype
        and (residual is None or residual.stride(-1) == 1)
        and _fuses(x, linear, row_parallel=False)
    ):
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
    if isinstance(act, SiluAndMul) and linear.bias is None and _fuses(
        x, linear, row_parallel=True
    ):
        from vllm.model_executor.layers.ops.norm_linear import silu_and_mul_linear

        return silu_and_mul_linear(x, linear.weight)
    return linear(act(x))

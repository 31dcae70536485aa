"""Skinny projections (a decode batch of 1..16 rows): y = x W^T (+ b), bandwidth-bound.

A decode step of a large model reads every weight once for a handful of rows,
so a projection's time is its weight bytes over the HBM bandwidth it reaches.
cuBLAS tiles such a GEMM 64 or 128 output columns per CTA; when N / 64 is
under about two waves of the SMs (Llama-3-8B on an H200: qkv N = 6144 -> 96
CTAs for 132 SMs, o_proj 4096 -> 64, split-K 2 plus a reduce kernel) part of
the chip idles and the read runs at ~3.1 TB/s where gate_up (N = 28672)
reaches ~4.2 (`benchmarks/benchmark_gemv.py`). Here the columns are cut
finer, so a launch has enough programs to keep every SM streaming:

    grid (cdiv(N, BLOCK_N),): program j owns output columns [j*BLOCK_N, (j+1)*BLOCK_N)
      for k0 in 0, BLOCK_K, ..:   w = W[cols, k0:k0+BLOCK_K]   (rows of W read along K,
                                                              coalesced, each byte once)
        M_PAD == 1:  acc[BLOCK_N]        += sum_k w * x[k]     (no padding to a tl.dot)
        M_PAD >= 16: acc[M_PAD, BLOCK_N] += x_tile @ w^T        (rows past M are masked)
      y[:, cols] = acc (+ bias), rounded once, as cuBLAS does

Products are summed in float32 in a different order from cuBLAS', so outputs
agree with `F.linear` to a bf16/fp16 ulp or two, not bitwise.
`num_rows` and the row strides are not specialised on (every decode batch shares
one compiled variant per layer shape), so warm-up compiles all of them.

One row can also take its elementwise prologue inside the launch (a batch-1
decode step of a small model is launch-bound, so the separate kernel before
the projection costs more than the bytes it moves):

    gemv_rms_norm:      a = RMSNorm(x + residual), y = a W^T (+ b); program 0 also
                        stores x + residual (the new residual stream)
    gemv_silu_and_mul:  a = silu(x[:K]) * x[K:],   y = a W^T (+ b)

Each program recomputes `a` from the row (K elements from L2: every program
reads the same bytes) alongside its weight tiles (the first tile's load is
issued before anything else: see `dependent_launch`); the norm needs one more pass
over K for the mean square. `a` is rounded where `RMSNorm.forward_native` /
`SiluAndMul.forward_native` round (fp contraction off in these variants), so
it equals the torch path's input bit for bit except for the float32 sum order
of the mean square and Triton's `exp`; the new residual stream is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm import envs
from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_norm_inputs,
    check_same_device,
    gate_up_width,
)
from vllm.v1.attention.ops.attention_config import compute_capability, num_sms

MAX_ROWS = 16  # tl.dot's smallest M: rows 2..16 share one padded tile


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one launch: output columns and K elements per program step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_AND_MUL = 0, 1, 2


@triton.jit
def _residual_sum(x_ptr, res_ptr, offs_k, k_mask, HAS_RESIDUAL: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """x[offs_k] (+ residual[offs_k], the sum rounded to x's dtype as torch's add does)."""
    if EVEN_K:
        s = tl.load(x_ptr + offs_k)
    else:
        s = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        if EVEN_K:
            r = tl.load(res_ptr + offs_k)
        else:
            r = tl.load(res_ptr + offs_k, mask=k_mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return s


@triton.jit
def _one_row_input(x_ptr, res_ptr, norm_w_ptr, offs_k, k_mask, K, rstd,
                   PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """The matmul input a[offs_k] of the one row, in float32 (values rounded as torch rounds)."""
    dtype = x_ptr.dtype.element_ty
    if PROLOGUE == 1:  # PROLOGUE_RMS_NORM
        s = _residual_sum(x_ptr, res_ptr, offs_k, k_mask, HAS_RESIDUAL, EVEN_K)
        if EVEN_K:
            nw = tl.load(norm_w_ptr + offs_k)
        else:
            nw = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0)
        normed = (s.to(tl.float32) * rstd).to(dtype)
        a = (normed.to(tl.float32) * nw.to(tl.float32)).to(dtype)
    elif PROLOGUE == 2:  # PROLOGUE_SILU_AND_MUL: x = [gate | up], K = len(gate)
        if EVEN_K:
            gate = tl.load(x_ptr + offs_k).to(tl.float32)
            up = tl.load(x_ptr + K + offs_k).to(tl.float32)
        else:
            gate = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        # As ops/activation.py: silu in float32 (IEEE division), rounded; product rounded.
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        a = (silu * up).to(dtype)
    else:
        if EVEN_K:
            a = tl.load(x_ptr + offs_k)
        else:
            a = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
    return a.to(tl.float32)


@triton.jit(do_not_specialize=["num_rows", "stride_x", "stride_o"])
def _gemv_kernel(
    x_ptr,  # [num_rows, K] ([1, 2K] for PROLOGUE_SILU_AND_MUL), last dim contiguous
    w_ptr,  # [n_out, K], last dim contiguous
    bias_ptr,  # [n_out] (HAS_BIAS)
    out_ptr,  # [num_rows, n_out], last dim contiguous
    res_ptr,  # [1, K] (PROLOGUE_RMS_NORM and HAS_RESIDUAL)
    norm_w_ptr,  # [K] (PROLOGUE_RMS_NORM)
    res_out_ptr,  # [1, K] (PROLOGUE_RMS_NORM and HAS_RESIDUAL): x + residual
    num_rows,
    n_out,
    K,
    stride_x,
    stride_w,
    stride_o,
    eps,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,  # PROLOGUE_*: what `a` is made of (one row only)
    HAS_RESIDUAL: tl.constexpr,
    M_PAD: tl.constexpr,  # 1 (one row, no dot) or 16 (tl.dot, rows masked)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    FP32_IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (one row)
):
    tl.static_assert(PROLOGUE == 0 or M_PAD == 1, "prologues are for one row")
    tl.static_assert(not USE_PDL or M_PAD == 1, "dependent launch is for one row")
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    # Out-of-range columns read row n_out - 1 (in bounds, discarded at the store),
    # so the weight loads need no mask along N.
    w_rows = w_ptr + tl.minimum(offs_n, n_out - 1).to(tl.int64)[:, None] * stride_w
    offs_kb = tl.arange(0, BLOCK_K)
    if M_PAD == 1:
        # The first weight tile (no kernel of a forward writes weights), loaded before
        # this program reads or writes anything another kernel touches: with
        # USE_PDL the launch starts while the kernel before it still runs, and
        # waits for it to finish (gdc_wait) only after this load was issued.
        if EVEN_K:
            w = tl.load(w_rows + offs_kb[None, :])
        else:
            w = tl.load(w_rows + offs_kb[None, :], mask=(offs_kb < K)[None, :], other=0.0)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()  # the next launch may start now
        rstd = 0.0
        if PROLOGUE == 1:  # the mean square of x + residual; program 0 stores the sum
            sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + offs_kb
                k_mask = offs_k < K
                s = _residual_sum(x_ptr, res_ptr, offs_k, k_mask, HAS_RESIDUAL, EVEN_K)
                if HAS_RESIDUAL:  # noqa: SIM102 (constexpr branch, then a runtime one)
                    if pid == 0:
                        tl.store(res_out_ptr + offs_k, s, mask=k_mask)
                s32 = s.to(tl.float32)
                sum_sq += s32 * s32
            rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=0) / K + eps)
        a = _one_row_input(x_ptr, res_ptr, norm_w_ptr, offs_kb, offs_kb < K, K, rstd,
                           PROLOGUE, HAS_RESIDUAL, EVEN_K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + offs_kb
            k_mask = offs_k < K
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :])
            else:
                w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            a = _one_row_input(x_ptr, res_ptr, norm_w_ptr, offs_k, k_mask, K, rstd,
                               PROLOGUE, HAS_RESIDUAL, EVEN_K)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(dtype), mask=n_mask)
    else:
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < num_rows
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_kb
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :])
            else:
                k_mask = offs_k < K
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                            other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            if FP32_IEEE:
                acc = tl.dot(x, tl.trans(w), acc=acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc=acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :],
            acc.to(dtype),
            mask=m_mask[:, None] & n_mask[None, :],
        )


# One-row launches of weights up to this take programmatic dependent launch. On an
# H100 (2026-12-06, benchmark_throughput.py batch 1, same machine, on / off):
# SmolLM2-135M shape (weights <= 3.4 MiB) decode step 0.634 / 0.713 ms; Llama-3-8B
# shape (32-112 MiB) 5.745 / 5.633 ms, slower: there a launch is bandwidth-bound
# and the next one's early weight loads compete with its last wave.
PDL_MAX_WEIGHT_BYTES = 8 << 20


def dependent_launch(device: torch.device, weight_bytes: int = 0) -> bool:
    """Whether a one-row launch on `device` over `weight_bytes` of weights uses
    programmatic dependent launch (PDL).

    With PDL (compute capability 9.0+, CUDA 12.3+ inside graphs) a launch may start
    while the kernel before it on the stream still runs: each program issues its
    first weight tile's load, waits for that kernel to complete (griddepcontrol.wait),
    then lets the next launch start. A batch-1 decode step of a small model is a
    chain of ~3 us launches, so the weight fetch and the launch latency overlap
    the previous kernel's tail instead of following it (the weight-prefetch
    pattern of CUTLASS example 63; NVIDIA CUDA Programming Guide, "Programmatic
    Dependent Launch and Synchronization"). Weights over PDL_MAX_WEIGHT_BYTES, and
    ROCm devices, launch plainly. The weights must not be written by the kernel
    launched just before (nothing in a forward writes weights).

    `VLLM_GEMV_PDL` (vllm/envs.py): 1/true/on (default) or 0/false/off; any other
    value is a ValueError.
    """
    if device.type != "cuda" or torch.version.cuda is None or weight_bytes > PDL_MAX_WEIGHT_BYTES:
        return False  # ROCm's torch says "cuda" too; its Triton has no griddepcontrol
    return envs.VLLM_GEMV_PDL and compute_capability(device) >= (9, 0)


def default_config(num_rows: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """The tile `gemv` uses when none is given.

    One row: 8 output columns per program, K in steps of 1024 (the whole row
    when shorter), 8 warps. In the H200 sweep of `benchmarks/benchmark_gemv.py`
    (2026-12-03, docs/benchmarks.md) that was the best tile for Llama-3-8B's
    o_proj and down and for all four SmolLM2-135M projections; qkv's and
    gate_up's best were other tiles (8 x 2048 with 4 warps: 15.41 us; 16 x 512:
    56.74 us), not timed against this one in that run. The engine A/B (8B
    batch-1 step 4.43 ms against 4.67 with cuBLAS) ran with this default.
    More rows (tl.dot; cuBLAS is faster there, so the engine does not use
    them): BLOCK_N 32 (16 when that gives fewer than
    2 * sm_count programs), BLOCK_K 512, the sweep's best for 8 and 16 rows.
    """
    if num_rows == 1:
        return GemvConfig(block_n=8, block_k=min(1024, triton.next_power_of_2(k)), num_warps=8)
    block_n = 32 if triton.cdiv(n, 32) >= 2 * sm_count else 16
    return GemvConfig(block_n=block_n, block_k=min(512, max(16, triton.next_power_of_2(k))),
                      num_warps=4, num_stages=3)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias for a few rows, as one Triton launch.

    Args:
        x: [M, K] float16/bfloat16/float32, 1 <= M <= MAX_ROWS, last dim contiguous.
        weight: [N, K], x's dtype, last dim contiguous.
        bias: None or [N], x's dtype.
        config: tile override (benchmarks); None picks `default_config`.

    Returns:
        y [M, N] contiguous, x's dtype.

    Raises:
        ValueError: dtypes, shapes, strides, devices, or M outside 1..MAX_ROWS.
    """
    op = "gemv"
    k = _check_x_weight(op, x, weight, x.shape[1] if x.dim() == 2 else -1)
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"{op}: takes 1..{MAX_ROWS} rows, got {x.shape[0]}")
    return _launch(op, x, weight, bias, config, k, PROLOGUE_NONE)[0]


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual) @ weight^T + bias, x + residual) for one row, one launch.

    The norm is `RMSNorm.forward_native`'s (statistics in float32, rounded to
    x's dtype before the weight multiply, Zhang & Sennrich 2019).

    Args:
        x: [1, K] float16/bfloat16/float32, last dim contiguous.
        residual: None or like x (dtype and shape), last dim contiguous.
        norm_weight: [K], x's dtype. eps: added to the mean square.
        weight: [N, K], x's dtype, last dim contiguous. bias: None or [N], x's dtype.
        config: tile override (benchmarks); None picks `default_config`.

    Returns:
        (y [1, N] contiguous, the new residual stream x + residual [1, K]
        contiguous, or None without a residual). Inputs are not modified.

    Raises:
        ValueError: dtypes, shapes, strides, devices, or more than one row.
    """
    op = "gemv_rms_norm"
    k = _check_x_weight(op, x, weight, x.shape[1] if x.dim() == 2 else -1)
    _check_one_row(op, x)
    check_norm_inputs(op, x, residual, norm_weight, k)
    return _launch(op, x, weight, bias, config, k, PROLOGUE_RMS_NORM, residual=residual,
                   norm_weight=norm_weight, eps=eps)


def gemv_silu_and_mul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """(silu(x[:, :K]) * x[:, K:]) @ weight^T + bias for one row, one launch.

    The activation is `SiluAndMul.forward_native`'s (silu rounded to x's dtype,
    then the product rounded), as `ops/activation.py` computes it.

    Args:
        x: [1, 2K] float16/bfloat16/float32 (gate | up), last dim contiguous.
        weight: [N, K], x's dtype, last dim contiguous. bias: None or [N], x's dtype.
        config: tile override (benchmarks); None picks `default_config`.

    Returns:
        y [1, N] contiguous, x's dtype.

    Raises:
        ValueError: dtypes, shapes, strides, devices, an odd last dim, or more
            than one row.
    """
    op = "gemv_silu_and_mul"
    k = _check_x_weight(op, x, weight, gate_up_width(op, x))
    _check_one_row(op, x)
    return _launch(op, x, weight, bias, config, k, PROLOGUE_SILU_AND_MUL)[0]


def _check_x_weight(op: str, x: torch.Tensor, weight: torch.Tensor, k: int) -> int:
    """Validate x [M, *] and weight [N, k] (k > 0, x's dtype); returns k."""
    check_dtype(op, "x", x)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k or k <= 0:
        raise ValueError(
            f"{op}: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight must be {x.dtype}, got {weight.dtype}")
    return k


def _check_one_row(op: str, x: torch.Tensor) -> None:
    if x.shape[0] != 1:
        raise ValueError(f"{op}: takes one row, got {x.shape[0]}")


def _check_launch(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
) -> None:
    """Check bias ([N], x's dtype), last-dim strides and one device over every tensor.

    Raises:
        ValueError: naming `op` and the tensor at fault.
    """
    n = weight.shape[0]
    tensors = dict(x=x, weight=weight)
    if residual is not None:
        tensors["residual"] = residual
    if norm_weight is not None:
        tensors["norm_weight"] = norm_weight
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"{op}: bias must be [{n}] {x.dtype}, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        tensors["bias"] = bias
    check_last_dim_contiguous(op, **tensors)
    check_same_device(op, **tensors)


def _launch(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None,
    k: int,
    prologue: int,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Check the inputs (`_check_launch`), allocate the outputs and launch `_gemv_kernel`."""
    _check_launch(op, x, weight, bias, residual, norm_weight)
    num_rows, n = x.shape[0], weight.shape[0]
    if config is None:
        config = default_config(num_rows, n, k, num_sms(x.device))
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty(1, k, dtype=x.dtype, device=x.device)
    pdl = num_rows == 1 and dependent_launch(x.device, weight.numel() * weight.element_size())
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        x if residual is None else residual,
        x if norm_weight is None else norm_weight,
        out if res_out is None else res_out,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        M_PAD=1 if num_rows == 1 else MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        FP32_IEEE=x.dtype == torch.float32,
        USE_PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # The prologues round each product where torch does: no fused multiply-adds.
        enable_fp_fusion=prologue == PROLOGUE_NONE,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out, res_out

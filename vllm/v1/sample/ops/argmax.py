"""Greedy sampling: the argmax of each row of [N, V] logits, read in their own dtype.

`torch.argmax` over a decode step's logits is a single reduction kernel that
gives a row to few CTAs: on the H200 (2026-12-04,
`benchmarks/benchmark_decode_primitives.py --sections argmax`, in a CUDA graph)
[1, 49152] took 11.8 us and [32, 128256] 27.1 us for 0.1-8 MB, and the
sampler's float32 conversion before it another 2.7-9.4 us. Here each row is cut
into chunks of `BLOCK` logits read by separate programs, so a launch has a
program per few KiB:

    stage 1, grid (N, cdiv(V, BLOCK)):  key[row, chunk] = max over the chunk of
                                        (order(logit) << 32) | (2^31 - 1 - col)
    stage 2, grid (N,):                 out[row] = 2^31 - 1 - (max_chunk key & 0xffffffff)

`order` maps a float's bits to an int32 with the same order (negative floats:
the 31 low bits flipped), so the largest key is the largest logit and, among
equal logits, the smallest column: the same answer as `torch.argmax` on the
float32 logits, including its rules that NaN is larger than everything (the
first NaN wins) and that -0.0 equals +0.0. Casting bf16 / fp16 to float32 is
exact and keeps order, which is why the sampler may skip its float32 copy when
it only takes the argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from vllm.model_executor.layers.ops.launch import CompiledLaunches

BLOCK = 2048  # logits per stage-1 program: 4 KiB of bf16; 63 programs a row at V = 128256
_MAX_COLS = 2**31 - 1  # the column fits the key's low 31 bits
_NO_KEY = tl.constexpr(-(2**63) + 1)  # below every logit's key


@triton.jit
def _argmax_chunks_kernel(
    logits_ptr,  # [N, V] float32 / bf16 / fp16, last dim contiguous
    keys_ptr,  # [N, num_chunks] int64
    stride_row,
    vocab_size,
    num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < vocab_size
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=in_row, other=0.0)
    x = x.to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = tl.where(x == 0.0, 0, order)  # -0.0 == +0.0
    order = tl.where(x != x, 0x7FFFFFFF, order)  # NaN above +inf, as torch.argmax
    key = (order.to(tl.int64) << 32) | (cols ^ 0x7FFFFFFF).to(tl.int64)  # 2^31 - 1 - col
    key = tl.where(in_row, key, _NO_KEY)
    tl.store(keys_ptr + row * num_chunks + chunk, tl.max(key, axis=0))


@triton.jit
def _argmax_rows_kernel(keys_ptr, out_ptr, num_chunks, BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_CHUNKS)
    keys = tl.load(keys_ptr + row * num_chunks + offs, mask=offs < num_chunks,
                   other=_NO_KEY)
    best = tl.max(keys, axis=0)
    tl.store(out_ptr + row, (best & 0xFFFFFFFF) ^ 0x7FFFFFFF)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N] int64: the column of each row's largest logit (the first one on ties).

    Equals `logits.float().argmax(dim=-1)`, reading `logits` once in its own
    dtype with the two launches above. The sampler calls it for CUDA logits
    (`sampler.argmax_rows`); elsewhere `torch.argmax` gives the same answer.

    Args:
        logits: [N, V] float32 / bfloat16 / float16, N >= 1, 1 <= V < 2^31,
            last dim contiguous, on CUDA (or CPU under TRITON_INTERPRET=1).

    Raises:
        ValueError: any of the above not met.
    """
    check_same_device("greedy_argmax", logits=logits)
    check_dtype("greedy_argmax", "logits", logits)
    check_last_dim_contiguous("greedy_argmax", logits=logits)
    if logits.dim() != 2 or logits.shape[0] < 1 or not 0 < logits.shape[1] <= _MAX_COLS:
        raise ValueError(f"greedy_argmax takes [N, V] logits with N >= 1 and 1 <= V < 2^31, "
                         f"got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    stride, device = logits.stride(0), logits.device
    num_chunks = triton.cdiv(vocab, BLOCK)
    keys = torch.empty(rows, num_chunks, dtype=torch.int64, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    # What Triton specialises on: the logits' dtype and alignment, the stride and
    # the vocabulary size (num_chunks follows from it); keys and out are fresh
    # allocations, always aligned. The row count is only the grid.
    key = (device, logits.dtype, stride, vocab, logits.data_ptr() % 16 == 0)
    _CHUNKS((*key, "chunks"), (rows, num_chunks),
            (logits, keys, stride, vocab, num_chunks, BLOCK), device, num_warps=4)
    _ROWS((device, num_chunks), (rows,),
          (keys, out, num_chunks, triton.next_power_of_2(num_chunks)), device, num_warps=1)
    return out


# The two kernels' compiled variants: an eager decode step calls greedy_argmax
# once, and Triton's JIT dispatch would cost more host time than both kernels'
# device time (~27 us a launch on the H200's host; see ops/launch.py).
_CHUNKS = CompiledLaunches(_argmax_chunks_kernel)
_ROWS = CompiledLaunches(_argmax_rows_kernel)

"""Tensor-parallel linear layers: y = x W^T (+ b).

Column-parallel layers split the output features over the TP ranks, row-
parallel layers split the input features and sum the partial products:

    x [T, in] --ColumnParallel--> y_r [T, out / tp] --RowParallel--> sum_r (y_r W_r^T) [T, out']

so an MLP or attention block needs one all-reduce, after its row-parallel
output projection. Weights are created empty on the current default device
and dtype (`get_model` sets both) and filled by their `weight_loader`, which
receives the full HF tensor and copies this rank's shard, so tensor
parallelism needs no change to checkpoints or to the models' `load_weights`.

`forward` returns the output tensor only (vLLM's layers return an
`(output, bias)` pair; nothing here defers the bias, so the pair would only
add noise).

Every projection goes through `linear_forward`: cuBLAS (`F.linear`), except a
single row on CUDA (a batch-1 decode step), which takes the Triton GEMV of
`ops/gemv.py`. cuBLAS tiles one row 64-128 output columns per CTA and leaves
SMs idle where N is small: on the H200 (2026-12-03, `benchmarks/benchmark_gemv.py`,
one launch in a CUDA graph, weight from HBM) Llama-3-8B's qkv took 17.1 us with
cuBLAS and 15.4 with the GEMV, o_proj 12.8 / 10.9, down 32.5 / 30.8, and
SmolLM2-135M's four projections 3.6-5.1 us / 2.3-3.4. From two rows on the
GEMV's tl.dot tiles lose to cuBLAS (8 rows: qkv 16.6 vs 23.6 us), so
`GEMV_MAX_ROWS` is 1 (0 turns it off).

From 32 to 64 rows (a decode batch of that size) the NVIDIA build asks torch
for cuBLASLt instead of cuBLAS: their heuristics pick different kernels there.
On the H200 (2026-12-04, `benchmark_decode_primitives.py --sections blas_rows`,
one launch in a CUDA graph, weights from HBM, cuBLAS / cuBLASLt) Llama-3-8B's
o_proj took 13.26 / 11.92 us at 32 rows and 13.84 / 12.02 at 48, down 34.15 /
32.06 and 35.15 / 32.54, gate_up 64.07 / 61.71 at 64, qkv 17.98 / 16.98 at 32;
below 32 rows and from 128 on cuBLASLt's down is slower (8 rows 32.72 / 35.89,
128 rows 38.73 / 39.94), and SmolLM2's projections and both lm_heads take the
same time either way (within 1 %). `CUBLASLT_ROWS` holds that range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.ops import use_fused_ops
from vllm.model_executor.layers.tensor_parallel import (
    all_gather,
    all_reduce,
    check_tp,
    divide,
    partition_attention_heads,
)
from vllm.model_executor.layers.weight_utils import (
    check_rows,
    check_shape,
    default_weight_loader,
    narrow_to_rank,
)

GEMV_MAX_ROWS = 1  # rows up to which CUDA projections take ops/gemv.py (0: always cuBLAS)
CUBLASLT_ROWS = range(32, 65)  # row counts whose NVIDIA projections ask for cuBLASLt


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight^T (+ bias): x [T, in] (or [..., in]), weight [out, in] -> [T, out].

    The Triton GEMV for 2-D CUDA inputs of at most `GEMV_MAX_ROWS` rows in the
    weight's dtype with a contiguous last dim; `F.linear` otherwise.
    """
    if takes_gemv(x, weight, bias):
        from vllm.model_executor.layers.ops.gemv import gemv

        return gemv(x, weight, bias)
    if takes_cublaslt(x):
        return linear_cublaslt(x, weight, bias)
    return F.linear(x, weight, bias)


def takes_cublaslt(x: torch.Tensor) -> bool:
    """Whether `linear_forward` asks for cuBLASLt: x's row count in `CUBLASLT_ROWS`, NVIDIA CUDA."""
    return (
        x.is_cuda
        and torch.version.cuda is not None
        and x.numel() // max(x.shape[-1], 1) in CUBLASLT_ROWS
    )


def linear_cublaslt(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """F.linear with torch's preferred BLAS set to cuBLASLt for this call, then restored.

    The preference is process-wide torch state read at each GEMM call (and at
    a CUDA graph's capture), so setting it around the call scopes it to this
    projection.
    """
    blas = torch.backends.cuda
    previous = blas.preferred_blas_library()
    blas.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight, bias)
    finally:
        blas.preferred_blas_library(previous)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear_forward(x, weight, bias)` launches the Triton GEMV (else cuBLAS)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_ROWS
        and x.stride(-1) == 1
        and x.dtype == weight.dtype
        and (bias is None or bias.dtype == x.dtype)
        and use_fused_ops(x)
    )


def _check_not_stacked(layer: nn.Module, shard_id: object) -> None:
    """A layer loaded from one whole checkpoint tensor refuses a shard id (ValueError)."""
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} is not stacked; got shard id {shard_id!r}")


def _copy_shard(target: torch.Tensor, shard: torch.Tensor, what: str = "") -> None:
    """Copy a checkpoint `shard` into `target` (a parameter or a slice of one) after
    checking the shapes agree (ValueError naming both, and `what`)."""
    check_shape(target, shard, what)
    with torch.no_grad():
        target.copy_(shard)


class LinearBase(nn.Module):
    """Holds `weight` [output_size_per_partition, input_size_per_partition] and optional `bias`."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_size_per_partition: int,
        *,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_tp(tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(
                torch.empty(output_size_per_partition, dtype=params_dtype), requires_grad=False
            )
            if bias
            else None
        )

    def extra_repr(self) -> str:
        return (
            f"in_per_partition={self.input_size_per_partition}, "
            f"out_per_partition={self.output_size_per_partition}, bias={self.bias is not None}, "
            f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ColumnParallelLinear(LinearBase):
    """Output features split over ranks: rank r holds rows [r*out/tp, (r+1)*out/tp) of W.

    Args:
        input_size: in features.
        output_size: out features over all ranks (divisible by tp_size).
        bias: add a bias (split like the output).
        gather_output: all-gather the output so every rank gets [T, output_size].

    Shapes: x [T, input_size] -> [T, output_size / tp_size] (or [T, output_size]).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size,
            divide(output_size, tp_size, "output_size"),
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=params_dtype,
        )
        self.gather_output = gather_output
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of the full weight (or bias) `loaded_weight`."""
        _check_not_stacked(self, shard_id)
        _copy_shard(param, narrow_to_rank(loaded_weight, 0, param.shape[0], self.tp_rank,
                                          self.tp_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_forward(x, self.weight, self.bias)
        return all_gather(y, self.tp_size, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_up_proj).

    Args:
        output_sizes: out features of each stacked projection, in stacking order;
            checkpoint tensor `i` is loaded with `shard_id=i`.

    Each rank stacks its own slice of every projection:
    weight rows = [proj0 rows of rank r | proj1 rows of rank r | ...].
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        gather_output: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        for i, size in enumerate(output_sizes):
            divide(size, tp_size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            gather_output=gather_output,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=params_dtype,
        )
        for param in self.parameters(recurse=False):
            param.shard_ids = tuple(range(len(output_sizes)))

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's rows of projection `shard_id` (an int index into output_sizes)."""
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        sizes = [size // self.tp_size for size in self.output_sizes]
        target = param.narrow(0, sum(sizes[:shard_id]), sizes[shard_id])
        shard = narrow_to_rank(loaded_weight, 0, sizes[shard_id], self.tp_rank, self.tp_size)
        _copy_shard(target, shard, f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections of attention in one matmul, split by heads.

    Args:
        hidden_size: in features.
        head_size: features per head.
        total_num_heads: query heads over all ranks.
        total_num_kv_heads: key/value heads over all ranks (None = total_num_heads).

    Which heads this rank holds is `partition_attention_heads` (even where the
    TP size divides the KV heads, by whole KV groups where it does not, KV
    heads replicated when there are fewer than ranks): `num_heads`,
    `num_kv_heads`, and `head_shard` for the row-parallel output projection.

    Output per rank: [T, (num_heads + 2 * num_kv_heads) * head_size], laid out
    q | k | v. Checkpoint tensors q_proj/k_proj/v_proj load with shard ids
    "q"/"k"/"v".
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        *,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.head_shard = partition_attention_heads(
            total_num_heads, total_num_kv_heads, tp_size, tp_rank
        )
        self.num_heads = self.head_shard.num_heads
        self.num_kv_heads = self.head_shard.num_kv_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        LinearBase.__init__(
            self,
            hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=params_dtype,
        )
        self.gather_output = False
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
            param.shard_ids = ("q", "k", "v")

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's heads of q_proj ("q"), k_proj ("k") or v_proj ("v")."""
        shard, d = self.head_shard, self.head_size
        if shard_id == "q":
            offset, size, start, total = 0, self.q_size, shard.q_start, self.total_num_heads
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, start, total = self.kv_size, shard.kv_start, self.total_num_kv_heads
        else:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        target = param.narrow(0, offset, size)
        check_rows(loaded_weight, 0, total * d, f"shard {shard_id!r}")
        _copy_shard(target, loaded_weight.narrow(0, start * d, size), f"shard {shard_id!r}")


class RowParallelLinear(LinearBase):
    """Input features split over ranks; the partial outputs are summed (all-reduce).

    Args:
        input_size: in features over all ranks (divisible by tp_size).
        output_size: out features.
        bias: add a bias once, after the reduction.
        reduce_results: all-reduce the output (tp_size > 1); turn off only when
            the caller reduces itself.
        input_shard: (start, size) of this rank's input features, for a split
            that is not even (attention heads: `QKVParallelLinear.head_shard`);
            None = the even split, input_size / tp_size each.

    Shapes: x [T, input_size / tp_size] (or [T, input_shard size]) -> [T, output_size].
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        reduce_results: bool = True,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        if input_shard is None:
            size = divide(input_size, tp_size, "input_size")
            input_shard = (tp_rank * size, size)
        start, size = input_shard
        if start < 0 or size < 1 or start + size > input_size:
            raise ValueError(f"input_shard {input_shard} is outside input_size {input_size}")
        self.input_size = input_size
        self.input_start = start
        super().__init__(
            size,
            output_size,
            bias=bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=params_dtype,
        )
        self.reduce_results = reduce_results
        self.weight.weight_loader = self.weight_loader
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's input columns of the full weight `loaded_weight`."""
        _check_not_stacked(self, shard_id)
        check_rows(loaded_weight, 1, self.input_size)
        _copy_shard(param, loaded_weight.narrow(1, self.input_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear_forward(x, self.weight, self.bias)
        y = linear_forward(x, self.weight)
        if self.reduce_results:
            y = all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias
